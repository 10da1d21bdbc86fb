"""Shared by the tests of zero8 on CUDA tensors (tests/python/test_cuda_*.py): the `cuda` marker with the
reason to skip (no CUDA kernels in this build, or no GPU), bit-for-bit comparison, a way to hold a stream
busy, and the tolerance of a float result against a float64 reference, tied to the CPU's own error.
`pytest -m cuda` selects these tests (scripts/gpu_check.sh runs them on a GPU machine).
"""

from __future__ import annotations

import os

import pytest
import torch

import zero8


def cuda_unavailable() -> str | None:
    """Why zero8 cannot run on CUDA tensors here, or None when it can."""
    if not zero8.build_info()["cuda"]:
        return ("this zero8 build has no CUDA kernels (installed without a GPU or nvcc, or with ZERO8_CUDA=OFF; "
                "see docs/ENGINE.md, 'Install')")
    if not torch.cuda.is_available():
        return "no CUDA device on this machine (torch.cuda.is_available() is False)"
    return None


REASON = cuda_unavailable()
# pytestmark of every CUDA test module: selected by -m cuda, skipped (saying why) where it cannot run.
CUDA = [pytest.mark.cuda, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
# With its index: tensors report cuda:0, and torch.device("cuda") == torch.device("cuda", 0) is False, so a
# bare "cuda" here would fail every device comparison of the tests.
DEV = torch.device("cuda", 0)


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's bit pattern on the CPU (so -0.0 differs from 0.0 and NaNs compare by payload)."""
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def differ(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Where got and want (same dtype and shape) differ in any bit, but for NaNs: their payloads are the
    hardware's (x86 keeps an operand's, a GPU writes its canonical NaN), so any NaN stands for any other."""
    diff = bits(got) != bits(want)
    if got.is_floating_point():
        diff &= ~(torch.isnan(got.detach().cpu()) & torch.isnan(want.detach().cpu()))
    return diff


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and not bool(differ(a, b).any())


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), (what, got.dtype, want.dtype,
                                                                               got.shape, want.shape)
    diff = differ(got, want).reshape(-1)
    if bool(diff.any()):
        i = int(diff.nonzero()[0])
        raise AssertionError(f"{what}: {int(diff.sum())} of {diff.numel()} elements differ; first at flat index "
                             f"{i}: {got.reshape(-1)[i].item()!r} (CUDA) vs {want.reshape(-1)[i].item()!r} (CPU)")


def busy(stream: torch.cuda.Stream, ms: float = 50.0) -> None:
    """Queue about `ms` milliseconds of GPU spinning on `stream` (torch.cuda._sleep counts clock cycles), so
    work queued after it on that stream runs late, and work on another stream (or with a host wait) shows."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    khz = getattr(props, "clock_rate", 0) or 2_000_000  # 0 or absent: not reported
    cycles = int(max(khz, 1_000_000) * ms)  # at least a 1 GHz clock's worth: spinning longer is harmless
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)


def assert_close_to_reference(got: torch.Tensor, cpu: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """A float result whose CUDA and CPU versions may round differently (a float32 matmul or reduction sums
    in another order): the CUDA error against the float64 reference `ref` is at most twice the CPU's own
    error, plus one ulp of the result's dtype at the value (for elements the CPU gets exactly right)."""
    ref = ref.detach().double().cpu()
    err_gpu = (got.detach().double().cpu() - ref).abs()
    err_cpu = (cpu.detach().double().cpu() - ref).abs()
    ulp = torch.finfo(got.dtype).eps * ref.abs().clamp_min(torch.finfo(got.dtype).tiny)
    bound = 2 * err_cpu.max() + ulp
    bad = err_gpu > bound
    assert not bool(bad.any()), (f"{what}: {int(bad.sum())} elements off by more than 2x the CPU's largest error "
                                 f"({float(err_cpu.max()):.3g}) + 1 ulp; worst {float(err_gpu.max()):.3g}")


def dist_world():
    """For the multi-rank GPU test files (tests/python/dist/dist_*_cuda.py, under mpirun): (backend as the
    parent test set it in ZERO8_CUDA_BACKEND, "mpi" by default; this rank's GPU, made current; the world
    communicator over it)."""
    from zero8.engine import local_device, world_comm

    backend = os.environ.get("ZERO8_CUDA_BACKEND", "mpi")
    device = local_device()
    torch.cuda.set_device(device)
    return backend, device, world_comm(backend, device=device)


def backend_config(cfg: dict, backend: str, device: torch.device) -> dict:
    """cfg with zero8.comm_backend for a model on `device` in those files: `backend` on the GPU, "auto" (the
    world made already) for a CPU reference beside it."""
    cfg.setdefault("zero8", {})["comm_backend"] = backend if device.type == "cuda" else "auto"
    return cfg
