"""SGLang's own Qwen2.5-VL vision tower on CUDA with its ``triton_attn`` backend, through encgraph's SGLang shim
(issue 28 point 4). Skipped where SGLang is not importable (the GPU image has none: its wheel is carried in).

SGLang's call site (``forward_with_cuda_graph``) with the shim's runner in GRAPH mode, captured once, replayed on
fresh random grids; each call's output equals SGLang's own eager forward item by item (bf16 tolerance), and a
second call does not change the first one's outputs.
"""

from __future__ import annotations

import pytest
import torch

from tests.shims import sglang_env

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

if not sglang_env.available():
    pytest.skip("SGLang is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def sglang():
    sglang_env.prepare()
    from sglang.srt.models import qwen2_5_vl
    from sglang.srt.runtime_context import get_context

    get_context().override_server_args(mm_attention_backend="triton_attn").install()
    return qwen2_5_vl


def tower(sgl):
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    torch.manual_seed(0)
    cfg = Qwen2_5_VLVisionConfig(depth=4, hidden_size=256, intermediate_size=512, num_heads=4, out_hidden_size=128,
                                 fullatt_block_indexes=[1, 3], window_size=112)
    vit = sgl.Qwen2_5_VisionTransformer(cfg, use_data_parallel=True)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in vit.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name and name.endswith("weight") else 0.05 * noise)
    return vit.to("cuda", torch.bfloat16).eval()


def random_grid(gen: torch.Generator, n: int) -> list[list[int]]:
    return [[1, 2 * int(torch.randint(1, 9, (1,), generator=gen)), 2 * int(torch.randint(1, 9, (1,), generator=gen))]
            for _ in range(n)]


def test_triton_attn_tower_replays_equal_sglangs_eager_forward(sglang):
    from encgraph.shims import sglang as shim

    vit = tower(sglang)
    channels = vit.patch_embed.proj.weight[0].numel()
    runner = shim.ViTGraphRunner(vit, min_budget=64, max_budget=1024, max_items=8)
    vit.cuda_graph_runner = runner
    gen = torch.Generator().manual_seed(1)
    first = None
    for call in range(6):
        grid = random_grid(gen, int(torch.randint(1, 7, (1,), generator=gen)))
        rows = sum(t * h * w for t, h, w in grid)
        x = torch.randn(rows, channels, generator=gen).to("cuda", torch.bfloat16)
        with torch.inference_mode():
            got = vit.forward_with_cuda_graph(x, torch.tensor(grid)).float()
            want, start = [], 0
            for g in grid:
                n = g[0] * g[1] * g[2]
                want.append(vit.forward(x[start : start + n], torch.tensor([g])).float())
                start += n
        assert got.shape[0] == sum(w.shape[0] for w in want)
        offset = 0
        for i, w in enumerate(want):
            part = got[offset : offset + w.shape[0]]
            offset += w.shape[0]
            err = ((part - w).norm() / w.norm().clamp_min(1e-6)).item()
            assert torch.isfinite(part).all() and err < 3e-2, f"call {call} item {i}: relative error {err:.3g}"
        if first is None:
            first, kept = got, got.clone()
    torch.testing.assert_close(first, kept, rtol=0, atol=0)  # later calls left the first call's output alone
    stats = runner.runner.stats
    print(f"\nSGLang triton_attn through the shim: {stats['graph_items']} items replayed, "
          f"{stats['eager_items']} eager, replays {stats['paths']['default']['replays']}")
    assert stats["mode"] == "graph" and stats["graph_items"] > 0
