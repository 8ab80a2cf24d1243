#!/usr/bin/env bash
# Everything a lent GPU machine (H100/H200: Python 3.12, PyTorch with CUDA, transformers, click,
# rich, pyyaml, psutil, cloudpickle, numpy, ml_dtypes, nvcc; no TVM, no pytest, no network) runs
# for tvmbert, in two calls. A task has 15 minutes of device time in all (the start, idle waits
# and calls count), at most 10 a call, and the machine goes after 30 s idle: prepare here, then
# make the two calls back to back.
#
# Here, once: fills the ignored .gpu1/ and .gpu2/ (the apache-tvm wheel in halves, the small wheels
# beside them) and checks that each call fits 64 MiB with the files every call carries:
#   bash benchmarks/gpu_run.sh pack
# On the lent machine, the device tool's `run`, back to back:
#   1. carry [".gpu1"], timeout_s 60:    bash benchmarks/gpu_run.sh unpack
#   2. carry [".gpu2"], timeout_s 600:   bash benchmarks/gpu_run.sh install steps
#   more on the same warm machine (no carry):  STEPS="builds bench-fp32" bash benchmarks/gpu_run.sh steps
# Results come back under $OUT (at most 8 files): log.txt (the GPU, its driver, each step's command,
# exit and stderr) and one file per step, each stopped at its limit so that the finished ones come
# back when a later one runs out of time:
#   builds.txt                              every build the steps below run (bert-base on cuda: fp32 1 x 14,
#                                           fp16 1 x 14, 1 x 128, 8 x 128), in one process: TVM parses its
#                                           CUDA tensor intrinsics once (5 s on 2 cores here)
#   verify-fp32.json, verify-fp16.json      tvmbert verify MODEL --target cuda [--dtype float16]
#   bench-fp16-b1.json, bench-fp16-b8.json  tvm against torch-eager, -sdpa and -compile on the GPU,
#                                           synchronized, in fp16: 1 x 14 and 1 x 128; 8 x 128
#   tests.txt                               the tests marked cuda, on the device
#   bench-fp32.json                         the same in fp32 at 1 x 14 and 1 x 128 (on request: STEPS)
# The default steps' limits add up to 540 s (BUILDS_S, VERIFY_S, BENCH_S, TESTS_S set them), the
# install takes about 20: guesses from this CPU, to be set from the first GPU run's log.txt.
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

# `tvmbert build` of each DTYPE:BATCHxSEQ_LEN argument, in one process; one that fails leaves the others to build
BUILDS='
import os, sys
from tvmbert.cli import main
failed = []
for build in sys.argv[1:]:
    dtype, shape = build.split(":")
    batch, seq_len = shape.split("x")
    if main(["build", os.environ["MODEL"], "--target", "cuda", "--dtype", dtype, "--batch", batch, "--seq-len", seq_len,
             "--workdir", os.environ["WORK"]]):
        failed.append(build)
sys.exit(f"failed: {failed}" if failed else 0)
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
    steps=" ${STEPS:-builds verify-fp32 verify-fp16 bench-fp16-b1 bench-fp16-b8 tests} "
    source benchmarks/steps.sh
    # Every build the asked steps run, first and in one process: TVM parses its CUDA tensor intrinsics
    # once (5 s on 2 cores here), and a dry run cross-compiles each shape. The steps after reuse them.
    local wanted=()
    run verify-fp32 || run bench-fp32 && wanted+=(float32:1x14)
    run verify-fp16 || run bench-fp16-b1 && wanted+=(float16:1x14)
    run bench-fp16-b1 && wanted+=(float16:1x128)
    run bench-fp16-b8 && wanted+=(float16:8x128)
    run bench-fp32 && wanted+=(float32:1x128)
    run builds && step builds.txt "${BUILDS_S:-270}" "$PY" -c "$BUILDS" "${wanted[@]}"
    local verify=("$PY" -m tvmbert verify "$MODEL" --target cuda --workdir "$WORK" --json)
    local bench=("$PY" -m tvmbert bench "$MODEL" --target cuda --workdir "$WORK" --repeat 20 --min-time 2 --json)
    run verify-fp32 && step verify-fp32.json "${VERIFY_S:-40}" "${verify[@]}"
    run verify-fp16 && step verify-fp16.json "${VERIFY_S:-40}" "${verify[@]}" --dtype float16
    run bench-fp16-b1 && step bench-fp16-b1.json "${BENCH_S:-80}" "${bench[@]}" --dtype float16 --batch 1 --seq-len 14,128
    run bench-fp16-b8 && step bench-fp16-b8.json "${BENCH_S:-60}" "${bench[@]}" --dtype float16 --batch 8 --seq-len 128
    run tests && step tests.txt "${TESTS_S:-50}" "$PY" -m pytest -v -rfEs -p no:cacheprovider -m cuda tests/test_gpu_run.py
    run bench-fp32 && step bench-fp32.json "${BENCH_S:-80}" "${bench[@]}" --batch 1 --seq-len 14,128
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
