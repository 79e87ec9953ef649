"""The SGLang shim against SGLang's real vision towers (SGLang 0.5.23; skipped where SGLang is not importable).

Real: SGLang's ``Qwen2_5_VisionTransformer`` and ``Qwen3VLMoeVisionModel`` (their blocks, attention layer with the
``sdpa`` backend, mergers, deepstack mergers, and their own ``forward_with_cuda_graph`` call sites, which build
the runner inputs and call ``run``), SGLang's ``ViTCudaGraphRunner`` class, its parallel-state setup (gloo, one
process). Stand-ins: ``torchvision`` (see ``sglang_env``). SGLang's own runner cannot replay here (CUDA graphs,
and it refuses ``sdpa``); the shim runs its STATIC mode: the same plan, padded buffers and static forward.
"""

from __future__ import annotations

import pytest
import torch

from tests.shims import sglang_env

if not sglang_env.available():
    pytest.skip("SGLang is not installed", allow_module_level=True)
sglang_env.prepare()

from sglang.srt.models import qwen2_5_vl as sgl_q25  # noqa: E402
from sglang.srt.models import qwen3_vl as sgl_q3  # noqa: E402
from sglang.srt.multimodal.vit_cuda_graph_runner import ViTCudaGraphRunner  # noqa: E402

from encgraph.capture.records import RunMode  # noqa: E402
from encgraph.errors import ConfigError  # noqa: E402
from encgraph.shims import sglang as shim  # noqa: E402

GRID = [[1, 4, 6], [1, 8, 8], [2, 4, 4], [1, 2, 4], [1, 4, 4], [1, 16, 12]]  # the last: 48 tokens, over the 32 budget


def init(vit):
    # SGLang's parallel layers allocate with torch.empty and expect a checkpoint: give every weight values.
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in vit.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name and name.endswith("weight") else 0.05 * noise)
    return vit.eval()


def qwen2_5():
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    torch.manual_seed(0)
    cfg = Qwen2_5_VLVisionConfig(depth=3, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=48,
                                 fullatt_block_indexes=[1], window_size=56)
    return init(sgl_q25.Qwen2_5_VisionTransformer(cfg, use_data_parallel=True))


def qwen3():
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

    torch.manual_seed(0)
    cfg = Qwen3VLVisionConfig(depth=3, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=48,
                              patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0, 2])
    return init(sgl_q3.Qwen3VLMoeVisionModel(cfg, use_data_parallel=True))


def pixels(vit, grid, seed=0):
    channels = vit.patch_embed.proj.weight[0].numel() if hasattr(vit.patch_embed, "proj") else None
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grid), channels, generator=gen)


def same_position_embeddings(vit):
    """Qwen3: SGLang's graph path interpolates position embeddings with ``fast_pos_embed_interpolate``, its
    eager ``forward`` with ``fast_pos_embed_interpolate_from_list`` (or the vectorized one); here they differ
    (up to 1.07 on the embeddings of this random tower). The reference forward is given the graph path's
    interpolation, so that SGLang's eager blocks and the shim see the same inputs."""
    if hasattr(vit, "fast_pos_embed_interpolate_from_list"):
        vit._use_vectorized_pos_embed = lambda n: False
        vit.fast_pos_embed_interpolate_from_list = lambda grid: vit.fast_pos_embed_interpolate(torch.tensor(grid))


def per_item_eager(vit, x, grid):
    same_position_embeddings(vit)
    out, start = [], 0
    for g in grid:
        rows = g[0] * g[1] * g[2]
        with torch.inference_mode():
            out.append(vit.forward(x[start : start + rows], torch.tensor([g])))
        start += rows
    return out


@pytest.mark.parametrize("build,attr", [(qwen2_5, "cuda_graph_runner"), (qwen3, "graph_runners")], ids=["qwen2_5_vl", "qwen3_vl"])
def test_sglangs_call_site_through_the_shim_equals_its_eager_forward(build, attr):
    vit = build()
    if attr == "graph_runners":  # Qwen3 builds SGLang's own runner in __init__, on any device
        assert type(vit.graph_runners) is ViTCudaGraphRunner
    # STATIC: the padded plan on the CPU (the CPU default is the eager forward).
    runner = shim.ViTGraphRunner(vit, budgets=[8, 16, 32], max_items=4, mode=RunMode.STATIC)
    setattr(vit, attr, runner)
    x = pixels(vit, GRID, seed=1)
    with torch.inference_mode():
        got = vit.forward_with_cuda_graph(x, torch.tensor(GRID))
    want = per_item_eager(vit, x, GRID)
    assert got.shape[0] == sum(w.shape[0] for w in want)
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-4, atol=1e-5)
    stats = runner.runner.stats
    assert stats["mode"] == "static" and stats["eager_items"] >= 1 and stats["graph_items"] >= 3
    assert sum(stats["paths"]["default"]["replays"].values()) >= 2  # several sub-batches, several budgets


def test_install_makes_sglang_build_the_shim():
    try:
        shim.install()
        assert type(qwen3().graph_runners) is shim.ViTGraphRunner
        assert sgl_q25.ViTCudaGraphRunner is shim.ViTGraphRunner
    finally:
        shim.uninstall()
    assert type(qwen3().graph_runners) is ViTCudaGraphRunner and sgl_q25.ViTCudaGraphRunner is ViTCudaGraphRunner


def test_sdpa_cannot_be_captured():
    vit = qwen2_5()
    assert shim.SglangViTAdapter(vit).backend == "sdpa"
    with pytest.raises(ConfigError, match="cannot run inside a CUDA graph"):
        shim.ViTGraphRunner(vit, mode=RunMode.GRAPH)


def test_sglangs_own_runner_cannot_run_here():
    vit = qwen3()
    x = pixels(vit, GRID[:2])
    with pytest.raises(Exception), torch.inference_mode():  # CUDA graphs, and no graph support for sdpa
        vit.forward_with_cuda_graph(x, torch.tensor(GRID[:2]))
