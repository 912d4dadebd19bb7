#!/usr/bin/env bash
# One-command set-up: installs the dependencies into the active Python environment and builds dtmt with
# its C++ extension (editable, so the tests and benchmarks run from this checkout).
#   bash setup.sh            (use a virtual environment first if you prefer: python3 -m venv .venv && . .venv/bin/activate)
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "== installing torch 2.13.0"
  "$PY" -m pip install "torch==2.13.0"
fi
echo "== installing build and test requirements"
"$PY" -m pip install -r requirements.txt
echo "== building dtmt_kernels._C (C++17 + OpenMP; CUDA sources too when torch has CUDA)"
"$PY" -m pip install --no-build-isolation -e .
"$PY" -c "import dtmt_kernels as dk; print('dtmt ready; backends:', dk.available_backends())"
