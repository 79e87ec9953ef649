"""A CPU stand-in for ``torch.cuda.CUDAGraph`` / ``torch.cuda.graph``, to run vLLM's real encoder manager here.

A CUDA graph records the kernels a block launches and replays them later on the same memory: inputs are read
from the captured addresses at replay time, and everything the host decided during capture (shapes, Python
branches, ``.item()`` values) is frozen. :class:`RecordedGraph` does the same with a ``TorchDispatchMode``:
during capture it records every aten call with its arguments; ``replay()`` re-runs the calls in order, on the
same input tensors, substituting each recorded intermediate by its replayed value. Tensors created outside the
block (the manager's buffers) are read and written in place, as a graph would; so are the tensors the block
made (a graph's outputs keep their memory: encgraph's runner keeps its largest graph's outputs as the path's
output buffers), each written again with its replayed value.

It is a test double for the graph API only: vLLM's manager code (budgets, packing, buffer copies, padding
logic, scatter) runs unchanged around it. :func:`graph_mode_on_cpu` likewise runs encgraph's own runner in GRAPH
mode after capture (replays into each path's one shared output buffer, results copied out of it) on the CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["RecordedGraph", "recorded_graph", "patch_cuda_graphs", "graph_mode_on_cpu"]


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


class RecordedGraph:
    """Stand-in for ``torch.cuda.CUDAGraph``: ``replay()`` re-runs the aten calls recorded at capture."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.ops: list = []
        self.replays = 0

    def replay(self) -> None:
        env: dict[int, torch.Tensor] = {}

        def sub(x: Any) -> Any:
            return env.get(id(x), x) if isinstance(x, torch.Tensor) else x

        for func, args, kwargs, out in self.ops:
            new = func(*tree_map(sub, args), **tree_map(sub, kwargs))
            for old_t, new_t in zip(tree_flatten(out)[0], tree_flatten(new)[0]):
                if isinstance(old_t, torch.Tensor):
                    env[id(old_t)] = new_t
                    if new_t is not old_t and not old_t._is_view() and old_t.shape == new_t.shape:
                        # The captured tensor's memory holds the replayed value, and later calls (a view of it
                        # written in place) act on that memory, as in a graph.
                        _write(old_t, new_t)
                        env[id(old_t)] = old_t
        self.replays += 1


def _write(old: torch.Tensor, new: torch.Tensor) -> None:
    mode = torch.inference_mode() if old.is_inference() else contextlib.nullcontext()
    with mode, torch.no_grad():
        old.copy_(new)


@contextlib.contextmanager
def recorded_graph(graph: RecordedGraph, pool: Any = None, stream: Any = None, **kwargs: Any) -> Iterator[None]:
    """Stand-in for ``torch.cuda.graph(graph, pool=..., stream=...)``: records the block's aten calls."""
    with _Recorder(graph.ops):
        yield


def patch_cuda_graphs(monkeypatch: Any) -> None:
    """Replace ``torch.cuda.CUDAGraph`` and ``torch.cuda.graph`` by the stand-ins for the test's duration."""
    monkeypatch.setattr(torch.cuda, "CUDAGraph", RecordedGraph)
    monkeypatch.setattr(torch.cuda, "graph", recorded_graph)


def graph_mode_on_cpu(runner: Any) -> None:
    """Turn a captured STATIC-mode runner on the CPU into a GRAPH-mode one whose graphs are :class:`RecordedGraph`
    s: per path and budget, the static forward recorded with its copy into the path's shared output buffer, as
    ``encgraph.capture.capture`` captures it (capture itself needs CUDA: streams, pools, synchronisation)."""
    from encgraph.capture.records import GraphRecord, RunMode

    for path, ladder in runner.ladders.items():
        for budget in (b for b in ladder if b > 0):
            views = runner.buffers[path].fill(budget, None)
            runner.outputs[path].ensure(runner.adapter.forward_static(path, views, budget), ladder)
            targets = runner.outputs[path].view(budget)
            graph = RecordedGraph()
            with recorded_graph(graph):
                produced = runner.adapter.forward_static(path, views, budget)
                for name, target in targets.items():
                    target.copy_(produced[name])
            runner.records[path][budget] = GraphRecord(path, budget, graph, views, targets, 0.0, 0)
    runner.mode = RunMode.GRAPH
