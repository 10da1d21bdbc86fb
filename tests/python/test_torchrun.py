"""Jobs started without MPI, by torchrun (DeepSpeed's launcher sets the same variables): zero8 connects their
ranks with its tcp backend, through torch.distributed's rendezvous store. The training gives the bits of
the same job under mpirun; a rank whose peers never come fails after the communicator timeout naming the
rendezvous; a group that torchrun restarts connects again; the MPI backend says what to use instead.
(The engine's and the pipeline's multi-rank tests under torchrun, a rank dying among them:
test_engine_dist.py, test_pipe_dist.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch

from mpirun_util import (DIST, MPI_LAUNCHER_VARS, ROOT, free_port, mpi_env, mpirun_or_skip, torchrun_cmd,
                         torchrun_env)

pytestmark = pytest.mark.slow  # conftest.py starts such files first


def _run(cmd, env, timeout=240):
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return r, r.stdout + r.stderr


def test_torchrun_gives_the_bits_of_mpirun(tmp_path):
    """The full 8-bit engine (int8 gradients and updates, reductions overlapping backward) on 2 ranks: under
    torchrun over TCP the same losses and weights, bit for bit, as under mpirun over MPI."""
    mpirun = mpirun_or_skip()
    script = str(DIST / "train_digest.py")
    r, out = _run([mpirun, "-np", "2", "--oversubscribe", sys.executable, script, "mpirun"],
                  mpi_env(ZERO8_DIGEST_OUT=tmp_path))
    assert r.returncode == 0, out[-4000:]
    r, out = _run(torchrun_cmd(2) + [script, "torchrun"], torchrun_env(ZERO8_DIGEST_OUT=tmp_path))
    assert r.returncode == 0, out[-4000:]
    mpi, tcp = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("mpirun", "torchrun"))
    assert (mpi["backend"], tcp["backend"], mpi["size"], tcp["size"]) == ("mpi", "tcp", 2, 2)
    assert mpi["replicas_equal"] and tcp["replicas_equal"]
    assert tcp["losses"] == mpi["losses"] and tcp["digest"] == mpi["digest"]
    first, last = sum(tcp["losses"][:5]), sum(tcp["losses"][-5:])
    assert last < 0.8 * first, tcp["losses"]  # it trained


_INIT = ("import torch, zero8\n"
         "zero8.initialize(model=torch.nn.Linear(2, 2), config={'train_batch_size': 2, "
         "'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-3}}, 'zero8': {'comm_backend': '%s'}})\n")


def _one_rank_of_two(tmp_path, rank: int, backend: str = "auto", timeout_s: int = 3, in_config: bool = False):
    """Rank `rank` of a job of 2 as torchrun would start it, whose other rank never comes; its timeout set
    by ZERO8_COMM_TIMEOUT, or by zero8.comm_timeout_s (in_config)."""
    script = tmp_path / "train.py"
    init = _INIT % backend
    if in_config:
        init = init.replace("'comm_backend'", f"'comm_timeout_s': {timeout_s}, 'comm_backend'")
    script.write_text(init)
    env = torchrun_env(WORLD_SIZE=2, RANK=rank, LOCAL_RANK=rank, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    env.pop("ZERO8_COMM_TIMEOUT", None)
    if not in_config:
        env["ZERO8_COMM_TIMEOUT"] = str(timeout_s)
    t0 = time.monotonic()
    r, out = _run([sys.executable, str(script)], env, timeout=120)
    return r, out, time.monotonic() - t0


@pytest.mark.parametrize("rank,in_config", [(0, False), (1, False), (1, True)])
def test_a_rank_whose_peer_never_comes_fails_after_the_timeout(tmp_path, rank, in_config):
    """Rank 0 serves the store on MASTER_PORT and waits for rank 1; rank 1 waits for the store. Either gives
    up after ZERO8_COMM_TIMEOUT, or the config's zero8.comm_timeout_s (3 s here), with a Zero8CommError
    naming the rendezvous."""
    r, out, took = _one_rank_of_two(tmp_path, rank, in_config=in_config)
    assert r.returncode != 0 and "Zero8CommError" in out, out[-3000:]
    assert f"rank {rank} of 2: the rendezvous at 127.0.0.1:" in out and "did not complete within 3 s" in out, \
        out[-3000:]
    assert took < 60, took


def test_the_mpi_backend_under_torchrun_names_what_works(tmp_path):
    r, out, _ = _one_rank_of_two(tmp_path, 1, "mpi")
    assert r.returncode != 0, out[-3000:]
    assert "no MPI launcher started this process" in out and "'tcp'" in out, out[-3000:]


_RESTARTED = """
import os, sys
from pathlib import Path
import torch
from zero8.engine import world_comm
world = world_comm()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
total = world.all_reduce_f64([float(world.rank + 1)], "sum")[0]
if attempt == 0 and world.rank == 1:
    sys.exit(3)  # the whole group restarts
