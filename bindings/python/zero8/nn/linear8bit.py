"""LLM.int8() inference layers (Dettmers et al. 2022, "LLM.int8(): 8-bit Matrix Multiplication for
Transformers at Scale"): ``Linear8bitLt`` (bitsandbytes' constructor, defaults and int8 state dicts) keeps
int8 weights with one absmax scale per output row (or a float weight quantized at every forward, its
default), quantizes each activation row to int8 on the fly, and computes the input columns holding any
``|x| >= threshold`` (the emergent outlier features) in float32, added back to the int8 product.
``convert_linear8bit`` swaps the ``nn.Linear`` modules of a trained model for it.

Also the int8 primitives both int8 layers use (``Int8Linear`` imports them): torch tensors in, validated
here (errors name the tensor), then the kernels of kernels/src/int8_*.cpp (kernels/cuda/int8_*.cu for CUDA
tensors, in a build with CUDA) as the torch custom ops of ``zero8._ops`` (so ``torch.compile`` traces them
without graph breaks), and the int8 GEMM: on the CPU zero8's oneDNN one when built with it, else
``torch._int_mm``; on a GPU ``torch._int_mm`` (docs/INT8.md).
"""

from __future__ import annotations

import math
import warnings
from typing import Iterable, Optional, Sequence

import torch
from torch import Tensor

from .. import _C, _ops
from .._tensors import (CUDA_BUILT, FLOAT_DTYPES, check_device, check_device_contiguous, check_dtype,
                        check_same_device, dtype_code)
from .._C import Zero8ValueError
from ..optim.optimizer import Zero8UnsupportedArgumentError

__all__ = [
    "Linear8bitLt",
    "bnb_state_dict",
    "convert_linear8bit",
    "int8_gemm_backend",
    "set_int8_gemm_backend",
]

# ---------------------------------------------------------------- primitives (shared with Int8Linear)

# Which int8 GEMM the layers call: "zero8" (_C.int8_gemm: oneDNN's matmul, Debian's libdnnl, when the
# extension was built with it) or "torch" (torch._int_mm, torch's bundled oneDNN). Measured side by side
# (docs/INT8.md), zero8's oneDNN path was as fast or faster here, so it is the default when built; without
# oneDNN _C.int8_gemm is the scalar reference, and torch._int_mm is used instead.
_GEMM = "zero8" if _C.int8_gemm_backend().startswith("onednn") or not hasattr(torch, "_int_mm") else "torch"


def int8_gemm_backend() -> str:
    """The int8 GEMM in use on the CPU: ``"torch"`` or ``"zero8 (<_C.int8_gemm_backend()>)"``. On a GPU the
    layers multiply with ``torch._int_mm`` whatever this says."""
    return "torch" if _GEMM == "torch" else f"zero8 ({_C.int8_gemm_backend()})"


def set_int8_gemm_backend(name: str) -> None:
    """Choose the int8 GEMM: ``"zero8"`` (the default when zero8 is built with oneDNN) or ``"torch"`` (the
    default otherwise), for comparisons (docs/INT8.md)."""
    global _GEMM
    if name not in ("torch", "zero8"):
        raise Zero8ValueError(f"int8 GEMM backend must be 'torch' or 'zero8', got {name!r}")
    if name == "torch" and not hasattr(torch, "_int_mm"):
        raise Zero8ValueError("this torch has no torch._int_mm")
    _GEMM = name


def _float_matrix(x: Tensor, name: str) -> Tensor:
    """A contiguous 2-D view of a float tensor on the CPU or a GPU (a copy only if needed); errors name the
    tensor."""
    check_device(x, name)
    dtype_code(x, name)
    if x.dim() != 2:
        raise Zero8ValueError(f"{name} must be 2-D here, got shape {tuple(x.shape)}")
    return x.contiguous()


def _seed() -> Tensor:
    # Stochastic rounding draws its seed from torch's CPU generator, so torch.manual_seed makes a run
    # reproducible, with the same draws for CPU and CUDA tensors (the kernels read the seed on the host: no
    # wait for a GPU); a one-element tensor, drawn in the graph under torch.compile (zero8._ops).
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device="cpu")


