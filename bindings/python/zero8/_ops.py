"""The int8 kernels of zero8._C as torch custom ops (namespace ``zero8``), so that ``torch.compile`` traces
the int8 layers in one graph: each op runs its kernel as one opaque call, and its fake function gives the
output shapes and dtypes without running it (FakeTensor tracing, meta tensors). The ops that multiply
matrices also have a FLOP formula, for ``torch.utils.flop_counter.FlopCounterMode``, which cannot see into them.

Callers (zero8.nn.linear8bit's primitives) validate arguments and name them in errors; the ops take CPU
tensors, or CUDA tensors in a build with CUDA, of the right dtypes, all on one device, and make 2-D operands
contiguous (no copy when they are). On a GPU the ops queue zero8's CUDA kernels on torch's current stream (the
same codes, scales and epilogue bits as the CPU) and multiply with ``torch._int_mm`` (cuBLASLt, exact int32
products), whatever ``gemm`` says. Stochastic rounding takes its seed as a one-element int64 tensor the caller
draws from torch's generator, so the ops are pure functions of their inputs (the compiler may neither merge
two draws nor replay one) and eager and compiled runs see the same seeds. ``gemm`` arguments ("torch" or
"zero8") say which int8 GEMM a composite op calls (``linear8bit.set_int8_gemm_backend``); both give the same
int32 products.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from . import _C
from ._tensors import cuda_stream, dtype_code, on_device, ptr

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


def _cdiv(a, b):
    return -(-a // b)


def _seed_of(seed: Optional[Tensor]) -> int:
    return int(seed.item()) if seed is not None else 0


def _run(t: Tensor, name: str, *args):
    """``_C.<name>(*args)`` for CPU tensors, or ``_C.<name>_cuda(*args)`` on t's GPU, queued on torch's
    current stream (the CUDA entries take the CPU ones' arguments, less the thread count, plus the stream)."""
    if t.is_cuda:
        with on_device(t):
            return getattr(_C, name + "_cuda")(*args, stream=cuda_stream(t))
    return getattr(_C, name)(*args)


# ---------------------------------------------------------------- kernels (eager bodies of the ops)


def _quantize_rows(x: Tensor, col_mask: Optional[Tensor], seed: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    x = x.contiguous()
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=torch.int8, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    mask = col_mask.contiguous() if col_mask is not None else None  # held until the kernel has read it
    _run(x, "int8_quantize_rows", ptr(x), dtype_code(x), rows, cols, ptr(q), ptr(scale),
         ptr(mask) if mask is not None else 0, seed is not None, _seed_of(seed))
    return q, scale


def _quantize_cols(x: Tensor, seed: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    x = x.contiguous()
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=torch.int8, device=x.device)
    scale = torch.empty(cols, dtype=torch.float32, device=x.device)
    _run(x, "int8_quantize_cols", ptr(x), dtype_code(x), rows, cols, ptr(q), ptr(scale), seed is not None,
         _seed_of(seed))
    return q, scale


def _quantize_blocks(x: Tensor, block: int, seed: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    x = x.contiguous()
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=torch.int8, device=x.device)
    scale = torch.empty((_cdiv(rows, block), _cdiv(cols, block)), dtype=torch.float32, device=x.device)
    _run(x, "int8_quantize_blocks", ptr(x), dtype_code(x), rows, cols, block, block, ptr(q), ptr(scale),
         seed is not None, _seed_of(seed))
    return q, scale


def _dequantize_blocks(q: Tensor, scale: Tensor, block: int, dtype: torch.dtype) -> Tensor:
    q, scale = q.contiguous(), scale.contiguous()
    rows, cols = q.shape
    y = torch.empty((rows, cols), dtype=dtype, device=q.device)
    _run(q, "int8_dequantize_blocks", ptr(q), ptr(scale), rows, cols, block, block, ptr(y), dtype_code(y))
    return y


def _gemm(a: Tensor, b: Tensor, b_trans: bool) -> Tensor:
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


def _mm(a: Tensor, b: Tensor, gemm: str, b_trans: bool = True) -> Tensor:
    if a.is_cuda:
        return _int_mm_cuda(a, b if b_trans else b.t())
    if gemm == "torch":
        return torch._int_mm(a, b.t() if b_trans else b)
    return _gemm(a, b, b_trans)


def _dequantize_matmul_into(acc: Tensor, row_scale: Tensor, col_scale: Tensor, add: Optional[Tensor],
                            bias: Optional[Tensor], out: Tensor, accumulate: bool, row_group: int, row_stride: int,
                            col_group: int, col_stride: int) -> Tensor:
    # The epilogue writing (or, with accumulate, adding into) `out`. The scales are read from their first
    # element as row_scale[(i // row_group) * row_stride]: a column view of a block-scale matrix is
    # passed as it is, with its stride.
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
    out = torch.empty(tuple(acc.shape), dtype=out_dtype, device=acc.device)
    return _dequantize_matmul_into(acc, row_scale, col_scale, add, bias, out, False, row_group, row_stride,
                                   col_group, col_stride)


def int8_block_matmul_sliced(qa: Tensor, sa: Tensor, qb_t: Tensor, sb_t: Tensor, block: int,
                             out_dtype: torch.dtype, bias: Optional[Tensor], gemm: str) -> Tensor:
    """The per-block product through a library GEMM: one int8 GEMM per ``block``-wide slice of k, each
    int32 result dequantized by its row-block and column-block scales and accumulated into a float32
    output (the epilogue's ``out + float(acc) * (sa * sb)``), then ``+ bias``. The same bits as the fused
    kernel (tested); used where that kernel cannot run (no AVX512_VNNI)."""
    m, k = qa.shape
    n = qb_t.shape[0]
    nkb = sa.shape[1]
    sa = sa.contiguous()
    sb_t = sb_t.contiguous()
    out = torch.zeros((m, n), dtype=torch.float32, device=qa.device)
    for s in range(nkb):
        k0, k1 = s * block, min(k, (s + 1) * block)
        acc = _mm(qa[:, k0:k1].contiguous(), qb_t[:, k0:k1].contiguous(), gemm)
        _dequantize_matmul_into(acc, sa[:, s], sb_t[:, s], None, None, out, True, block, nkb, block, nkb)
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
    if not qa.is_cuda and _C.int8_block_matmul_backend() != "avx512-vnni":
        return int8_block_matmul_sliced(qa, sa, qb_t, sb_t, block, out_dtype, bias, gemm)
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
            # columns (bitsandbytes does the same when the fp16 weights are gone).
            w_out = w_fp[:, idx].float() if w_fp is not None else w_q[:, idx].float() * w_scale[:, None]
            add = x[:, idx].float() @ w_out.t()
        else:
            mask = None
    q_x, s_x = _quantize_rows(x, mask, None)
    acc = _mm(q_x, w_q, gemm)
    return _dequantize_matmul(acc, s_x, w_scale, x.dtype, add, bias, 1, 1, 1, 1)


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
