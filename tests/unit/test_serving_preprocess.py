"""Decoding and preprocessing in worker processes (``encgraph.serving.preprocess``): the workers' arrays and the
adapter inputs made from them equal the in-thread path's, bit for bit, for both embedded models; bad images come
back as the same :class:`ImageError`; a killed worker fails the requests it held with :class:`WorkerDiedError`,
the pool restarts once and the next request succeeds; closing does not hang.

Two pools, started together (a worker's start-up is mostly importing torch and transformers): one with the
embedded models' processors, one with a stand-in processor (:class:`TinyProcessor`: no transformers import, so
its restart after a kill is quick).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
import os
import pickle
import signal
import time
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import pytest
import torch

pytest.importorskip("PIL")

from PIL import Image  # noqa: E402

from encgraph.errors import ConfigError, ShutdownError  # noqa: E402
from encgraph.serving import preprocess  # noqa: E402
from encgraph.serving.images import ImageError, ImageLimits, decode_image, name_the_refused  # noqa: E402
from encgraph.serving.preprocess import PreprocessPool, Prepared, WorkerDiedError  # noqa: E402

MODELS = ("siglip", "qwen2_5_vl")
TIMEOUT = 120


class TinyProcessor:
    """A picklable stand-in for an image processor: each image's mean colour as a ``(1, 3, 1, 1)`` float32 block."""

    def __call__(self, images: list, return_tensors: str) -> dict:
        means = [np.asarray(image, dtype=np.float32).mean((0, 1)) for image in images]
        return {"pixel_values": torch.from_numpy(np.stack(means)[:, :, None, None])}


def _encode(width: int, height: int, seed: int, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format=fmt)
    return base64.b64encode(buf.getvalue()).decode()


TEXTS = [_encode(56, 56, 0), _encode(90, 70, 1, "JPEG"), _encode(40, 120, 2), _encode(112, 84, 3, "JPEG")]


def _prepare(pool: PreprocessPool, model: str, texts: list[str]) -> Prepared:
    return asyncio.run(asyncio.wait_for(pool.prepare(model, texts), TIMEOUT))


@pytest.fixture(scope="module")
def pools() -> Iterator[dict[str, PreprocessPool]]:
    from encgraph.serving.loading import load_processor

    made = {"embedded": PreprocessPool({n: load_processor(n) for n in MODELS}, 1),
            "tiny": PreprocessPool({"tiny": TinyProcessor()}, 1)}
    try:
        with concurrent.futures.ThreadPoolExecutor(len(made)) as ex:
            for future in [ex.submit(pool.start) for pool in made.values()]:
                future.result(TIMEOUT)
        yield made
    finally:
        for pool in made.values():
            pool.close()


def test_image_errors_pickle_with_every_field():
    exc = ImageError(413, "input[3]", "image_too_large", "input[3]: too large.")
    back = pickle.loads(pickle.dumps(exc))
    assert (type(back), back.status, back.param, back.code, str(back)) == (ImageError, 413, "input[3]",
                                                                            "image_too_large", "input[3]: too large.")
    for error in (WorkerDiedError("died"), preprocess.WorkerError("failed")):
        assert str(pickle.loads(pickle.dumps(error))) == str(error)


def test_name_the_refused_names_the_first_image_refused_alone():
    images = [Image.new("RGB", (4, 3)), Image.new("RGB", (5, 2)), Image.new("RGB", (6, 1))]

    def fn(batch: list) -> int:
        if any(image.height < 3 for image in batch):
            raise ValueError("too short")
        return len(batch)

    assert name_the_refused(fn, images[:1]) == 1
    with pytest.raises(ImageError) as info:
        name_the_refused(fn, images)
    err = info.value
    assert (err.status, err.param, err.code) == (400, "input[1]", "unprocessable_image")
    assert str(err) == "input[1]: the model's image processor refused this image (5x2): too short"
    with pytest.raises(KeyError):  # no image refused alone: fn's own error
        name_the_refused(lambda batch: len(batch) if len(batch) == 1 else {}["batch"], images)


def _fields_equal(a: object, b: object) -> None:
    assert type(a) is type(b)
    for field in attrs.fields(type(a)):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.device == y.device and torch.equal(x, y), field.name
        elif isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), field.name
        else:
            assert x == y, field.name


