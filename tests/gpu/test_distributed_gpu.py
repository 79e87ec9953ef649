"""Data-parallel encoding over NCCL: a group of one on one GPU, and one process per GPU when there are 2 or more.

The toy tower runs captured (GRAPH mode). Its static forward sums sequences with ``index_add_`` (atomic adds on
CUDA), so two runs need not agree to the bit: results are compared with the single-GPU run to fp32 rounding
(TF32 off), while the transport itself is checked exactly (every rank's local results, gathered independently
with ``all_gather_object``, against what the encoder handed out; structured results of several dtypes against
the same function run on the whole call).

NVLink multicast stays off: the variables in ``NO_MULTICAST`` are set before the process group (and before any
spawn), as the shared machines require.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from encgraph.capture import EncoderGraphRunner, RunMode
from encgraph.capture.distributed import DataParallelEncoder, RemoteRankError
from encgraph.packing import balance
from tests.toy_models import ToyAdapter, ToyTower, reference
from tests.unit.test_distributed import (
    Report,
    check_structured_calls,
    make_inputs,
    run_scenarios,
    spawn_ranks,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
NCCL_TIMEOUT = datetime.timedelta(seconds=60)
TOL = 2e-5


@pytest.fixture(autouse=True)
def no_multicast_no_tf32(monkeypatch):
    for k, v in NO_MULTICAST.items():
        monkeypatch.setenv(k, v)  # before init_process_group, and inherited by spawned ranks
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def make(paths: tuple[str, ...], empty: tuple[str, ...], device: torch.device) -> ToyAdapter:
    torch.manual_seed(0)  # built on the CPU, then moved: the same weights on every rank
    towers = {p: ToyTower(channels=32, hidden=64).to(device) for p in paths}
    return ToyAdapter(towers, empty=empty, min_budget=32, max_budget=512)


def runner_stats(runner: EncoderGraphRunner) -> Any:
    return lambda: runner.stats


def gpu_scenarios(rank: int, world: int, device: torch.device) -> list:
    def toy_graphs(report: Report) -> None:
        for paths, empty in [(("default",), ()), (("global", "local"), ("local",))]:
            adapter = make(paths, empty, device)
            runner = EncoderGraphRunner(adapter)
            report.check(runner.mode is RunMode.GRAPH, f"runner mode {runner.mode}")
            runner.capture()
            plain = EncoderGraphRunner(adapter)  # the single-GPU reference, with counters of its own
            ran: list[torch.Tensor] = []

            def local_call(sub: Any, runner: EncoderGraphRunner = runner, ran: list = ran) -> list:
                results = runner(sub)
                ran[:] = [r.clone() for r in results]
                return results

            dp = DataParallelEncoder(local_call, adapter=adapter, device=device, local_stats=runner_stats(runner))
            total = 0
            for n, seed in [(20, 1), (1, 2), (max(world - 1, 1), 3), (3 * world + 5, 4), (7, 5)]:
                inputs = make_inputs(adapter, n, seed)
                specs = adapter.item_specs(inputs)
                mine = balance([s.total_tokens for s in specs], world)[rank]
                ran.clear()
                out = dp(inputs)
                total += n
                single, eager = plain(inputs), reference(adapter, inputs)  # the single-GPU run, here
                tag = f"{'+'.join(paths)}, {n} items"
                report.check(len(out) == n and all(o.device == device for o in out), f"{tag}: count or device")
                for i in range(n):
                    report.check(bool(torch.isfinite(out[i]).all()), f"{tag}: item {i} not finite")
                    report.check(torch.allclose(out[i], single[i], atol=TOL, rtol=TOL), f"{tag}: item {i} != single GPU")
                    report.check(torch.allclose(out[i], eager[i], atol=TOL, rtol=TOL), f"{tag}: item {i} != eager")
                # Exact transport: every rank's local results, gathered on the side through pickling.
                everyone: list[Any] = [None] * world
                dist.all_gather_object(everyone, [(i, r.cpu()) for i, r in zip(mine, ran)])
                sent = dict(pair for part in everyone for pair in part)
                report.check(sorted(sent) == list(range(n)), f"{tag}: items ran {sorted(sent)}")
                for i, r in sent.items():
                    report.check(torch.equal(out[i].cpu(), r), f"{tag}: item {i} changed in transport")
            g = dp.global_stats()
            report.check(g["items"] == total and g["graph_items"] + g["eager_items"] == total, f"global stats {g}")
            report.check(g["graph_items"] > 0, "some items replayed graphs")
            report.info.setdefault("stats", []).append({k: g[k] for k in ("items", "graph_items", "eager_items")})

    def structures(report: Report) -> None:
        check_structured_calls(report, make(("default",), (), device), [(6, 21), (1, 22), (world + 3, 23)])

    def failure(report: Report) -> None:
        adapter = make(("default",), (), device)
        inputs = make_inputs(adapter, 1, 31)

        def boom(sub: Any) -> list:
            raise ValueError("boom on the only busy rank")

        report.raises(ValueError if rank == 0 else RemoteRankError,
                      lambda: DataParallelEncoder(boom, adapter=adapter)(inputs), "local failure")
        runner = EncoderGraphRunner(adapter, mode=RunMode.EAGER)
        more = make_inputs(adapter, 5, 32)
        out, ref = DataParallelEncoder(runner)(more), runner(more)
        report.check(all(torch.allclose(a, b, atol=TOL, rtol=TOL) for a, b in zip(out, ref)), "a call after a failure")

    return [toy_graphs, structures, failure]


def assert_clean(reports: list[dict]) -> None:
    failures = [f for r in reports for f in r["failures"]]
    assert not failures, "\n".join(failures)
    assert all(r["checks"] > 100 for r in reports), [r["checks"] for r in reports]


def test_nccl_group_of_one_equals_plain_runner(tmp_path):
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=NCCL_TIMEOUT, device_id=device)
    report = Report(0)
    try:
        for scenario in gpu_scenarios(0, 1, device):
            scenario(report)
        # A group of one plans the whole call as one share, in order: the runner's own plan and graphs.
        adapter = make(("default",), (), device)
        runner = EncoderGraphRunner(adapter)
        dp = DataParallelEncoder(runner)
        assert dp.comm_device == device and dp.backend == "nccl"
        inputs = make_inputs(adapter, 12, 41)
        for a, b in zip(dp(inputs), runner(inputs), strict=True):
            torch.testing.assert_close(a, b, atol=TOL, rtol=TOL)
        print(f"\nNCCL group of one: {report.checks} checks; {report.info['stats']}")
    finally:
        dist.destroy_process_group()
    assert_clean([{"checks": report.checks, "failures": report.failures}])


def nccl_worker(rank: int, world: int, port: int, outdir: str) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    report_env = {k: os.environ.get(k) for k in NO_MULTICAST}
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=NCCL_TIMEOUT, device_id=device)

    def env_check(report: Report) -> None:
        report.check(report_env == NO_MULTICAST, f"NVLink multicast variables in the rank: {report_env}")

    run_scenarios(rank, outdir, [env_check, *gpu_scenarios(rank, world, device)])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")
def test_one_process_per_gpu_equals_single_gpu(tmp_path):
    world = torch.cuda.device_count()
    reports = spawn_ranks(nccl_worker, world, tmp_path, deadline_s=300.0)
    assert_clean(reports)
    print(f"\n{world} GPUs: {[r['checks'] for r in reports]} checks per rank; {reports[0]['info']['stats']}")
