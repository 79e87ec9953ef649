"""The any-module path of ``graphed()`` (CPU, STATIC mode: the padded plan a GPU would replay): call shapes learned
from the module's own answers, their graphs built on a shape's second call, batch-first verified, bounded."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import encgraph
from encgraph.capture.compiling import Sizes
from encgraph.capture.records import RunMode
from encgraph.errors import ConfigTypeError, EncgraphError
from encgraph.models.batch_ladder import take_rows
from encgraph.models.call_spec import describe_key, rebuild, split_call
from encgraph.models.generic import GenericModuleAdapter, OutputSpec
from encgraph.models.graphed_forward import FIRST_SIGHT
from tests.models.fixtures_fixed import LADDER, assert_items_close


class TwoHeads(torch.nn.Module):
    """Returns a tuple, or a dict, of two batch-first tensors of different trailing shapes."""

    def __init__(self, as_dict: bool = False) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 6).requires_grad_(False)
        self.as_dict = as_dict

    def forward(self, x: torch.Tensor, scale: torch.Tensor, *, tanh: bool = True) -> tuple | dict:
        h = self.lin(x)
        h = (torch.tanh(h) if tanh else h) * scale[:, None, None]
        pooled = h.mean(1)
        return {"tokens": h, "pooled": pooled, "none": None} if self.as_dict else (h, pooled)


def sequential() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()


def inputs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, 8, generator=gen), torch.rand(n, generator=gen) + 0.5


def own(module: torch.nn.Module):
    return encgraph.graphs(module).original_forward


@torch.no_grad()
def test_sequential_any_batch_size_replays_from_the_second_call():
    net = sequential()
    fast = encgraph.graphed(net, mode=RunMode.STATIC, budgets=LADDER)
    for n in range(1, 10):  # over the largest batch size: several batches
        x = torch.randn(n, 8)
        out = fast(x)
        assert isinstance(out, torch.Tensor)
        assert_items_close(out, own(net)(x))
    stats = encgraph.graphs(fast).stats
    assert isinstance(encgraph.graphs(fast).adapter, GenericModuleAdapter)
    assert stats["eager_reasons"] == {FIRST_SIGHT: 1} and stats["stock_calls"] == 1
    assert stats["items"] == stats["graph_items"] == sum(range(2, 10))
    assert stats["shapes"]["live"][0]["shape"] == "arg0(B, 8) float32"


@torch.no_grad()
def test_eager_mode_runs_the_module_whole():
    """RunMode.EAGER verifies nothing (no padded run): every call is the module's own, on all its rows at once."""
    calls = []
    net = sequential()
    net.register_forward_pre_hook(lambda m, a: calls.append(a[0].shape[0]))
    fast = encgraph.graphed(net, mode=RunMode.EAGER, budgets=[1, 2])
    x = torch.randn(7, 8)
    assert_items_close(fast(x), own(net)(x))
    assert calls == [7] and encgraph.graphs(fast).stats["stock_calls"] == 1


@pytest.mark.parametrize("as_dict", [False, True], ids=["tuple", "dict"])
@torch.no_grad()
def test_structured_outputs_keep_their_type(as_dict):
    torch.manual_seed(0)
    net = TwoHeads(as_dict).eval()
    fast = encgraph.graphed(net, budgets=LADDER, mode=RunMode.STATIC)
    for n in (1, 3, 6, 6):
        x, scale = inputs(n, seed=n)
        out, ref = fast(x, scale), own(net)(x, scale)
        assert type(out) is type(ref)
        if as_dict:
            assert list(out) == list(ref) and out["none"] is None
        for key in (["tokens", "pooled"] if as_dict else [0, 1]):
            assert_items_close(out[key], ref[key])
    assert encgraph.graphs(fast).stats["graph_items"] == 3 + 6 + 6


