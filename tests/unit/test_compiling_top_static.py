"""``Sizes.TOP_STATIC`` (``encgraph.capture.compiling``), on the CPU: a batch ladder's top budget compiles with
static sizes in a frame of its own, every smaller budget through one batch-symbolic frame, and the top budget's
calls run the static entry even after the symbolic one was traced and used (Dynamo looks entries up most recently
used first). Which entry ran is read from a recording Dynamo backend (Dynamo only, no inductor: seconds)."""

from __future__ import annotations

import pytest
import torch

from encgraph.capture.compiling import (
    CompiledRegions,
    Sizes,
    compile_dynamic,
    compile_stats,
    no_duck_sizing,
)
from tests.unit.test_compiling import BATCH_LADDERS, run_budgets

pytest.importorskip("transformers")

RAN: list[str] = []
"""What the recording backend's graphs ran, in order: "static" or "symbolic" per compiled graph call."""


def recording(gm, example_inputs):
    """A Dynamo backend: the graph as it is, each run logged in :data:`RAN` as static (every size an int) or
    symbolic (a SymInt among its inputs' sizes or its inputs)."""
    symbolic = any(isinstance(s, torch.SymInt) for t in example_inputs if isinstance(t, torch.Tensor)
                   for s in t.shape) or any(isinstance(t, torch.SymInt) for t in example_inputs)
    kind = "symbolic" if symbolic else "static"

    def run(*args):
        RAN.append(kind)
        return gm.forward(*args)

    return run


def _top_static(name, monkeypatch):
    adapter, _ = BATCH_LADDERS[name]()
    monkeypatch.setattr(adapter, "compile_dynamic", Sizes.TOP_STATIC, raising=False)
    return adapter


@pytest.mark.parametrize("name", ["vit (generic)", "siglip", "clip"])
def test_top_static_compiles_the_top_budget_static_and_the_rest_in_one_symbolic_frame(name, monkeypatch):
    """The capture's order (every warm-up largest first, a compiled eager check at smaller sizes, then every
    capture largest first): two frames; every call at the top budget ran the static entry, every other the
    symbolic one; outputs equal the uncompiled forward, item by item."""
    torch._dynamo.reset()
    adapter = _top_static(name, monkeypatch)
    regions = CompiledRegions(adapter, backend=recording)
    assert regions.dynamic is Sizes.TOP_STATIC
    before = compile_stats()
    with no_duck_sizing(), torch.no_grad():
        done = run_budgets(adapter, regions, [8, 4, 2, 1, 3, 2, 8, 4, 2, 1], RAN)
        after = compile_stats()
        for budget, out, views, ran in done:
            assert ran == ({"static"} if budget == 8 else {"symbolic"}), (budget, ran)
            ref = adapter.forward_static(adapter.config.paths[0].name, views, budget)
            for key in ref:
                for item in range(budget):
                    torch.testing.assert_close(out[key][item], ref[key][item], rtol=1e-5, atol=1e-5)
    assert after["frames_ok"] - before["frames_ok"] == 2
    assert after["graph_breaks"] == before["graph_breaks"]
    assert regions.top_static is not None and regions.top_static.top == 8
    assert all(m._compiled_call_impl is None for m in regions.modules)


def test_top_static_ladder_of_one_budget_traces_one_frame(monkeypatch):
    torch._dynamo.reset()
    adapter = _top_static("siglip", monkeypatch)
    regions = CompiledRegions(adapter, backend=recording)
    before = compile_stats()
    with no_duck_sizing(), torch.no_grad():
        done = run_budgets(adapter, regions, [4, 4, 4], RAN)
    assert compile_stats()["frames_ok"] - before["frames_ok"] == 1
    assert all(ran == {"static"} for *_, ran in done)


def test_automatic_dynamic_serves_the_top_budget_from_its_later_symbolic_entry():
    """Why TOP_STATIC's static frame has a code object of its own: under torch's automatic dynamic (``dynamic=None``)
    the top budget's first call traces a static entry, but once the smaller budgets traced the symbolic one, a
    call at the top budget runs the symbolic entry (Dynamo looks entries up most recently used first). Pins torch's
    behaviour that the member works around; if torch changes it, the docstring of Sizes.TOP_STATIC is to be
    revisited, not the member."""
    torch._dynamo.reset()
    layer = torch.nn.Linear(8, 8).requires_grad_(False)
    compiled = torch.compile(layer, dynamic=None, backend=recording)
    ran = []
    for b in (8, 4, 2, 8):
        start = len(RAN)
        compiled(torch.randn(b, 3, 8))
        ran.append(RAN[start:])
    assert ran == [["static"], ["symbolic"], ["symbolic"], ["symbolic"]]


def test_top_static_whole_forward_runs_its_first_budget_static():
    """Where an adapter names no regions, ``compile_dynamic`` compiles the whole forward: the first budget's calls
    run a static frame of their own, before and after the others, which go through torch's automatic dynamic (as
    under Sizes.BATCH: static, then symbolic, then a batch of 1; four frames in all), and outputs are the
    forward's."""
    torch._dynamo.reset()
    layer = torch.nn.Linear(8, 8).requires_grad_(False)

    def forward(buffers, budget):
        return {"out": torch.relu(layer(buffers["x"]))}

    fn = compile_dynamic(forward, Sizes.TOP_STATIC, backend=recording)
    before = compile_stats()
    for b in (8, 4, 2, 1, 8):
        x = torch.randn(b, 3, 8)
        start = len(RAN)
        torch.testing.assert_close(fn({"x": x}, b)["out"], forward({"x": x}, b)["out"])
        if b == 8:
            assert RAN[start:] == ["static"]
    assert compile_stats()["frames_ok"] - before["frames_ok"] <= 4


@pytest.mark.parametrize(("variant", "member"), [("stack/top-static", Sizes.TOP_STATIC),
                                                 ("blocks/top-static", Sizes.TOP_STATIC), ("stack/batch", Sizes.BATCH)])
def test_generic_compile_variants_select_the_sizes_member_and_put_the_default_back(variant, member):
    """benches/generic_compile.py's variants set the batch-ladder adapters' ``compile_dynamic`` for one run and put
    the default (Sizes.BATCH, left unchanged) back."""
    from benches.generic_compile import VARIANTS, adapter_classes, restore, set_variant

    saved = set_variant(*VARIANTS[variant])
    try:
        assert all(cls.compile_dynamic is member for cls in adapter_classes())
    finally:
        restore(saved)
    assert all(cls.compile_dynamic is Sizes.BATCH for cls in adapter_classes())
