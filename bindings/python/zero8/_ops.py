"""The int8 kernels of zero8._C as torch custom ops (namespace ``zero8``), so that ``torch.compile`` traces
the int8 layers in one graph: each op runs its kernel as one opaque call, and its fake function gives the
output shapes and dtypes without running it (FakeTensor tracing, meta tensors). The ops that multiply
matrices also have a FLOP formula, for ``torch.utils.flop_counter.FlopCounterMode``, which cannot see into them.

The kernels take raw pointers and sizes, so a tensor smaller than the sizes say, or of another dtype, is read
or written past its end (garbage, a crash, corrupted memory), not an error. Each op therefore checks the
device, dtype and shape of every tensor it hands a kernel, whoever calls it (zero8.nn's primitives or
``torch.ops.zero8.*`` directly), and raises Zero8ValueError naming the argument. The ops take CPU tensors, or
CUDA tensors in a build with CUDA, all on one device, and make 2-D operands contiguous (no copy when they
are). On a GPU the ops queue zero8's CUDA kernels on torch's current stream (the same codes, scales and
epilogue bits as the CPU) and multiply with ``torch._int_mm`` (cuBLASLt, exact int32 products), whatever
``gemm`` says. Stochastic rounding takes its seed as a one-element int64 tensor the caller draws from torch's
generator, so the ops are pure functions of their inputs (the compiler may neither merge two draws nor
replay one) and eager and compiled runs see the same seeds. ``gemm`` arguments ("torch" or "zero8") say
which int8 GEMM a composite op calls (``linear8bit.set_int8_gemm_backend``); both give the same int32
products. ``torch.autocast`` does not reach inside the ops: their float arithmetic is float32 (LLM.int8's
outlier product is added by the epilogue, which reads float32).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from . import _C
from ._C import Zero8NotSupportedError, Zero8ValueError
from . import _tensors
from ._tensors import (FLOAT_DTYPES, PLAIN_TENSORS, EagerOp, check_device, check_dtype, check_not_dtensor,
                       check_same_device, cuda_stream, dtype_code, on_device, ptr)

__all__ = [
    "int8_quantize_rows",
    "int8_quantize_cols",
    "int8_quantize_blocks",
    "int8_dequantize_blocks",
    "int8_gemm",
    "int8_dequantize_matmul",
    "int8_block_matmul",
    "int8_block_matmul_sliced",
    "llm_int8_matmul",
]


# The longest reduction one int8 GEMM takes: its int32 sum of k products of codes in [-127, 127] cannot
# overflow while 127 * 127 * k < 2^31. zero8's CPU GEMM refuses more; torch._int_mm and cuBLASLt would wrap
# around without a word. mm_dequantize splits longer reductions.
INT8_GEMM_MAX_K = 131071


def _cdiv(a, b):
    return -(-a // b)


# ---------------------------------------------------------------- argument checks (every op, before its kernel)
#
# The kernels read raw pointers: each op checks every tensor it hands one and names it in the error. A tensor
# is checked against its op's reference tensor (the input, or acc) for device, dtype and exact shape in one test
# in the common case; zero8._tensors' checks run only to word an error. The others' devices are compared with
# the reference's before that device itself is checked, so that a tensor elsewhere is named as such (a kernel
# on one device reading another's address is the worst of the mistakes).

_F32, _I8, _I32, _U8 = (torch.float32,), (torch.int8,), (torch.int32,), (torch.uint8,)
_ANY_FLOAT = FLOAT_DTYPES + (torch.float64,)  # a bias: the ops pass bias.float() to the kernels


def _ref(t, name: str, dtypes: tuple) -> None:
    """The reference tensor's dtype and rank (a matrix); its device is checked after the others'."""
    if type(t) in PLAIN_TENSORS and t.layout == torch.strided and t.dtype in dtypes and t.dim() == 2:
        return
    check_dtype(t, name, dtypes)
    if t.dim() != 2:
        raise Zero8ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")


def _arg(t, name: str, dtypes: tuple, shape: Optional[tuple], ref: Tensor, ref_name: str) -> None:
    """``t``: a dense tensor on ``ref``'s device, of one of ``dtypes`` and of exactly ``shape`` (None: any)."""
    if (type(t) in PLAIN_TENSORS and t.layout == torch.strided and t.device == ref.device and t.dtype in dtypes
            and (shape is None or t.shape == shape)):
        return
    check_same_device(t, name, ref, ref_name)
    check_not_dtensor(t, name)
    check_dtype(t, name, dtypes)
    if shape is not None and t.shape != shape:
        raise Zero8ValueError(f"{name} has shape {tuple(t.shape)}; expected {shape}")


