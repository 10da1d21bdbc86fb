#!/usr/bin/env bash
# Configures and builds zero8 (Release, Ninja) into build/ (or $ZERO8_BUILD_DIR).
# Extra arguments go to cmake's configure step, e.g. `bash scripts/build.sh -DZERO8_CUDA=OFF`;
# $ZERO8_CMAKE_ARGS is read too. Backends are auto-detected (see README.md, "Build options").
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="${ZERO8_BUILD_DIR:-$root/build}"
jobs="${ZERO8_JOBS:-$(nproc 2>/dev/null || echo 2)}"

# shellcheck disable=SC2086  # ZERO8_CMAKE_ARGS is a space-separated list of cmake arguments
cmake -S "$root" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release ${ZERO8_CMAKE_ARGS:-} "$@"
start=$(date +%s)
cmake --build "$build_dir" --parallel "$jobs"
echo "build: done in $(( $(date +%s) - start )) s -> $build_dir"
