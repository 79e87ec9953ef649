#!/usr/bin/env bash
# Every benchmark in one go on one CUDA GPU, in about 10 minutes (BENCH_TOTAL_SECONDS, default 600).
#
#   bash benches/run_all.sh            # from the repository root (or anywhere: it cds there)
#   bash benches/run_all.sh --cpu-smoke --results-dir /tmp/smoke   # arguments go to every script: a CPU dry run
#   BENCH_SCRIPTS="traffic capture" BENCH_TOTAL_SECONDS=440 bash benches/run_all.sh   # a subset, in that order
#
# Each script gets a time budget (it starts no measurement past it and records what it skipped) and a hard
# `timeout` of budget + 60 s; budgets shrink to what is left of the total. Results: benches/results/
# <script>_<gpu>.json and .md (also under $OUT/results when $OUT is set), logs in $OUT/logs or
# benches/results/logs, plots (if matplotlib is installed) beside the JSON. Tables go to stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
EXTRA=("$@")

PY=${PYTHON:-python3}
TOTAL=${BENCH_TOTAL_SECONDS:-600}
SCRIPTS=${BENCH_SCRIPTS:-floor towers traffic capture}
RESULTS=benches/results
LOGS="${OUT:-$RESULTS}/logs"
mkdir -p "$RESULTS" "$LOGS"
export PYTHONUNBUFFERED=1
START=$(date +%s)

run() {  # run NAME BUDGET [ARGS...]: only if NAME is in BENCH_SCRIPTS
    local name=$1 budget=$2
    shift 2
    case " $SCRIPTS " in *" $name "*) ;; *) return ;; esac
    local left=$((TOTAL - ($(date +%s) - START)))
    if [ "$left" -lt 25 ]; then
        echo "== $name: skipped, ${left} s left of ${TOTAL} s" | tee -a "$LOGS/run_all.log"
        return
    fi
    if [ "$budget" -gt $((left - 15)) ]; then budget=$((left - 15)); fi
    local t0
    t0=$(date +%s)
    echo "== $name: budget ${budget} s (${left} s left of ${TOTAL} s)" | tee -a "$LOGS/run_all.log"
    timeout --kill-after=15 $((budget + 60)) "$PY" "benches/$name.py" --time-budget "$budget" "$@" "${EXTRA[@]}" \
        2> "$LOGS/$name.err" | tee "$LOGS/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $(($(date +%s) - t0)) s (stderr: $LOGS/$name.err)" | tee -a "$LOGS/run_all.log"
    if [ "$rc" -ne 0 ]; then tail -n 25 "$LOGS/$name.err"; fi
}

"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)" | tee "$LOGS/run_all.log"

run floor 15
run towers 150
run traffic 330
run capture 60
# Other helpers' CPU benchmarks (no time-budget option): run as they are, bounded by `timeout`, on real runs only.
for other in host_overhead planner; do
    left=$((TOTAL - ($(date +%s) - START)))
    if [ -f "benches/$other.py" ] && [ ${#EXTRA[@]} -eq 0 ] && [ -z "${BENCH_SCRIPTS:-}" ] && [ "$left" -gt 20 ]; then
        limit=$((left - 10 < 45 ? left - 10 : 45))
        echo "== $other (at most ${limit} s)" | tee -a "$LOGS/run_all.log"
        timeout "$limit" "$PY" "benches/$other.py" 2> "$LOGS/$other.err" | tee "$LOGS/$other.log"
    fi
done
"$PY" benches/plot.py "${EXTRA[@]}" 2>&1 | tee -a "$LOGS/run_all.log"
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT/results"
    cp -f "$RESULTS"/*.json "$RESULTS"/*.md "$RESULTS"/*.png "$OUT/results/" 2>/dev/null || true
fi
echo "== all done in $(($(date +%s) - START)) s" | tee -a "$LOGS/run_all.log"
