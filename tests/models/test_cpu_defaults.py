"""The CPU defaults cost no more than the tower (issue 31, point 1; issue 55, point 6): on a CPU ``graphed(tower)``
with no options answers every call with the tower's own forward (no graphs to gain), so the README's tiny
Qwen2.5-VL tower answers its first call within 2 s and every call within 1.2x the tower's own forward, equal to
it; and the tiny SigLIP and CLIP towers cost at most 1.1x their forward + 50 us a call.

Times are the calling thread's CPU time (``time.thread_time``; the tests run torch on one thread), so other jobs
on the machine do not count; the bounds carry CI slack: 4 s for the first call, 1.5x for the median of paired
calls (measured on the 2-core machine: 0.4-0.6 s and 0.74-0.99x wall time, see issue 31's report).
"""

from __future__ import annotations

import copy
import statistics
import time

import pytest
import torch

pytest.importorskip("transformers")

import encgraph  # noqa: E402
from encgraph.models.graphed_forward import CPU_PASSTHROUGH  # noqa: E402
from tests.models.fixtures_multipath import one_thread  # noqa: E402,F401  (autouse: one torch thread)

FIRST_CALL_S = 4.0
"""2 s asked for, with CI slack."""
PER_CALL_RATIO = 1.5
"""1.2x asked for, with CI slack."""


def readme_tower() -> torch.nn.Module:
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    config = Qwen2_5_VLVisionConfig(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=64,
                                    fullatt_block_indexes=[1], window_size=56)
    torch.manual_seed(0)
    return Qwen2_5_VisionTransformerPretrainedModel._from_config(config).eval()


def test_first_call_and_every_call_cost_about_the_tower() -> None:
    tower = readme_tower()
    stock = copy.deepcopy(tower)
    grid = torch.tensor([[1, 4, 6], [1, 8, 8], [2, 4, 4]])
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14)
    with torch.inference_mode():
        reference = stock(pixels, grid_thw=grid)
        t0 = time.thread_time()
        fast = encgraph.graphed(tower)
        out = fast(pixels, grid_thw=grid)
        first = time.thread_time() - t0
        ratios = []
        for _ in range(9):
            a = time.thread_time()
            stock(pixels, grid_thw=grid)
            b = time.thread_time()
            fast(pixels, grid_thw=grid)
            ratios.append((time.thread_time() - b) / max(b - a, 1e-6))
    torch.testing.assert_close(out.pooler_output, reference.pooler_output, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.last_hidden_state, reference.last_hidden_state, rtol=1e-5, atol=1e-5)
    stats = encgraph.graphs(fast).stats
    assert stats["eager_reasons"] == {CPU_PASSTHROUGH: 10} and stats["calls"] == 0
    assert not encgraph.graphs(fast).runner.captured  # nothing captured, padded or self-checked on a CPU
    assert first <= FIRST_CALL_S, f"first call {first:.2f} s of CPU"
    assert statistics.median(ratios) <= PER_CALL_RATIO, ratios


HOOK_RATIO, HOOK_US = 1.1, 50.0
"""Issue 55: a wrapped call on the CPU costs at most 1.1x the module's + 50 us."""


@pytest.mark.parametrize("family", ["siglip", "clip"])
def test_tiny_fixed_towers_cost_their_forward_on_the_cpu(family: str) -> None:
    from tests.models.fixtures_fixed import images, tiny_clip, tiny_siglip

    tower = (tiny_siglip if family == "siglip" else tiny_clip)().eval()
    stock = copy.deepcopy(tower)
    fast = encgraph.graphed(tower)
    x = images(2)
    plain, wrapped = [], []
    with torch.no_grad():
        torch.testing.assert_close(fast(x).last_hidden_state, stock(x).last_hidden_state)
        for i in range(301):  # alternating, the first of each pair alternating too: load hits both alike
            for fn, times in ((stock, plain), (fast, wrapped)) if i % 2 else ((fast, wrapped), (stock, plain)):
                t = time.perf_counter()
                fn(x)
                times.append(time.perf_counter() - t)
    base, got = statistics.median(plain), statistics.median(wrapped)
    print(f"{family}: wrapped {got * 1e6:.0f} us, module {base * 1e6:.0f} us")
    assert got <= HOOK_RATIO * base + HOOK_US * 1e-6, f"{family}: wrapped {got * 1e6:.0f} us, module {base * 1e6:.0f} us"
