"""The three varlen kernels on the CPU (issue 56): which one a head geometry runs in graphs and which in eager calls
(encgraph.models.varlen_kernel), the measurement's choice among them (encgraph.packing.crossover), and cuDNN's
packed SDPA through the frontend wheel (encgraph.models.cudnn_varlen) with that wheel stood in for. The kernels
themselves run on CUDA only (tests/gpu/test_cudnn_gpu.py, tests/gpu/test_fa4_gpu.py)."""

from __future__ import annotations

import logging
import sys
import threading
import types

import pytest
import torch

from encgraph.capture.recording import graph_calls, in_graph_calls
from encgraph.errors import ConfigError
from encgraph.models import cudnn_varlen, fa4, varlen_kernel
from encgraph.packing.crossover import Crossover, faster_varlen

GPU = torch.device("cuda", 0)
H100 = "NVIDIA H100 80GB HBM3"


def _query(heads: int = 16, head_dim: int = 72) -> types.SimpleNamespace:
    """What kernel_of reads of a CUDA query, on a machine without one."""
    return types.SimpleNamespace(shape=(8, heads, head_dim), dtype=torch.bfloat16, device=GPU, is_cuda=True)


@pytest.fixture
def kernels_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """FlashAttention-4 and the cuDNN frontend reported available on cuda:0, and an empty registry after."""
    monkeypatch.setattr(fa4, "available", lambda device: True)
    monkeypatch.setattr(cudnn_varlen, "available", lambda device: True)
    monkeypatch.setattr(varlen_kernel, "_CHOSEN", {})


def test_cudnn_runs_in_graph_calls_only(kernels_here):
    q = _query()
    varlen_kernel.use(16, 72, torch.bfloat16, GPU, "cudnn")
    assert varlen_kernel.kernel_of(q) == "flash"  # an eager call: no plan per batch
    with graph_calls():
        assert varlen_kernel.kernel_of(q) == "cudnn"
        with graph_calls():  # nested (a capture within the runner's own)
            assert in_graph_calls()
        assert varlen_kernel.kernel_of(q) == "cudnn"
        # Keys with other bounds than the queries' (one query per sequence, some empty): the eager kernel.
        assert varlen_kernel.kernel_of(q, self_attention=False) == "flash"
        assert varlen_kernel.kernel_of(_query(16, 80)) == "flash"  # another geometry: nothing chosen
    assert not in_graph_calls()
    varlen_kernel.use(16, 72, torch.bfloat16, GPU, "cudnn", eager="fa4")
    with graph_calls():
        assert varlen_kernel.kernel_of(q) == "cudnn"
    assert varlen_kernel.kernel_of(q) == "fa4"
    varlen_kernel.use(16, 72, torch.bfloat16, GPU, "fa4")  # FlashAttention-4 runs eagerly too
    with graph_calls():
        assert varlen_kernel.kernel_of(q, self_attention=False) == "fa4"
    assert varlen_kernel.kernel_of(q) == "fa4"
    varlen_kernel.use(16, 72, torch.bfloat16, GPU, "flash")
    assert varlen_kernel._CHOSEN == {}


def test_graph_calls_are_per_thread(kernels_here):
    seen = []
    with graph_calls():
        thread = threading.Thread(target=lambda: seen.append(in_graph_calls()))
        thread.start()
        thread.join()
        assert in_graph_calls()
    assert seen == [False]


@pytest.mark.parametrize(("kernel", "eager", "device", "match"), [
    ("fa3", None, GPU, r"varlen_kernel.use\(kernel\): expected one of \('flash', 'fa4', 'cudnn'\), got 'fa3'"),
    ("flash", "cudnn", GPU, r"varlen_kernel.use\(eager\): expected one of \('flash', 'fa4'\).*graphs only"),
    ("fa4", None, torch.device("cpu"), r"varlen_kernel.use\(device\): expected a CUDA device, got cpu"),
])
def test_bad_kernel_choices_are_refused(kernels_here, kernel, eager, device, match):
    with pytest.raises(ConfigError, match=match):
        varlen_kernel.use(16, 72, torch.bfloat16, device, kernel, eager=eager)


