#!/usr/bin/env bash
# The README's demo command: installs what it needs into ./.venv, then runs the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
source deploy/venv.sh
exec sevendb demo "$@"