@pytest.mark.parametrize("model", MODELS)
def test_worker_arrays_and_inputs_equal_the_in_thread_path(pools, model):
    from encgraph.models.registry import wrap
    from encgraph.serving.loading import ServedModel, embedded_tower

    pool = pools["embedded"]
    prepared = _prepare(pool, model, TEXTS)
    images = [decode_image(text, i, ImageLimits()) for i, text in enumerate(TEXTS)]
    processor = pool.processors[model]
    reference = processor(images=images, return_tensors="pt")  # what the server ran before the split
    assert set(prepared.arrays) == {"pixel_values", *(["image_grid_thw"] if model == "qwen2_5_vl" else [])}
    for key, array in prepared.arrays.items():
        want = reference[key].numpy()
        assert array.dtype == want.dtype and array.shape == want.shape and np.array_equal(array, want), key
    assert prepared.decode_s > 0
    tower, _ = embedded_tower(model, device=torch.device("cpu"), dtype=torch.float32)
    served = ServedModel(model, "", processor, wrap(tower), None, torch.device("cpu"), torch.float32)
    _fields_equal(served.inputs_from_arrays(prepared.arrays), served.inputs(images))


def test_pixels_come_back_through_shared_slots_and_through_the_pipe_alike(pools, tmp_path):
    """The embedded pool's results came through its shared-memory slots (above: bit for bit); a pool whose slot
    is too small for a result sends it through the pipe, counted, with the same values; requests that find every
    slot taken wait for one in turn (a cancelled one passes its turn on); closing removes the arena's file."""
    used = pools["embedded"].stats
    assert used["slots"] >= 8 and used["slot_bytes"] == preprocess.slots.SLOT_BYTES
    want = _prepare(pools["tiny"], "tiny", TEXTS).arrays["pixel_values"]  # 4 x 3 float32: 48 bytes
    small = PreprocessPool({"tiny": TinyProcessor()}, 1, slot_bytes=32, slot_count=1).start()
    try:
        path = small._arena.path
        got = _prepare(small, "tiny", TEXTS).arrays["pixel_values"]  # larger than its slot
        assert np.array_equal(got, want) and small.stats["overflows"] == 1
        one = _prepare(small, "tiny", TEXTS[:2]).arrays["pixel_values"]  # 24 bytes: fits
        assert np.array_equal(one, want[:2]) and small.stats["overflows"] == 1

        async def together() -> list[Prepared]:  # three requests, one slot: they wait for it in turn
            return await asyncio.gather(*(small.prepare("tiny", TEXTS[i:i + 2]) for i in (0, 1, 2)))

        both = asyncio.run(asyncio.wait_for(together(), TIMEOUT))
        assert [np.array_equal(b.arrays["pixel_values"], want[i:i + 2]) for b, i in zip(both, (0, 1, 2))] == [True] * 3
        assert small.stats["overflows"] == 1  # none through the pipe for want of a slot
        # The arena's name went once the worker had mapped it: a killed server leaves no file (slots.sweep).
        assert not os.path.exists(path) and not small._arena.closed

        async def one_cancelled() -> list[Any]:  # a request cancelled while it waits passes its turn on
            tasks = [asyncio.ensure_future(small.prepare("tiny", TEXTS[i:i + 2])) for i in (0, 1, 2)]
            await asyncio.sleep(0)  # every task has started: the first holds the slot, the others wait
            tasks[1].cancel()
            return await asyncio.gather(*tasks, return_exceptions=True)

        first, cancelled, third = asyncio.run(asyncio.wait_for(one_cancelled(), TIMEOUT))
        assert isinstance(cancelled, asyncio.CancelledError)
        assert np.array_equal(first.arrays["pixel_values"], want[:2])
        assert np.array_equal(third.arrays["pixel_values"], want[2:4]) and small.stats["overflows"] == 1
        assert small._arena.take() == 0  # the one slot is free again
        small._arena.give(0)
    finally:
        small.close()
    assert not os.path.exists(path)


