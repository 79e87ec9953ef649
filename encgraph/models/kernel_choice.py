"""Which attention kernels a tower runs: measured per device and head geometry at capture.

:func:`measure_crossover` times one sequence of each of :data:`LENGTHS` rows through the kernels a tower's attention
can run: torch's Flash varlen and, where the optional FlashAttention-4 wheel can run (:mod:`encgraph.models.fa4`: a
Hopper or Blackwell GPU; its kernels compiled first, seconds once per process and geometry), FlashAttention-4's
varlen kernel, and where the optional ``nvidia-cudnn-frontend`` wheel can run (:mod:`encgraph.models.cudnn_varlen`),
cuDNN's packed SDPA, each replayed from a CUDA graph (:func:`_graph_ms`: the device's time, as in a replay; one call
synced alone times the host, 0.14-0.37 ms at short lengths where the kernels take 0.02-0.07); and dense SDPA per
sequence in the towers' own layout (cuDNN on an H100 or H200), its calls issued back to back as an eager forward
issues them (:func:`_queued_ms`), and its first call at a length new to the thread (:func:`probe_rows`: it builds
cuDNN's plan for that shape). The :class:`~encgraph.packing.crossover.Crossover` it returns says which varlen kernel
the geometry runs in graphs and which in eager forwards (:func:`choose` registers them:
:func:`encgraph.models.varlen_kernel.use`), and from how many rows an eager forward runs a sequence dense
(:meth:`~encgraph.packing.crossover.Crossover.dense_from`, through :func:`rows_table`). The runner calls
:func:`choose` through the adapter at capture and keeps the result in the cost model's JSON
(``CostModel.kernels``); a geometry already in a given cost model for this device is not measured again. Under a
second per geometry on an H200.

Nothing here changes torch's settings: the dense kernel is the one torch's SDPA picks with its flags as found.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from encgraph.models import attention, cudnn_varlen, varlen_kernel
from encgraph.models import fa4 as fa4_module
from encgraph.models.exact_attention import dense_sequence
from encgraph.packing.crossover import Crossover, kernel_key

__all__ = ["LENGTHS", "REPEATS", "attention_calls", "choose", "device_name", "measure_crossover", "probe_rows",
           "probe_slices", "rows_table", "tower_geometries"]

log = logging.getLogger("encgraph")

LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384)
"""Rows of the one sequence timed (16,384: the patch rows of a 4096-token image at merge 2; Qwen's processors
go to 16,384 tokens, 65,536 rows, where attention only grows more dominant and the dense kernel's lead holds)."""
REPEATS = 3
"""Dense calls per length issued back to back and timed together (:func:`_queued_ms`), after a first call timed
alone and kept apart (at a new length it includes the dense kernel's plan for that shape)."""

_MEASURED: dict[str, Crossover] = {}
"""Measurements of this process, by key: a second runner of the same geometry reuses them."""


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def tower_geometries(module: torch.nn.Module) -> tuple[tuple[int, int], ...]:
    """``(heads, head_dim)`` of every attention layer of ``module`` (the Hugging Face vision attention classes
    keep both as ints), distinct, sorted."""
    return tuple(sorted(set(_layer_geometries(module))))


def _layer_geometries(module: torch.nn.Module) -> Iterable[tuple[int, int]]:
    """``(heads, head_dim)`` of each attention layer of ``module`` whose calls the packed kernels run: not
    ``nn.MultiheadAttention`` (a pooling head's, as SigLIP's and SigLIP2's: it attends with torch's own dense
    kernel, per image, so no crossover of ours applies to it and its calls are not the tower's packed ones)."""
    for m in module.modules():
        if isinstance(m, torch.nn.MultiheadAttention):
            continue
        heads, dim = getattr(m, "num_heads", None), getattr(m, "head_dim", None)
        if isinstance(heads, int) and isinstance(dim, int) and heads > 0 and dim > 0:
            yield heads, dim


def attention_calls(module: torch.nn.Module) -> dict[tuple[int, int], int]:
    """Per ``(heads, head_dim)``, the attention calls of one forward of ``module`` over whole images (what host
    bounds cover): its attention layers of that geometry, or, where the config lists its full-attention layers
    (``fullatt_block_indexes``: Qwen2.5-VL, whose other layers attend within windows), that many."""
    counts: dict[tuple[int, int], int] = {}
    for geometry in _layer_geometries(module):
        counts[geometry] = counts.get(geometry, 0) + 1
    full = getattr(getattr(module, "config", None), "fullatt_block_indexes", None)
    if isinstance(full, (list, tuple)) and full:
        counts = {geometry: min(n, len(full)) for geometry, n in counts.items()}
    return counts


_PROBES = itertools.count()


def probe_rows(rows: int) -> int:
    """An odd length a few rows under ``rows``, another at each call of the process: where the dense kernel's
    first call is timed (:func:`measure_crossover`). Torch keeps cuDNN's attention plans per thread and shape, and
    a thread that already ran dense SDPA at ``rows`` (the tower's own forward, a benchmark's floor: on an H200 the
    measured plan cost fell from about 65 ms to 0.15) would make a new length look free. No image has an odd length
    in a tower that merges 2 x 2 patches, and successive probes of one length cycle through 32 offsets (1-64 rows), so a later measurement in the
    process meets an earlier one's plan only after 32 of them.

    >>> a, b = probe_rows(4096), probe_rows(4096)
    >>> a % 2 == b % 2 == 1 and a != b and 4096 - 64 <= min(a, b) < max(a, b) < 4096
    True
    """
    rows = int(rows)
    if rows <= 64:  # shorter than any measured length (LENGTHS): just under it
        return max(rows - 1, 1)
    return rows - (2 * (next(_PROBES) % 32) + 1 + rows % 2)  # odd: an odd offset from an even length


def probe_slices(qkv: Sequence[torch.Tensor], rows: int) -> list[torch.Tensor]:
    """The first :func:`probe_rows` rows of each of ``q, k, v`` (``(rows, heads, head_dim)`` each): one probe
    length drawn once for the three (a length drawn per tensor gave keys and values of different lengths, which
    cuDNN's SDPA does not check: on an H200 it failed or crashed the process)."""
    n = probe_rows(rows)
    return [t[:n] for t in qkv]


def _first_ms(fn: Any) -> float:
    """ms of one call of ``fn``, synced: at a new shape, what its first call costs, plan included."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end))


GRAPH_REPLAYS = 10
"""Replays of a one-call CUDA graph timed back to back by :func:`_graph_ms`, after an untimed one."""


def _graph_ms(fn: Any, replays: int = GRAPH_REPLAYS, *, strict: bool = False) -> float:
    """ms per replay of a CUDA graph that holds one call of ``fn`` (called once first, outside it: lazy plans
    and compiles), ``replays`` replays issued back to back: the kernel's time on the device with no host work
    per call, as in encgraph's own replays. Where the call cannot be captured, its calls issued back to back
    instead (:func:`_queued_ms`), said in the log; with ``strict`` (a kernel that runs in graphs only) the
    capture's error is raised. The graph and its outputs are freed on return."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as exc:  # a kernel that cannot be captured: its queued time, the nearest measure
        if strict:
            raise
        log.warning("encgraph: an attention kernel could not be captured to be timed (%s: %s); it is timed "
                    "queued instead.", type(exc).__name__, exc)
        del graph
        return _queued_ms(fn, replays)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    del graph
    return float(start.elapsed_time(end)) / replays


def _queued_ms(fn: Any, repeats: int) -> float:
    """ms per call of ``repeats`` calls issued back to back after an untimed first: the device's time where the
    host keeps ahead of it, as in an eager forward over a long image (one call synced alone would time the host
    as well)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / repeats


def measure_crossover(
    heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, *,
    lengths: Iterable[int] = LENGTHS, repeats: int = REPEATS,
) -> Crossover:
    """Time one sequence of each length through Flash varlen and, where they can run, FlashAttention-4
    (:func:`_fa4_fits`: its kernels compiled first, :func:`encgraph.models.fa4.warm`) and cuDNN's packed SDPA
    (:func:`encgraph.models.cudnn_varlen.fits`; a failure logged and the kernel left out), each replayed from a CUDA
    graph (:func:`_graph_ms`), and through dense SDPA (``repeats`` calls back to back: :func:`_queued_ms`; its first
    call just under each length, at one no earlier call of this thread ran, :func:`probe_rows`, synced: its plan),
    on random ``(rows, heads, head_dim)`` inputs in ``dtype`` on the CUDA ``device``, through the exact calls of
    :mod:`encgraph.models.attention`. Returns the :class:`~encgraph.packing.crossover.Crossover`. Syncs the host
    (capture time only)."""
    lengths = tuple(sorted(set(lengths)))
    gen = torch.Generator(device=device).manual_seed(0)
    varlen_ms, dense_ms, first_ms, fa4_ms, cudnn_ms = [], [], [], [], []
    with_fa4, with_cudnn = _fa4_fits(head_dim, dtype, device), cudnn_varlen.fits(head_dim, dtype, device)
    if with_fa4:
        try:
            seconds = fa4_module.warm(heads, head_dim, dtype, device)
        except Exception as exc:  # a wheel that cannot run this geometry: torch's kernel, said once
            log.warning("encgraph: FlashAttention-4 failed at %d heads x %d (%s: %s); packed attention keeps "
                        "torch's Flash kernel there.", heads, head_dim, type(exc).__name__, exc)
            with_fa4 = False
        else:
            log.info("encgraph: FlashAttention-4 kernels for %d heads x %d compiled in %.1f s.", heads, head_dim,
                     seconds)
    with torch.inference_mode(), torch.cuda.device(device):
        for rows in lengths:
            qkv = [torch.randn(rows, heads, head_dim, device=device, dtype=dtype, generator=gen) for _ in "qkv"]
            cu = torch.tensor([0, rows], device=device, dtype=torch.int32)
            varlen_ms.append(_graph_ms(lambda: attention._varlen_attention(*qkv, cu, rows, None, "flash")))
            if with_fa4:
                fa4_ms.append(_graph_ms(lambda: attention._varlen_attention(*qkv, cu, rows, None, "fa4")))
            if with_cudnn:
                try:
                    cudnn_ms.append(_graph_ms(lambda: attention._varlen_attention(*qkv, cu, rows, None, "cudnn"),
                                              strict=True))
                except Exception as exc:  # a geometry it cannot plan or capture: the other kernels, said once
                    log.warning("encgraph: cuDNN's packed SDPA failed at %d heads x %d (%s: %s); graphs keep the "
                                "other kernels there.", heads, head_dim, type(exc).__name__, exc)
                    with_cudnn, cudnn_ms = False, []
            probe = probe_slices(qkv, rows)
            first_ms.append(_first_ms(lambda: dense_sequence(*probe, None)))
            dense_ms.append(_queued_ms(lambda: dense_sequence(*qkv, None), repeats))
    return Crossover(device_name(device), heads, head_dim, str(dtype).replace("torch.", ""), lengths,
                     [round(t, 5) for t in varlen_ms], [round(t, 5) for t in dense_ms],
                     dense_first_ms=[round(t, 5) for t in first_ms], fa4_ms=[round(t, 5) for t in fa4_ms],
                     cudnn_ms=[round(t, 5) for t in cudnn_ms])


def _fa4_fits(head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether FlashAttention-4 can run this geometry here: installed, a Hopper or Blackwell GPU, fp16/bf16, a head
    dim that is a multiple of 8 up to 256 (its Hopper kernels' range)."""
    return (dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and 8 <= head_dim <= 256
            and fa4_module.available(device))


def choose(
    module: torch.nn.Module, dtype: torch.dtype, device: torch.device, known: Mapping[str, Crossover] | None = None
) -> dict[str, Crossover]:
    """The crossover of every head geometry of ``module`` on ``device``: from ``known`` (a given cost model's) or
    this process's earlier measurements where they cover it, else measured now. Empty off CUDA, where there is
    no varlen kernel to choose against (every sequence runs on its own there), and where this torch has no
    varlen kernel; a failed measurement is logged and leaves that geometry on the default crossover. Each
    geometry's varlen calls then run the kernels its crossover chose, in graphs and eager
    (:func:`encgraph.models.varlen_kernel.use`): a cost model measured without FlashAttention-4 or cuDNN's packed
    SDPA where it can now run (or the reverse) is measured again."""
    if device.type != "cuda" or attention._varlen()[0] is None or dtype not in (torch.float16, torch.bfloat16):
        return {}
    name, kind = device_name(device), str(dtype).replace("torch.", "")
    out: dict[str, Crossover] = {}
    for heads, dim in tower_geometries(module):
        key = kernel_key(name, heads, dim, kind)
        found = (known or {}).get(key) or _MEASURED.get(key)
        if found is not None and (bool(found.fa4_ms) != _fa4_fits(dim, dtype, device)
                                  or bool(found.cudnn_ms) != cudnn_varlen.fits(dim, dtype, device)):
            found = None  # a kernel installed (or removed) since: measure again, with (or without) it
        if found is None:
            try:
                found = _MEASURED[key] = measure_crossover(heads, dim, dtype, device)
            except Exception as exc:  # measurement only: eager forwards keep the default crossover
                log.warning("encgraph: the attention kernel crossover of %d heads x %d was not measured (%s: %s); "
                            "eager forwards use the default of %d rows.", heads, dim, type(exc).__name__, exc,
                            attention.SEGMENT_MIN_ROWS)
                continue
            log.info("encgraph: %s, %d heads x %d %s: graph kernel %s, eager varlen kernel %s, dense SDPA faster "
                     "from %s rows (varlen ms %s, FlashAttention-4 ms %s, cuDNN ms %s, dense ms %s at %s rows).",
                     name, heads, dim, kind, found.graph_kernel, found.varlen_kernel,
                     found.min_rows if found.min_rows else "no length", list(found.varlen_ms),
                     list(found.fa4_ms) or "not measured", list(found.cudnn_ms) or "not measured",
                     list(found.dense_ms), list(found.lengths))
        varlen_kernel.use(heads, dim, dtype, device, found.graph_kernel, eager=found.varlen_kernel)
        out[key] = found
    return out


def rows_table(crossovers: Iterable[Crossover], calls: Mapping[tuple[int, int], int] | None = None
               ) -> attention.RowsTable:
    """``{(heads, head_dim, dtype): rows}`` for :func:`encgraph.models.attention.host_bounds`: from how many rows
    an eager forward runs a sequence of each geometry dense (:meth:`Crossover.dense_from` of its
    ``calls[(heads, head_dim)]`` attention calls per forward, 1 where not given; ``None``: never)."""
    calls = calls or {}
    return {(c.heads, c.head_dim, getattr(torch, c.dtype)): c.dense_from(calls.get((c.heads, c.head_dim), 1))
            for c in crossovers}
