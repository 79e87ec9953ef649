"""What ``benches/traffic.py`` reports from its per-request latencies: per-system summaries and ratios against the
reference systems, graph runners' padding and eager items, the issue's targets, and the markdown tables (also
rendered into the README by ``benches/readme.py``).

Reads both layouts of ``traffic_<gpu>.json``: one document per tower under ``towers`` (now), or one tower's
document at the top level (runs before both Qwen towers were measured in one run, baseline ``adapter_eager``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from benches.lib.results import fmt, markdown_table
from benches.lib.systems import System

REFERENCES = (System.HF_SDPA, System.ADAPTER_EAGER)
"""Systems every other one is compared with, request by request, when they ran."""


FLOOR_BOUND = 1.2
"""Issue 32's bound on every request's time over its floor."""


def _floor_stats(lat: np.ndarray, floors: Sequence[float], name: str) -> dict[str, Any]:
    """Mean and worst ratio of each request's time ``lat`` to its floor (``floors``, ms; NaN or 0: none), and how
    many stay within :data:`FLOOR_BOUND`, under keys ending in ``name``."""
    fl = np.asarray(floors, dtype=np.float64)[: lat.size]
    both = np.isfinite(lat[: fl.size]) & np.isfinite(fl) & (fl > 0)
    if not both.any():
        return {}
    ratio = lat[: fl.size][both] / fl[both]
    return {f"mean_ratio_vs_{name}": round(float(ratio.mean()), 3),
            f"worst_ratio_vs_{name}": round(float(ratio.max()), 3),
            f"within_{name}_bound": int((ratio <= FLOOR_BOUND).sum()),
            f"compared_with_{name}": int(both.sum())}


Floors = Sequence[float] | Mapping[System, Sequence[float]]
"""Floor ms per request: one list for every system, or one per system (each at the sizes that system ran)."""


def summarize(latencies: Mapping[System, Sequence[float]], errors: Mapping[System, int],
              floors: Floors | None = None, shape_floors: Floors | None = None) -> dict[str, Any]:
    """Per system: requests, errors, mean / P50 / P90 / P99 / max ms, and against each reference that ran (on the
    requests both completed): speedups of the mean, P50 and P99, the worst per-request ratio (system / reference)
    and its request, and how many requests were slower; with ``floors`` (ms per request, shared or per system),
    the mean and worst ratio of each request's time to its floor and how many requests stay within
    :data:`FLOOR_BOUND` of it; with ``shape_floors`` the same against the floor at the request's sizes
    (``benches.lib.shape_floor``)."""
    out = {}
    for s, values in latencies.items():
        lat = np.asarray(values, dtype=np.float64)
        ok = lat[np.isfinite(lat)]
        entry: dict[str, Any] = {"requests": int(ok.size), "errors": int(errors.get(s, 0))}
        if ok.size:
            entry.update({
                "mean_ms": round(float(ok.mean()), 4),
                "p50_ms": round(float(np.percentile(ok, 50)), 4),
                "p90_ms": round(float(np.percentile(ok, 90)), 4),
                "p99_ms": round(float(np.percentile(ok, 99)), 4),
                "max_ms": round(float(ok.max()), 4),
            })
        for ref in REFERENCES:
            if ref is s or ref not in latencies or not ok.size:
                continue
            base = np.asarray(latencies[ref], dtype=np.float64)
            both = np.isfinite(lat) & np.isfinite(base)
            if not both.any():
                continue
            b, x = base[both], lat[both]
            ratios = x / b
            k = ref.value
            entry.update({
                f"speedup_mean_vs_{k}": round(float(b.mean() / x.mean()), 3),
                f"speedup_p50_vs_{k}": round(float(np.percentile(b, 50) / np.percentile(x, 50)), 3),
                f"speedup_p99_vs_{k}": round(float(np.percentile(b, 99) / np.percentile(x, 99)), 3),
                f"worst_ratio_vs_{k}": round(float(ratios.max()), 3),
                f"worst_request_vs_{k}": int(np.flatnonzero(both)[int(np.argmax(ratios))]),
                f"slower_than_{k}": int((ratios > 1.0).sum()),
                f"compared_with_{k}": int(both.sum()),
            })
        for name, given in (("floor", floors), ("shape_floor", shape_floors)):
            own = given.get(s) if isinstance(given, Mapping) else given
            if own is not None and ok.size:
                entry.update(_floor_stats(lat, own, name))
        out[s.value] = entry
    return out


FEEDBACK_KEYS = ("samples", "explored", "unchosen", "corrections", "scale")
"""The runner's ``stats["cost_feedback"]`` entries a traffic result keeps (those the runner has)."""


