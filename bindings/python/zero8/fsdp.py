"""zero8's int8 communication for FSDP2 (``fully_shard``) jobs: FSDP2's gradient reduce-scatter and its
parameter all-gather with each rank's part sent as 8-bit blocks, as zero8's own engine sends them (docs/FSDP2.md)::

    import zero8.fsdp
    fully_shard(...)                        # as usual, then
    zero8.fsdp.int8_reduce_scatter(model)   # every FSDP module of the model reduces its gradients in int8
    zero8.fsdp.int8_all_gather(model)       # and gathers its parameters in int8 (optional)

Gradients: each rank cuts its unsharded gradients into the pieces FSDP2 sends to each rank, encodes every
piece with zero8's block-wise codec (the dynamic signed map, one float32 scale per block of ``block_size`` =
2048 elements: the engine's wire format, docs/ENGINE.md), exchanges them with one all-to-all (codes and
scales), and each rank decodes the pieces it received and sums them in float32, in rank order, into its shard.
A rank sends ``1 + 4 / 2048`` bytes per gradient element instead of 4 (float32 gradients; 2 with bfloat16
ones), with the error of one 8-bit code per rank and element; like the engine's default, no error feedback.
A block holding an Inf or NaN decodes to non-finite values, so a loss scaler still sees the overflow.

Parameters (ZeRO++'s quantized weight communication): each rank encodes its shards of a module's parameters
(FSDP2's all-gather input, in the parameters' dtype or the mixed-precision param_dtype) with the same codec,
one all-gather moves the codes and scales, and every rank decodes all of them, its own included, into the
unsharded parameters: every rank computes the forward and the backward with the same decoded weights, while
the sharded parameters, which the optimizer steps and checkpoints save, stay exact. (With
``reshard_after_forward=<ranks>`` the backward gathers the shards FSDP2 kept from the forward's decoded output
over that smaller group: exactly, so that the backward's weights are the forward's.) Blocks run over the
concatenated shards, so one may straddle two parameters; the log-spaced map keeps small values next to large
ones to a few percent. Groups whose all-gather moves raw bytes (parameters of mixed dtypes, or tensor
subclasses that gather their own representation) keep FSDP2's exact all-gather.

Replicas (HSDP over hosts): FSDP2's native HSDP (a 2-d mesh) all-reduces the shards' gradients across the
replicas itself, in the reduce dtype. Shard over the shard dimension of the mesh alone instead and pass the
replicate dimension's group to ``int8_replicate_all_reduce``: its hook (``FSDPModule.set_all_reduce_hook``)
averages each reduced shard over the replicas as zero8.ddp averages a bucket (an int8 reduce-scatter and an
int8 all-gather, every replica decoding the same codes, so the replicas stay bit for bit equal). That is the
exchange that crosses the hosts when the shard group is a host's GPUs.

Requires ``FSDPModule.set_custom_reduce_scatter`` / ``set_custom_all_gather`` / ``set_all_reduce_hook``
(PyTorch's FSDP2 custom communication API).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import _int8_wire
from ._C import Zero8NotSupportedError, Zero8ValueError
from .ddp import Int8AllReduce

__all__ = ["Int8AllGather", "Int8ReduceScatter", "int8_all_gather", "int8_reduce_scatter", "int8_replicate_all_reduce"]

WIRE_BLOCK = _int8_wire.BLOCK

try:  # FSDP2's communication interface (PyTorch 2.9 and later)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _AllGatherBase
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterBase
except ImportError:  # pragma: no cover - older PyTorch: int8_reduce_scatter and int8_all_gather say what is missing
    _AllGatherBase = _ReduceScatterBase = object


class _FreshBuffers:
    """FSDP2's comm allocation (``allocate``): plain tensors from the caching allocator, as FSDP2's default."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class Int8ReduceScatter(_FreshBuffers, _ReduceScatterBase):
    """FSDP2's reduce-scatter with 8-bit block-wise codes on the wire (see the module docstring). Counts what
    it sent: ``calls``, ``elements`` (gradient elements reduced per rank, over all calls) and ``wire_bytes``
    (bytes this rank sent to the others) against ``full_bytes`` (what FSDP2's own reduce-scatter would send in
    the gradients' dtype, (N - 1) / N of the input)."""

    def __init__(self, block_size: int = WIRE_BLOCK):
        self.block_size = _int8_wire.check_block(block_size, "Int8ReduceScatter")
        self.calls = self.elements = self.wire_bytes = self.full_bytes = 0

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


