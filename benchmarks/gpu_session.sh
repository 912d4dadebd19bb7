#!/usr/bin/env bash
# Everything issue 3 asks of a GPU machine, in one command: build the extension with its CUDA kernels, run the
# GPU tests (triton and cuda backends against the float64 reference, every dtype), then the GPU benchmark in
# float32 and bfloat16 (triton, cuda, eager reference, cuDNN torch.nn.GRU; fwd+bwd and fwd only; peak memory).
#
#   bash benchmarks/gpu_session.sh              # results under $OUT (default benchmarks/out/gpu)
#
# Needs python3 with a CUDA torch, triton, pybind11, ninja, pytest and hypothesis (the device machines' image
# has them all). Files written (six, at most two folders down): build.log, gpu_tests.log and, per dtype,
# <dtype>/bench_cells_cuda.csv and .png; the tables themselves go to stdout. Copy the tables into
# benchmarks/RESULTS.md with the device line they print.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out/gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
status=0

echo "== device"
nvidia-smi -L || true
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', \
triton.__version__, torch.cuda.get_device_name(0))" || exit 1
# compile the CUDA sources for this device only (a fraction of the build time of torch's default list)
: "${TORCH_CUDA_ARCH_LIST:=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability(0))")}"
export TORCH_CUDA_ARCH_LIST

echo "== build (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, $MAX_JOBS jobs)"
start=$SECONDS
if ! "$PY" setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"
  exit 1
fi
echo "built in $((SECONDS - start)) s"
"$PY" -c "import dtmt_kernels as dk; print('backends:', dk.available_backends())" || exit 1

echo "== GPU tests"
"$PY" -m pytest -q -m gpu -p no:cacheprovider tests/ 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

for dtype in float32 bfloat16; do
  echo "== bench_cells --device cuda --dtype $dtype"
  "$PY" benchmarks/bench_cells.py --device cuda --dtype "$dtype" --T 50 --BH 1x512 8x512 64x512 \
    --depths 1 4 --repeat 10 --out "$OUT/$dtype" || status=1
done
exit $status
