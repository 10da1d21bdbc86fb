"""The libtorch C++ example (examples/cpp/libtorch_train): installs the C++ build of zero8 (scripts/build.sh's
build/, or $ZERO8_BUILD_DIR) into a temporary prefix, builds the example as a separate CMake project
against it and the torch package's libtorch, runs it under `mpirun -np 2`, and checks that it trained
(held-out loss below half its initial value) and that both replicas ended with identical weights.

A pytest test rather than a ctest one: it needs the torch package, which scripts/python_setup.sh installs
after ctest has run. Cost here: about 15 s to configure, 15-45 s to compile (libtorch's headers), a few
seconds to run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import zero8

pytestmark = pytest.mark.slow  # conftest.py starts such files first

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "examples" / "cpp" / "libtorch_train"


def _build_dir() -> Path:
    return Path(os.environ.get("ZERO8_BUILD_DIR", ROOT / "build"))


def _run(cmd: list, what: str, timeout: float, env: dict | None = None) -> str:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{what} failed ({r.returncode}):\n{out[-6000:]}"
    return out


def test_libtorch_example_trains_under_mpirun(tmp_path):
    build = _build_dir()
    if not (build / "cmake_install.cmake").is_file() or not list(build.glob("zero8/libzero8.*")):
        pytest.skip(f"no C++ build of zero8 in {build} (run scripts/build.sh, or set ZERO8_BUILD_DIR)")
    for tool in ("cmake", "ninja", "mpirun"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not found (scripts/setup.sh installs it)")
    prefix = tmp_path / "prefix"
    _run(["cmake", "--install", build, "--prefix", prefix], "cmake --install", 120)
    package = (prefix / "lib" / "cmake" / "zero8" / "zero8Config.cmake").read_text()
    if not re.search(r"^set\(zero8_WITH_MPI (1|ON|TRUE)\)", package, re.M):
        pytest.skip(f"the C++ build in {build} has no MPI backend (OpenMPI not found when it was configured)")
    exe_dir = tmp_path / "build"
    _run(["cmake", "-S", SOURCE, "-B", exe_dir, "-G", "Ninja", f"-DCMAKE_PREFIX_PATH={prefix}",
          f"-DPython3_EXECUTABLE={sys.executable}"], "configuring the example", 300)
    _run(["cmake", "--build", exe_dir], "building the example", 600)

    env = dict(os.environ)
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMP_WAIT_POLICY": "passive", "ZERO8_COMM_TIMEOUT": "60"})
    out = _run(["mpirun", "-np", "2", exe_dir / "libtorch_train", "--steps", "200", "--threads", "1"],
               "mpirun -np 2 libtorch_train", 300, env)
    assert "2 rank(s) on mpi" in out, out
    m = re.search(r"held-out loss ([\d.]+) -> ([\d.]+)", out)
    assert m, out
    first, last = float(m.group(1)), float(m.group(2))
    # The classes are 10 balanced-ish teacher labels: the untrained loss is about ln 10 = 2.3; the program's
    # own criterion (exit status 0) is that it halves; checked here from its output as well.
    assert 2.0 < first < 2.7 and last < 0.5 * first, (first, last)
    assert "replicas identical" in out and "PASS" in out, out
    assert zero8.__version__ in out  # the installed C++ library is this version
