"""Where torch tensors meet zero8._C: validation whose errors name the tensor, and the raw pointer and
dtype code the C++ layer takes instead of the tensor (the extension does not link libtorch, so it works
with any torch build). Torch types stop here: callers pass ``ptr(t)`` and ``dtype_code(t)`` to ``_C``.
"""

from __future__ import annotations

import sys

import torch

from . import _C
from ._C import Zero8NotSupportedError, Zero8ValueError

__all__ = [
    "FLOAT_DTYPES",
    "check_cpu",
    "check_contiguous",
    "check_cpu_contiguous",
    "check_dtype",
    "check_numel",
    "check_float_tensor",
    "check_not_dtensor",
    "dtype_code",
    "is_dtensor",
    "ptr",
    "torch_dtype",
]

# The element types the kernels read and write (zero8::DType).
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CODES = {torch.float32: _C.DType.f32, torch.bfloat16: _C.DType.bf16, torch.float16: _C.DType.f16}
_TORCH = {int(code): dt for dt, code in _CODES.items()}


def _check_is_tensor(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise Zero8ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")


def ptr(t: torch.Tensor) -> int:
    """Address of the tensor's first element as an int (0 for an empty tensor without storage)."""
    return t.data_ptr()


def dtype_code(t: torch.Tensor, name: str = "tensor") -> "_C.DType":
    """The zero8 DType of a float32/bfloat16/float16 tensor; Zero8ValueError naming `name` otherwise."""
    _check_is_tensor(t, name)
    code = _CODES.get(t.dtype)
    if code is None:
        raise Zero8ValueError(f"{name} has dtype {t.dtype}; zero8 kernels take float32, bfloat16 or float16")
    return code


def torch_dtype(code) -> torch.dtype:
    """The torch dtype of a zero8 DType."""
    return _TORCH[int(code)]


def is_dtensor(t) -> bool:
    """Whether t is a torch.distributed DTensor (FSDP2's sharded parameters, tensor parallelism). Its
    device is its local shard's, but its data_ptr() is 0: the data is in a local tensor it wraps. (No
    DTensor exists unless torch.distributed.tensor was imported, so it is looked up, never imported.)"""
    mod = sys.modules.get("torch.distributed.tensor")
    cls = getattr(mod, "DTensor", None) if mod is not None else None
    return cls is not None and isinstance(t, cls)


def check_not_dtensor(t: torch.Tensor, name: str,
                      why: str = "zero8 does not support DTensors; it reads plain CPU tensors") -> None:
    """Zero8NotSupportedError naming `name` if t is a DTensor; `why`: the caller's reason and alternative."""
    if is_dtensor(t):
        raise Zero8NotSupportedError(f"{name} is a DTensor (a torch.distributed sharded tensor, e.g. a parameter "
                                     f"of a module wrapped by FSDP2's fully_shard): {why}")


def check_cpu(t: torch.Tensor, name: str) -> None:
    """The tensor lives in host memory. A CUDA tensor is a valid request the Python layer does not route
    to the CUDA kernels (Zero8NotSupportedError); any other device is a bad argument (Zero8ValueError). A
    DTensor is refused (Zero8NotSupportedError): its data pointer is not its data."""
    _check_is_tensor(t, name)
    check_not_dtensor(t, name)
    dev = t.device.type
    if dev == "cpu":
        return
    if dev == "cuda":
        raise Zero8NotSupportedError(
            f"{name} is on {t.device}: zero8's Python layer runs on CPU tensors "
            f"(this build: CUDA kernels {'compiled' if _C.build_info()['cuda'] else 'not compiled'})"
        )
    raise Zero8ValueError(f"{name} is on device {t.device}; zero8 needs a CPU tensor")


def check_contiguous(t: torch.Tensor, name: str) -> None:
    _check_is_tensor(t, name)
    if not t.is_contiguous():
        raise Zero8ValueError(
            f"{name} must be contiguous (shape {tuple(t.shape)}, strides {t.stride()}); call .contiguous() first"
        )


def check_cpu_contiguous(t: torch.Tensor, name: str) -> None:
    """A dense, contiguous CPU tensor: what a raw pointer plus element count describes."""
    check_cpu(t, name)
    check_contiguous(t, name)


def check_dtype(t: torch.Tensor, name: str, allowed) -> None:
    """t.dtype is `allowed` (a dtype or a tuple of them)."""
    _check_is_tensor(t, name)
    allowed = allowed if isinstance(allowed, tuple) else (allowed,)
    if t.dtype not in allowed:
        want = " or ".join(str(a).replace("torch.", "") for a in allowed)
        raise Zero8ValueError(f"{name} has dtype {t.dtype}; expected {want}")


def check_numel(t: torch.Tensor, name: str, n: int, what: str = "") -> None:
    if t.numel() != n:
        extra = f" ({what})" if what else ""
        raise Zero8ValueError(f"{name} has {t.numel()} elements; expected {n}{extra}")


def check_float_tensor(t: torch.Tensor, name: str) -> "_C.DType":
    """A contiguous CPU float32/bfloat16/float16 tensor; returns its DType code."""
    check_cpu_contiguous(t, name)
    return dtype_code(t, name)
