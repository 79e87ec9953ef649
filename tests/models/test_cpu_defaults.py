"""The CPU defaults cost no more than the tower (issue 31, point 1): the README's tiny Qwen2.5-VL tower wrapped with
``graphed(tower)`` and no options answers its first call within 2 s (capture included: nothing is padded, captured
or self-checked on a CPU) and every call within 1.2x the tower's own forward, equal to it.

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
from encgraph.capture.records import RunMode  # noqa: E402
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
    assert encgraph.graphs(fast).runner.mode is RunMode.EAGER and encgraph.graphs(fast).stats["capture"]["graphs"] == 0
    assert first <= FIRST_CALL_S, f"first call {first:.2f} s of CPU"
    assert statistics.median(ratios) <= PER_CALL_RATIO, ratios