def quantize_rows(x: Tensor, col_mask: Optional[Tensor] = None, stochastic: bool = False):
    """Row-wise absmax int8 of a 2-D float tensor: ``(q int8 like x, scale float32[rows])``; columns with a
    nonzero ``col_mask`` byte are left out of the scale and coded 0."""
    x = _float_matrix(x, "x")
    if col_mask is not None:
        check_device_contiguous(col_mask, "col_mask")
        check_same_device(col_mask, "col_mask", x, "x")
        check_dtype(col_mask, "col_mask", torch.uint8)
        if col_mask.numel() != x.shape[1]:
            raise Zero8ValueError(f"col_mask has {col_mask.numel()} elements; expected {x.shape[1]}")
    return _ops.eager.int8_quantize_rows(x, col_mask, _seed() if stochastic else None)


def quantize_cols(x: Tensor, stochastic: bool = False):
    """Column-wise absmax int8: ``(q int8 like x, scale float32[cols])``."""
    x = _float_matrix(x, "x")
    return _ops.eager.int8_quantize_cols(x, _seed() if stochastic else None)


def quantize_blocks(x: Tensor, block: int, stochastic: bool = False):
    """Per-block absmax int8 (Jetfire): ``(q int8 like x, scale float32[ceil(rows/block), ceil(cols/block)])``."""
    x = _float_matrix(x, "x")
    return _ops.eager.int8_quantize_blocks(x, block, _seed() if stochastic else None)


