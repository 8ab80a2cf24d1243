#!/usr/bin/env bash
# bert-base on a CPU without tuning logs of its own, simulated on this machine: a target whose
# mcpu has no folder under tvmbert/tuning_logs/ (default skylake-avx512: AVX-512, no AMX, code this
# machine runs). Every table is one `tvmbert bench` run, TVM against ONNX Runtime and PyTorch.
#   1. out of the box: records carried from the shipped logs (zero tuning)
#   2. after `tvmbert tune --adapt` on a copy of the logs (wall time printed)
#   3. no logs at all: default schedules only
# Usage: benchmarks/other_cpu.sh [MCPU] [SEQ_LENS]    e.g. benchmarks/other_cpu.sh znver4 14,128
set -euo pipefail
cd "$(dirname "$0")/.."
MCPU=${1:-skylake-avx512}
SEQ=${2:-14}
OUT=${OUT:-build/other-cpu}
TVMBERT=${TVMBERT:-.venv/bin/tvmbert}
BENCH=(bench bert-base --seq-len "$SEQ" --repeat 20 --min-time 5 --target "llvm -mcpu=$MCPU" --json)
rm -rf "$OUT" && mkdir -p "$OUT/empty"
# Each run reads only its --log-dir: a copy of the shipped logs, or none.
export TVMBERT_SHIPPED_LOGS=
cp -r tvmbert/tuning_logs "$OUT/logs"
rm -rf "$OUT/logs/llvm-$MCPU"
"$TVMBERT" "${BENCH[@]}" --log-dir "$OUT/logs" > "$OUT/transferred.json"
start=$(date +%s)
"$TVMBERT" tune bert-base --seq-len "${SEQ%%,*}" --target "llvm -mcpu=$MCPU" --adapt --log-dir "$OUT/logs" --json > "$OUT/adapt.json"
echo "adapt: $(( $(date +%s) - start )) s wall" | tee "$OUT/adapt-wall.txt"
"$TVMBERT" "${BENCH[@]}" --log-dir "$OUT/logs" > "$OUT/adapted.json"
"$TVMBERT" "${BENCH[@]}" --log-dir "$OUT/empty" --engines tvm,onnxruntime > "$OUT/default.json"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
for name in ("transferred", "adapted", "default"):
    report = json.load(open(f"{out}/{name}.json"))
    for r in report["results"]:
        cells = {e: (f"{s['median_ms']:.2f}" if "median_ms" in s else "-") for e, s in r["engines"].items()}
        print(f"| {name} | {r['batch']}x{r['seq_len']} | " + " | ".join(f"{e} {v}" for e, v in cells.items())
              + f" | {r['ratio']:.2f} vs {r['best_other']} |")
PY
