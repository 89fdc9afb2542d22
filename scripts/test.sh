#!/usr/bin/env bash
# Set up (scripts/setup.sh), lint, then run the suite in two tiers: the fast one first (what
# `pytest -m "not system"` runs while iterating), then the `system` tests (processes, installs).
# The two markers split the suite exactly, so no test runs twice or is left out. CI runs exactly
# this. Extra arguments go to both pytest runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Bytecode of every installed module, once per install: the suite starts hundreds of processes,
# and where Python may not write .pyc files (PYTHONDONTWRITEBYTECODE) each would compile what it
# imports again (an import of the pipelines 19 s against 7.6 s). A file that does not compile
# (torch ships a Python 3.12-only test helper) is one no import reads: not an error here.
if [ ! -f .venv/.bytecode ]; then
    .venv/bin/python -m compileall -q -j 0 \
        "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
        > /dev/null 2>&1 || true
    touch .venv/.bytecode
fi
.venv/bin/ruff check .

# The tests may write bytecode (into the clone's __pycache__, git-ignored) even where the machine
# asks Python not to: pytest then caches each test file's assertion rewriting, which every
# pytest process otherwise repeats (the system tier's two workers collect again what the fast
# tier's rewrote: 6-7 s each), and the hundreds of jobs the system tier starts read ssl_vit's
# compiled modules instead of compiling them again.
unset PYTHONDONTWRITEBYTECODE

# Exit 5 is "no test selected" (arguments that pick tests of one tier only): not a failure.
tier() {
    local rc=0
    .venv/bin/python -m pytest -q "$@" || rc=$?
    [[ $rc == 0 || $rc == 5 ]] || return "$rc"
}
# Both tiers run in two xdist workers with one thread per process (the fast one took 67 s so
# against 85 s in one process, 2026-11-28). The system tier runs even when the fast one failed,
# so CI reports both; the exit is non-zero if either failed. Its tests mostly wait on the
# processes they start (imports, launches, signals), so two xdist workers run them side by
# side; one thread per process keeps the two from oversubscribing the cores (README, "quick
# start", has the measured times).
# The fast tier with --dist=loadfile: each test file in one worker, so a file's module fixture
# (a tiny trained run) is made once, not once per worker, and what only a few files import
# (transformers, scikit-learn) is imported by one worker. The system tier balances by test:
# its files hold minutes of jobs each.
rc=0
OMP_NUM_THREADS=1 tier -m "not system" -n 2 --dist=loadfile "$@" || rc=$?
OMP_NUM_THREADS=1 tier -m system -n 2 "$@" || rc=$?
exit "$rc"
