"""benches/kernel_profile.py's kernel categories, summary and table, and attention_kernels.segment_columns (one
dense attention equal to attention per sequence), on the CPU."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from benches import kernel_profile  # noqa: E402


@pytest.mark.parametrize("name, kind", [
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_bf16_256x128_64x3_tn_align2>", "matmul"),
    ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN", "matmul"),
    ("void implicit_convolveNd_sgemm<__nv_bfloat16, 3, 128>", "convolution"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<96, 128>>", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1", "attention"),
    ("kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object", "attention"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_9", "fused (triton)"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda>", "copy / cast"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps>>", "reduction / norm"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "element-wise"),
    ("Memcpy HtoD (Pinned -> Device)", "copy / cast"),
    ("some_custom_kernel", "other"),
])
def test_kernel_categories(name, kind):
    assert kernel_profile.category(name) == kind


def test_kernel_profile_summary_and_table():
    trace_ = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_gemm", "dur": 300.0},
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_gemm", "dur": 100.0},
        {"ph": "X", "cat": "kernel", "name": "flash_fwd_kernel", "dur": 50.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "dur": 10.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 999.0},  # host ops are not device time
        {"ph": "i", "cat": "kernel", "name": "marker"},
    ]}
    records = kernel_profile.device_records(trace_)
    assert len(records) == 4
    s = kernel_profile.summarize(records, calls=2, median_ms=0.5)
    assert s["kernel_ms"] == pytest.approx(0.23) and s["idle_ms"] == pytest.approx(0.27)
    assert s["kernels"] == 2.0
    assert list(s["categories"]) == ["matmul", "attention", "copy / cast"]
    assert s["categories"]["matmul"] == {"ms": 0.2, "kernels": 1.0}
    assert s["top"][0] == {"name": "nvjet_sm90_gemm", "ms": 0.2, "calls": 1.0}
    data = {"tower": {"label": "T"}, "environment": {"gpu": "G"},
            "cases": {"1x224": {"floor_ms": 0.25, "systems": {"graph": s, "graph_compile": {"skipped": "skipped: x"}},
                                "patch_embed": {"rows": 256, "conv_ms": 0.2, "linear_ms": 0.03, "max_abs_diff": 0.0}}}}
    table = kernel_profile.render(data)
    assert ("| 1x224 | graph | 0.50 | 0.23 | 0.27 | - | 2.00 | matmul 0.20, attention 0.03, copy / cast 0.01 | 2.00 |"
            in table)
    assert "| 1x224 | graph_compile | skipped |" in table
    assert "| 1x224 | 256 | 0.20 | 0.03 | 0 |" in table


def _x(cat, name, ts, dur, corr):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def test_replay_split_tells_a_replays_own_waits_from_work_around_it():
    """Two calls, each a copy in, one replay of two kernels with a wait between them, and a copy out: the kernels
    a cudaGraphLaunch started (same correlation) are the replay's, whatever their order in the trace."""
    events = []
    for call, t0 in ((0, 0.0), (1, 1000.0)):
        launch = 100 + call
        events += [
            _x("gpu_memcpy", "Memcpy HtoD", t0, 10.0, 10 + call),  # copy in (its own cudaMemcpyAsync)
            _x("cuda_runtime", "cudaGraphLaunch", t0 + 5.0, 4.0, launch),
            _x("kernel", "nvjet_sm90_gemm", t0 + 300.0, 200.0, launch),  # listed out of order
            _x("kernel", "flash_fwd_kernel", t0 + 20.0, 250.0, launch),  # 30 us wait before the gemm
            _x("kernel", "copy_kernel", t0 + 520.0, 6.0, 20 + call),  # copy out, eager
            _x("cuda_runtime", "cudaLaunchKernel", t0 + 515.0, 3.0, 20 + call),
        ]
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 0.0, "dur": 900.0})
    split = kernel_profile.replay_split({"traceEvents": events}, calls=2)
    assert split == {"replays": 1.0, "replay_span_ms": 0.48, "replay_kernel_ms": 0.45, "replay_gap_ms": 0.03,
                     "outside_kernel_ms": 0.016}
    # No graph launch (an eager system, or a trace without the runtime's calls): nothing to split, said as None.
    eager = [e for e in events if e["name"] != "cudaGraphLaunch"]
    assert kernel_profile.replay_split({"traceEvents": eager}, calls=2) is None
    s = kernel_profile.summarize(kernel_profile.device_records({"traceEvents": events}), calls=2, median_ms=0.9)
    s["replay"] = split
    data = {"tower": {"label": "T"}, "environment": {"gpu": "G"}, "cases": {"1x224": {"floor_ms": 0.3,
                                                                                       "systems": {"graph": s}}}}
    assert "| 1x224 | graph | 0.90 | 0.47 | 0.43 | 0.03 | 4.00 |" in kernel_profile.render(data)


def test_kernel_profile_refuses_the_cpu_smoke():
    with pytest.raises(SystemExit, match="no CPU smoke"):
        kernel_profile.main(["--cpu-smoke"])


