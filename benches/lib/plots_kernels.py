"""Charts of the results about kernels, capture and start-up: attention kernels, FlexAttention, the kernel profile,
capture per ladder, compile start, long items and the neighbour's forward. Each ``*_chart(data, path)`` reads one
result JSON; a cell the JSON holds as an error or a skip is ``None`` and the note quotes the reason."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benches.capture import ladder_entries
from benches.lib.plots import Cells, Chart, Kind, Panel, long, missing, num, spread_of, titled, wide
from benches.lib.results import status_of

MIB = 2**20


def _reason(entry: Any) -> str:
    return str(entry.get("error") or entry.get("skipped") or "") if isinstance(entry, Mapping) else str(entry or "")


def _drop_unmeasured(panels: dict[str, Cells]) -> None:
    """Remove the series no panel measured (a column of x's says less than the note names)."""
    names = dict.fromkeys(s for cells in panels.values() for g in cells.values() for s in g)
    empty = [s for s in names if all(g.get(s) is None for cells in panels.values() for g in cells.values())]
    for cells in panels.values():
        for g in cells.values():
            for s in empty:
                g.pop(s, None)


def attention_chart(data: Mapping[str, Any], path: Path) -> Chart:
    """Useful TFLOP/s per kernel and layout, a panel per head geometry; ``<kernel> eager``: called eagerly in a
    process that captures nothing."""
    panels: dict[str, Cells] = {}
    reasons: dict[str, str] = {}
    for row in data.get("rows", []):
        title = f"{row.get('geometry')}: {row.get('heads')} heads x {row.get('head_dim')}"
        cells = panels.setdefault(title, {}).setdefault(str(row.get("layout")), {})
        for key, entry in row.items():
            if not isinstance(entry, Mapping):
                continue
            name = key.replace("_eager", " eager")
            cells[name] = num(entry.get("tflops", entry.get("eager_tflops")))
            if cells[name] is None:
                reasons.setdefault(name, _reason(entry))
    _drop_unmeasured(panels)
    return Chart(titled("attention kernels in CUDA graphs: useful TFLOP/s per call", data),
                 tuple(Panel(t, "TFLOP/s", cells=c, xlabel="sequences in the packed call") for t, c in panels.items()),
                 note=missing(reasons, width=90), cols=2, width=14.0)


def dense_buckets_chart(data: Mapping[str, Any], path: Path) -> Chart:
    """Useful TFLOP/s of one sequence per length and kernel (Flash varlen, exact cuDNN, padded to its bucket:
    encgraph's log-sum-exp correction, a mask column or a bias), a panel per head geometry."""
    panels: dict[str, Cells] = {}
    for row in data.get("rows", []):
        group = f"{row.get('rows')} -> {row.get('bucket')}"
        cells = panels.setdefault(str(row.get("geometry")), {}).setdefault(group, {})
        for name in ("flash", "exact", "padded", "cols", "bias"):
            ms = num(row.get(f"{name}_ms"))
            cells[name] = row["flops"] / (ms * 1e9) if ms and row.get("flops") else None
    return Chart(titled("dense attention at bucket lengths: useful TFLOP/s of one sequence", data),
                 tuple(Panel(t, "TFLOP/s", cells=c, xlabel="rows -> bucket") for t, c in panels.items()),
                 cols=3, width=16.0)


def flex_chart(data: Mapping[str, Any], path: Path) -> Chart:
    rows = data.get("rows", [])
    return Chart(titled("FlexAttention against varlen attention inside CUDA graphs", data), (
        Panel("per call, and FlexAttention's block-mask rebuild", "ms", log=True, cells=wide(rows, "case", {
            "varlen call": "varlen_ms", "flex call": "flex_ms", "flex block-mask rebuild": "flex_mask_rebuild_ms"})),
        Panel("FlexAttention's one-time costs", "seconds", cells=wide(rows, "case", {
            "first block mask": "flex_first_mask_s", "compile": "flex_compile_s"})),
    ), cols=2, width=12.0)


def kernel_profile_chart(data: Mapping[str, Any], path: Path) -> Chart:
    """Per case, each system's device time per call by kernel category, stacked, with the GPU's idle time on top
    (the stack is the median wall time); the dashed line is the case's matmul floor."""
    cases = data.get("cases", {})
    totals: dict[str, float] = {}
    for c in cases.values():
        for s in c.get("systems", {}).values():
            for cat, v in (s.get("categories") or {}).items():
                totals[cat] = totals.get(cat, 0.0) + (num(v.get("ms")) or 0.0)
    order = sorted(totals, key=totals.__getitem__, reverse=True) + ["GPU idle"]
    reasons: dict[str, str] = {}
    panels = []
    for case, c in cases.items():
        cells: Cells = {}
        for system, s in c.get("systems", {}).items():
            cats = s.get("categories") or {}
            if not cats:
                reasons[f"{case} {system}"] = _reason(s)
                continue
            cells[system] = {k: num(cats[k].get("ms")) if k in cats else 0.0 for k in order[:-1]}
            cells[system]["GPU idle"] = num(s.get("idle_ms"))
        panels.append(Panel(f"case {case}", "ms per call", cells=cells, kind=Kind.STACKED,
                            ref=num(c.get("floor_ms")), ref_label="matmul floor"))
    note = " ".join(filter(None, [missing(reasons), str(data.get("note") or "")]))
    tower = (data.get("tower") or {}).get("label", "")
    return Chart(titled(f"kernel time per call by category: {tower}", data), tuple(panels), note=note,
                 cols=2, width=13.0)


def capture_chart(data: Mapping[str, Any], path: Path) -> Chart:
    seconds: Cells = {}
    memory: Cells = {}
    reasons: dict[str, str] = {}
    for tower in data.get("towers", {}).values():
        label = tower.get("label", "?")
        for which, e in ladder_entries(tower):
            measured = "graphs" in e
            if not measured:
                reasons[f"{label} {which}"] = status_of(e)
            seconds.setdefault(label, {})[f"{which} ladder"] = num(e.get("seconds")) if measured else None
            for part, key in (("pool", "pool_bytes"), ("largest graph", "largest_graph_bytes")):
                memory.setdefault(label, {})[f"{which}: {part}"] = num(e.get(key, 0) / MIB) if measured else None
    if data.get("towers") and not any("doubling" in t for t in data["towers"].values()):
        reasons["doubling ladder"] = "not in this run: the default ladder alone"
    return Chart(titled("capture per ladder: seconds and graph pool", data), (
        Panel("capture seconds", "seconds", cells=seconds),
        Panel("graph pool against the largest single graph", "MiB", cells=memory),
    ), note=missing(reasons), cols=2, width=13.0)


def compile_start_chart(data: Mapping[str, Any], path: Path) -> Chart:
    starts = {**{k: data[k] for k in ("cold", "warm") if k in data},
              **{f"{k} (plain graphs)": v for k, v in (data.get("ladders") or {}).items()}}
    reasons = {k: _reason(v) for k, v in starts.items() if "wall_seconds" not in v}
    seconds: Cells = {}
    for name, e in starts.items():
        parts = {"wall": e.get("wall_seconds"), "first compile": (e.get("compile") or {}).get("first_compile_seconds"),
                 "self-check + costs": e.get("selfcheck_seconds")}
        # A start that was skipped: an x per part; a measured one: the parts it has (plain graphs compile nothing).
        seconds[name] = dict.fromkeys(parts) if name in reasons else {k: num(v) for k, v in parts.items()
                                                                       if v is not None}
    memory = {name: {"pool": num(e.get("pool_mib")), "largest graph": num(e.get("largest_graph_mib"))}
              for name, e in starts.items()}
    replays = data.get("replay_ms") or {}
    systems = {"dynamic compiled": "dynamic_compiled", "per-budget static compiled": "static_compiled",
               "plain graphs": "plain"}
    budgets = sorted({int(b) for r in replays.values() for b in r})
    replay = {str(b): {n: num((replays.get(k) or {}).get(str(b))) for n, k in systems.items()} for b in budgets}
    reasons.update({n: "not in this run" for n, k in systems.items() if not replays.get(k)})
    return Chart(titled(f"compiled default runner: start-up and replays, depth {data.get('depth', '?')}", data), (
        Panel("start-up", "seconds", cells=seconds),
        Panel("replay per budget", "ms per call", cells=replay, xlabel="budget (tokens)"),
        Panel("graph pool", "MiB", cells=memory),
    ), note=missing(reasons), cols=3, width=14.0)


def long_items_chart(data: Mapping[str, Any], path: Path) -> Chart:
    systems = {"HF sdpa": "hf_sdpa_ms", "eager (measured kernels)": "eager_ms",
               "eager (Flash varlen)": "eager_varlen_ms", "eager (compiled blocks)": "eager_compiled_ms",
               "graph replay": "graph_ms"}
    panels = []
    reasons: dict[str, str] = {}
    for tower in data.get("towers", {}).values():
        label = tower.get("label", "?")
        budgets = sorted(tower.get("budgets", {}).items(), key=lambda kv: int(kv[0]))
        for b, e in budgets:
            if "skipped" in e or "error" in e:
                reasons[f"{label} {b}"] = _reason(e)
            reasons.update({f"{label} {b} {n}": str(e[k]) for n, k in systems.items() if isinstance(e.get(k), str)})
        panels.append(Panel(label, "ms per item", log=True, xlabel="tokens in the one image",
                            cells=wide([dict(e, budget=b) for b, e in budgets], "budget", systems)))
        if "skipped" in tower or "error" in tower:
            reasons[label] = _reason(tower)
    return Chart(titled("long items: graph replay against eager per budget", data), tuple(panels),
                 note=missing(reasons), cols=2, width=12.0)


def neighbour_chart(data: Mapping[str, Any], path: Path) -> Chart:
    names = {"lm_first": "LM before the tower call", "lm_after_tower": "LM right after the tower call",
             "tower": "tower call"}
    rows = [dict(stats, phase=phase, call=call, label=names.get(call, call))
            for phase, calls in data.get("phases", {}).items() for call, stats in calls.items()]
    lm = [r for r in rows if r["call"] != "tower"]
    tower = [r for r in rows if r["call"] == "tower"]
    return Chart(titled("a language model's eager forward beside the tower, around graphed(tower)", data), (
        Panel("language model", "median ms", xlabel="phase", cells=long(lm, "phase", "label", "median_ms"),
              spread=spread_of(lm, "phase", "label", "p25_ms", "p75_ms")),
        Panel("tower", "median ms", xlabel="phase", cells=long(tower, "phase", "label", "median_ms"),
              spread=spread_of(tower, "phase", "label", "p25_ms", "p75_ms")),
    ), cols=2, width=12.0, note="whisker: quartiles. before: the tower's own forward; after: graphed(tower); "
                                "before_again: the own forward of a copy never wrapped (before against before_again: "
                                "the machine's drift)")


def varlen_slots_chart(data: Mapping[str, Any], path: Path) -> Chart:
    rows = [r for r in data.get("rows", []) if "ms" in r]
    reasons = {f"{r['geometry']} {r['rows']} rows, {r['slots']} slots": r["skipped"]
               for r in data.get("rows", []) if "skipped" in r}
    panels = []
    for geometry in dict.fromkeys(r["geometry"] for r in rows):
        mine = [dict(r, budget=f"{r['rows']:,} rows",
                     series=f"{r['slots']} slots" if r.get("kernel", "varlen") == "varlen" else r["kernel"])
                for r in rows if r["geometry"] == geometry]
        panels.append(Panel(geometry, "x varlen's ms at 3 slots", xlabel="budget rows (max_seqlen)", ref=1.0,
                            base=1.0, cells=long(mine, "budget", "series", "ratio")))
    return Chart(titled("varlen attention: empty cu_seqlens slots, and one dense call, replayed", data),
                 tuple(panels), note=missing(reasons), cols=3, width=14.0)

