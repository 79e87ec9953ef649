"""The capture's static buffers on the CPU (encgraph.capture.buffers): the input buffers set aside for the
capture's eager phase and allocated again after it; the output buffers shaped at the warm-up and made only at the
first capture, once: the forward's own outputs where they own their storage, copies otherwise."""

from __future__ import annotations

import pytest
import torch

from encgraph.capture.buffers import PathBuffers, PathOutputs
from encgraph.capture.protocol import BufferSpec, FillRule
from encgraph.errors import CaptureError


def _buffers() -> PathBuffers:
    specs = {b: {"pixels": BufferSpec((b, 3, 4), torch.float32, FillRule.REPEAT_LAST),
                 "ids": BufferSpec((b,), torch.int64, FillRule.ARANGE)} for b in (2, 8)}
    return PathBuffers("default", specs, torch.device("cpu"))


def test_input_buffers_set_aside_hold_nothing_and_come_back_at_full_size():
    buffers = _buffers()
    full = buffers.nbytes
    with buffers.set_aside():
        assert buffers.storage == {} and buffers.nbytes == 0
    assert buffers.nbytes == full
    assert {n: tuple(t.shape) for n, t in buffers.storage.items()} == {"pixels": (8, 3, 4), "ids": (8,)}
    values = {"pixels": torch.arange(36.0).reshape(3, 3, 4), "ids": torch.tensor([5, 6, 7])}
    views = buffers.fill(8, values)
    assert torch.equal(views["pixels"][:3], values["pixels"])
    assert torch.equal(views["pixels"][3:], values["pixels"][2:3].expand(5, 3, 4))  # the last row repeated
    assert views["ids"].tolist() == [5, 6, 7, 3, 4, 5, 6, 7]  # the arange continues past the items


def test_input_buffers_come_back_when_the_block_raises():
    buffers = _buffers()
    with pytest.raises(ValueError), buffers.set_aside():
        raise ValueError("an eager check failed")
    assert set(buffers.storage) == {"pixels", "ids"}


def test_output_buffers_are_shaped_at_the_warm_up_and_allocated_once_at_the_first_capture():
    outputs = PathOutputs("default", torch.device("cpu"))
    produced = {"last_hidden_state": torch.zeros(4, 5, 6, dtype=torch.bfloat16), "pooled": torch.zeros(4, 6)}
    outputs.learn(produced, (1, 4, 16))
    assert outputs.storage == {} and outputs.nbytes == 0  # nothing held through the self-check's eager phase
    outputs.learn({"other": torch.zeros(4, 2)}, (1, 4, 16))  # a later warm-up changes nothing
    outputs.allocate()
    first = dict(outputs.storage)
    assert {n: (tuple(t.shape), t.dtype) for n, t in first.items()} == {
        "last_hidden_state": ((16, 5, 6), torch.bfloat16), "pooled": ((16, 6), torch.float32)}
    outputs.allocate()  # every later capture of the path writes the same tensors
    assert all(outputs.storage[n] is t for n, t in first.items())
    assert outputs.view(4)["pooled"].shape == (4, 6)


def test_output_buffers_never_shaped_cannot_be_allocated():
    with pytest.raises(CaptureError, match="never shaped"):
        PathOutputs("default", torch.device("cpu")).allocate()


def test_the_first_capture_adopts_the_outputs_that_own_their_storage_and_copies_the_others():
    outputs = PathOutputs("default", torch.device("cpu"))
    hidden = torch.randn(4, 5, 6)
    inputs = torch.randn(4, 5, 6)
    produced = {
        "last_hidden_state": hidden,  # the forward's own tensor: adopted as it is
        "pooled": hidden[:, 0],  # a view of another output: copied
        "echo": inputs,  # an input buffer returned as it is: copied, never written over by a later budget
        "twice": hidden,  # one storage named twice: the second copied
        "strided": torch.randn(6, 4).t(),  # not contiguous: copied
    }
    outputs.learn(produced, (1, 2, 4))
    targets = outputs.adopt(produced, {inputs.untyped_storage().data_ptr()})
    assert targets["last_hidden_state"] is hidden
    for name in ("pooled", "echo", "twice", "strided"):
        assert targets[name] is not produced[name] and targets[name].is_contiguous()
        assert torch.equal(targets[name], produced[name])
    ptrs = [t.untyped_storage().data_ptr() for t in targets.values()]
    assert len(set(ptrs)) == len(ptrs) and inputs.untyped_storage().data_ptr() not in ptrs
    assert outputs.storage == targets and outputs.view(2)["pooled"].shape == (2, 6)
    with pytest.raises(CaptureError, match="exist already"):
        outputs.adopt(produced, set())


def test_a_first_capture_smaller_than_the_ladder_gets_buffers_of_the_ladders_rows():
    # The largest budget is captured first; where it failed and was dropped, the next one is the path's first: its
    # outputs are copied into buffers of the learned rows (never adopted short), and a later budget's view fits.
    outputs = PathOutputs("default", torch.device("cpu"))
    outputs.learn({"x": torch.zeros(8, 3), "y": torch.zeros(8, 2, dtype=torch.float64)}, (2, 4, 8))
    small = {"x": torch.randn(4, 3), "y": torch.randn(4, 2)}  # y: float32 where float64 was learned
    targets = outputs.adopt(small, set())
    assert targets["x"].shape == (8, 3) and targets["x"] is not small["x"]
    assert torch.equal(targets["x"][:4], small["x"]) and targets["y"].dtype == torch.float64
    assert outputs.view(4)["y"].shape == (4, 2)


def test_output_buffers_never_shaped_cannot_be_adopted():
    with pytest.raises(CaptureError, match="never shaped"):
        PathOutputs("default", torch.device("cpu")).adopt({"x": torch.zeros(2)}, set())


@pytest.mark.parametrize(("ladder", "adopts"), [
    ((1, 2, 4, 8, 16, 32), True),  # a batch ladder: 16 fits beside the adopted outputs of 32
    ((32,), True),
    ((1, 2, 3, 4), False),  # 3 of 4 is more than half: not adopted
    ((64, 128, 3840, 4096), False),  # a token ladder: 3840 would not fit the space the outputs of 4096 split
    ((4096, 64, 2048), True),
])
def test_outputs_are_adopted_only_where_the_next_budget_is_at_most_half_the_largest(ladder, adopts):
    outputs = PathOutputs("default", torch.device("cpu"))
    outputs.learn({"x": torch.zeros(1, 3)}, ladder)
    assert outputs.adopts is adopts
