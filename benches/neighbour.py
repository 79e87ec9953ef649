"""Neighbour: does wrapping and capturing a tower slow another module of the same process? (issue 32 point 5)

In ``generate()`` the language model runs eagerly beside the vision tower. One process, one GPU: a language
model stand-in (a Qwen2 text model at Qwen2.5-VL-7B's width, ``--lm-layers`` layers, random bf16 weights, a
prefill of ``--lm-tokens`` tokens) and the Qwen3-VL-8B tower (one 896 px image). Phase ``before``: rounds of
(LM, the tower's own forward, LM again); then ``encgraph.graphed(tower)`` is made and captured (defaults); phase
``after``: the same rounds with the graphed tower; then phase ``before_again``: the rounds with the tower's own
forward once more (a copy never wrapped), so that drift of the machine shows as a difference between the two
unwrapped phases. Each LM call is timed with CUDA events; reported: median and quartiles per phase and position
(LM before the tower call, LM after it).

JSON (``benches/results/neighbour_<gpu>.json``)::

    {"environment", "options", "capture": {...}, "phases": {"<phase>": {"lm_first", "lm_after_tower", "tower":
        {"median_ms", "p25_ms", "p75_ms", "runs"}}}}
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from benches.lib import cli
from benches.lib.cases import Visual, make_inputs
from benches.lib.env import Deadline, Env, log
from benches.lib.results import Results, fmt, markdown_table
from benches.lib.timing import time_once
from benches.lib.towers import TOWERS, Geometry, build_tower

SCRIPT = "neighbour"
PHASES = ("before", "after", "before_again")
GRAPHED_OPTIONS: dict[str, Any] = {}
"""Options of ``graphed()``: none, the defaults; only the CPU tests set one (``verify=False`` spares seconds)."""


def build_parser() -> Any:
    p = cli.base_parser(SCRIPT, __doc__.split("\n\n")[0], time_budget=60.0)
    p.add_argument("--rounds", type=int, default=30, help="rounds per phase (default 30; 3 with --cpu-smoke)")
    p.add_argument("--lm-layers", type=int, default=4, help="layers of the language model stand-in (default 4)")
    p.add_argument("--lm-tokens", type=int, default=512, help="prefill tokens (default 512; 16 with --cpu-smoke)")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.cpu_smoke:
        args.rounds, args.lm_tokens = min(args.rounds, 3), min(args.lm_tokens, 16)
    return cli.run_script(SCRIPT, args, run, render)


def language_model(env: Env, layers: int) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2Model

    full = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4)
    tiny = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    config = Qwen2Config(vocab_size=1024, num_hidden_layers=layers, **(tiny if env.tiny else full))
    torch.manual_seed(env.seed)
    with torch.device(env.device):
        model = Qwen2Model._from_config(config, attn_implementation="sdpa", dtype=env.dtype)
    return model.eval().requires_grad_(False)


def run(args: Any, env: Env, deadline: Deadline, results: Results) -> None:
    import torch

    import encgraph

    lm = language_model(env, args.lm_layers)
    ids = torch.randint(0, 1024, (1, args.lm_tokens), device=env.device)
    spec = TOWERS["qwen3_vl_8b"]
    tower = build_tower(spec, env)
    plain = copy.deepcopy(tower)
    geom = Geometry.of(spec.kind, tower.config, spec.facts)
    side = 224 if env.tiny else 896  # the CPU smoke's tower attends by masked SDPA on a busy CPU
    inputs = make_inputs([Visual(side, side)], geom, env, seed=env.seed)
    call_args, call_kwargs = inputs.hf_args, inputs.hf_kwargs
    phases = results.data["phases"] = {}

    def rounds(name: str, fn: Any) -> None:
        lm_first, lm_after, tow = [], [], []
        fn(*call_args, **call_kwargs)
        lm(ids)
        for _ in range(args.rounds):
            lm_first.append(time_once(lambda: lm(ids), env))
            tow.append(time_once(lambda: fn(*call_args, **call_kwargs), env))
            lm_after.append(time_once(lambda: lm(ids), env))
        phases[name] = {k: _summary(v) for k, v in (("lm_first", lm_first), ("lm_after_tower", lm_after),
                                                    ("tower", tow))}
        log(f"{name}: {phases[name]}")
        results.flush()

    rounds("before", plain)
    fast = encgraph.graphed(tower, **GRAPHED_OPTIONS)
    results.data["capture"] = {k: v for k, v in encgraph.graphs(fast).capture().items() if k in ("seconds", "graphs", "pool_bytes")}
    rounds("after", fast)
    rounds("before_again", plain)


def _summary(values: list[float]) -> dict[str, Any]:
    a = np.asarray(values)
    return {"median_ms": round(float(np.median(a)), 4), "p25_ms": round(float(np.percentile(a, 25)), 4),
            "p75_ms": round(float(np.percentile(a, 75)), 4), "runs": int(a.size)}


def render(data: dict[str, Any]) -> str:
    rows = []
    for phase in PHASES:
        p = data.get("phases", {}).get(phase)
        if p:
            rows.append([phase] + [f"{fmt(p[k]['median_ms'])} ({fmt(p[k]['p25_ms'])}-{fmt(p[k]['p75_ms'])})"
                                   for k in ("lm_first", "lm_after_tower", "tower")])
    cap = data.get("capture", {})
    return (f"## neighbour: a language model's eager forward beside a tower, before and after graphed(tower) "
            f"({data['environment']['gpu']})\n\n"
            + markdown_table(["phase", "LM ms, median (quartiles)", "LM right after the tower call ms",
                              "tower call ms"], rows)
            + f"\n\ncapture: {fmt(cap.get('seconds'))} s, {cap.get('graphs')} graphs, pool "
              f"{fmt(cap.get('pool_bytes'))} "
              "bytes; before / before_again: the tower's own forward on a copy never wrapped (machine drift)")


if __name__ == "__main__":
    main()
