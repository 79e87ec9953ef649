"""What ``benches/serving.py`` reports: the issue's targets at 32 clients, the markdown tables and the plot of
images/s against clients."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benches.lib.plots import pyplot, save
from benches.lib.plots_models import serving_chart
from benches.lib.serving_towers import TOWERS
from encgraph.serving.metrics import STAGES


def targets(points: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's target at concurrency 32 (or the largest measured below it)."""
    def at(system: str) -> dict[str, Any] | None:
        by_c = points.get(system, {})
        cs = [int(c) for c, p in by_c.items() if p.get("requests")]
        pick = max((c for c in cs if c <= 32), default=None)  # the same for every system: one concurrency list
        return by_c[str(pick)] if pick is not None else None

    hf, per, co = at("hf_eager"), at("graphed_per_request"), at("graphed_coalesce")
    out: dict[str, Any] = {"clients": max((int(c) for c in points.get("graphed_coalesce", {}) if int(c) <= 32),
                                          default=None)}
    if hf and co:
        out["coalesce_vs_hf_eager_images_per_s"] = round(co["images_per_s"] / max(hf["images_per_s"], 1e-9), 2)
        out["coalesce_3x_hf_eager"] = out["coalesce_vs_hf_eager_images_per_s"] >= 3.0
    if per and co:
        out["coalesce_p99_not_worse_than_per_request"] = co["p99_ms"] <= per["p99_ms"]
        if "runs" in co and "runs" in per:  # the k-th runs of both ran in the same round
            pairs = list(zip(co["runs"], per["runs"]))
            out["coalesce_p99_not_worse_runs"] = f"{sum(a['p99_ms'] <= b['p99_ms'] for a, b in pairs)} of {len(pairs)}"
    default = at("defaults")  # the same targets for what a user starts with no options
    if hf and default:
        out["defaults_vs_hf_eager_images_per_s"] = round(default["images_per_s"] / max(hf["images_per_s"], 1e-9), 2)
    if per and default:
        out["defaults_p99_not_worse_than_per_request"] = default["p99_ms"] <= per["p99_ms"]
    return out


def render(data: dict[str, Any]) -> str:
    workers = data["options"].get("preprocess_workers")  # absent from runs before the option
    servers = "" if workers is None else f"; servers with --preprocess-workers {workers}"
    repeats = data["options"].get("repeats", 1)  # absent from runs before the option
    rounds = "" if repeats == 1 else (f", {repeats} runs per point in rounds of one run per system (latencies "
                                      "pooled over a point's runs)")
    # HTTP answers' encoding (the in-process transport answers no JSON); runs before the option asked for base64.
    http = any(t != "inprocess" for t in data["options"].get("transports", ("server",)))
    answers = f", {data['options'].get('encoding_format', 'base64')} answers over HTTP" if http else ""
    lines = [f"# Serving: {data['environment']['gpu']}", "",
             f"torch {data['environment']['torch']}, transformers {data['environment']['transformers']}; "
             f"{data['options']['duration']} s per {'point' if repeats == 1 else 'run'} after "
             f"{data['options']['warmup']} s warm-up{rounds}; one image per request{answers}; graphed_coalesce "
             f"max_wait_ms={data['options']['max_wait_ms']}{servers}.", ""]
    for tower, by_transport in data["towers"].items():
        lines += ray_lines(TOWERS[tower]["label"], by_transport)
        for transport, result in by_transport.items():
            lines += [f"## {TOWERS[tower]['label']}, {transport}", ""]
            if "skipped" in result:
                lines += [result["skipped"], ""]
                continue
            # The server's own split of a request's time, where the run measured it (servers with stage metrics).
            staged = any(p.get("stage_ms") for by_c in result["points"].values() for p in by_c.values())
            extra = (" server ms per request: " + " / ".join(STAGES) + " |") if staged else ""
            lines += ["| clients | system | images/s | P50 ms | P99 ms | requests/call | padded share |" + extra,
                      "|---|---|---|---|---|---|---|" + ("---|" if staged else "")]
            for system, by_c in result["points"].items():
                for c, p in by_c.items():
                    if not p.get("requests"):
                        lines.append(f"| {c} | {system} | {p.get('skipped') or p.get('first_error') or 'no answer'} "
                                     "| | | | |" + (" |" if staged else ""))
                        continue
                    share = "" if p.get("padded_share") is None else f"{100 * p['padded_share']:.1f}%"
                    split = p.get("stage_ms") or {}
                    cell = (" " + " / ".join(f"{split[k]:.2f}" if k in split else "-" for k in STAGES) + " |"
                            if staged else "")
                    lines.append(f"| {c} | {system} | {p['images_per_s']:.1f} | {p['p50_ms']:.2f} | {p['p99_ms']:.2f} "
                                 f"| {p.get('requests_per_call') or ''} | {share} |" + cell)
            eager = [f"{system} x{c}: {p['eager_items']}{_reasons(p.get('eager_reasons'))}"
                     for system, by_c in result["points"].items() if system != "hf_eager"
                     for c, p in by_c.items() if p.get("eager_items")]
            if eager:
                lines += ["", "Items that a graphed system ran eagerly (the tower's own forward): " + "; ".join(eager)
                          + "."]
            busy = [f"{system} x{c}: {b['busy_pct_mean']:.0f}% / {b['busy_pct_p50']:.0f}% / {b['share_at_100']:.2f}"
                    for system, by_c in result["points"].items() for c, p in by_c.items()
                    if (b := p.get("gpu_busy") or {}).get("samples")]
            if busy:
                lines += ["", "GPU busy over the measured windows (NVML utilization: the share of time some kernel "
                          "ran; mean / median / share of samples at 100%): " + "; ".join(busy) + "."]
            lines += [_profile_line(system, c, p["gil_profile"]) for system, by_c in result["points"].items()
                      for c, p in by_c.items() if p.get("gil_profile")]
            t = result.get("targets", {})
            if len(t) > 1 and any(k.startswith("coalesce") for k in t):  # graphed_coalesce was in the run
                ratio = ("hf_eager not in this run" if "coalesce_vs_hf_eager_images_per_s" not in t else
                         f"{t['coalesce_vs_hf_eager_images_per_s']} (target >= 3: "
                         f"{'met' if t.get('coalesce_3x_hf_eager') else 'not met'})")
                runs = t.get("coalesce_p99_not_worse_runs")
                lines += ["", f"At {t['clients']} clients: graphed_coalesce / hf_eager images/s = {ratio}; P99 no "
                          f"worse than graphed_per_request: {t.get('coalesce_p99_not_worse_than_per_request')}"
                          + (f" (pooled; in {runs} runs of a round)." if runs else ".")]
            if "defaults_vs_hf_eager_images_per_s" in t or "defaults_p99_not_worse_than_per_request" in t:
                p99 = t.get("defaults_p99_not_worse_than_per_request")
                lines += ["", f"defaults (no options) / hf_eager images/s = "
                          f"{t.get('defaults_vs_hf_eager_images_per_s', 'hf_eager not in this run')}"
                          + ("." if p99 is None else f"; P99 no worse than graphed_per_request: {p99}.")]
            lines.append("")
    return "\n".join(lines)


