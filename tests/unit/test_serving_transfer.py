"""``encgraph.serving.transfer`` on the CPU: the same values as a plain ``.to`` (its CUDA path, with side
streams and events, is in ``tests/gpu/test_serving_gpu.py``)."""

from __future__ import annotations

import torch

from encgraph.serving.transfer import HostCopy, to_host, upload


def test_upload_on_the_cpu_is_to():
    x = torch.randn(3, 4)
    got = upload(x, "cpu", torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, x.to(torch.bfloat16))
    assert upload(x, torch.device("cpu")) is x  # nothing to move or convert


def test_to_host_of_cpu_tensors_needs_no_wait():
    xs = [torch.randn(2), torch.arange(3)]
    copy = to_host(xs)
    assert isinstance(copy, HostCopy) and copy.event is None
    assert all(a is b for a, b in zip(copy.wait(), xs))
    assert to_host([]).wait() == ()


class _FakeStream:
    """Stands in for a CUDA stream: records what was asked of it."""

    def __init__(self, device=None, priority=0):
        self.device, self.priority, self.calls = device, priority, []

    def synchronize(self):
        self.calls.append("synchronize")

    def wait_stream(self, other):
        self.calls.append(("wait_stream", other))


class _FakeTensor:
    def __init__(self):
        self.recorded = []

    def record_stream(self, stream):
        self.recorded.append(stream)


def _fake_cuda(monkeypatch):
    import contextlib

    from encgraph.serving import transfer

    default = _FakeStream("default")
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: default)
    monkeypatch.setattr(transfer, "_LOCAL", __import__("threading").local())  # no side stream made before
    return default


class _FakeEvent:
    def __init__(self):
        self.recorded_on, self.synchronized = None, 0

    def record(self, stream):
        self.recorded_on = stream

    def synchronize(self):
        self.synchronized += 1


def test_side_stream_handoffs_wait_on_the_host_or_hand_an_event_over(monkeypatch):
    """HOST: the thread waits for its side stream; EVENT: an event is recorded on the side stream instead, the
    thread does not wait, and ``ready()`` makes the calling thread's current stream wait for that event (not for
    the side stream as it is then); either way the kept results are marked used by the default stream, and the
    side stream is made once per thread and device, with high priority."""
    from encgraph.serving.transfer import Handoff, Ready, _side_stream, side_stream_work

    default = _fake_cuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    worker = _FakeStream("worker")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: worker)
    worker.wait_event = lambda event: worker.calls.append(("wait_event", event))
    device = torch.device("cuda", 0)
    for handoff in Handoff:
        t = _FakeTensor()
        with side_stream_work(device, handoff) as work:
            assert work(t) is t
        side = _side_stream(device)
        assert side.priority < 0 and t.recorded == [default] and default.calls == []
        if handoff is Handoff.HOST:
            assert side.calls == ["synchronize"] and work.ready is None
        else:
            assert side.calls == ["synchronize"]  # the HOST round's, no new host wait
            assert isinstance(work.ready, Ready) and work.ready.event.recorded_on is side
            assert worker.calls == []
            work.ready()  # on the worker: its stream waits for the event on the device
            assert worker.calls == [("wait_event", work.ready.event)] and work.ready.event.synchronized == 0
            work.ready.wait_host()  # or a caller that needs the results ready for any stream waits on the host
            assert work.ready.event.synchronized == 1
    assert _side_stream(device) is side


def test_side_stream_work_off_cuda_runs_the_block_as_it_is():
    from encgraph.serving.transfer import Handoff, side_stream_work

    x = torch.ones(2)
    for handoff in Handoff:
        with side_stream_work("cpu", handoff) as work:
            assert work(x) is x
        assert work.ready is None  # nothing in flight: nothing to wait for


def test_device_processing_on_the_cpu_gives_the_processors_pixels():
    """``DeviceProcessing.on_device`` on the CPU: the same pixels as the torchvision processor on the decoded
    images (the CUDA path, with its stream handoff, is in tests/gpu/test_serving_gpu.py)."""
    import numpy as np
    import pytest

    pytest.importorskip("torchvision")
    from PIL import Image
    from transformers import SiglipImageProcessor

    from encgraph.serving.device_preprocess import DeviceProcessing

    processor = SiglipImageProcessor(size={"height": 32, "width": 32})
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((40, 50), (17, 90))]
    split = DeviceProcessing(processor)
    arrays = {k: v.numpy() for k, v in split(images).items()}
    got = split.on_device(arrays, "cpu", torch.float32)["pixel_values"]
    want = processor(images=images, return_tensors="pt")["pixel_values"]
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)


