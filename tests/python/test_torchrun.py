"""Jobs started without MPI, by torchrun (DeepSpeed's launcher sets the same variables): zero8 connects their
ranks with its tcp backend, through torch.distributed's rendezvous store. The training gives the bits of
the same job under mpirun; a rank whose peers never come fails after the communicator timeout naming the
rendezvous; a group that torchrun restarts connects again; the MPI backend says what to use instead.
(The engine's and the pipeline's multi-rank tests under torchrun, a rank dying among them:
test_engine_dist.py, test_pipe_dist.py.)
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
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


def test_a_taken_master_port_is_named_as_such(tmp_path):
    """Rank 0 serves the store on MASTER_PORT; where another process holds that port, it fails at once
    saying the port is in use and to choose another, not that the rendezvous timed out."""
    script = tmp_path / "train.py"
    script.write_text(_INIT % "auto")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = torchrun_env(WORLD_SIZE=2, RANK=0, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                           ZERO8_COMM_TIMEOUT=30)
        r, out = _run([sys.executable, str(script)], env, timeout=120)
    assert r.returncode != 0 and "Zero8CommError" in out, out[-3000:]
    assert (f"the rendezvous cannot serve its store on 127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT): port {port} is "
            f"in use, by another job or process; choose another MASTER_PORT") in out, out[-3000:]
    assert "did not complete within" not in out, out[-3000:]


_WORLD = """
import os
from zero8.engine import world_comm
w = world_comm()
print(f"rank {os.environ.get('RANK')}: {w.backend} {w.rank} {w.size}", flush=True)
"""


def test_torchrun_under_mpirun_makes_torchruns_world(tmp_path):
    """`mpirun -np 1 torchrun --nproc_per_node 2` (as `srun --mpi=pmix torchrun`): the workers inherit
    mpirun's variables, but TORCHELASTIC_RUN_ID (and their RANK/WORLD_SIZE) say their world is torchrun's:
    the tcp world of 2, not MPI (whose MPI_Init failed there)."""
    mpirun = mpirun_or_skip()
    script = tmp_path / "world.py"
    script.write_text(_WORLD)
    r, out = _run([mpirun, "-np", "1", *torchrun_cmd(2), str(script)], mpi_env(ZERO8_COMM_TIMEOUT=30))
    assert r.returncode == 0, out[-4000:]
    assert "rank 0: tcp 0 2" in out and "rank 1: tcp 1 2" in out, out[-4000:]


@pytest.mark.parametrize("env,launched", [
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "x", "RANK": "0"}, 4),
    ({"PMIX_RANK": "0", "SLURM_STEP_NUM_TASKS": "2", "RANK": "5"}, 4),  # srun --mpi=pmix, DeepSpeed's launcher
    ({"PMI_RANK": "1", "PMI_SIZE": "4", "RANK": "1"}, 0),  # zero8-launch: its rank, an MPI job
])
def test_mpi_launchers_variables_with_another_world(monkeypatch, env, launched):
    """env_launched_size (the tcp world's size where "auto" makes one): a process whose RANK/WORLD_SIZE are not
    its MPI launcher's, or that torchrun started, is in the launcher-without-MPI world of WORLD_SIZE."""
    from zero8.engine import world

    for k in [k for k in os.environ if k.startswith(MPI_LAUNCHER_VARS + ("SLURM_", "TORCHELASTIC"))]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("WORLD_SIZE", "4")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert world.env_launched_size() == launched


def test_srun_tasks_without_pmi_are_refused(tmp_path):
    """`srun -n 4 python train.py` where srun starts no PMI (MpiDefault=none): SLURM_PROCID and the step's task
    count, no WORLD_SIZE. "auto" refuses to make a world of one on every task, naming the ways out."""
    script = tmp_path / "train.py"
    script.write_text(_INIT % "auto")
    env = {k: v for k, v in torchrun_env().items() if not k.startswith(("SLURM_", "TORCHELASTIC"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(SLURM_PROCID="1", SLURM_STEP_NUM_TASKS="4", SLURM_NTASKS="4", SLURM_LOCALID="1")
    r, out = _run([sys.executable, str(script)], env, timeout=120)
    assert r.returncode != 0, out[-3000:]
    for part in ("srun started this process as task 1 of 4 (SLURM_PROCID, SLURM_STEP_NUM_TASKS) without PMI",
                 "srun --mpi=pmix", "torchrun under srun", "zero8-launch --launcher slurm",
                 '"comm_backend": "single"'):
        assert part in out, out[-3000:]
    env["SLURM_STEP_NUM_TASKS"] = "1"  # a batch script's own python: a step of one task
    r, out = _run([sys.executable, str(script)], env, timeout=120)
    assert r.returncode == 0, out[-3000:]


@pytest.mark.parametrize("local_size,spans", [("1", True), ("2", False)])
def test_loopback_master_addr_of_a_job_across_hosts(monkeypatch, tmp_path, local_size, spans):
    """`--master_addr $(hostname)` where the host name is 127.0.1.1 (Debian), or localhost: the route to
    MASTER_ADDR is loopback. On a job that spans hosts (WORLD_SIZE above the local size) the rank listens on
    its default route's interface instead (read from the routing table), saying so; on one host it keeps the
    backend's default. Nothing is connected: the rendezvous and the world are stand-ins."""
    import torch.distributed as dist
    from zero8.engine import world
    from zero8_launch import netinfo

    route = tmp_path / "route"
    route.write_text("Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
                     "eth9\t0009090A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n"
                     "eth9\t00000000\t0109090A\t0003\t0\t0\t0\t00000000\t0\t0\t0\n")
    monkeypatch.setattr(netinfo, "ROUTE_FILE", str(route))
    monkeypatch.setattr(netinfo, "local_ipv4", lambda: {"lo": ipaddress.IPv4Interface("127.0.0.1/8"),
                                                         "eth9": ipaddress.IPv4Interface("10.9.9.9/24")})
    for k in ("LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("ZERO8_COMM_IFADDR", "")
    monkeypatch.delenv("ZERO8_COMM_IFADDR")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    for k, v in dict(RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE=local_size, MASTER_ADDR="localhost",
                     MASTER_PORT="29999").items():
        monkeypatch.setenv(k, v)

    def rendezvous(*_args, **_kw):
        yield dist.HashStore(), 0, 2

    made = {}

    class FakeC:
        Zero8CommError = world._C.Zero8CommError

        @staticmethod
        def comm_create(_backend):
            return type("Single", (), {"timeout": 5.0})()

        @staticmethod
        def comm_create_tcp(rank, size, exchange, nccl=False, host_if_gpus_shared=False):
            made["ifaddr"] = os.environ.get("ZERO8_COMM_IFADDR")
            return "world"

    monkeypatch.setattr(dist, "rendezvous", rendezvous)
    monkeypatch.setattr(world, "_C", FakeC)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert world.tcp_world() == "world"
    said = [str(w.message) for w in caught if "zero8" in str(w.message)]
    if spans:
        assert made["ifaddr"] == "10.9.9.9"
        assert said == ["zero8: rank 0: MASTER_ADDR localhost is reached over loopback on this host, and the job "
                        "spans hosts (2 ranks, 1 here): listening on 10.9.9.9, the address of eth9, the interface "
                        "of the default route; set ZERO8_COMM_IFADDR to this host's address on the network the "
                        "hosts share to choose it"], said
    else:
        assert made["ifaddr"] is None and said == []


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
