"""Block-wise 8-bit quantization of torch tensors with bitsandbytes' signatures (``bitsandbytes.functional``):
``create_dynamic_map``, ``quantize_blockwise`` and ``dequantize_blockwise``, on tensors of float32, bfloat16
or float16, run by zero8's C++ codec (SIMD, OpenMP, GIL released) on the CPU, and, in a build with CUDA, by
its CUDA kernels on GPU tensors: outputs on the input's device, queued on torch's current stream, with the
same codes and scales as the CPU for the same input. The codec runs as two torch custom ops,
``zero8::quantize_blockwise`` and ``zero8::dequantize_blockwise``, so ``torch.compile`` (fullgraph) traces
code calling these functions without a graph break; with ``aot_eager`` it gives the eager bits, and with
inductor too, except where the nested scales' mean (a float64 sum, rounded once), summed in inductor's own
order, rounds the other way. In eager mode the dispatch costs about 7 us per call, which doubles the time of a
call on a few thousand elements and is noise on large tensors.

Format: a tensor is cut into blocks of ``blocksize`` elements (a power of two in 64..4096; bitsandbytes'
default 4096); each block stores uint8 codes and one float32 scale. Decoding is ``code[q] * absmax`` as in
bitsandbytes, so states are interchangeable in both directions. Two differences, both by design:
the code is the exact nearest map value (ties to the even code, never flipping a nonzero value's sign),
and a block whose largest-magnitude element is negative stores a *negative* absmax when the map lacks -1
(the dynamic signed map ends at -0.99297 but +1.0), so that element decodes exactly. bitsandbytes'
dequantization formula handles such a scale unchanged.

``nested=True`` (the scales quantized again, minus an offset) first makes the scales non-negative when the
map is sign-symmetric (see ``quantize_blockwise``): centring signed scales, whose mean is near 0, would
leave them as hard to quantize as before, and the nested error would be well above bitsandbytes'. The
offset is the scales' mean, as in bitsandbytes, unless 0 quantizes them better (scales over decades).
"""

from __future__ import annotations

import operator
from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from . import _C
from ._C import Zero8ValueError
from ._tensors import (FLOAT_DTYPES, EagerOp, check_device_contiguous, check_dtype, check_float_tensor, check_numel,
                       check_same_device, cuda_stream, dtype_code, on_device, ptr)

__all__ = ["QuantState", "create_dynamic_map", "quantize_blockwise", "dequantize_blockwise"]

_STANDARD_KINDS = (
    _C.MapKind.dynamic_signed,
    _C.MapKind.dynamic_unsigned,
    _C.MapKind.linear_signed,
    _C.MapKind.linear_unsigned,
)
_standard_maps: dict = {}


def _standard_map(kind) -> torch.Tensor:
    t = _standard_maps.get(int(kind))
    if t is None:
        t = torch.tensor(_C.map_values(kind), dtype=torch.float32)
        _standard_maps[int(kind)] = t
    return t


# bitsandbytes' default map, the `code` of states quantized without one (a plain tensor, so that code
# torch.compile traces reads it without calling into _C).
_DEFAULT_MAP = _standard_map(_C.MapKind.dynamic_signed)


def create_dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """The dynamic (tree) quantization map as bitsandbytes builds it: 256 sorted float32 values.

    For the default arguments this is exactly ``_C.map_values`` (dynamic signed, or dynamic unsigned
    with ``signed=False``), the maps zero8's 8-bit optimizers use; other arguments follow the same
    construction (fewer ``total_bits`` pad with zeros to 256 entries, as bitsandbytes does). Returns a new
    tensor each call.
    """
    if max_exponent_bits == 7 and total_bits == 8:
        kind = _C.MapKind.dynamic_signed if signed else _C.MapKind.dynamic_unsigned
        return _standard_map(kind).clone()
    return torch.tensor(_C.map_dynamic_values(bool(signed), int(max_exponent_bits), int(total_bits)),
                        dtype=torch.float32)


