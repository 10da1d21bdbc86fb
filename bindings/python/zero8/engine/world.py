"""The process's world communicator, one per process and kept for its lifetime (the MPI backend finalizes
MPI when its last communicator is destroyed, after which no new one can be made), the live engines that
exit releases before it, and the local rank the launchers set.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
import weakref
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


def world_comm(backend: str = "auto", device=None) -> "_C.Communicator":
    """The process's world communicator ('auto': MPI under mpirun, single-process otherwise; for a model on
    a CUDA ``device``, NCCL instead of MPI where nccl_by_default), created on first use. Asking later for
    another backend than the one made is an error; 'auto' takes the one made, whichever it is."""
    with _world_lock:
        comm = _world.get("comm")
        if comm is None:
            made = backend
            if backend == "auto" and getattr(device, "type", None) == "cuda" and nccl_by_default():
                made = "nccl"
            comm = _C.comm_create(made)
            _world["comm"] = comm
            atexit.register(_shutdown)
            _world["backend"] = backend
        elif backend not in ("auto", comm.backend):
            raise Zero8ValueError(
                f"zero8.comm_backend: '{backend}' requested, but this process already uses the "
                f"'{comm.backend}' world communicator"
            )
        return comm


def nccl_by_default() -> bool:
    """Whether 'auto' means NCCL for a model on a GPU: the launcher started several processes, zero8 has
    NCCL (``_C.comm_auto_backend("device")``), and each process of this node can have a GPU of its own
    (NCCL refuses two ranks on one; over MPI they may share it)."""
    if _C.comm_auto_backend("device") != "nccl":
        return False
    size = launcher_local_size()
    return size is None or size <= torch.cuda.device_count()


def launcher_local_size() -> int | None:
    """The number of processes on this node, as the launcher set it; None when none did."""
    for var in ("LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"):
        v = os.environ.get(var, "").strip()
        if v.isdigit() and int(v) > 0:
            return int(v)
    return None


def launcher_local_rank() -> int | None:
    """This process's rank on its node, as the launcher (zero8-launch, mpirun, srun) set it; None when none did."""
    for var in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"):
        v = os.environ.get(var)
        if v is not None and v.strip().lstrip("-").isdigit():
            return int(v)
    return None


def local_rank() -> int:
    """This process's rank on its node, as the launcher (zero8-launch, mpirun, srun) set it; 0 when none did."""
    rank = launcher_local_rank()
    return 0 if rank is None else rank
