#!/usr/bin/env bash
# Everything a lent GPU machine (H100/H200: Python 3.12, PyTorch with CUDA, transformers, click,
# rich, pyyaml, psutil, cloudpickle, numpy, ml_dtypes, nvcc; no TVM, no pytest, no network) runs
# for tvmbert, in three calls. A task has 15 minutes of device time in all (the start, idle waits
# and calls count), at most 10 a call, and the machine goes after 30 s idle: prepare here, then
# make the three calls back to back.
#
# Here, once: fills the ignored .gpu1/ and .gpu2/ (the apache-tvm wheel in halves, the small wheels
# beside them) and checks that each call fits 64 MiB with the files every call carries:
#   bash benchmarks/gpu_run.sh pack
# On the lent machine, the device tool's `run`, back to back:
#   1. carry [".gpu1"], timeout_s 60:    bash benchmarks/gpu_run.sh unpack
#   2. carry [".gpu2"], timeout_s 500:   bash benchmarks/gpu_run.sh install steps
#   3. no carry, timeout_s 330:         STEPS="tune records rebuild bench-tuned" bash benchmarks/gpu_run.sh steps
#      (the same warm machine, at once: TVM in /tmp/site and the builds are still there)
# Results come back under $OUT (at most 8 files a call), one file per step, each stopped at its limit
# so that the finished ones come back when a later one runs out of time; log.txt has the GPU, its
# driver, each step's command, exit and stderr. In the order that matters (call 2, then call 3):
#   builds.txt                  every build the steps below run (bert-base on cuda, fp16: 1 x 14, 1 x 128,
#                               8 x 128, and 1 x 128 without its CUDA graph), in one process
#   verify-fp16.json            tvmbert verify MODEL --target cuda --dtype float16
#   verify-fp16-b8.json         the same at 8 x 128 with 32 sentences: flash attention over several tiles
#                               of keys, padded sequences and a batch (1 x 14 is one tile, no padding)
#   graph-check.txt             the CUDA-graph build's answers (its capture, then replays) against the graph-less build's
#   bench-fp16-b1.json          tvm against torch-eager, -sdpa and -cudagraph on the GPU, synchronized: 1 x 14, 1 x 128
#   bench-fp16-b8.json          the same at 8 x 128
#   profile.txt                 benchmarks/vm_profile.py: each kernel's time at 1 x 128 (the graph-less build, synchronized)
#   tune.json                   tvmbert tune at 1 x 128 into $WORK/logs (stopped at its limit: the records so far are kept)
#   records.json, tuning_logs/  the records compacted (tvmbert compact), to commit under tuning_logs/
#   tuning_history.tar.gz       the log folder as tune wrote it (a compact that failed loses nothing)
#   rebuild.json, bench-tuned.json  the 1 x 128 build with them (tasks tuned), timed against the peers again
# Limits (BUILDS_S ... set them) from the first H200 run (../shared/gpu/README.md: four builds 111 s,
# verify 18-25 s, bench 60-75 s a call with three peers) with a margin: call 2's add up to 485 s,
# call 3's to 310 s; the machine's start (~45 s), call 1 and the install (~30 s) fit in 15 minutes.
# On request: verify-fp32, bench-fp32 (fp32 at 1 x 14 and 1 x 128), tests (the tests marked cuda), memcheck
# (compute-sanitizer over three calls of the fp16 1 x 14 build), bench-graphless (1 x 14 without the CUDA graph).
#
# A dry run here: every build compiles its kernels with nvcc as on the GPU (where there is no
# driver, a stub one whose every call fails lets TVM load its CUDA runtime; without it TVM keeps
# the kernels' CUDA source), then each step that needs the device says so in one line ("this
# machine has no cuda device", exit 2); the cuda tests skip:
#   OUT=/tmp/gpu MODEL=bert-tiny PY=.venv/bin/python bash benchmarks/gpu_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
TVM_VERSION=0.27.0.post1
FFI_VERSION=0.1.14.post0  # pyproject.toml's pin: 0.1.15.post2 segfaults every tuning run
# What tvmbert and its tests import that the machine's image lacks, beside TVM: pytest for the tests
# step, xgboost-cpu for tuning (MetaSchedule's cost model), tornado for TVM's RPC tracker.
SMALL_WHEELS=("apache-tvm-ffi==$FFI_VERSION" pytest pluggy iniconfig tornado xgboost-cpu)
CARRY_LIMIT=$((64 * 1024 * 1024))
WHEELS=/tmp/tvm-wheels
SITE=/tmp/site

