"""The int8 exchanges of zero8.fsdp and zero8.ddp over torch.distributed: pieces of a tensor encoded with zero8's
block-wise codec (the dynamic signed map, one float32 scale per block: the engine's wire format), moved as codes
and scales, decoded and summed in float32 in rank order, so that every rank computes the same sums.

Over gloo an exchange returns only once gloo's worker threads hold none of the tensors it handed them. A worker
drops its reference to a finished collective's tensors a moment after the caller's wait has returned; were that
the last reference, the tensor's Python object would be freed on that thread, which needs the GIL, and a process
whose interpreter is exiting by then aborts ("terminate called without an active exception"): the last exchange
of a job's last step is followed by nothing else that takes long enough.
"""

from __future__ import annotations

import time
import weakref
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _C
from ._C import Zero8ValueError
from .functional import _dequantize_rows_into, _quantize_rows_into

BLOCK = 2048  # the engine's default wire block (zero8.wire_block_size)
_MAP = _C.MapKind.dynamic_signed  # functional.quantize_blockwise's default map: the same codes


def check_block(block_size, who: str) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 64 <= block_size <= 4096 \
            or block_size & (block_size - 1):
        raise Zero8ValueError(f"{who}: block_size must be a power of two in 64..4096, got {block_size!r}")
    return block_size


def piece_bytes(numel: int, block: int) -> int:
    """Bytes of one piece of `numel` elements on the wire: its codes and its blocks' scales."""
    return numel + 4 * -(-numel // block)


def _encode(pieces: torch.Tensor, block: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8, pieces' shape) and scales (float32, one row per piece) of the rows of `pieces` (contiguous),
    each in blocks of its own (a piece need not hold whole blocks): one call of the codec for all of them."""
    n, size = pieces.shape
    codes = torch.empty(n, size, dtype=torch.uint8, device=pieces.device)
    scales = torch.empty(n, -(-size // block), dtype=torch.float32, device=pieces.device)
    _quantize_rows_into(pieces, _MAP, block, codes.data_ptr(), scales.data_ptr())
    return codes, scales


def _released(handed: List[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Empties `handed` (the tensors an exchange gave its collectives over `group`, none of them referenced
    elsewhere by the caller any more) and returns once nothing else holds them either (see the module docstring):
    the thread that holds the last reference frees each one while this one sleeps without the GIL. Over NCCL,
    whose collectives the host does not wait for, CUDA tensors are left to it; gloo's worker threads hold CUDA
    tensors as they hold CPU ones."""
    if not handed or (handed[0].device.type == "cuda" and dist.get_backend(group) == "nccl"):
        handed.clear()
        return
    refs = [weakref.ref(t) for t in handed]
    handed.clear()
    deadline = time.monotonic() + 10.0  # a bound, should another reference be held for good: nothing to wait for
    while any(r() is not None for r in refs) and time.monotonic() < deadline:
        time.sleep(0)


def reduce_scatter(pieces: torch.Tensor, group: dist.ProcessGroup, block: int) -> torch.Tensor:
    """Row j of `pieces` (n ranks x piece) goes to rank j; returns the float32 sum of the pieces this rank got,
    decoded and added in rank order. One all-to-all of codes and one of scales."""
    codes, scales = _encode(pieces.contiguous(), block)
    got_codes, got_scales = torch.empty_like(codes), torch.empty_like(scales)
    dist.all_to_all_single(got_codes, codes, group=group)
    dist.all_to_all_single(got_scales, scales, group=group)
    total = torch.empty(pieces.shape[1], dtype=torch.float32, device=pieces.device)
    # Summed in rank order, so that every rank's sum is the same whatever arrives first; one pass, no float32
    # copy of the pieces.
    _dequantize_rows_into(got_codes.data_ptr(), got_scales.data_ptr(), pieces.shape[0], block, _MAP, total, sum=True)
    handed = [codes, scales, got_codes, got_scales]
    del codes, scales, got_codes, got_scales
    _released(handed, group)
    return total


def all_gather(mine: torch.Tensor, group: dist.ProcessGroup, block: int, out: Optional[torch.Tensor] = None) \
        -> torch.Tensor:
    """Every rank's piece (this rank's: `mine`), as n ranks x piece values decoded from the codes all of them
    received, this rank's own included: every rank ends with the same values. Decoded into `out` (n x piece,
    contiguous, any floating dtype; it may hold `mine`) or into a new float32 tensor; returned."""
    codes, scales = _encode(mine.reshape(1, -1).contiguous(), block)
    n = group.size()
    all_codes = torch.empty(n, codes.shape[1], dtype=torch.uint8, device=mine.device)
    all_scales = torch.empty(n, scales.shape[1], dtype=torch.float32, device=mine.device)
    dist.all_gather_into_tensor(all_codes, codes, group=group)
    dist.all_gather_into_tensor(all_scales, scales, group=group)
    every = out if out is not None else torch.empty(n, codes.shape[1], dtype=torch.float32, device=mine.device)
    _dequantize_rows_into(all_codes.data_ptr(), all_scales.data_ptr(), n, block, _MAP, every)
    handed = [codes, scales, all_codes, all_scales]
    del codes, scales, all_codes, all_scales
    _released(handed, group)
    return every