Path(sys.argv[1], f"rank{world.rank}.attempt{attempt}").write_text(f"{world.backend} {world.size} {total}")
"""


def test_a_group_restarted_by_torchrun_connects_again(tmp_path):
    """torchrun --max-restarts 1: rank 1 fails in the first attempt, the agent restarts both workers, and
    the second attempt's world forms from its own addresses (the agent's store keeps the first's)."""
    script = tmp_path / "restarted.py"
    script.write_text(_RESTARTED)
    r, out = _run(torchrun_cmd(2, "--max-restarts", "1", "--monitor-interval", "0.2") + [str(script), str(tmp_path)],
                  torchrun_env(ZERO8_COMM_TIMEOUT=30))
    assert r.returncode == 0, out[-4000:]
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.attempt1").read_text() == "tcp 2 3.0", out[-4000:]


class _FakeComm:
    def __init__(self, backend: str):
        self.backend, self.rank, self.size = backend, 0, 2


@pytest.fixture
def torchrun_world(monkeypatch):
    """world_comm's choice under torchrun (WORLD_SIZE 2, no MPI launcher) on a machine whose GPUs, local
    ranks and NCCL the test sets: returns set_up(gpus, local_ranks, nccl_built) and the tcp_world calls."""
    from zero8.engine import world

    for k in [k for k in os.environ if k.startswith(MPI_LAUNCHER_VARS)]:
        monkeypatch.delenv(k)
    for k in ("LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(world, "_world", {})  # this process's own world stays as it is
    calls = []
    machine = {"shared": False}  # whether the ranks' devices are one GPU, as the real creation finds by UUID

    def fake_tcp_world(nccl=False, timeout_s=None, host_if_gpus_shared=False):
        calls.append(nccl)
        if nccl and machine["shared"] and not host_if_gpus_shared:
            raise zero8.Zero8NotSupportedError("its CUDA device 0 is also the device of rank 1")
        return _FakeComm("nccl" if nccl and not machine["shared"] else "tcp")

    monkeypatch.setattr(world, "tcp_world", fake_tcp_world)

    def set_up(gpus: int, local_ranks: int, nccl_built: bool = True, visible: str | None = None,
               shared: bool = False):
        monkeypatch.setattr(world.torch.cuda, "device_count", lambda: gpus)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
        if visible is not None:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        machine["shared"] = shared
        real = world._C
        fake = type("FakeC", (), {})()
        fake.comm_backend_available = lambda b: nccl_built if b == "nccl" else real.comm_backend_available(b)
        fake.comm_auto_backend = real.comm_auto_backend
        monkeypatch.setattr(world, "_C", fake)
        world._world.clear()
        calls.clear()

    return world, set_up, calls


GPU = torch.device("cuda", 0)


@pytest.mark.parametrize("gpus,local_ranks,nccl_built,visible,shared,backend,device,tried,made,warning", [
    (2, 2, True, None, False, "auto", GPU, True, "nccl", None),  # a GPU per rank: NCCL over tcp
    (1, 2, True, None, True, "auto", GPU, False, "tcp", "2 ranks on this node share 1 GPU(s)"),
    # Each rank sees one GPU (CUDA_VISIBLE_DEVICES per rank): the GPUs' UUIDs decide while NCCL is made
    (1, 2, True, "0", False, "auto", GPU, True, "nccl", None),
    (1, 2, True, "0", True, "auto", GPU, True, "tcp", "ranks share a GPU (each one's device, by UUID)"),
    (2, 2, False, None, False, "auto", GPU, False, "tcp", "built without NCCL"),
    (2, 2, True, None, False, "auto", None, False, "tcp", None),  # a CPU model: tcp, nothing to say
    (2, 2, True, None, False, "tcp", GPU, False, "tcp", '"comm_backend": "tcp" asks for it'),
    (1, 2, True, "0", False, "nccl", GPU, True, "nccl", None),
])
def test_torchrun_world_choice(torchrun_world, gpus, local_ranks, nccl_built, visible, shared, backend, device,
                               tried, made, warning):
    """Under torchrun "auto" makes NCCL over tcp for a GPU model where each local rank has a GPU of its own
    and zero8 has NCCL, else tcp, warning why the device buffers go through host memory. Where each rank sees
    only its own device, whether two of them are one GPU is learnt while making the world (the real
    creation compares the GPUs' UUIDs): "auto" then keeps the tcp world."""
    world, set_up, calls = torchrun_world
    set_up(gpus, local_ranks, nccl_built, visible, shared)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm = world.world_comm(backend, device=device)
    assert calls == [tried] and comm.backend == made
    said = [str(w.message) for w in caught if "zero8" in str(w.message)]
    if warning is None:
        assert said == []
    else:
        assert len(said) == 1 and warning in said[0] and "host memory over TCP" in said[0], said


_NCCL_STEP = """
import os, torch, zero8
from zero8.engine import world_comm
rank = int(os.environ["LOCAL_RANK"])
model = torch.nn.Linear(64, 64).cuda(rank % torch.cuda.device_count())
engine, *_ = zero8.initialize(model=model, config={"train_batch_size": 4, "optimizer": {"type": "AdamW",
    "params": {"lr": 1e-3}}, "zero8": {"comm_backend": "nccl"}})
x = torch.randn(2, 64, device=model.weight.device)
loss = engine(x).square().mean()
engine.backward(loss)
engine.step()
print(f"rank {engine.global_rank}: {world_comm().backend} {world_comm().size} ok", flush=True)
"""


@pytest.mark.cuda
def test_nccl_under_torchrun(tmp_path):
    """On a GPU machine: "comm_backend": "nccl" under torchrun on 2 ranks bootstraps NCCL over tcp and steps
    where each rank has a GPU; where the two share one, every rank fails at creation naming the other rank,
    the GPU and the way out (the tcp backend), not NCCL's own "duplicate GPU" error."""
    import zero8

    if not torch.cuda.is_available() or not zero8.build_info()["nccl"]:
        pytest.skip("needs a GPU and a zero8 built with NCCL")
    script = tmp_path / "step.py"
    script.write_text(_NCCL_STEP)
    r, out = _run(torchrun_cmd(2) + [str(script)], torchrun_env(ZERO8_COMM_TIMEOUT=60))
    if torch.cuda.device_count() >= 2:
        assert r.returncode == 0, out[-4000:]
        assert "rank 0: nccl 2 ok" in out and "rank 1: nccl 2 ok" in out, out[-4000:]
    else:
        assert r.returncode != 0, out[-4000:]
        assert ") is also the device of rank " in out and "and NCCL needs a GPU per rank" in out, out[-4000:]
        assert "use the 'tcp' backend" in out, out[-4000:]
