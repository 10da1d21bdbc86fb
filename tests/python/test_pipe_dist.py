"""Runs the multi-rank pipeline tests as real processes under mpirun (see test_engine_dist.py for the
settings): tests/python/dist/dist_pipe.py on 4 ranks (2 and 4 stages), then on 2 ranks (the 4-rank run's
checkpoint at another data-parallel size), a rank killed mid-schedule (dist/pipe_die.py), and on GPUs
(marked cuda) dist/dist_pipe_cuda.py: 2 stages on one GPU over MPI, and on two over NCCL.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import zero8

DIST = Path(__file__).resolve().parent / "dist"
ROOT = Path(__file__).resolve().parents[2]


def _mpirun() -> str:
    if not zero8.build_info()["mpi"]:
        pytest.skip("zero8 was built without MPI: no multi-rank backend")
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        pytest.skip("mpirun not found (scripts/setup.sh installs OpenMPI)")
    return mpirun


def _env(**extra) -> dict:
    env = dict(os.environ)
    env.update({
        "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive",
        "ZERO8_COMM_TIMEOUT": "60",
    })
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _pytest_under_mpirun(np: int, env: dict, results: Path, script: str = "dist_pipe.py") -> int:
    cmd = [_mpirun(), "-np", str(np), "--oversubscribe", sys.executable, "-m", "pytest", "-q", "--color=no",
           "-p", "no:cacheprovider", "-W", "ignore::zero8.config.Zero8ConfigWarning", str(DIST / script)]
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"mpirun -np {np} did not finish in 300 s:\n{(e.stdout or '')[-4000:]}")
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"mpirun -np {np} exited with {r.returncode}:\n{out[-6000:]}"
    outcomes = {}
    for rank in range(np):
        f = results / f"rank{rank}.txt"
        assert f.is_file(), f"rank {rank} left no result:\n{out[-6000:]}"
        outcomes[rank] = tuple(int(v) for v in f.read_text().split())
    assert all(o == (0, outcomes[0][1], 0) for o in outcomes.values()), (outcomes, out[-6000:])
    return outcomes[0][1]


def test_pipeline_under_mpirun(tmp_path):
    shared = tmp_path / "shared"
    r4, r2 = tmp_path / "np4", tmp_path / "np2"
    r4.mkdir()
    r2.mkdir()
    collected = _pytest_under_mpirun(4, _env(ZERO8_PIPE_SHARED=shared, ZERO8_DIST_RESULTS=r4), r4)
    assert collected >= 14
    assert (shared / "latest").read_text() == "global_step3"
    _pytest_under_mpirun(2, _env(ZERO8_PIPE_SHARED=shared, ZERO8_DIST_RESULTS=r2), r2)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["mpi", "nccl"])
def test_pipeline_on_gpus_under_mpirun(tmp_path, backend):
    if backend == "nccl":
        if not zero8.build_info()["nccl"]:
            pytest.skip("zero8 was built without NCCL")
        if torch.cuda.device_count() < 2:
            pytest.skip(f"NCCL needs a GPU per rank: 2 stages need 2 GPUs, this machine has "
                        f"{torch.cuda.device_count()} (the mpi case runs both stages on one)")
    results = tmp_path / "results"
    results.mkdir()
    env = _env(ZERO8_CUDA_BACKEND=backend, ZERO8_CUDA_OUT=tmp_path, ZERO8_DIST_RESULTS=results)
    collected = _pytest_under_mpirun(2, env, results, "dist_pipe_cuda.py")
    assert collected >= 8


def test_a_rank_dying_mid_schedule_fails_every_rank_naming_it(tmp_path):
    t0 = time.monotonic()
    cmd = [_mpirun(), "-np", "4", "--oversubscribe", sys.executable, str(DIST / "pipe_die.py")]
    r = subprocess.run(cmd, cwd=ROOT, env=_env(ZERO8_PIPE_DIE_OUT=tmp_path), capture_output=True, text=True,
                       timeout=240)
    took = time.monotonic() - t0
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-4000:]
    assert (tmp_path / "death").is_file(), f"rank 3 never reached its death:\n{out[-4000:]}"
    for rank in (0, 1, 2):
        f = tmp_path / f"rank{rank}.txt"
        assert f.is_file(), f"rank {rank} wrote no error:\n{out[-4000:]}"
        since, message = f.read_text().split(" ", 1)
        # Well inside the 60 s communicator timeout: the death itself is seen, not a timeout.
        assert 0 <= float(since) < 10, (rank, since, message)
        assert message.startswith("Zero8CommError") and re.search(r"\brank 3\b.*died", message), (rank, message)
    assert took < 200, took
