#!/usr/bin/env bash
# Installs the Python package zero8 into python3 (or $PYTHON): the Debian build packages (scripts/setup.sh),
# the build tools from PyPI when missing (pybind11, scikit-build-core), then
# `pip install --no-build-isolation .`: CMake builds the extension incrementally in build/python/<wheel tag>/
# (about 2 min from clean on 2 cores, seconds when little changed), and torch comes from PyPI only if the
# version pinned in scripts/constraints.txt (the one place it is pinned) is not installed already.
# With --test: `.[test]`, also pyproject.toml's test extra (pytest; bitsandbytes for the interoperability
# tests of zero8.optim; deepspeed, transformers and accelerate for tests/python/test_deepspeed.py), resolved by
# pip together with the torch pin.
# Extra pip arguments: $ZERO8_PIP_ARGS (e.g. -v to see the compiler). The CUDA kernels are built in when this
# machine has nvcc and a GPU; ZERO8_CUDA=ON|OFF in the environment decides instead (pyproject.toml).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

target="$root"
case "${1:-}" in
  "") ;;
  --test) target="$root[test]" ;;
  *) echo "python_setup: unknown argument '$1' (the only option is --test)" >&2; exit 2 ;;
esac

bash "$root/scripts/setup.sh"

# Without build isolation pip uses these from the environment (the minimum versions are pyproject.toml's
# [build-system] requires), so repeated installs need no download and reuse the CMake build directory.
missing=()
"$python" -c 'import pybind11' 2>/dev/null || missing+=("pybind11>=2.12")
"$python" -c 'import scikit_build_core' 2>/dev/null || missing+=("scikit-build-core>=0.10")
# The pretraining example's progress bar and loss plot (examples/pretrain_gpt.py).
"$python" -c 'import tqdm' 2>/dev/null || missing+=("tqdm")
"$python" -c 'import matplotlib' 2>/dev/null || missing+=("matplotlib")
# The test extra's deepspeed is a source distribution, built here without isolation: setuptools before 70.1
# (Python 3.11's bundled 65.5, for one) has no bdist_wheel of its own and needs the wheel package for it.
if [[ "$target" != "$root" ]]; then
  "$python" -c 'import setuptools.command.bdist_wheel' 2>/dev/null || "$python" -c 'import wheel' 2>/dev/null ||
    missing+=("wheel")
fi
if ((${#missing[@]} > 0)); then
  echo "python_setup: installing from PyPI: ${missing[*]}"
  "$python" -m pip install "${missing[@]}"
fi

# One install at a time: concurrent runs would share the CMake build directory.
mkdir -p "$root/build/python"
exec 9>"$root/build/python/.install.lock"
flock 9

start=$(date +%s)
# shellcheck disable=SC2086  # ZERO8_PIP_ARGS is a space-separated list of pip arguments
"$python" -m pip install --no-build-isolation -c "$root/scripts/constraints.txt" ${ZERO8_PIP_ARGS:-} "$target"
echo "python_setup: zero8 built and installed in $(( $(date +%s) - start )) s"
"$python" -W ignore -c 'import zero8; print("python_setup: zero8", zero8.__version__, zero8.build_info())'
