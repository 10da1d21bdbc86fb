"""zero8's int8 layers and primitives on CUDA tensors against the CPU. Integer results (codes, int32 products)
and everything computed from them by zero8's kernels (scales, the dequantizing epilogue, the per-block
product) are compared bit for bit: the CUDA kernels run the CPU's ZERO8_HD element math (--fmad=false) and
draw stochastic rounding from the same seed (torch's CPU generator, torch.manual_seed). Results that go
through a float32 matmul or reduction of torch's (LLM.int8's outlier columns and backward, the bias
gradient) are summed in another order on the GPU: they are compared with a float64 reference, allowed twice
the CPU's own error plus one ulp. Marked `cuda`; skipped, saying why, without a CUDA build or a GPU.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import zero8
from zero8 import _C, _ops
from zero8.nn import Int8Linear, Linear8bitLt
from zero8.nn import linear8bit as l8
from zero8.nn.int8_linear import blockwise_int8_matmul

from cuda_util import CUDA, DEV, assert_close_to_reference, assert_same_bits, busy

pytestmark = CUDA

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _no_tf32():
    # float32 matmuls in full precision on the GPU, as on the CPU (TF32 would be the tolerance, not rounding).
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def matrix(rows, cols, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 2, cols)[torch.randperm(cols, generator=g)]
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantizers_match_the_cpu(dtype):
    x = matrix(77, 130, dtype, seed=1)
    x[5, 7] = float("inf")  # its row, column and block get a NaN scale and zero codes
    xd = x.to(DEV)
    mask = (torch.arange(130) % 17 == 3).to(torch.uint8)
    for stochastic in (False, True):
        for name, fn, args in (("rows", l8.quantize_rows, ()), ("rows, masked", l8.quantize_rows, (mask,)),
                               ("cols", l8.quantize_cols, ()), ("blocks 32", l8.quantize_blocks, (32,)),
                               ("blocks 20", l8.quantize_blocks, (20,))):
            args_d = tuple(a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args)
            torch.manual_seed(7)
            q, s = fn(x, *args, stochastic=stochastic)
            torch.manual_seed(7)
            qd, sd = fn(xd, *args_d, stochastic=stochastic)
            assert qd.device == DEV and sd.device == DEV
            assert_same_bits(qd, q, f"{name} codes (stochastic={stochastic})")
            assert_same_bits(sd, s, f"{name} scales (stochastic={stochastic})")
    q, s = l8.quantize_blocks(x, 32)
    for out in DTYPES:
        assert_same_bits(l8.dequantize_blocks(q.to(DEV), s.to(DEV), 32, out), l8.dequantize_blocks(q, s, 32, out),
                         f"dequantized blocks as {out}")


def test_outlier_decomposition_matches_the_cpu():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(50, 200, generator=g)
    x[:, [3, 77, 150]] *= 40  # LLM.int8's emergent outlier features
    mask = torch.empty(200, dtype=torch.uint8)
    assert _C.int8_outlier_columns(x.data_ptr(), _C.DType.f32, 50, 200, 6.0, mask.data_ptr()) == 3
    xd = x.to(DEV)
    mask_d = torch.empty(200, dtype=torch.uint8, device=DEV)
    _C.int8_outlier_columns_cuda(xd.data_ptr(), _C.DType.f32, 50, 200, 6.0, mask_d.data_ptr(),
                                 stream=torch.cuda.current_stream().cuda_stream)
    assert_same_bits(mask_d, mask, "outlier columns")
    lin = Linear8bitLt.from_linear(torch.nn.Linear(200, 40), threshold=6.0)
    lin_d = copy.deepcopy(lin).to(DEV)
    lin_off, lin_off_d = copy.deepcopy(lin), copy.deepcopy(lin_d)
    lin_off.threshold = lin_off_d.threshold = float("inf")
    # No outlier decomposition: integer products and zero8's epilogue only, bit for bit.
    assert_same_bits(lin_off_d(xd), lin_off(x), "Linear8bitLt without outlier columns")
    # With it, the float part (the outlier columns times their dequantized weights, the same float32 operands
    # on both sides) is a float32 matmul, torch's on each side: all that may differ.
    want, got = lin(x), lin_d(xd)
    idx = mask.nonzero().squeeze(1)
    w_out = lin.weight[:, idx].float() * lin.weight_scale[:, None]
    ref = want.double() - (x[:, idx] @ w_out.t()).double() + x[:, idx].double() @ w_out.double().t()
    assert_close_to_reference(got, want, ref, "Linear8bitLt with outlier columns")


@pytest.mark.parametrize("shape", [(64, 256, 128), (5, 13, 7), (17, 8, 8), (300, 1000, 50)])
def test_int8_gemms_are_exact(shape):
    m, k, n = shape
    g = torch.Generator().manual_seed(m + k + n)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    want = a.long() @ b.long().t()
    ad, bd = a.to(DEV), b.to(DEV)
    assert torch.equal(l8.int8_mm(ad, bd).cpu().long(), want)  # torch._int_mm, padded to its shape rules
    assert torch.equal(l8.int8_mm(ad, bd.t().contiguous(), b_trans=False).cpu().long(), want)
    assert torch.equal(_ops.int8_gemm(ad, bd, True).cpu().long(), want)  # zero8's cuBLASLt GEMM
    assert torch.equal(_ops.int8_gemm(ad, bd.t().contiguous(), False).cpu().long(), want)


# Blocks of 16s take the tensor-core kernel (several 128 x 128 output tiles in the last case), 20 the tiled one.
@pytest.mark.parametrize("block,m,n,k", [(32, 70, 50, 96), (16, 70, 50, 96), (20, 70, 50, 96), (64, 300, 260, 192)])
def test_blockwise_matmul_matches_the_cpu(block, m, n, k):
    assert _C.int8_block_matmul_cuda_backend(block) == ("wmma" if block % 16 == 0 else "tiled")
    x, w = matrix(m, k, seed=3), matrix(n, k, seed=4)
    qa, sa = l8.quantize_blocks(x, block)
    qb, sb = l8.quantize_blocks(w, block)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(5))
    dev = [t.to(DEV) for t in (qa, sa, qb, sb, bias)]
    for out_dtype in DTYPES:
        want = blockwise_int8_matmul(qa, sa, qb, sb, block, out_dtype, bias)
        got = blockwise_int8_matmul(*dev[:4], block, out_dtype, dev[4])
        assert_same_bits(got, want, f"per-block product as {out_dtype}")
    # Transposed operands as a linear layer's backward passes them (stored the other way round, no copies):
    # dX = dY W and dW = dY^T X.
    qg, sg = l8.quantize_blocks(matrix(m, n, seed=6), block)
    qgd, sgd = qg.to(DEV), sg.to(DEV)
    want = blockwise_int8_matmul(qg, sg, qb.t(), sb.t(), block)
    got = blockwise_int8_matmul(qgd, sgd, dev[2].t(), dev[3].t(), block)
    assert_same_bits(got, want, "per-block product dY W")
    want = blockwise_int8_matmul(qg.t(), sg.t(), qa.t(), sa.t(), block)
    got = blockwise_int8_matmul(qgd.t(), sgd.t(), dev[0].t(), dev[1].t(), block)
    assert_same_bits(got, want, "per-block product dY^T X")


def _layer_pair(make):
    torch.manual_seed(0)
    layer = make()
    layer_d = copy.deepcopy(layer).to(DEV)
    return layer, layer_d


def test_int8linear_exact_warns_once_where_its_block_takes_the_plain_kernel(monkeypatch):
    monkeypatch.setattr(Int8Linear, "_warned_exact_on_gpu", False)
    x = torch.randn(40, 64, device=DEV)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # blocks of 16s take the tensor-core kernel; fast mode never warns
        Int8Linear(64, 32, device=DEV)(x)
        Int8Linear(64, 32, block_size=16, device=DEV)(x)
        Int8Linear(64, 32, block_size=20, gemm="fast", device=DEV)(x)
    with pytest.warns(UserWarning, match="block_size=20.*gemm='fast'"):
        Int8Linear(64, 32, block_size=20, device=DEV)(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        Int8Linear(64, 32, block_size=20, device=DEV)(x)


@pytest.mark.parametrize("gemm", ["exact", "fast"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_int8linear_forward_and_backward_match_the_cpu(gemm, dtype, bias):
    layer, layer_d = _layer_pair(lambda: Int8Linear(96, 80, bias=bias, gemm=gemm))
    x = matrix(3 * 45, 96, dtype, seed=8).reshape(3, 45, 96).requires_grad_()
    xd = x.detach().to(DEV).requires_grad_()
    grad = matrix(3 * 45, 80, dtype, seed=9).reshape(3, 45, 80)
    y, yd = layer(x), layer_d(xd)
    assert yd.device == DEV and yd.dtype == dtype
    assert_same_bits(yd, y, f"Int8Linear({gemm}) forward")
    torch.manual_seed(11)  # the output gradient's stochastic rounding draws its seed here
    y.backward(grad)
    torch.manual_seed(11)
    yd.backward(grad.to(DEV))
    assert_same_bits(xd.grad, x.grad, f"Int8Linear({gemm}) input gradient")
    assert_same_bits(layer_d.weight.grad, layer.weight.grad, f"Int8Linear({gemm}) weight gradient")
    if bias:  # torch's float32 sum over the tokens
        ref = grad.double().reshape(-1, 80).sum(0)
        assert_close_to_reference(layer_d.bias.grad, layer.bias.grad, ref, "Int8Linear bias gradient")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear8bitlt_forward_and_backward_match_the_cpu(dtype):
    # No outliers (threshold 0): the forward is integer products and zero8's epilogue, bit for bit. The
    # backward is a float32 matmul with the dequantized weight (straight-through), torch's on each side.
    lin = torch.nn.Linear(96, 80).to(dtype)
    layer, layer_d = _layer_pair(lambda: Linear8bitLt(96, 80, has_fp16_weights=True, dtype=dtype))
    layer.load_state_dict(lin.state_dict())
    layer_d.load_state_dict(lin.state_dict())
    x = matrix(64, 96, dtype, seed=12).requires_grad_()
    xd = x.detach().to(DEV).requires_grad_()
    y, yd = layer(x), layer_d(xd)
    assert_same_bits(yd, y, "Linear8bitLt forward")
    grad = matrix(64, 80, dtype, seed=13)
    y.backward(grad)
    yd.backward(grad.to(DEV))
    ref_x = (grad.double() @ lin.weight.detach().double())
    assert_close_to_reference(xd.grad, x.grad, ref_x, "Linear8bitLt input gradient")
    ref_w = grad.double().t() @ x.detach().double()
    assert_close_to_reference(layer_d.weight.grad, layer.weight.grad, ref_w, "Linear8bitLt weight gradient")


def test_layer_on_a_side_stream_without_a_host_wait():
    layer, layer_d = _layer_pair(lambda: Int8Linear(256, 512))
    x = matrix(512, 256, seed=14)
    want = layer(x)
    xd = torch.zeros(x.shape, device=DEV)
    staged = x.to(DEV)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    busy(s)
    with torch.cuda.stream(s):
        xd.copy_(staged)  # ready only after the busy wait: kernels on another stream would read zeros
        got = layer_d(xd)
        assert not s.query(), "Int8Linear's forward waited for the GPU"
    s.synchronize()
    assert_same_bits(got, want, "Int8Linear forward on a side stream")


def test_mixed_devices_name_both_tensors():
    layer = Int8Linear(16, 8).to(DEV)
    with pytest.raises(zero8.Zero8ValueError, match=r"Int8Linear\.weight is on cuda:\d but input is on cpu"):
        layer(torch.randn(4, 16))
    lin = Linear8bitLt(16, 8, has_fp16_weights=False).to(DEV)
    lin.bias = torch.nn.Parameter(torch.zeros(8))
    with pytest.raises(zero8.Zero8ValueError, match=r"Linear8bitLt\.bias is on cpu but input is on cuda:\d"):
        lin(torch.randn(4, 16, device=DEV))
    q, s = l8.quantize_blocks(torch.randn(32, 32, device=DEV), 32)
    with pytest.raises(zero8.Zero8ValueError, match=r"sb_t is on cpu but qb_t is on cuda:\d"):
        blockwise_int8_matmul(q, s, q, s.cpu(), 32)


def test_layers_made_on_the_gpu():
    for make in (lambda: Linear8bitLt(40, 24, device=DEV, has_fp16_weights=False),
                 lambda: Int8Linear(40, 24, device=DEV)):
        layer = make()
        assert all(t.device.type == "cuda" for t in layer.state_dict().values())
        assert layer(torch.randn(3, 40, device=DEV)).shape == (3, 24)