def ray_lines(label: str, by_transport: dict[str, Any]) -> list[str]:
    """What Ray adds, where a run measured one system both through ``encgraph serve`` and through ``encgraph serve
    --ray --replicas 1``: per concurrency, images/s and P50 / P99 side by side, and the N-GPU figure as a projection
    (one replica's measured rate times N: the machine had one GPU)."""
    direct, ray = (by_transport.get(t, {}).get("points", {}) for t in ("server", "ray"))
    rows = []
    for system, by_c in ray.items():
        for c, p in by_c.items():
            d = direct.get(system, {}).get(c)
            if p.get("requests") and d and d.get("requests"):
                rows.append(f"| {c} | {system} | {d['images_per_s']:.1f} / {p['images_per_s']:.1f} | "
                            f"{p['images_per_s'] / d['images_per_s']:.2f} | {d['p50_ms']:.2f} / {p['p50_ms']:.2f} | "
                            f"{d['p99_ms']:.2f} / {p['p99_ms']:.2f} | {p['p50_ms'] - d['p50_ms']:+.2f} |")
    if not rows:
        return []
    top = max(((c, p) for by_c in ray.values() for c, p in by_c.items() if p.get("requests")),
              key=lambda cp: int(cp[0]))
    header = ("| clients | system | images/s: direct / Ray | Ray / direct | P50 ms: direct / Ray | P99 ms: direct / Ray "
              "| Ray's added P50 ms |")
    projection = (f"Projection, not measured (one replica here): N GPUs behind Ray, one replica each, at {top[0]} "
                  f"clients per replica: N x {top[1]['images_per_s']:.0f} images/s, each request paying Ray's added "
                  "latency above.")
    return [f"## {label}: one replica through Ray Serve against encgraph serve directly", "", header,
            "|---|---|---|---|---|---|---|", *rows, "", projection, ""]


def _profile_line(system: str, clients: str, profile: dict[str, Any]) -> str:
    """One sentence of a point's py-spy GIL profile (``benches.lib.server_profile``)."""
    if "skipped" in profile:
        return f"\nGIL profile of {system}'s server at {clients} clients: not taken ({profile['skipped']})."
    groups = ", ".join(f"{name} {100 * share:.0f}%" for name, share in profile["groups"].items() if share >= 0.02)
    ours = ", ".join(f"{name} {100 * share:.0f}%" for name, share in list(profile.get("top_encgraph", {}).items())[:5]
                     if share >= 0.02)
    return (f"\nGIL profile of {system}'s server at {clients} clients ({profile['samples']} samples at "
            f"{profile['rate_hz']} Hz over {profile['seconds']} s): a thread of the server process held its GIL "
            f"at least {100 * profile['gil_held_share']:.0f}% of the time (its preprocessing workers together: "
            f"{profile['workers_gil_share'] or 0:.2f} GILs busy on average); of those samples: {groups}."
            + (f" encgraph's innermost function in them: {ours}." if ours else ""))


def _reasons(counts: dict[str, int] | None) -> str:
    """`` (reason: n, ...)`` of a point's eagerly run items, or nothing."""
    return f" ({', '.join(f'{r}: {n}' for r, n in counts.items())})" if counts else ""


def plot(data: dict[str, Any], path: Path) -> Path | None:
    """``benches/plot.py``'s chart of this result (``plots_models.serving_chart``) at ``path``; ``None`` without
    matplotlib or with nothing measured."""
    plt = pyplot()
    chart = serving_chart(data)
    if plt is None or not chart.panels:
        return None
    return save(plt, chart, path)