def test_the_pixels_leave_their_slot_off_the_event_loop(pools, monkeypatch):
    """The copy out of a shared-memory slot runs on the pool's own thread as the worker answers, not on the event
    loop (ANALYSIS-57 item 5), and the slot is free again by the time the request resumes."""
    import threading

    pool = pools["tiny"]
    readers: list[str] = []
    read = preprocess.slots.Arena.read

    def spy(self, *args):
        readers.append(threading.current_thread().name)
        return read(self, *args)

    monkeypatch.setattr(preprocess.slots.Arena, "read", spy)

    async def request() -> tuple[Prepared, str, int]:
        prepared = await pool.prepare("tiny", TEXTS[:2])
        await asyncio.sleep(0)  # the slot's return was queued on the loop before the request resumed
        return prepared, threading.current_thread().name, len(pool._arena._free)

    prepared, loop_thread, free = asyncio.run(asyncio.wait_for(request(), TIMEOUT))
    assert readers and loop_thread not in readers
    assert free == pool._arena.count
    want = np.stack([np.asarray(decode_image(t, 0, ImageLimits()), np.float32).mean((0, 1)) for t in TEXTS[:2]])
    np.testing.assert_allclose(prepared.arrays["pixel_values"][:, :, 0, 0], want, rtol=1e-6)


def test_bad_images_come_back_as_the_same_image_errors(pools):
    pool = pools["embedded"]
    thin = _encode(2000, 3, 4)  # an aspect ratio Qwen's processor refuses
    cases = [("siglip", [TEXTS[0], "not base64!"]), ("siglip", [TEXTS[0], TEXTS[1][:200]]),
             ("qwen2_5_vl", [TEXTS[0], thin])]
    for model, texts in cases:
        with pytest.raises(ImageError) as got:
            _prepare(pool, model, texts)
        with pytest.raises(ImageError) as want:
            images = [decode_image(text, i, ImageLimits()) for i, text in enumerate(texts)]
            name_the_refused(lambda batch: pool.processors[model](images=batch, return_tensors="pt"), images)
        a, b = got.value, want.value
        assert (a.status, a.param, a.code, str(a)) == (b.status, b.param, b.code, str(b)), model
    assert _prepare(pool, "siglip", TEXTS[:1]).arrays["pixel_values"].shape[0] == 1  # still serving


def test_a_killed_worker_fails_its_requests_and_the_pool_restarts_once(pools):
    pool = pools["tiny"]
    assert _prepare(pool, "tiny", TEXTS).arrays["pixel_values"].shape == (4, 3, 1, 1)
    (dead,) = pool.pids
    os.kill(dead, signal.SIGKILL)

    async def burst() -> list:
        return await asyncio.gather(*(pool.prepare("tiny", TEXTS) for _ in range(3)), return_exceptions=True)

    answers = asyncio.run(asyncio.wait_for(burst(), TIMEOUT))
    assert all(isinstance(a, WorkerDiedError) for a in answers), answers
    assert "retry it" in str(answers[0]) and pool.restarts == 1
    assert _prepare(pool, "tiny", TEXTS).arrays["pixel_values"].shape == (4, 3, 1, 1)
    assert pool.restarts == 1 and len(pool.pids) == 1 and pool.pids != (dead,)


def test_close_with_requests_in_flight_does_not_hang(pools):
    pool = pools["tiny"]
    big = [_encode(600, 600, 5)] * 8

    async def close_under_load() -> tuple[list, float]:
        requests = [asyncio.ensure_future(pool.prepare("tiny", big)) for _ in range(6)]
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        await asyncio.to_thread(pool.close)
        return await asyncio.gather(*requests, return_exceptions=True), time.monotonic() - t0

    answers, seconds = asyncio.run(asyncio.wait_for(close_under_load(), TIMEOUT))
    assert all(isinstance(a, (Prepared, ShutdownError)) for a in answers), answers
    assert any(isinstance(a, ShutdownError) for a in answers) and seconds < 30
    with pytest.raises(ShutdownError):
        _prepare(pool, "tiny", TEXTS)
    pool.close()  # again: nothing left to do


def test_default_workers_and_bad_counts(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert preprocess.default_workers([torch.device("cpu")] * 2) == 0
    assert preprocess.default_workers([torch.device("cpu"), torch.device("cuda", 0)]) == 8
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert preprocess.default_workers(["cuda"]) == 1
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="workers: expected an int >= 1"):
            PreprocessPool({"tiny": TinyProcessor()}, bad)
    with pytest.raises(ConfigError, match="processors"):
        PreprocessPool({}, 1)


