"""The compiled eager forward on a GPU (``encgraph.capture.compiled_eager``): a runner captured with the defaults
checks, at capture, its eager forward run through the blocks compiled for the graphs (inductor), then runs every
item past its ladder that way. Each item equals the plain eager forward's on fresh random inputs, under
``inference_mode`` and ``no_grad``, and nothing is traced again while serving. Qwen3-VL-8B and GLM-4.1V towers at
real geometry, fewer layers (6 and 4: Qwen3-VL's deepstack reads layer 5); ``pytest -s`` prints plain against
compiled eager time of large images."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from encgraph.capture.compiling import compile_stats
from encgraph.capture.records import RunMode
from encgraph.capture.runner import EncoderGraphRunner
from encgraph.models import wrap
from tests.gpu.test_qwen_gpu import HF_RTOL, cuda_ms, qwen3_vl, rel
from tests.models.test_kernel_choice import dense_spy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BUDGETS = [64, 128, 256, 512, 1024]


def _tower(family):
    torch.manual_seed(0)
    if family == "qwen3_vl":
        return qwen3_vl(depth=6)[0].cuda().eval().requires_grad_(False)
    from tests.gpu.family_geometry import GEOMETRY

    return GEOMETRY["glm4v"].build(depth=4).cuda()


def _items(adapter, gen, shapes):
    grid = np.array([[1, h, w] for h, w in shapes], dtype=np.int64)
    pixels = torch.randn(int(grid.prod(1).sum()), adapter.channels, device="cuda", dtype=torch.bfloat16)
    return adapter.inputs(pixels, grid)


@pytest.mark.parametrize("family", ["qwen3_vl", "glm4v"])
def test_items_past_the_ladder_run_the_compiled_blocks(family, monkeypatch):
    tower = _tower(family)
    adapter = wrap(tower)
    runner = EncoderGraphRunner(adapter, budgets=BUDGETS, max_items=8)
    info = runner.capture()
    eager = info["compile"]["eager"]
    assert info["compile"]["status"] == "compiled" and eager["status"] == "on", info["compile"]
    plain = EncoderGraphRunner(adapter, budgets=BUDGETS, max_items=8, mode=RunMode.EAGER)
    gen = np.random.default_rng(11)
    before = compile_stats()
    worst = 0.0
    for case in range(6):
        # One image past the top budget (1,024 tokens) among small ones: 1,260 to 2,500 tokens.
        side = int(gen.integers(36, 50)) * 2
        shapes = [(side, side - 2 * int(gen.integers(0, 6)))]
        shapes += [tuple(int(x) * 2 for x in gen.integers(2, 17, 2)) for _ in range(int(gen.integers(0, 4)))]
        gen.shuffle(shapes)
        inputs = _items(adapter, gen, shapes)
        with (torch.inference_mode if case % 2 else torch.no_grad)():
            got, want = runner(inputs), plain(inputs)
        assert len(got) == len(want) == len(shapes)
        for i, (g, w) in enumerate(zip(got, want)):
            for name in w:
                assert torch.isfinite(g[name]).all(), (case, i, name)
                err = rel(g[name], w[name])
                worst = max(worst, err)
                assert err < HF_RTOL, (case, i, shapes[i], name, err)
    stats = runner.stats
    delta = {k: v - before[k] for k, v in compile_stats().items()}
    assert delta["frames_ok"] == 0 and delta["graph_breaks"] == 0, delta  # nothing traced while serving
    served = stats["compiled_eager"]
    assert served["runs"] >= 6 and served["fallbacks"] == 0 and served["recompiles"] == 0, served
    assert stats["eager_items"] >= 6

    big = _items(adapter, gen, [(192, 192)] if family == "glm4v" else [(128, 128)])  # 36,864 / 16,384 rows
    # Where capture measured dense cuDNN faster for long sequences (no FlashAttention-4), the compiled blocks'
    # attention op runs the big image on it (from the rows measured at capture): the eager forward's host bounds
    # are found at run time.
    rows = int(big.grid[0].prod())
    rules = (adapter.kernel_rows or {}).values()
    dense_rule = any(rule is not None and rule <= rows for rule in rules)
    dense = dense_spy(monkeypatch)
    with torch.inference_mode():
        runner.compiled_eager.forward(adapter, "default", big)
    assert bool(dense) == dense_rule and all(r == rows for r in dense), (dense_rule, sorted(set(dense)))
    with torch.inference_mode():
        plain_ms = cuda_ms(lambda: adapter.forward_eager("default", big))
        compiled_ms = cuda_ms(lambda: runner.compiled_eager.forward(adapter, "default", big))
        err = max(rel(a, b) for a, b in zip(runner.compiled_eager.forward(adapter, "default", big).values(),
                                               adapter.forward_eager("default", big).values()))
    assert err < HF_RTOL, err
    print(f"\n{family} depth {len(adapter.module.blocks)}: compiled eager vs plain, worst norm-relative "
          f"{worst:.2e}; dense calls of the big image {len(dense)}; capture {info['seconds']:.1f} s; one image of "
          f"{big.grid[0, 1]} x {big.grid[0, 2]} patches: plain {plain_ms:.2f} ms, compiled {compiled_ms:.2f} ms "
          f"({plain_ms / compiled_ms:.2f}x), error {err:.2e}")
