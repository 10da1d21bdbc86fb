"""Where the engine trains: on the CPU, or on the CUDA device the model is on, which under a launcher must
be this rank's (LOCAL_RANK -> cuda:N, as DeepSpeed's engine places its module); the communicator backend
that goes with it; and the order between the sharded optimizer's CUDA stream (the current stream at
initialize) and the current stream of each later call.
"""

from __future__ import annotations

import contextlib
import os
import socket

import torch

from .. import _C, _tensors
from .._C import Zero8NotSupportedError, Zero8ValueError
from .world import launcher_local_rank, launcher_local_rank_from, launcher_rank_from

_CPU = torch.device("cpu")


def local_device() -> torch.device:
    """This rank's CUDA device: ``cuda:(LOCAL_RANK % visible devices)``, LOCAL_RANK as the launcher set it
    (zero8-launch, mpirun, srun; 0 without one). DeepSpeed's engine uses ``cuda:LOCAL_RANK``; the modulo
    lets several ranks share a GPU (the MPI backend stages their buffers; NCCL needs a GPU per rank and
    picks the same device). Scripts put their model there: ``model.to(zero8.engine.local_device())``."""
    count = torch.cuda.device_count()
    if count == 0:
        raise Zero8NotSupportedError("local_device(): no CUDA device (torch.cuda.device_count() is 0); train on "
                                     "the CPU")
    rank = launcher_local_rank()
    return torch.device("cuda", (rank or 0) % count)


def model_device(model: torch.nn.Module) -> torch.device:
    """The device the engine trains ``model`` on: the one all its parameters are on (the CPU, or a CUDA
    device this rank may use, check_device); parameters on several devices are an error naming two."""
    where: dict[torch.device, str] = {}
    for name, p in model.named_parameters():
        where.setdefault(p.device, name)
    if len(where) > 1:
        (d0, n0), (d1, n1) = list(where.items())[:2]
        raise Zero8NotSupportedError(
            f"the model's parameters are on {len(where)} devices ({n0} on {d0}, {n1} on {d1}): zero8's engine "
            f"trains a model on one device (model.to(device) first)")
    return check_device(next(iter(where), _CPU))


def check_device(device: torch.device) -> torch.device:
    """``device`` if the engine can train there: the CPU, or a CUDA device when zero8 was built with CUDA
    and, under a launcher, the device of this rank's local rank (local_device). Returns it with its index.
    The error for another device names the variable the local rank came from (LOCAL_RANK, SLURM_LOCALID,
    OMPI_COMM_WORLD_LOCAL_RANK, ...), the global rank, the host and CUDA_VISIBLE_DEVICES: what to compare
    with the launcher's placement."""
    device = torch.device(device)
    if device.type == "cpu":
        return _CPU
    if device.type != "cuda":
        raise Zero8NotSupportedError(f"the model is on {device}: zero8's engine trains on the CPU or a CUDA device")
    if not _tensors.CUDA_BUILT:
        raise Zero8NotSupportedError(f"the model is on {device}, but {_tensors._NO_CUDA}; or train on the CPU")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    found = launcher_local_rank_from()
    if found is not None:
        want = local_device()
        if device != want:
            var, local = found
            ranked = launcher_rank_from()
            who = f"rank {ranked[1]} ({ranked[0]})" if ranked is not None else "this rank"
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise Zero8ValueError(
                f"the model is on {device}, but this rank's device is {want} ({var} {local}, "
                f"{torch.cuda.device_count()} visible device(s); {who} on host {socket.gethostname()}, "
                f"CUDA_VISIBLE_DEVICES {'not set' if visible is None else repr(visible)}): put the model on its "
                f"rank's GPU, model.to(zero8.engine.local_device()), as DeepSpeed's engine does")
    return device


def comm_backend(requested: str, device: torch.device) -> str:
    """zero8.comm_backend as written ("auto", "mpi", "single", "nccl", any case) for a model on ``device``:
    "nccl" needs a model on a GPU; "auto" becomes NCCL where world_comm decides so."""
    backend = requested.lower()
    if backend == "nccl" and device.type != "cuda":
        raise Zero8NotSupportedError(
            f'zero8.comm_backend: "nccl" needs a model on a GPU, and this one is on {device}: NCCL takes device '
            f'buffers only; use "auto", "mpi" or "single" for a CPU model, or put the model on its rank\'s GPU '
            f'(model.to(zero8.engine.local_device()))')
    return backend


def check_nccl_device(comm: "_C.Communicator", device: torch.device) -> None:
    """An NCCL communicator works on the GPU it chose at creation (the rank's among the ranks of its node):
    the model must be there."""
    if comm.backend == "nccl" and comm.device != device.index:
        raise Zero8ValueError(
            f"the model is on {device}, but this rank's NCCL communicator works on cuda:{comm.device} (its rank "
            f"among the ranks of its node, modulo the visible devices): put the model there "
            f"(model.to(zero8.engine.local_device())), or use \"comm_backend\": \"mpi\" (\"tcp\" under torchrun), "
            f"which stages device buffers through host memory")


class StreamOrder:
    """The sharded optimizer's CUDA stream (the current stream when the engine was made) against the current
    stream of a call: ``with order():`` makes the optimizer's stream wait for the work queued so far on the
    current stream (backward's gradients), and the current stream wait for the optimizer's work when the
    block ends. Nothing to do where they are the same stream (the usual case) or on the CPU."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def __call__(self):
        return _NO_ORDER if self.stream is None else _Ordered(self.stream)


_NO_ORDER = contextlib.nullcontext()


class _Ordered:
    __slots__ = ("stream", "current")

    def __init__(self, stream):
        self.stream, self.current = stream, None

    def __enter__(self):
        current = torch.cuda.current_stream(self.stream.device)
        if current != self.stream:
            self.stream.wait_stream(current)
            self.current = current

    def __exit__(self, *exc) -> bool:
        if self.current is not None:
            self.current.wait_stream(self.stream)
        return False
