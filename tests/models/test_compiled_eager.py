"""The compiled eager forward (``encgraph.capture.compiled_eager``), on the CPU with Dynamo only
(``backend="eager"``: no C++ compiler, seconds): the blocks compiled as the capture compiles them serve the
adapter's eager forward on items of any size, under ``inference_mode`` too, without tracing again once checked;
each item equals the plain eager forward; long sequences keep their dense kernel (the host bounds are found at run
time, inside the opaque attention op); a failure or a disagreement falls back to the plain forward, logged and
counted; outside its forwards the tower runs uncompiled."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from encgraph.capture.agreement import relative_error
from encgraph.capture.buffers import PathBuffers
from encgraph.capture.compiled_eager import CompiledEager, EagerCompile
from encgraph.capture.compiling import CompiledRegions, compile_stats, no_duck_sizing
from encgraph.capture.grad import persistent
from tests.models.conftest import CHANNELS, QWEN_TOWERS
from tests.models.fixtures_families import glm4v_tower
from tests.models.test_kernel_choice import dense_spy

pytest.importorskip("transformers")

TOWERS = {"qwen2_5_vl": QWEN_TOWERS["qwen2_5_vl"], "qwen3_vl": QWEN_TOWERS["qwen3_vl"], "glm4v": glm4v_tower}
DENSE_ROWS = 64  # sequences of at least this many patch rows run dense in the eager forward
TOL = 1e-5  # fp32, the same kernels compiled by Dynamo's eager backend: equal up to reassociation


@pytest.fixture
def varlen_call_on_cpu(monkeypatch):
    """The CUDA path of the packed attention with a CPU kernel behind torch's ``varlen_attn``: the compiled op
    calls :func:`encgraph.models.attention._varlen_call`, as on a GPU, host plan included."""
    import encgraph.models.attention as attention
    from encgraph.models import _varlen_op, varlen_kernel
    from encgraph.models._varlen_op import make_op

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        return attention.masked_attention(q, k, v, cu_q, kw.get("scale"))

    previous = _varlen_op._IMPL
    monkeypatch.setattr(attention, "pick_backend", lambda q: attention.AttentionBackend.VARLEN)
    monkeypatch.setattr(varlen_kernel, "_VARLEN", (kernel, True))
    monkeypatch.setattr(attention, "_VARLEN_OP", make_op(attention._varlen_call, True))
    yield
    _varlen_op._IMPL = previous


def _compiled(family):
    """A wrapped tiny tower whose blocks were compiled as a capture compiles them and ran its static forward at
    two budgets; returns ``(adapter, holder)``, the regions restored (the tower uncompiled again)."""
    from encgraph.models import wrap

    torch._dynamo.reset()
    torch.manual_seed(0)
    adapter = wrap(TOWERS[family]())
    geometries = {(m.num_heads, m.head_dim) for m in adapter.module.modules()
                  if isinstance(getattr(m, "num_heads", None), int) and isinstance(getattr(m, "head_dim", None), int)}
    adapter.kernel_rows = {(h, d, torch.float32): DENSE_ROWS for h, d in geometries}
    regions = CompiledRegions(adapter, backend="eager")
    with persistent(), no_duck_sizing():
        regions.compile()
        specs = {b: adapter.buffer_specs("default", b, 4, 8) for b in (64, 32)}
        buffers = PathBuffers("default", specs, torch.device("cpu"))
        for b in (64, 32):
            views = buffers.fill(b, None)
            for t in views.values():
                if t.is_floating_point():
                    t.normal_()
            adapter.forward_static("default", views, b)
        holder = CompiledEager(regions)
        regions.restore()
    return adapter, holder


def _inputs(adapter, gen, shapes):
    grid = np.array([[1, h, w] for h, w in shapes], dtype=np.int64)
    pixels = torch.from_numpy(gen.standard_normal((int(grid.prod(1).sum()), CHANNELS)).astype(np.float32))
    return adapter.inputs(pixels, grid)


def _close(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.isfinite(got[name]).all(), name
        assert relative_error(got[name], want[name]) < TOL, (name, relative_error(got[name], want[name]))


@pytest.mark.parametrize("family", sorted(TOWERS))
def test_compiled_eager_equals_plain_eager_at_any_size_without_tracing_again(family, varlen_call_on_cpu,
                                                                            monkeypatch):
    adapter, holder = _compiled(family)
    assert holder.status is EagerCompile.PENDING and holder.modules
    gen = np.random.default_rng(1)
    sample = _inputs(adapter, gen, [(8, 8), (4, 6)])
    with torch.no_grad():
        reference = adapter.forward_eager("default", sample)
    assert holder.forward(adapter, "default", sample) is not None and holder.runs == 0  # pending: plain
    before = compile_stats()
    holder.check(adapter, "default", sample, reference, relative_error, TOL)
    assert holder.status is EagerCompile.ON, holder.as_dict()
    # The capture's trace served the eager forward as it was: no second trace (the eager forward's metadata
    # tensors are views, as the static buffers are; Dynamo guards a view's base).
    assert compile_stats()["frames_ok"] == before["frames_ok"]
    dense = dense_spy(monkeypatch)
    before = compile_stats()
    calls = 0
    for case, shapes in enumerate([[(12, 10)], [(2, 2), (10, 12), (4, 4)], [(6, 8)] * 3, [(16, 14), (2, 4)]]):
        inputs = _inputs(adapter, gen, shapes)
        # Served under inference_mode (inference tensors in), no_grad, and neither: one trace serves them all.
        mode = (torch.inference_mode, torch.no_grad, torch.enable_grad)[case % 3]
        with mode():
            if mode is torch.inference_mode:
                inputs = _inputs(adapter, gen, shapes)
            got = holder.forward(adapter, "default", inputs)
        calls += 1
        with torch.no_grad():
            want = adapter.forward_eager("default", inputs)
        _close(got, want)
        assert not any(t.requires_grad for t in got.values())
    delta = {k: v - before[k] for k, v in compile_stats().items()}
    assert delta["frames_ok"] == 0 and delta["graph_breaks"] == 0 and delta["recompiles"] == 0, delta
    assert holder.runs == calls and holder.recompiles == 0 and holder.fallbacks == 0
    # The long frames (120, 120 and 224 patch rows; 48 rows stay varlen) ran on the dense kernel from inside the
    # compiled blocks: their bounds were found at run time.
    assert {120, 224} <= set(dense) and all(r >= DENSE_ROWS for r in dense), sorted(set(dense))
    assert all(m._compiled_call_impl is None for m in holder.modules)  # uncompiled outside its forwards


def test_a_failing_compiled_forward_falls_back_logged_and_counted(varlen_call_on_cpu, caplog):
    adapter, holder = _compiled("qwen3_vl")
    gen = np.random.default_rng(2)
    sample = _inputs(adapter, gen, [(8, 8)])
    with torch.no_grad():
        reference = adapter.forward_eager("default", sample)
    holder.check(adapter, "default", sample, reference, relative_error, TOL)
    assert holder.engaged

    def broken(*args, **kwargs):
        raise RuntimeError("inductor could not lower this")

    holder.calls = [broken] * len(holder.calls)
    with caplog.at_level(logging.WARNING, logger="encgraph"), torch.no_grad():
        got = holder.forward(adapter, "default", sample)
    _close(got, reference)  # the plain forward answered the call
    assert holder.status is EagerCompile.FAILED and holder.fallbacks == 1 and "inductor could not" in holder.reason
    assert "compiled eager forwards stop" in caplog.text
    assert all(m._compiled_call_impl is None for m in holder.modules)
    with torch.no_grad():
        _close(holder.forward(adapter, "default", sample), reference)
    assert holder.fallbacks == 1 and holder.as_dict()["status"] == "failed"


def test_a_disagreeing_compiled_forward_never_engages(varlen_call_on_cpu):
    adapter, holder = _compiled("qwen2_5_vl")
    sample = _inputs(adapter, np.random.default_rng(3), [(8, 8)])
    with torch.no_grad():
        reference = {k: v + 1.0 for k, v in adapter.forward_eager("default", sample).items()}
    holder.check(adapter, "default", sample, reference, relative_error, TOL)
    assert holder.status is EagerCompile.FAILED and "differs from the plain eager forward" in holder.reason
    assert holder.worst_error is not None and holder.worst_error > TOL
    holder.check(adapter, "default", sample, reference, relative_error, 1e9)  # failed stays failed
    assert not holder.engaged


def test_off_holders_run_the_plain_forward():
    holder = CompiledEager.off("compile is off")
    assert holder.as_dict() == {"status": "off", "reason": "compile is off", "runs": 0, "fallbacks": 0,
                                "recompiles": 0, "worst_error": None}
    sentinel = object()

    class Adapter:
        def forward_eager(self, path, inputs):
            return sentinel

    assert holder.forward(Adapter(), "default", None) is sentinel
    assert CompiledEager(CompiledRegions(Adapter())).status is EagerCompile.OFF  # names no regions


def test_the_runner_checks_it_at_capture_and_runs_eager_items_through_it(varlen_call_on_cpu):
    from encgraph.capture.records import RunMode
    from encgraph.capture.runner import EncoderGraphRunner
    from encgraph.capture.selfcheck import check_and_measure

    adapter, holder = _compiled("qwen3_vl")
    runner = EncoderGraphRunner(adapter, budgets=[16, 32, 64], max_items=4, mode=RunMode.STATIC)
    runner.capture()
    assert runner.stats["compiled_eager"]["status"] == "off"  # nothing compiled outside GRAPH mode
    assert "STATIC" in runner.stats["compiled_eager"]["reason"].upper()
    runner.compiled_eager = holder  # what a GRAPH-mode capture keeps (the GPU tests run that capture)
    check_and_measure(runner, verify=True, measure=False)
    assert holder.status is EagerCompile.ON and not any(runner.failed.values())
    plain = EncoderGraphRunner(adapter, budgets=[16, 32, 64], max_items=4, mode=RunMode.EAGER)
    gen = np.random.default_rng(4)
    for shapes in ([(16, 20), (2, 2)], [(4, 4), (18, 16)]):  # 80 and 72 tokens: past the ladder, run eagerly
        inputs = _inputs(adapter, gen, shapes)
        with torch.inference_mode():
            got, want = runner(inputs), plain(inputs)
        assert len(got) == len(want) == 2
        for g, w in zip(got, want):
            g, w = (g, w) if isinstance(g, dict) else ({"out": g}, {"out": w})
            _close(g, w)
    stats = runner.stats
    assert stats["compiled_eager"]["runs"] == 2 and stats["compiled_eager"]["status"] == "on"
    # The two large items ran eagerly (through the compiled blocks); the small ones replayed their budgets.
    assert stats["eager_items"] == 2 and stats["graph_items"] == 2 and stats["compiled_eager"]["fallbacks"] == 0
