#!/usr/bin/env bash
# Prepares the image's build context (container/Dockerfile) without network access inside the
# build: the project and its runtime dependencies as wheels, pip as a wheel, and a static tini.
#   bash container/prepare-context.sh OUT_DIR
# Wheels are built with the project's venv (.venv, else python3): its Python version must be the base image's.
# tini: $TINI, else tini-static / tini from PATH (Debian package `tini`).
set -euo pipefail
out=${1:?usage: prepare-context.sh OUT_DIR}
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$repo/.venv/bin/python}
[[ -x $python ]] || python=python3  # before scripts/setup.sh made the venv
mkdir -p "$out/wheels"
"$python" -m pip wheel --quiet --wheel-dir "$out/wheels" "$repo" pip
tini=${TINI:-$(command -v tini-static || command -v tini || true)}
if [[ -z $tini ]]; then
  echo "prepare-context: no tini binary (apt-get install tini, or set TINI=/path/to/tini-static)" >&2
  exit 1
fi
cp "$tini" "$out/tini"
echo "prepare-context: $(ls "$out/wheels" | wc -l) wheels and $(basename "$tini") in $out"
