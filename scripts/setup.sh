#!/usr/bin/env bash
# Set up ssl-vit in ./.venv: a virtual environment with the package (editable) and the exact
# dependency versions of scripts/constraints.txt. Safe to run again (it only checks then).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($PYTHON --version)"
    "$PYTHON" -m venv .venv
fi
echo "setup: installing ssl-vit and its pinned dependencies (torch is large: ~1 min the first time)"
.venv/bin/python -m pip install --quiet --disable-pip-version-check \
    -c scripts/constraints.txt -e ".[dev]"
echo "setup: ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
