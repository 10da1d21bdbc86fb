"""Runs the multi-rank engine tests (tests/python/dist/dist_engine.py) under mpirun with 2 and 4 ranks
as real processes, and checks that every rank passed every test. 4 ranks share this machine's 2 cores
(--oversubscribe); one kernel thread per rank; a 60 s communicator timeout turns a rank that failed
and skipped a collective into an error on the others instead of a wait.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import torch

import zero8
from engine_util import make_data, reference

DIST_TESTS = Path(__file__).resolve().parent / "dist" / "dist_engine.py"
ROOT = Path(__file__).resolve().parents[2]


def _mpirun() -> str | None:
    return shutil.which("mpirun") or shutil.which("mpiexec")


@pytest.fixture(scope="module")
def reference_file(tmp_path_factory):
    """torch AdamW's reference run, computed once for every rank (dist_engine.py's STEPS and B)."""
    path = tmp_path_factory.mktemp("engine_ref") / "reference.pt"
    torch.save(reference(make_data(), 30, 32), path)
    return path


@pytest.mark.parametrize("np", [2, 4])
def test_engine_under_mpirun(np, reference_file, tmp_path):
    if not zero8.build_info()["mpi"]:
        pytest.skip("zero8 was built without MPI: no multi-rank backend")
    mpirun = _mpirun()
    if mpirun is None:
        pytest.skip("mpirun not found (scripts/setup.sh installs OpenMPI)")
    env = dict(os.environ)
    env.update({
        "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive",
        "ZERO8_COMM_TIMEOUT": "60", "ZERO8_ENGINE_REF": str(reference_file), "ZERO8_DIST_RESULTS": str(tmp_path),
    })
    cmd = [mpirun, "-np", str(np), "--oversubscribe", sys.executable, "-m", "pytest", "-q", "--color=no",
           "-p", "no:cacheprovider", "-W", "ignore::zero8.config.Zero8ConfigWarning", str(DIST_TESTS)]
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"mpirun -np {np} did not finish in 300 s:\n{(e.stdout or '')[-4000:]}")
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"mpirun -np {np} exited with {r.returncode}:\n{out[-6000:]}"
    # Every rank ran the same tests and none failed (dist/conftest.py writes each rank's outcome).
    results = {}
    for rank in range(np):
        f = tmp_path / f"rank{rank}.txt"
        assert f.is_file(), f"rank {rank} left no result:\n{out[-6000:]}"
        results[rank] = tuple(int(v) for v in f.read_text().split())
    assert all(r == (0, results[0][1], 0) for r in results.values()), (results, out[-6000:])
    assert results[0][1] >= 10, results
