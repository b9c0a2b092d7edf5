#!/usr/bin/env bash
# Sets everything up on a fresh machine and runs every check: ruff, mypy (strict), pytest.
# At the end, pass or fail, it prints its wall time: in all, and for the checks alone.
# The fast tier for the edit loop: .venv/bin/python -m pytest -q -m "not e2e and not deploy and not external"
set -euo pipefail
cd "$(dirname "$0")/.."
checks_start=
report() {
  local status=$? checks=-
  [[ -n $checks_start ]] && checks=$((SECONDS - checks_start))
  echo "scripts/test.sh: exit $status after ${SECONDS} s wall time (ruff, mypy and pytest: ${checks} s)"
}
trap report EXIT
bash scripts/system-packages.sh
bash scripts/setup.sh
checks_start=$SECONDS
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
