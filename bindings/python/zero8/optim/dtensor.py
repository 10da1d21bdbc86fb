"""zero8.optim's optimizers on DTensor parameters: FSDP2's ``fully_shard`` (and tensor parallelism's
``Shard``/``Replicate`` placements).

Each rank steps its local shard (``p._local_tensor`` with ``p.grad._local_tensor``) with the same fused kernel
as a plain parameter, and keeps the states as DTensors with the parameter's mesh and placements, so that
``torch.distributed.checkpoint`` saves them sharded and loads them at another world size, as it does
torch.optim's.

The 8-bit layout must not depend on how the parameter is cut, or a checkpoint could not be resharded: the
blocks lie on the parameter's last dimension, block b of row r covering elements ``[b*B, (b+1)*B)`` of the
row, and the block scales form a tensor of shape ``p.shape[:-1] + (p.shape[-1] // B,)`` with the
parameter's placements. So a parameter gets 8-bit states when, besides ``optim_bits=8`` and
``min_8bit_size``, it has at least two dimensions and its last one is a multiple of ``block_size`` (any
shard along the other dimensions then starts on a block boundary, and its blocks are the whole parameter's
in flat order: gathered, the states are exactly those a plain zero8 optimizer keeps for the whole tensor).
Other parameters keep 32-bit states (a warning names those that asked for 8-bit). A shard along the last
dimension must hold whole blocks: each mesh dimension sharding it must leave ``ceil(L / n)`` a multiple of
B, else the step names the parameter.

State of a DTensor parameter: as a plain parameter's (``optimizer.py``), with ``state1``/``state2``,
``absmax1``/``absmax2`` and ``master`` as DTensors, and ``zero8_block`` (int: the block of its 8-bit
states, 0 for 32-bit ones), by which a load recognises 8-bit codes that ``torch.distributed.checkpoint``
copied into a 32-bit state of another run's layout.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

from .._C import Zero8NotSupportedError, Zero8ValueError
from .._tensors import is_dtensor

__all__ = ["BLOCK_KEY", "absmax_shape", "check_grid", "check_placements", "eight_bit_fits", "grid_error", "local",
           "local_of", "wrap"]

BLOCK_KEY = "zero8_block"


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of DTensor t, itself (not a view through autograd: the optimizer writes into it)."""
    return t._local_tensor


def eight_bit_fits(p: torch.Tensor, block: int) -> bool:
    """Whether DTensor parameter p can keep 8-bit states whose layout no resharding changes: at least two
    dimensions, the last a multiple of the block."""
    return p.dim() >= 2 and p.shape[-1] % block == 0


def absmax_shape(shape: Sequence[int], block: int) -> Tuple[int, ...]:
    """The block scales' shape for 8-bit states of a tensor of `shape` (eight_bit_fits)."""
    return tuple(shape[:-1]) + (shape[-1] // block,)


def _contiguous_stride(shape: Sequence[int]) -> Tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))


def check_placements(p: torch.Tensor, name: str) -> None:
    """Shard and Replicate placements only (a parameter is never Partial; anything else is refused by name)."""
    from torch.distributed.tensor import Replicate, Shard
    for i, pl in enumerate(p.placements):
        if not isinstance(pl, (Shard, Replicate)):
            raise Zero8NotSupportedError(f"{name} is a DTensor with placement {pl} on mesh dimension {i}; zero8.optim "
                                         f"steps Shard and Replicate placements (FSDP2's and tensor parallelism's)")


def grid_error(p: torch.Tensor, block: int, name: str) -> Optional[Exception]:
    """Why 8-bit states in blocks of `block` cannot lie on DTensor p's shards along its last dimension (see the
    module docstring), as the exception to raise; None when they can."""
    from torch.distributed.tensor import Shard
    last = p.dim() - 1
    cuts = [i for i, pl in enumerate(p.placements) if isinstance(pl, Shard) and pl.dim % p.dim() == last]
    length = p.shape[-1]
    if len(cuts) > 1:
        return Zero8NotSupportedError(f"{name} (shape {tuple(p.shape)}) is sharded along its last dimension by "
                                      f"{len(cuts)} mesh dimensions; 8-bit states allow one: keep its states 32-bit "
                                      f"(optimizer.override_config(param, optim_bits=32))")
    for i in cuts:
        chunk = math.ceil(length / p.device_mesh.size(i))
        if chunk % block:
            return Zero8ValueError(f"{name} (shape {tuple(p.shape)}, placements {tuple(p.placements)}) is cut along "
                                   f"its last dimension into shards of {chunk} elements, not a multiple of the 8-bit "
                                   f"state block {block}: the blocks would straddle ranks. Choose a block_size "
                                   f"dividing {chunk}, or keep its states 32-bit (optimizer.override_config(param, "
                                   f"optim_bits=32))")
    return None


def check_grid(p: torch.Tensor, block: int, name: str) -> None:
    """For 8-bit states: every shard along the last dimension holds whole blocks (grid_error)."""
    err = grid_error(p, block, name)
    if err is not None:
        raise err


def wrap(t: torch.Tensor, p: torch.Tensor, shape: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Local tensor t as the local shard of a DTensor with p's mesh and placements and global `shape` (p's
    by default)."""
    from torch.distributed.tensor import DTensor
    shape = tuple(p.shape) if shape is None else tuple(shape)
    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=torch.Size(shape),
                              stride=_contiguous_stride(shape))


def local_of(v: torch.Tensor, p: torch.Tensor, shape: Sequence[int], where: str) -> torch.Tensor:
    """This rank's part of saved tensor v laid out as a tensor of global `shape` with p's placements: a DTensor
    is redistributed to them (on p's mesh), a plain tensor (a full state dict) is cut locally, without
    communication. A contiguous copy on p's device."""
    shape = tuple(shape)
    dev = local(p).device
    if is_dtensor(v):
        if v.device_mesh != p.device_mesh:
            raise Zero8ValueError(f"{where} is a DTensor on another device mesh ({v.device_mesh}) than its parameter "
                                  f"({p.device_mesh})")
        if tuple(v.shape) == shape:
            if tuple(v.placements) != tuple(p.placements):
                v = v.redistribute(p.device_mesh, p.placements)
            return local(v).detach().to(dev).contiguous().clone()
        # Another shape of the same elements (set_optimizer_state_dict's full state dicts shard a flat tensor of
        # block scales as they come): gathered, then cut as a whole tensor (every rank loads the same parameters
        # in the same order, so the gathers match).
        v = v.full_tensor()
    from torch.distributed.tensor import distribute_tensor
    if v.numel() != math.prod(shape):
        raise Zero8ValueError(f"{where} has {v.numel()} elements; this optimizer's layout is {shape}")
    full = v.detach().reshape(shape).to(dev)
    part = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
    return local(part).contiguous().clone()