def dequantize_blocks(q: Tensor, scale: Tensor, block: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """The float tensor of per-block codes: ``q * scale[block of q]``; ``scale`` as ``quantize_blocks`` made
    it (float32, ceil(rows/block) x ceil(cols/block))."""
    # The kernel reads raw pointers on q's device: a scale elsewhere, of another dtype or too small would be
    # read anyway (on a GPU, an illegal address ends the process's CUDA context). The op checks again; this
    # check also runs where the op's body does not (fake tensors, torch.compile's tracing).
    _ops.check_dequantize_blocks(q, scale, block, dtype)
    return _ops.eager.int8_dequantize_blocks(q, scale, block, dtype)


def int8_mm(a: Tensor, b: Tensor, b_trans: bool = True) -> Tensor:
    """int32 ``a @ b.T`` (``b_trans``: ``b`` is n x k, a weight matrix) or ``a @ b`` (``b`` is k x n) for
    int8 ``a`` (m x k), through the chosen int8 GEMM (``torch._int_mm`` on a GPU, any shape: see
    ``zero8._ops._int_mm_cuda``). Operands may be strided views (zero8's path makes them contiguous: it
    takes row-major matrices). k is at most 131071 (``zero8._ops.INT8_GEMM_MAX_K``), where the int32 sum
    could overflow; ``zero8._ops.mm_dequantize`` takes longer reductions."""
    _ops.check_gemm(a, b, b_trans)
    return _ops._mm(a, b, _GEMM, b_trans)


def dequantize_matmul(acc: Tensor, row_scale: Tensor, col_scale: Tensor, *, out_dtype=torch.float32,
                      add: Optional[Tensor] = None, bias: Optional[Tensor] = None, out: Optional[Tensor] = None,
                      accumulate: bool = False, row_group: int = 1, row_stride: int = 1, col_group: int = 1,
                      col_stride: int = 1) -> Tensor:
    """The int8 GEMM epilogue: ``float(acc) * (row_scale * col_scale) (+ add) (+ bias)`` written as
    ``out_dtype`` (or added into the float32 ``out`` with ``accumulate``). Scales are indexed
    ``row_scale[(i // row_group) * row_stride]`` (and likewise for columns): groups of the block size
    select one K-slice of a per-block GEMM: each scale is a 1-D float32 view of exactly the elements read
    (``ceil(rows / row_group)`` of them, with stride ``row_stride``). ``add`` is float32 of ``acc``'s shape,
    ``bias`` float of ``cols``, ``out`` contiguous of ``acc``'s shape."""
    # The kernel reads raw pointers: each tensor is checked (device, dtype, size) before it does, here and
    # again by the op (this check also runs under fake tensors and torch.compile's tracing).
    if out is None and accumulate:  # accumulating into a fresh tensor would add to whatever its memory held
        raise Zero8ValueError("accumulate=True adds into out: pass the float32 out to accumulate into")
    _ops.check_epilogue(acc, row_scale, col_scale, add, bias, out, out_dtype, accumulate, row_group, row_stride,
                        col_group, col_stride)
    if out is None:
        return _ops.eager.int8_dequantize_matmul(acc, row_scale, col_scale, out_dtype, add, bias, row_group, row_stride,
                                           col_group, col_stride)
    # Writing into a given tensor (the per-slice path accumulates into one) is eager only: not an op.
    return _ops._dequantize_matmul_into(acc, row_scale, col_scale, add, bias, out, accumulate, row_group,
                                        row_stride, col_group, col_stride)


def _check_input(x: Tensor, in_features: int, name: str = "input", meta: bool = False) -> None:
    """A float input of ``... x in_features`` on the CPU or a GPU (or, with ``meta``, on the meta device)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not (meta and x.is_meta):
        check_device(x, name)
    if x.dtype not in FLOAT_DTYPES:
        raise Zero8ValueError(f"{name} has dtype {x.dtype}; expected float32, bfloat16 or float16")
    if x.dim() < 1 or x.shape[-1] != in_features:
        raise Zero8ValueError(f"{name} has shape {tuple(x.shape)}; its last dimension must be in_features={in_features}")


def _check_weight(w: Tensor, name: str) -> None:
    # A float weight the kernels quantize (after model.double(), say): the error names the layer's weight.
    if w.dtype not in FLOAT_DTYPES:
        raise Zero8ValueError(f"{name} has dtype {w.dtype}; the int8 kernels take float32, bfloat16 or float16")


def _check_device_arg(device, layer: str) -> None:
    if device is None:
        return
    kind = torch.device(device).type
    if kind == "cuda" and not CUDA_BUILT:  # both a bad argument here and a not-supported device
        raise Zero8UnsupportedArgumentError(
            f"{layer}(device={device!r}): this zero8 was built without its CUDA kernels, so the layer runs on CPU "
            f"(or is created on the meta device, to be loaded later); reinstall zero8 on a machine with a GPU and "
            f"nvcc, or with ZERO8_CUDA=ON (docs/ENGINE.md, \"Install\")")
    if kind not in ("cpu", "cuda", "meta"):
        raise Zero8ValueError(f"{layer} runs on CPU or CUDA (or is created on the meta device, to be loaded "
                              f"later); device={device!r}")


def _check_layer_tensors(module: torch.nn.Module, layer: str, names: Sequence[str], x: Tensor) -> None:
    """The layer's tensors are on the input's device (one kernel call reads them all); errors name both."""
    for name in names:
        t = getattr(module, name)
        if t is not None:
            check_same_device(t, f"{layer}.{name}", x, "input")


def _check_loaded(module: torch.nn.Module, layer: str, names: Sequence[str]) -> None:
    # A layer created on the meta device (torch.device("meta"), accelerate's init_empty_weights) has shapes
    # but no data until a state dict is loaded into it.
    for name in names:
        t = getattr(module, name)
        if t is not None and t.is_meta:
            raise Zero8ValueError(
                f"{layer}.{name} is on the meta device (the layer was created without data): load the weights "
                f"first, with model.to_empty(device='cpu') then model.load_state_dict(state_dict), or with "
                f"model.load_state_dict(state_dict, assign=True)")


def _is_meta_call(module: torch.nn.Module, x, names: Sequence[str]) -> bool:
    """A meta input to a layer on the meta device (created with device="meta" or under init_empty_weights,
    not loaded: any of its tensors is meta, such as a bias left on meta by a partial load): shape inference
    or FLOP counting, answered by ``_float_linear`` on meta tensors. A
    meta layer given a CPU input still raises (``_check_loaded``), a CPU layer given a meta input too."""
    return isinstance(x, Tensor) and x.is_meta and any(
        getattr(module, name) is not None and getattr(module, name).is_meta for name in names)


def _autocast_input(x: Tensor) -> Tensor:
    """The (float32, bfloat16 or float16) input as ``torch.autocast`` casts ``nn.Linear``'s where it is enabled
    for the input's device: to autocast's dtype, so the layers return that dtype as nn.Linear does. The int8
    ops themselves are not autocast (zero8._ops)."""
    dev = x.device.type
    if dev in ("cpu", "cuda") and torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        if dtype in FLOAT_DTYPES and x.dtype != dtype:
            return x.to(dtype)
    return x


def _keep_float32(module: torch.nn.Module, names: Sequence[str], fn, recurse: bool) -> None:
    """``Module._apply(fn)`` with the named float32 tensors (and their gradients) kept float32: a dtype cast
    (``.half()``, ``.to(torch.bfloat16)``) is undone from the original values, a device move kept. A
    Parameter is updated in place (``.data``), so one shared by tied layers stays shared."""
    saved = {}
    for name in names:
        t = getattr(module, name)
        if t is not None and t.dtype == torch.float32:
            grad = t.grad if isinstance(t, torch.nn.Parameter) else None
            saved[name] = (t.detach(), None if grad is None else grad.detach())
    torch.nn.Module._apply(module, fn, recurse)
    for name, (data, grad) in saved.items():
        t = getattr(module, name)
        if t is None or t.dtype == torch.float32:
            continue
        kept = data.to(t.device)
        if isinstance(t, torch.nn.Parameter):
            t.data = kept
            if grad is not None and t.grad is not None:
                t.grad = grad.to(t.device)
        else:
            setattr(module, name, kept)


def _float_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``x W^T + b`` as a float product, in the input's dtype and connected to the graph, where the int8
    kernels have nothing to compute: an input without elements (the output is empty too, and backward gives
    zero gradients as ``nn.Linear`` does) and a meta input (output and gradients with their shapes and
    dtypes; torch.utils.flop_counter counts it as the float linear it stands for)."""
    return torch.nn.functional.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


# ---------------------------------------------------------------- LLM.int8()


class _Linear8bitLtFn(torch.autograd.Function):
    """Forward: the int8 decomposition. Backward (straight-through, as bitsandbytes): the input gradient
    ``grad @ W`` with the float (or dequantized int8) weight; the weight gradient only when fp weights are
    kept (``has_fp16_weights=True``)."""

    @staticmethod
    def forward(ctx, x, weight_fp, bias, w_q, w_scale, threshold):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        # LLM.int8's mixed-precision decomposition, one op (zero8._ops): the outlier columns, and so
        # the shapes of its float part, depend on the data.
        y = _ops.eager.llm_int8_matmul(x2, w_q, w_scale, weight_fp, threshold, bias, _GEMM)
        ctx.save_for_backward(x2 if weight_fp is not None and weight_fp.requires_grad else None, weight_fp, w_q,
                              w_scale)
        ctx.has_bias = bias is not None
        ctx.in_shape = shape
        return y.reshape(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x2, weight_fp, w_q, w_scale = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1]).float()
        w = weight_fp.float() if weight_fp is not None else w_q.float() * w_scale[:, None]
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g2 @ w).to(grad.dtype).reshape(ctx.in_shape)
        if ctx.needs_input_grad[1] and x2 is not None:
            grad_w = (g2.t() @ x2.float()).to(weight_fp.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b, None, None, None


class Linear8bitLt(torch.nn.Module):
    """LLM.int8() linear layer, with bitsandbytes' ``Linear8bitLt`` constructor and defaults:

    ``Linear8bitLt(input_features, output_features, bias=True, has_fp16_weights=True, threshold=0.0,
    index=None, device=None, dtype=None)``

    - ``has_fp16_weights=True`` (the default, as in bitsandbytes): the float ``weight`` Parameter is kept,
      trainable, and quantized at every forward. ``has_fp16_weights=False`` (inference): the weight is
      int8 with one scale per output row (``scale = max|W[j]| / 127``, codes ``round(W / scale)``), the
      Parameters ``weight`` (int8, out x in) and ``weight_scale`` (float32, out), frozen
      (``requires_grad=False``, as bitsandbytes' ``Int8Params``; ``requires_grad_(True)`` on an int8 tensor
      is torch's error).
    - activations: each row of the input quantized to int8 with its own absmax scale, int8 x int8 -> int32
      GEMM, output ``acc * row_scale * weight_scale (+ bias)``.
    - outliers: input columns (features) holding any ``|x| >= threshold`` leave the int8 path; their
      product with the weight columns is computed in float32 and added back (``threshold=0``, the default,
      or ``inf``: none). The LLM.int8 paper (and transformers' ``llm_int8_threshold``) uses 6.0:
      inference is ``Linear8bitLt(in, out, has_fp16_weights=False, threshold=6.0)``, what
      ``from_linear`` and ``convert_linear8bit`` make by default.
    - ``index``: accepted and kept as ``self.index``, unused, as in bitsandbytes.

    The state dict of an int8 layer holds ``weight`` (int8), ``weight_scale`` and ``bias``; it loads into a
    fresh ``Linear8bitLt(..., has_fp16_weights=False)`` of the same shape without any float weights. Also
    loaded: an ``nn.Linear`` state dict (its weight quantized on load), an int8 one into a layer with
    ``has_fp16_weights=True`` (dequantized), and bitsandbytes' int8 ``Linear8bitLt`` state dict (``weight``
    int8, ``SCB`` the per-row absmax, ``weight = int8 * SCB / 127``, ``weight_format`` 0 for row-major):
    ``weight_scale = SCB / 127``. ``bnb_state_dict(model)`` saves in bitsandbytes' form. ``.half()`` /
    ``.to(dtype)`` cast the bias (and a kept float weight) but leave ``weight_scale`` float32. Tensors of
    float32, bfloat16 or float16 on the CPU, or on a GPU in a build with CUDA (``.to("cuda")`` moves the int8
    weight and its scales; the integer products equal the CPU's); the output has the input's dtype, or under
    ``torch.autocast`` autocast's (the input is cast first, as for ``nn.Linear``). Bad inputs and malformed
    state dicts raise ``zero8.Zero8ValueError`` naming them.

    Made on the meta device (``device="meta"``, ``with torch.device("meta"):``), the layer holds shapes
    only until ``to_empty(device=...)`` + ``load_state_dict`` or ``load_state_dict(..., assign=True)``;
    until then a meta input gives a meta output (shapes and dtypes, backward too) and a real input raises.
    """

    def __init__(self, input_features: int, output_features: int, bias: bool = True,
                 has_fp16_weights: bool = True, threshold: float = 0.0, index=None, device=None,
                 dtype=None) -> None:
        super().__init__()
        _check_device_arg(device, "Linear8bitLt")
        if input_features <= 0 or output_features <= 0:
            raise Zero8ValueError(f"input_features and output_features must be > 0, got {input_features}, "
                                  f"{output_features}")
        if not (threshold >= 0):
            raise Zero8ValueError(f"threshold must be >= 0 (0 or inf: no outlier decomposition), got {threshold}")
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise Zero8ValueError(f"Linear8bitLt takes dtype float32, bfloat16 or float16, got {dtype}")
        self.in_features = input_features
        self.out_features = output_features
        self.threshold = float(threshold)
        self.has_fp16_weights = has_fp16_weights
        self.index = index
        w = torch.empty(output_features, input_features, dtype=dtype or torch.float32, device=device)
        torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))  # nn.Linear's initialisation
        # weight before bias, as nn.Linear and bitsandbytes: optimizer states are matched by parameter order.
        self._set_weight(w)
        if bias:
            bound = 1 / math.sqrt(input_features)
            b = torch.empty(output_features, dtype=dtype or torch.float32, device=device)
            self.bias = torch.nn.Parameter(b.uniform_(-bound, bound))
        else:
            self.register_parameter("bias", None)

    def _set_weight(self, w: Tensor) -> None:
        if self.has_fp16_weights:
            self.weight = torch.nn.Parameter(w)
            self.register_buffer("weight_scale", None)
            return
        # The int8 codes and their scales are frozen Parameters, as bitsandbytes' Int8Params: DDP sends them
        # once when it wraps the model (buffers it would broadcast from rank 0 at every forward), and
        # Module._apply moves a Parameter in place, so layers sharing one stay tied through .to() and
        # to_empty(). Optimizers skip them (no gradient); zero8's engine leaves frozen parameters out.
        if w.is_meta:
            # Created on the meta device: int8 codes and scales with shapes only, filled by a state dict.
            q = torch.empty(w.shape, dtype=torch.int8, device="meta")
            s = torch.empty(w.shape[0], dtype=torch.float32, device="meta")
        else:
            q, s = quantize_rows(w.detach().contiguous())
        self.weight = torch.nn.Parameter(q, requires_grad=False)
        self.weight_scale = torch.nn.Parameter(s, requires_grad=False)

    def _apply(self, fn, recurse=True):
        # model.half() / .to(torch.bfloat16) cast every floating tensor; the per-row scales are part of the
        # int8 format (the kernels read float32), so they keep float32 and only follow a device move.
        _keep_float32(self, ("weight_scale",), fn, recurse)
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # A checkpoint in the other weight format is converted (torch would cast a float weight to int8
        # codes, or int8 codes to float weights, without a word): a float weight without scales (an
        # nn.Linear's) is quantized by rows as from_linear does; int8 codes with their scales are dequantized
        # for a layer that keeps float weights; bitsandbytes' SCB become weight_scale. Other shapes are left
        # to torch's size check.
        wkey, skey = prefix + "weight", prefix + "weight_scale"
        _bnb_scales_to_zero8(state_dict, prefix)
        w = state_dict.get(wkey)
        if isinstance(w, Tensor) and w.dtype == torch.int8 and skey not in state_dict:
            # Else strict=False would decode them with the layer's old scales, silently wrong.
            raise Zero8ValueError(f"{wkey} holds int8 codes but the state dict has no per-row scales for them: "
                                  f"{skey} (zero8) or {prefix}SCB (bitsandbytes)")
        shape = (self.out_features, self.in_features)
        if isinstance(w, Tensor) and tuple(w.shape) == shape:
            if not self.has_fp16_weights and w.is_floating_point() and skey not in state_dict:
                check_device(w, wkey)
                state_dict[wkey], state_dict[skey] = quantize_rows(w.detach().float())
            elif self.has_fp16_weights and w.dtype == torch.int8 and isinstance(state_dict.get(skey), Tensor):
                scale = state_dict.pop(skey)
                state_dict[wkey] = w.float() * scale.float()[:, None]
        # The scales stay float32 (the kernels read float32): load_state_dict(..., assign=True) takes the
        # checkpoint's tensor as it is, where copying into the layer's tensor would have converted it.
        scale = state_dict.get(skey)
        if not self.has_fp16_weights and isinstance(scale, Tensor) and scale.is_floating_point():
            state_dict[skey] = scale.float()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, threshold: float = 6.0,
                    has_fp16_weights: bool = False) -> "Linear8bitLt":
        """An int8 copy of a trained ``nn.Linear`` (its weight quantized by rows, its bias kept). Its
        defaults are inference's (int8 weights, the paper's threshold 6.0), not the constructor's."""
        m = cls.__new__(cls)
        torch.nn.Module.__init__(m)
        if not (threshold >= 0):
            raise Zero8ValueError(f"threshold must be >= 0, got {threshold}")
        m.in_features, m.out_features = linear.in_features, linear.out_features
        m.threshold = float(threshold)
        m.has_fp16_weights = has_fp16_weights
        m.index = None
        if not linear.weight.is_meta:
            check_device(linear.weight, "linear.weight")
        _check_weight(linear.weight, "linear.weight")
        m._set_weight(linear.weight.detach().clone())
        if has_fp16_weights:
            m.weight.requires_grad_(linear.weight.requires_grad)  # a frozen weight stays frozen
        if linear.bias is not None:
            m.bias = torch.nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
        else:
            m.register_parameter("bias", None)
        return m

    def weight_bytes(self) -> int:
        """Bytes of the stored weight (int8 codes + float32 scales, or the float weight)."""
        n = self.weight.numel() * self.weight.element_size()
        return n + (self.weight_scale.numel() * 4 if self.weight_scale is not None else 0)

    def forward(self, x: Tensor) -> Tensor:
        names = ("weight", "weight_scale", "bias")
        meta = _is_meta_call(self, x, names)
        if not meta:
            _check_loaded(self, "Linear8bitLt", names)
        _check_input(x, self.in_features, meta=meta)
        if not meta:
            _check_layer_tensors(self, "Linear8bitLt", names, x)
        x = _autocast_input(x)
        if meta or x.numel() == 0:  # shapes only, or an empty batch kept in the graph: the float product
            w = self.weight if self.has_fp16_weights else x.new_zeros(()).expand(self.out_features, self.in_features)
            return _float_linear(x, w, self.bias)
        if self.has_fp16_weights:
            _check_weight(self.weight, "Linear8bitLt.weight")
            w_q, w_s = quantize_rows(self.weight.detach())
            w_fp = self.weight
        else:
            w_q, w_s, w_fp = self.weight, self.weight_scale, None
        return _Linear8bitLtFn.apply(x, w_fp, self.bias, w_q, w_s, self.threshold)

    def extra_repr(self) -> str:
        return (f"input_features={self.in_features}, output_features={self.out_features}, "
                f"bias={self.bias is not None}, has_fp16_weights={self.has_fp16_weights}, "
                f"threshold={self.threshold}")


