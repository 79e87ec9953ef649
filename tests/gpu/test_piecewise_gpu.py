"""Piecewise replays on a GPU (``encgraph.capture.piecewise``): the budgets whose sequences can reach the measured
dense crossover are captured a second time, split at each full-attention call, and a replay then attends its long
sequences on the dense kernel between the segments. Every item of a piecewise replay equals the eager forward's
(and the whole graph's) on fresh random inputs, in ``inference_mode`` and ``no_grad``; a NaN item poisons only its
own rows; the runner's defaults choose piecewise replays for batches of one long image. Qwen3-VL-8B and GLM-4.1V
towers at real geometry, fewer layers; ``pytest -s`` prints whole against piecewise replay times."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from encgraph.capture.execution import run_static
from encgraph.capture.records import RunMode
from encgraph.capture.runner import EncoderGraphRunner
from encgraph.models import wrap
from encgraph.packing.kernels import LEDGER
from tests.gpu.test_compiled_eager_gpu import _items, _tower
from tests.gpu.test_qwen_gpu import HF_RTOL, cuda_ms, rel
from tests.models.test_kernel_choice import dense_spy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BUDGETS = [64, 256, 768, 1280]  # output tokens: 1280 holds one 5,120-row image


def _captured(family):
    adapter = wrap(_tower(family))
    runner = EncoderGraphRunner(adapter, budgets=BUDGETS, max_items=8)
    info = runner.capture()
    rules = [r for r in (adapter.kernel_rows or {}).values() if getattr(r, "min_rows", None) is not None]
    if not rules:
        pytest.skip("capture chose a varlen kernel for every length (FlashAttention-4): nothing runs dense")
    split = {b: r.piecewise for b, r in runner.records["default"].items() if r.piecewise is not None}
    assert split, [r.summary() for r in runner.records["default"].values()]
    assert info["piecewise"]["graphs"] == len(split) and info["piecewise"]["static_bytes"] > 0
    return adapter, runner, split, min(r.min_rows for r in rules)


def _sub(adapter, gen, shapes, nan_item=None):
    inputs = _items(adapter, gen, shapes)
    if nan_item is not None:
        start = int(inputs.grid[:nan_item].prod(1).sum())
        inputs.pixel_values[start:start + int(inputs.grid[nan_item].prod())] = float("nan")
    return inputs


@pytest.mark.parametrize("family", ["qwen3_vl", "glm4v"])
def test_piecewise_replays_equal_eager_per_item(family, monkeypatch):
    adapter, runner, split, min_rows = _captured(family)
    top = max(split)
    gen = np.random.default_rng(23)
    dense = dense_spy(monkeypatch)
    worst = 0.0
    for case in range(6):
        # One long image (rows from the crossover up to the budget's) and 0-3 small ones, all within the top budget.
        side = int(np.sqrt(gen.integers(min_rows, max(min_rows + 1, top * 4 - 1024)))) // 2 * 2
        shapes = [(side, side)] + [tuple(int(x) * 2 for x in gen.integers(2, 9, 2)) for _ in range(int(gen.integers(0, 4)))]
        gen.shuffle(shapes)
        sub = _sub(adapter, gen, shapes, nan_item=0 if case == 5 else None)
        used = int(sub.grid.prod(1).sum()) // 4
        budget = min(b for b in split if b >= used)
        grad = torch.inference_mode if case % 2 else torch.no_grad
        with grad(), LEDGER.buying():  # plans bought at once: the steady state
            pieces = {n: t.clone() for n, t in run_static(runner, "default", budget, sub, used, piecewise=True).items()}
            whole = {n: t.clone() for n, t in run_static(runner, "default", budget, sub, used, piecewise=False).items()}
            eager = adapter.forward_eager("default", sub)
        offset = 0
        for i, (h, w) in enumerate(sub.grid[:, 1:].tolist()):
            n = h * w // 4
            for name in ("pooler_output",):
                p, g, e = (t[name][offset:offset + n] for t in (pieces, whole, eager))
                if case == 5 and i == 0:
                    assert torch.isnan(p).all() and torch.isnan(e).all(), (case, i)
                    continue
                assert torch.isfinite(p).all(), (case, i, shapes)
                err = max(rel(p, e), rel(p, g))
                worst = max(worst, err)
                assert err < HF_RTOL, (case, i, shapes, name, rel(p, e), rel(p, g))
            offset += n
    assert any(r >= min_rows for r in dense), sorted(set(dense))  # long sequences ran on the dense kernel
    print(f"\n{family}: piecewise budgets {sorted(split)}, min_rows {min_rows}, worst norm-relative {worst:.2e}")


@pytest.mark.parametrize("family", ["qwen3_vl", "glm4v"])
def test_defaults_replay_one_long_image_piecewise(family):
    adapter, runner, split, _ = _captured(family)
    top = max(split)
    plain = EncoderGraphRunner(adapter, budgets=BUDGETS, max_items=8, mode=RunMode.EAGER)
    gen = np.random.default_rng(29)
    side = int(np.sqrt(top * 4 * 0.85)) // 2 * 2  # one image at 85% of the top budget's rows
    for case in range(4):
        inputs = _sub(adapter, gen, [(side, side)])
        with LEDGER.buying(), (torch.inference_mode if case % 2 else torch.no_grad)():
            got, want = runner(inputs), plain(inputs)
        err = rel(got[0]["pooler_output"], want[0]["pooler_output"])
        assert torch.isfinite(got[0]["pooler_output"]).all() and err < HF_RTOL, (case, err)
    stats = runner.stats
    record = split[top]
    bounds = [(0, side * side)] * len(record.sites)
    with LEDGER.buying(), torch.inference_mode():
        sub = _sub(adapter, gen, [(side, side)])
        run_static(runner, "default", top, sub, side * side // 4, piecewise=False)
        whole_ms = cuda_ms(lambda: runner.records["default"][top].graph.replay())
        piece_ms = cuda_ms(lambda: record.replay(bounds))
        eager_ms = cuda_ms(lambda: runner.compiled_eager.forward(adapter, "default", sub))
    print(f"\n{family}: one {side} x {side} image at budget {top}: whole {whole_ms:.2f} ms, piecewise "
          f"{piece_ms:.2f} ms, compiled eager {eager_ms:.2f} ms; capture: {record.summary()}; "
          f"piecewise replays {stats['paths']['default']['piecewise_replays']}, eager {stats['eager_reasons']}")
    # Where the split measured faster at capture, the defaults chose it (replayed piecewise, or rerouted from eager).
    if record.dense_ms < record.whole_ms and record.pays(bounds):
        assert sum(stats["paths"]["default"]["piecewise_replays"].values()) >= 1, stats


@pytest.mark.parametrize("family", ["qwen3_vl", "glm4v"])
def test_a_new_image_size_runs_dense_at_once_on_a_plan_built_at_capture(family, monkeypatch):
    """Capture builds the split calls' plans at bucket lengths up to the largest split budget's rows: an image size
    the thread never met replays piecewise with its long sequence on the dense kernel padded to its bucket (standing
    in while its own length rents, or its run length where buckets start), without buying a plan inside the
    call, and equals the eager forward per item. A size whose padded call would lose to varlen rents varlen."""
    from encgraph.models import kernel_choice, sequence_bounds
    from encgraph.packing.kernels import bucket_rows

    adapter, runner, split, min_rows = _captured(family)
    geometry, table_rule = next((g, r) for g, r in adapter.kernel_rows.items()
                                if getattr(r, "min_rows", None) is not None)
    rule = next(iter(split.values())).sites[0].attention.rule
    assert rule.replayed and rule.crossover is table_rule.crossover
    if rule.warm_from is None:
        pytest.skip(f"the padded call's device time never beat varlen: {rule.crossover.to_dict()}")
    top = max(split)
    key = sequence_bounds.ledger_key(*geometry, runner.device, replayed=True)
    lengths = kernel_choice.warm_lengths(rule, (min_rows, top * 4))
    assert lengths and all(LEDGER.bought(key, n) for n in lengths), (lengths, runner.capture_info["piecewise"])
    padded: list[tuple[int, int]] = []
    dense_spy(monkeypatch, padded)
    gen = np.random.default_rng(31)
    h = int(np.sqrt(top * 4)) // 2 * 2

    def bucketed(rows: int) -> bool:  # runs padded to its bucket, whose plan capture built
        return rule.stand_in_rows(rows) is not None or (rule.run_rows(rows) != rows and rule.may_run_dense(rows))

    # Row counts no bucket has, from where buckets may run: three padded at their bucket, and one (where there is
    # one) just past a bucket's start, where padding costs more than varlen and the call stays varlen.
    sizes = [(h, w) for w in range(h - 2, 0, -2) if h * w >= max(min_rows, rule.warm_from)
             and bucket_rows(h * w) != h * w]
    dense = [s for s in sizes if bucketed(s[0] * s[1])][:3]
    stays = [s for s in sizes if not bucketed(s[0] * s[1])][:1]
    assert len(dense) == 3, (sizes, rule.crossover.to_dict())
    for case, (h, w) in enumerate(dense + stays):
        rows = h * w
        sub = _sub(adapter, gen, [(h, w), (8, 6)])
        used = int(sub.grid.prod(1).sum()) // 4
        before = LEDGER.stats()
        with (torch.inference_mode if case % 2 else torch.no_grad)():
            got = {n: t.clone() for n, t in run_static(runner, "default", top, sub, used, piecewise=True).items()}
            after = LEDGER.stats()
            want = adapter.forward_eager("default", sub)
        moved = {k: after[k] - before[k] for k in after}
        assert moved["bought"] == 0, (case, moved)  # no plan bought inside the call
        if case < 3:  # every call at the bucket: as its run length (nothing rented) or standing in (all rented)
            assert moved["stand_in_calls"] == moved["rented_calls"] in (0, len(split[top].sites)), (case, moved)
        else:
            assert moved["stand_in_calls"] == 0, (case, moved)
        assert ((rows, bucket_rows(rows)) in padded) == (case < 3), (case, rows, padded[-3:])
        offset = 0
        for n in (rows // 4, 12):
            p, e = got["pooler_output"][offset:offset + n], want["pooler_output"][offset:offset + n]
            assert torch.isfinite(p).all() and rel(p, e) < HF_RTOL, (case, n, rel(p, e))
            offset += n
    c = rule.crossover
    print(f"\n{family}: padded at {dense}, varlen at {stays}; capture built {runner.capture_info['piecewise']['warmed_plans']}; "
          f"split calls stand in from {c.replay_stand_in_from} and bucket from {c.replay_bucket_from} rows (eager "
          f"{c.stand_in_from} and {c.bucket_from}); padded replay ms {list(c.padded_replay_ms)}, dense {list(c.dense_ms)}")