def _check_block(block) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= 65536:
        raise Zero8ValueError(f"block must be an int in 1..65536, got {block!r}")


def _check_float_dtype(dtype, name: str) -> None:
    if dtype not in FLOAT_DTYPES:
        raise Zero8ValueError(f"{name} must be float32, bfloat16 or float16, got {dtype}")


def _check_seed(seed: Optional[Tensor], x: Tensor) -> None:
    if seed is None:
        return
    if not isinstance(seed, Tensor) or seed.dtype != torch.int64 or seed.numel() != 1:
        got = f"dtype {seed.dtype}, shape {tuple(seed.shape)}" if isinstance(seed, Tensor) else type(seed).__name__
        raise Zero8ValueError(f"seed must be a one-element int64 tensor, got {got}")
    if x.is_cuda:
        with on_device(x):
            capturing = torch.cuda.is_current_stream_capturing()
        if capturing:
            # The kernels take the seed as a launch argument read on the host: a CUDA graph would capture
            # this one draw and replay it at every step, the same rounding noise each time (biased).
            raise Zero8NotSupportedError(
                "stochastic rounding (Int8Linear's backward, quantize_*(stochastic=True)) cannot be captured in "
                "a CUDA graph: its seed is read on the host when the kernel is queued, so every replay would "
                "reuse the captured one. Capture the forward only, or run the backward outside the graph")


def check_quantize(x: Tensor, col_mask: Optional[Tensor] = None, seed: Optional[Tensor] = None,
                   block: Optional[int] = None) -> None:
    """The arguments of the quantizers: a float matrix ``x``, a uint8 mask of its columns, a seed, a block."""
    if block is not None:
        _check_block(block)
    _ref(x, "x", FLOAT_DTYPES)
    if col_mask is not None:
        _arg(col_mask, "col_mask", _U8, None, x, "x")
        if col_mask.numel() != x.shape[1]:
            raise Zero8ValueError(f"col_mask has {col_mask.numel()} elements; x has {x.shape[1]} columns")
    check_device(x, "x")
    _check_seed(seed, x)


def check_dequantize_blocks(q: Tensor, scale: Tensor, block: int, dtype: torch.dtype) -> None:
    """The arguments of ``int8_dequantize_blocks``: ``scale`` as quantize_blocks made it for ``q``."""
    _check_block(block)
    _ref(q, "q", _I8)
    _arg(scale, "scale", _F32, (_cdiv(q.shape[0], block), _cdiv(q.shape[1], block)), q, "q")
    check_device(q, "q")
    _check_float_dtype(dtype, "dtype")


def check_gemm(a: Tensor, b: Tensor, b_trans: bool) -> None:
    """The operands of one int8 GEMM: ``a`` (m x k) and ``b`` (n x k, or k x n without ``b_trans``), k at most
    INT8_GEMM_MAX_K."""
    _ref(a, "a", _I8)
    _arg(b, "b", _I8, None, a, "a")
    k = b.shape[1] if b.dim() == 2 and b_trans else b.shape[0] if b.dim() == 2 else -1
    if k != a.shape[1]:
        raise Zero8ValueError(f"inner sizes differ: a {tuple(a.shape)}, b {tuple(b.shape)} (b_trans={b_trans})")
    if k > INT8_GEMM_MAX_K:
        raise Zero8ValueError(f"k = {k} exceeds {INT8_GEMM_MAX_K}, beyond which the int32 sum of products of int8 "
                              f"codes can overflow: split k (zero8._ops.mm_dequantize sums the parts in int64)")
    check_device(a, "a")


