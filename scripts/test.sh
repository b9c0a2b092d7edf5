#!/usr/bin/env bash
# Sets everything up on a fresh machine and runs every check: ruff, mypy (strict), pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/system-packages.sh
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
