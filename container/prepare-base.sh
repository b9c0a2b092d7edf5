#!/usr/bin/env bash
# Machine setup for the image test (tests/deploy/test_image.py), like scripts/system-packages.sh:
# needs the network once, so that the test itself needs none. Makes, in CACHE (default
# /var/cache/region-agent-image):
#   base.tar   a Debian bookworm minbase root file system with python3 (debootstrap), for `podman import`
#   context/   the build context of container/Dockerfile (prepare-context.sh: dependency wheels, pip, tini)
#              plus setuptools, so the test builds the project's own wheel offline
# Re-running keeps what exists (the wheels are made again when pyproject.toml's dependencies change);
# delete CACHE to start over.
set -euo pipefail
cache=${1:-${REGION_AGENT_IMAGE_CACHE:-/var/cache/region-agent-image}}
repo=$(cd "$(dirname "$0")/.." && pwd)
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
mkdir -p "$cache"
if [[ ! -s $cache/base.tar ]]; then
  if [[ $(id -u) != 0 ]] || ! command -v debootstrap >/dev/null 2>&1; then
    echo "prepare-base: needs root and debootstrap (scripts/system-packages.sh installs it)" >&2
    exit 1
  fi
  rootfs=$(mktemp -d "$cache/rootfs.XXXXXX")
  trap 'rm -rf "$rootfs"' EXIT
  debootstrap --variant=minbase --include=python3 bookworm "$rootfs" "$mirror" >"$cache/debootstrap.log" 2>&1
  tar -C "$rootfs" -cf "$cache/base.tar.tmp" . && mv "$cache/base.tar.tmp" "$cache/base.tar"
fi
# The wheels follow the project's dependency list: a changed list makes them again.
deps=$(sed -n '/^dependencies = \[/,/^\]/p' "$repo/pyproject.toml" | sha256sum | cut -c1-16)
if [[ -d $cache/context/wheels && $(cat "$cache/context/deps" 2>/dev/null) != "$deps" ]]; then
  echo "prepare-base: the dependencies changed: making the wheels again" >&2
  rm -rf "$cache/context" "$cache/context.tmp"
fi
if [[ ! -d $cache/context/wheels ]]; then
  rm -rf "$cache/context.tmp"
  bash "$repo/container/prepare-context.sh" "$cache/context.tmp"
  python=${PYTHON:-$repo/.venv/bin/python}
  [[ -x $python ]] || python=python3
  "$python" -m pip wheel --quiet --wheel-dir "$cache/context.tmp/wheels" "setuptools>=68"
  echo "$deps" >"$cache/context.tmp/deps"
  mv "$cache/context.tmp" "$cache/context"
fi
echo "prepare-base: $cache/base.tar and $cache/context are ready"