class QuantState:
    """What dequantization needs (bitsandbytes' ``QuantState`` fields for block-wise 8-bit): the block
    scales ``absmax`` (float32, one per block; or, when nested, their own uint8 codes with ``offset`` and
    ``state2``), the 256-value ``code`` map, ``blocksize``, and the original ``dtype`` and ``shape``."""

    def __init__(self, absmax: torch.Tensor, shape=None, code: Optional[torch.Tensor] = None,
                 blocksize: Optional[int] = None, quant_type: Optional[str] = None,
                 dtype: Optional[torch.dtype] = None, offset: Optional[torch.Tensor] = None,
                 state2: Optional["QuantState"] = None):
        self.absmax = absmax
        self.shape = shape
        self.code = code
        self.dtype = dtype
        self.blocksize = blocksize
        self.quant_type = quant_type
        self.offset = offset
        self.state2 = state2

    @property
    def nested(self) -> bool:
        return self.state2 is not None

    def to(self, device) -> "QuantState":
        """Move the tensors to `device` in place (bitsandbytes' QuantState.to); returns self."""
        self.absmax = self.absmax.to(device)
        if self.code is not None:
            self.code = self.code.to(device)
        if self.offset is not None:
            self.offset = self.offset.to(device)
        if self.state2 is not None:
            self.state2.to(device)
        return self

    def __eq__(self, other) -> bool:
        if not isinstance(other, QuantState):
            return NotImplemented

        def same(a, b):
            if a is None or b is None:
                return a is b
            return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b

        return (same(self.absmax, other.absmax) and same(self.code, other.code) and self.shape == other.shape
                and self.dtype == other.dtype and self.blocksize == other.blocksize
                and same(self.offset, other.offset) and same(self.state2, other.state2))

    def __repr__(self) -> str:
        return (f"QuantState(blocksize={self.blocksize}, dtype={self.dtype}, shape={tuple(self.shape or ())}, "
                f"blocks={self.absmax.numel()}, nested={self.nested})")


def _check_blocksize(blocksize) -> int:
    """blocksize as an int: any integer type (a numpy or 0-d torch integer too, as bitsandbytes takes)."""
    try:
        if isinstance(blocksize, bool):
            raise TypeError
        blocksize = operator.index(blocksize)
    except TypeError:
        raise Zero8ValueError(f"blocksize must be an int, got {type(blocksize).__name__}") from None
    if not (64 <= blocksize <= 4096 and blocksize & (blocksize - 1) == 0):
        raise Zero8ValueError(f"blocksize must be a power of two in 64..4096, got {blocksize}")
    return blocksize


def _check_code(code: Optional[torch.Tensor], data: torch.Tensor) -> None:
    """A 256-value float32 map on the CPU or on `data`'s device (bitsandbytes' QuantState.to moves it)."""
    if code is not None:
        check_device_contiguous(code, "code")
        if code.device.type != "cpu":
            check_same_device(code, "code", data, "A")
        check_dtype(code, "code", torch.float32)
        check_numel(code, "code", 256, "a code table has 256 values")


# A code map on a GPU -> (its version, its CPU copy): the codec builds its tables from the values on the host,
# so such a map is read back once, not at every call (a copy that waits for the GPU).
_host_codes = WeakIdKeyDictionary()


def _host_code(code: Tensor) -> Tensor:
    if code.device.type == "cpu":
        return code
    hit = _host_codes.get(code)
    if hit is None or hit[0] != code._version:
        hit = (code._version, code.cpu())
        _host_codes[code] = hit
    return hit[1]


def _map_arg(code: Optional[torch.Tensor]):
    """(MapKind, None) for a standard map (the C++ side caches its table) or (None, values) for a custom
    256-value code table; None is bitsandbytes' default, the dynamic signed map. Compares the values, so
    it runs inside the ops, where the data is real."""
    if code is None:
        return _C.MapKind.dynamic_signed, None
    code = _host_code(code)
    for kind in _STANDARD_KINDS:
        if torch.equal(code, _standard_map(kind)):
            return kind, None
    return None, code.tolist()