travelling_bytes() {  # what every call carries: the tracked files and the untracked ones git does not ignore
    git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}'
}

pack() {  # the two carries: half the TVM wheel in each, the small wheels beside them
    local download tree
    download=$(mktemp -d)
    rm -rf .gpu1 .gpu2 && mkdir -p .gpu1 .gpu2
    local wheel_args=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
                      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
                      --platform manylinux1_x86_64 --platform any)
    python3 -m pip download -q "${wheel_args[@]}" -d "$download" "apache-tvm==$TVM_VERSION" || return 1
    python3 -m pip download -q "${wheel_args[@]}" -d .gpu1 "${SMALL_WHEELS[@]}" || return 1
    mv .gpu1/xgboost_cpu-*.whl .gpu2/  # the largest beside the other half: room in each call for the tree to grow
    local wheel=("$download"/apache_tvm-*.whl)
    split -n 2 -d "${wheel[0]}" "$download/part."
    mv "$download/part.00" ".gpu1/$(basename "${wheel[0]}").part00"
    mv "$download/part.01" ".gpu2/$(basename "${wheel[0]}").part01"
    rm -rf "$download"
    tree=$(travelling_bytes)
    echo "every call: $(( tree / 1024 )) KiB of tracked and untracked files"
    for part in .gpu1 .gpu2; do
        local bytes=$(( tree + $(du -sb "$part" | cut -f1) ))
        echo "$part: $(( bytes / 1024 / 1024 )) MiB with them (the limit: $(( CARRY_LIMIT / 1024 / 1024 )) MiB): $(ls "$part" | tr '\n' ' ')"
        (( bytes < CARRY_LIMIT )) || { echo "$part does not fit one call" >&2; return 1; }
    done
}

unpack() {  # call 1: the first half kept on the machine until call 2
    mkdir -p "$WHEELS" && cp .gpu1/* "$WHEELS"/ && ls -la "$WHEELS"
}

install() {  # call 2: the wheel joined and installed, with no index, into $SITE
    cp .gpu2/* "$WHEELS"/ || return 1
    local first=("$WHEELS"/*.part00)
    cat "${first[0]}" "${first[0]%.part00}.part01" > "${first[0]%.part00}" && rm "$WHEELS"/*.part0? || return 1
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl || return 1
    use_tvm
    python3 -c "import tvm, pytest; print('tvm', tvm.__version__, 'cuda device:', tvm.cuda(0).exist)"
}

use_tvm() {  # TVM from $SITE, the project from the working tree, CUDA's runtime from PyTorch's wheels
    local cudart
    cudart=$(python3 -c "import glob, os, nvidia; print(':'.join(sorted({os.path.dirname(p) for d in nvidia.__path__ for p in glob.glob(d + '/**/libcudart.so*', recursive=True)})))" 2>/dev/null)
    export PYTHONPATH=$SITE:$PWD LD_LIBRARY_PATH=${cudart:+$cudart:}${LD_LIBRARY_PATH:-}
    if [[ -d /usr/local/cuda/bin ]]; then export PATH=$PATH:/usr/local/cuda/bin; fi  # nvcc, where the image keeps it off PATH
}

stub_driver() {  # where there is no CUDA driver: one whose every call fails (no device), built in $1
    local symbols
    symbols=$("$PY" -c "import glob, os, tvm; print(glob.glob(os.path.dirname(tvm.__file__) + '/lib/libtvm_runtime_cuda.so')[0])" 2>/dev/null) || return 1
    mkdir -p "$1"
    nm -D --undefined-only "$symbols" | awk '$2 ~ /^cu[A-Z]/ {print "int " $2 "(void) { return 100; }"}' > "$1/stub.c"
    gcc -shared -fPIC -o "$1/libcuda.so.1" "$1/stub.c" && export LD_LIBRARY_PATH=$1:${LD_LIBRARY_PATH:-}
}

