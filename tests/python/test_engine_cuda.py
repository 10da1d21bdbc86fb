"""The engine with a model on a GPU (zero8.initialize of a CUDA model).

Everywhere (CPU): the device rules (LOCAL_RANK -> cuda:N as DeepSpeed, here with a patched device count; a
CUDA model in a build without CUDA; parameters on several devices or on an unsupported one), what "auto" means
for device buffers, and that the optimizer's calls that queue work on its stream (a gradient's add, the
deferred all-gather's waits) run inside the engine's stream order. The GPU tests (marked cuda; they skip
without a device) are the real check: with exact gradients (engine_util.ExactGradModel) the CUDA engine's
codes, masters and weights equal the CPU engine's bit for bit over several steps (fp32, bf16, fp16 with an
overflow; stage 1 and 2) in one process, on one rank over NCCL and on two ranks sharing one GPU over MPI
and over tcp (dist/dist_engine_cuda.py under mpirun and torchrun); the parameters are views of the optimizer's
device buffers; calls on another current stream than the engine's are ordered after it; a GPU checkpoint
resumes bit-exactly on the GPU and loads on the CPU; the pretraining example runs with --device cuda.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zero8
from zero8 import _C
from zero8.engine.device import check_device, local_device
from zero8.engine.world import nccl_by_default
from engine_util import (
    EXACT_COMBOS,
    ExactGradModel,
    config,
    dump_diff,
    engine_dump,
    exact_config,
    exact_train,
)
from mpirun_util import ROOT, pytest_under_launcher

STEPS = 4  # as dist_engine_cuda.py
_LAUNCHER_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")


@pytest.fixture
def no_launcher(monkeypatch):
    for var in _LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def cuda_build(monkeypatch):
    """This process's zero8 says it has CUDA kernels, whether or not this build has them."""
    monkeypatch.setattr(zero8._tensors, "CUDA_BUILT", True)


# ---- everywhere ----

def test_local_rank_picks_the_gpu(monkeypatch, no_launcher):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert local_device() == torch.device("cuda", 0)  # no launcher: rank 0's
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert local_device() == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert local_device() == torch.device("cuda", 1)  # 4 ranks on 2 GPUs: two per GPU
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "2")  # plain mpirun
    assert local_device() == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(zero8.Zero8NotSupportedError, match=r"local_device\(\): no CUDA device"):
        local_device()


def test_a_model_on_another_gpu_than_its_ranks_is_refused(monkeypatch, no_launcher, cuda_build):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    for var in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    assert check_device(torch.device("cuda", 3)) == torch.device("cuda", 3)  # no launcher: used where it is
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert check_device(torch.device("cuda", 2)) == torch.device("cuda", 2)
    host = re.escape(socket.gethostname())
    with pytest.raises(zero8.Zero8ValueError,
                       match=r"the model is on cuda:3, but this rank's device is cuda:2 \(LOCAL_RANK 2, 4 visible "
                             rf"device\(s\); this rank on host {host}, CUDA_VISIBLE_DEVICES not set\): put the model "
                             r"on its rank's GPU, model.to\(zero8.engine.local_device\(\)\)"):
        check_device(torch.device("cuda", 3))
    # The local rank named by the variable it came from (srun's here), with the global rank and the devices.
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    with pytest.raises(zero8.Zero8ValueError,
                       match=r"this rank's device is cuda:1 \(SLURM_LOCALID 1, 4 visible device\(s\); rank 5 "
                             rf"\(SLURM_PROCID\) on host {host}, CUDA_VISIBLE_DEVICES '4,5,6,7'\)"):
        check_device(torch.device("cuda", 0))
    assert check_device(torch.device("cpu")) == torch.device("cpu")  # a CPU model trains on the CPU


def test_a_cuda_model_in_a_build_without_cuda_names_the_build(monkeypatch):
    monkeypatch.setattr(zero8._tensors, "CUDA_BUILT", False)
    with pytest.raises(zero8.Zero8NotSupportedError,
                       match=r"the model is on cuda:0, but this zero8 was built without its CUDA kernels .*; or "
                             r"train on the CPU"):
        check_device(torch.device("cuda", 0))


def test_parameters_on_several_devices_or_an_unsupported_one_are_refused():
    model = torch.nn.Linear(3, 4)
    model.bias = torch.nn.Parameter(torch.empty(4, device="meta"))
    with pytest.raises(zero8.Zero8NotSupportedError,
                       match=r"the model's parameters are on 2 devices \(weight on cpu, bias on meta\)"):
        zero8.initialize(model=model, config=config())
    with pytest.raises(zero8.Zero8NotSupportedError,
                       match=r"the model is on meta: zero8's engine trains on the CPU or a CUDA device"):
        zero8.initialize(model=torch.nn.Linear(3, 4, device="meta"), config=config())