def graph_stats(stats: Mapping[str, Any]) -> dict[str, Any]:
    """Padding and eager fallbacks of a graph runner over the replayed trace. ``padded_share`` counts padded
    rows over all replayed rows (budget x replays); the runner's own share also counts eager tokens as real."""
    paths = stats["paths"]
    padded = sum(p["padded_tokens"] for p in paths.values())
    replayed = sum(int(b) * n for p in paths.values() for b, n in p["replays"].items())
    return {
        "padded_share": round(padded / replayed, 4) if replayed else 0.0,
        "runner_padded_share": {k: round(p["padded_share"], 4) for k, p in paths.items()},
        "items": stats["items"],
        "eager_items": stats["eager_items"],
        "stock_calls": stats.get("stock_calls", 0),
        "eager_reasons": stats["eager_reasons"],
        "replays": {k: p["replays"] for k, p in paths.items()},
        "cost_feedback": {k: v for k, v in stats.get("cost_feedback", {}).items() if k in FEEDBACK_KEYS},
    }


def route(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """How a graph runner ran one request, from its ``stats`` before and after the call: ``replays`` per budget
    (over every path), ``eager`` items per reason, and the cost feedback's ``explored`` batches where there were
    any. Read outside the timed call. (Results from before issue 56 also have the retired dense machinery's
    counters here: piecewise replays, plans bought, calls rented.)

    >>> b = {"paths": {"p": {"replays": {"64": 1}}}, "eager_reasons": {}, "cost_feedback": {"explored": 2}}
    >>> a = {"paths": {"p": {"replays": {"64": 1, "2688": 1}}}, "eager_reasons": {"eager is cheaper": 1},
    ...      "cost_feedback": {"explored": 3}}
    >>> route(b, a)
    {'replays': {'2688': 1}, 'eager': {'eager is cheaper': 1}, 'explored': 1}
    """
    replays: dict[str, int] = {}
    for name, path in after["paths"].items():
        old = before["paths"].get(name, {}).get("replays", {})
        for budget, n in path["replays"].items():
            if n - old.get(budget, 0):
                replays[str(budget)] = replays.get(str(budget), 0) + n - old.get(budget, 0)
    eager = {k: n - before["eager_reasons"].get(k, 0) for k, n in after["eager_reasons"].items()
             if n - before["eager_reasons"].get(k, 0)}
    out: dict[str, Any] = {"replays": replays, "eager": eager}
    moved = after.get("cost_feedback", {}).get("explored", 0) - before.get("cost_feedback", {}).get("explored", 0)
    if moved:
        out["explored"] = moved
    return out


# ---------------------------------------------------------------------------------------------------- targets
@attrs.frozen
class Target:
    """One of issue 13's targets for ``defaults``: a value read from a tower's document, compared with a bound."""

    name: str
    read: Callable[[Mapping[str, Any]], float | None]
    op: str  # ">=" or "<="
    bound: float
    towers: tuple[str, ...] = ()
    """Towers the target is stated for (empty: every tower)."""

    def check(self, tower: str, doc: Mapping[str, Any]) -> dict[str, Any] | None:
        if self.towers and tower not in self.towers:
            return None
        value = self.read(doc)
        met = None if value is None else _OPS[self.op](value, self.bound)
        return {"target": self.name, "value": value, "op": self.op, "bound": self.bound, "met": met}


_OPS = {">=": operator.ge, "<=": operator.le}


def _defaults(key: str) -> Callable[[Mapping[str, Any]], float | None]:
    return lambda doc: doc.get("systems", {}).get(System.DEFAULTS.value, {}).get(key)


def _startup(phase: str, key: str) -> Callable[[Mapping[str, Any]], float | None]:
    return lambda doc: doc.get("startup", {}).get(phase, {}).get(key)


TARGETS = (
    Target("mean speedup vs HF sdpa", _defaults("speedup_mean_vs_hf_sdpa"), ">=", 2.5),
    Target("P99 speedup vs HF sdpa", _defaults("speedup_p99_vs_hf_sdpa"), ">=", 2.5),
    Target("requests slower than HF sdpa", _defaults("slower_than_hf_sdpa"), "<=", 0),
    Target("padded share", lambda doc: doc.get("graph_stats", {}).get(System.DEFAULTS.value, {}).get("padded_share"),
           "<=", 0.10),
    Target("cold capture s", _startup("cold", "capture_seconds"), "<=", 60, towers=("qwen2_5_vl_7b",)),
    Target("warm capture s (second process)", _startup("warm", "capture_seconds"), "<=", 15,
           towers=("qwen2_5_vl_7b",)),
)
"""Issue 13: points 5 (speedups, none slower), 2 (padded share) and 3 (cold and warm capture, stated for the
Qwen2.5-VL-7B tower)."""


_Q3 = ("qwen3_vl_8b",)
PHOTO_TARGETS = (
    Target("mean speedup vs HF sdpa", _defaults("speedup_mean_vs_hf_sdpa"), ">=", 1.3, towers=_Q3),
    Target("P99 speedup vs HF sdpa", _defaults("speedup_p99_vs_hf_sdpa"), ">=", 1.1, towers=_Q3),
    Target("worst request / HF sdpa", _defaults("worst_ratio_vs_hf_sdpa"), "<=", 1.02, towers=_Q3),
    Target("mean speedup vs HF sdpa", _defaults("speedup_mean_vs_hf_sdpa"), ">=", 4.0, towers=("qwen2_5_vl_7b",)),
    Target("mean speedup vs HF sdpa", _defaults("speedup_mean_vs_hf_sdpa"), ">=", 1.5, towers=("glm4v",)),
    Target("requests slower than HF sdpa", _defaults("slower_than_hf_sdpa"), "<=", 0),
    Target("worst request / its floor", _defaults("worst_ratio_vs_floor"), "<=", FLOOR_BOUND),
)
"""Issue 32 point 4, on the photo trace."""


def check_targets(tower: str, doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    targets = PHOTO_TARGETS if doc.get("trace", {}).get("kind") == "photo" else TARGETS
    return [c for t in targets if (c := t.check(tower, doc)) is not None]


# ---------------------------------------------------------------------------------------------------- tables
def tower_docs(data: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """``{tower name: its document}`` of either JSON layout."""
    if "towers" in data:
        return dict(data["towers"])
    if "systems" in data or "tower" in data:
        return {data.get("tower", {}).get("name", "tower"): data}
    return {}


def is_photo(data: Mapping[str, Any]) -> bool:
    """Whether a tower of the result ran the photo trace (issue 32's targets and the floor columns)."""
    return any(doc.get("trace", {}).get("kind") == "photo" for doc in tower_docs(data).values())


def baseline_of(doc: Mapping[str, Any]) -> str:
    """The reference a tower's document compares with (old runs: the adapter's eager forward)."""
    return doc.get("baseline", System.ADAPTER_EAGER.value)


def _seconds(entry: Mapping[str, Any] | None) -> Any:
    if not entry:
        return None
    return entry.get("capture_seconds", entry.get("error", "-").split(":")[0] if "error" in entry else None)


def headline(data: Mapping[str, Any]) -> str:
    """One row per tower: ``defaults`` against HF sdpa, with issue 13's targets beside the numbers ("" if no
    tower measured both); on the photo trace (issue 32's targets, listed apart) with each request's floor."""
    rows = []
    photo = is_photo(data)
    for name, doc in tower_docs(data).items():
        systems = doc.get("systems", {})
        d, hf = systems.get(System.DEFAULTS.value), systems.get(System.HF_SDPA.value)
        if not d or not hf:
            continue
        gs = doc.get("graph_stats", {}).get(System.DEFAULTS.value, {})
        startup = doc.get("startup", {})
        rows.append([doc.get("tower", {}).get("label", name), d.get("requests"), hf.get("mean_ms"), d.get("mean_ms"),
                     hf.get("p99_ms"), d.get("p99_ms"), _x(d.get("speedup_mean_vs_hf_sdpa")),
                     _x(d.get("speedup_p99_vs_hf_sdpa")), _x(d.get("worst_ratio_vs_hf_sdpa")),
                     d.get("slower_than_hf_sdpa"), _pct(gs.get("padded_share")),
                     f"{gs.get('eager_items')} of {gs.get('items')}" if gs else None,
                     _seconds(startup.get("cold")), _seconds(startup.get("warm"))]
                    + ([d.get("worst_ratio_vs_floor")] if photo else []))
    if not rows:
        return ""
    if photo:
        return markdown_table(
            ["tower", "requests", "HF sdpa mean ms", "defaults mean ms", "HF sdpa P99 ms", "defaults P99 ms",
             "mean speedup", "P99 speedup", "worst request (defaults / HF)", "requests slower than HF",
             "padded share", "eager items", "cold capture s", "warm capture s", "worst request / floor"], rows)
    return markdown_table(
        ["tower", "requests", "HF sdpa mean ms", "defaults mean ms", "HF sdpa P99 ms", "defaults P99 ms",
         "mean speedup (target >= 2.5x)", "P99 speedup (target >= 2.5x)", "worst request (defaults / HF)",
         "requests slower than HF (target 0)", "padded share (target <= 10%)", "eager items",
         "cold capture s (target <= 60)", "warm capture s, 2nd process (target <= 15)"], rows)


def _x(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}x"


def _pct(value: float | None) -> str | None:
    return None if value is None else f"{100 * value:.1f}%"


def system_table(doc: Mapping[str, Any]) -> str:
    """Every system of one tower against its baseline, with the graph runners' padding and eager items."""
    base = baseline_of(doc)
    base_label = System(base).label
    all_stats = doc.get("graph_stats", {})
    floor = any("mean_ratio_vs_floor" in e for e in doc.get("systems", {}).values())
    if "padded_share" in all_stats:  # results of before graph_compile was offered: one graph system
        all_stats = {System.GRAPH.value: all_stats}
    rows = []
    for name, e in doc.get("systems", {}).items():
        gs = all_stats.get(name)
        row = [System(name).label, e["requests"], e["errors"], e.get("mean_ms"), e.get("p50_ms"),
               e.get("p99_ms"), e.get(f"speedup_mean_vs_{base}"), e.get(f"speedup_p99_vs_{base}"),
               e.get(f"worst_ratio_vs_{base}"), e.get(f"slower_than_{base}"),
               gs.get("padded_share") if gs else None,
               f"{gs.get('eager_items')} of {gs.get('items')}" if gs else None]
        if floor:
            row += [e.get("mean_ratio_vs_floor"), e.get("worst_ratio_vs_floor"),
                    f"{e.get('within_floor_bound')} of {e.get('compared_with_floor')}"]
        rows.append(row)
    head = ["system", "requests", "errors", "mean ms", "P50 ms", "P99 ms", f"mean speedup vs {base_label}",
            f"P99 speedup vs {base_label}", f"worst request ratio vs {base_label}",
            f"requests slower than {base_label}", "padded share", "eager items"]
    if floor:
        head += ["mean x floor", "worst x floor", f"requests within {FLOOR_BOUND}x floor"]
    return markdown_table(head, rows)


def tower_notes(doc: Mapping[str, Any]) -> list[str]:
    notes = [f"- {k}: {v}" for k, v in {**doc.get("unavailable", {}), **doc.get("dropped", {})}.items()]
    if doc.get("defaults_options"):
        given = ", ".join(f"{k}={v!r}" for k, v in doc["defaults_options"].items())
        notes.append(f"- defaults built with graphed(tower, {given}): not the library's defaults")
    for phase in ("cold", "warm"):
        entry = doc.get("startup", {}).get(phase)
        if entry:
            shown = {k: v for k, v in entry.items() if k != "capture_info"}
            notes.append(f"- defaults, {phase} capture: " + ", ".join(f"{k} {fmt(v)}" for k, v in shown.items()))
    for name, cap in doc.get("capture", {}).items():
        for path, term in (cap.get("selfcheck", {}).get("attention") or {}).items():
            coef, power = term.get("coef", term.get("ms_per_token2")), term.get("power", 2.0)  # older files: 2
            fit = term.get("fit")
            how = (f"{coef:.3g} ms per token^{power:g} (budget {term['budget']}: {fmt(term['full_ms'])} ms "
                   f"as one sequence, {fmt(term['split_ms'])} ms as {term['sequences']}"
                   + (f"; budget {fit['budget']}: {fmt(fit['full_ms'])} / {fmt(fit['split_ms'])} ms" if fit else "")
                   + ")" if coef is not None else f"none ({term.get('skipped')})")
            notes.append(f"- {System(name).label}, cost model attention term, path {path}: {how}")
    comp = doc.get("compile_dynamic")
    if comp:
        total, trace = comp.get("total", {}), comp.get("trace", {})
        notes.append(
            f"- {System.HF_COMPILE_DYNAMIC.label}: {total.get('graphs_compiled')} graphs compiled "
            f"({trace.get('graphs_compiled')} during the trace), {total.get('recompiles')} recompiles, "
            f"{total.get('graph_breaks')} graph breaks, {fmt(total.get('compile_seconds'))} s compiling "
            f"({fmt(trace.get('compile_seconds'))} s during the trace); {comp.get('calls_that_compiled')} calls "
            f"compiled; {fmt(comp.get('used_seconds'))} of its {fmt(comp.get('cap_seconds'))} s cap used"
            + (f"; stopped: {comp['stopped']}" if comp.get("stopped") else ""))
    for name, diff in doc.get("output_check", {}).items():
        notes.append(f"- outputs of {System(name).label} vs {System.HF_SDPA.label} on one request: max relative "
                     f"difference {fmt(diff) if isinstance(diff, float) else diff}")
    rates = doc.get("floor", {}).get("rates")
    if rates:
        notes.append(f"- floor rates: matmul {fmt(rates['matmul_tflops'])} TF/s, attention "
                     f"{fmt(rates['attention_tflops'])} "
                     f"TF/s (best kernel on one {rates['attention_rows']}-row sequence: "
                     + ", ".join(f"{k} {fmt(rates[k])}" for k in ("varlen_ms", "fa4_ms", "dense_ms") if k in rates)
                     + f"), memory {fmt(rates['bandwidth_gbs'])} GB/s")
    elif doc.get("floor", {}).get("error"):
        notes.append(f"- floor not measured: {doc['floor']['error']}")
    for name, e in doc.get("systems", {}).items():
        if "worst_ratio_vs_shape_floor" in e:
            notes.append(f"- {System(name).label} against the floor at each request's sizes (products and "
                         f"attention timed at them: benches.lib.shape_floor): mean {e['mean_ratio_vs_shape_floor']}x,"
                         f" worst {e['worst_ratio_vs_shape_floor']}x, {e['within_shape_floor_bound']} of "
                         f"{e['compared_with_shape_floor']} within {FLOOR_BOUND}x")
    if doc.get("floor", {}).get("shape_error"):
        notes.append(f"- floor at the requests' sizes not measured: {doc['floor']['shape_error']}")
    for name, cap in doc.get("capture", {}).items():
        for key, c in (cap.get("kernels") or {}).items():
            if isinstance(c, dict) and "min_rows" in c:
                padded = c.get("padded_ms") or []
                ratio = (f"; padded / exact dense at {c['lengths'][-1]} rows {padded[-1] / c['dense_ms'][-1]:.2f}"
                         if padded and c.get("dense_ms") else "")
                eager = c.get("varlen_kernel", "flash")
                notes.append(f"- {System(name).label}, {key}: graph kernel {c.get('graph_kernel', eager)}, eager "
                             f"varlen kernel {eager}, dense SDPA per sequence in eager forwards from {c['min_rows']} "
                             f"rows{ratio}")
    if doc.get("trace", {}).get("stopped"):
        notes.append(f"- trace stopped early: {doc['trace']['stopped']}")
    if doc.get("error"):
        notes.append(f"- this tower's run failed: {doc['error']}")
    return notes


SIZES_LABELS = {"as-drawn": "sizes as drawn", "new": "sizes new to every system",
                "seen": "sizes seen before (an untimed call of the same request first)"}
"""How a pass met its sizes (``benches/traffic.py --sizes``)."""


def passes(doc: Mapping[str, Any]) -> list[tuple[str | None, Mapping[str, Any]]]:
    """``(sizes mode, the pass's document)`` of one tower: the top level first (its mode ``None`` in results of
    before ``--sizes``), then each of ``sizes_passes`` over the top level's other keys."""
    out: list[tuple[str | None, Mapping[str, Any]]] = [(doc.get("sizes"), doc)]
    for mode, sub in doc.get("sizes_passes", {}).items():
        out.append((mode, pass_doc(doc, sub)))
    return out


def pass_doc(doc: Mapping[str, Any], sub: Mapping[str, Any]) -> dict[str, Any]:
    """One of ``sizes_passes`` over its tower's document (its ``trace`` entries over the tower's)."""
    return {**doc, **sub, "trace": {**doc.get("trace", {}), **sub.get("trace", {})}}


def target_lines(data: Mapping[str, Any]) -> list[str]:
    lines = []
    for name, doc in tower_docs(data).items():
        label = doc.get("tower", {}).get("label", name)
        several = len(doc.get("sizes_passes", {})) > 0
        for mode, one in passes(doc):
            where = f" ({SIZES_LABELS.get(mode or '', mode)})" if several else ""
            for t in one.get("targets", []):
                verdict = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
                lines.append(f"- {label}{where}: {t['target']} {fmt(t['value'])} (target {t['op']} "
                             f"{fmt(t['bound'])}): {verdict}")
    return lines


def render(data: Mapping[str, Any]) -> str:
    """The whole markdown report: headline and targets, then one section per tower."""
    env = data["environment"]
    parts = [f"## traffic ({env['gpu']}, {env['dtype']})"]
    head = headline(data)
    if head:
        parts += ["### encgraph defaults vs Hugging Face, per tower", head]
    targets = target_lines(data)
    if targets:
        parts += [f"### targets (issue {32 if is_photo(data) else 13})", "\n".join(targets)]
    for name, doc in tower_docs(data).items():
        trace = doc.get("trace", {})
        summary = trace.get("summary", {})
        parts.append(f"### {doc.get('tower', {}).get('label', name)}: {trace.get('completed', 0)} of "
                     f"{trace.get('requests', 0)} requests, seed {trace.get('seed')}")
        if "skipped" in doc:
            parts.append(f"skipped: {doc['skipped']}")
            continue
        planning = doc.get("planning")
        parts.append(f"trace ({trace.get('kind', 'chat')}): {summary.get('items_per_request_mean')} items per request, "
                     f"tokens per request mean "
                     f"{summary.get('tokens_mean')}, P50 {summary.get('tokens_p50')}, P99 {summary.get('tokens_p99')}"
                     + (f"; planning of the benchmark's own graph runners: {planning}" if planning else ""))
        for mode, one in passes(doc):
            if mode is not None:
                parts.append(f"{SIZES_LABELS.get(mode, mode)}:")
            parts.append(system_table(one))
        notes = tower_notes(doc)
        if notes:
            parts.append("\n".join(notes))
    return "\n\n".join(parts)

