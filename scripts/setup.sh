#!/usr/bin/env bash
# Installs what zero8 needs to build and test on Debian 12 (bookworm), from Debian's packages only.
# Idempotent: when every package is already installed it touches nothing (no apt-get update), so
# scripts/build.sh, test.sh and run.sh can call it on every run. The CUDA toolkit is optional: the
# build compiles the CUDA kernels when nvcc is found (/usr/local/cuda/bin/nvcc or on PATH).
set -euo pipefail

# cmake >= 3.24 (bookworm has 3.25), Ninja, g++ (OpenMP through libgomp), GoogleTest/GoogleMock,
# OpenMPI (the CPU communication backend and `mpirun` for the multi-rank tests), nlohmann-json
# (DeepSpeed config, checkpoint manifests) and xxHash (checkpoint checksums), both header-only,
# oneDNN (the CPU int8 GEMM; the build falls back to the scalar reference without it), python3;
# clang with its OpenMP runtime (libomp), for the test suite's second build of the C++ library, and
# its sanitizer and libFuzzer runtimes (libclang-rt-14-dev) and llvm-symbolizer (llvm) for the
# sanitizer and fuzz builds (scripts/sanitize.sh);
# iproute2 (`ip netns`, veth) for the two-host tests in network namespaces.
ZERO8_APT_PACKAGES=(
  cmake
  ninja-build
  g++
  make
  pkg-config
  libgtest-dev
  libgmock-dev
  libopenmpi-dev
  openmpi-bin
  nlohmann-json3-dev
  libxxhash-dev
  libdnnl-dev
  python3
  clang
  libomp-dev
  libclang-rt-14-dev
  llvm
  iproute2
)

missing=()
for pkg in "${ZERO8_APT_PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
  if [[ "$status" != "install ok installed" ]]; then
    missing+=("$pkg")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "setup: all ${#ZERO8_APT_PACKAGES[@]} Debian packages present"
else
  echo "setup: installing missing Debian packages: ${missing[*]}"
  if [[ $(id -u) -eq 0 ]]; then
    SUDO=()
  elif command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo)
  else
    echo "setup: error: not root and sudo is not available; install as root: apt-get install ${missing[*]}" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  "${SUDO[@]}" apt-get update
  "${SUDO[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
fi

if command -v nvcc >/dev/null 2>&1 || [[ -x /usr/local/cuda/bin/nvcc ]]; then
  echo "setup: CUDA toolkit found: the CUDA kernels will be compiled (nothing here runs them without a GPU)"
else
  echo "setup: no CUDA toolkit (nvcc): building the CPU library only"
fi