def test_auto_means_nccl_for_device_buffers_of_ranks_with_a_gpu_each(monkeypatch):
    monkeypatch.delenv("PMI_SIZE", raising=False)
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE", raising=False)
    assert _C.comm_auto_backend("device") == _C.comm_auto_backend("host") == "single"
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    if _C.build_info()["mpi"]:
        assert _C.comm_auto_backend("host") == "mpi"
        assert _C.comm_auto_backend("device") == ("nccl" if _C.build_info()["nccl"] else "mpi")
    with pytest.raises(zero8.Zero8ValueError, match="invalid argument 'memory'"):
        _C.comm_auto_backend("gpu")
    assert _C.comm_create("single").device == -1
    # The engine's 'auto' takes NCCL only where every process of the node can have a GPU of its own: not
    # where each sees every GPU and they outnumber them; where CUDA_VISIBLE_DEVICES may give each its own,
    # making the world decides (the GPUs' UUIDs; test_comm_nccl.cpp, test_torchrun.py).
    for var in ("LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    nccl = _C.comm_auto_backend("device") == "nccl"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert nccl_by_default() == nccl
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert not nccl_by_default()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert nccl_by_default() == nccl


def test_the_host_world_instead_of_nccl_is_asked_of_nccl_alone():
    """comm_create's host_if_gpus_shared ("auto"'s way to NCCL, keeping the host world where ranks share a GPU)
    belongs to backend 'nccl': with another it is refused by name."""
    for backend in ("single", "mpi", "auto"):
        with pytest.raises(zero8.Zero8ValueError, match=f"host_if_gpus_shared.*is for backend 'nccl', not '{backend}'"):
            _C.comm_create(backend, host_if_gpus_shared=True)
    if not _C.build_info()["nccl"]:
        with pytest.raises(zero8.Zero8NotSupportedError, match="zero8 was not built with NCCL"):
            _C.comm_create("nccl", host_if_gpus_shared=True)


class _DepthOrder:
    """Stands in for the engine's StreamOrder on the CPU, where the real one does nothing: counts how deep
    the calls are inside it."""

    def __init__(self):
        self.depth = 0

    def __call__(self):
        return self

    def __enter__(self):
        self.depth += 1

    def __exit__(self, *exc):
        self.depth -= 1
        return False


def _recording_opt(opt, order: _DepthOrder, names: tuple, log: list, **attrs):
    """The sharded optimizer with each call in `names` logged as (name, whether it ran inside `order`);
    attrs override attributes (gather_pending)."""

    class Recorder:
        def __getattr__(self, name):
            value = getattr(opt, name)
            if name not in names:
                return value

            def call(*args):
                log.append((name, order.depth > 0))
                return value(*args)
            return call

    rec = Recorder()
    rec.__dict__.update(attrs)
    return rec


def test_gradients_are_added_inside_the_stream_order():
    # Stage 2 hands each gradient to the optimizer (grad_add), which adds it on its own CUDA stream: inside the
    # engine's stream order, after the current stream (autograd's) wrote it and before that stream can reuse
    # its memory. On the CPU the order does nothing, so whether each add ran inside it is recorded instead.
    combo = "bf16_stage2_int8"
    engine, *_ = zero8.initialize(model=ExactGradModel(), config=exact_config(combo, 1))
    order, log = _DepthOrder(), []
    opt = engine._opt
    engine._stream_order, engine._opt = order, _recording_opt(opt, order, ("grad_add",), log)
    try:
        exact_train(engine, combo, 0, 1, 0)
    finally:
        engine._opt = opt
    engine.destroy()
    assert log and all(inside for _, inside in log), log


def test_deferred_gather_is_waited_for_inside_the_stream_order():
    # After a deferred step on a GPU a parameter's first touch makes the current stream wait for its piece:
    # the optimizer's wait_param queues the wait on its own stream, so it must run inside the engine's stream
    # order (the current stream then waits for the optimizer's); so must wait_gather, whose end the
    # current stream waits for. A deferring optimizer is stood in for (one CPU rank defers nothing).
    engine, *_ = zero8.initialize(model=ExactGradModel(), config=exact_config("fp32_stage2_int8_ef", 1))
    order, log = _DepthOrder(), []
    opt, defer = engine._opt, engine._defer_gather
    engine._stream_order, engine._defer_gather = order, True
    engine._opt = _recording_opt(opt, order, ("wait_param", "wait_gather"), log, gather_pending=True)
    try:
        engine._wait_param(1)
        engine._wait_gather()
    finally:
        engine._opt, engine._defer_gather = opt, defer
    engine.destroy()
    assert log == [("wait_param", True), ("wait_gather", True)]


# ---- on a GPU ----

def _cuda_engine(combo: str, seed: int = 0, device=None):
    device = device or local_device()
    engine, *_ = zero8.initialize(model=ExactGradModel(seed).to(device), config=exact_config(combo, 1))
    return engine


def _cpu_run(combo: str, steps: int = STEPS) -> dict:
    engine, *_ = zero8.initialize(model=ExactGradModel(), config=exact_config(combo, 1))
    exact_train(engine, combo, 0, steps, 0)
    out = engine_dump(engine)
    engine.destroy()
    return out


def test_parameters_are_views_of_the_optimizers_host_buffers():
    # The host side of the GPU test below: fp32 weights are views of the working buffer; their .grad views
    # of the gradient buffer in stage 1 only (stage 2 has no full gradient buffer: .grad stays None).
    for combo, grad_views in (("fp32_stage1_gas2", True), ("fp32_stage2_int8_ef", False)):
        engine, *_ = zero8.initialize(model=ExactGradModel(), config=exact_config(combo, 1))
        opt = engine._opt
        base = {g: torch.frombuffer(opt.working_buffer(g), dtype=torch.uint8).data_ptr() for g in range(2)}
        for i, p in enumerate(engine._params):
            g, offset, _ = opt.param_slot(i)
            assert p.data_ptr() == base[g] + 4 * offset
            if grad_views:
                assert p.grad.data_ptr() == torch.frombuffer(opt.grad_buffer(g), dtype=torch.uint8).data_ptr() \
                    + 4 * offset
            else:
                assert p.grad is None
        exact_train(engine, combo, 0, 2, 0)
        assert all((p.grad is not None) == grad_views for p in engine._params)
        engine.destroy()


@pytest.mark.cuda
def test_parameters_are_views_of_the_optimizers_device_buffers():
    combo = "fp32_stage1_gas2"  # stage 1: .grad is a view of the gradient buffer too (stage 2 has none)
    engine = _cuda_engine(combo)
    opt = engine._opt
    assert engine.device == local_device() and opt.config.memory == "device"
    for i, p in enumerate(engine._params):
        g, offset, _ = opt.param_slot(i)
        assert p.device == engine.device
        assert p.data_ptr() == opt.device_buffer("working", g).ptr + 4 * offset
        assert p.grad.data_ptr() == opt.device_buffer("grad", g).ptr + 4 * offset
    exact_train(engine, combo, 0, 2, 0)
    m = engine.memory_stats()
    assert m["device"] == str(engine.device) and m["torch_max_allocated"] >= m["torch_allocated"] >= 0
    assert m["state"] == opt.memory()["state"] > 0
    weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()  # the parameters keep their values in memory of their own, on the GPU
    for n, p in engine.module.named_parameters():
        assert p.device == weights[n].device and torch.equal(p, weights[n])


@pytest.mark.cuda
@pytest.mark.parametrize("combo", list(EXACT_COMBOS))
def test_cuda_steps_equal_cpu_steps_in_one_process(combo):
    ref = _cpu_run(combo)
    engine = _cuda_engine(combo)
    exact_train(engine, combo, 0, STEPS, 0)
    got = engine_dump(engine)
    engine.destroy()
    assert dump_diff(ref, got) == []


@pytest.mark.cuda
def test_calls_on_another_current_stream_are_ordered_after_it():
    # The engine's stream is the current one at initialize; forward, backward and step on another stream
    # (and an engine made on a side stream, trained on the default one) must give the same bits.
    combo = "bf16_stage2_int8"
    ref = _cpu_run(combo)
    side = torch.cuda.Stream()
    a = _cuda_engine(combo)
    with torch.cuda.stream(side):
        exact_train(a, combo, 0, STEPS, 0)
    torch.cuda.current_stream().wait_stream(side)
    assert dump_diff(ref, engine_dump(a)) == []
    a.destroy()
    with torch.cuda.stream(side):
        b = _cuda_engine(combo)
    exact_train(b, combo, 0, STEPS, 0)
    assert dump_diff(ref, engine_dump(b)) == []
    b.destroy()


@pytest.mark.cuda
def test_gpu_checkpoint_resumes_on_the_gpu_and_loads_on_the_cpu(tmp_path):
    combo, k, m = "fp16_stage2_overflow", 2, 2  # the overflow at step 1: a loss scale to restore
    a = _cuda_engine(combo)
    exact_train(a, combo, 0, k, 0)
    at_save = engine_dump(a)
    a.save_checkpoint(tmp_path)
    exact_train(a, combo, k, m, 0)
    run_a = engine_dump(a)
    a.destroy()
    b = _cuda_engine(combo, seed=3)
    b.load_checkpoint(tmp_path)
    assert dump_diff(at_save, engine_dump(b)) == []
    exact_train(b, combo, k, m, 0)
    assert dump_diff(run_a, engine_dump(b)) == []
    b.destroy()
    c, *_ = zero8.initialize(model=ExactGradModel(3), config=exact_config(combo, 1))
    c.load_checkpoint(tmp_path)
    assert dump_diff(at_save, engine_dump(c)) == []
    exact_train(c, combo, k, m, 0)
    assert dump_diff(run_a, engine_dump(c)) == []
    # The model-states file holds CPU tensors: torch.load needs no GPU.
    states = torch.load(tmp_path / "global_step2" / zero8.engine.MODEL_STATES_FILE, weights_only=False)
    assert all(t.device.type == "cpu" for t in states["module"].values())


def _run_dist(np: int, backend: str, tmp_path: Path, extra_env: dict | None = None, launcher: str = "mpirun") -> None:
    """dist_engine_cuda.py on np ranks under `launcher` with ZERO8_CUDA_BACKEND=backend; every rank must pass
    every test."""
    collected = pytest_under_launcher(np, "dist_engine_cuda.py", tmp_path / "results", timeout=240,
                                    launcher=launcher, ZERO8_COMM_TIMEOUT=120, ZERO8_CUDA_BACKEND=backend,
                                    ZERO8_CUDA_OUT=tmp_path, **(extra_env or {}))
    assert collected >= len(EXACT_COMBOS) + 2, collected


@pytest.mark.cuda
def test_one_rank_over_nccl(tmp_path):
    if not zero8.build_info()["nccl"]:
        pytest.skip("zero8 was built without NCCL")
    ref = tmp_path / "reference.pt"
    torch.save({combo: _cpu_run(combo) for combo in EXACT_COMBOS}, ref)
    _run_dist(1, "nccl", tmp_path, {"ZERO8_CUDA_REF": str(ref)})
    # The checkpoint the NCCL run saved, on the CPU (dist_engine_cuda.py's combo and steps).
    states = torch.load(tmp_path / "states.rank0.pt", weights_only=False)
    c, *_ = zero8.initialize(model=ExactGradModel(5), config=exact_config("bf16_stage2_int8", 1))
    c.load_checkpoint(tmp_path / "ckpt")
    assert dump_diff(states["at_save"], engine_dump(c)) == []
    exact_train(c, "bf16_stage2_int8", 3, 2, 0)
    assert dump_diff(states["run_a"], engine_dump(c)) == []
    c.destroy()


@pytest.mark.cuda
def test_two_ranks_share_one_gpu_over_mpi(tmp_path):
    _run_dist(2, "mpi", tmp_path)


@pytest.mark.cuda
def test_two_ranks_share_one_gpu_under_torchrun(tmp_path):
    """The same over the tcp backend, which stages device buffers as MPI does: no MPI library in the job."""
    _run_dist(2, "tcp", tmp_path, launcher="torchrun")


@pytest.mark.cuda
def test_the_pretraining_example_trains_on_cuda(tmp_path):
    cmd = [sys.executable, str(ROOT / "examples" / "pretrain_gpt.py"), "--device", "cuda", "--steps", "4",
           "--d_model", "32", "--n_layer", "1", "--n_head", "2", "--seq_len", "32", "--batch_size", "8",
           "--corpus_mb", "0.5", "--eval_seqs", "16", "--eval_interval", "2", "--log_interval", "2",
           "--save_interval", "0", "--no_progress", "--no_plot", "--out_dir", str(tmp_path),
           "--config", str(ROOT / "examples" / "configs" / "gpt_zero8_stage2.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore::UserWarning"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-5000:]
    assert "cuda:" in out and "peak GPU/rank" in out and "done: 4 steps" in out, out[-3000:]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "global_step4"
