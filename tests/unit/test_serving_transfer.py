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