def check_epilogue(acc: Tensor, row_scale: Tensor, col_scale: Tensor, add: Optional[Tensor], bias: Optional[Tensor],
                   out: Optional[Tensor], out_dtype: torch.dtype, accumulate: bool, row_group: int, row_stride: int,
                   col_group: int, col_stride: int) -> None:
    """The arguments of the epilogue (``int8_dequantize_matmul``, ``linear8bit.dequantize_matmul``); ``out``
    None where the op makes it, of ``out_dtype``. The scales are read as ``s[(i // group) * stride]`` from
    their first element: each must be a 1-D view of exactly those elements, ``ceil(n / group)`` of them with
    that stride (a column of a block-scale matrix is one)."""
    _ref(acc, "acc", _I32)
    rows, cols = acc.shape
    for v, name in ((row_group, "row_group"), (row_stride, "row_stride"), (col_group, "col_group"),
                    (col_stride, "col_stride")):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise Zero8ValueError(f"{name} must be an int >= 1, got {v!r}")
    for s, name, n, stride in ((row_scale, "row_scale", _cdiv(rows, row_group), row_stride),
                               (col_scale, "col_scale", _cdiv(cols, col_group), col_stride)):
        _arg(s, name, _F32, (n,), acc, "acc")
        if n > 1 and s.stride(0) != stride:
            raise Zero8ValueError(f"{name} has stride {s.stride(0)}, but the epilogue is told to read it with "
                                  f"stride {stride}")
    if add is not None:  # read as float32, element for element with acc
        _arg(add, "add", _F32, (rows, cols), acc, "acc")
    if bias is not None:
        _arg(bias, "bias", _ANY_FLOAT, (cols,), acc, "acc")
    if out is not None:
        _arg(out, "out", _F32 if accumulate else FLOAT_DTYPES, (rows, cols), acc, "acc")
        if not out.is_contiguous():
            raise Zero8ValueError(f"out must be contiguous (the epilogue writes it row-major), got strides "
                                  f"{out.stride()}")
    check_device(acc, "acc")
    if out is None:
        _check_float_dtype(out_dtype, "out_dtype")


def check_block_matmul(qa: Tensor, sa: Tensor, qb_t: Tensor, sb_t: Tensor, block: int, out_dtype: torch.dtype,
                       bias: Optional[Tensor]) -> None:
    """The arguments of a per-block product (``int8_block_matmul``, ``blockwise_int8_matmul``): each scale
    matrix as quantize_blocks made it for its operand."""
    _check_block(block)
    _ref(qa, "qa", _I8)
    m, k = qa.shape
    _arg(sa, "sa", _F32, (_cdiv(m, block), _cdiv(k, block)), qa, "qa")
    _arg(qb_t, "qb_t", _I8, None, qa, "qa")
    _ref(qb_t, "qb_t", _I8)
    n, kb = qb_t.shape
    _arg(sb_t, "sb_t", _F32, (_cdiv(n, block), _cdiv(kb, block)), qb_t, "qb_t")
    if kb != k:
        raise Zero8ValueError(f"qa (m x k) and qb_t (n x k) must have the same k, got shapes {tuple(qa.shape)} and "
                              f"{tuple(qb_t.shape)}")
    if bias is not None:
        _arg(bias, "bias", _ANY_FLOAT, (n,), qa, "qa")
    check_device(qa, "qa")
    _check_float_dtype(out_dtype, "out_dtype")


def check_llm_int8_matmul(x: Tensor, w_q: Tensor, w_scale: Tensor, w_fp: Optional[Tensor],
                          bias: Optional[Tensor]) -> None:
    """The arguments of LLM.int8's product: ``w_q`` (n x k) int8 with its n float32 scales, the float weight
    when kept, a bias of n."""
    _ref(x, "x", FLOAT_DTYPES)
    _arg(w_q, "w_q", _I8, None, x, "x")
    if w_q.dim() != 2 or w_q.shape[1] != x.shape[1]:
        raise Zero8ValueError(f"w_q has shape {tuple(w_q.shape)}; expected (n, {x.shape[1]}) for x's columns")
    n, k = w_q.shape
    _arg(w_scale, "w_scale", _F32, (n,), x, "x")
    if w_fp is not None:
        _arg(w_fp, "w_fp", FLOAT_DTYPES, (n, k), x, "x")
    if bias is not None:
        _arg(bias, "bias", _ANY_FLOAT, (n,), x, "x")
    check_device(x, "x")


def _seed_of(seed: Optional[Tensor]) -> int:
    return int(seed.item()) if seed is not None else 0


def _run(t: Tensor, name: str, *args):
    """``_C.<name>(*args)`` for CPU tensors, or ``_C.<name>_cuda(*args)`` on t's GPU, queued on torch's
    current stream (the CUDA entries take the CPU ones' arguments, less the thread count, plus the stream). The
    ops' checks have put every tensor whose data the arguments point at on t's device, or made it there, so the
    entry takes the pointers on trust (``pointers_checked``: no driver query per pointer)."""
    if t.is_cuda:
        with on_device(t):
            return getattr(_C, name + "_cuda")(*args, stream=cuda_stream(t), pointers_checked=True)
    return getattr(_C, name)(*args)


