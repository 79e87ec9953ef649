"""Data-parallel encoding (``encgraph.capture.distributed``) on CPU processes joined by gloo on localhost.

The multi-rank tests spawn 2 and 3 processes once each and run every scenario in them in lockstep; a scenario
records failed checks instead of raising (a rank that stopped early would leave the others waiting in a
collective), and the parent asserts on the reports. The gloo timeout and the parent's deadline are short, so a
hang fails in seconds.
"""

from __future__ import annotations

import collections
import datetime
import gc
import json
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from encgraph.capture.records import RunMode
from encgraph.capture import EncoderGraphRunner
from encgraph.capture.distributed import (
    DataParallelEncoder,
    RemoteRankError,
    flatten_result,
)
from encgraph.errors import ConfigError, ConfigTypeError, InputError
from encgraph.packing import balance
from tests.toy_models import ToyAdapter, ToyInputs, ToyTower, random_inputs, reference

GLOO_TIMEOUT = datetime.timedelta(seconds=15)
Pair = collections.namedtuple("Pair", "first second")


# ---------------------------------------------------------------------------------------------- spawning helpers
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(fn: Callable[..., None], world: int, outdir: Path, *args: Any, deadline_s: float = 90.0) -> list[dict]:
    """Run ``fn(rank, world, port, outdir, *args)`` in ``world`` spawned processes; return each rank's report
    (``outdir/rank{r}.json``). Kills the processes and fails if they run past ``deadline_s``."""
    ctx = mp.start_processes(fn, args=(world, free_port(), str(outdir), *args), nprocs=world, join=False,
                             start_method="spawn")
    end = time.monotonic() + deadline_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > end:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"{world} ranks still running after {deadline_s} s: a collective hung")
    return [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(world)]