@torch.no_grad()
def test_every_call_shape_is_answered_keywords_and_flags_included():
    net = TwoHeads().eval()
    fast = encgraph.graphed(net, budgets=LADDER, mode=RunMode.STATIC, max_shapes=2)
    x, scale = inputs(3, seed=0)
    calls = [
        ((x, scale), {}),
        ((x,), {"scale": scale}),  # keyword inputs
        ((x, scale), {"tanh": False}),  # a flag: another shape
        ((torch.randn(3, 7, 8), scale), {}),  # another trailing shape
        ((x.double(), scale.double()), {}),  # another dtype: the module raises, as it would unwrapped
    ]
    for args, kwargs in calls * 2:
        try:
            want = own(net)(*args, **kwargs)
        except RuntimeError as exc:
            with pytest.raises(type(exc)):
                fast(*args, **kwargs)
            continue
        got = fast(*args, **kwargs)
        for a, b in zip(got, want):
            assert_items_close(a, b)
    shapes = encgraph.graphs(fast).stats["shapes"]
    # Four shapes the module answers, each built on its second call; at most two hold graphs at once.
    assert shapes["built"] == 4 and shapes["evicted"] == 2 and len(shapes["live"]) == 2


@torch.no_grad()
def test_calls_that_cannot_be_batched_are_the_modules_own():
    net = TwoHeads().eval()
    fast = encgraph.graphed(net, budgets=LADDER, mode=RunMode.STATIC)
    x, scale = inputs(3, seed=0)
    for args in ((x, scale[:2]), (x, 2.0), (x[:0], scale[:0])):  # dim 0 differs, a scalar scale, an empty batch
        try:
            want = own(net)(*args)
        except Exception as exc:
            with pytest.raises(type(exc)):
                fast(*args)
            continue
        got = fast(*args)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    reasons = encgraph.graphs(fast).stats["eager_reasons"]
    assert {"tensor arguments differ in dim 0", "empty batch"} <= set(reasons)
    with pytest.raises(EncgraphError):
        encgraph.graphed("not a module", mode=RunMode.STATIC)
    with pytest.raises(ConfigTypeError, match="max_batch"):
        encgraph.graphed(net, adapter_options={"examples": 1})


@torch.no_grad()
def test_output_not_batch_first_is_answered_by_the_module():
    class Summed(torch.nn.Module):
        def forward(self, x):
            return x.sum(0), x * 2

    net = Summed().eval()
    fast = encgraph.graphed(net, budgets=LADDER, mode=RunMode.STATIC)
    x = torch.randn(3, 4)
    for _ in range(3):
        got = fast(x)
        torch.testing.assert_close(got[0], x.sum(0))
    reasons = encgraph.graphs(fast).stats["eager_reasons"]
    assert any("not batch-first" in r for r in reasons) and encgraph.graphs(fast).stats["calls"] == 0


def test_call_split_round_trips_and_keys_ignore_keyword_order():
    x, y = torch.randn(2, 3), torch.randn(2, 1, dtype=torch.float64)
    a = split_call((x,), {"b": y, "flag": True, "nested": [x, (y, None)]})
    b = split_call((x,), {"nested": [x, (y, None)], "flag": True, "b": y})
    assert a.key == b.key and a.batch == 2 and len(a.tensors) == 4
    args, kwargs = rebuild(a.key, a.tensors)
    assert args[0] is x and kwargs["flag"] is True and kwargs["nested"][1][1] is None and kwargs["b"] is y
    assert split_call((x,), {"flag": 1}).key != split_call((x,), {"flag": True}).key
    assert split_call((torch.tensor(1.0),), {}) == "a 0-dim tensor argument"
    assert split_call((x,), {"cfg": {"a": [1]}}) != a and isinstance(split_call((x, {1: [2]}), {}), type(a))
    assert "b(B, 1) float64" in describe_key(a.key) and "flag=True" in describe_key(a.key)


def test_output_spec_names_tensor_leaves_and_keeps_none():
    spec = OutputSpec.learn({"a": torch.zeros(3, 2), "b": None, "c": (torch.zeros(3), torch.zeros(3, 1))}, 3)
    assert spec.tensor_names == ("out0", "out2", "out3")
    built = spec.build({"out0": torch.ones(1, 2), "out2": torch.ones(1), "out3": torch.ones(1, 1)})
    assert built["b"] is None and built["c"][1].shape == (1, 1)
    assert "not batch-first" in OutputSpec.learn(torch.zeros(2, 3), 3)
    assert "not a tensor" in OutputSpec.learn((torch.zeros(3), 5), 3)


