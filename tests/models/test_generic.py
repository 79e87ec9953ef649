"""The generic batch-first adapter and ``graphed()`` for plain modules (CPU, static and eager modes)."""

from __future__ import annotations

import pytest
import torch

import encgraph
from encgraph.capture.records import RunMode
from encgraph.errors import ConfigError, EncgraphError, InputError, InputTypeError
from encgraph.models.generic import GenericModuleAdapter, take_rows
from tests.models.fixtures_fixed import LADDER, assert_items_close


class TwoHeads(torch.nn.Module):
    """Returns a tuple, or a dict, of two batch-first tensors of different trailing shapes."""

    def __init__(self, as_dict: bool = False) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 6).requires_grad_(False)
        self.as_dict = as_dict

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, ...] | dict[str, torch.Tensor]:
        h = torch.tanh(self.lin(x)) * scale[:, None, None]
        pooled = h.mean(1)
        return {"tokens": h, "pooled": pooled} if self.as_dict else (h, pooled)


def sequential() -> torch.nn.Module:
    torch.manual_seed(0)
    # Frozen, as a served module: with trainable parameters a plain call asks for autograd and the module's
    # own forward answers it (tests/models/test_dropin.py).
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).requires_grad_(False)


def inputs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, 8, generator=gen), torch.rand(n, generator=gen) + 0.5


@pytest.mark.parametrize("mode", [RunMode.STATIC, RunMode.EAGER])
def test_sequential_any_batch_size(mode):
    net = sequential()
    fast = encgraph.graphed(net, mode=mode, budgets=LADDER)
    assert isinstance(encgraph.graphs(fast).adapter, GenericModuleAdapter)
    for n in range(1, 10):  # over the largest batch size: several batches
        x = torch.randn(n, 8)
        out = fast(x)
        assert isinstance(out, torch.Tensor)
        assert_items_close(out, net(x).detach())
    assert encgraph.graphs(fast).stats["items"] == sum(range(1, 10))


@pytest.mark.parametrize("as_dict", [False, True], ids=["tuple", "dict"])
def test_structured_outputs_keep_their_type(as_dict):
    torch.manual_seed(0)
    net = TwoHeads(as_dict)
    fast = encgraph.graphed(net, budgets=LADDER, mode=RunMode.STATIC)
    for n in (1, 3, 6):
        x, scale = inputs(n, seed=n)
        out, ref = fast(x, scale), net(x, scale)
        assert type(out) is type(ref)
        pairs = [(out[k], ref[k]) for k in ref] if as_dict else list(zip(out, ref))
        if as_dict:
            assert list(out) == list(ref)
        for a, b in pairs:
            assert_items_close(a, b.detach())


def test_example_allows_capture_before_the_first_call():
    net = sequential()
    with pytest.raises(ConfigError, match="example="):
        encgraph.graphed(net, budgets=LADDER, mode=RunMode.STATIC).capture()
    fast = encgraph.graphed(net, adapter_options={"example": torch.zeros(1, 8)}, budgets=LADDER, mode=RunMode.STATIC)
    encgraph.graphs(fast).capture()
    x = torch.randn(3, 8)
    assert_items_close(fast(x), net(x).detach())


def test_bad_calls_raise_clear_errors():
    fast = encgraph.graphed(TwoHeads(), budgets=LADDER, mode=RunMode.STATIC)
    x, scale = inputs(3, seed=0)
    with pytest.raises(InputTypeError, match="keyword arguments"):
        fast(x, scale=scale)
    fast(x, scale)
    with pytest.raises(InputError, match="trailing shapes"):  # a new trailing shape would need other graphs
        fast(torch.randn(3, 7, 8), scale)
    with pytest.raises(InputError, match="trailing shapes"):
        fast(x.double(), scale)
    with pytest.raises(InputError, match="same batch size"):
        fast(x, scale[:2])
    with pytest.raises(InputTypeError, match="batch-first tensor"):
        fast(x, 2.0)
    with pytest.raises(EncgraphError):
        encgraph.graphed("not a module", mode=RunMode.STATIC)


@pytest.mark.parametrize("rows", [[2, 3, 4], [4, 0, 2], [0], [], [3, 2], [1, 1]])
def test_take_rows_views_one_run_and_gathers_the_rest(rows):
    import numpy as np

    t = torch.arange(30.0).reshape(6, 5)
    for given in (rows, np.asarray(rows, dtype=np.int64)):
        got = take_rows(t, given)
        assert torch.equal(got, t[torch.as_tensor(rows, dtype=torch.long)])
        one_run = rows == list(range(rows[0], rows[0] + len(rows))) if rows else True
        assert (got.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()) is one_run
