#!/usr/bin/env bash
# Set up ssl-vit in ./.venv: a virtual environment with the package (editable) and the exact
# dependency versions of scripts/constraints.txt. Safe to run again: when the constraints and
# pyproject.toml are those of the last install (a stamp in .venv) and the package is found, it
# only says so (under a second, against ~15 s for pip to re-check everything).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
STAMP=.venv/.ssl-vit-setup
want=$(cat scripts/constraints.txt pyproject.toml | cksum)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && .venv/bin/python -c 'import importlib.util as u, sys; sys.exit(u.find_spec("ssl_vit") is None)' 2>/dev/null; then
    echo "setup: .venv is up to date (rm $STAMP to reinstall)"
    exit 0
fi
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($PYTHON --version)"
    "$PYTHON" -m venv .venv
fi
echo "setup: installing ssl-vit and its pinned dependencies (torch is large: ~1 min the first time)"
# uv installs the same pinned set about 4x faster than pip (parallel downloads and unpacking).
# No bytecode here: compiling all of site-packages took 60 s of a 79 s setup on the 2-core VM,
# and the quick start starts four processes (the study forks its jobs from its own imports),
# which compile what they import in 27 s in all. The test suite, which starts hundreds, has
# scripts/test.sh compile it once. pip stays the fallback for machines where uv cannot be
# installed or cannot reach the index (uv ignores pip.conf: set UV_INDEX_URL for a private
# mirror).
pip_install() { .venv/bin/python -m pip install --quiet --disable-pip-version-check "$@"; }
if pip_install "$(grep '^uv==' scripts/constraints.txt)" 2>/dev/null &&
    .venv/bin/uv pip install --quiet --python .venv/bin/python \
        -c scripts/constraints.txt -e ".[dev]"; then
    :
else
    echo "setup: uv unavailable, installing with pip"
    pip_install -c scripts/constraints.txt -e ".[dev]"
fi
rm -f .venv/.bytecode  # scripts/test.sh compiles the new install's
echo "$want" > "$STAMP"
echo "setup: ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
