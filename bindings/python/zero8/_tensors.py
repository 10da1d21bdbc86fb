"""Where torch tensors meet zero8._C: validation whose errors name the tensor, and the raw pointer and
dtype code the C++ layer takes instead of the tensor (the extension does not link libtorch, so it works
with any torch build). Torch types stop here: callers pass ``ptr(t)`` and ``dtype_code(t)`` to ``_C``, and
for a CUDA tensor ``cuda_stream(t)``, torch's current stream on its device, where the ``*_cuda`` entries
queue their kernels, called within ``on_device(t)`` (the C++ side works on the current device).
"""

from __future__ import annotations

import contextlib
import sys

import torch

from . import _C
from ._C import Zero8NotSupportedError, Zero8ValueError

__all__ = [
    "CUDA_BUILT",
    "FLOAT_DTYPES",
    "check_cpu",
    "check_contiguous",
    "check_cpu_contiguous",
    "check_device",
    "check_device_contiguous",
    "check_same_device",
    "cuda_stream",
    "on_device",
    "check_dtype",
    "check_numel",
    "check_float_tensor",
    "check_not_dtensor",
    "dtype_code",
    "is_dtensor",
    "ptr",
    "torch_dtype",
]

# Whether this build has the CUDA kernels (pyproject.toml's ZERO8_CUDA decides at install).
CUDA_BUILT = bool(_C.build_info()["cuda"])
_NO_CUDA = ("this zero8 was built without its CUDA kernels (no GPU or no nvcc when it was installed, or "
            "ZERO8_CUDA=OFF); reinstall it on a machine with a GPU and the CUDA toolkit, or with ZERO8_CUDA=ON "
            "(docs/ENGINE.md, \"Install\")")

# Tensors of these types exactly are plain: not a subclass (a DTensor, a tensor subclass of another library).
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


# A call of one of zero8's custom ops through torch's dispatcher costs 10-20 us of host time (custom_op's Python
# kernel behind the dispatch keys): more than a small layer's kernels take, and a GPU idles when the host launches
# slower than it computes. zero8.nn and zero8.functional call their ops through EagerOp, which runs an op's
# function itself when nothing could tell the difference: plain tensors, none of them needing a gradient where
# autograd records, and nothing tracing or intercepting calls (torch.compile, torch.jit.trace, a dispatch or
# torch-function mode such as FakeTensorMode or FlopCounterMode, a functorch transform, forward-mode AD, the
# profiler, whose trace names the ops). The function checks its arguments as the op does. Anything else goes
# through the op. (torch.jit.trace would record the function's torch.empty and not the kernel that fills it.)


def direct(args) -> bool:
    """Whether a call with ``args`` may run an op's function instead of dispatching the op (see above)."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._is_torch_function_mode_enabled() or torch.autograd._profiler_enabled()
            or torch._C._get_tracing_state() is not None or torch.autograd.forward_ad._current_level >= 0
            or torch._C._functorch.peek_interpreter_stack() is not None):
        return False
    grad = torch.is_grad_enabled()
    for a in args:
        if isinstance(a, torch.Tensor) and (type(a) not in PLAIN_TENSORS or (grad and a.requires_grad)):
            return False
    return True


class EagerOp:
    """A custom op as zero8 calls it: its function ``fn`` where ``direct`` allows, else the op."""
    __slots__ = ("op", "fn")

    def __init__(self, op, fn):
        self.op, self.fn = op, fn

    def __call__(self, *args):
        return self.fn(*args) if direct(args) else self.op(*args)

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
    code = float_code(t.dtype)
    if code is None:
        raise Zero8ValueError(f"{name} has dtype {t.dtype}; zero8 kernels take float32, bfloat16 or float16")
    return code


def float_code(dtype: torch.dtype):
    """The zero8 DType of torch dtype float32, bfloat16 or float16, else None: dtype_code without its checks
    and messages, for a hot loop whose caller takes the checked path when it gets None."""
    return _CODES.get(dtype)


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
                      why: str = "this function takes plain tensors (a DTensor's own shard is t.to_local())") -> None:
    """Zero8NotSupportedError naming `name` if t is a DTensor; `why`: the caller's reason and alternative."""
    if is_dtensor(t):
        raise Zero8NotSupportedError(f"{name} is a DTensor (a torch.distributed sharded tensor, e.g. a parameter "
                                     f"of a module wrapped by FSDP2's fully_shard): {why}")


def check_cpu(t: torch.Tensor, name: str) -> None:
    """The tensor lives in host memory, for the functions that run on the CPU only. A CUDA tensor is a
    valid request they do not route to the CUDA kernels (Zero8NotSupportedError); any other device is a
    bad argument (Zero8ValueError). A DTensor is refused (Zero8NotSupportedError): its data pointer is not
    its data."""
    _check_is_tensor(t, name)
    check_not_dtensor(t, name)
    dev = t.device.type
    if dev == "cpu":
        return
    if dev == "cuda":
        raise Zero8NotSupportedError(f"{name} is on {t.device}: this function runs on CPU tensors")
    raise Zero8ValueError(f"{name} is on device {t.device}; zero8 needs a CPU tensor")


def check_device(t: torch.Tensor, name: str) -> None:
    """The tensor is where zero8's kernels run: host memory, or a CUDA device when this build has the CUDA
    kernels. A CUDA tensor in a build without them raises Zero8NotSupportedError naming the tensor and
    saying so; any other device (meta, mps...) is a bad argument (Zero8ValueError). A DTensor is refused
    (Zero8NotSupportedError): its data pointer is not its data."""
    # A plain tensor (no subclass, so no DTensor) in one test first: the checks below run to word an error.
    if type(t) in PLAIN_TENSORS and t.layout == torch.strided:
        dev = t.device.type
        if dev == "cpu" or (dev == "cuda" and CUDA_BUILT):
            return
    _check_is_tensor(t, name)
    check_not_dtensor(t, name)
    dev = t.device.type
    if dev == "cpu" or (dev == "cuda" and CUDA_BUILT):
        return
    if dev == "cuda":
        raise Zero8NotSupportedError(f"{name} is on {t.device}, but {_NO_CUDA}")
    raise Zero8ValueError(f"{name} is on device {t.device}; zero8 runs on CPU and CUDA tensors")


def check_same_device(t: torch.Tensor, name: str, ref: torch.Tensor, ref_name: str) -> None:
    """t is on ref's device (one kernel call reads both); the error names both tensors and devices."""
    _check_is_tensor(t, name)
    if t.device != ref.device:
        raise Zero8ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}; zero8 needs them on "
                              f"the same device (move one with .to({ref_name}.device))")


def check_device_contiguous(t: torch.Tensor, name: str) -> None:
    """A dense, contiguous tensor on a device zero8 runs on (check_device)."""
    check_device(t, name)
    check_contiguous(t, name)


def cuda_stream(t: torch.Tensor) -> int:
    """The cudaStream_t, as an int, of torch's current stream on CUDA tensor t's device: the stream the
    ``*_cuda`` entries of ``_C`` queue their kernels on, so they are ordered with torch's work as torch's
    own kernels are (``torch.cuda.stream(s)`` moves them to s). 0 is the legacy default stream, torch's
    default."""
    return torch.cuda.current_stream(t.device).cuda_stream


def on_device(t: torch.Tensor):
    """A context in which t's CUDA device is the current one (the C++ side allocates, uploads its tables and
    launches on the current device); nothing for a CPU tensor."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


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
    """A contiguous float32/bfloat16/float16 tensor on the CPU or (a CUDA build) a GPU; returns its DType
    code."""
    check_device_contiguous(t, name)
    return dtype_code(t, name)
