"""INT8 training linear layer after Jetfire (Xi et al. 2024, "Jetfire: Efficient and Accurate Transformer
Pretraining with INT8 Data Flow and Per-Block Quantization"): the forward, input-gradient and
weight-gradient matrix products run as int8 x int8 -> int32 GEMMs with float32 accumulation, operands are
quantized per ``block x block`` tile (absmax / 127; the output gradient with stochastic rounding), the
float32 master weight is the ``nn.Parameter`` the optimizer updates, and the activation saved for the
backward pass is kept as int8 codes plus per-block scales.

Two GEMM modes (docs/INT8.md explains the choice and has the measurements):

- ``gemm="exact"`` (default): Jetfire's per-block math, exactly: every product is a sum over the
  ``block``-wide slices of the reduction axis of ``int32 slice product * (row-block scale * column-block
  scale)``, accumulated in float32. A library GEMM can only scale rows and columns of its output, so this
  runs zero8's fused kernel (``zero8._C.int8_block_matmul``: AVX-512 VNNI, the scaling done per slice in
  registers); on a CPU without AVX512_VNNI, one library int8 GEMM per slice (same bits, much slower).
  With VNNI it is several times faster than float32 ``nn.Linear``, forward and backward; the figures per
  CPU are in docs/BENCHMARKS.md and docs/INT8.md.
- ``gemm="fast"``: one library int8 GEMM per product with vector-wise scales (one per row of the left
  operand, one per column of the right operand, SwitchBack/LLM.int8-style), each operand quantized from
  its float values (the saved activation is dequantized from its per-block int8 form first, the output
  gradient stochastically rounded). Error bound per element: half a vector-wise step (plus half a
  per-block step for the saved activation). Its forward is faster than the exact one at 512 tokens
  (1.4-1.6x, level from 2048); its forward + backward is slower at 4 of the 6 shapes of docs/INT8.md.
"""

from __future__ import annotations

import math
import warnings
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import _ops
from .._C import Zero8ValueError
from . import linear8bit as _l8
from .linear8bit import (_autocast_input, _check_device_arg, _check_input, _check_layer_tensors, _check_loaded,
                         _check_weight, _float_linear, _is_meta_call, _keep_float32, _seed)

__all__ = ["Int8Linear", "blockwise_int8_matmul"]


def _blockwise_int8_matmul_sliced(qa: Tensor, sa: Tensor, qb_t: Tensor, sb_t: Tensor, block: int,
                                  out_dtype: torch.dtype = torch.float32, bias: Optional[Tensor] = None) -> Tensor:
    """The per-block product through a library GEMM, one int8 GEMM per ``block``-wide slice of k (eager;
    ``zero8._ops.int8_block_matmul_sliced``): the same bits as the fused kernel, used where that kernel
    cannot run (no AVX512_VNNI)."""
    return _ops.int8_block_matmul_sliced(qa, sa, qb_t, sb_t, block, out_dtype, bias, _l8._GEMM)


def blockwise_int8_matmul(qa: Tensor, sa: Tensor, qb_t: Tensor, sb_t: Tensor, block: int,
                          out_dtype: torch.dtype = torch.float32, bias: Optional[Tensor] = None) -> Tensor:
    """The per-block product ``A @ B_t.T`` of two per-block int8 matrices, exactly as defined: ``qa`` (m x k)
    with scales ``sa`` (ceil(m/block) x ceil(k/block)), ``qb_t`` (n x k) with ``sb_t`` (ceil(n/block) x
    ceil(k/block)); for each ``block``-wide slice of k the int32 product is scaled by its row-block and
    column-block scales and accumulated in float32 (slices in ascending order), then ``+ bias``, returned
    as ``out_dtype``. Either operand may be the ``.t()`` view of a contiguous matrix (no copy). Runs the
    fused AVX-512 VNNI kernel (``zero8._C.int8_block_matmul``) where the CPU has it, else one library int8
    GEMM per slice, and on a GPU zero8's per-block CUDA kernel; all give the same bits."""
    # Checked here too (the op checks again), so that under torch.compile a bad call fails while tracing.
    _ops.check_block_matmul(qa, sa, qb_t, sb_t, block, out_dtype, bias)
    # One op (zero8._ops): the fused kernel where the CPU has AVX512_VNNI, else the per-slice path.
    return _ops.eager.int8_block_matmul(qa, sa, qb_t, sb_t, block, out_dtype, bias, _l8._GEMM)


