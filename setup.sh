#!/usr/bin/env bash
# One-command set-up: installs the dependencies into the active Python environment and builds dtmt with
# its C++ extension (editable, so the tests and benchmarks run from this checkout).
# It also installs the embedded Bible corpus (Debian's sword-text-sparv, sword-text-web, libsword-utils) with
# apt-get when mod2imp or the modules are missing and it can (root or password-less sudo); else it warns.
#   bash setup.sh            (use a virtual environment first if you prefer: python3 -m venv .venv && . .venv/bin/activate)
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

# The embedded Bible corpus (`dtmt prepare bible`) is read from Debian's SWORD modules with mod2imp.
BIBLE_PKGS="sword-text-sparv sword-text-web libsword-utils"
bible_ready() {
  command -v mod2imp >/dev/null 2>&1 || return 1
  local module
  for module in spaRV1909eb engWEB2015eb; do
    mod2imp "$module" >/dev/null 2>&1 || return 1
  done
}
apt_install_bible() {
  local run
  command -v apt-get >/dev/null 2>&1 || return 1
  if [ "$(id -u)" -eq 0 ]; then
    run="env"
  elif command -v sudo >/dev/null 2>&1 && sudo -n true >/dev/null 2>&1; then
    run="sudo -n env"
  else
    return 1
  fi
  # shellcheck disable=SC2086
  $run DEBIAN_FRONTEND=noninteractive apt-get install -y -q $BIBLE_PKGS ||
    { $run DEBIAN_FRONTEND=noninteractive apt-get update -q &&
      $run DEBIAN_FRONTEND=noninteractive apt-get install -y -q $BIBLE_PKGS; }
}
if bible_ready; then
  echo "== Bible corpus: mod2imp and the SWORD modules spaRV1909eb, engWEB2015eb are installed"
else
  echo "== installing the embedded Bible corpus: $BIBLE_PKGS (apt-get)"
  apt_install_bible || true
  if ! bible_ready; then
    echo "WARNING: the embedded Bible corpus (dtmt prepare bible) will not be available: mod2imp or the SWORD" >&2
    echo "         modules spaRV1909eb / engWEB2015eb are missing and could not be installed (this needs apt-get" >&2
    echo "         and root or password-less sudo). Install them with:" >&2
    echo "             sudo apt-get install $BIBLE_PKGS" >&2
    echo "         Everything else works without them (dtmt prepare files takes your own corpus)." >&2
  fi
fi

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "== installing torch 2.13.0"
  "$PY" -m pip install "torch==2.13.0"
fi
echo "== installing build and test requirements"
"$PY" -m pip install -r requirements.txt
echo "== building dtmt_kernels._C (C++17 + OpenMP; CUDA sources too when torch has CUDA)"
"$PY" -m pip install --no-build-isolation -e .
"$PY" -c "import dtmt_kernels as dk; print('dtmt ready; backends:', dk.available_backends())"
