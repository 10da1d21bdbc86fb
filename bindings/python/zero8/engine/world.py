"""The process's world communicator, one per process and kept for its lifetime (the MPI backend finalizes
MPI when its last communicator is destroyed, after which no new one can be made), the live engines that
exit releases before it, and the local rank the launchers set.
"""

from __future__ import annotations

import atexit
import errno
import gc
import os
import sys
import threading
import warnings
import weakref
from datetime import timedelta
from typing import Any

import torch

from .. import _C
from .._C import Zero8ValueError

_world_lock = threading.Lock()
_world: dict[str, Any] = {}
# The live engines (Zero8Engine registers itself), released at exit before the communicator.
engines: weakref.WeakSet = weakref.WeakSet()


def _shutdown() -> None:
    """At exit: release every engine (its parameters get their own memory, so nothing references the C++
    buffers), then the world communicator, so the last communicator is destroyed while the interpreter is
    whole and MPI is finalized (otherwise mpirun reports the ranks as exiting improperly).

    A rank that exits on an uncaught exception (Python has printed it and set sys.last_value) ends the
    whole job instead: its peers may be waiting for it in a collective, and a normal exit would leave
    them there until the communicator timeout (600 s by default). A Zero8CommError is the exception: its
    world has already failed, and every rank reports its own view of that failure."""
    comm = _world.get("comm")
    exc = getattr(sys, "last_value", None)
    if comm is not None and comm.size > 1 and exc is not None and not isinstance(exc, _C.Zero8CommError):
        print(f"[zero8] rank {comm.rank}: exiting on an uncaught {type(exc).__name__}; ending the job so that "
              f"the other ranks do not wait for it", file=sys.stderr, flush=True)
        comm.abort(1)
    for engine in list(engines):
        engine.destroy()
    _world.clear()
    gc.collect()


def world_comm(backend: str = "auto", device=None, timeout_s: float | None = None) -> "_C.Communicator":
    """The process's world communicator, created on first use. 'auto': under an MPI launcher (mpirun,
    zero8-launch, srun) MPI, and for a model on a CUDA ``device`` NCCL instead where nccl_by_default; under a
    launcher without MPI (torchrun, DeepSpeed's launcher) TCP (tcp_world), with NCCL bootstrapped over it for
    a model on a GPU where nccl_by_default; else a single process. 'nccl' by name under such a launcher is
    NCCL over TCP too. ``timeout_s`` bounds the TCP rendezvous (zero8.comm_timeout_s; default the
    communicator timeout, ZERO8_COMM_TIMEOUT or 600 s). Asking later for another backend than the one made
    is an error; 'auto' takes the one made, whichever it is."""
    with _world_lock:
        comm = _world.get("comm")
        if comm is None:
            cuda = getattr(device, "type", None) == "cuda"
            launched = env_launched_size() > 1
            made = backend
            if backend == "auto" and cuda and nccl_by_default():
                made = "nccl"
            elif backend == "auto" and launched:
                made = "tcp"
            # "auto" takes NCCL only where no two ranks' devices are one GPU, which the ranks learn together
            # from the GPUs' UUIDs while making it; else every rank keeps the host world it bootstraps over.
            shared_ok = backend == "auto" and made == "nccl"
            if launched and made in ("tcp", "nccl"):
                comm = tcp_world(nccl=made == "nccl", timeout_s=timeout_s, host_if_gpus_shared=shared_ok)
            elif shared_ok:
                comm = _C.comm_create(made, host_if_gpus_shared=True)
            else:
                comm = _C.comm_create(made)
            if comm.backend in ("tcp", "mpi") and cuda and comm.size > 1 and comm.rank == 0:
                why = why_not_nccl()
                if not why and shared_ok:  # NCCL was tried: the ranks' UUIDs showed a shared GPU
                    why = "ranks share a GPU (each one's device, by UUID), and NCCL needs a GPU per rank"
                elif not why:
                    why = f'"comm_backend": "{backend}" asks for it ("auto" makes NCCL where each rank has a GPU)'
                warnings.warn(f"zero8: the model's device buffers go through host memory over "
                              f"{comm.backend.upper()}, not NCCL: {why}", stacklevel=3)
            _world["comm"] = comm
            atexit.register(_shutdown)
            _world["backend"] = backend
        elif backend not in ("auto", comm.backend):
            raise Zero8ValueError(
                f"zero8.comm_backend: '{backend}' requested, but this process already uses the "
                f"'{comm.backend}' world communicator"
            )
        return comm