class _Int8LinearFn(torch.autograd.Function):
    # Calls the ops of zero8._ops directly: Int8Linear.forward has validated x and the weight, and under
    # torch.compile a backward may not read tensor attributes such as .layout (which the checks read).
    @staticmethod
    def forward(ctx, x, weight, bias, block, exact):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        gemm = _l8._GEMM
        # The activation kept for the backward pass: int8 per-block (Jetfire's data flow format).
        qxb, sxb = _ops.eager.int8_quantize_blocks(x2, block, None)
        if exact:
            qwb, swb = _ops.eager.int8_quantize_blocks(weight.detach(), block, None)
            y = _ops.eager.int8_block_matmul(qxb, sxb, qwb, swb, block, x.dtype, bias, gemm)
        else:
            qx, sx = _ops.eager.int8_quantize_rows(x2, None, None)
            qw, sw = _ops.eager.int8_quantize_rows(weight.detach(), None, None)
            y = _ops.mm_dequantize(qx, qw, True, sx, sw, x.dtype, None, bias, gemm)
        ctx.save_for_backward(qxb, sxb, weight)
        ctx.block, ctx.exact, ctx.in_shape, ctx.x_dtype = block, exact, shape, x.dtype
        ctx.has_bias = bias is not None
        return y.reshape(*shape[:-1], y.shape[-1])

    @staticmethod
    @once_differentiable  # int8 kernels autograd cannot trace: a second derivative must fail, not drop terms
    def backward(ctx, grad):
        qxb, sxb, weight = ctx.saved_tensors
        block = ctx.block
        gemm = _l8._GEMM
        g2 = grad.reshape(-1, grad.shape[-1]).contiguous()
        need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]
        grad_x = grad_w = grad_b = None
        w = weight.detach()
        if ctx.exact:
            # One stochastic per-block quantization of the output gradient serves both products: the
            # blocks of its transpose are its blocks transposed.
            qgb, sgb = _ops.eager.int8_quantize_blocks(g2, block, _seed())
            if need_x:  # dX = dY W: reduction over the output features
                qwb, swb = _ops.eager.int8_quantize_blocks(w, block, None)
                grad_x = _ops.eager.int8_block_matmul(qgb, sgb, qwb.t(), swb.t(), block, ctx.x_dtype, None, gemm)
            if need_w:  # dW = dY^T X: reduction over the tokens
                grad_w = _ops.eager.int8_block_matmul(qgb.t(), sgb.t(), qxb.t(), sxb.t(), block, torch.float32, None, gemm)
        else:
            if need_x:
                qg, sg = _ops.eager.int8_quantize_rows(g2, None, _seed())  # per token, stochastic
                qw, sw = _ops.eager.int8_quantize_cols(w, None)  # per input feature
                grad_x = _ops.mm_dequantize(qg, qw, False, sg, sw, ctx.x_dtype, None, None, gemm)
            if need_w:
                qg, sg = _ops.eager.int8_quantize_cols(g2, _seed())  # per output feature, stochastic
                xd = _ops.eager.int8_dequantize_blocks(qxb, sxb, block, torch.float32)
                qx, sx = _ops.eager.int8_quantize_cols(xd, None)  # per input feature
                # A reduction over every token: past INT8_GEMM_MAX_K of them, in parts summed in int64.
                grad_w = _ops.mm_dequantize(qg.t(), qx, False, sg, sx, torch.float32, None, None, gemm)
        if need_b:
            grad_b = g2.float().sum(0)
        if grad_x is not None:
            grad_x = grad_x.reshape(ctx.in_shape)
        return grad_x, grad_w, grad_b, None, None


