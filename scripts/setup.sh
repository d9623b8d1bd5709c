#!/usr/bin/env bash
# Create .venv (Python 3.11) and install the project with its test extras.
# torch is pinned in every install step: an unpinned torch pulls several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
CONSTRAINTS="$(mktemp)"
echo "torch==${TORCH_VERSION}" > "$CONSTRAINTS"
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==${TORCH_VERSION}"
.venv/bin/python -m pip install -q -c "$CONSTRAINTS" -e ".[test,bench]"
rm -f "$CONSTRAINTS"
