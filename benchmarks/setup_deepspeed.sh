#!/usr/bin/env bash
# Installs DeepSpeed, the yardstick of benchmarks/bench_vs_deepspeed.py, from PyPI into the Python that
# runs the benchmark (python3, or $PYTHON; activate a virtualenv first to keep it there). DeepSpeed is a
# benchmark dependency, not one of zero8's: the main install never pulls it. Its ops are not prebuilt
# (DS_BUILD_OPS=0); DeepSpeed JIT-compiles the CPU Adam it uses on first use, with this machine's g++.
# The version is the one the benchmark's figures were made with; pyproject.toml's test extra, where it
# names deepspeed, pins the same one (tests/python/test_bench_vs_deepspeed.py checks that they agree).
set -euo pipefail
python="${PYTHON:-python3}"
DEEPSPEED_VERSION=0.19.8
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

have=$("$python" -c 'import importlib.metadata as m; print(m.version("deepspeed"))' 2>/dev/null || true)
if [[ "$have" == "$DEEPSPEED_VERSION" ]]; then
  echo "setup_deepspeed: deepspeed $have is installed"
else
  # torch stays as installed: pip would otherwise be free to replace the version zero8 pins.
  torch_version=$("$python" -c 'import torch; print(torch.__version__.split("+")[0])') ||
    { echo "setup_deepspeed: torch is not importable by $python; install zero8 first (scripts/python_setup.sh)" >&2; exit 1; }
  echo "setup_deepspeed: installing deepspeed==$DEEPSPEED_VERSION for torch $torch_version into $("$python" -c 'import sys; print(sys.prefix)')"
  DS_BUILD_OPS=0 "$python" -m pip install "deepspeed==$DEEPSPEED_VERSION" "torch==$torch_version"
fi
DS_ACCELERATOR=cpu "$python" -W ignore -c 'import deepspeed; print("setup_deepspeed: deepspeed", deepspeed.__version__, "imports")'