def env_launched_size() -> int:
    """WORLD_SIZE where a launcher without MPI started this process (torchrun and DeepSpeed's launcher set
    RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT); 0 where an MPI launcher started it or none did."""
    if _C.comm_auto_backend("host") != "single":
        return 0
    size = os.environ.get("WORLD_SIZE", "").strip()
    return int(size) if size.isdigit() else 0


def tcp_world(nccl: bool = False, timeout_s: float | None = None, host_if_gpus_shared: bool = False
              ) -> "_C.Communicator":
    """The 'tcp' world: every pair of ranks connected over TCP (each listening on ZERO8_COMM_IFADDR, else the
    address of its route to MASTER_ADDR, else the backend's default), their addresses exchanged through
    torch.distributed's store: the default process group's where the script made one
    (``torch.distributed.init_process_group``), else the one ``env://`` names (MASTER_ADDR:MASTER_PORT;
    under torchrun its agent's). No process group is made. Waits for the other ranks ``timeout_s``, by
    default as long as a collective may (ZERO8_COMM_TIMEOUT, default 600 s). ``nccl``: the 'nccl' world
    bootstrapped over it (rank 0's NCCL id, splits and barriers go over TCP, and its connections watch the
    peers while NCCL calls wait); with ``host_if_gpus_shared``, the tcp world itself where ranks share a GPU."""
    import torch.distributed as dist

    env = {k: os.environ.get(k, "").strip() for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    missing = [k for k, v in env.items() if not v]
    if missing:
        raise Zero8ValueError(
            f"zero8.comm_backend 'tcp': {', '.join(missing)} not set; the tcp backend is for jobs that torchrun "
            f"or DeepSpeed's launcher starts (they set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT); under "
            f"mpirun or zero8-launch use 'auto'")
    rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
    # What a new communicator gets (ZERO8_COMM_TIMEOUT, parsed in C++ only), unless the config says.
    timeout = timeout_s if timeout_s is not None else _C.comm_create("single").timeout
    if not os.environ.get("ZERO8_COMM_IFADDR"):
        addr = _comm_ifaddr(rank, size, env["MASTER_ADDR"])
        if addr is not None:
            os.environ["ZERO8_COMM_IFADDR"] = addr
    if dist.is_available() and dist.is_initialized():
        store = dist.distributed_c10d._get_default_store()
    else:
        where = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
        rendezvous = dist.rendezvous("env://", rank=rank, world_size=size, timeout=timedelta(seconds=timeout))
        try:
            store = next(rendezvous)[0]
        except (RuntimeError, ValueError) as e:  # torch's DistStoreError is a RuntimeError
            if _address_in_use(e):
                raise _C.Zero8CommError(
                    f"zero8: rank {rank} of {size}: the rendezvous cannot serve its store on {where} (MASTER_ADDR:"
                    f"MASTER_PORT): port {env['MASTER_PORT']} is in use, by another job or process; choose another "
                    f"MASTER_PORT (the launcher's --master_port): {e}") from e
            raise _C.Zero8CommError(f"zero8: rank {rank} of {size}: the rendezvous at {where} (MASTER_ADDR:"
                                    f"MASTER_PORT) did not complete within {timeout:g} s: {e}") from e
        finally:
            rendezvous.close()
    # torchrun's agent keeps its store across the restarts of its workers (--max-restarts): each attempt
    # has keys of its own, so a restarted rank never reads the addresses of the previous attempt.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"zero8/world/{attempt}/", store)

    def exchange(mine: str) -> list[str]:
        store.set(str(rank), mine)
        try:
            return [store.get(str(r)).decode() for r in range(size)]
        except RuntimeError as e:
            raise _C.Zero8CommError(f"zero8: rank {rank} of {size}: not every rank published its address in the "
                                    f"rendezvous store within {timeout:g} s ({e})") from e

    # Every peer connects to rank 0 only after its own exchange, so once this returns no rank reads the
    # store any more, and rank 0 may drop it (DeepSpeed's launcher has rank 0 serve it on MASTER_PORT,
    # where the script may start its own process group later).
    return _C.comm_create_tcp(rank, size, exchange, nccl=nccl, host_if_gpus_shared=host_if_gpus_shared)


def _comm_ifaddr(rank: int, size: int, master_addr: str) -> str | None:
    """The address this rank's tcp world listens on, where ZERO8_COMM_IFADDR does not say: the source address
    of its route to MASTER_ADDR (the backend's default, the host name's address, is loopback on many machines:
    127.0.1.1 on Debian). Where that route is loopback too (MASTER_ADDR is this host's name, or localhost) but
    the job spans hosts (WORLD_SIZE above the launcher's local size), the other hosts could not reach a
    loopback address: the address of the default route's interface instead, said in a warning; None keeps
    the backend's default."""
    from zero8_launch.netinfo import default_route_ifaddr, pick_comm_ifaddr

    addr, _ = pick_comm_ifaddr("", None, master_addr)
    local = launcher_local_size()
    if addr is not None or local is None or size <= local:
        return addr
    addr, why = default_route_ifaddr()
    said = (f"listening on {addr}, {why}" if addr is not None
            else f"{why}, so it listens on loopback and the other hosts' ranks will fail to connect")
    warnings.warn(f"zero8: rank {rank}: MASTER_ADDR {master_addr} is reached over loopback on this host, and the "
                  f"job spans hosts ({size} ranks, {local} here): {said}; set ZERO8_COMM_IFADDR to this host's "
                  f"address on the network the hosts share to choose it", stacklevel=4)
    return addr


def _address_in_use(e: BaseException) -> bool:
    """Whether a failed rendezvous is rank 0's store finding MASTER_PORT taken (torch's DistNetworkError says
    EADDRINUSE; older releases errno 98)."""
    text = str(e).lower()
    return (getattr(e, "errno", None) == errno.EADDRINUSE or "eaddrinuse" in text
            or "address already in use" in text)


def nccl_by_default() -> bool:
    """Whether 'auto' means NCCL for a model on a GPU: several processes (an MPI launcher's, or torchrun's and
    DeepSpeed's launcher's, whose NCCL is bootstrapped over TCP), zero8 has NCCL, and each process of this
    node can have a GPU of its own (NCCL refuses two ranks on one; over MPI or TCP they may share it)."""
    return not why_not_nccl()


def why_not_nccl() -> str:
    """Why 'auto' does not mean NCCL for a model on a GPU ("" where it does)."""
    if not _C.comm_backend_available("nccl"):
        return "zero8 was built without NCCL"
    if env_launched_size() <= 1 and _C.comm_auto_backend("device") != "nccl":
        return "one process, or a launcher that started none"
    size = launcher_local_size()
    # Sharing is certain only where every rank sees every GPU of its node; with CUDA_VISIBLE_DEVICES each
    # may see a GPU of its own as device 0 (srun --gpus-per-task), and making the world tells (by UUID).
    if size is not None and size > torch.cuda.device_count() and not os.environ.get("CUDA_VISIBLE_DEVICES"):
        return (f"{size} ranks on this node share {torch.cuda.device_count()} GPU(s), and NCCL needs a GPU per "
                f"rank")
    return ""


def launcher_local_size() -> int | None:
    """The number of processes on this node, as the launcher set it; None when none did."""
    for var in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                "SLURM_NTASKS_PER_NODE"):
        v = os.environ.get(var, "").strip()
        if v.isdigit() and int(v) > 0:
            return int(v)
    return None


def _first_int(names) -> tuple[str, int] | None:
    for var in names:
        v = os.environ.get(var)
        if v is not None and v.strip().lstrip("-").isdigit():
            return var, int(v)
    return None


def launcher_local_rank_from() -> tuple[str, int] | None:
    """(variable, value): this process's rank on its node and the launcher variable it came from (LOCAL_RANK
    of zero8-launch, torchrun and DeepSpeed's launcher, else mpirun's, MPICH's or srun's own); None when none
    is set."""
    return _first_int(("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"))


def launcher_rank_from() -> tuple[str, int] | None:
    """(variable, value): this process's global rank as a launcher set it, for messages; None when none did."""
    return _first_int(("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"))


def launcher_local_rank() -> int | None:
    """This process's rank on its node, as the launcher (zero8-launch, mpirun, srun) set it; None when none did."""
    found = launcher_local_rank_from()
    return None if found is None else found[1]


def local_rank() -> int:
    """This process's rank on its node, as the launcher (zero8-launch, mpirun, srun) set it; 0 when none did."""
    rank = launcher_local_rank()
    return 0 if rank is None else rank
