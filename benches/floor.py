"""The matmul floor per tower and case: ``2 x params x tokens`` flops over the measured bf16 matmul rate.

The rate is measured once: the median of 30 timed ``8192 x 8192 x 8192`` bf16 matmuls on random data (CUDA
events, after 5 warm-ups). ``tokens`` are the rows through the tower's blocks (patches; tiles x patches per tile
for a fixed-resolution tower); ``params`` all of the tower's parameters (counted on the ``meta`` device, no
weights are built). Attention's own flops are left out, so the floor is a lower bound: no forward can beat it.
``towers.py`` prints the same floor beside each latency; this script gives it on its own, for every case.

JSON (``benches/results/floor_<gpu>.json``)::

    {"environment", "options", "matmul": {"n", "dtype", "tflops", "median_ms", ...},
     "towers": {"<tower>": {"label", "params", "cases": {"<case>": {"patches", "tokens", "floor_ms"}}}}}
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benches.lib import cli
from benches.lib.cases import CASES, CaseError, sizes_of
from benches.lib.env import inference, make_env
from benches.lib.results import Results, markdown_table
from benches.lib.timing import FLOOR_MATMUL_N, SMOKE_MATMUL_N, floor_ms, matmul_rate
from benches.lib.towers import CORE_TOWERS, SMOKE_TOWERS, TOWERS, count_params

SCRIPT = "floor"


def build_parser() -> Any:
    p = cli.base_parser(SCRIPT, __doc__.split("\n\n")[0], time_budget=15.0)
    p.add_argument("--towers", type=cli.parse_names(TOWERS), default=None,
                   help=f"comma list out of {','.join(TOWERS)} (default {','.join(CORE_TOWERS)}; with --cpu-smoke "
                        f"{','.join(SMOKE_TOWERS)})")
    p.add_argument("--n", type=int, default=None,
                   help=f"matmul side (default {FLOOR_MATMUL_N}; {SMOKE_MATMUL_N} with --cpu-smoke)")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    cli.smoke_defaults(args, towers=CORE_TOWERS)
    env = make_env(args)
    results = Results(SCRIPT, args, env)
    data = results.data
    with inference():
        data["matmul"] = matmul_rate(env, args.n)
    tflops = data["matmul"]["tflops"]
    data["towers"] = {}
    for name in args.towers:
        spec = TOWERS[name]
        params = count_params(spec, env.tiny)
        geom = spec.geometry(env.tiny)
        cases = {}
        for case in CASES:
            try:
                sizes = sizes_of(case.visuals, geom)
            except CaseError:  # a family row's layout does not model this case
                continue
            cases[case.name] = {"patches": sizes.patches, "tokens": sizes.tokens,
                                "floor_ms": round(floor_ms(params, sizes.patches, tflops), 4)}
        data["towers"][name] = {"label": spec.label, "params": params, "cases": cases}
    results.finish(render(data))
    return data


def render(data: dict[str, Any]) -> str:
    mm = data["matmul"]
    rows = [[t["label"], round(t["params"] / 1e6, 1), case, c["patches"], c["floor_ms"]]
            for t in data["towers"].values() for case, c in t["cases"].items()]
    return (f"## matmul floor ({data['environment']['gpu']}: {mm['n']}^3 {mm['dtype']} matmul in {mm['median_ms']} ms "
            f"= {mm['tflops']} TFLOP/s)\n\n"
            + markdown_table(["tower", "params (M)", "case", "patches", "floor ms"], rows))


if __name__ == "__main__":
    main()
