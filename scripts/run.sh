#!/usr/bin/env bash
# The main job: installs what is missing, builds zero8, and runs the optimizer demonstration
# (a small MLP fitted with 8-bit and 32-bit AdamW side by side; loss and optimizer-state memory).
# Arguments are passed to the demo (try --help).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="${ZERO8_BUILD_DIR:-$root/build}"

bash "$root/scripts/setup.sh"
bash "$root/scripts/build.sh"
echo
exec "$build_dir/examples/demo_optimizers" "$@"
