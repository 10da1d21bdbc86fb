"""What CUDA tensors meet on any machine, GPU or not: in a build without zero8's CUDA kernels every entry point
refuses them with Zero8NotSupportedError naming the tensor and saying the build has no CUDA, and tensors on
different devices fail naming both. torch's FakeTensorMode makes tensors that are on "cuda" without a GPU:
zero8 refuses them before anything reads their (absent) data. Not marked `cuda`: these run in CI.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import zero8
from zero8 import _C
from zero8 import functional as F
from zero8 import optim as zo
from zero8.nn import Int8Linear, Linear8bitLt

CUDA_BUILT = zero8.build_info()["cuda"]
cpu_build_only = pytest.mark.skipif(CUDA_BUILT, reason="this zero8 build has its CUDA kernels: CUDA tensors are "
                                                       "accepted (tests/python/test_cuda_*.py)")
NO_CUDA = "this zero8 was built without its CUDA kernels"


@cpu_build_only
def test_functional_refuses_cuda_tensors():
    with FakeTensorMode():
        x = torch.randn(1000, device="cuda")
        with pytest.raises(zero8.Zero8NotSupportedError, match=rf"^A is on cuda:0, but {NO_CUDA} .*ZERO8_CUDA=ON"):
            F.quantize_blockwise(x)
        codes = torch.zeros(1000, dtype=torch.uint8, device="cuda")
        with pytest.raises(zero8.Zero8NotSupportedError, match=rf"^A is on cuda:0, but {NO_CUDA}"):
            F.dequantize_blockwise(codes, absmax=torch.ones(1, device="cuda"), blocksize=4096)


@cpu_build_only
def test_optimizers_refuse_cuda_parameters():
    with FakeTensorMode():
        w = torch.nn.Parameter(torch.zeros(8, 16, device="cuda"))
        w.grad = torch.ones(8, 16, device="cuda")
        opt = zo.AdamW8bit([{"params": [w], "param_names": ["fc.weight"]}])
        with pytest.raises(zero8.Zero8NotSupportedError,
                           match=rf"^param_groups\[0\]\['params'\]\[0\] \('fc.weight'\) is on cuda:0, but {NO_CUDA}"):
            opt.step()
        assert len(opt.state) == 0  # refused before any state was made


@cpu_build_only
def test_int8_layers_refuse_cuda_inputs_and_devices():
    for make in (lambda: Int8Linear(16, 8), lambda: Linear8bitLt(16, 8, has_fp16_weights=False)):
        layer = make()
        with FakeTensorMode():
            x = torch.randn(4, 16, device="cuda")
            with pytest.raises(zero8.Zero8NotSupportedError, match=rf"^input is on cuda:0, but {NO_CUDA}"):
                layer(x)
    for make in (lambda: Linear8bitLt(8, 4, device="cuda"), lambda: Int8Linear(8, 4, device="cuda")):
        with pytest.raises(zero8.Zero8NotSupportedError, match=NO_CUDA):
            make()


@cpu_build_only
def test_cuda_entry_points_say_not_built_with_cuda():
    # The raw bindings, called with device pointers that a CPU-only build never dereferences.
    calls = [
        lambda: _C.quantize_blockwise_cuda(0, _C.DType.f32, 0, 256, _C.MapKind.dynamic_signed, 0, 0),
        lambda: _C.dequantize_blockwise_cuda(0, 0, 0, 256, _C.MapKind.dynamic_signed, 0, _C.DType.f32),
        lambda: _C.step_tensor_cuda(_C.StepArgs()),
        lambda: _C.step_tensor_cuda(_C.StepArgs(bits=32)),
        lambda: _C.int8_quantize_rows_cuda(0, _C.DType.f32, 0, 0, 0, 0),
        lambda: _C.int8_gemm_cuda(0, 0, 0, 0, 0, 0),
        lambda: _C.int8_block_matmul_cuda(0, 0, False, 0, 0, True, 0, 0, 0, 32),
    ]
    for call in calls:
        with pytest.raises(zero8.Zero8NotSupportedError, match="not built with CUDA"):
            call()


def test_mixed_parameter_and_gradient_devices_name_both():
    # A parameter moved through .data keeps its gradient where it was; the step names both tensors, before
    # it looks at whether this build can run on either device.
    with FakeTensorMode():
        p = torch.nn.Parameter(torch.zeros(64))
        p.grad = torch.ones(64)
        p.data = torch.zeros(64, device="cuda")
        p.fake_device = torch.device("cuda", 0)  # what .data= does to a real tensor's device; a fake keeps its own
        assert p.device.type == "cuda" and p.grad.device.type == "cpu"
        opt = zo.Adam8bit([p])
        with pytest.raises(zero8.Zero8ValueError, match=r"^param_groups\[0\]\['params'\]\[0\]\.grad is on cpu but "
                                                        r"param_groups\[0\]\['params'\]\[0\] is on cuda:0"):
            opt.step()


def test_mixed_layer_and_input_devices_name_both():
    with FakeTensorMode():  # (a module cannot .to() a fake device: its weight is set instead)
        for layer in (Int8Linear(16, 8), Linear8bitLt(16, 8)):
            layer.weight = torch.nn.Parameter(torch.zeros(8, 16, device="cuda"))
            name = type(layer).__name__
            with pytest.raises(zero8.Zero8ValueError, match=rf"^{name}\.weight is on cuda:0 but input is on cpu"):
                layer(torch.randn(4, 16))


def test_the_cuda_tests_device_equals_their_tensors_devices():
    # A tensor made on "cuda" reports cuda:0, and torch.device("cuda") != torch.device("cuda", 0): the GPU
    # tests' DEV (cuda_util) must carry the index, or each of their device comparisons fails.
    from cuda_util import DEV

    with FakeTensorMode():
        assert torch.empty(4, device="cuda").device == DEV
        assert torch.empty(4).to(DEV).device == DEV


def test_int8_primitives_name_tensors_on_two_devices():
    # dequantize_blocks / dequantize_matmul hand raw pointers to a kernel on the first tensor's device: a
    # tensor elsewhere is refused naming both (a GPU kernel would read a host address), a wrong dtype too.
    from zero8.nn import linear8bit as l8

    with FakeTensorMode():
        q = torch.zeros(32, 32, dtype=torch.int8, device="cuda")
        with pytest.raises(zero8.Zero8ValueError, match=r"^scale is on cpu but q is on cuda:0"):
            l8.dequantize_blocks(q, torch.ones(1, 1), 32)
        acc = torch.zeros(4, 8, dtype=torch.int32, device="cuda")
        rows, cols = torch.ones(4, device="cuda"), torch.ones(8, device="cuda")
        with pytest.raises(zero8.Zero8ValueError, match=r"^row_scale is on cpu but acc is on cuda:0"):
            l8.dequantize_matmul(acc, torch.ones(4), cols)
        with pytest.raises(zero8.Zero8ValueError, match=r"^bias is on cpu but acc is on cuda:0"):
            l8.dequantize_matmul(acc, rows, cols, bias=torch.zeros(8))
        with pytest.raises(zero8.Zero8ValueError, match=r"^out is on cpu but acc is on cuda:0"):
            l8.dequantize_matmul(acc, rows, cols, out=torch.zeros(4, 8), accumulate=True)
    q, s = l8.quantize_blocks(torch.randn(32, 32), 32)
    with pytest.raises(zero8.Zero8ValueError, match=r"^scale has dtype torch.float64; expected float32"):
        l8.dequantize_blocks(q, s.double(), 32)
    assert torch.equal(l8.dequantize_blocks(q, s, 32), q.float() * s)
