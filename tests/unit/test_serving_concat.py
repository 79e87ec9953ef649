"""``adapter.concat(parts)`` on every adapter, through the batching front: requests coalesced into one runner
call get, per item, what the tower's own forward gives for that request alone (Qwen2.5-VL and Qwen3-VL towers,
SigLIP, DeepSeek-OCR2's two paths, the generic adapter), and ``output_for_call`` per request for a graphed
module. CPU, tiny random towers, the runner's STATIC mode.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from encgraph.capture.records import RunMode
import encgraph
from encgraph.errors import InputError, InputTypeError
from encgraph.models.registry import wrap
from encgraph.serving import BatchingFront
from tests.models.conftest import CHANNELS, qwen2_5_vl_tower, qwen3_vl_tower, random_grid
from tests.models.fixtures_fixed import tiny_siglip

WAIT_MS = 5_000.0
TOL = 1e-5
TIMEOUT = 60


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


@pytest.mark.parametrize("make", [qwen2_5_vl_tower, qwen3_vl_tower], ids=["qwen2_5_vl", "qwen3_vl"])
def test_qwen_requests_coalesce_per_item_equal_to_the_tower(make):
    torch.manual_seed(0)
    tower = make()
    gen = np.random.default_rng(1)
    requests = []
    for n in (2, 1, 3):
        grid = random_grid(gen, n, max_side=8, max_t=2)
        requests.append((torch.randn(int(grid.prod(1).sum()), CHANNELS), torch.from_numpy(grid)))
    with torch.no_grad():
        refs = [tower(pv, grid_thw=g).pooler_output for pv, g in requests]
    adapter = wrap(make_copy(tower, make))
    runner = encgraph.EncoderGraphRunner(adapter, budgets=[16, 32, 64, 128], mode=RunMode.STATIC)
    with BatchingFront(runner, max_wait_ms=WAIT_MS, max_requests=3) as front:
        futures = [front.submit(adapter.inputs(pv, g)) for pv, g in requests]
        results = [f.result(TIMEOUT) for f in futures]
        stats = front.stats
    assert stats["requests_per_call"] == {3: 1}
    for (pv, g), ref, items in zip(requests, refs, results):
        assert len(items) == g.shape[0]
        got = torch.cat([r["pooler_output"] for r in items])
        assert got.shape == ref.shape and rel(got, ref) < TOL


def make_copy(tower: torch.nn.Module, make) -> torch.nn.Module:
    """A second tower with the same weights (wrapping rewrites the layout of the one it wraps)."""
    torch.manual_seed(0)
    twin = make()
    twin.load_state_dict(tower.state_dict())
    return twin.eval()


def test_qwen_concat_keeps_order_and_checks_parts():
    adapter = wrap(qwen2_5_vl_tower())
    a = adapter.inputs(torch.randn(16, CHANNELS), torch.tensor([[1, 4, 4]]))
    b = adapter.inputs(torch.randn(24, CHANNELS), torch.tensor([[1, 2, 4], [1, 4, 4]]))
    joined = adapter.concat([a, b])
    assert joined.grid.tolist() == [[1, 4, 4], [1, 2, 4], [1, 4, 4]]
    assert torch.equal(joined.pixel_values, torch.cat([a.pixel_values, b.pixel_values]))
    assert adapter.concat([a]) is a
    with pytest.raises(InputError, match="non-empty"):
        adapter.concat([])
    with pytest.raises(InputTypeError, match=r"parts\[1\]"):
        adapter.concat([a, "b"])


def test_siglip_graphed_module_gets_its_own_output_per_request():
    tower = tiny_siglip()
    torch.manual_seed(0)
    twin = tiny_siglip()
    fast = encgraph.graphed(twin, budgets=[1, 2, 4, 8], mode=RunMode.STATIC)
    batches = [torch.randn(n, 3, 32, 32) for n in (1, 3, 2)]
    with torch.no_grad():
        refs = [tower(pixel_values=b) for b in batches]
    with BatchingFront(fast, max_wait_ms=WAIT_MS, max_requests=3) as front:
        futures = [front.submit(pixel_values=batches[0]), front.submit(batches[1], return_dict=False),
                   front.submit(pixel_values=batches[2])]
        outs = [f.result(TIMEOUT) for f in futures]
        stats = front.stats
    assert stats["requests_per_call"] == {3: 1}
    assert isinstance(outs[1], tuple)  # each request's own return_dict
    for out, ref in zip((outs[0], outs[2]), (refs[0], refs[2])):
        assert type(out) is type(ref)
        for field in ("last_hidden_state", "pooler_output"):
            assert rel(getattr(out, field), getattr(ref, field)) < TOL
    assert rel(outs[1][0], refs[1].last_hidden_state) < TOL and rel(outs[1][1], refs[1].pooler_output) < TOL


def test_generic_concat_joins_every_positional_tensor():
    from encgraph.models.generic import GenericModuleAdapter

    net = torch.nn.Bilinear(3, 4, 2)
    a = (torch.randn(2, 3), torch.randn(2, 4))
    b = (torch.randn(1, 3), torch.randn(1, 4))
    adapter = GenericModuleAdapter.of_call(net, *a)
    joined = adapter.concat([adapter.inputs_from_call(*a), adapter.inputs_from_call(*b)])
    assert joined.batch == 3 and [t.shape[0] for t in joined.tensors] == [3, 3]
    assert torch.equal(joined.tensors[1][2:], b[1])


def test_deepseek_two_paths_coalesce_per_image_equal_to_the_model():
    from tests.models.test_deepseek_ocr2 import images, make_adapter
    from transformers import DeepseekOcr2ForConditionalGeneration

    from tests.models.test_deepseek_ocr2 import deepseek_config

    torch.manual_seed(0)
    model = DeepseekOcr2ForConditionalGeneration(deepseek_config()).eval()
    with torch.no_grad():
        model.model.view_separator.normal_()
    requests = [images([1, 0], seed=1), images([0], seed=2), images([2], seed=3)]
    with torch.no_grad():
        refs = [model.model.get_image_features(pv, local, torch.tensor(t)).pooler_output for pv, local, t in requests]
    adapter = make_adapter(model)
    runner = encgraph.EncoderGraphRunner(adapter, mode=RunMode.STATIC)
    with BatchingFront(runner, max_wait_ms=WAIT_MS, max_requests=3) as front:
        futures = [front.submit(adapter.inputs_from_call(pv, local, t)) for pv, local, t in requests]
        results = [f.result(TIMEOUT) for f in futures]
    for ref, got in zip(refs, results):
        assert len(got) == len(ref)
        for g, r in zip(got, ref):
            assert g.shape == r.shape and rel(g, r) < TOL
