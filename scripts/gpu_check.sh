#!/usr/bin/env bash
# Every CUDA test and the GPU bench preset, in one call, for a machine with one GPU (< 8 min).
# Uses the machine's own python3 (with a CUDA torch); optree, if missing there, is installed
# from wheels carried in .whl/ (see /work/.library/device/README.md, "wheels").
# Usage: scripts/gpu_check.sh [OUT_DIR]     (results: OUT_DIR/gpu_tests.log, OUT_DIR/bench/)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-check-out}}
mkdir -p "$out"
if ! python3 -c 'import optree' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name())' || exit 1
status=0
# -p no:cacheprovider: the tree may be read-only there
timeout 300 python3 -m pytest -p no:cacheprovider -q -m cuda tests 2>&1 | tee "$out/gpu_tests.log" || status=1
timeout 240 python3 -m examples.glm_dsa.bench --preset gpu-small --device cuda --out "$out/bench" 2>&1 \
  | tee "$out/bench.log" || status=1
exit $status
