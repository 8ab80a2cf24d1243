#!/usr/bin/env bash
# Everything a lent GPU machine (H100/H200: Python 3.12, PyTorch with CUDA, transformers, click,
# rich, pyyaml, psutil, cloudpickle, numpy, ml_dtypes, nvcc; no TVM, no network) runs for
# tvmbert, in the fewest calls. A task has 15 minutes of device time in all (starts, idle waits
# and calls count), at most 10 a call, and the machine goes after 30 s idle: prepare here, then
# make the three calls back to back.
#
# Here, once (fills the ignored folders .gpu1/ and .gpu2/, and checks each call's carry fits):
#   bash benchmarks/gpu_run.sh pack
# On the lent machine, three calls of the device tool's `run`, in a row:
#   1. carry [".gpu1"]:  bash benchmarks/gpu_run.sh unpack
#   2. carry [".gpu2"]:  bash benchmarks/gpu_run.sh install
#   3. no carry:         bash benchmarks/gpu_run.sh            (timeout_s 600; STEPS="..." for some)
# A call carries at most 64 MiB, tracked files included: the apache-tvm wheel (~100 MB) travels
# in halves, one a call. Results come back under $OUT (at most 8 files): log.txt (the GPU, the
# driver, each step's exit and stderr) and one file per step:
#   verify-fp32.json, verify-fp16.json   tvmbert verify MODEL --target cuda [--dtype float16]
#   bench-fp16.json, bench-fp32.json     tvm against torch-eager, -sdpa and -compile on the GPU, 1 x 14, 1 x 128, 8 x 128
#   tests.txt                            the tests marked cuda (tests/test_gpu_run.py), run on the device
# The default steps' limits add up to 560 s. A dry run here (no CUDA device: each device step
# cross-compiles, then says so in one line, exit 2):
#   OUT=/tmp/gpu MODEL=bert-tiny PY=.venv/bin/python bash benchmarks/gpu_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
TVM_VERSION=0.27.0.post1
FFI_VERSION=0.1.14.post0  # pyproject.toml's pin: 0.1.15.post2 segfaults every tuning run
CARRY_LIMIT=$((64 * 1024 * 1024))
WHEELS=/tmp/tvm-wheels
SITE=/tmp/site

pack() {  # the two carries: half the TVM wheel in each, the small wheels beside the smaller half
    local download part tracked
    download=$(mktemp -d)
    rm -rf .gpu1 .gpu2 && mkdir -p .gpu1 .gpu2
    local wheel_args=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
                      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    python3 -m pip download -q "${wheel_args[@]}" -d "$download" "apache-tvm==$TVM_VERSION" || return 1
    python3 -m pip download -q "${wheel_args[@]}" -d .gpu1 "apache-tvm-ffi==$FFI_VERSION" tornado safetensors || return 1
    python3 -m pip download -q "${wheel_args[@]}" -d .gpu2 xgboost-cpu || return 1
    local wheel=("$download"/apache_tvm-*.whl)
    split -n 2 -d "${wheel[0]}" "$download/part."
    mv "$download/part.00" ".gpu1/$(basename "${wheel[0]}").part00"
    mv "$download/part.01" ".gpu2/$(basename "${wheel[0]}").part01"
    rm -rf "$download"
    tracked=$(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s}')
    for part in .gpu1 .gpu2; do
        local bytes=$(( tracked + $(du -sb "$part" | cut -f1) ))
        echo "$part: $(( bytes / 1024 / 1024 )) MiB with the tracked files (the limit: $(( CARRY_LIMIT / 1024 / 1024 )))"
        (( bytes < CARRY_LIMIT )) || { echo "$part does not fit one call" >&2; return 1; }
    done
}

unpack() {  # call 1: the first half kept on the machine until call 2
    mkdir -p "$WHEELS" && cp .gpu1/* "$WHEELS"/ && ls -la "$WHEELS"
}

install() {  # call 2: the wheel joined and installed, with no index, into $SITE
    cp .gpu2/* "$WHEELS"/ || return 1
    local first=("$WHEELS"/*.part00)
    cat "${first[0]}" "${first[0]%.part00}.part01" > "${first[0]%.part00}" && rm "$WHEELS"/*.part0?
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl || return 1
    use_tvm
    python3 -c "import tvm; print('tvm', tvm.__version__, 'cuda device:', tvm.cuda(0).exist)"
}

use_tvm() {  # TVM from $SITE, the project from the working tree, CUDA's runtime from PyTorch's wheels
    local cudart
    cudart=$(python3 -c "import glob, os, nvidia; print(':'.join(sorted({os.path.dirname(p) for d in nvidia.__path__ for p in glob.glob(d + '/**/libcudart.so*', recursive=True)})))" 2>/dev/null)
    export PYTHONPATH=$SITE:$PWD LD_LIBRARY_PATH=${cudart:+$cudart:}${LD_LIBRARY_PATH:-}
}

steps_on_device() {
    OUT=${OUT:-build/gpu}
    MODEL=${MODEL:-bert-base}
    PY=${PY:-python3}
    WORK=${WORK:-build/gpu-work}
    mkdir -p "$OUT" "$WORK"
    export PYTHONUNBUFFERED=1 TVMBERT_TRACEBACK=1
    use_tvm
    log="$OUT/log.txt"
    { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "no nvidia-smi"; lscpu | grep -E "Model name|^CPU\(s\)"; } > "$log"
    steps=" ${STEPS:-verify-fp32 verify-fp16 bench-fp16 bench-fp32 tests} "
    source benchmarks/steps.sh
    local tvmbert=("$PY" -m tvmbert)
    # verify builds 1 x 14 first; bench reuses it (same workdir), then builds 1 x 128 and 8 x 128
    run verify-fp32 && step verify-fp32.json "${VERIFY_S:-110}" "${tvmbert[@]}" verify "$MODEL" --target cuda --workdir "$WORK" --json
    run verify-fp16 && step verify-fp16.json "${VERIFY_S:-110}" "${tvmbert[@]}" verify "$MODEL" --target cuda --dtype float16 --workdir "$WORK" --json
    local bench=(bench "$MODEL" --target cuda --workdir "$WORK" --repeat 20 --min-time 2 --json)
    run bench-fp16 && step bench-fp16.json "${BENCH_S:-150}" "${tvmbert[@]}" "${bench[@]}" --dtype float16 --batch 1,8 --seq-len 14,128
    run bench-fp32 && step bench-fp32.json "${BENCH_S:-130}" "${tvmbert[@]}" "${bench[@]}" --batch 1 --seq-len 14,128
    run tests && step tests.txt "${TESTS_S:-60}" "$PY" -m pytest -v -rfE -p no:cacheprovider -m cuda tests/test_gpu_run.py
}

case "${1:-steps}" in
    pack) pack ;;
    unpack) unpack ;;
    install) install ;;
    steps) steps_on_device ;;
    *) echo "usage: $0 [pack|unpack|install|steps]" >&2; exit 2 ;;
esac
