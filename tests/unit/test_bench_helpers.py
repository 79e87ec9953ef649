"""The benchmarks' helpers on the CPU: the matmul floor, relative differences, option lists, time boxes and
the compile caches' directory."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import pytest

pytest.importorskip("transformers")

from benches.lib import cli, compiled, outputs, startup, systems, timing  # noqa: E402
from benches.lib.env import Deadline, Env  # noqa: E402
from benches.lib.systems import System  # noqa: E402
from benches.lib.timing import floor_ms  # noqa: E402


def test_floor_formula():
    assert floor_ms(10**9, 1000, 1000.0) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="tflops must be a positive"):
        floor_ms(10**9, 1000, 0.0)


def test_a_slow_cpu_matmul_keeps_a_nonzero_rate(monkeypatch):
    # CI once measured a 256^3 matmul at over 67 ms (a cold, busy 2-core machine): three decimals of TFLOP/s
    # rounded that to 0.0 and the towers smoke divided by it. The rate keeps significant digits, and the first
    # call is untimed even under --warmup 0.
    import torch

    calls = []
    monkeypatch.setattr(timing, "time_once", lambda fn, env: (calls.append(fn()), 100.0)[1])
    env = Env(torch.device("cpu"), torch.float32, True, runs=1, warmup=0, seed=0)
    rate = timing.matmul_rate(env)
    assert len(calls) == 1 and rate["median_ms"] == 100.0
    assert rate["tflops"] == pytest.approx(2 * 256**3 / 0.1 / 1e12, rel=1e-3) and rate["tflops"] > 0
    assert floor_ms(10**6, 256, rate["tflops"]) > 0


def test_max_rel_diff():
    import torch

    a = [{"x": torch.ones(2, 3)}, torch.zeros(1)]
    assert outputs.max_rel_diff(a, a) == 0.0
    b = [{"x": torch.ones(2, 3) * 1.01}, torch.zeros(1)]
    assert outputs.max_rel_diff(b, a) == pytest.approx(0.01, rel=1e-3)
    assert outputs.max_rel_diff(a[:1], a) == math.inf


def test_parse_lists_reject_unknown_names():
    assert systems.parse_systems("graph,adapter_eager") == (System.GRAPH, System.ADAPTER_EAGER)
    with pytest.raises(argparse.ArgumentTypeError):
        systems.parse_systems("graphs")
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_names(("a", "b"))("a,c")
    assert cli.parse_budgets("64,32,64") == (32, 64)
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_budgets("0,8")


def test_deadline_share_splits_what_is_left():
    d = Deadline(100.0)
    assert d.share(4).seconds == pytest.approx(25.0, abs=0.5)
    assert Deadline(-5).share(2).seconds == 0.0


def test_hard_cap_cuts_a_long_call_and_the_box_stays_spent():
    box = compiled.TimeBox(0.2)
    t0 = time.perf_counter()
    with pytest.raises(compiled.CapExceeded):
        box.run(lambda: [time.sleep(0.01) for _ in range(500)])
    assert time.perf_counter() - t0 < 2.0
    assert box.spent and "cut off" in box.spent
    with pytest.raises(compiled.CapExceeded):
        box.run(lambda: None)
    assert box.summary()["used_seconds"] >= 0.2


def test_time_box_counts_the_calls_that_compile():
    import torch

    fn = torch.compile(lambda x: x * 2 + 1, dynamic=True, backend="eager")
    before = compiled.dynamo_counters()
    box = compiled.TimeBox(60)
    for n in (3, 5, 3):
        assert torch.equal(box.run(lambda n=n: fn(torch.ones(n))), torch.full((n,), 3.0))
    delta = compiled.counter_delta(compiled.dynamo_counters(), before)
    assert box.compiling_calls == 1 and delta["graphs_compiled"] == 1  # dynamic: one graph for every size
    assert delta["compile_seconds"] > 0 and box.summary()["calls_that_compiled"] == 1


def test_cache_env_points_every_cache_at_one_directory_and_restores(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")
    monkeypatch.delenv("ENCGRAPH_CACHE_DIR", raising=False)
    with startup.cache_env() as fresh:
        assert fresh.is_dir() and not any(fresh.iterdir())
        assert os.environ["ENCGRAPH_CACHE_DIR"] == os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(fresh)
        assert os.environ["TRITON_CACHE_DIR"] == str(fresh / "triton")
        (fresh / "a").write_bytes(b"123")
        assert startup.cache_bytes(fresh) == 3
    assert not fresh.exists()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/else" and "ENCGRAPH_CACHE_DIR" not in os.environ
    with startup.cache_env(tmp_path) as kept:
        assert kept == tmp_path
    assert tmp_path.exists()


def test_write_rows_writes_the_json_and_a_table_beside_it(tmp_path):
    from benches.lib.results import write_rows

    report = {"environment": {"gpu": "x"}, "results": [{"case": "a", "ms": 1.23456}, {"case": "b", "extra": 2}]}
    md = write_rows(tmp_path / "bench.json", report, report["results"], "a bench")
    assert json.loads((tmp_path / "bench.json").read_text()) == report
    assert md.read_text().splitlines()[:5] == [
        "## a bench", "", "| case | ms | extra |", "|---|---|---|", "| a | 1.23 | - |"]


def test_results_record_whether_flash_attn_4_was_installed(tmp_path, monkeypatch):
    """Every result's environment says whether FlashAttention-4 was there (it changes the attention kernel capture
    picks): the wheel's version, a tree on the path without its metadata, or None."""
    import importlib.metadata

    from benches.lib import results

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    assert results.flash_attn_4_version() is None
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    monkeypatch.setattr(sys, "path_importer_cache", {})
    assert results.flash_attn_4_version() == "importable, no package metadata"
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "4.0.0b40" if name == "flash-attn-4" else None)
    assert results.flash_attn_4_version() == "4.0.0b40"
    import torch

    env = Env(torch.device("cpu"), torch.float32, True, runs=1, warmup=0, seed=0)
    assert results.environment(env)["flash_attn_4"] == "4.0.0b40"


