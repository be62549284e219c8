#!/usr/bin/env bash
# The device command of issue 42, run from the repository root on the device image (Python 3.12, JAX
# 0.11 with its CUDA plugin, torch): installs the carried wheels (`make gpu-wheels`, carry .whl), then
# runs bench/gpu_check.py, all sections, under an 8-minute limit.
#     bash bench/gpu_check.sh "$OUT" [gpu_check.py options]
set -u
out=${1:?usage: bench/gpu_check.sh OUT_DIR [options]}
shift
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_check.sh: installing the carried wheels failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/src:$PWD" PYTHONUNBUFFERED=1
(nvidia-smi; python3 -m pip list 2>/dev/null) >"$out/image.txt" 2>&1
timeout 480 python3 bench/gpu_check.py --out "$out" "$@" 2>&1 | tee "$out/log.txt"
exit "${PIPESTATUS[0]}"