# A custom map's codec table on a GPU, by (device, values): uploaded once, kept for the process (a few
# KB each; the kernels read it asynchronously, so it is never freed under them).
_device_tables: dict = {}


def _device_table(values: list, device: torch.device) -> Tensor:
    key = (device, tuple(values))
    t = _device_tables.get(key)
    if t is None:
        host = torch.frombuffer(bytearray(_C.quant_table_bytes(values)), dtype=torch.uint8)
        t = host.to(device)
        _device_tables[key] = t
    return t


def _codec_table_problem(values: list) -> Optional[str]:
    """Why the C++ codec cannot take the custom map `values` (its nearest-code thresholds need 256 finite
    values sorted ascending within [-1, 1]), or None when it can."""
    for i, v in enumerate(values):
        if not (abs(v) <= 1.0):  # False for NaN too
            return f"code[{i}] = {v} is not a finite value within [-1, 1]"
        if i and values[i - 1] > v:
            return f"code is not sorted ascending at index {i} ({values[i - 1]} > {v})"
    return None


def _code_tensor(code: Optional[torch.Tensor]) -> torch.Tensor:
    return _DEFAULT_MAP if code is None else code


_negation_tables: dict = {}


def _negation_table(kind, code: torch.Tensor, device: torch.device) -> Optional[torch.Tensor]:
    """The 256 uint8 codes of -code[c] for a sign-symmetric map, one whose values other than its largest
    all have their negation in the map (the dynamic signed map: +-v_k, 0 and +1.0); the largest value goes
    to the code nearest to its negation (+1.0 -> -0.99297, where bitsandbytes encodes -1). None for any
    other map (unsigned maps, asymmetric custom maps): negating there would change decoded values. `code`
    is on the CPU; the table is on `device` (a standard map's is kept per device: no copy per call)."""
    key = (int(kind), str(device)) if kind is not None else None
    if key in _negation_tables:
        return _negation_tables[key]
    if device.type != "cpu":
        table = _negation_table(kind, code, torch.device("cpu"))
        table = table.to(device) if table is not None else None
        if key is not None:
            _negation_tables[key] = table
        return table
    neg = -code
    hi = torch.searchsorted(code, neg).clamp(max=255)  # the map is sorted (the codec checked it)
    lo = (hi - 1).clamp(min=0)
    nearest = torch.where((neg - code[lo]).abs() <= (code[hi] - neg).abs(), lo, hi)
    exact = code[nearest] == neg
    table = nearest.to(torch.uint8) if bool((exact | (code == code.max())).all()) else None
    if key is not None:
        _negation_tables[key] = table
    return table


def _scales_make_nonnegative(out: torch.Tensor, absmax: torch.Tensor, blocksize: int, table: torch.Tensor) -> None:
    """Negate the negative block scales in place and recode those blocks with `table` (code of -value):
    every element decodes to the same value, except the +1.0 code's (the block's extreme element and what
    rounded to it), which becomes the nearest code of -1.0."""
    neg = absmax < 0
    if out.is_cuda:  # every code through a select: no read of `neg` by the host (a wait for the GPU)
        flat = out.view(-1)
        recode = neg.repeat_interleave(blocksize)[: flat.numel()]
        flat.copy_(torch.where(recode, table[flat.long()], flat))
        absmax.abs_()
        return
    if not bool(neg.any()):
        return
    flat = out.view(-1)
    full = flat.numel() // blocksize
    rows = neg[:full].nonzero().squeeze(1)
    if rows.numel():
        q = flat[: full * blocksize].view(full, blocksize)
        q[rows] = table[q[rows].long()]
    if full < neg.numel() and bool(neg[full]):  # the partial last block
        tail = flat[full * blocksize:]
        tail.copy_(table[tail.long()])
    absmax.abs_()


# ---------------------------------------------------------------- the codec as torch custom ops
# One opaque kernel call each, with fake functions giving the output shapes (FakeTensor tracing, meta
# tensors); the Python functions below validate the arguments and name them in errors, then call these.


