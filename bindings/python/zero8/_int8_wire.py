"""The int8 exchanges of zero8.fsdp and zero8.ddp over torch.distributed: pieces of a tensor encoded with zero8's
block-wise codec (the dynamic signed map, one float32 scale per block: the engine's wire format), moved as codes
and scales, decoded and summed in float32 in rank order, so that every rank computes the same sums."""

from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist

from . import _C
from ._C import Zero8ValueError
from .functional import _dequantize_into, _quantize_into

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
    """Codes (uint8, pieces' shape) and scales (float32, one row per piece) of the rows of `pieces`, each in
    blocks of its own (a piece need not hold whole blocks)."""
    n, size = pieces.shape
    codes = torch.empty(n, size, dtype=torch.uint8, device=pieces.device)
    scales = torch.empty(n, -(-size // block), dtype=torch.float32, device=pieces.device)
    for j in range(n):  # the codec itself, without the public functions' checks, copies and op dispatch
        _quantize_into(pieces[j], _MAP, block, codes[j].data_ptr(), scales[j].data_ptr())
    return codes, scales


def _decode_rows(codes: torch.Tensor, scales: torch.Tensor, block: int, out: torch.Tensor) -> torch.Tensor:
    """out[j] = the float32 values of row j (out: float32, the codes' shape)."""
    for j in range(codes.shape[0]):
        _dequantize_into(codes[j].data_ptr(), scales[j].data_ptr(), block, _MAP, out[j])
    return out


def reduce_scatter(pieces: torch.Tensor, group: dist.ProcessGroup, block: int) -> torch.Tensor:
    """Row j of `pieces` (n ranks x piece) goes to rank j; returns the float32 sum of the pieces this rank got,
    decoded and added in rank order. One all-to-all of codes and one of scales."""
    codes, scales = _encode(pieces.contiguous(), block)
    got_codes, got_scales = torch.empty_like(codes), torch.empty_like(scales)
    dist.all_to_all_single(got_codes, codes, group=group)
    dist.all_to_all_single(got_scales, scales, group=group)
    total = torch.empty(pieces.shape[1], dtype=torch.float32, device=pieces.device)
    part = torch.empty_like(total)  # one piece at a time: no float32 copy of the whole input
    for j in range(pieces.shape[0]):  # in rank order, so that every rank's sum is the same whatever arrives first
        _dequantize_into(got_codes[j].data_ptr(), got_scales[j].data_ptr(), block, _MAP, total if j == 0 else part)
        if j:
            total += part
    return total


def all_gather(mine: torch.Tensor, group: dist.ProcessGroup, block: int) -> torch.Tensor:
    """Every rank's piece (this rank's: `mine`), as n ranks x piece float32 values decoded from the codes all of
    them received, this rank's own included: every rank ends with the same values."""
    codes, scales = _encode(mine.reshape(1, -1).contiguous(), block)
    n = group.size()
    all_codes = torch.empty(n, codes.shape[1], dtype=torch.uint8, device=mine.device)
    all_scales = torch.empty(n, scales.shape[1], dtype=torch.float32, device=mine.device)
    dist.all_gather_into_tensor(all_codes, codes, group=group)
    dist.all_gather_into_tensor(all_scales, scales, group=group)
    return _decode_rows(all_codes, all_scales, block, torch.empty(n, codes.shape[1], device=mine.device))