# `tvmbert build` of each DTYPE:BATCHxSEQ_LEN[:nograph] argument, in one process; one that fails leaves the others to build
BUILDS='
import os, sys
from tvmbert.cli import main
failed = []
for build in sys.argv[1:]:
    dtype, shape, *graph = build.split(":")
    batch, seq_len = shape.split("x")
    if main(["build", os.environ["MODEL"], "--target", "cuda", "--dtype", dtype, "--batch", batch, "--seq-len", seq_len,
             "--workdir", os.environ["WORK"], *(["--no-cuda-graph"] if graph else [])]):
        failed.append(build)
sys.exit(f"failed: {failed}" if failed else 0)
'

# The CUDA-graph build of fp16 1 x 128 against the graph-less one: the first call captures, the next replay.
GRAPH_CHECK='
import os, sys
import numpy as np
from tvmbert import Job, JobConfig, build
from tvmbert.deploy.compiled import CompiledModel
answers = {}
for graph in (False, True):
    job = Job(JobConfig(model=os.environ["MODEL"], dtype="float16", seq_len=128, target="cuda", workdir=os.environ["WORK"],
                        cuda_graph=graph))
    built = build(job)
    if not job.target.device_present():
        sys.exit(print("error: the graph check runs the model: this machine has no cuda device", file=sys.stderr) or 2)
    model, arrays = CompiledModel(built, job), [t.numpy() for t in job.inputs.as_tuple()]
    answers[graph] = [model(arrays) for _ in range(3)]
off = max(float(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64)).max())
          for run in answers[True] for g, w in zip(run, answers[False][0]))
same = all(np.array_equal(g, w) for run in answers[True] for g, w in zip(run, answers[False][0]))
verdict = "identical" if same else "DIFFERENT"
print(f"cuda graph against graph-less, capture and 2 replays: {verdict} (max abs diff {off:.3g})")
sys.exit(0 if same else 1)
'

# Three calls of the fp16 1 x 14 build (the CUDA graph's capture, then replays): what memcheck watches.
CALLS='
import os
from tvmbert import Job, JobConfig, build
from tvmbert.deploy.compiled import CompiledModel
job = Job(JobConfig(model=os.environ["MODEL"], dtype="float16", seq_len=14, target="cuda", workdir=os.environ["WORK"]))
model, arrays = CompiledModel(build(job), job), [t.numpy() for t in job.inputs.as_tuple()]
print([float(abs(out).max()) for _ in range(3) for out in model(arrays)])
'

