"""The messages between neighbouring stages: activations forward, their gradients backward, over the
pipeline group's point-to-point calls. The structure of what crosses a boundary (a tensor or a tuple of
them; each one's dtype, shape and whether a gradient comes back for it) is agreed once per batch, with
the first micro-batch; the micro-batches after it send their bytes only, and a sender whose tensors differ
from what was agreed raises before sending anything. Floating tensors optionally travel as int8 blocks with
one float32 absmax each (zero8.int8_activations), the wire format of the gradients: n codes plus
4 * ceil(n / block) bytes, 25.05% of fp32 at block 2048.

On a GPU the tensors stay on the stage's device: they are quantized there on torch's current stream, which
the pipeline communicator is ordered on (its ``stream``), and received into device memory; NCCL moves
them between GPUs, MPI stages them through host memory. The calls block until the message is done, unless
``queued`` (zero8.queued_stage_messages, NCCL): then a tensor's send and receive are queued on that stream
(``send_ptr_queued``, ``recv_ptr_queued``) and return once issued: the kernels that read a received tensor
come after its receive on the stream, and a buffer freed after a send is handed out again by torch's
caching allocator only to work queued after the send on that stream (the tensors sent here are made on
it), so no buffer needs to be kept; the host goes on queueing the stage's kernels while the messages wait
for the neighbour or travel, and ``sync`` waits for them. The structure travels as host bytes
(``send_bytes``, through a device scratch buffer on NCCL), once per batch, blocking.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import torch

from .. import _C
from .._C import Zero8ValueError
from ..functional import _dequantize_into, _quantize_into

# Tags on the pipeline communicator, one ordered channel each: the messages of a pair of ranks with the
# same tag arrive in order, so a batch's structure and then its micro-batches share one.
TAG_ACTIVATION = 1
TAG_GRAD = 2
TAG_TIED_GRAD = 3
TAG_TIED_WEIGHT = 4

_LEN = struct.Struct("<q")


@dataclass(frozen=True)
class TensorMeta:
    dtype: torch.dtype
    shape: tuple
    grad: bool  # a gradient comes back for it (a floating tensor that requires grad on the sending side)

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Structure:
    """What one message of a batch holds: one tensor (``is_tuple`` False) or a tuple of them."""
    is_tuple: bool
    tensors: tuple

    @staticmethod
    def of(value, what: str) -> "Structure":
        items = value if isinstance(value, (tuple, list)) else (value,)
        metas = []
        for i, t in enumerate(items):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{what}: element {i} is a {type(t).__name__}; a pipeline stage's output must be a "
                                f"tensor or a tuple of tensors (as in DeepSpeed)")
            metas.append(TensorMeta(t.dtype, tuple(t.shape), bool(t.is_floating_point() and t.requires_grad)))
        return Structure(isinstance(value, (tuple, list)), tuple(metas))

    def to_bytes(self) -> bytes:
        return json.dumps({"tuple": self.is_tuple, "tensors": [
            {"dtype": str(m.dtype).removeprefix("torch."), "shape": list(m.shape), "grad": m.grad}
            for m in self.tensors]}).encode()

    @staticmethod
    def from_bytes(data: bytes) -> "Structure":
        d = json.loads(data)
        return Structure(bool(d["tuple"]), tuple(
            TensorMeta(getattr(torch, m["dtype"]), tuple(m["shape"]), bool(m["grad"])) for m in d["tensors"]))

    def describe(self) -> str:
        shown = ", ".join(f"{str(m.dtype).removeprefix('torch.')}{list(m.shape)}" for m in self.tensors)
        return f"({shown})" if self.is_tuple else shown


@dataclass
class Traffic:
    """What this rank sent in one direction: payload bytes, the float elements among them (4 bytes each
    in fp32) and messages, by kind."""
    bytes: int = 0
    float_elements: int = 0
    other_bytes: int = 0  # non-floating tensors (token ids, masks), sent as they are
    messages: int = 0

    def as_dict(self) -> dict:
        return {"bytes": self.bytes, "fp32_bytes": 4 * self.float_elements + self.other_bytes,
                "messages": self.messages}


@dataclass
class StageLink:
    """This rank's wires to the previous and next stage of its pipeline (same data-parallel rank)."""
    comm: "_C.Communicator"
    stage: int
    stages: int
    int8: bool
    wire_block: int
    device: torch.device = torch.device("cpu")  # where received tensors go: the stage's
    queued: bool = False  # tensors sent and received with the queued calls (zero8.queued_stage_messages)
    activations: Traffic = field(default_factory=Traffic)  # sent to stage + 1
    gradients: Traffic = field(default_factory=Traffic)    # sent to stage - 1
    _sent: Structure | None = None  # agreed with stage + 1 for this batch
    _received: Structure | None = None  # agreed with stage - 1 for this batch

    def new_batch(self) -> None:
        """The next messages start a batch: its structure is agreed again (a new sequence length is fine)."""
        self._sent = None
        self._received = None

    def sync(self) -> None:
        """Waits for the messages queued on the stream so far (NCCL; nothing elsewhere), raising the error
        that names a neighbour that died or stalled."""
        self.comm.sync()

    # ---- forward ----
    def send_activations(self, value, micro: int) -> None:
        s = Structure.of(value, f"stage {self.stage} output of micro-batch {micro}")
        items = value if isinstance(value, (tuple, list)) else (value,)
        for i, t in enumerate(items):
            if t.device != self.device:
                raise Zero8ValueError(
                    f"stage {self.stage}: element {i} of micro-batch {micro}'s output is on {t.device}, the stage "
                    f"on {self.device}; a stage sends tensors of its own device (move the layer's output there)")
        if self._sent is None:
            self._send_structure(s)
            self._sent = s
        elif s != self._sent:
            raise Zero8ValueError(
                f"stage {self.stage}: micro-batch {micro}'s output {s.describe()} differs from the batch's first "
                f"micro-batch {self._sent.describe()}; the micro-batches of one batch must have the same shapes")
        for t in items:
            self._send_tensor(t.detach(), self.stage + 1, TAG_ACTIVATION, self.activations)

    def recv_activations(self):
        """The previous stage's output, as fresh tensors. Every floating one requires grad, as in DeepSpeed,
        also where the sender wants no gradient back: a reentrant checkpoint segment's output requires grad
        only when one of its inputs does. Only the gradients the sender asked for go back (send_grads)."""
        if self._received is None:
            self._received = self._recv_structure()
        out = []
        for m in self._received.tensors:
            t = self._recv_tensor(m, self.stage - 1, TAG_ACTIVATION)
            if t.is_floating_point():
                t.requires_grad_()
            out.append(t)
        return tuple(out) if self._received.is_tuple else out[0]

    # ---- backward ----
    def send_grads(self, inputs) -> None:
        """The gradients of the received activations that the previous stage asked for, in order (zeros for
        one this stage did not use)."""
        items = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
        for m, t in zip(self._received.tensors, items):
            if not m.grad:
                continue
            g = t.grad if t.grad is not None else torch.zeros(m.shape, dtype=m.dtype, device=self.device)
            self._send_tensor(g.to(m.dtype).contiguous(), self.stage - 1, TAG_GRAD, self.gradients)

    def recv_grads(self, outputs) -> tuple[list, list]:
        """(tensors, gradients): this stage's outputs that a gradient came back for, and those gradients."""
        items = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        tensors, grads = [], []
        for m, t in zip(self._sent.tensors, items):
            if m.grad:
                tensors.append(t)
                grads.append(self._recv_tensor(m, self.stage + 1, TAG_GRAD))
        return tensors, grads

    # ---- the wire ----
    def _send_structure(self, s: Structure) -> None:
        # Two messages, the length first: a receive must name the exact size of the message it takes.
        data = s.to_bytes()
        self.comm.send_bytes(_LEN.pack(len(data)), self.stage + 1, TAG_ACTIVATION)
        self.comm.send_bytes(data, self.stage + 1, TAG_ACTIVATION)

    def _recv_structure(self) -> Structure:
        (n,) = _LEN.unpack(self.comm.recv_bytes(_LEN.size, self.stage - 1, TAG_ACTIVATION))
        return Structure.from_bytes(self.comm.recv_bytes(n, self.stage - 1, TAG_ACTIVATION))

    def _quantized(self, t: torch.Tensor) -> bool:
        return self.int8 and t.is_floating_point() and t.numel() > 0

    def _send_tensor(self, t: torch.Tensor, peer: int, tag: int, traffic: Traffic) -> None:
        t = t.contiguous()
        if self._quantized(t):
            n = t.numel()
            nb = _C.quant_num_blocks(n, self.wire_block)
            buf = torch.empty(4 * nb + n, dtype=torch.uint8, device=t.device)  # absmax first: float32-aligned
            _quantize_into(t, _C.MapKind.dynamic_signed, self.wire_block, buf.data_ptr() + 4 * nb, buf.data_ptr())
            payload = buf
        else:
            payload = t
        nbytes = payload.numel() * payload.element_size()
        (self.comm.send_ptr_queued if self.queued else self.comm.send_ptr)(payload.data_ptr(), nbytes, peer, tag)
        traffic.bytes += nbytes
        traffic.messages += 1
        if t.is_floating_point():
            traffic.float_elements += t.numel()
        else:
            traffic.other_bytes += nbytes

    def _recv_tensor(self, m: TensorMeta, peer: int, tag: int) -> torch.Tensor:
        out = torch.empty(m.shape, dtype=m.dtype, device=self.device)
        n = out.numel()
        if self.int8 and out.is_floating_point() and n > 0:
            nb = _C.quant_num_blocks(n, self.wire_block)
            buf = torch.empty(4 * nb + n, dtype=torch.uint8, device=self.device)
            self._recv(buf.data_ptr(), buf.numel(), peer, tag)
            _dequantize_into(buf.data_ptr() + 4 * nb, buf.data_ptr(), self.wire_block, _C.MapKind.dynamic_signed, out)
        else:
            self._recv(out.data_ptr(), n * out.element_size(), peer, tag)
        return out

    def _recv(self, ptr: int, nbytes: int, peer: int, tag: int) -> None:
        (self.comm.recv_ptr_queued if self.queued else self.comm.recv_ptr)(ptr, nbytes, peer, tag)
