"""Host tensors to a device (encgraph.capture.upload) on the CPU: values, dtype and layout as ``copy_``/``to``
give them, a non-contiguous or other-typed source included. Pinning and not blocking are CUDA's:
tests/gpu/test_upload_gpu.py checks them against work queued on the device."""

from __future__ import annotations

import torch

from encgraph.capture.upload import copy_into, to_device


def test_to_device_on_the_cpu_is_the_tensor_moved():
    host = torch.arange(12).reshape(3, 4)
    moved = to_device(host, torch.device("cpu"))
    assert torch.equal(moved, host) and moved.dtype == torch.int64


def test_copy_into_converts_and_accepts_a_transposed_source():
    view = torch.zeros(4, 3, dtype=torch.int32)
    source = torch.arange(12, dtype=torch.int64).reshape(3, 4).t()  # non-contiguous, another dtype
    copy_into(view, source)
    assert torch.equal(view, source.to(torch.int32))


def test_copy_into_writes_only_the_view():
    storage = torch.full((6,), -1.0)
    copy_into(storage[:2], torch.tensor([1.0, 2.0]))
    assert storage.tolist() == [1.0, 2.0, -1.0, -1.0, -1.0, -1.0]