run_steps() {
    OUT=${OUT:-build/gpu}
    MODEL=${MODEL:-bert-base}
    PY=${PY:-python3}
    WORK=${WORK:-build/gpu-work}
    mkdir -p "$OUT" "$WORK"
    export PYTHONUNBUFFERED=1 TVMBERT_TRACEBACK=1 MODEL WORK  # an internal failure's traceback: no rerun to get it
    use_tvm
    "$PY" -c "import ctypes; ctypes.CDLL('libcuda.so.1')" 2>/dev/null || stub_driver "$WORK/cuda-stub" \
        || echo "no stub CUDA driver: the builds keep their CUDA source, uncompiled"
    log="$OUT/log.txt"
    { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "no nvidia-smi"
      "$PY" -c "import tvm; print('cuda device:', tvm.cuda(0).exist)"; lscpu | grep -E "Model name|^CPU\(s\)"; } > "$log"
    steps=" ${STEPS:-builds verify-fp16 verify-fp16-b8 graph-check bench-fp16-b1 bench-fp16-b8 profile} "
    source benchmarks/steps.sh
    # Every build the asked steps run, first and in one process: TVM parses its CUDA tensor intrinsics
    # once, and a dry run cross-compiles each shape. The steps after reuse them.
    local wanted=()
    run verify-fp32 || run bench-fp32 && wanted+=(float32:1x14)
    run verify-fp16 || run bench-fp16-b1 && wanted+=(float16:1x14)
    run bench-fp16-b1 || run graph-check || run profile && wanted+=(float16:1x128)
    run graph-check || run profile && wanted+=(float16:1x128:nograph)
    run memcheck && wanted+=(float16:1x14)
    run bench-graphless && wanted+=(float16:1x14:nograph)
    run bench-fp16-b8 || run verify-fp16-b8 && wanted+=(float16:8x128)
    run bench-fp32 && wanted+=(float32:1x128)
    run builds && step builds.txt "${BUILDS_S:-150}" "$PY" -c "$BUILDS" "${wanted[@]}"
    local verify=("$PY" -m tvmbert verify "$MODEL" --target cuda --workdir "$WORK" --json)
    local engines=tvm,torch-eager,torch-sdpa,torch-cudagraph  # torch-compile's max-autotune takes minutes: on request
    local bench=("$PY" -m tvmbert bench "$MODEL" --target cuda --workdir "$WORK" --engines "${ENGINES:-$engines}" --repeat 10
                 --min-time 1 --json)
    local logs=("--log-dir" "$WORK/logs")
    run verify-fp16 && step verify-fp16.json "${VERIFY_S:-30}" "${verify[@]}" --dtype float16
    run verify-fp16-b8 && step verify-fp16-b8.json "${VERIFY_B8_S:-35}" "${verify[@]}" --dtype float16 --batch 8 \
        --seq-len 128 --samples 4
    run memcheck && step memcheck.txt "${MEMCHECK_S:-90}" compute-sanitizer --tool memcheck --print-limit 40 --error-exitcode 1 \
        "$PY" -c "$CALLS"
    run bench-graphless && step bench-graphless.json "${BENCH_GRAPHLESS_S:-60}" "${bench[@]}" --dtype float16 --batch 1 --seq-len 14 \
        --no-cuda-graph
    run graph-check && step graph-check.txt "${CHECK_S:-30}" "$PY" -c "$GRAPH_CHECK"
    run bench-fp16-b1 && step bench-fp16-b1.json "${BENCH_S:-100}" "${bench[@]}" --dtype float16 --batch 1 --seq-len 14,128
    run bench-fp16-b8 && step bench-fp16-b8.json "${BENCH_B8_S:-70}" "${bench[@]}" --dtype float16 --batch 8 --seq-len 128
    run profile && step profile.txt "${PROFILE_S:-40}" "$PY" benchmarks/vm_profile.py "$MODEL" --target cuda --dtype float16 \
        --seq-len 128 --workdir "$WORK" --runs 20 --top 20
    # Call 3: tuning where the time is (1 x 128), its records compacted and brought back, the build and bench with them.
    run tune && step tune.json "${TUNE_S:-170}" "$PY" -m tvmbert tune "$MODEL" --target cuda --dtype float16 --seq-len 128 \
        --workdir "$WORK" "${logs[@]}" --trials "${TRIALS:-256}" --json
    if run records; then
        step records.json "${RECORDS_S:-20}" "$PY" -m tvmbert compact "${logs[@]}" --json
        for database in "$WORK"/logs/cuda-*; do  # the compacted file and the tasks marked done: what tuning_logs/ ships
            [[ -d $database ]] || continue
            mkdir -p "$OUT/tuning_logs/${database##*/}" && cp "$database"/records.jsonl.gz "$database"/tasks_done.json \
                "$OUT/tuning_logs/${database##*/}/" 2>> "$log"
        done
        # Every measurement as tune wrote it, whatever compact made of it: the machine and its records go with the call.
        tar -czf "$OUT/tuning_history.tar.gz" -C "$WORK" logs 2>> "$log"
    fi
    run rebuild && step rebuild.json "${REBUILD_S:-50}" "$PY" -m tvmbert build "$MODEL" --target cuda --dtype float16 --seq-len 128 \
        --workdir "$WORK" "${logs[@]}" --json
    run bench-tuned && step bench-tuned.json "${BENCH_TUNED_S:-70}" "${bench[@]}" "${logs[@]}" --dtype float16 --batch 1 --seq-len 128
    run verify-fp32 && step verify-fp32.json "${VERIFY_S:-40}" "${verify[@]}"
    run tests && step tests.txt "${TESTS_S:-60}" "$PY" -m pytest -v -rfEs -p no:cacheprovider -m cuda tests/test_gpu_run.py
    run bench-fp32 && step bench-fp32.json "${BENCH_S:-100}" "${bench[@]}" --batch 1 --seq-len 14,128
    return 0  # each step's exit is in the log
}

(( $# )) || set -- steps
for action in "$@"; do
    case "$action" in
        pack) pack || exit 1 ;;
        unpack) unpack || exit 1 ;;
        install) install || exit 1 ;;
        steps) run_steps ;;
        *) echo "usage: $0 [pack | unpack | install [steps] | steps]" >&2; exit 2 ;;
    esac
done
