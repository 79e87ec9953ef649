"""What the family table (tests/models/test_families.py) does not reach of the Pixtral adapter: the tower's own
call forms (``image_sizes`` omitted or a list; sizes that are not whole patches, padding that is not either; the
whole call against the tower's one packed sequence), a chosen ``hidden_states``, and the rotary table of
transformers 5.15, which bounds an image's side.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import encgraph  # noqa: E402
from encgraph.capture.records import RunMode  # noqa: E402
from encgraph.errors import InputError  # noqa: E402
from encgraph.models import wrap  # noqa: E402
from tests.models.fixtures_families import FAMILIES, rel_err  # noqa: E402

FAMILY = FAMILIES["pixtral"]
BUDGETS = [8, 16, 32]


def graphed_pair(**options):
    tower = FAMILY.tower()
    reference = copy.deepcopy(tower)
    return encgraph.graphed(tower, budgets=BUDGETS, max_items=3, mode=RunMode.STATIC, **options), reference


def assert_close(got, want):
    assert type(got) is type(want)
    assert rel_err(got.last_hidden_state, want.last_hidden_state) < 1e-5
    assert (got.hidden_states is None) == (want.hidden_states is None)
    for a, b in zip(got.hidden_states or (), want.hidden_states or ()):
        assert (a is None) == (b is None) and (b is None or rel_err(a, b) < 1e-5)


def test_the_whole_call_equals_the_towers_packed_sequence():
    """Sizes in pixels that are not whole patches (the tower floors them), padding that is not whole patches
    either, more images than a batch holds and one over the largest budget; ``image_sizes`` as a tensor and as
    a list of pairs."""
    fast, reference = graphed_pair()
    sizes = [[9, 13], [4, 4], [15, 17], [15, 3], [2, 16], [11, 11], [7, 2]]
    pixels = torch.randn(len(sizes), 3, 15, 17)
    with torch.no_grad():
        want = reference(pixels, image_sizes=torch.tensor(sizes))
        assert_close(fast(pixels, image_sizes=torch.tensor(sizes)), want)
        assert_close(fast(pixels, sizes), want)
    stats = encgraph.graphs(fast).stats
    assert stats["graph_items"] > 0 and stats["eager_items"] > 0  # 15 x 17 px: 7 x 8 patches, over 32 rows


def test_without_image_sizes_every_image_is_whole():
    fast, reference = graphed_pair()
    pixels = torch.randn(3, 3, 8, 6)
    with torch.no_grad():
        assert_close(fast(pixels), reference(pixels))
        got, want = fast(pixels, return_dict=False), reference(pixels, return_dict=False)
    assert isinstance(got, tuple) and len(got) == len(want) and rel_err(got[0], want[0]) < 1e-5


def test_chosen_hidden_states():
    """``hidden_states=[1]``: a call asking for index 1 and the last (``last_hidden_state`` itself) replays; one
    asking for every entry gets ``None`` where none was captured, as the fixed-resolution adapters do."""
    fast, reference = graphed_pair(adapter_options={"hidden_states": [1]})
    assert encgraph.graphs(fast).adapter.output_names == ("last_hidden_state", "hidden_states.1")
    pixels, sizes = torch.randn(2, 3, 8, 8), torch.tensor([[8, 8], [4, 6]])
    asked = [1, -1] if _selects_indices() else True
    with torch.no_grad():
        got = fast(pixels, image_sizes=sizes, output_hidden_states=asked)
        want = reference(pixels, image_sizes=sizes, output_hidden_states=asked)
        every = fast(pixels, image_sizes=sizes, output_hidden_states=True)
    if _selects_indices():
        assert_close(got, want)
    assert every.hidden_states[0] is None and every.hidden_states[1] is not None
    assert not encgraph.graphs(fast).stats["eager_reasons"]


def _selects_indices() -> bool:
    from encgraph.models.hidden_choice import _selects_full_indices

    return _selects_full_indices()


def test_bad_image_sizes():
    fast, _ = graphed_pair()
    pixels = torch.randn(2, 3, 8, 8)
    for sizes in ([[8, 8]], [[8, 8], [1, 8]], torch.tensor([[8.0, 8.0], [4.0, 4.0]]), "8x8"):
        with pytest.raises(InputError, match="image_sizes"):
            fast(pixels, image_sizes=sizes)


def test_the_rotary_table_of_5_15_bounds_the_side():
    """transformers 5.15's tower indexes a table of ``(image_size / patch)^2`` rotary positions by ``row * side +
    col``: a larger image would read past it (or another position), so the adapter refuses it; 5.2x's axial
    rotary has no bound."""
    adapter = wrap(FAMILY.tower())
    side = FAMILY.tower().config.image_size
    big = torch.randn(1, 3, side + 4, side)
    if adapter.max_side is None:
        assert adapter.item_specs(adapter.inputs(big))[0].tokens["default"] == (side + 4) * side // 4
    else:
        with pytest.raises(InputError, match="rotary table"):
            adapter.inputs(big)
    assert np.array_equal(adapter.metadata(np.array([[1, 2, 3]]))["cu_seqlens"], [0, 6])
    bound = adapter.max_side or side  # the capture's samples stay inside the table
    for tokens in (5, 3 * bound**2 + 7, 2 * bound**2):
        sample = adapter.sample_inputs("default", tokens)
        used = sum(s.tokens["default"] for s in adapter.item_specs(sample))
        assert tokens - np.sqrt(tokens) <= used <= tokens
        assert adapter.max_side is None or sample.grid[:, 1:].max() <= adapter.max_side
