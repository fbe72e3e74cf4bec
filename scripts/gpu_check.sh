#!/usr/bin/env bash
# Every CUDA test and the GPU benchmarks, in one call, for a machine with one GPU (< 8 min).
# Uses the machine's own python3 (with a CUDA torch, numpy, pytest and hypothesis: the test
# files import hypothesis at collection); optree, if missing there, is installed
# from wheels carried in .whl/ (ignored by git; see /work/.library/device/README.md, "wheels").
# Prepare them once, here, for the device's Python 3.12 on x86-64:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl optree==0.20.0
# then run it with the device tool: command "bash scripts/gpu_check.sh $OUT", carry [".whl"].
# Usage: scripts/gpu_check.sh [OUT_DIR]
#   OUT_DIR/gpu_tests.log              pytest -m cuda (first: the cheapest correctness signal)
#   OUT_DIR/offload.log, offload.json  the offload targets (16 layers, hidden 2048, 8k, bf16)
#   OUT_DIR/bench.log, bench/          the GLM-DSA comparison at the gpu-small preset
# Each step has its own time limit (120 + 180 + 150 s); a failing step does not stop the rest.
# Expected on an H200 (estimates, nothing has run there yet): the CUDA tests ~30-45 s (mostly
# collection, torch import and CUDA start); the offload bench ~30-60 s (16 x 50M-parameter bf16
# layers, ~0.1-0.2 s a step, ~1 s for save_on_cpu's steps, which copy ~10 GiB each way); the
# GLM-DSA bench ~40-90 s (13 configurations, ~105 steps of fp32 at 4096 tokens, FLOP-counter and
# census steps in Python). A bench stopped at its limit still leaves what it measured: the
# offload bench writes offload.json after each probe, the GLM-DSA bench results.json after each
# phase and timed round.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-check-out}}
mkdir -p "$out"
# optree 0.15 or newer (pyproject.toml); an older one already there is not enough
if ! python3 -c 'import optree, sys; sys.exit(tuple(map(int, optree.__version__.split(".")[:2])) < (0, 15))' 2>/dev/null; then
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "gpu_check: optree is missing here and no wheel was carried in .whl/ (see the header)" >&2
    exit 2
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  # Here, not as a collection error in every test module: a wheel for another Python, or a
  # dependency it needs (typing_extensions) missing there.
  python3 -c 'import optree' || { echo "gpu_check: optree from .whl/ does not import" >&2; exit 1; }
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# cuBLAS is deterministic under torch.use_deterministic_algorithms only with a fixed workspace,
# read when cuBLAS starts: for the tests' deterministic() blocks too, not only the GLM bench's.
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
# What ran, first in gpu_tests.log: the device image's torch is not the one the suite is
# developed against, and the timings and determinism depend on these.
python3 -c 'import os, torch; assert torch.cuda.is_available(), "no CUDA device"
p = torch.cuda.get_device_properties(0)
print("torch", torch.__version__, "CUDA", torch.version.cuda, "cuDNN",
      torch.backends.cudnn.version(), "|", p.name, f"sm_{p.major}{p.minor}",
      f"{p.total_memory / 2**30:.0f} GiB", "|",
      "CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG"))' 2>&1 \
  | tee "$out/gpu_tests.log" || exit 1
status=0
# -p no:cacheprovider: the tree may be read-only there; -v names a test the timeout stops;
# a module that fails to import on that torch must not cost the other modules' CUDA tests.
# timeout -k: a step that ignores SIGTERM is killed 10 s later.
# -o timeout=45 (pytest-timeout, in the device image): one test stuck in Python must not take
# the whole step. Where the plugin is missing, the option is left out (it would stop nothing).
# faulthandler_timeout (pytest's own): a test still running after 40 s dumps every thread's
# stack, autograd's device threads too, also when it is stuck inside a CUDA call, where
# pytest-timeout's signal cannot stop it (the step's limit does).
per_test=()
if python3 -c 'import pytest_timeout' 2>/dev/null; then per_test=(-o timeout=45); fi
# Only the files that mark a test cuda are collected (8 of the suite's 95 modules): collecting
# all of them took 15 s of this step's 120 on a 2-core developer machine, 7 of these took 5 s.
# tests/test_gpu_check.py checks that they hold every test `-m cuda` selects in the suite.
mapfile -t cuda_files < <(grep -rlE 'mark\.cuda' tests --include='test_*.py' | sort)
# --durations: what each test cost there, to size the next run's limits.
timeout -k 10 120 python3 -m pytest -p no:cacheprovider -v -m cuda --continue-on-collection-errors \
  --durations=12 ${per_test[@]+"${per_test[@]}"} -o faulthandler_timeout=40 \
  "${cuda_files[@]}" 2>&1 | tee -a "$out/gpu_tests.log" \
  || status=1
timeout -k 10 180 python3 -m examples.bench_offload --size realistic --device cuda \
  --json "$out/offload.json" 2>&1 | tee "$out/offload.log" || status=1
timeout -k 10 150 python3 -m examples.glm_dsa.bench --preset gpu-small --device cuda --rounds 3 \
  --warmup 1 --out "$out/bench" 2>&1 | tee "$out/bench.log" || status=1
exit $status
