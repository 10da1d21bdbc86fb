"""zero8.functional's block-wise codec on CUDA tensors against the CPU: the same codes and scales, bit for bit
(the CUDA kernels run the CPU's ZERO8_HD element math, built with --fmad=false), for every dtype and block
size, partial last blocks, non-finite blocks, stochastic rounding with the same seed, custom and nested maps,
and on the caller's stream. Marked `cuda`; skipped, saying why, without a CUDA build or a GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch

import zero8
from zero8 import _C
from zero8 import functional as F

from cuda_util import CUDA, DEV, assert_same_bits, busy, same_bits

pytestmark = CUDA

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CODES = {torch.float32: _C.DType.f32, torch.bfloat16: _C.DType.bf16, torch.float16: _C.DType.f16}


def data(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Blocks of very different scales (a codec that mixed blocks up would show), some with a negative
    extreme, a zero run, and one NaN and one Inf element (their blocks' scales are NaN)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-4, 3, n).flip(0)[torch.randperm(n, generator=g)]
    x[n // 3: n // 3 + 300] = 0
    if n > 5000:
        x[4321] = float("nan")
        x[n - 7] = float("inf")
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("blocksize", [64, 256, 2048, 4096])
def test_quantize_and_dequantize_match_the_cpu(dtype, blocksize):
    for n in (1, blocksize - 1, 3 * blocksize + 17, 40_000):
        x = data(n, dtype, seed=n + blocksize)
        codes, state = F.quantize_blockwise(x, blocksize=blocksize)
        codes_d, state_d = F.quantize_blockwise(x.to(DEV), blocksize=blocksize)
        assert codes_d.device == DEV and state_d.absmax.device == DEV
        assert_same_bits(codes_d, codes, f"codes n={n}")
        assert_same_bits(state_d.absmax, state.absmax, f"absmax n={n}")
        for out_dtype in DTYPES:  # decoded into any dtype: the float32 product, one rounding
            want = F.dequantize_blockwise(codes, state, out=torch.empty(n, dtype=out_dtype))
            got = F.dequantize_blockwise(codes_d, state_d, out=torch.empty(n, dtype=out_dtype, device=DEV))
            assert_same_bits(got, want, f"decoded n={n} into {out_dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_stochastic_rounding_with_the_same_seed_matches_the_cpu(dtype):
    n, block = 50_001, 256
    x = data(n, dtype, seed=3)
    xd = x.to(DEV)
    for seed, base in ((1, 0), (12345, 0), (12345, 1 << 40)):
        codes, absmax = torch.empty(n, dtype=torch.uint8), torch.empty(-(-n // block))
        codes_d, absmax_d = torch.empty_like(codes, device=DEV), torch.empty_like(absmax, device=DEV)
        _C.quantize_blockwise(x.data_ptr(), CODES[dtype], n, block, _C.MapKind.dynamic_signed, codes.data_ptr(),
                              absmax.data_ptr(), stochastic=True, seed=seed, index_base=base)
        _C.quantize_blockwise_cuda(xd.data_ptr(), CODES[dtype], n, block, _C.MapKind.dynamic_signed,
                                   codes_d.data_ptr(), absmax_d.data_ptr(), stochastic=True, seed=seed,
                                   index_base=base, stream=torch.cuda.current_stream().cuda_stream)
        assert_same_bits(codes_d, codes, f"stochastic codes seed={seed} base={base}")
        assert_same_bits(absmax_d, absmax, "stochastic absmax")
    # The draws matter: another seed gives other codes (the test above is not comparing nearest codes).
    assert not same_bits(codes_d, F.quantize_blockwise(xd, blocksize=block)[0])


def test_custom_and_unsigned_maps_match_the_cpu():
    x = data(30_000, torch.float32, seed=9)
    g = torch.Generator().manual_seed(2)
    maps = [F.create_dynamic_map(signed=True, max_exponent_bits=5), F.create_dynamic_map(signed=False),
            torch.tensor(_C.map_values(_C.MapKind.linear_signed)),
            torch.cat([torch.tensor([-1.0, 0.0, 1.0]), torch.rand(253, generator=g) * 2 - 1]).sort().values]
    for code in maps:
        src = x.abs() if bool((code >= 0).all()) else x
        codes, state = F.quantize_blockwise(src, code=code, blocksize=512)
        for code_d in (code, code.to(DEV)):  # the map on the CPU, or moved with the state (bitsandbytes)
            codes_d, state_d = F.quantize_blockwise(src.to(DEV), code=code_d, blocksize=512)
            assert_same_bits(codes_d, codes, "codes of a custom map")
            assert_same_bits(state_d.absmax, state.absmax, "absmax of a custom map")
            assert_same_bits(F.dequantize_blockwise(codes_d, state_d), F.dequantize_blockwise(codes, state),
                             "decoded with a custom map")


@pytest.mark.parametrize("blocksize", [64, 256])
def test_nested_matches_the_cpu(blocksize):
    # The nested offset is a float64 sum rounded once, the same on both sides (a float32 sum would not be).
    x = data(200_000, torch.bfloat16, seed=blocksize)
    codes, state = F.quantize_blockwise(x, blocksize=blocksize, nested=True)
    codes_d, state_d = F.quantize_blockwise(x.to(DEV), blocksize=blocksize, nested=True)
    assert_same_bits(codes_d, codes, "nested codes")
    assert_same_bits(state_d.absmax, state.absmax, "nested scale codes")
    assert_same_bits(state_d.offset, state.offset, "nested offset")
    assert_same_bits(state_d.state2.absmax, state.state2.absmax, "scales of the scales")
    assert_same_bits(F.dequantize_blockwise(codes_d, state_d), F.dequantize_blockwise(codes, state), "decoded")
    # bitsandbytes' QuantState.to moves everything, the map too: decoding reads the map back once.
    moved = copy.deepcopy(state).to(DEV)
    assert moved.code.device.type == "cuda"
    assert_same_bits(F.dequantize_blockwise(codes.to(DEV), moved), F.dequantize_blockwise(codes, state),
                     "decoded from a moved state")


def test_out_and_absmax_arguments_and_mixed_devices():
    x = data(10_000, torch.float16, seed=4).to(DEV)
    out = torch.empty(10_000, dtype=torch.uint8, device=DEV)
    absmax = torch.empty(-(-10_000 // 256), device=DEV)
    codes, state = F.quantize_blockwise(x, blocksize=256, out=out, absmax=absmax)
    assert codes.data_ptr() == out.data_ptr() and state.absmax.data_ptr() == absmax.data_ptr()
    with pytest.raises(zero8.Zero8ValueError, match=r"absmax is on cpu but A is on cuda:\d"):
        F.quantize_blockwise(x, blocksize=256, absmax=torch.empty(absmax.numel()))
    with pytest.raises(zero8.Zero8ValueError, match=r"out is on cpu but A is on cuda:\d"):
        F.dequantize_blockwise(codes, state, out=torch.empty(10_000))
    with pytest.raises(zero8.Zero8ValueError, match=r"absmax is on cpu but A is on cuda:\d"):
        F.dequantize_blockwise(codes, absmax=state.absmax.cpu(), blocksize=256)


def test_kernels_run_on_the_current_stream_without_a_host_wait():
    # On a side stream: its copy of x completes only after a delay. Kernels on another stream would read x
    # before the copy (zeros); a host wait inside the call would leave the stream idle when it returns.
    src = data(1 << 20, torch.float32, seed=5)
    want_codes, want = F.quantize_blockwise(src, blocksize=256)
    x = torch.zeros(src.shape, device=DEV)
    staged = src.to(DEV)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    busy(s)
    with torch.cuda.stream(s):
        x.copy_(staged)
        codes, state = F.quantize_blockwise(x, blocksize=256)
        back = F.dequantize_blockwise(codes, state)
        assert not s.query(), "the codec waited for the GPU"
    s.synchronize()
    assert_same_bits(codes, want_codes, "codes on a side stream")
    assert_same_bits(state.absmax, want.absmax, "absmax on a side stream")
    assert_same_bits(back, F.dequantize_blockwise(want_codes, want), "decoded on a side stream")


def test_a_second_gpu_uses_its_own_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU on this machine: the device guard is tested with two")
    x = data(9_999, torch.float32, seed=6)
    codes, state = F.quantize_blockwise(x, blocksize=128)
    codes_d, state_d = F.quantize_blockwise(x.to("cuda:1"), blocksize=128)
    assert codes_d.device == torch.device("cuda:1")
    assert_same_bits(codes_d, codes, "codes on cuda:1")
    assert_same_bits(state_d.absmax, state.absmax, "absmax on cuda:1")