@pytest.mark.parametrize("lengths", [[37, 0, 50, 13, 0, 0], [64, 0], [5] * 9 + [3]])
def test_segment_columns_make_one_dense_attention_equal_attention_per_sequence(lengths):
    """``attention_kernels.segment_columns``: one dense SDPA over every packed row of the widened tensors equals SDPA
    within each sequence (float32: to rounding; the extra columns add exactly 0 within a sequence), empty slots
    included, and the same widened call follows other lengths written into the same ``cu_seqlens``."""
    import torch
    import torch.nn.functional as F

    from benches import attention_kernels as ak

    def dense(q, k, v, cu):
        scale = q.shape[-1] ** -0.5
        wide = ak.segment_columns(q, k, v, cu, scale)
        assert wide[0].shape[-1] % 8 == 0 and wide[0].shape[-1] >= q.shape[-1] + cu.numel() - 1
        out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in wide), scale=scale)[0]
        return out.transpose(0, 1)[..., : q.shape[-1]]

    def per_sequence(q, k, v, lengths):
        outs, start = [], 0
        for n in (n for n in lengths if n):
            part = (t[start:start + n].transpose(0, 1)[None] for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(*part)[0].transpose(0, 1))
            start += n
        return torch.cat(outs)

    gen = torch.Generator().manual_seed(len(lengths))
    q, k, v = (torch.randn(sum(lengths), 3, 72, generator=gen) for _ in range(3))
    cu = ak._cu(lengths, "cpu")
    torch.testing.assert_close(dense(q, k, v, cu), per_sequence(q, k, v, lengths), atol=1e-5, rtol=1e-5)
    other = sorted(lengths, reverse=True)  # another split of the same rows, as many slots
    cu.copy_(ak._cu(other, "cpu"))
    torch.testing.assert_close(dense(q, k, v, cu), per_sequence(q, k, v, other), atol=1e-5, rtol=1e-5)


def test_flashinfer_kernel_plans_on_the_host_once_per_split_and_never_inside_a_capture(monkeypatch):
    """``benches.lib.flashinfer_kernel.FlashInferRagged`` against a fake ``flashinfer`` (the wheel needs CUDA and
    nvcc): one wrapper per geometry, its offsets planned from the host lengths once per new split, no plan while a
    capture runs (a replay reads the last plan), ``replan`` before a replay at a new split, and the backend the
    wrapper reports in ``describe``. The attention itself is checked on the GPU (``vs_flash`` in each row)."""
    import sys
    import types

    import torch

    from benches import attention_kernels as ak
    from benches.lib import flashinfer_kernel

    events = []

    class Wrapper:
        def __init__(self, workspace, layout, use_cuda_graph, qo_indptr_buf, kv_indptr_buf, backend):
            assert layout == "NHD" and use_cuda_graph and backend == "auto"
            self.buf, self._backend = qo_indptr_buf, "fa3"
            events.append(("new", workspace.numel()))

        def plan(self, qo, kv, heads, kv_heads, dim, causal, q_data_type, kv_data_type, disable_split_kv):
            assert qo.device.type == "cpu" and not causal and (heads, kv_heads, dim) == (2, 2, 8)
            assert disable_split_kv  # head dim 8: FlashInfer's split-KV merge has no such instantiation
            self.buf.copy_(qo)
            events.append(("plan", qo.tolist()))

        def run(self, q, k, v):
            events.append(("run", self.buf.tolist()))
            return q.clone()

    fake = types.ModuleType("flashinfer")
    fake.__version__ = "0.0-fake"
    fake.prefill = types.SimpleNamespace(BatchPrefillWithRaggedKVCacheWrapper=Wrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setitem(sys.modules, "flashinfer.prefill", fake.prefill)
    monkeypatch.setattr(flashinfer_kernel, "WORKSPACE_BYTES", 64)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])

    kernel = ak.kernels()["flashinfer"]
    q = torch.randn(10, 2, 8)
    cu = ak._cu([6, 4], "cpu")
    kernel(q, q, q, cu, 6, [6, 4])
    kernel(q, q, q, cu, 6, [6, 4])  # the same split: no new plan
    kernel(q[:8], q[:8], q[:8], ak._cu([4, 4], "cpu"), 4, [4, 4])  # other rows: a wrapper of its own
    capturing[0] = True
    kernel(q, q, q, cu, 6, [3, 7])  # inside a capture: no host work, the last plan is read
    capturing[0] = False
    kernel.replan(q, q, cu, [3, 7])
    assert events == [("new", 64), ("plan", [0, 6, 10]), ("run", [0, 6, 10]), ("run", [0, 6, 10]),
                      ("new", 64), ("plan", [0, 4, 8]), ("run", [0, 4, 8]),
                      ("run", [0, 6, 10]), ("plan", [0, 3, 10])]
    assert kernel.describe() == {"flashinfer": "0.0-fake", "backend": "fa3"}
