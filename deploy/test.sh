#!/usr/bin/env bash
# The README's test command: installs what it needs into ./.venv, then lints,
# type-checks and runs the whole test suite. Extra arguments go to pytest
# (e.g. `deploy/test.sh -m "not slow"` for the quick loop).
set -euo pipefail
cd "$(dirname "$0")/.."
source deploy/system-deps.sh
export SEVENDB_EXTRAS="${SEVENDB_EXTRAS:-server,dev,spark,netlab}"
source deploy/venv.sh
echo "== ruff" && ruff check .
echo "== mypy" && python deploy/typing_tree.py && mypy && mypy --no-warn-unused-ignores --no-warn-return-any tests
echo "== pytest" && exec python -m pytest "$@"