class Report:
    """Checks that record instead of raising, so that every rank keeps issuing the same collectives."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.checks = 0
        self.failures: list[str] = []
        self.info: dict[str, Any] = {}

    def check(self, ok: bool, what: str) -> None:
        self.checks += 1
        if not ok:
            self.failures.append(f"rank {self.rank}: {what}")

    def raises(self, kind: type[BaseException], fn: Callable[[], Any], what: str) -> BaseException | None:
        try:
            fn()
        except kind as exc:
            self.check(True, what)
            return exc
        except Exception as exc:  # noqa: BLE001 - the wrong error is a failed check, not a stop
            self.check(False, f"{what}: expected {kind.__name__}, got {type(exc).__name__}: {exc}")
            return None
        self.check(False, f"{what}: expected {kind.__name__}, nothing raised")
        return None

    def save(self, outdir: str) -> None:
        data = {"checks": self.checks, "failures": self.failures, "info": self.info}
        Path(outdir, f"rank{self.rank}.json").write_text(json.dumps(data))


def init_gloo(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)  # up to 3 ranks share the test machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=GLOO_TIMEOUT)


def run_scenarios(rank: int, outdir: str, scenarios: list[Callable[[Report], None]]) -> None:
    report = Report(rank)
    try:
        for scenario in scenarios:
            try:
                scenario(report)
            except Exception:  # noqa: BLE001 - recorded; the other scenarios still run
                report.failures.append(f"rank {rank}: {scenario.__name__} raised\n{traceback.format_exc()}")
    finally:
        report.save(outdir)
        gc.collect()  # drop encoders and exceptions (reference cycles) while the group still exists
        # Leave together: a rank tearing gloo down while a peer still talks to it can abort at exit.
        dist.barrier()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- models and checks
def one_path() -> ToyAdapter:
    torch.manual_seed(0)  # the same weights on every rank
    return ToyAdapter({"default": ToyTower()}, min_budget=16, max_budget=128)


def two_path() -> ToyAdapter:
    torch.manual_seed(1)
    return ToyAdapter({"global": ToyTower(), "local": ToyTower()}, empty=("local",), min_budget=16, max_budget=128)


def make_inputs(adapter: ToyAdapter, n: int, seed: int) -> ToyInputs:
    torch.manual_seed(seed)  # random_inputs draws rows from torch's global generator
    return random_inputs(np.random.default_rng(seed), adapter, n, max_len=60)


def shares_of(adapter: ToyAdapter, inputs: ToyInputs, world: int) -> tuple[tuple[int, ...], ...]:
    return balance([s.total_tokens for s in adapter.item_specs(inputs)], world)


def check_against_single_process(report: Report, adapter: ToyAdapter, inputs: ToyInputs, out: list, world: int,
                                 tag: str) -> None:
    """Per item: exactly the single-process runner's result on the share the item ran in (the same plan, the
    same padded buffers, so the same bits), and close to a single-process run of the whole call and to eager."""
    single = EncoderGraphRunner(adapter, mode=RunMode.STATIC)
    exact: list[Any] = [None] * inputs.n
    for share in shares_of(adapter, inputs, world):
        if share:
            for i, r in zip(share, single(adapter.select(inputs, share))):
                exact[i] = r
    whole, eager = single(inputs), reference(adapter, inputs)
    report.check(len(out) == inputs.n, f"{tag}: {len(out)} results for {inputs.n} items")
    for i, o in enumerate(out[: inputs.n]):
        report.check(o.shape == exact[i].shape and torch.equal(o, exact[i]), f"{tag}: item {i} differs from its share's single-process run")
        report.check(torch.allclose(o, whole[i], atol=1e-5, rtol=1e-5), f"{tag}: item {i} far from the whole call's single-process run")
        report.check(torch.allclose(o, eager[i], atol=1e-5, rtol=1e-5), f"{tag}: item {i} far from eager")


def structured(sub: ToyInputs) -> list[Any]:
    """A result per item made of every container kind and several dtypes, with shapes that vary per item; items
    with an even row count carry an extra key (two structures in one call)."""
    # Imported here: only this scenario needs transformers.
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    out = []
    offset = 0
    for item in sub.seqs["default"]:
        n = sum(item)
        rows = sub.rows["default"][offset : offset + n]
        offset += n
        r: dict[str, Any] = {
            "rows": rows,
            "lens": torch.tensor(item, dtype=torch.int64),
            "pair": Pair(rows[:, :3].to(torch.bfloat16), rows[:0]),
            "hf": BaseModelOutputWithPooling(last_hidden_state=rows * 2, pooler_output=rows.sum(0)),
            "nested": [(rows > 0, torch.tensor(float(n))), collections.OrderedDict(t=rows.T.contiguous())],
            "half": rows[:, :1].half(),
        }
        if n % 2 == 0:
            r["even"] = torch.arange(n, dtype=torch.int32).view(-1, 1).expand(n, 2)  # non-contiguous leaf
        out.append(r)
    return out


def same_structured(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        # Results come back on the communication device (documented): compare values, not placement.
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b.to(a.device))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_structured(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(same_structured(x, y) for x, y in zip(a, b))


def check_structured_calls(report: Report, adapter: ToyAdapter, calls: list[tuple[int, int]]) -> DataParallelEncoder:
    """Data-parallel calls of :func:`structured` (``(items, seed)`` each): every item rebuilt exactly."""
    dp = DataParallelEncoder(structured, adapter=adapter)
    for n, seed in calls:
        inputs = make_inputs(adapter, n, seed)
        out, ref = dp(inputs), structured(inputs)
        for i in range(n):
            report.check(same_structured(out[i], ref[i]), f"structured item {i} of {n} not rebuilt exactly")
    return dp


# ---------------------------------------------------------------------------------------------- scenarios (every rank)
def make_scenarios(rank: int, world: int) -> list[Callable[[Report], None]]:
    def toy_calls(report: Report) -> None:
        adapter = one_path()
        runner = EncoderGraphRunner(adapter, mode=RunMode.STATIC)
        dp = DataParallelEncoder(runner)
        total_items, total_tokens, idle = 0, 0, 0
        for n, seed in [(7, 1), (1, 2), (world - 1, 3), (2 * world + 3, 4), (1, 5)]:
            inputs = make_inputs(adapter, n, seed)
            idle += not shares_of(adapter, inputs, world)[rank]
            out = dp(inputs)
            check_against_single_process(report, adapter, inputs, out, world, f"one path, {n} items")
            total_items += n
            total_tokens += sum(s.total_tokens for s in adapter.item_specs(inputs))
        s = dp.stats
        report.check(s["calls"] == 5 and s["items"] == total_items, f"stats calls/items {s['calls']}/{s['items']}")
        report.check(sum(s["items_per_rank"]) == total_items, f"items_per_rank {s['items_per_rank']}")
        report.check(s["local"]["items"] == s["local_items"], "the local runner ran exactly the local items")
        report.check(s["idle_calls"] == idle and (idle >= 2) == (rank > 0), f"idle calls {s['idle_calls']}, expected {idle}")
        report.check(s["tensor_collectives"] == 11 and s["object_collectives"] == 1,
                     f"collectives {s['tensor_collectives']} tensor, {s['object_collectives']} object "
                     "(2 per call, plus one object and one meta gather for the first structure)")
        g = dp.global_stats()
        report.check(g["items"] == g["dp_items"] == total_items and g["calls"] == 5,
                     f"global items/calls {g['items']}/{g['calls']}")
        report.check(g["graph_items"] + g["eager_items"] == total_items, f"global graph+eager items {g}")
        report.check(sum(p["local_items"] for p in g["per_rank"]) == total_items, "local items sum to the items")
        report.check(g["paths"]["default"]["real_tokens"] == total_tokens, "real tokens counted once")
        report.info["items_per_rank"] = s["items_per_rank"]
        dp.reset_stats()
        report.check(dp.stats["items"] == 0 and dp.stats["items_per_rank"] == [0] * world, "reset_stats")

    def two_path_calls(report: Report) -> None:
        adapter = two_path()
        dp = DataParallelEncoder(EncoderGraphRunner(adapter, mode=RunMode.STATIC))
        for n, seed in [(9, 11), (1, 12), (2, 13)]:
            inputs = make_inputs(adapter, n, seed)
            check_against_single_process(report, adapter, inputs, dp(inputs), world, f"two paths, {n} items")

    def structures(report: Report) -> None:
        dp = check_structured_calls(report, one_path(), [(5, 21), (1, 22), (world + 2, 23)])
        report.check(dp.stats["structures"] == 2, f"{dp.stats['structures']} structures registered, expected 2")

    def failures(report: Report) -> None:
        adapter = one_path()
        runner = EncoderGraphRunner(adapter, mode=RunMode.STATIC)
        inputs = make_inputs(adapter, 1, 31)  # one item: rank 0 runs it, the others are idle

        def boom(sub: ToyInputs) -> list:
            raise ValueError("boom on the only busy rank")

        expected = ValueError if rank == 0 else RemoteRankError
        exc = report.raises(expected, lambda: DataParallelEncoder(boom, adapter=adapter)(inputs), "local failure")
        report.check(exc is not None and "boom" in str(exc), f"failure message reaches every rank: {exc}")
        expected = ConfigTypeError if rank == 0 else RemoteRankError
        bad = DataParallelEncoder(lambda sub: [{"a": "not a tensor"}], adapter=adapter)
        exc = report.raises(expected, lambda: bad(inputs), "non-tensor leaf")
        report.check(exc is not None and "['a']" in str(exc), f"the error names the leaf: {exc}")
        # A call after a failure still works: nothing is left half-exchanged.
        dp = DataParallelEncoder(runner)
        more = make_inputs(adapter, 4, 32)
        check_against_single_process(report, adapter, more, dp(more), world, "after failures")
        # Ranks given different items all raise (the checksum of the specs differs), none hangs.
        other = make_inputs(adapter, world, 40 + rank)
        report.raises(InputError, lambda: dp(other), "different inputs per rank")

    return [toy_calls, two_path_calls, structures, failures]


def gloo_worker(rank: int, world: int, port: int, outdir: str) -> None:
    init_gloo(rank, world, port)
    run_scenarios(rank, outdir, make_scenarios(rank, world))


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("world", [2, 3])
def test_gloo_ranks_equal_single_process(world, tmp_path):
    reports = spawn_ranks(gloo_worker, world, tmp_path)
    failures = [f for r in reports for f in r["failures"]]
    assert not failures, "\n".join(failures)
    assert all(r["checks"] > 100 for r in reports), [r["checks"] for r in reports]
    assert len({json.dumps(r["info"]["items_per_rank"]) for r in reports}) == 1  # every rank saw the same plan


def test_world_of_one_in_process(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=GLOO_TIMEOUT)
    try:
        adapter = two_path()
        runner = EncoderGraphRunner(adapter, mode=RunMode.STATIC)
        dp = DataParallelEncoder(runner)
        assert repr(dp).startswith("DataParallelEncoder(rank=0, world_size=1, backend='gloo'")
        inputs = make_inputs(adapter, 6, 3)
        out = dp(inputs)
        plain = runner(inputs)  # one rank: the share is the whole call, in order, so the same plan
        assert all(torch.equal(a, b) for a, b in zip(out, plain, strict=True))
        with pytest.raises(InputError, match="empty batch"):
            dp(adapter.select(inputs, []))
        g = dp.global_stats()
        assert g["dp_items"] == 6 and g["calls"] == 1 and g["items"] == runner.stats["items"] == 12  # + the direct call
        assert DataParallelEncoder(runner, device="cpu").device == torch.device("cpu")
        with pytest.raises(ConfigTypeError, match="device"):
            DataParallelEncoder(runner, device=3.5)
    finally:
        dist.destroy_process_group()


def test_needs_an_initialised_group():
    with pytest.raises(ConfigError, match="init_process_group"):
        DataParallelEncoder(EncoderGraphRunner(one_path(), mode=RunMode.STATIC))


@pytest.mark.parametrize(
    "runner, adapter, match",
    [(42, None, "runner: expected a callable"), (lambda sub: [], None, "adapter: expected an adapter")],
)
def test_bad_arguments(runner, adapter, match):
    with pytest.raises(ConfigTypeError, match=match):
        DataParallelEncoder(runner, adapter=adapter)


def test_flatten_round_trip_and_errors():
    adapter = one_path()
    inputs = make_inputs(adapter, 4, 7)
    for result in structured(inputs):
        structure, leaves = flatten_result(result)
        assert same_structured(structure.rebuild(leaves), result)
        assert structure.words == 1 + sum(t.dim() for t in leaves)
    with pytest.raises(ConfigTypeError, match=r"result\['x'\]\[1\]: .*got None"):
        flatten_result({"x": [torch.ones(1), None]})
    with pytest.raises(ConfigTypeError, match="defaultdict"):
        flatten_result(collections.defaultdict(list, a=torch.ones(1)))
