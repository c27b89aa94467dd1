#!/usr/bin/env bash
# The checksum worker's GPU figures (issue 8) in one call on a CUDA machine:
# values checked against the CPU's (and no host sync in a step), then the
# large-KV throughput, eager and compiled, then small requests, then the
# candidate forms of the fused kernel side by side. Each stage
# runs under its own time limit and a failed one does not stop the next:
# a lent GPU's minutes are few.
#
#     bash benchmarks/gpu_check.sh [OUT_DIR]    # logs in OUT_DIR (or $OUT),
#                                               # inductor's kernels in kernels.tgz
#     DEVICE=cpu bash benchmarks/gpu_check.sh    # a dry run of the script
#
# Needs torch with CUDA, numpy and msgspec; where msgspec is missing, wheels
# in .whl/ (for a machine with no index) are installed into /tmp/site.
set -u
out=${1:-${OUT:-/tmp/kvguard-gpu}}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if ! python3 -c "import msgspec" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site .whl/*.whl || exit
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
# Inductor's generated kernels come back with the logs (kernels.tgz).
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/kvguard-inductor}
bench=(python3 benchmarks/bench_checksum.py --device "${DEVICE:-cuda}" --baseline "" --check)

stage() {
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc, $((SECONDS - start)) s (limit $limit s); log's end:"
    tail -n 25 "$out/$name.log"
}

stage env 30 bash -c 'nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv
python3 -c "import sys, torch, numpy, msgspec; print(sys.version.split()[0], torch.__version__, numpy.__version__, msgspec.__version__, torch.cuda.get_device_name())"'
stage eager 90 "${bench[@]}" --modes eager --parts large
stage compiled 150 "${bench[@]}" --modes compiled --parts large
stage small 90 "${bench[@]}" --modes eager,compiled --parts small --small-reps 100
stage forms 200 python3 benchmarks/bench_kernel_forms.py --device "${DEVICE:-cuda}" \
    --kv-gib "${KV_GIB:-16}"
find "$TORCHINDUCTOR_CACHE_DIR" -name "*.py" -print0 2>/dev/null |
    tar czf "$out/kernels.tgz" --null -T - 2>/dev/null
echo "== summary"
grep -h "device check\|FAILED\|^fused\|Error" "$out"/*.log
grep -h -A6 "^form " "$out/forms.log"
