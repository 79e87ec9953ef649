"""Deferred plan purchases wired end to end on the CPU: a runner call's eager forward through a Qwen adapter, the
host plan and the process's plan ledger, with the stand-in varlen kernel of ``test_kernel_choice`` (the CPU has
none); the ledger's own rules are ``tests/unit/test_plan_ledger.py``'s."""

from __future__ import annotations

import pytest
import torch

from encgraph.models import kernel_choice, sequence_bounds
from encgraph.packing.kernels import Crossover, DenseRule
from tests.models.test_kernel_choice import dense_spy, fake_varlen  # noqa: F401 - fake_varlen: a fixture


@pytest.mark.usefixtures("fake_varlen")
def test_a_runner_call_defers_the_plan_its_eager_forward_buys(monkeypatch):
    """Wired end to end (runner, adapter, host plan, ledger), with the stand-in varlen kernel: a runner call whose
    eager forward buys the plan of a length rents it to the forward's end, and the plan is built once, after the
    forward, by ``dense_plans.plan_build`` with the layout of the adapter's own attention call; the next call runs
    that length dense at once. Every call equals the tower's own forward per item."""
    import numpy as np

    from encgraph.capture import EncoderGraphRunner, RunMode
    from encgraph.models import dense_plans, wrap
    from encgraph.models.qwen_vl import QwenVisionInputs
    from tests.models import conftest as qwen

    ledger = sequence_bounds.LEDGER  # the process's: the runner's deferring block is on it
    ledger.clear()
    deferred = ledger.stats()["deferred"]
    monkeypatch.setattr(sequence_bounds, "_rents", lambda device: True)  # the stand-in varlen kernel rents
    torch.manual_seed(0)
    tower = qwen.qwen2_vl_tower()
    adapter = wrap(tower)
    runner = EncoderGraphRunner(adapter, budgets=[16, 32], max_items=2, mode=RunMode.EAGER, compile=False,
                                progress=False)
    grid = np.array([[1, 8, 8]], dtype=np.int64)  # one image of 64 rows: eager, over the ladder
    pixels = qwen.random_pixels(grid)
    want = adapter.forward_eager("default", QwenVisionInputs(pixels, grid))["pooler_output"]
    runner.capture()
    heads, head_dim = kernel_choice.tower_geometries(adapter._module)[0]
    c = Crossover("cpu", heads, head_dim, "float32", (16, 64), (1.0, 16.0), (0.5, 8.0), dense_first_ms=(30.5, 38.0))
    calls = adapter._module.config.depth
    rule = DenseRule(c.min_rows, c, calls=calls)
    assert 0 < calls * rule.gain_ms(64) < rule.plan_ms  # bought over several forwards, not at first sight
    adapter.kernel_rows = {(heads, head_dim, torch.float32): rule}
    key = sequence_bounds.ledger_key(heads, head_dim, torch.float32, torch.device("cpu"))
    builds: list[int] = []
    layouts: list[tuple] = []
    plan_build = dense_plans.plan_build

    def recording(q, k, v, scale):
        layouts.append((q.stride(), k.stride(), v.stride(), tuple(q.shape[1:])))
        build = plan_build(q, k, v, scale)
        return lambda rows: (builds.append(rows), build(rows))[1]

    monkeypatch.setattr(dense_plans, "plan_build", recording)
    dense = dense_spy(monkeypatch)
    for call in range(20):
        before = list(dense)
        out = runner(adapter.inputs(pixels, grid))
        torch.testing.assert_close(out[0]["pooler_output"], want, rtol=1e-5, atol=1e-5)
        if builds:
            break
    assert builds == [64] and len(layouts) == 1 and ledger.bought(key, 64) and ledger.due() == 0
    assert dense == before  # the call that bought it ran it on varlen to its end
    runner(adapter.inputs(pixels, grid))
    assert dense[len(before):] == [64] * calls  # the next call: dense at once, in every layer
    assert ledger.stats()["deferred"] == runner.stats["kernel_plans"]["deferred"] == deferred + 1
    ledger.clear()