def test_a_kernel_that_cannot_run_here_is_refused_with_its_install(monkeypatch):
    monkeypatch.setattr(varlen_kernel, "_CHOSEN", {})
    monkeypatch.setattr(fa4, "available", lambda device: False)
    monkeypatch.setattr(cudnn_varlen, "available", lambda device: False)
    with pytest.raises(ConfigError, match=r"pip install nvidia-cudnn-frontend, or pass kernel='flash'"):
        varlen_kernel.use(16, 72, torch.bfloat16, GPU, "cudnn")
    with pytest.raises(ConfigError, match=r"FlashAttention-4 cannot run on cuda:0.*install flash-attn-4"):
        varlen_kernel.use(16, 72, torch.bfloat16, GPU, "cudnn", eager="fa4")
    assert varlen_kernel._CHOSEN == {}


def test_call_kernel_dispatches_and_says_whether_the_keys_share_the_queries_bounds(monkeypatch):
    calls = []
    monkeypatch.setattr(cudnn_varlen, "varlen_attn", lambda *a: calls.append(("cudnn", a[5], a[7])) or a[0])
    monkeypatch.setattr(fa4, "varlen_attn", lambda *a: calls.append(("fa4", a[5], a[7])) or a[0])
    asked = []
    monkeypatch.setattr(varlen_kernel, "kernel_of", lambda q, self_attention=True: asked.append(self_attention)
                        or "cudnn")
    q = torch.zeros(8, 2, 8)
    cu, other = torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32)
    assert varlen_kernel.call_kernel(q, q, q, cu, cu, 5, 5, 0.5) is q
    varlen_kernel.call_kernel(q, q, q, other, cu, 1, 5, None)
    varlen_kernel.call_kernel(q, q, q, cu, cu, 5, 5, None, "fa4")  # forced (the measurement): not asked
    assert asked == [True, False]
    assert calls == [("cudnn", 5, 0.5), ("cudnn", 1, None), ("fa4", 5, None)]


def test_the_measurement_picks_the_fastest_graph_kernel_and_keeps_cudnn_out_of_eager_calls():
    lengths, flash, dense = (1024, 4096, 16384), (0.1, 1.6, 25.0), (0.15, 1.0, 14.0)
    # cuDNN measured (the frontend installed), FlashAttention-4 not: graphs run cuDNN, eager calls Flash (whose
    # times set from how many rows an eager forward goes dense).
    c = Crossover(H100, 16, 72, "bfloat16", lengths, flash, dense, cudnn_ms=(0.07, 1.1, 17.0))
    assert (c.graph_kernel, c.varlen_kernel, c.chosen_varlen_ms, c.min_rows) == ("cudnn", "flash", flash, 4096)
    # Both measured: the lower median ratio to Flash wins the graphs; FlashAttention-4 runs the eager calls.
    both = Crossover(H100, 16, 72, "bfloat16", lengths, flash, dense, fa4_ms=(0.08, 0.9, 12.0),
                     cudnn_ms=(0.07, 1.1, 17.0))
    assert (both.graph_kernel, both.varlen_kernel) == ("fa4", "fa4")
    # Within the margin of Flash: Flash.
    close = Crossover(H100, 16, 72, "bfloat16", lengths, flash, dense, cudnn_ms=(0.098, 1.55, 24.0))
    assert close.graph_kernel == "flash"
    assert faster_varlen(flash, (), (0.05, 0.8, 12.5)) == "cudnn" and faster_varlen(flash, ()) == "flash"
    data = c.to_dict()
    assert data["graph_kernel"] == "cudnn" and data["cudnn_ms"] == [0.07, 1.1, 17.0]
    assert Crossover.from_dict(data) == c
    old = {k: v for k, v in data.items() if k not in ("cudnn_ms", "graph_kernel")}  # a file of before cuDNN
    assert Crossover.from_dict(old) == Crossover(H100, 16, 72, "bfloat16", lengths, flash, dense)
    with pytest.raises(ConfigError, match="cudnn_ms.*one time per length"):
        Crossover(H100, 16, 72, "bfloat16", lengths, flash, dense, cudnn_ms=(1.0,))