def _quantize_into(A: Tensor, kind: "_C.MapKind", blocksize: int, codes_ptr: int, absmax_ptr: int) -> None:
    """The codec over a standard map, on A's device: A's codes and one float32 scale per block into the
    memory at codes_ptr and absmax_ptr (on that device too, which the caller vouches for: the CUDA entry takes
    the pointers on trust; CUDA work queued on torch's current stream)."""
    args = (ptr(A), dtype_code(A), A.numel(), blocksize, kind, codes_ptr, absmax_ptr)
    if A.is_cuda:
        with on_device(A):
            _C.quantize_blockwise_cuda(*args, stream=cuda_stream(A), pointers_checked=True)
    else:
        _C.quantize_blockwise(*args)


def _dequantize_into(codes_ptr: int, absmax_ptr: int, blocksize: int, kind: "_C.MapKind", out: Tensor) -> None:
    """The decoding of _quantize_into: out.numel() values into `out` (contiguous), on its device (the codes and
    scales too, as the caller vouches)."""
    args = (codes_ptr, absmax_ptr, out.numel(), blocksize, kind, ptr(out), dtype_code(out))
    if out.is_cuda:
        with on_device(out):
            _C.dequantize_blockwise_cuda(*args, stream=cuda_stream(out), pointers_checked=True)
    else:
        _C.dequantize_blockwise(*args)


def _quantize_rows_into(A: Tensor, kind: "_C.MapKind", blocksize: int, codes_ptr: int, absmax_ptr: int) -> None:
    """_quantize_into of each row of A (2-d, contiguous), every row blocked on its own (its last block partial
    when blocksize does not divide it), in one call: row r's codes from r * A.shape[1] on, its scales from
    r * ceil(A.shape[1] / blocksize) on (on A's device, as the caller vouches)."""
    if A.dim() != 2 or not A.is_contiguous():
        raise Zero8ValueError(f"_quantize_rows_into: needs a contiguous 2-d tensor, got shape {tuple(A.shape)}"
                              f"{'' if A.is_contiguous() else ' (not contiguous)'}")
    args = (ptr(A), dtype_code(A), A.shape[0], A.shape[1], blocksize, kind, codes_ptr, absmax_ptr)
    if A.is_cuda:
        with on_device(A):
            _C.quantize_blockwise_rows_cuda(*args, stream=cuda_stream(A), pointers_checked=True)
    else:
        _C.quantize_blockwise_rows(*args)


def _dequantize_rows_into(codes_ptr: int, absmax_ptr: int, rows: int, blocksize: int, kind: "_C.MapKind", out: Tensor,
                          sum: bool = False) -> None:
    """The decoding of _quantize_rows_into: into `out` (rows x row, contiguous), or with sum the rows' values
    added in row order, ((r0 + r1) + r2) ..., into `out` (row float32 values, contiguous); the codes and scales
    on out's device, as the caller vouches."""
    row = out.numel() if sum else out.numel() // max(rows, 1)
    if not out.is_contiguous() or (not sum and rows * row != out.numel()):
        raise Zero8ValueError(f"_dequantize_rows_into: `out` must be contiguous and hold {rows} rows of one length, "
                              f"got shape {tuple(out.shape)}{'' if out.is_contiguous() else ' (not contiguous)'}")
    args = (codes_ptr, absmax_ptr, rows, row, blocksize, kind, ptr(out), dtype_code(out), sum)
    if out.is_cuda:
        with on_device(out):
            _C.dequantize_blockwise_rows_cuda(*args, stream=cuda_stream(out), pointers_checked=True)
    else:
        _C.dequantize_blockwise_rows(*args)