# ---------------------------------------------------------------- bitsandbytes' int8 state dicts

# bitsandbytes' weight_format codes (bitsandbytes/utils.py); only row-major is a plain out x in matrix, the
# others are GPU tile layouts that bitsandbytes >= 0.45 refuses to load too.
_BNB_WEIGHT_FORMATS = {0: "row", 1: "col32", 2: "col_turing", 3: "col_ampere"}


def _bnb_scales_to_zero8(state_dict, prefix: str) -> None:
    """bitsandbytes' int8 ``Linear8bitLt`` saves ``weight`` (int8 codes, row-major), ``SCB`` (each output
    row's absmax: ``weight = codes * SCB / 127``) and ``weight_format``; zero8's scale is ``SCB / 127``
    (``absmax / 127`` in float32, as the kernels compute it). Replaces them in ``state_dict`` by
    ``weight_scale``; malformed entries raise naming the key."""
    wkey, skey, bkey, fkey = prefix + "weight", prefix + "weight_scale", prefix + "SCB", prefix + "weight_format"
    if fkey in state_dict:
        fmt = state_dict.pop(fkey)
        value = fmt
        if isinstance(fmt, Tensor):
            value = fmt.item() if fmt.numel() == 1 and not fmt.is_floating_point() else None
        name = _BNB_WEIGHT_FORMATS.get(value, value) if isinstance(value, int) else value
        if name != "row":
            known = f" ({name})" if isinstance(value, int) and name != value else ""
            raise Zero8ValueError(f"{fkey} is {fmt!r}{known}: only bitsandbytes' row-major int8 weight (0 or 'row') "
                                  f"loads, as in bitsandbytes >= 0.45 (col32/col_turing/col_ampere are GPU tile "
                                  f"layouts)")
    if bkey not in state_dict:
        return
    scb = state_dict.pop(bkey)
    w = state_dict.get(wkey)
    if skey in state_dict:
        raise Zero8ValueError(f"the state dict has both {skey} (zero8's per-row scales) and {bkey} "
                              f"(bitsandbytes'): one layer has one set of scales")
    if not (isinstance(w, Tensor) and w.dtype == torch.int8 and w.dim() == 2):
        got = f"dtype {w.dtype}, shape {tuple(w.shape)}" if isinstance(w, Tensor) else "nothing"
        raise Zero8ValueError(f"{bkey} (bitsandbytes' per-row absmax) scales the int8 codes of {wkey}, a 2-D "
                              f"int8 tensor; got {got}")
    if not (isinstance(scb, Tensor) and scb.is_floating_point() and scb.dim() == 1 and scb.numel() == w.shape[0]):
        got = f"dtype {scb.dtype}, shape {tuple(scb.shape)}" if isinstance(scb, Tensor) else type(scb).__name__
        raise Zero8ValueError(f"{bkey} must be a 1-D float tensor of {w.shape[0]} per-row absmax values (one per "
                              f"row of {wkey}); got {got}")
    state_dict[skey] = scb.detach().float() / 127