@pytest.fixture
def frontend(monkeypatch: pytest.MonkeyPatch) -> dict:
    """A stand-in ``cudnn`` package: ``sdpa_torch`` records its calls and adds a plan to the frontend's cache."""
    state: dict = {"calls": [], "cache": {}, "capturing": False}

    def sdpa_torch(q, k, v, **kw):
        state["calls"].append(kw)
        state["cache"][("plan", kw["max_seqlen_q"], len(state["cache"]))] = object()
        return q

    package = types.ModuleType("cudnn")
    package.sdpa_torch = sdpa_torch
    torch_op = types.ModuleType("cudnn.sdpa.fwd.torch_op")
    torch_op._graph_cache = state["cache"]
    for name, module in (("cudnn", package), ("cudnn.sdpa", types.ModuleType("cudnn.sdpa")),
                         ("cudnn.sdpa.fwd", types.ModuleType("cudnn.sdpa.fwd")),
                         ("cudnn.sdpa.fwd.torch_op", torch_op)):
        monkeypatch.setitem(sys.modules, name, module)
    sys.modules["cudnn.sdpa.fwd"].torch_op = torch_op
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    monkeypatch.setattr(cudnn_varlen, "_PINNED", {})
    monkeypatch.setattr(cudnn_varlen, "_WARNED", [])
    return state


def test_cudnn_rounds_the_longest_sequence_and_keeps_the_plans_a_capture_recorded(frontend):
    q = torch.zeros(8, 2, 8)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    assert cudnn_varlen.varlen_attn(q, q, q, cu, cu, 5, 300, 0.25) is q
    assert frontend["calls"][0] == {"scale": 0.25, "cu_seqlens_q": cu, "cu_seqlens_kv": cu, "max_seqlen_q": 128,
                                    "max_seqlen_kv": 512}
    assert cudnn_varlen.pinned() == 0  # a call outside any graph's calls keeps nothing
    with graph_calls():  # a warm-up
        cudnn_varlen.varlen_attn(q, q, q, cu, cu, 2000, 2000)
    assert cudnn_varlen.pinned() == 2
    frontend["capturing"] = True  # a capture (the kernel's own measurement captures outside graph_calls)
    cudnn_varlen.varlen_attn(q, q, q, cu, cu, 4000, 4000)
    assert cudnn_varlen.pinned() == 3  # every plan of the frontend's cache then, the recorded one among them
    frontend["cache"].clear()  # the frontend dropped them (past 128 newer ones): still kept here
    assert cudnn_varlen.pinned() == 3


def test_a_frontend_without_its_plan_cache_is_said_once(frontend, caplog):
    del sys.modules["cudnn.sdpa.fwd.torch_op"]._graph_cache
    frontend["capturing"] = True
    q, cu = torch.zeros(8, 2, 8), torch.tensor([0, 8], dtype=torch.int32)
    with caplog.at_level(logging.WARNING, logger="encgraph"):
        cudnn_varlen.varlen_attn(q, q, q, cu, cu, 8, 8)
        cudnn_varlen.varlen_attn(q, q, q, cu, cu, 8, 8)
    assert len(caplog.records) == 1 and "cannot keep cuDNN's SDPA plans" in caplog.records[0].getMessage()


def test_cudnn_is_not_available_off_cuda_and_on_older_gpus(monkeypatch):
    assert not cudnn_varlen.available(torch.device("cpu"))
    assert not cudnn_varlen.fits(72, torch.bfloat16, torch.device("cpu"))
    monkeypatch.setattr(cudnn_varlen, "_AVAILABLE", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (7, 5))
    assert not cudnn_varlen.available(GPU)  # a Turing GPU: cuDNN's SDPA needs Ampere or newer
    monkeypatch.setattr(cudnn_varlen, "_AVAILABLE", {0: True})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 0))
    assert cudnn_varlen.fits(128, torch.bfloat16, GPU) and not cudnn_varlen.fits(256, torch.bfloat16, GPU)
    assert not cudnn_varlen.fits(72, torch.float32, GPU) and not cudnn_varlen.fits(76, torch.float16, GPU)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    assert cudnn_varlen.fits(256, torch.bfloat16, GPU)


def test_a_graph_only_kernel_that_cannot_be_captured_is_never_timed_queued(monkeypatch):
    # Flash and FlashAttention-4 run eagerly too, so a failed capture of their timing falls back to queued calls;
    # cuDNN's packed SDPA runs in graphs only: its timing must capture, or the kernel is left out.
    from encgraph.models import kernel_choice

    def refuse(graph, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "graph", refuse)
    monkeypatch.setattr(kernel_choice, "_queued_ms", lambda fn, repeats: 1.5)
    assert kernel_choice._graph_ms(lambda: None) == 1.5
    with pytest.raises(RuntimeError, match="not permitted"):
        kernel_choice._graph_ms(lambda: None, strict=True)