def test_serve_parses_preprocess_workers(capsys):
    from encgraph.cli import build_parser, main

    def parsed(*argv: str) -> int | None:
        return build_parser().parse_args(["serve", *argv]).preprocess_workers

    assert parsed() is None and parsed("--preprocess-workers", "auto") is None  # None: auto
    assert parsed("--preprocess-workers", "0") == 0 and parsed("--preprocess-workers", "3") == 3
    for bad in ("-1", "many"):
        assert main(["serve", "--preprocess-workers", bad]) == 2
        assert "expected 'auto' or a number of processes >= 0" in capsys.readouterr().err


def test_requests_waiting_for_a_slot_survive_a_restart_and_a_close():
    """One slot, one worker. A worker dies while one request holds the slot and two wait for it: the holder fails
    with WorkerDiedError, the two that waited run on the new workers (they were never in the dead pool's hands).
    Then a close while requests wait for the slot answers each, none hangs."""
    pool = PreprocessPool({"tiny": TinyProcessor()}, 1, slot_count=1).start()
    try:
        (dead,) = pool.pids
        os.kill(dead, signal.SIGKILL)

        async def burst() -> list:
            return await asyncio.gather(*(pool.prepare("tiny", TEXTS) for _ in range(3)), return_exceptions=True)

        first, *waited = asyncio.run(asyncio.wait_for(burst(), TIMEOUT))
        assert isinstance(first, WorkerDiedError), first
        assert all(isinstance(a, Prepared) and a.arrays["pixel_values"].shape == (4, 3, 1, 1) for a in waited), waited
        assert pool.restarts == 1 and pool.stats["overflows"] == 0
        big = [_encode(600, 600, 5)] * 8

        async def close_while_waiting() -> list:
            requests = [asyncio.ensure_future(pool.prepare("tiny", big)) for _ in range(4)]
            await asyncio.sleep(0.05)  # one holds the slot, three wait
            await asyncio.to_thread(pool.close)
            return await asyncio.gather(*requests, return_exceptions=True)

        answers = asyncio.run(asyncio.wait_for(close_while_waiting(), TIMEOUT))
        assert all(isinstance(a, (Prepared, ShutdownError)) for a in answers), answers
        assert sum(isinstance(a, ShutdownError) for a in answers) >= 2
    finally:
        pool.close()


def test_sweep_removes_the_arena_files_of_dead_servers_only(tmp_path, monkeypatch):
    import subprocess
    import sys

    monkeypatch.setattr(preprocess.slots, "directory", lambda: str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    names = [f"encgraph-preprocess-{int(dead.stdout)}-abc", f"encgraph-preprocess-{os.getpid()}-def",
             "encgraph-preprocess-xyz", "other-1-abc"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert preprocess.slots.sweep() == [str(tmp_path / names[0])]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])


def test_a_broken_pools_blocked_feeder_is_freed_by_closing_its_reader(monkeypatch):
    """python/cpython#94777 (fixed in 3.11.5): a worker dies while the executor's call queue holds more than its pipe
    does; the queue's feeder thread blocks writing to a pipe nobody reads, the executor's thread waits for it, and
    the process hangs at exit (the killed-worker test above did, on Debian 12's Python 3.11.2). unblock_broken
    closes the parent's read end as the fix does; forced here on any CPython, on a queue whose reader nobody uses."""
    import multiprocessing
    import threading

    monkeypatch.setattr(preprocess, "FEEDER_FIXED", (99,))
    queue = multiprocessing.get_context("spawn").Queue()
    queue.put(b"x" * (4 << 20))  # more than a pipe holds: the feeder thread blocks in its write
    time.sleep(0.3)
    assert preprocess.unblock_broken(queue) is True
    queue.close()
    joiner = threading.Thread(target=queue.join_thread, daemon=True)
    joiner.start()
    joiner.join(20)
    assert not joiner.is_alive(), "the feeder thread is still blocked"
    assert preprocess.unblock_broken(queue) is False  # closed already
    assert preprocess.unblock_broken(None) is False
    monkeypatch.undo()
    fresh = multiprocessing.get_context("spawn").Queue()
    try:  # a fixed CPython closes it itself; closing it again could race with the executor's thread
        import sys

        assert preprocess.unblock_broken(fresh) is (sys.version_info < (3, 11, 5))
    finally:
        fresh.close()
