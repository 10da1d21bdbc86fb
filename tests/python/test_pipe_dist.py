"""Runs the multi-rank pipeline tests as real processes under mpirun and torchrun (mpirun_util.py: how they
run and report): tests/python/dist/dist_pipe.py on 4 ranks (2 and 4 stages), then on 2 ranks (the 4-rank
run's checkpoint at another data-parallel size), a rank killed mid-schedule (dist/pipe_die.py), and on GPUs
(marked cuda) dist/dist_pipe_cuda.py: 2 stages on one GPU over MPI and (torchrun) tcp, and on two over NCCL.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
import torch

import zero8
from mpirun_util import DIST, ROOT, mpi_env, mpirun_or_skip, pytest_under_launcher, torchrun_cmd, torchrun_env

pytestmark = pytest.mark.slow  # conftest.py starts such files first


@pytest.mark.parametrize("launcher", ["mpirun", "torchrun"])
def test_pipeline_on_ranks(tmp_path, launcher):
    """4 ranks (2 and 4 stages), then, under mpirun, 2 resuming the 4-rank run's checkpoint (which does not
    depend on the launcher); under torchrun the stages' messages and the data-parallel reductions go over
    the tcp backend."""
    shared = tmp_path / "shared"
    collected = pytest_under_launcher(4, "dist_pipe.py", tmp_path / "np4", launcher=launcher, ZERO8_PIPE_SHARED=shared)
    assert collected >= 14
    assert (shared / "latest").read_text() == "global_step3"
    if launcher == "mpirun":
        pytest_under_launcher(2, "dist_pipe.py", tmp_path / "np2", ZERO8_PIPE_SHARED=shared)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["mpi", "nccl", "tcp"])
def test_pipeline_on_gpus(tmp_path, backend):
    """2 stages under mpirun over MPI (sharing one GPU) and NCCL (a GPU each), and under torchrun over tcp
    (sharing one GPU: staged as over MPI, with no MPI library in the job)."""
    if backend == "nccl":
        if not zero8.build_info()["nccl"]:
            pytest.skip("zero8 was built without NCCL")
        if torch.cuda.device_count() < 2:
            pytest.skip(f"NCCL needs a GPU per rank: 2 stages need 2 GPUs, this machine has "
                        f"{torch.cuda.device_count()} (the mpi case runs both stages on one)")
    collected = pytest_under_launcher(2, "dist_pipe_cuda.py", tmp_path / "results",
                                    launcher="torchrun" if backend == "tcp" else "mpirun",
                                    ZERO8_CUDA_BACKEND=backend, ZERO8_CUDA_OUT=tmp_path)
    assert collected >= 8


@pytest.mark.parametrize("launcher", ["mpirun", "torchrun"])
def test_a_rank_dying_mid_schedule_fails_every_rank_naming_it(tmp_path, launcher):
    """Under torchrun (the tcp backend) the agent checks its workers only every 5 s here, so that it does not
    end the survivors before they report."""
    t0 = time.monotonic()
    if launcher == "torchrun":
        cmd = torchrun_cmd(4, "--monitor-interval", "5") + [str(DIST / "pipe_die.py")]
        env = torchrun_env(ZERO8_PIPE_DIE_OUT=tmp_path)
    else:
        cmd = [mpirun_or_skip(), "-np", "4", "--oversubscribe", sys.executable, str(DIST / "pipe_die.py")]
        env = mpi_env(ZERO8_PIPE_DIE_OUT=tmp_path)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
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
