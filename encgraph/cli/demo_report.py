"""What ``encgraph demo`` prints (:mod:`encgraph.cli.demo`): its measurements as text lines or as one JSON
object."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

import attrs

from encgraph.cli._common import budget_text, count, plan_json, plan_lines, table
from encgraph.cli.demo_batches import DemoBatch
from encgraph.cli.demo_timing import Timings
from encgraph.packing import Plan

__all__ = ["DemoReport", "path_ladders", "NOTE_CPU"]

NOTE_CPU = (
    "CUDA graphs need a CUDA GPU: on the CPU the runner runs in STATIC mode (the same plan, padded buffers and "
    "static forward that a graph would replay, run eagerly), so the agreement above checks what a replay "
    "computes, not its speed; run 'encgraph demo' on a GPU machine for the speed-up."
)



def path_ladders(ladders: Mapping[str, Any]) -> str:
    return "; ".join(f"{path} {', '.join(map(str, ladder))}" for path, ladder in ladders.items())


def path_lines(paths: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Per path of a multi-path tower, what the checked call ran there: replays per budget and eager items."""
    out = ["per path:"]
    for path, p in paths.items():
        replays = ", ".join(f"{n} at {b}" for b, n in sorted(p["replays"].items())) or "none"
        out.append(
            f"  {path}: {p['real_tokens']} tokens, replays {replays}; {count(p['eager_items'], 'item')} eager; "
            f"padded share {p['padded_share']:.1%}"
        )
    return out


