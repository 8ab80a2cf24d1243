#!/usr/bin/env bash
# A lent GPU machine's CPU, in one call (../shared/gpu/README.md installs TVM into /tmp/site first;
# benchmarks/pack_openvino.sh says how OpenVINO and NNCF get there, for openvino-int8):
# the checks and timings that need instruction sets our machines may lack (AMX, AVX512-VNNI).
#   1. tests: the int8, AMX and attention tests, which run the AMX and VNNI kernels for real where the CPU has them
#   2. tvmbert bench MODEL in int8 against ort-int8 (and openvino-int8 where it was carried) at 8 x 128
#      (on request: int8-b8-ort, the same without OpenVINO in the process; fp32-b8, tvm's fp32)
#   3. benchmarks/vm_profile.py: where int8's time goes at 8 x 128, kernel by kernel
#   4. int8 at 1 x 14 and 1 x 128, as in 2.
#   5. benchmarks/int8_kernel.py: the kernels alone (fp32 FMA, int8 on vectors, AMX-INT8)
# Timings on 2 threads, as the int8 goals are stated (the builds free to use every core); the tests on 8 workers.
# Each step is bounded (a stopped call still returns the finished ones): results under $OUT, at
# most 8 files (the device tool's limit): log.txt (the CPU, each step's status and stderr), one
# file per step; the tests name each result as it finishes. A call runs 600 s at most: the default
# steps' limits add up to 560.
#   OUT=/tmp/out benchmarks/lent_machine.sh            MODEL=bert-tiny PY=.venv/bin/python for a dry run here
#   STEPS="int8-b1 int8-b8" B1_SEQ=14 ...              some steps, some shapes
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/lent}
MODEL=${MODEL:-bert-base}
PY=${PY:-python3}
WORK=${WORK:-build/lent-work}
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
log="$OUT/log.txt"
lscpu | grep -v Vulnerab > "$log"

steps=" ${STEPS:-tests int8-b8 profile int8-b1 kernels} "  # 560 s at most; int8-b8-ort and fp32-b8 on request
source benchmarks/steps.sh
# openvino-int8 too where OpenVINO and NNCF were carried (the machine's image lacks them)
engines=tvm,ort-int8$("$PY" -c "import openvino, nncf" 2>/dev/null && echo ,openvino-int8)
# test_attention.py's AMX tests only: its fp32 ones would take the step's time (an Emerald Rapids: 95% done at 100 s with them all)
amx_attention_tests=(tests/test_attention.py::test_amx_attention_matches_float64_within_bf16_probabilities_and_values
                     "tests/test_attention.py::test_a_row_with_every_key_masked_averages_the_values_as_pytorch_does[True]")
run tests && step tests.txt "${TESTS_S:-100}" "$PY" -m pytest -v -rfE -p no:cacheprovider -n 8 tests/test_int8.py tests/test_amx.py "${amx_attention_tests[@]}" ${TESTS_K:+-k "$TESTS_K"}
export TVM_NUM_THREADS=2
bench=("$PY" -m tvmbert bench "$MODEL" --threads 2 --repeat 10 --min-time 2 --workdir "$WORK" --json)
run int8-b8 && step int8-b8.json "${BENCH_S:-120}" "${bench[@]}" --dtype int8 --engines "$engines" --batch 8 --seq-len 128
run int8-b8-ort && step int8-b8-ort.json "${BENCH_S:-120}" "${bench[@]}" --dtype int8 --engines tvm,ort-int8 --batch 8 --seq-len 128
run fp32-b8 && step fp32-b8.json "${BENCH_S:-80}" "${bench[@]}" --dtype float32 --engines tvm --batch 8 --seq-len 128
run profile && step profile.txt "${PROFILE_S:-90}" "$PY" benchmarks/vm_profile.py "$MODEL" --dtype int8 --batch 8 --seq-len 128 --workdir "$WORK" --top 20
run int8-b1 && step int8-b1.json "${BENCH_S:-190}" "${bench[@]}" --dtype int8 --engines "$engines" --batch 1 --seq-len "${B1_SEQ:-14,128}"
run kernels && step kernels.txt "${KERNELS_S:-60}" "$PY" benchmarks/int8_kernel.py --rows "${KERNEL_ROWS:-14,128,1024}"