def test_carry_wheels_split_pack_and_join(tmp_path):
    # benches/carry_wheels.py: a wheel too large for one call is cut into parts with its sha256, the files are
    # packed into folders of at most one call's size, and the device joins the parts from every folder it was
    # carried in; a missing part or a changed byte is a clear error, never a broken install.
    import os

    import pytest

    from benches.carry_wheels import join, pack, project, split

    assert pack({"a": 5, "b": 4, "c": 3, "d": 2}, 7) == [["a", "d"], ["b", "c"]]
    with pytest.raises(ValueError, match="over one folder"):
        pack({"big": 8}, 7)
    assert project("PyYAML-6.0.4-cp312-cp312-x.whl") == "pyyaml"
    pool, one, two, out = (tmp_path / n for n in ("pool", "one", "two", "out"))
    for d in (pool, one, two, out):
        d.mkdir()
    data = os.urandom(10_000)
    (pool / "big-1.0-py3-none-any.whl").write_bytes(data)
    files = split(pool / "big-1.0-py3-none-any.whl", 3_000)
    assert max(f.name for f in files) == "big-1.0-py3-none-any.whl.sha256" and len(files) == 5
    for f in files:  # the parts spread over two carried folders
        f.rename((one if f.name.endswith(("part0", "part2", "sha256")) else two) / f.name)
    (joined,) = join([one, two], out)
    assert joined.read_bytes() == data
    (two / "big-1.0-py3-none-any.whl.part1").unlink()
    with pytest.raises(ValueError, match="parts of big-1.0-py3-none-any.whl missing"):
        join([one, two], out)
    (two / "big-1.0-py3-none-any.whl.part1").write_bytes(bytes(3_000))
    with pytest.raises(ValueError, match="does not match its sha256"):
        join([one, two], out)


def test_block_stack_is_the_outermost_submodule_holding_every_block():
    # generic_compile's "stack" regions: the encoder of SigLIP, CLIP and DINOv2 (transformers 5), a timm-like blocks
    # Sequential; the blocks themselves where only the hooked module or a ModuleList holds them all.
    import torch
    import transformers as tf

    from benches.generic_compile import block_stack
    from encgraph.models._hf import repeated_blocks

    small = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
             "image_size": 28, "patch_size": 14}
    siglip = tf.SiglipVisionModel(tf.SiglipVisionConfig(**small))
    clip = tf.CLIPVisionModel(tf.CLIPVisionConfig(**small))
    dinov2 = tf.Dinov2Model(tf.Dinov2Config(**small))
    assert block_stack(siglip) == [siglip.encoder] and block_stack(clip) == [clip.encoder]
    assert block_stack(dinov2) == [dinov2.encoder]

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

    block = Block

    class TimmLike(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem, self.blocks = torch.nn.Linear(4, 4), torch.nn.Sequential(block(), block())

    class Flat(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([block(), block()])

    timm_like, flat = TimmLike(), Flat()
    assert block_stack(timm_like) == [timm_like.blocks]
    assert block_stack(flat) == repeated_blocks(flat) == list(flat.layers)
    assert block_stack(torch.nn.Linear(4, 4)) == []