@attrs.frozen
class DemoReport:
    """What the demo measured, as text lines or as one JSON object.

    ``errors[i]``: item ``i``'s max |encgraph - tower| / max |tower| over the outputs named in ``compared``;
    ``timings``: the tower's own forward and encgraph on the whole batch, timed interleaved
    (:mod:`encgraph.cli.demo_timing`); ``stats``: the runner's counters after the checked call.
    """

    args: argparse.Namespace
    description: str
    device: str
    dtype: str
    runner: Any
    batch: DemoBatch
    specs: tuple[Any, ...]
    plan: Plan
    errors: tuple[float, ...]
    compared: tuple[str, ...]
    threshold: float
    timings: Timings
    capture: dict[str, Any]
    stats: dict[str, Any]

    @property
    def name(self) -> str:
        return self.args.model

    @property
    def mode(self) -> str:
        return self.runner.mode.value

    @property
    def unit(self) -> str:
        return self.runner.config.paths[0].unit.value

    def _ran(self, i: int) -> tuple[int, dict[str, int | None], str | None]:
        """Item ``i``'s batch, that batch's budgets, and why it runs eager (``None``: it replays)."""
        for index, b in enumerate(self.plan.batches):
            if i in b.items:
                return index, b.budgets, "; ".join(sorted({r.value for r in b.eager.values()})) or None
        raise AssertionError(f"item {i} is in no batch")  # pragma: no cover  (Plan guarantees it)

    def _versions(self) -> dict[str, str]:
        import torch
        import transformers

        return {"torch": torch.__version__, "transformers": transformers.__version__}

    def lines(self) -> list[str]:
        v = self._versions()
        lim = self.runner.limits
        ladder = next(iter(self.runner.ladders.values()))
        unit = "images per batch" if self.unit == "items" else "tokens"
        out = [
            f"encgraph demo: {self.name}, {self.description}; random weights, seed {self.args.seed}",
            f"device {self.device}, {self.dtype}, torch {v['torch']}, transformers {v['transformers']}; runner mode "
            f"{self.mode}",
            f"ladder: {', '.join(map(str, ladder))} {unit}; at most {lim.max_items} items and {lim.max_frames} "
            f"frames per batch",
        ]
        if len(self.runner.ladders) > 1:
            out[-1] = (
                f"ladders, one per path ({unit}; 0: the path skipped): {path_ladders(self.runner.ladders)}; at most "
                f"{lim.max_items} items and {lim.max_frames} frames per batch"
            )
        items = self.batch.items
        if self.unit == "items":
            sizes = sorted({it.label for it in items})
            out.append(f"items: {count(len(items), 'image')} of {', '.join(sizes)} (a fixed-resolution tower)")
        else:
            videos = sum(1 for it in items if it.kind == "video")
            out.append(
                f"items: {len(items)} ({count(len(items) - videos, 'image')}, {count(videos, 'video')}), "
                f"{sum(s.total_tokens for s in self.specs)} tokens"
            )
            out += table(
                ("item", "tokens", "frames", "kind", "grid t,h,w", "size"),
                (
                    (i, s.total_tokens, s.frames, it.kind, ",".join(map(str, it.grid)) if it.grid else "-", it.label)
                    for i, (it, s) in enumerate(zip(items, self.specs))
                ),
                left=3,
            )
        out += plan_lines(self.plan, [it.label for it in items], unit="images" if self.unit == "items" else "tokens")
        if len(self.runner.ladders) > 1:
            out += path_lines(self.stats["paths"])
        out.append(
            f"agreement with the tower's own forward, per item (max |encgraph - tower| / max |tower| over "
            f"{', '.join(self.compared)}):"
        )
        out += table(
            ("item", "max rel err", "ran"),
            ((i, f"{e:.2e}", self._ran_text(i)) for i, e in enumerate(self.errors)),
        )
        worst = max(self.errors)
        verdict = "agree" if worst <= self.threshold else "DO NOT all agree"
        out.append(f"all {len(self.errors)} items {verdict} within {self.threshold:g} ({self.dtype}); largest {worst:.2e}")
        t = self.timings
        out.append(
            f"timings on the whole batch, {count(t.pairs, 'call')} of each (interleaved, after "
            f"{count(t.warmup, 'untimed call')} of each)" + ("; median (min-max):" if t.pairs > 1 else ":")
        )
        label = "encgraph, CUDA graphs" if self.mode == "graph" else f"encgraph, {self.mode} mode"
        rows = [("tower's own forward (eager)", t.tower.text()), (label, t.runner.text())]
        if self.mode == "graph":
            rows.append(("speed-up", f"{t.speedup:.2f}x (median over pairs of calls)"))
        width = max(len(name) for name, _ in rows)
        out += [f"  {name.ljust(width)}  {value}" for name, value in rows]
        noise = t.noise_note()
        if noise:
            out.append(f"timing noise: {noise}")
        if self.mode == "graph":
            c = self.capture
            out.append(
                f"capture: {c.get('graphs', 0)} graphs in {c.get('seconds', 0.0):.2f} s, graph pool "
                f"{c.get('pool_bytes', 0) / 2**20:.1f} MiB, static buffers {c.get('buffer_bytes', 0) / 2**20:.1f} MiB"
                + (f"; failed: {c['failed']}" if c.get("failed") else "")
            )
        else:
            out.append(f"note: {NOTE_CPU}")
        return out

    def _ran_text(self, i: int) -> str:
        batch, budgets, reason = self._ran(i)
        return f"batch {batch}, " + (f"eager ({reason})" if reason else f"budget {budget_text(self.plan, budgets)}")

    def json(self) -> dict[str, Any]:
        lim = self.runner.limits
        return {
            "model": self.name,
            "description": self.description,
            "seed": self.args.seed,
            "device": str(self.device),
            "dtype": self.dtype,
            "mode": self.mode,
            "versions": self._versions(),
            "unit": self.unit,
            "ladders": {p: list(lad) for p, lad in self.runner.ladders.items()},
            "limits": {"max_items": lim.max_items, "max_frames": lim.max_frames},
            "items": [
                {
                    "item": i,
                    "kind": it.kind,
                    "label": it.label,
                    "grid": list(it.grid) if it.grid else None,
                    "tokens": s.total_tokens,
                    "frames": s.frames,
                    "batch": self._ran(i)[0],
                    "budgets": self._ran(i)[1],
                    "eager_reason": self._ran(i)[2],
                    "max_rel_error": self.errors[i],
                }
                for i, (it, s) in enumerate(zip(self.batch.items, self.specs))
            ],
            "plan": plan_json(self.plan),
            "agreement": {
                "outputs": self.compared,
                "max_rel_error": max(self.errors),
                "threshold": self.threshold,
                "ok": max(self.errors) <= self.threshold,
            },
            "timings_ms": {
                "repeats": self.timings.pairs,
                "tower_eager": self.timings.tower.median,
                "encgraph": self.timings.runner.median,
                "encgraph_mode": self.mode,
                **self.timings.as_dict(),
            },
            "capture": self.capture,
            "stats": self.stats,
            "note": None if self.mode == "graph" else NOTE_CPU,
        }
