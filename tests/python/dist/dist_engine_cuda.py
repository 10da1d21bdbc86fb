"""The engine on a GPU on K ranks (run by test_engine_cuda.py as ``mpirun -np K python3 -m pytest -q
tests/python/dist/dist_engine_cuda.py`` with ZERO8_CUDA_BACKEND=nccl or mpi, or under torchrun with tcp; the
name does not start with test_ so that the single-process pytest run does not collect it).

With exact gradients (engine_util.ExactGradModel) the CUDA engine's codes, masters and weights equal the
CPU engine's bit for bit after every step of each combination (fp32 / bf16 / fp16 with an overflow, stage
1 and 2). Over MPI or tcp (device buffers staged, so the ranks may share one GPU) every rank runs the CPU engine
itself; over NCCL (one GPU per rank) the CPU engine cannot share the process's world, and rank 0 reads the
reference the parent test computed (ZERO8_CUDA_REF, one rank). A GPU checkpoint resumes bit-exactly on the
GPU, and over MPI or tcp loads into a CPU engine that resumes the same way; over NCCL the parent loads it on the
CPU (ZERO8_CUDA_OUT holds the checkpoint and the states to compare).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # engine_util, cuda_util

import zero8  # noqa: E402
from cuda_util import backend_config, dist_world  # noqa: E402
from engine_util import (  # noqa: E402
    EXACT_COMBOS,
    ExactGradModel,
    dump_diff,
    engine_dump,
    exact_config,
    exact_train,
)

torch.set_num_threads(1)
BACKEND, DEVICE, WORLD = dist_world()
RANK, N = WORLD.rank, WORLD.size
OUT = Path(os.environ.get("ZERO8_CUDA_OUT", "."))
STEPS = 4


def engine_on(device, combo: str, seed: int = 0):
    cfg = backend_config(exact_config(combo, N), BACKEND, device)
    engine, *_ = zero8.initialize(model=ExactGradModel(seed).to(device), config=cfg)
    return engine


def cpu_reference(combo: str) -> dict:
    ref = os.environ.get("ZERO8_CUDA_REF")
    if WORLD.memory == "device":  # NCCL: the CPU engine cannot use this world; the parent computed it
        assert ref and N == 1, "over NCCL the CPU reference comes from the parent test (one rank)"
        return torch.load(ref, weights_only=False)[combo]
    engine = engine_on(torch.device("cpu"), combo)
    exact_train(engine, combo, 0, STEPS, RANK)
    out = engine_dump(engine)
    engine.destroy()
    return out


def test_the_engine_is_on_the_device():
    engine = engine_on(DEVICE, "fp32_stage2_int8_ef")
    assert engine.device == DEVICE and engine._dp.backend == BACKEND
    assert all(p.device == DEVICE for p in engine.module.parameters())
    assert engine._opt.config.memory == "device"
    # Several ranks run the optimizer's thread, so the step's all-gather goes on into the next forward (the
    # steps below compare its bits); one rank gathers nothing.
    assert engine._defer_gather == (N > 1)
    engine.destroy()


@pytest.mark.parametrize("combo", list(EXACT_COMBOS))
def test_cuda_steps_equal_cpu_steps(combo):
    ref = cpu_reference(combo)
    engine = engine_on(DEVICE, combo)
    exact_train(engine, combo, 0, STEPS, RANK)
    got = engine_dump(engine)
    engine.destroy()
    assert dump_diff(ref, got) == [], f"rank {RANK}"
    if EXACT_COMBOS[combo].get("inf_step") is not None:
        assert got["steps"][1] == 1, got["steps"]  # the overflow was skipped


def test_gpu_checkpoint_resumes_on_the_gpu_and_loads_on_the_cpu():
    combo, k, m = "bf16_stage2_int8", 3, 2
    ckpt = OUT / "ckpt"
    a = engine_on(DEVICE, combo)
    exact_train(a, combo, 0, k, RANK)
    at_save = engine_dump(a)
    a.save_checkpoint(ckpt, client_state={"note": "gpu"})
    exact_train(a, combo, k, m, RANK)
    run_a = engine_dump(a)
    a.destroy()
    torch.save({"at_save": at_save, "run_a": run_a}, OUT / f"states.rank{RANK}.pt")

    b = engine_on(DEVICE, combo, seed=5)
    _, client = b.load_checkpoint(ckpt)
    assert client["note"] == "gpu"
    assert dump_diff(at_save, engine_dump(b)) == [], f"rank {RANK}: right after the load"
    exact_train(b, combo, k, m, RANK)
    assert dump_diff(run_a, engine_dump(b)) == [], f"rank {RANK}: resumed on the GPU"
    b.destroy()

    if WORLD.memory == "device":
        return  # NCCL: test_engine_cuda.py loads it on the CPU
    c = engine_on(torch.device("cpu"), combo, seed=5)
    c.load_checkpoint(ckpt)
    assert dump_diff(at_save, engine_dump(c)) == [], f"rank {RANK}: the GPU checkpoint on the CPU"
    exact_train(c, combo, k, m, RANK)
    assert dump_diff(run_a, engine_dump(c)) == [], f"rank {RANK}: resumed on the CPU"
    c.destroy()
