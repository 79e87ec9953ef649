"""encgraph.serving.device_batch: the device half of preprocessing run once per group of waiting requests. A fake
processor stands in for the torchvision one (tests/unit/test_device_preprocess.py runs the real one): each request
gets its own rows, in order, whatever groups form; a failing request fails alone, with its own error."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from encgraph.serving.device_batch import DeviceBatcher  # noqa: E402
from encgraph.serving.loading import Prepared  # noqa: E402

TIMEOUT = 30


class FakeProcessor:
    """``on_device_many`` as the torchvision one's shape: one call over every part's images, the result split back
    per part. An image whose first byte is 255 is refused (as a processor refuses an image)."""

    def __init__(self, batches: bool = True, gate: threading.Event | None = None) -> None:
        self.batches = batches
        self.calls: list[int] = []  # parts per call
        self.gate = gate
        self.entered = threading.Event()  # set once a call is waiting at the gate

    def on_device_many(self, parts, device, dtype):
        if self.gate is not None:
            self.entered.set()
            self.gate.wait(TIMEOUT)
        self.calls.append(len(parts))
        rows = [np.asarray(p["pixel_values"]).reshape(len(p["decoded_sizes"]), -1) for p in parts]
        if any((r[:, 0] == 255).any() for r in rows):
            raise ValueError("an image the processor refuses")
        pixels = torch.from_numpy(np.concatenate(rows)).to(dtype)  # one tensor for the whole call
        return [{"pixel_values": p} for p in torch.split(pixels, [len(r) for r in rows])]


class FakeModel:
    name = "fake"
    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self, processor: FakeProcessor) -> None:
        self.processor = processor

    def adapter_inputs(self, pixels, grid):
        return {"pixel_values": pixels.clone()}

    def prepare(self, arrays):  # what a request alone runs (app: _from_arrays / _prepare)
        return Prepared(self.adapter_inputs(*[d["pixel_values"] for d in
                                              self.processor.on_device_many([arrays], self.device, self.dtype)],
                                            None))


def request(tag: int, images: int, bad: int | None = None) -> dict[str, np.ndarray]:
    """``images`` images of 4 bytes each, every byte ``tag * 10 + image`` (255: refused)."""
    rows = np.array([[255 if i == bad else tag * 10 + i] * 4 for i in range(images)], dtype=np.uint8)
    return {"pixel_values": rows.reshape(-1), "decoded_sizes": np.ones((images, 2), np.int64)}


def expected(tag: int, images: int) -> np.ndarray:
    return np.array([[tag * 10 + i] * 4 for i in range(images)], dtype=np.float32)


def submit(batcher: DeviceBatcher, model: FakeModel, arrays) -> concurrent.futures.Future:
    return batcher.submit(lambda: arrays, model.prepare)


@contextlib.contextmanager
def held(**options: Any) -> Iterator[tuple[FakeModel, DeviceBatcher, Callable[[], None]]]:
    """A batcher whose first call (one request of one image, tag 0) waits inside the processor until ``release()``:
    what is submitted meanwhile queues behind it. On release that first request is checked, then the test goes on;
    the batcher is closed at the end."""
    gate = threading.Event()
    model = FakeModel(FakeProcessor(gate=gate))
    batcher = DeviceBatcher(model, **options)
    try:
        first = submit(batcher, model, request(0, 1))
        assert model.processor.entered.wait(TIMEOUT)

        def release() -> None:
            gate.set()
            np.testing.assert_array_equal(first.result(TIMEOUT).inputs["pixel_values"].numpy(), expected(0, 1))

        yield model, batcher, release
    finally:
        gate.set()
        batcher.close()


def rows(future: concurrent.futures.Future) -> np.ndarray:
    return future.result(TIMEOUT).inputs["pixel_values"].numpy()


def test_every_request_gets_its_own_rows_in_order_from_shared_calls():
    sizes = [1, 3, 2, 1, 4, 1, 2, 5, 1, 1, 3, 2]
    with held(max_images=64) as (model, batcher, release):
        futures = [submit(batcher, model, request(t, n)) for t, n in enumerate(sizes, start=1)]
        release()
        for tag, (n, future) in enumerate(zip(sizes, futures, strict=True), start=1):
            np.testing.assert_array_equal(rows(future), expected(tag, n))
        stats = batcher.stats
    assert model.processor.calls == [1, len(sizes)]  # the queued requests went in one call
    assert stats["groups"] == 2 and stats["requests"] == 1 + len(sizes) and stats["images"] == 1 + sum(sizes)
    assert stats["largest_group"] == len(sizes) and stats["alone"] == 0 and stats["retried_groups"] == 0


def test_groups_stay_within_max_images_and_keep_the_order():
    with held(max_images=4) as (model, batcher, release):
        futures = [submit(batcher, model, request(t, 2)) for t in range(1, 8)]
        release()
        for tag, future in enumerate(futures, start=1):
            np.testing.assert_array_equal(rows(future), expected(tag, 2))
    assert model.processor.calls[0] == 1 and max(model.processor.calls[1:]) == 2  # 2 requests of 2 images
    assert sum(model.processor.calls) == 8


def test_a_refused_image_fails_its_own_request_alone():
    with held() as (model, batcher, release):
        futures = [submit(batcher, model, request(t, 3, bad=1 if t == 3 else None)) for t in range(1, 6)]
        release()
        for tag, future in enumerate(futures, start=1):
            if tag == 3:
                with pytest.raises(ValueError, match="refuses"):
                    future.result(TIMEOUT)
            else:
                np.testing.assert_array_equal(rows(future), expected(tag, 3))
        stats = batcher.stats
    assert stats["retried_groups"] == 1 and stats["alone"] == 5


def test_a_failing_read_fails_its_own_request_and_a_cancelled_one_is_skipped():
    def broken():
        raise OSError("slot gone")

    with held() as (model, batcher, release):
        ok = submit(batcher, model, request(1, 2))
        bad = batcher.submit(broken, model.prepare)
        cancelled = submit(batcher, model, request(2, 2))
        assert cancelled.cancel()
        last = submit(batcher, model, request(3, 1))
        release()
        with pytest.raises(OSError, match="slot gone"):
            bad.result(TIMEOUT)
        np.testing.assert_array_equal(rows(ok), expected(1, 2))
        np.testing.assert_array_equal(rows(last), expected(3, 1))
    assert model.processor.calls == [1, 2]


def test_a_bug_while_grouping_fails_the_taken_requests_and_the_thread_goes_on():
    # Arrays without decoded_sizes break the grouping itself (not the read): the requests taken with it get the
    # error instead of waiting forever, and the thread serves the next request.
    with held() as (model, batcher, release):
        bad = submit(batcher, model, {"pixel_values": np.zeros(4, np.uint8)})
        release()
        with pytest.raises(KeyError, match="decoded_sizes"):
            bad.result(TIMEOUT)
        thread = batcher._thread
        after = submit(batcher, model, request(4, 1))
        np.testing.assert_array_equal(rows(after), expected(4, 1))
        assert batcher._thread is thread and thread.is_alive()


def test_a_processor_that_does_not_batch_runs_each_request_alone_and_says_so(caplog):
    model = FakeModel(FakeProcessor(batches=False))
    batcher = DeviceBatcher(model)
    try:
        futures = [submit(batcher, model, request(t, 2)) for t in range(6)]
        for tag, future in enumerate(futures):
            np.testing.assert_array_equal(future.result(TIMEOUT).inputs["pixel_values"].numpy(), expected(tag, 2))
        assert set(model.processor.calls) == {1}
        assert batcher.stats["alone"] == 6
        assert sum("runs per request" in r.getMessage() for r in caplog.records) == 1
    finally:
        batcher.close()


def test_concurrent_submitters_never_get_each_others_rows():
    model = FakeModel(FakeProcessor())
    batcher = DeviceBatcher(model, max_images=16)
    results: dict[int, np.ndarray] = {}

    def client(c: int) -> None:
        for k in range(20):
            tag = c * 20 + k
            n = 1 + (tag % 3)
            results[tag] = (n, submit(batcher, model, request(tag % 25, n)).result(TIMEOUT))

    try:
        threads = [threading.Thread(target=client, args=(c,)) for c in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert len(results) == 160
        for tag, (n, got) in results.items():
            np.testing.assert_array_equal(got.inputs["pixel_values"].numpy(), expected(tag % 25, n))
        assert batcher.stats["requests"] == 160
    finally:
        batcher.close()


def test_close_finishes_the_queue_and_a_later_submit_starts_again():
    model = FakeModel(FakeProcessor())
    batcher = DeviceBatcher(model)
    futures = [submit(batcher, model, request(t, 1)) for t in range(5)]
    batcher.close()
    assert all(f.done() and not f.exception() for f in futures)
    again = submit(batcher, model, request(7, 2))
    np.testing.assert_array_equal(again.result(TIMEOUT).inputs["pixel_values"].numpy(), expected(7, 2))
    batcher.close()
