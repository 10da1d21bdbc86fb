"""Runs a pytest file of tests/python/dist/ on several ranks under mpirun (or torchrun), as real processes, and
checks that every rank ran the same tests and passed them all (used by test_engine_dist.py,
test_engine_cuda.py, test_pipe_dist.py, test_optim_fsdp2.py and test_ddp_int8.py). Each rank writes its
outcome to $ZERO8_DIST_RESULTS/rank<R>.txt (dist/conftest.py), which is read instead of the ranks'
interleaved output.

The ranks share this machine's cores (--oversubscribe) with one kernel thread each, and a communicator
timeout turns a rank that failed and skipped a collective into an error on the others instead of a wait.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import zero8

ROOT = Path(__file__).resolve().parents[2]
DIST = Path(__file__).resolve().parent / "dist"


def mpirun_or_skip() -> str:
    """mpirun's path; the calling test skips, with the reason, where there is no multi-rank backend."""
    import pytest  # here, not at the top: soak_kill_resume.py, also a script, imports mpi_env
    if not zero8.build_info()["mpi"]:
        pytest.skip("zero8 was built without MPI: no multi-rank backend")
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        pytest.skip("mpirun not found (scripts/setup.sh installs OpenMPI)")
    return mpirun


def mpi_env(**extra) -> dict:
    """The environment of a job: OpenMPI allowed as root and oversubscribed, one passive kernel thread per
    rank, a 60 s communicator timeout; extra (values made str) added or replacing."""
    env = dict(os.environ)
    env.update({
        "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive",
        "ZERO8_COMM_TIMEOUT": "60",
    })
    env.update({k: str(v) for k, v in extra.items()})
    return env


def free_port() -> int:
    """A TCP port of 127.0.0.1 that is free now (for a launcher's --master_port or MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What marks a process as started by an MPI launcher (zero8's comm_auto_backend reads these).
MPI_LAUNCHER_VARS = ("OMPI_COMM_WORLD", "PMI_", "PMIX_")


def torchrun_env(**extra) -> dict:
    """mpi_env(**extra) without what marks a process as started by an MPI launcher (as under torchrun, whose
    workers zero8 connects with its tcp backend)."""
    return {k: v for k, v in mpi_env(**extra).items() if not k.startswith(MPI_LAUNCHER_VARS)}


def torchrun_cmd(np: int, *options: str) -> list[str]:
    """torchrun on this machine with np workers, its rendezvous on a free local port (--standalone), and
    its other options before the script's."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(np), *options]


def pytest_under_launcher(np: int, script: str, results: Path, timeout: float = 300, launcher: str = "mpirun",
                        select: str | None = None, **env) -> int:
    """Runs dist/<script> on np ranks (its tests matching pytest's `-k select`, if given), under `mpirun -np np`
    with mpi_env(**env) (or, with launcher="torchrun", under torchrun with torchrun_env(**env)) and
    ZERO8_DIST_RESULTS=results; fails the test unless the job exits 0 and every rank collected the same tests
    and passed them. Returns how many tests each rank collected (selected)."""
    import pytest

    results.mkdir(parents=True, exist_ok=True)
    # Not the pytest plugins of other packages (hypothesis' alone takes 0.8 s to import, in every rank).
    pytest_args = ["-m", "pytest", "-q", "--color=no", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
                   "-p", "no:anyio", "-W", "ignore::zero8.config.Zero8ConfigWarning", str(DIST / script)] \
        + (["-k", select] if select else [])
    if launcher == "torchrun":
        cmd = torchrun_cmd(np) + pytest_args  # torchrun's own -m: run pytest as a module
        job_env = torchrun_env(ZERO8_DIST_RESULTS=results, **env)
    else:
        cmd = [mpirun_or_skip(), "-np", str(np), "--oversubscribe", sys.executable] + pytest_args
        job_env = mpi_env(ZERO8_DIST_RESULTS=results, **env)
    what = f"{launcher} -np {np} {script}"
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=job_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"{what} did not finish in {timeout:g} s:\n{out[-4000:]}")
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{what} exited with {r.returncode}:\n{out[-6000:]}"
    outcomes = {}
    for rank in range(np):
        f = results / f"rank{rank}.txt"
        assert f.is_file(), f"{what}: rank {rank} left no result:\n{out[-6000:]}"
        outcomes[rank] = tuple(int(v) for v in f.read_text().split())  # exit status, collected, failed
    assert all(o == (0, outcomes[0][1], 0) for o in outcomes.values()), (outcomes, out[-6000:])
    return outcomes[0][1]


def init_torch_world(device_var: str) -> tuple[str, int, int]:
    """For a dist/ file run under torchrun on torch.distributed itself (FSDP2, DDP): the device $device_var names
    ("cpu" by default; "cuda": this local rank's GPU, ranks past the GPUs sharing them), the default process
    group made on it (gloo or NCCL; $ZERO8_TORCH_BACKEND: another, such as gloo for ranks sharing a GPU, which
    NCCL refuses), one intra-op thread per rank; returns (device, rank, world size)."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    device = os.environ.get(device_var, "cpu")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group(os.environ.get("ZERO8_TORCH_BACKEND") or ("nccl" if device == "cuda" else "gloo"))
    return device, dist.get_rank(), dist.get_world_size()
