#!/usr/bin/env bash
# Set up (scripts/setup.sh), lint, then run the suite in two tiers: the fast one first (what
# `pytest -m "not system"` runs while iterating), then the `system` tests (processes, installs).
# The two markers split the suite exactly, so no test runs twice or is left out. CI runs exactly
# this. Extra arguments go to both pytest runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .

# Exit 5 is "no test selected" (arguments that pick tests of one tier only): not a failure.
tier() {
    local rc=0
    .venv/bin/python -m pytest -q -m "$1" "${@:2}" || rc=$?
    [[ $rc == 0 || $rc == 5 ]] || return "$rc"
}
# The system tier runs even when the fast one failed, so CI reports both; the exit is non-zero
# if either failed.
rc=0
tier "not system" "$@" || rc=$?
tier "system" "$@" || rc=$?
exit "$rc"
