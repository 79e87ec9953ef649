"""Which attention kernel an eager forward runs for a long sequence: measured per device and head geometry.

On CUDA, :func:`measure_crossover` times one sequence of each of :data:`LENGTHS` rows through the two kernels an
eager forward with host bounds can run (:func:`encgraph.models.attention.host_bounds`): Flash varlen (one call
for all sequences) and dense SDPA (one call per sequence, in the towers' own layout: cuDNN on an H200). Both are
timed on the device alone, as they run where they matter (in a replay, and in an eager forward over a long
image, where the host keeps ahead): varlen calls replayed from a CUDA graph (:func:`_graph_ms`), dense calls
issued back to back (:func:`_queued_ms`; each builds a cuDNN plan per new shape, which a graph cannot hold). One
call synced alone times the host at short lengths (0.14-0.17 ms for Flash, 0.17-0.37 ms for FlashAttention-4 on
an H200, whose kernels take 0.02-0.07 ms there), and that made the faster kernel look slower. The
:class:`~encgraph.packing.kernels.Crossover` it returns says from how many rows the dense kernel wins; the
runner measures it at capture for the adapter's head geometries (:func:`choose`), keeps it in the cost model's
JSON (``CostModel.kernels``) and hands the adapter its :func:`rows_table`. The dense kernel is timed a second way
at each length, on a shorter sequence padded to it (:func:`~encgraph.models.dense_sequence.padded_dense`): where
that costs little, dense calls run at bucket lengths (``Crossover.bucket_from``); and the same padded call replayed
from a CUDA graph, its device time alone, as it runs between a piecewise replay's segments (where the host issues
its copies while the segment before runs): from where that beats varlen, those calls stand in at bucket lengths
while their own lengths rent (``Crossover.replay_stand_in_from``; eager calls from ``stand_in_from``), whose plans
capture builds. Measured once per process and geometry (under a second on an H200: 7 lengths, each kernel a few
calls, two new plans per length); a geometry already in a given cost model for this device is not measured
again.

Where the optional FlashAttention-4 wheel can run (:mod:`encgraph.models.fa4`: a Hopper or Blackwell GPU), its
varlen kernel is timed at the same lengths, after its kernels are compiled (seconds, once per process and
geometry); where it is measured faster than torch's Flash kernel (``Crossover.varlen_kernel``) the geometry's
varlen calls run it, in graphs and eager forwards, and the dense crossover is taken against it.

Nothing here changes torch's settings: the dense kernel is the one torch's SDPA picks with its flags as found.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from encgraph.models import attention
from encgraph.models import fa4 as fa4_module
from encgraph.models.dense_plans import WARM_ROWS, warm_lengths, warm_plans
from encgraph.models.dense_sequence import dense_sequence, padded_dense
from encgraph.packing.kernels import Crossover, DenseRule, kernel_key

__all__ = ["LENGTHS", "PADDED_SHARE", "REPEATS", "WARM_ROWS", "attention_calls", "choose", "device_name",
           "measure_crossover", "probe_rows", "probe_slices", "rows_table", "tower_geometries", "warm_lengths",
           "warm_plans"]

log = logging.getLogger("encgraph")

LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384)
"""Rows of the one sequence timed (16,384: the patch rows of a 4096-token image at merge 2; Qwen's processors
go to 16,384 tokens, 65,536 rows, where attention only grows more dominant and the dense kernel's lead holds)."""
PADDED_SHARE = 1 / 32
"""How much shorter than each length the padded timing's sequence is: half a bucket's width
(:data:`~encgraph.packing.kernels.PER_OCTAVE` buckets per doubling), the mean padding (the kernel's work is the
length's either way; the copies into the padded buffers scale with the rows)."""
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
    seen = set()
    for m in module.modules():
        heads, dim = getattr(m, "num_heads", None), getattr(m, "head_dim", None)
        if isinstance(heads, int) and isinstance(dim, int) and heads > 0 and dim > 0:
            seen.add((heads, dim))
    return tuple(sorted(seen))


def attention_calls(module: torch.nn.Module) -> dict[tuple[int, int], int]:
    """Per ``(heads, head_dim)``, the attention calls of one forward of ``module`` over whole images (what host
    bounds cover): its attention layers of that geometry, or, where the config lists its full-attention layers
    (``fullatt_block_indexes``: Qwen2.5-VL, whose other layers attend within windows), that many."""
    counts: dict[tuple[int, int], int] = {}
    for m in module.modules():
        heads, dim = getattr(m, "num_heads", None), getattr(m, "head_dim", None)
        if isinstance(heads, int) and isinstance(dim, int) and heads > 0 and dim > 0:
            counts[(heads, dim)] = counts.get((heads, dim), 0) + 1
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
    in a tower that merges 2 x 2 patches, no bucket is odd (:func:`~encgraph.packing.kernels.bucket_rows`: multiples
    of 8), and successive probes of one length cycle through 32 offsets (1-64 rows), so a later measurement in the
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


def _graph_ms(fn: Any, replays: int = GRAPH_REPLAYS) -> float:
    """ms per replay of a CUDA graph that holds one call of ``fn`` (called once first, outside it: lazy plans
    and compiles), ``replays`` replays issued back to back: the kernel's time on the device with no host work
    per call, as in encgraph's own replays. Where the call cannot be captured, its calls issued back to back
    instead (:func:`_queued_ms`), said in the log. The graph and its outputs are freed on return."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as exc:  # a kernel that cannot be captured: its queued time, the nearest measure
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
    host keeps ahead of it, as in an eager forward over a long image (a padded call issues about a dozen small
    ops, each some 25 us of host time: one call synced alone would time the host)."""
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
    """Time one sequence of each length through Flash varlen (replayed from a CUDA graph: :func:`_graph_ms`) and
    dense SDPA (``repeats`` calls back to back: :func:`_queued_ms`), on random ``(rows, heads, head_dim)`` inputs
    in ``dtype`` on the CUDA ``device`` through the exact calls of :mod:`encgraph.models.attention`; the dense
    kernel at each length over a sequence :data:`PADDED_SHARE` shorter, padded to it
    (:func:`~encgraph.models.dense_sequence.padded_dense`: what the padding costs, where buckets can pay; queued
    too, and replayed from a CUDA graph: its device time, as between a piecewise replay's segments); and, where FlashAttention-4 can run (:func:`_fa4_fits`: its kernels compiled first,
    :func:`encgraph.models.fa4.warm`), its varlen kernel, replayed like Flash. Returns the
    :class:`~encgraph.packing.kernels.Crossover`; the dense kernel's first call just under each length, at one
    no earlier call of this thread ran (:func:`probe_rows`), synced (it builds its plan for that shape), is kept
    beside. Syncs the host (capture time only)."""
    lengths = tuple(sorted(set(lengths)))
    gen = torch.Generator(device=device).manual_seed(0)
    varlen_ms, dense_ms, first_ms, padded_ms, fa4_ms, replay_ms = [], [], [], [], [], []
    with_fa4 = _fa4_fits(head_dim, dtype, device)
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
            short = [t[:max(rows - int(rows * PADDED_SHARE), 1)] for t in qkv]
            varlen_ms.append(_graph_ms(lambda: attention._varlen_attention(*qkv, cu, rows, None, "flash")))
            if with_fa4:
                fa4_ms.append(_graph_ms(lambda: attention._varlen_attention(*qkv, cu, rows, None, "fa4")))
            # The first call at a new length builds its plan (synced: what a new image size pays), timed at a
            # length no earlier call of this thread ran (probe_rows); the steady time, queued, is the kernel's.
            probe = probe_slices(qkv, rows)
            first_ms.append(_first_ms(lambda: dense_sequence(*probe, None)))
            dense_ms.append(_queued_ms(lambda: dense_sequence(*qkv, None), repeats))
            padded_ms.append(_queued_ms(lambda: padded_dense(*short, None, rows), repeats))
            # The same call as a piecewise replay runs it between segments: the device's time alone (the host
            # issues its dozen small ops while the segment before runs).
            replay_ms.append(_graph_ms(lambda: padded_dense(*short, None, rows)))
    return Crossover(device_name(device), heads, head_dim, str(dtype).replace("torch.", ""), lengths,
                     [round(t, 5) for t in varlen_ms], [round(t, 5) for t in dense_ms],
                     dense_first_ms=[round(t, 5) for t in first_ms], padded_ms=[round(t, 5) for t in padded_ms],
                     fa4_ms=[round(t, 5) for t in fa4_ms], padded_replay_ms=[round(t, 5) for t in replay_ms])


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
    geometry's varlen calls then run the kernel its crossover chose (:func:`encgraph.models.fa4.use`): a cost model
    measured without FlashAttention-4 where it can now run (or the reverse), or without the padded call's replay
    times (``Crossover.padded_replay_ms``: a cost model saved before they were measured), is measured again."""
    if device.type != "cuda" or attention._varlen()[0] is None or dtype not in (torch.float16, torch.bfloat16):
        return {}
    name, kind = device_name(device), str(dtype).replace("torch.", "")
    out: dict[str, Crossover] = {}
    for heads, dim in tower_geometries(module):
        key = kernel_key(name, heads, dim, kind)
        found = (known or {}).get(key) or _MEASURED.get(key)
        if found is not None and bool(found.fa4_ms) != _fa4_fits(dim, dtype, device):
            found = None  # FlashAttention-4 installed (or removed) since: measure again, with (or without) it
        if found is not None and not found.padded_replay_ms:
            found = None  # a cost model of before the padded call's replay times: its split calls would not bucket
        if found is None:
            try:
                found = _MEASURED[key] = measure_crossover(heads, dim, dtype, device)
            except Exception as exc:  # measurement only: eager forwards keep the default crossover
                log.warning("encgraph: the attention kernel crossover of %d heads x %d was not measured (%s: %s); "
                            "eager forwards use the default of %d rows.", heads, dim, type(exc).__name__, exc,
                            attention.SEGMENT_MIN_ROWS)
                continue
            log.info("encgraph: %s, %d heads x %d %s: varlen kernel %s, dense SDPA per sequence from %s rows "
                     "(varlen ms %s, FlashAttention-4 ms %s, dense ms %s at %s rows).", name, heads, dim, kind,
                     found.varlen_kernel, found.min_rows if found.min_rows else "no length", list(found.varlen_ms),
                     list(found.fa4_ms) or "not measured", list(found.dense_ms), list(found.lengths))
        fa4_module.use(heads, dim, dtype, device, found.varlen_kernel)
        out[key] = found
    return out


def rows_table(crossovers: Iterable[Crossover], calls: Mapping[tuple[int, int], int] | None = None
               ) -> attention.RowsTable:
    """``{(heads, head_dim, dtype): DenseRule}`` for :func:`encgraph.models.attention.host_bounds`: each crossover's
    rows, its times (for rent-or-buy at new lengths) and ``calls[(heads, head_dim)]`` (1 where not given)."""
    calls = calls or {}
    return {(c.heads, c.head_dim, getattr(torch, c.dtype)):
            DenseRule(c.min_rows, c, calls.get((c.heads, c.head_dim), 1)) for c in crossovers}
