"""The runner's defaults never cost more than the work itself (issue 31), on the CPU with the toy tower:

- EAGER is the CPU default: no buffers, no capture, no self-check; every item through the adapter's eager forward;
- capture-time work never fails a valid call: an adapter whose ``sample_inputs`` raises at some sizes loses those
  budgets (reason in ``capture_info["failed"]``), and the call is answered;
- the cost model corrects itself while serving: a model that prices replays 10^4 times too high (every batch
  "eager is cheaper") sees explored replays and is corrected within the stated bound; ``stats`` counts it; a model
  that replaces it (assigned, measured, or dropped by a recapture) starts unscaled.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from encgraph.capture import EncoderGraphRunner, RunMode
from encgraph.capture.feedback import EXPLORE_EVERY, MIN_SAMPLES, SAMPLE_EVERY
from encgraph.errors import ConfigTypeError, InputError
from encgraph.packing import CostModel
from tests.toy_models import ToyAdapter, ToyInputs, ToyTower, random_inputs, reference


class SampledToy(ToyAdapter):
    """The toy with ``sample_inputs``: one item of one sequence; refuses (as an adapter's own validation would)
    samples over ``refuse_over`` tokens."""

    refuse_over = 10**9

    def sample_inputs(self, path: str, tokens: int) -> ToyInputs:
        if tokens > self.refuse_over:
            raise InputError(f"toy: a sample of {tokens} tokens is outside what this toy accepts")
        c = self.towers[path].lin1.in_features
        return ToyInputs({path: torch.randn(tokens, c)}, {path: ((tokens,),)})


def toy(**kw) -> SampledToy:
    torch.manual_seed(0)
    return SampledToy({"default": ToyTower()}, min_budget=16, max_budget=128, **kw)


def test_eager_is_the_cpu_default() -> None:
    adapter = toy()
    runner = EncoderGraphRunner(adapter)
    inputs = random_inputs(np.random.default_rng(0), adapter, 5, max_len=40)
    out = runner(inputs)
    for a, b in zip(out, reference(adapter, inputs)):
        torch.testing.assert_close(a, b)
    assert runner.mode is RunMode.EAGER and not runner.buffers
    assert runner.stats["eager_items"] == 5 and runner.capture_info["selfcheck"]["verify"] is False


def test_a_failing_sample_drops_its_budget_not_the_call() -> None:
    adapter = toy()
    adapter.refuse_over = 40
    runner = EncoderGraphRunner(adapter, mode=RunMode.STATIC, budgets=[16, 32, 64, 128])
    inputs = random_inputs(np.random.default_rng(1), adapter, 4, max_len=30)
    for a, b in zip(runner(inputs), reference(adapter, inputs)):
        torch.testing.assert_close(a, b)
    failed = runner.capture_info["failed"]["default"]
    assert sorted(failed) == [64, 128] and all("InputError" in r and "toy" in r for r in failed.values())
    assert runner.capture_info["selfcheck"]["checked"]["default"].keys() == {16, 32}


def wrong_model() -> CostModel:
    """Replays priced 10^4 times too high: every batch "eager is cheaper"."""
    return CostModel.linear(["default"], graph_fixed_ms=1e4, graph_per_budget_ms=0, eager_fixed_ms=0.5,
                            eager_per_token_ms=0)


def serve_until_corrected(runner: EncoderGraphRunner, adapter: SampledToy, gen: np.random.Generator) -> None:
    calls = 0
    bound = EXPLORE_EVERY * MIN_SAMPLES + 1
    while runner.stats["cost_feedback"]["scale"].get("default", {}).get("graph", 1.0) == 1.0:  # since the model came
        runner(random_inputs(gen, adapter, 1, max_len=40, max_frames=1))
        calls += 1
        assert calls <= bound, runner.stats["cost_feedback"]


def test_a_wrong_cost_model_is_corrected_within_the_bound() -> None:
    adapter = toy()
    runner = EncoderGraphRunner(adapter, mode=RunMode.STATIC, costs=wrong_model(), budgets=[16, 32, 64, 128])
    serve_until_corrected(runner, adapter, np.random.default_rng(2))
    feedback = runner.stats["cost_feedback"]
    assert feedback["explored"] >= MIN_SAMPLES and feedback["scale"]["default"]["graph"] < 1e-2
    assert runner.costs.graph_cost("default", 64) < 100  # from 10^4 ms to the order of what a replay takes
    replays = sum(runner.stats["paths"]["default"]["replays"].values())
    assert replays >= MIN_SAMPLES and SAMPLE_EVERY >= 1


@pytest.mark.parametrize("replace", ["assign", "measure_costs", "recapture"])
def test_a_replaced_cost_model_starts_unscaled(replace: str) -> None:
    """What the feedback learned about one model (its scale, samples not yet acted on) never carries over to the
    model that replaces it."""
    adapter = toy()
    runner = EncoderGraphRunner(adapter, mode=RunMode.STATIC, costs=wrong_model(), budgets=[16, 32, 64, 128])
    gen = np.random.default_rng(3)
    serve_until_corrected(runner, adapter, gen)
    learned = runner.stats["cost_feedback"]
    assert learned["scale"]["default"]["graph"] < 1e-2
    if replace == "assign":
        with pytest.raises(ConfigTypeError, match="costs: expected a CostModel or None"):
            runner.costs = "costs.json"
        runner.costs = wrong_model()
    elif replace == "measure_costs":
        runner.measure_costs([random_inputs(gen, adapter, n, max_len=40, max_frames=1) for n in (1, 2, 4)], repeats=1)
    else:
        runner.recapture(budgets=[16, 64])
    feedback = runner.stats["cost_feedback"]
    assert feedback["scale"] == {} and feedback["corrections"] == learned["corrections"]  # counters: kept
    if replace == "assign":  # the same wrong prices again: checked from scratch, and corrected again
        serve_until_corrected(runner, adapter, gen)
        assert runner.costs.graph_cost("default", 64) < 100


def test_eager_runs_the_model_did_not_choose_never_correct_it() -> None:
    """Eager priced 10^-6 ms, far below what it takes. Items over the largest budget run eagerly whatever the price
    (``tokens over the largest budget``): they are counted as ``unchosen`` and never scale the eager curve, however
    many run. The same wrong price on batches the model sent eagerly as cheaper is corrected within the bound."""
    adapter = toy()
    costs = CostModel.linear(["default"], graph_fixed_ms=1.0, graph_per_budget_ms=0, eager_fixed_ms=1e-6,
                             eager_per_token_ms=0)
    runner = EncoderGraphRunner(adapter, mode=RunMode.STATIC, costs=costs, budgets=[16, 32, 64, 128])
    gen = np.random.default_rng(5)
    calls = SAMPLE_EVERY * MIN_SAMPLES + 2
    for _ in range(calls):
        inputs = adapter.sample_inputs("default", int(gen.integers(129, 200)))
        for a, b in zip(runner(inputs), reference(adapter, inputs)):
            torch.testing.assert_close(a, b)
    feedback = runner.stats["cost_feedback"]
    assert runner.stats["eager_reasons"] == {"tokens over the largest budget": calls}
    assert feedback["unchosen"] == calls and feedback["scale"] == {} and feedback["samples"] == 0
    runner.reset_stats()
    chosen = 0
    while runner.stats["cost_feedback"]["scale"].get("default", {}).get("eager", 1.0) == 1.0:
        runner(random_inputs(gen, adapter, 1, max_len=40, max_frames=1))
        chosen += 1
        assert chosen <= SAMPLE_EVERY * MIN_SAMPLES + 1, runner.stats["cost_feedback"]
    stats = runner.stats  # every call chose eager, but for the explored replays
    assert stats["eager_reasons"] == {"eager is cheaper": chosen - stats["cost_feedback"]["explored"]}
    assert runner.stats["cost_feedback"]["scale"]["default"]["eager"] > 1e2
