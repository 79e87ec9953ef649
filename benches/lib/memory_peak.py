"""What was alive at a run's peak of allocated device memory, from torch's allocator history.

``anymodule.py --memory-history`` records ``torch.cuda.memory._record_memory_history`` (Python stacks) over each
system's warm-up and reads the trace here: the allocations alive when the bytes allocated *during the recording*
peaked, grouped by where they were made. Issue 55's point 5 asks for encgraph's peak no higher than
``torch.compile(mode="reduce-overhead")``'s; the capture's own phase figures (``memory_peak_rise_mib``) say which
phase raised the peak, and this says which tensors made it.

The trace (``torch.cuda.memory._snapshot()["device_traces"][device]``) is a list of events, each a dict with
``action`` (``alloc``, ``free_requested``, ``free_completed``, ``segment_alloc``, ``segment_free``, ``oom``, ...),
``addr``, ``size`` and ``frames`` (``filename``, ``line``, ``name``; innermost first). The allocator's allocated
bytes fall at ``free_completed`` (a block freed on one stream while another still used it is counted until
then), so that is where an allocation ends here. Blocks allocated before the recording started are not in the
trace: their frees are ignored, so the figure is the peak of what the recording saw allocated, an upper bound on
how far the recorded span raised the process's peak. A trace that hit ``max_entries`` lost its oldest events;
completed frees of blocks the trace never saw allocated (``unknown_frees``) count both kinds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["live_at_peak", "site"]

# Frames of these files say nothing about which caller's tensor it is: the site is the innermost frame outside them.
_PLUMBING = ("/torch/", "/torch\\", "<frozen", "/contextlib.py", "/functools.py")


def site(frames: Sequence[Mapping[str, Any]], roots: Sequence[str] = ("encgraph/", "benches/")) -> str:
    """Where an allocation was made, as ``name (file:line)``: the innermost frame outside torch and the standard
    library, then, after ``<-``, the innermost frame of ``roots`` (this project's code) above it where that is a
    different frame. ``?`` for an allocation without frames (history recorded without Python stacks)."""
    def label(f: Mapping[str, Any]) -> str:
        name = str(f.get("filename", "?"))
        short = "/".join(name.replace("\\", "/").split("/")[-2:])
        return f"{f.get('name', '?')} ({short}:{f.get('line', '?')})"

    frames = list(frames)
    inner = next((f for f in frames if not any(p in str(f.get("filename", "")) for p in _PLUMBING)), None)
    ours = next((f for f in frames if any(r in str(f.get("filename", "")).replace("\\", "/") for r in roots)), None)
    if inner is None and ours is None:
        return label(frames[0]) if frames else "?"
    if inner is None or ours is None or ours is inner:
        return label(inner if inner is not None else ours)  # type: ignore[arg-type]
    return f"{label(inner)} <- {label(ours)}"


def live_at_peak(trace: Sequence[Mapping[str, Any]], top: int = 12) -> dict[str, Any]:
    """The peak of the bytes allocated over ``trace`` (alloc minus completed frees of blocks it saw allocated)
    and the allocations alive at that peak: ``peak_mib``, ``at_event`` (the event index of the peak), ``live``
    (how many blocks), ``sites`` (the ``top`` largest groups by :func:`site`: ``[site, MiB, blocks]``, largest
    first, the rest summed as ``(other)``), ``end_mib`` (still allocated at the trace's end) and
    ``unknown_frees`` (completed frees of blocks the trace never saw allocated: from before the recording, or lost
    to a full history)."""
    if top < 1:
        raise ValueError(f"top: expected an int >= 1 (groups to list), got {top!r}")
    live: dict[int, int] = {}
    current = peak = 0
    peak_at = -1
    unknown = 0
    for i, e in enumerate(trace):
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = i
            current += int(e["size"])
            if current > peak:
                peak, peak_at = current, i
        elif action == "free_completed":
            start = live.pop(e["addr"], None)
            if start is None:
                unknown += 1
            else:
                current -= int(trace[start]["size"])
    # Second pass: the blocks alive at the peak event (allocated at or before it, not freed by then).
    alive: dict[int, int] = {}
    for e_i, e in enumerate(trace[: peak_at + 1]):
        if e.get("action") == "alloc":
            alive[e["addr"]] = e_i
        elif e.get("action") == "free_completed":
            alive.pop(e["addr"], None)
    groups: dict[str, list[int]] = {}
    for start in alive.values():
        e = trace[start]
        g = groups.setdefault(site(e.get("frames") or ()), [0, 0])
        g[0] += int(e["size"])
        g[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    sites = [[name, round(b / 2**20, 1), n] for name, (b, n) in ranked[:top]]
    rest = ranked[top:]
    if rest:
        sites.append(["(other)", round(sum(b for _, (b, _n) in rest) / 2**20, 1), sum(n for _, (_b, n) in rest)])
    return {"peak_mib": round(peak / 2**20, 1), "at_event": peak_at, "events": len(trace), "live": len(alive),
            "sites": sites, "end_mib": round(current / 2**20, 1), "unknown_frees": unknown}