def bnb_state_dict(model: torch.nn.Module) -> dict:
    """``model.state_dict()`` with the scales of each int8 ``Linear8bitLt`` (``has_fp16_weights=False``) in
    bitsandbytes' form: ``SCB = weight_scale * 127`` (the per-row absmax) and ``weight_format`` (0,
    row-major) instead of ``weight_scale``. A bitsandbytes model of int8 ``Linear8bitLt`` layers, quantized
    before loading as bitsandbytes requires (``has_fp16_weights=False``, then ``.to(device)``), loads it
    with ``load_state_dict``; zero8 loads it too. ``model.state_dict()`` keeps ``weight_scale``: its round
    trip is bit for bit, where ``SCB / 127`` may give back a scale one float32 ulp away."""
    sd = model.state_dict()
    for name, mod in model.named_modules(remove_duplicate=False):
        if isinstance(mod, Linear8bitLt) and not mod.has_fp16_weights:
            prefix = name + "." if name else ""
            scale = sd.pop(prefix + "weight_scale")
            sd[prefix + "SCB"] = (scale.double() * 127).float()
            sd[prefix + "weight_format"] = torch.tensor(0, dtype=torch.uint8)
    return sd


def _skipped(name: str, skip: Iterable[str]) -> bool:
    # A module is skipped when an entry names it fully, names one of its parents, or is its last
    # component(s) ("lm_head" skips "model.lm_head"), as bitsandbytes' llm_int8_skip_modules matches names.
    for s in skip:
        if name == s or name.endswith("." + s) or name.startswith(s + "."):
            return True
    return False