def test_served_inputs_wait_on_the_host_for_work_left_in_flight():
    """``ServedModel.inputs_from_arrays`` (inputs ready for any stream): where ``prepare`` left device work in
    flight, it waits for that work on the host (``Ready.wait_host``) before returning the inputs; ``submit`` hands
    ``ready`` to the front instead."""
    from encgraph.serving.loading import Prepared, ServedModel

    class Ready:
        waited = 0

        def wait_host(self):
            Ready.waited += 1

    class Front:
        def submit_after(self, ready, *args):
            return ("queued", ready, args)

    ready = Ready()

    class Served(ServedModel):
        def prepare(self, arrays):
            return Prepared(("inputs", arrays), ready)

    served = Served("m", "", None, None, Front(), torch.device("cpu"), torch.float32)
    assert served.inputs_from_arrays({"x": 1}) == ("inputs", {"x": 1}) and Ready.waited == 1
    assert served.submit(Prepared("inputs", ready)) == ("queued", ready, ("inputs",)) and Ready.waited == 1


def test_keep_all_keeps_every_device_tensor_of_a_structure():
    """``SideWork.keep_all``: every non-CPU tensor reachable through dicts, lists, tuples, attrs and dataclass
    fields is kept (once, however often it is reachable), CPU tensors and plain values are not, and the value
    comes back as it was."""
    import dataclasses

    import attrs

    from encgraph.serving.transfer import SideWork

    @attrs.frozen
    class Inputs:
        pixels: object
        grids: object
        note: str = "x"

    @dataclasses.dataclass
    class Bounds:
        cu: object
        rows: int = 3

    a, b, c = (torch.empty(2, device="meta") for _ in range(3))  # not on the host, as a CUDA tensor
    host = torch.ones(2)
    value = Inputs({"pixel_values": a, "again": a}, [Bounds(b), (c, host, 4), None])
    work = SideWork()
    assert work.keep_all(value) is value
    assert [id(t) for t in work.kept] == [id(a), id(b), id(c)]


class _OnCuda(torch.Tensor):
    """A CUDA tensor's stand-in on a CPU-only build: its values on the host, its device ``cuda:0``."""

    @property
    def device(self):
        return torch.device("cuda", 0)


class _CopyEvent:
    """A CUDA event's stand-in for device-to-host copies: ``done`` is what ``query()`` says."""

    def __init__(self):
        self.recorded, self.synchronized, self.done = 0, 0, True

    def record(self, stream=None):
        self.recorded += 1

    def query(self):
        return self.done

    def synchronize(self):
        self.synchronized += 1


def _fake_pinned(monkeypatch) -> list[torch.Tensor]:
    """Fake CUDA events, and ``torch.empty(..., pin_memory=True)`` made in plain memory: the list of those made."""
    made: list[torch.Tensor] = []
    real = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        out = real(*args, **kwargs)
        if pin_memory:
            made.append(out)
        return out

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "Event", _CopyEvent)
    return made


def test_pinned_buffers_copy_once_per_call_and_reuse_a_buffer_once_free(monkeypatch):
    """``PinnedBuffers.copy``: one copy and one event; the host tensor holds the values; a buffer is reused only
    once the copy that holds it is gone and its event is done; a larger call gets the next power of two, replacing
    a free buffer too small; another dtype gets a buffer of its own; a CPU tensor is returned as it is."""
    from encgraph.serving.transfer import MIN_PINNED_ELEMENTS, PinnedBuffers

    made = _fake_pinned(monkeypatch)
    buffers = PinnedBuffers()
    x = torch.randn(5, 7)
    first = buffers.copy(x.as_subclass(_OnCuda))
    (host,) = first.wait()
    assert type(host) is torch.Tensor and torch.equal(host, x) and host.shape == (5, 7)
    assert first.event.recorded == 1 and first.event.synchronized == 1
    assert [m.numel() for m in made] == [MIN_PINNED_ELEMENTS] and made[0].dtype == torch.float32
    first_ptr = host.data_ptr()
    held = buffers.copy(torch.ones(3, 7).as_subclass(_OnCuda))  # the first is still held: a buffer of its own
    assert len(made) == 2 and held.tensors[0].data_ptr() != first_ptr
    event = first.event
    event.done = False
    del first, host  # no request holds it any more, but its copy is still in flight
    third = buffers.copy(torch.ones(2, 7).as_subclass(_OnCuda))
    assert len(made) == 3 and third.tensors[0].data_ptr() != first_ptr
    event.done = True
    y = torch.randn(4, 7)
    fourth = buffers.copy(y.as_subclass(_OnCuda))  # now the first's buffer is free
    assert len(made) == 3 and fourth.tensors[0].data_ptr() == first_ptr and torch.equal(fourth.wait()[0], y)
    assert torch.equal(held.wait()[0], torch.ones(3, 7))  # untouched by the copies after it
    del held, third
    big = buffers.copy(torch.ones(MIN_PINNED_ELEMENTS + 1).as_subclass(_OnCuda))
    assert made[-1].numel() == 2 * MIN_PINNED_ELEMENTS and buffers.buffers == 3  # one too small one replaced
    half = buffers.copy(torch.ones(2, dtype=torch.float16).as_subclass(_OnCuda))
    assert made[-1].dtype == torch.float16 and half.wait()[0].dtype == torch.float16 and buffers.buffers == 4
    on_cpu = torch.ones(2)
    copy = buffers.copy(on_cpu)
    assert copy.event is None and copy.wait()[0] is on_cpu and len(made) == 5
    assert big.wait()[0].numel() == MIN_PINNED_ELEMENTS + 1