@pytest.mark.parametrize("rows", [[2, 3, 4], [4, 0, 2], [0], [], [3, 2], [1, 1]])
def test_take_rows_views_one_run_and_gathers_the_rest(rows):
    t = torch.arange(30.0).reshape(6, 5)
    for given in (rows, np.asarray(rows, dtype=np.int64)):
        got = take_rows(t, given)
        assert torch.equal(got, t[torch.as_tensor(rows, dtype=torch.long)])
        one_run = rows == list(range(rows[0], rows[0] + len(rows))) if rows else True
        assert (got.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()) is one_run


class _Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def test_repeated_blocks_are_every_instance_of_the_class_that_fills_containers():
    """timm and torchvision hold their layers in ``nn.Sequential``, staged towers in one container per stage: every
    block of the class is named (all stages, outermost instances), never leaf layers or the containers."""
    from encgraph.models._hf import repeated_blocks

    stages = torch.nn.Sequential(
        torch.nn.Sequential(_Block(8), _Block(8)),
        torch.nn.Linear(8, 16),
        torch.nn.ModuleList([_Block(16), _Block(16), _Block(16)]),
        torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                            torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16)),
    )
    blocks = repeated_blocks(stages)
    assert [id(b) for b in blocks] == [id(m) for m in stages.modules() if isinstance(m, _Block)]
    assert len(blocks) == 5
    assert repeated_blocks(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))) == []


def test_batch_ladders_compile_with_the_batch_alone_symbolic():
    """A call shape fixes every size but the batch: the any-module path and the fixed-resolution towers compile
    with the batch alone symbolic (Sizes.BATCH), where adapters whose budgets change several sizes keep every size
    symbolic."""
    from encgraph.capture.compiling import Sizes, dynamic_sizes
    from encgraph.models.fixed import FixedResolutionAdapter

    module = torch.nn.Sequential(_Block(8), _Block(8))
    adapter = GenericModuleAdapter.of_call(module, torch.randn(3, 5, 8))
    assert dynamic_sizes(adapter) is Sizes.BATCH
    assert FixedResolutionAdapter.compile_dynamic is Sizes.BATCH
    assert dynamic_sizes(object()) is True


@pytest.mark.parametrize(("value", "ok"), [(True, True), (None, True), (False, True), (Sizes.BATCH, True),
                                           (Sizes.TOP_STATIC, True), ("batch", False), ("top-static", False),
                                           ("auto", False), (0, False)])
def test_compile_dynamic_takes_true_none_false_or_a_sizes_member(value, ok):
    """``compile_dynamic``: every size symbolic (True), torch's automatic dynamic (None), static per budget
    (False, what benches/generic_compile.py's blocks/static measures), Sizes.BATCH or Sizes.TOP_STATIC; anything
    else (an enum's value as a string included) is a ConfigError naming it."""
    from encgraph.capture.compiling import dynamic_sizes
    from encgraph.errors import ConfigError

    class Adapter:
        compile_dynamic = value

    if ok:
        assert dynamic_sizes(Adapter()) is value
    else:
        with pytest.raises(ConfigError,
                           match="compile_dynamic: expected True, None, False, Sizes.BATCH or Sizes.TOP_STATIC"):
            dynamic_sizes(Adapter())


def test_take_rows_of_a_plans_items_is_a_view_and_otherwise_a_gather():
    t = torch.randn(5, 2)
    assert take_rows(t, (1, 2, 3))._base is t and take_rows(t, range(0, 5))._base is t
    assert take_rows(t, ()).shape == (0, 2)
    torch.testing.assert_close(take_rows(t, (3, 1)), t[[3, 1]])
    torch.testing.assert_close(take_rows(t, [0, 2]), t[[0, 2]])
