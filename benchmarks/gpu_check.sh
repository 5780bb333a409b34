#!/usr/bin/env bash
# The GPU check, one command on one GPU machine: tests/gpu, then benchmarks/gpu_smoke.py.
#
# On the GPU machine, from the repository root, with the wheels of benchmarks/gpu_wheels.sh in
# .whl/ (the `device` tool: carry [".whl"], command "bash benchmarks/gpu_check.sh"):
#     bash benchmarks/gpu_check.sh
# On a CPU, the same steps on a tiny model (tests/gpu skip, saying why), in a minute or two, with
# this machine's environment (PYTHON=.venv/bin/python, say):
#     bash benchmarks/gpu_check.sh --dry-run
# Logs and gpu_smoke.json go to $OUT (the device tool's folder that comes back; a new /tmp
# folder when unset). Each step has its own time limit; the whole stays under 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d /tmp/gpu-check-XXXXXX)}
SMOKE=()
DRY=0
if [ "${1:-}" = "--dry-run" ]; then
    SMOKE=(--device cpu --tiny)
    DRY=1
fi
# The wheels are for the GPU machine's Python 3.12; a dry run uses this machine's environment.
if [ $DRY -eq 0 ] && compgen -G ".whl/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
# Nothing is downloaded: the models are built locally, in a cache of this run's own.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 ARCTIC_PLATFORM_CACHE=/tmp/arctic-platform-cache
status=0
(nvidia-smi || echo "no nvidia-smi") > "$OUT/nvidia-smi.txt" 2>&1
timeout 180 "$PYTHON" -m pytest tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout 220 "$PYTHON" -m benchmarks.gpu_smoke "${SMOKE[@]}" --out "$OUT/gpu_smoke.json" 2>&1 \
    | tee "$OUT/gpu_smoke.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "gpu check: $([ $status -eq 0 ] && echo passed || echo FAILED); results in $OUT"
exit $status