class Int8Linear(torch.nn.Module):
    """Drop-in ``torch.nn.Linear`` for training with INT8 matrix products (Jetfire-style per-block):

    ``Int8Linear(in_features, out_features, bias=True, block_size=32, gemm="exact")``

    - ``weight`` (out x in) and ``bias`` are float32 Parameters, initialised as ``nn.Linear``'s: the master
      copy the optimizer updates; it is quantized to int8 at every forward.
    - forward ``y = x W^T + b``, input gradient ``dY W``, weight gradient ``dY^T X``: int8 x int8 -> int32
      products with float32 accumulation; the output gradient is quantized with stochastic rounding
      (unbiased), the rest round to nearest.
    - the input is saved for backward as int8 codes plus one float32 scale per ``block x block`` tile
      (about 1/4 of float32, 1/2 of bf16); ``activation_memory()`` reports the last forward's figures.
    - ``gemm``: ``"exact"`` (per-block scales in the reduction as well, Jetfire's math, the fused kernel)
      or ``"fast"`` (one library int8 GEMM per product, vector-wise scales): see the module docstring.
    - ``.half()``, ``.to(torch.bfloat16)`` and other dtype casts leave ``weight`` and ``bias`` float32 (the
      master copies; a device move moves them); under ``torch.autocast`` the layer computes from the input
      cast to autocast's dtype and returns that dtype, as ``nn.Linear`` does there.

    Tensors of float32, bfloat16 or float16 on the CPU, or on a GPU in a build with CUDA (the same int8
    codes, scales and integer products as the CPU, by zero8's CUDA kernels and ``torch._int_mm``); the output
    has the input's dtype. Made on the meta device (``device="meta"``), the layer holds shapes only until
    ``to_empty(device=...)`` + ``load_state_dict`` or ``load_state_dict(..., assign=True)``; a loaded weight
    is kept float32. Until then a meta input gives a meta output (shapes and dtypes, backward too;
    ``activation_memory()`` reports what the loaded layer would keep) and a real input raises.
    """

    _warned_exact_on_gpu = False  # once per process: the plain per-block kernel's speed on a GPU

    def __init__(self, in_features: int, out_features: int, bias: bool = True, block_size: int = 32,
                 gemm: str = "exact", device=None, dtype=None) -> None:
        super().__init__()
        _check_device_arg(device, "Int8Linear")
        if dtype is not None and dtype != torch.float32:
            raise Zero8ValueError(f"Int8Linear keeps a float32 master weight; dtype={dtype}")
        if in_features <= 0 or out_features <= 0:
            raise Zero8ValueError(f"in_features and out_features must be > 0, got {in_features}, {out_features}")
        if not isinstance(block_size, int) or not 1 <= block_size <= 65536:
            raise Zero8ValueError(f"block_size must be an int in 1..65536, got {block_size!r}")
        if gemm not in ("fast", "exact"):
            raise Zero8ValueError(f"gemm must be 'fast' or 'exact', got {gemm!r}")
        self.in_features, self.out_features = in_features, out_features
        self.block_size, self.gemm = block_size, gemm
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, device=device))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(out_features, device=device))
        else:
            self.register_parameter("bias", None)
        self._last_saved = None
        self.reset_parameters()
        self._warn_if_slow_on(self.weight.device)

    def reset_parameters(self) -> None:
        # nn.Linear's initialisation.
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            torch.nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, block_size: int = 32, gemm: str = "exact") -> "Int8Linear":
        """An Int8Linear with a copy of ``linear``'s weight and bias (float32), on ``linear``'s device (the
        meta device included)."""
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, block_size, gemm,
                device=linear.weight.device)
        with torch.no_grad():
            m.weight.copy_(linear.weight.float())
            if linear.bias is not None:
                m.bias.copy_(linear.bias.float())
        m.weight.requires_grad_(linear.weight.requires_grad)  # frozen parameters stay frozen
        if linear.bias is not None:
            m.bias.requires_grad_(linear.bias.requires_grad)
        return m

    def _apply(self, fn, recurse=True):
        # The master weight and bias stay float32 under model.half() / .to(torch.bfloat16): only a device
        # move (or to_empty) changes them.
        _keep_float32(self, ("weight", "bias"), fn, recurse)
        self._warn_if_slow_on(self.weight.device)
        return self

    def _warn_if_slow_on(self, device: torch.device) -> None:
        """Once per process, where the exact GEMM would run zero8's plain per-block kernel on a GPU. Called
        when the layer is made or moved and from an eager forward, never while torch.compile traces (dynamo
        cannot trace warnings.warn: fullgraph=True would fail)."""
        # (int8_block_matmul_cuda_backend's rule, as arithmetic.)
        if (self.gemm == "exact" and device.type == "cuda" and self.block_size % 16 != 0
                and not Int8Linear._warned_exact_on_gpu):
            Int8Linear._warned_exact_on_gpu = True
            warnings.warn(f"Int8Linear(gemm='exact', block_size={self.block_size}) on a GPU runs zero8's plain "
                          "per-block kernel on CUDA cores (the tensor-core kernel takes blocks that are "
                          "multiples of 16): on an H200 it took about 130x as long as a bf16 nn.Linear. Use a "
                          "block_size of 16, 32, 64 or 128, or gemm='fast' (torch._int_mm); docs/INT8.md "
                          "compares them.", stacklevel=3)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # The master weight stays float32: load_state_dict(..., assign=True) takes the checkpoint's tensors
        # as they are (a bf16 checkpoint would make a bf16 master), where copying would have converted them.
        for key in (prefix + "weight", prefix + "bias"):
            t = state_dict.get(key)
            if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float32:
                state_dict[key] = t.float()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def forward(self, x: Tensor) -> Tensor:
        meta = _is_meta_call(self, x, ("weight", "bias"))
        if not meta:
            _check_loaded(self, "Int8Linear", ("weight", "bias"))
        _check_input(x, self.in_features, meta=meta)
        if not meta:
            _check_layer_tensors(self, "Int8Linear", ("weight", "bias"), x)
        _check_weight(self.weight, "Int8Linear.weight")
        x = _autocast_input(x)
        if x.numel() == 0:  # an empty batch: the float product, so the output stays in the graph
            return _float_linear(x, self.weight, self.bias)
        if meta:  # shapes only (the layer has no data): the float product on meta tensors
            y = _float_linear(x, self.weight, self.bias)
        else:
            if not torch.compiler.is_compiling():
                self._warn_if_slow_on(x.device)
            y = _Int8LinearFn.apply(x, self.weight, self.bias, self.block_size, self.gemm == "exact")
        # What forward kept for backward: int8 codes of x plus one float32 scale per block (from the shapes,
        # so that torch.compile needs no side effect inside the autograd.Function).
        rows = x.numel() // self.in_features
        blocks = -(-rows // self.block_size) * -(-self.in_features // self.block_size)
        self._last_saved = (x.numel() + blocks * 4, x.numel() * x.element_size())
        return y

    def activation_memory(self) -> dict:
        """What the last forward kept for backward: ``saved_bytes`` (int8 codes + per-block scales) versus
        ``unquantized_bytes`` (the input in its own dtype, what ``nn.Linear`` keeps), and their ratio."""
        if self._last_saved is None:
            return {"saved_bytes": 0, "unquantized_bytes": 0, "ratio": float("nan")}
        saved, full = self._last_saved
        return {"saved_bytes": saved, "unquantized_bytes": full, "ratio": saved / full if full else float("nan")}

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"block_size={self.block_size}, gemm={self.gemm!r}")