class Int8AllGather(_FreshBuffers, _AllGatherBase):
    """FSDP2's parameter all-gather with 8-bit block-wise codes on the wire (see the module docstring), over the
    process groups named in ``groups`` (by ``group_name``; None: every group), and FSDP2's exact all-gather over
    any other. Counts what it sent: ``calls``, ``elements`` (parameter elements this rank sent, over all calls),
    ``wire_bytes`` (bytes this rank sent to the others) against ``full_bytes`` (what FSDP2's own all-gather would
    send, (N - 1) times its input), and ``exact_calls``: gathers made exactly (raw bytes, or another group)."""

    def __init__(self, block_size: int = WIRE_BLOCK, groups: Optional[set] = None):
        self.block_size = _int8_wire.check_block(block_size, "Int8AllGather")
        self.groups = groups
        self.calls = self.exact_calls = self.elements = self.wire_bytes = self.full_bytes = 0

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> Optional[dist.Work]:
        n = group.size()
        numel = input_tensor.numel()
        if output_tensor.numel() != n * numel:
            raise Zero8ValueError(f"Int8AllGather: the output has {output_tensor.numel()} elements, not {n} ranks x "
                                  f"the input's {numel}")
        full = (n - 1) * numel * input_tensor.element_size()
        self.calls += 1
        self.full_bytes += full
        # Exact: raw bytes (uint8), which FSDP2 moves when a group's parameters differ in dtype or are tensor
        # subclasses that gather their own representation (float8 training), nothing here to quantize; and the
        # backward's gather over a smaller group (reshard_after_forward=<ranks>) of shards cut from the forward's
        # decoded output: gathered as they are, the backward computes with the forward's weights
        if input_tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16) \
                or output_tensor.dtype != input_tensor.dtype \
                or (self.groups is not None and group.group_name not in self.groups):
            self.exact_calls += 1
            self.wire_bytes += full
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        _int8_wire.all_gather(input_tensor.reshape(-1), group, self.block_size, out=output_tensor.view(n, numel))
        self.elements += numel
        self.wire_bytes += (n - 1) * _int8_wire.piece_bytes(numel, self.block_size)
        return None


def _fsdp_modules(module: torch.nn.Module, setter: str, who: str) -> list:
    """The FSDP2 modules of `module` (itself included), once this PyTorch is known to have FSDPModule.<setter>."""
    from torch.distributed.fsdp import FSDPModule
    fsdp = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not fsdp:
        raise Zero8ValueError(f"{who}: no module of this model is wrapped by FSDP2's fully_shard; call it after "
                              f"fully_shard")
    if not hasattr(fsdp[0], setter) or _ReduceScatterBase is object:
        raise Zero8NotSupportedError(f"{who}: this PyTorch ({torch.__version__}) has no FSDP2 custom "
                                     f"communication for it (FSDPModule.{setter})")
    return fsdp


def int8_reduce_scatter(module: torch.nn.Module, block_size: int = WIRE_BLOCK) -> Int8ReduceScatter:
    """Make every FSDP2 module in `module` (itself included) reduce-scatter its gradients in int8 blocks, through
    one shared Int8ReduceScatter (returned, for its byte counts). Sums are forced (FSDP2 then divides the
    gradients itself), since the int8 exchange sums or averages only."""
    fsdp = _fsdp_modules(module, "set_custom_reduce_scatter", "int8_reduce_scatter")
    comm = Int8ReduceScatter(block_size)
    for m in fsdp:
        m.set_custom_reduce_scatter(comm)
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)
    return comm


def int8_all_gather(module: torch.nn.Module, block_size: int = WIRE_BLOCK) -> Int8AllGather:
    """Make every FSDP2 module in `module` (itself included) all-gather its parameters in int8 blocks, through one
    shared Int8AllGather (returned, for its byte counts): the forward and the backward compute with the decoded
    weights, the same on every rank; the sharded parameters stay exact (see the module docstring)."""
    from torch.distributed.tensor import DTensor, Shard
    fsdp = _fsdp_modules(module, "set_custom_all_gather", "int8_all_gather")
    # The groups the parameters are sharded over (a 2-d HSDP mesh: its shard dimension's); FSDP2's gather after
    # the forward with reshard_after_forward=<ranks> runs over a smaller group of its own, and stays exact.
    groups = {p.device_mesh.get_group(dim).group_name for p in module.parameters() if isinstance(p, DTensor)
              for dim, placement in enumerate(p.placements) if isinstance(placement, Shard)}
    comm = Int8AllGather(block_size, groups)
    for m in fsdp:
        m.set_custom_all_gather(comm)
    return comm


def int8_replicate_all_reduce(module: torch.nn.Module, replicate_group: dist.ProcessGroup,
                              block_size: int = WIRE_BLOCK) -> Int8AllReduce:
    """HSDP with the replicas' gradient all-reduce in int8 blocks: `module` is sharded by fully_shard over the
    shard group alone (a 1-d mesh, e.g. ``mesh["shard"]``), `replicate_group` joins the ranks that hold the same
    shards (``mesh["replicate"].get_group()``). Every FSDP2 module then averages its reduced gradient shard over
    `replicate_group` through zero8.ddp's int8 exchange (see the module docstring); returns its state, for the
    byte counts."""
    from torch.distributed.tensor import DTensor, Replicate
    fsdp = _fsdp_modules(module, "set_all_reduce_hook", "int8_replicate_all_reduce")
    for name, p in module.named_parameters():
        if isinstance(p, DTensor) and any(isinstance(pl, Replicate) for pl in p.placements):
            raise Zero8ValueError(f"int8_replicate_all_reduce: parameter {name!r} is replicated over a dimension of "
                                  f"its mesh ({p.device_mesh}): FSDP2's native HSDP all-reduces it itself. Shard "
                                  f"over the shard dimension alone (fully_shard(..., mesh=mesh['shard'])) and pass "
                                  f"mesh['replicate'].get_group()")
    if not isinstance(replicate_group, dist.ProcessGroup):
        raise Zero8ValueError(f"int8_replicate_all_reduce: replicate_group is a {type(replicate_group).__name__}, "
                              f"not a ProcessGroup (mesh['replicate'].get_group())")
    state = Int8AllReduce(replicate_group, block_size)
    for m in fsdp:
        m.set_all_reduce_hook(state.average)
    return state