def _quantize_blockwise_kernel(A: Tensor, code: Optional[Tensor], blocksize: int,
                               nonnegative_scales: bool) -> tuple[Tensor, Tensor]:
    """(codes of A's shape, one float32 scale per block), on A's device; nonnegative_scales: the first step
    of nesting (``_scales_make_nonnegative``, for a sign-symmetric map)."""
    A = A.contiguous()
    kind, values = _map_arg(code)
    n = A.numel()
    out = torch.empty(A.shape, dtype=torch.uint8, device=A.device)
    absmax = torch.empty(-(-n // blocksize), dtype=torch.float32, device=A.device)
    if kind is None:
        problem = _codec_table_problem(values)
        if problem is not None:
            raise Zero8ValueError(f"quantize_blockwise: {problem}. zero8 quantizes to the nearest value of a map "
                                  "of 256 finite values sorted ascending within [-1, 1] (dequantize_blockwise "
                                  "decodes with any 256 values)")
    if kind is not None:
        _quantize_into(A, kind, blocksize, ptr(out), ptr(absmax))
    elif A.is_cuda:
        with on_device(A):
            _C.quantize_blockwise_table_cuda(ptr(A), dtype_code(A), n, blocksize, ptr(_device_table(values, A.device)),
                                             ptr(out), ptr(absmax), stream=cuda_stream(A), pointers_checked=True)
    else:
        _C.quantize_blockwise_values(ptr(A), dtype_code(A), n, blocksize, values, ptr(out), ptr(absmax))
    if nonnegative_scales:
        table = _negation_table(kind, _host_code(_code_tensor(code)), A.device)
        if table is not None:
            _scales_make_nonnegative(out, absmax, blocksize, table)
    return out, absmax


def _dequantize_blockwise_kernel(A: Tensor, absmax: Tensor, code: Optional[Tensor], blocksize: int,
                                 dtype: torch.dtype) -> Tensor:
    """``code[A] * absmax`` per block, of A's shape, in `dtype`, on A's device."""
    A, absmax = A.contiguous(), absmax.contiguous()
    kind, values = _map_arg(code)
    n = A.numel()
    out = torch.empty(A.shape, dtype=dtype, device=A.device)
    if kind is None and _codec_table_problem(values) is not None:
        # A map the codec's tables do not take (unsorted, or values outside [-1, 1]), as bitsandbytes
        # states may carry: decoding needs no thresholds, so torch does it, with the codec's arithmetic
        # (the float32 product, then one rounding to dtype).
        scales = absmax.repeat_interleave(blocksize)[:n]
        out.view(-1).copy_(code.to(A.device)[A.reshape(-1).long()] * scales)
    elif kind is not None:
        _dequantize_into(ptr(A), ptr(absmax), blocksize, kind, out)
    elif A.is_cuda:
        with on_device(A):
            _C.dequantize_blockwise_table_cuda(ptr(A), ptr(absmax), n, blocksize, ptr(_device_table(values, A.device)),
                                               ptr(out), dtype_code(out), stream=cuda_stream(A),
                                               pointers_checked=True)
    else:
        _C.dequantize_blockwise_values(ptr(A), ptr(absmax), n, blocksize, values, ptr(out), dtype_code(out))
    return out


_quantize_blockwise_op = torch.library.custom_op("zero8::quantize_blockwise", _quantize_blockwise_kernel,
                                                 mutates_args=(), device_types=("cpu", "cuda"))
_dequantize_blockwise_op = torch.library.custom_op("zero8::dequantize_blockwise", _dequantize_blockwise_kernel,
                                                   mutates_args=(), device_types=("cpu", "cuda"))
_quantize_blockwise_eager = EagerOp(_quantize_blockwise_op, _quantize_blockwise_kernel)
_dequantize_blockwise_eager = EagerOp(_dequantize_blockwise_op, _dequantize_blockwise_kernel)


@_quantize_blockwise_op.register_fake
def _(A, code, blocksize, nonnegative_scales):
    blocks = -(-A.numel() // blocksize)
    return A.new_empty(A.shape, dtype=torch.uint8), A.new_empty((blocks,), dtype=torch.float32)


@_dequantize_blockwise_op.register_fake
def _(A, absmax, code, blocksize, dtype):
    return A.new_empty(A.shape, dtype=dtype)


# ---------------------------------------------------------------- bitsandbytes' functions


def _nest_scales(scales: Tensor, blocksize: int) -> Tuple[Tensor, Tensor, QuantState]:
    """The scales quantized again (dynamic signed map, `blocksize`) minus an offset: their mean, as
    bitsandbytes does, or 0, whichever gives the smaller sum of relative scale errors. Each block's values
    scale with its scale, so that sum tracks the error nesting adds to the data. The mean suits scales of
    similar size (normal, Student-t(3) data: offset 0 gives 6-36% more error); 0 suits scales spread over
    decades, whose small ones the mean would turn into near-equal negatives (Cauchy data: 0.30-0.50 of the
    mean's error). Chosen with torch.where, so a compiled caller keeps one graph.
    A non-finite scale (a block holding NaN or Inf) takes no part in the mean and the choice, so the
    other scales nest as they would without it; it still makes its group of `blocksize` scales NaN (the
    nested format has no room for one NaN scale), so blocksize**2 elements decode as NaN."""
    finite = scales.isfinite()
    # Both sums in float64, rounded once: a float32 sum depends on its order, which differs between the CPU
    # and a GPU (and inductor), and the offset and the choice must not.
    means = (torch.where(finite, scales, 0).double().sum() / finite.sum().clamp_min(1)).float()
    candidates = []
    for offset in (means, torch.zeros_like(means)):
        q, state2 = quantize_blockwise(scales - offset, blocksize=blocksize, nested=False)
        back = dequantize_blockwise(q, state2) + offset
        # The group of the non-finite scale decodes as NaN with either offset; the rest is compared.
        error = torch.where(finite & back.isfinite(),
                            (back - scales).abs() / scales.abs().clamp_min(torch.finfo(torch.float32).tiny),
                            0).double().sum()
        candidates.append((q, offset, state2, error))
    (q0, o0, s0, e0), (q1, o1, s1, e1) = candidates
    use_mean = e0 <= e1
    state2 = QuantState(absmax=torch.where(use_mean, s0.absmax, s1.absmax), shape=s0.shape, code=s0.code,
                        blocksize=blocksize, dtype=s0.dtype)
    return torch.where(use_mean, q0, q1), torch.where(use_mean, o0, o1), state2


def quantize_blockwise(A: torch.Tensor, code: Optional[torch.Tensor] = None, absmax: Optional[torch.Tensor] = None,
                       out: Optional[torch.Tensor] = None, blocksize: int = 4096,
                       nested: bool = False) -> Tuple[torch.Tensor, QuantState]:
    """Quantize A (contiguous, float32/bfloat16/float16, on the CPU or a GPU) block-wise with the map `code`
    (default: the dynamic signed map). Returns (codes as uint8 of A's shape, QuantState), on A's device.
    `absmax` (float32, ceil(numel / blocksize) elements) and `out` (uint8, numel elements) are filled when
    given (copied into: the op returns new tensors).
    nested=True quantizes the scales again, minus an offset (kept as `offset`): their mean, as bitsandbytes
    does, or 0 when that gives the smaller relative error of the scales (``_nest_scales``).
    Before centring, it makes the scales non-negative (as bitsandbytes' are) when the map is sign-symmetric
    (the default map or any dynamic signed map; a map with -1, such as the linear signed map, has no
    negative scales): a block with a negative scale is stored with the positive one and recoded to the
    codes of the negated values, which decode to the same values except the +1.0 code's (the block's
    extreme element and what rounded to it), which becomes the code of -0.99297, as bitsandbytes encodes
    -1. So the codes of those blocks differ from nested=False's, and the error is bitsandbytes' (measured:
    within 0.1% on normal and Student-t(2) data). With other maps (unsigned, or a custom map lacking negations) the
    signed scales are centred as they are. Centring by the mean suits scales of similar size; for scales
    spread over decades (Cauchy-like data) the offset is 0, and the error 0.30-0.50 of bitsandbytes'.
    """
    check_float_tensor(A, "A")
    blocksize = _check_blocksize(blocksize)
    _check_code(code, A)
    n = A.numel()
    blocks = -(-n // blocksize)
    if absmax is not None:
        check_device_contiguous(absmax, "absmax")
        check_same_device(absmax, "absmax", A, "A")
        check_dtype(absmax, "absmax", torch.float32)
        check_numel(absmax, "absmax", blocks, f"one scale per block of {blocksize}")
    if out is not None:
        check_device_contiguous(out, "out")
        check_same_device(out, "out", A, "A")
        check_dtype(out, "out", torch.uint8)
        check_numel(out, "out", n, "one code per element of A")
    codes, scales = _quantize_blockwise_eager(A, code, blocksize, nested)
    if out is not None:
        codes = out.copy_(codes.view(out.shape))
    if absmax is not None:
        scales = absmax.copy_(scales)
    code_t = _code_tensor(code)
    if nested:
        qabsmax, offset, state2 = _nest_scales(scales, blocksize)
        state = QuantState(absmax=qabsmax, shape=A.shape, code=code_t, blocksize=blocksize, dtype=A.dtype,
                           offset=offset, state2=state2)
    else:
        state = QuantState(absmax=scales, shape=A.shape, code=code_t, blocksize=blocksize, dtype=A.dtype)
    return codes, state


def dequantize_blockwise(A: torch.Tensor, quant_state: Optional[QuantState] = None,
                         absmax: Optional[torch.Tensor] = None, code: Optional[torch.Tensor] = None,
                         out: Optional[torch.Tensor] = None, blocksize: int = 4096,
                         nested: bool = False) -> torch.Tensor:
    """Decode uint8 codes A to ``code[A] * absmax`` per block. Give either `quant_state` (from
    quantize_blockwise, or bitsandbytes') or `absmax` (+ `code`, `blocksize`; the result is then float32).
    `out` (contiguous, float32/bfloat16/float16, A.numel() elements, on A's device) is filled when given
    (copied into); its dtype wins. `code` may be any 256 float32 values (bitsandbytes' states may carry maps
    that are unsorted or reach beyond [-1, 1]; quantize_blockwise takes only sorted maps within it).
    `nested` is accepted for signature compatibility (the state says whether it is
    nested)."""
    del nested  # bitsandbytes reads nesting from the state as well
    if quant_state is None:
        if absmax is None:
            raise Zero8ValueError("dequantize_blockwise needs quant_state or absmax")
        quant_state = QuantState(absmax=absmax, code=_code_tensor(code), blocksize=blocksize, dtype=torch.float32)
    check_device_contiguous(A, "A")
    check_dtype(A, "A", torch.uint8)
    bs = _check_blocksize(quant_state.blocksize)
    _check_code(quant_state.code, A)
    scales = quant_state.absmax
    if quant_state.nested:
        scales = dequantize_blockwise(quant_state.absmax, quant_state.state2)
        scales += quant_state.offset
        scales = scales.float()
    n = A.numel()
    check_device_contiguous(scales, "absmax")
    check_same_device(scales, "absmax", A, "A")
    check_dtype(scales, "absmax", torch.float32)
    check_numel(scales, "absmax", -(-n // bs), f"one scale per block of {bs}")
    if out is None:
        out_dtype = quant_state.dtype if quant_state.dtype is not None else torch.float32
        if out_dtype not in FLOAT_DTYPES:
            raise Zero8ValueError(f"quant_state.dtype is {out_dtype}; zero8 kernels take float32, bfloat16 or "
                                  "float16")
        return _dequantize_blockwise_eager(A, scales, quant_state.code, bs, out_dtype)
    check_float_tensor(out, "out")
    check_same_device(out, "out", A, "A")
    check_numel(out, "out", n, "one element per code of A")
    return out.copy_(_dequantize_blockwise_eager(A, scales, quant_state.code, bs, out.dtype).view(out.shape))