def _replaceable(mod: torch.nn.Module) -> bool:
    # nn.Linear itself or a subclass that keeps its forward (a subclass with its own forward would lose it).
    return isinstance(mod, torch.nn.Linear) and type(mod).forward is torch.nn.Linear.forward


def convert_linear8bit(model: torch.nn.Module, threshold: float = 6.0, skip: Sequence[str] = (),
                       has_fp16_weights: bool = False) -> torch.nn.Module:
    """Replace every ``torch.nn.Linear`` of ``model`` (in place) by a ``Linear8bitLt`` holding its weight
    in int8, except the modules named in ``skip`` (full dotted names, parents, or trailing components
    such as ``"lm_head"``). Returns ``model``; a bare ``nn.Linear`` cannot be replaced in place, so its
    ``Linear8bitLt`` copy is returned instead.

    Left as they are: the ``out_proj`` of ``nn.MultiheadAttention`` (the attention reads its weight
    directly instead of calling it) and subclasses of ``nn.Linear`` that define their own ``forward``.

    Frozen parameters stay frozen. Linears sharing one weight stay tied: they share the int8 weight and
    its scales, frozen Parameters that ``.to()`` and ``to_empty()`` move in place (or, with
    ``has_fp16_weights``, the float weight). A weight shared with a module that is
    not converted (an embedding tied to ``lm_head``) cannot stay tied to an int8 copy: that is warned
    about, naming both; skip the linear to keep the tie."""
    if isinstance(skip, str):
        skip = [skip]
    skip = list(skip)
    if _replaceable(model) and not _skipped("", skip):
        return Linear8bitLt.from_linear(model, threshold=threshold, has_fp16_weights=has_fp16_weights)
    attention = {name for name, mod in model.named_modules() if isinstance(mod, torch.nn.MultiheadAttention)}
    targets = [(name, mod) for name, mod in model.named_modules()
               if _replaceable(mod) and name and not _skipped(name, skip)
               and name.rpartition(".")[0] not in attention]
    converted_weights = {id(lin.weight) for _, lin in targets}
    owners: dict = {}  # id of a weight to be converted -> names of every parameter slot holding it
    for pname, p in model.named_parameters(remove_duplicate=False):
        if id(p) in converted_weights:
            owners.setdefault(id(p), []).append(pname)
    target_names = {name + ".weight" for name, _ in targets}
    for names in owners.values():
        kept = [n for n in names if n not in target_names]
        if kept:
            warnings.warn(f"convert_linear8bit: {', '.join(n for n in names if n in target_names)} shares its weight "
                          f"with {', '.join(kept)}, which is not converted; the int8 copy no longer follows it "
                          f"(skip the linear to keep the tie)", stacklevel=2)
    made: dict = {}  # id of a float weight -> the first Linear8bitLt made from it
    for name, lin in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = Linear8bitLt.from_linear(lin, threshold=threshold, has_fp16_weights=has_fp16_weights)
        first = made.setdefault(id(lin.weight), new)
        if first is not new:  # tied linears share the converted weight, as they shared the float one
            new.weight = first.weight
            if not has_fp16_weights:
                new.weight_scale = first.weight_scale
        setattr(parent, child, new)
    return model
