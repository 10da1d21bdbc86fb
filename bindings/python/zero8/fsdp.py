"""zero8's int8 gradient communication for FSDP2 (``fully_shard``) jobs: FSDP2's gradient reduce-scatter with
each rank's contribution sent as 8-bit blocks, as zero8's own engine sends its gradients (docs/FSDP2.md)::

    import zero8.fsdp
    fully_shard(...)                        # as usual, then
    zero8.fsdp.int8_reduce_scatter(model)   # every FSDP module of the model reduces its gradients in int8

How: each rank cuts its unsharded gradients into the pieces FSDP2 sends to each rank, encodes every piece
with zero8's block-wise codec (the dynamic signed map, one float32 scale per block of ``block_size`` = 2048
elements: the engine's wire format, docs/ENGINE.md), exchanges them with one all-to-all (codes and scales),
and each rank decodes the pieces it received and sums them in float32, in rank order, into its shard. A
rank sends ``1 + 4 / 2048`` bytes per gradient element instead of 4 (float32 gradients; 2 with bfloat16
ones), with the error of one 8-bit code per rank and element; like the engine's default, no error feedback.
A block holding an Inf or NaN decodes to non-finite values, so a loss scaler still sees the overflow.

Requires ``FSDPModule.set_custom_reduce_scatter`` (PyTorch's FSDP2 custom-communication API). HSDP's
all-reduce across replicas stays FSDP2's own.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import _int8_wire
from ._C import Zero8NotSupportedError, Zero8ValueError

__all__ = ["Int8ReduceScatter", "int8_reduce_scatter"]

WIRE_BLOCK = _int8_wire.BLOCK

try:  # FSDP2's communication interface (PyTorch 2.9 and later)
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterBase
except ImportError:  # pragma: no cover - older PyTorch: int8_reduce_scatter says what is missing
    _ReduceScatterBase = object


class Int8ReduceScatter(_ReduceScatterBase):
    """FSDP2's reduce-scatter with 8-bit block-wise codes on the wire (see the module docstring). Counts what
    it sent: ``calls``, ``elements`` (gradient elements reduced per rank, over all calls) and ``wire_bytes``
    (bytes this rank sent to the others) against ``full_bytes`` (what FSDP2's own reduce-scatter would send in
    the gradients' dtype, (N - 1) / N of the input)."""

    def __init__(self, block_size: int = WIRE_BLOCK):
        self.block_size = _int8_wire.check_block(block_size, "Int8ReduceScatter")
        self.calls = self.elements = self.wire_bytes = self.full_bytes = 0

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> Optional[dist.Work]:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise Zero8NotSupportedError(f"Int8ReduceScatter: reduce op {op} (FSDP2 picks it from the gradient "
                                         f"divide factor); it sums or averages: call "
                                         f"module.set_force_sum_reduction_for_comms(True), as int8_reduce_scatter does")
        n = group.size()
        shard = output_tensor.numel()
        if input_tensor.numel() != n * shard:
            raise Zero8ValueError(f"Int8ReduceScatter: the input has {input_tensor.numel()} elements, not {n} ranks x "
                                  f"the output's {shard}")
        total = _int8_wire.reduce_scatter(input_tensor.reshape(n, shard), group, self.block_size)
        if op == dist.ReduceOp.AVG:
            total /= n
        output_tensor.copy_(total.reshape(output_tensor.shape))
        self.calls += 1
        self.elements += shard
        self.wire_bytes += (n - 1) * _int8_wire.piece_bytes(shard, self.block_size)
        self.full_bytes += (n - 1) * shard * input_tensor.element_size()
        return None


def int8_reduce_scatter(module: torch.nn.Module, block_size: int = WIRE_BLOCK) -> Int8ReduceScatter:
    """Make every FSDP2 module in `module` (itself included) reduce-scatter its gradients in int8 blocks, through
    one shared Int8ReduceScatter (returned, for its byte counts). Sums are forced (FSDP2 then divides the
    gradients itself), since the int8 exchange sums or averages only."""
    from torch.distributed.fsdp import FSDPModule
    fsdp = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not fsdp:
        raise Zero8ValueError("int8_reduce_scatter: no module of this model is wrapped by FSDP2's fully_shard; "
                              "call it after fully_shard")
    if not hasattr(fsdp[0], "set_custom_reduce_scatter") or _ReduceScatterBase is object:
        raise Zero8NotSupportedError(f"int8_reduce_scatter: this PyTorch ({torch.__version__}) has no FSDP2 "
                                     f"custom reduce-scatter (FSDPModule.set_custom_reduce_scatter)")
    comm = Int8ReduceScatter(block_size)
    for m in fsdp:
        m.set_custom_reduce_scatter(comm)
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)
    return comm