# ---------------------------------------------------------------- kernels (eager bodies of the ops)
#
# Each op's body checks its arguments, then calls the function below it, which does not: the ops' bodies call
# one another's unchecked functions, the arguments being checked already (a second op dispatch costs about
# 13 us, a second check a few).


def _quantize_rows(x: Tensor, col_mask: Optional[Tensor], seed: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    check_quantize(x, col_mask, seed)
    return _quantize_rows_unchecked(x, col_mask, seed)


def _quantize_rows_unchecked(x: Tensor, col_mask: Optional[Tensor], seed: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    x = x.contiguous()
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=torch.int8, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    mask = col_mask.contiguous() if col_mask is not None else None  # held until the kernel has read it
    _run(x, "int8_quantize_rows", ptr(x), dtype_code(x), rows, cols, ptr(q), ptr(scale),
         ptr(mask) if mask is not None else 0, seed is not None, _seed_of(seed))
    return q, scale


def _quantize_cols(x: Tensor, seed: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    check_quantize(x, seed=seed)
    x = x.contiguous()
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=torch.int8, device=x.device)
    scale = torch.empty(cols, dtype=torch.float32, device=x.device)
    _run(x, "int8_quantize_cols", ptr(x), dtype_code(x), rows, cols, ptr(q), ptr(scale), seed is not None,
         _seed_of(seed))
    return q, scale


def _quantize_blocks(x: Tensor, block: int, seed: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    check_quantize(x, seed=seed, block=block)
    x = x.contiguous()
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=torch.int8, device=x.device)
    scale = torch.empty((_cdiv(rows, block), _cdiv(cols, block)), dtype=torch.float32, device=x.device)
    _run(x, "int8_quantize_blocks", ptr(x), dtype_code(x), rows, cols, block, block, ptr(q), ptr(scale),
         seed is not None, _seed_of(seed))
    return q, scale


def _dequantize_blocks(q: Tensor, scale: Tensor, block: int, dtype: torch.dtype) -> Tensor:
    check_dequantize_blocks(q, scale, block, dtype)
    q, scale = q.contiguous(), scale.contiguous()
    rows, cols = q.shape
    y = torch.empty((rows, cols), dtype=dtype, device=q.device)
    _run(q, "int8_dequantize_blocks", ptr(q), ptr(scale), rows, cols, block, block, ptr(y), dtype_code(y))
    return y


def _gemm(a: Tensor, b: Tensor, b_trans: bool) -> Tensor:
    check_gemm(a, b, b_trans)
    return _gemm_unchecked(a, b, b_trans)


def _gemm_unchecked(a: Tensor, b: Tensor, b_trans: bool) -> Tensor:
    # zero8's int8 GEMM (oneDNN, or the scalar reference; cuBLASLt on a GPU): row-major operands.
    if a.is_cuda:
        return _gemm_cuda(a, b if b_trans else b.t())
    a, b = a.contiguous(), b.contiguous()
    n = b.shape[0] if b_trans else b.shape[1]
    c = torch.empty((a.shape[0], n), dtype=torch.int32)
    _C.int8_gemm(ptr(a), ptr(b), ptr(c), a.shape[0], n, a.shape[1], b_trans)
    return c


def _round_up(v: int, m: int) -> int:
    return _cdiv(v, m) * m


def _int_mm_cuda(a: Tensor, b_t: Tensor) -> Tensor:
    """int32 ``a @ b_t.T`` on a GPU through ``torch._int_mm`` (cuBLASLt), exact: ``a`` (m x k) row-major and
    ``b_t`` (n x k) row-major, the form of ``x @ W.T`` that cuBLASLt's int8 kernels take ("TN"), made so
    with copies when the operands are views. torch._int_mm needs m > 16 and k, n multiples of 8, and its
    own tests go no lower than 16 for k and n: other shapes are padded with zero rows and columns to those,
    which add nothing to the products, and the result cut back."""
    m, k = a.shape
    n = b_t.shape[0]
    if m == 0 or n == 0 or k == 0:
        return torch.zeros((m, n), dtype=torch.int32, device=a.device)
    mp, kp, np_ = max(m, 17), max(_round_up(k, 8), 16), max(_round_up(n, 8), 16)
    a, b_t = a.contiguous(), b_t.contiguous()
    if (mp, kp) != (m, k):
        a = torch.nn.functional.pad(a, (0, kp - k, 0, mp - m))
    if (np_, kp) != (n, k):
        b_t = torch.nn.functional.pad(b_t, (0, kp - k, 0, np_ - n))
    c = torch._int_mm(a, b_t.t())
    return c if (mp, np_) == (m, n) else c[:m, :n].contiguous()


def _gemm_cuda(a: Tensor, b_t: Tensor) -> Tensor:
    """int32 ``a @ b_t.T`` through zero8's cuBLASLt GEMM (``_C.int8_gemm_cuda``), which takes the TN form with k
    and n multiples of 4: padded with zeros as _int_mm_cuda pads. The layers multiply with torch._int_mm;
    this is the ``zero8::int8_gemm`` op on CUDA tensors."""
    m, k = a.shape
    n = b_t.shape[0]
    kp, np_ = _round_up(k, 4), _round_up(n, 4)
    a, b_t = a.contiguous(), b_t.contiguous()
    if kp != k:
        a = torch.nn.functional.pad(a, (0, kp - k))
    if (np_, kp) != (n, k):
        b_t = torch.nn.functional.pad(b_t, (0, kp - k, 0, np_ - n))
    c = torch.empty((m, np_), dtype=torch.int32, device=a.device)
    _run(a, "int8_gemm", ptr(a), ptr(b_t), ptr(c), m, np_, kp, True)
    return c if np_ == n else c[:, :n].contiguous()


def _mm(a: Tensor, b: Tensor, gemm: str, b_trans: bool = True, in_op: bool = False) -> Tensor:
    """int32 ``a @ b.T`` (``b_trans``) or ``a @ b`` through the chosen GEMM, for k <= INT8_GEMM_MAX_K. Traceable
    (torch ops and the ``int8_gemm`` op), so the layers' backward may call it under torch.compile; ``in_op``:
    called from an op's body (eager), which calls the kernel's body instead of dispatching an op again (about
    13 us each)."""
    if a.is_cuda:
        return _int_mm_cuda(a, b if b_trans else b.t())
    if gemm == "torch":
        return torch._int_mm(a, b.t() if b_trans else b)
    return _gemm_unchecked(a, b, b_trans) if in_op else int8_gemm(a, b, b_trans)


def mm_dequantize(qa: Tensor, qb: Tensor, b_trans: bool, row_scale: Tensor, col_scale: Tensor, out_dtype: torch.dtype,
                  add: Optional[Tensor], bias: Optional[Tensor], gemm: str, in_op: bool = False) -> Tensor:
    """``float(qa @ qb.T) * (row_scale[i] * col_scale[j]) (+ add) (+ bias)`` as ``out_dtype`` (``qb`` not
    transposed without ``b_trans``): an int8 GEMM and its epilogue, traceable. A reduction longer than
    INT8_GEMM_MAX_K (the weight gradient's over more than 131071 tokens) is cut into GEMMs of at most that,
    their int32 products summed exactly in int64, and the epilogue's arithmetic (float32 of the sum times
    the scale product, then + add, + bias) done on that sum by torch ops. ``in_op`` as for ``_mm``; an eager
    call that ``_tensors.direct`` allows runs the same way."""
    in_op = in_op or _tensors.direct((qa, qb, row_scale, col_scale, add, bias))
    k = qa.shape[1]
    if k <= INT8_GEMM_MAX_K:
        # (In an op's body the epilogue's body, still checked: it is where `add`, computed by the caller, is read.)
        epilogue = _dequantize_matmul if in_op else int8_dequantize_matmul
        return epilogue(_mm(qa, qb, gemm, b_trans, in_op), row_scale, col_scale, out_dtype, add, bias, 1, 1, 1, 1)
    acc = None
    for k0 in range(0, k, INT8_GEMM_MAX_K):
        k1 = min(k, k0 + INT8_GEMM_MAX_K)
        part = _mm(qa[:, k0:k1], qb[:, k0:k1] if b_trans else qb[k0:k1], gemm, b_trans, in_op).to(torch.int64)
        acc = part if acc is None else acc + part
    y = acc.to(torch.float32) * (row_scale.float()[:, None] * col_scale.float()[None, :])
    if add is not None:
        y = y + add
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def _dequantize_matmul_into(acc: Tensor, row_scale: Tensor, col_scale: Tensor, add: Optional[Tensor],
                            bias: Optional[Tensor], out: Tensor, accumulate: bool, row_group: int, row_stride: int,
                            col_group: int, col_stride: int) -> Tensor:
    # The epilogue writing (or, with accumulate, adding into) `out`. The scales are read from their first
    # element as row_scale[(i // row_group) * row_stride]: a column view of a block-scale matrix is
    # passed as it is, with its stride.
    check_epilogue(acc, row_scale, col_scale, add, bias, out, out.dtype, accumulate, row_group, row_stride, col_group,
                   col_stride)
    return _dequantize_matmul_into_unchecked(acc, row_scale, col_scale, add, bias, out, accumulate, row_group,
                                             row_stride, col_group, col_stride)


def _dequantize_matmul_into_unchecked(acc: Tensor, row_scale: Tensor, col_scale: Tensor, add: Optional[Tensor],
                                      bias: Optional[Tensor], out: Tensor, accumulate: bool, row_group: int,
                                      row_stride: int, col_group: int, col_stride: int) -> Tensor:
    acc = acc.contiguous()
    rows, cols = acc.shape
    if bias is not None:
        bias = bias.float().contiguous()
    if add is not None:
        add = add.contiguous()
    _run(acc, "int8_dequantize_matmul", ptr(acc), rows, cols, ptr(row_scale), row_group, row_stride, ptr(col_scale),
         col_group, col_stride, ptr(add) if add is not None else 0, ptr(bias) if bias is not None else 0, ptr(out),
         dtype_code(out), accumulate)
    return out


def _dequantize_matmul(acc: Tensor, row_scale: Tensor, col_scale: Tensor, out_dtype: torch.dtype,
                       add: Optional[Tensor], bias: Optional[Tensor], row_group: int, row_stride: int,
                       col_group: int, col_stride: int) -> Tensor:
    check_epilogue(acc, row_scale, col_scale, add, bias, None, out_dtype, False, row_group, row_stride, col_group,
                   col_stride)
    return _dequantize_matmul_unchecked(acc, row_scale, col_scale, out_dtype, add, bias, row_group, row_stride,
                                        col_group, col_stride)


def _dequantize_matmul_unchecked(acc: Tensor, row_scale: Tensor, col_scale: Tensor, out_dtype: torch.dtype,
                                 add: Optional[Tensor], bias: Optional[Tensor], row_group: int, row_stride: int,
                                 col_group: int, col_stride: int) -> Tensor:
    out = torch.empty(tuple(acc.shape), dtype=out_dtype, device=acc.device)
    return _dequantize_matmul_into_unchecked(acc, row_scale, col_scale, add, bias, out, False, row_group,
                                             row_stride, col_group, col_stride)


def int8_block_matmul_sliced(qa: Tensor, sa: Tensor, qb_t: Tensor, sb_t: Tensor, block: int,
                             out_dtype: torch.dtype, bias: Optional[Tensor], gemm: str) -> Tensor:
    """The per-block product through a library GEMM: one int8 GEMM per ``block``-wide slice of k, each
    int32 result dequantized by its row-block and column-block scales and accumulated into a float32
    output (the epilogue's ``out + float(acc) * (sa * sb)``), then ``+ bias``. The same bits as the fused
    kernel (tested); used where that kernel cannot run (no AVX512_VNNI)."""
    check_block_matmul(qa, sa, qb_t, sb_t, block, out_dtype, bias)
    return _block_matmul_sliced_unchecked(qa, sa, qb_t, sb_t, block, out_dtype, bias, gemm)


def _block_matmul_sliced_unchecked(qa: Tensor, sa: Tensor, qb_t: Tensor, sb_t: Tensor, block: int,
                                   out_dtype: torch.dtype, bias: Optional[Tensor], gemm: str) -> Tensor:
    m, k = qa.shape
    n = qb_t.shape[0]
    nkb = sa.shape[1]
    sa = sa.contiguous()
    sb_t = sb_t.contiguous()
    out = torch.zeros((m, n), dtype=torch.float32, device=qa.device)
    for s in range(nkb):
        k0, k1 = s * block, min(k, (s + 1) * block)
        acc = _mm(qa[:, k0:k1].contiguous(), qb_t[:, k0:k1].contiguous(), gemm, in_op=True)
        _dequantize_matmul_into_unchecked(acc, sa[:, s], sb_t[:, s], None, None, out, True, block, nkb, block, nkb)
    if bias is not None:
        out += bias.float()
    return out if out_dtype == torch.float32 else out.to(out_dtype)


def _as_stored(q: Tensor, s: Tensor):
    """A 2-D operand as the C++ kernel takes it: ``(row-major tensor, its scales row-major, transposed)``,
    where ``transposed`` says ``q`` is the transpose of the row-major tensor (``.t()`` of a contiguous
    matrix, as backward passes), so no copy is made for it; other layouts are copied."""
    if q.is_contiguous():
        return q, s.contiguous(), False
    if q.t().is_contiguous():
        return q.t(), s.t().contiguous(), True
    return q.contiguous(), s.contiguous(), False


def _block_matmul(qa: Tensor, sa: Tensor, qb_t: Tensor, sb_t: Tensor, block: int, out_dtype: torch.dtype,
                  bias: Optional[Tensor], gemm: str) -> Tensor:
    # On a GPU, zero8's per-block CUDA kernel (kernels/cuda/int8_blockwise.cu); on the CPU the fused VNNI kernel
    # where the CPU has it, else one library GEMM per slice. The same bits everywhere.
    check_block_matmul(qa, sa, qb_t, sb_t, block, out_dtype, bias)
    if not qa.is_cuda and _C.int8_block_matmul_backend() != "avx512-vnni":
        return _block_matmul_sliced_unchecked(qa, sa, qb_t, sb_t, block, out_dtype, bias, gemm)
    m, k = qa.shape
    n = qb_t.shape[0]
    a, sa_, a_trans = _as_stored(qa, sa)
    b, sb_, b_is_t = _as_stored(qb_t, sb_t)  # b stored n x k (b_trans) unless qb_t is a transposed view
    out = torch.empty((m, n), dtype=out_dtype, device=qa.device)
    bias_ = bias.float().contiguous() if bias is not None else None
    _run(qa, "int8_block_matmul", ptr(a), ptr(sa_), a_trans, ptr(b), ptr(sb_), not b_is_t, m, n, k, block,
         ptr(bias_) if bias_ is not None else 0, ptr(out), dtype_code(out))
    return out


def _llm_int8_matmul(x: Tensor, w_q: Tensor, w_scale: Tensor, w_fp: Optional[Tensor], threshold: float,
                     bias: Optional[Tensor], gemm: str) -> Tensor:
    # LLM.int8's mixed-precision decomposition of x @ W.T (+ bias). One op, because which columns are
    # outliers (and so the shapes of the float part) depends on the data.
    check_llm_int8_matmul(x, w_q, w_scale, w_fp, bias)
    x = x.contiguous()
    add = None
    mask = None
    if threshold > 0 and math.isfinite(threshold):
        mask = torch.empty(x.shape[1], dtype=torch.uint8, device=x.device)
        _run(x, "int8_outlier_columns", ptr(x), dtype_code(x), x.shape[0], x.shape[1], float(threshold), ptr(mask))
        # Which columns, and so the shape of the float part, is data: read on the host (on a GPU, a wait for it).
        idx = mask.nonzero().squeeze(1)
        if idx.numel() > 0:
            # The outlier features in float32: with fp weights when kept, else the dequantized int8
            # columns (bitsandbytes does the same when the fp16 weights are gone). Not under autocast, which
            # reaches into the op and would make this product bfloat16 or float16 where the epilogue reads
            # float32.
            with torch.autocast(x.device.type, enabled=False):
                w_out = w_fp[:, idx].float() if w_fp is not None else w_q[:, idx].float() * w_scale[:, None]
                add = x[:, idx].float() @ w_out.t()
        else:
            mask = None
    q_x, s_x = _quantize_rows_unchecked(x, mask, None)
    return mm_dequantize(q_x, w_q, True, s_x, w_scale, x.dtype, add, bias, gemm, in_op=True)


# ---------------------------------------------------------------- the ops and their fake functions

_OP = dict(mutates_args=(), device_types=("cpu", "cuda"))

int8_quantize_rows = torch.library.custom_op("zero8::int8_quantize_rows", _quantize_rows, **_OP)
int8_quantize_cols = torch.library.custom_op("zero8::int8_quantize_cols", _quantize_cols, **_OP)
int8_quantize_blocks = torch.library.custom_op("zero8::int8_quantize_blocks", _quantize_blocks, **_OP)
int8_dequantize_blocks = torch.library.custom_op("zero8::int8_dequantize_blocks", _dequantize_blocks, **_OP)
int8_gemm = torch.library.custom_op("zero8::int8_gemm", _gemm, **_OP)
int8_dequantize_matmul = torch.library.custom_op("zero8::int8_dequantize_matmul", _dequantize_matmul, **_OP)
int8_block_matmul = torch.library.custom_op("zero8::int8_block_matmul", _block_matmul, **_OP)
llm_int8_matmul = torch.library.custom_op("zero8::llm_int8_matmul", _llm_int8_matmul, **_OP)


# ---------------------------------------------------------------- eager calls (zero8._tensors.EagerOp)


class eager:  # noqa: N801 (a namespace: zero8.nn calls _ops.eager.int8_gemm where tests call _ops.int8_gemm)
    int8_quantize_rows = EagerOp(int8_quantize_rows, _quantize_rows)
    int8_quantize_cols = EagerOp(int8_quantize_cols, _quantize_cols)
    int8_quantize_blocks = EagerOp(int8_quantize_blocks, _quantize_blocks)
    int8_dequantize_blocks = EagerOp(int8_dequantize_blocks, _dequantize_blocks)
    int8_gemm = EagerOp(int8_gemm, _gemm)
    int8_dequantize_matmul = EagerOp(int8_dequantize_matmul, _dequantize_matmul)
    int8_block_matmul = EagerOp(int8_block_matmul, _block_matmul)
    llm_int8_matmul = EagerOp(llm_int8_matmul, _llm_int8_matmul)


@int8_quantize_rows.register_fake
def _(x, col_mask, seed):
    rows, cols = x.shape
    return x.new_empty((rows, cols), dtype=torch.int8), x.new_empty((rows,), dtype=torch.float32)


@int8_quantize_cols.register_fake
def _(x, seed):
    rows, cols = x.shape
    return x.new_empty((rows, cols), dtype=torch.int8), x.new_empty((cols,), dtype=torch.float32)


@int8_quantize_blocks.register_fake
def _(x, block, seed):
    rows, cols = x.shape
    return (x.new_empty((rows, cols), dtype=torch.int8),
            x.new_empty((_cdiv(rows, block), _cdiv(cols, block)), dtype=torch.float32))


@int8_dequantize_blocks.register_fake
def _(q, scale, block, dtype):
    return q.new_empty(tuple(q.shape), dtype=dtype)


@int8_gemm.register_fake
def _(a, b, b_trans):
    return a.new_empty((a.shape[0], b.shape[0] if b_trans else b.shape[1]), dtype=torch.int32)


@int8_dequantize_matmul.register_fake
def _(acc, row_scale, col_scale, out_dtype, add, bias, row_group, row_stride, col_group, col_stride):
    return acc.new_empty(tuple(acc.shape), dtype=out_dtype)


@int8_block_matmul.register_fake
def _(qa, sa, qb_t, sb_t, block, out_dtype, bias, gemm):
    return qa.new_empty((qa.shape[0], qb_t.shape[0]), dtype=out_dtype)


@llm_int8_matmul.register_fake
def _(x, w_q, w_scale, w_fp, threshold, bias, gemm):
    return x.new_empty((x.shape[0], w_q.shape[0]), dtype=x.dtype)


# ---------------------------------------------------------------- FLOP formulas (torch.utils.flop_counter)
#
# The three ops that multiply matrices count as the float product they compute, 2 * m * n * k, as torch
# counts aten.mm (and aten._scaled_mm: no discount for int8 operands, nothing for the scaling epilogue).
# So a layer counts what nn.Linear of its shape counts, and MFU keeps its usual meaning. LLM.int8's outlier
# columns are not counted twice: the op computes one x @ W^T whatever the data. The quantize, dequantize
# and epilogue ops are elementwise and have no formula: 0 flops, as torch counts its own elementwise ops.
# torch copies its registry when a FlopCounterMode is made, so these count in modes made after zero8.nn
# (which imports this module) is imported. torch passes each tensor argument to a formula as its shape.


def _flops_mm(m, n, k):
    return 2 * m * n * k


@register_flop_formula(torch.ops.zero8.int8_gemm)
def _flops_int8_gemm(a, b, b_trans, *args, out_shape=None, **kwargs):
    m, k = a
    return _flops_mm(m, b[0] if b_trans else b[1], k)


@register_flop_formula(torch.ops.zero8.int8_block_matmul)
def _flops_int8_block_matmul(qa, sa, qb_t, *args, out_shape=None, **kwargs):
    m, k = qa
    return _flops_mm(m, qb_t[0], k)


@register_flop_formula(torch.ops.zero8.llm_int8_matmul)
def _flops_llm_int8_matmul(x, w_q, *args, out_shape=None, **kwargs):
    m, k = x
    return _flops_mm(m, w_q[0], k)
