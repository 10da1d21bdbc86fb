"""The pipeline engine on GPUs: 2 ranks, 2 stages (run by test_pipe_dist.py as ``mpirun -np 2 python3 -m
pytest tests/python/dist/dist_pipe_cuda.py`` with ZERO8_CUDA_BACKEND=mpi, the ranks sharing one GPU and
their messages staged through host memory, or nccl with a GPU per rank; or under torchrun with tcp, staged as
over MPI; the name does not start with test_
so the single-process run does not collect it).

References as in dist_pipe.py: the plain engine over the same layers on the same GPU, fed the same
micro-batches, on a data-parallel group of one. With exact settings a stage runs the same kernels on the
same numbers as the plain model's layers, so losses and weights must be equal bit for bit; int8 activations
keep the loss within 1% at a quarter of the bytes; tied weights stay the same bytes on both stages; a GPU
checkpoint resumes bit-exactly on the GPU and, over MPI or tcp, loads into the same pipeline on the CPU.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # engine_util, pipe_util, cuda_util

import zero8  # noqa: E402
from zero8.config import load_config  # noqa: E402
from cuda_util import backend_config, dist_world  # noqa: E402
from zero8.engine.training import Zero8Engine  # noqa: E402
from zero8.pipe import LayerModule, LayerSpec, PipelineModule  # noqa: E402
from engine_util import EXACT, FULL8, config, make_data  # noqa: E402
from pipe_util import (  # noqa: E402
    digest,
    lm_layers,
    lm_loss,
    make_tokens,
    micro_batches,
    mse,
    regression_layers,
    train_plain,
)

torch.set_num_threads(1)
B = 32
STAGES = 2
# Where the backend asked for is what "auto" makes (NCCL with a GPU per rank; MPI or tcp where the ranks
# share the one GPU), a first pipeline model is built before anything made the world, as in a DeepSpeed
# script: PipelineModule makes the world for this rank's GPU and puts its stage there.
EARLY = (PipelineModule(regression_layers(), num_stages=STAGES, loss_fn=mse, seed_layers=True,
                        partition_method="uniform")
         if os.environ.get("ZERO8_CUDA_BACKEND", "mpi") == "nccl" or torch.cuda.device_count() == 1 else None)
BACKEND, DEVICE, WORLD = dist_world()
RANK, N = WORLD.rank, WORLD.size
SHARED = Path(os.environ.get("ZERO8_CUDA_OUT", "."))
CPU = torch.device("cpu")
on_cpu_too = pytest.mark.skipif(WORLD.memory != "host", reason="the CPU pipeline needs a host world, not NCCL")


def on(device, data):
    return tuple(t.to(device) for t in data)


DATA = on(DEVICE, make_data())
TOKENS = on(DEVICE, make_tokens())


def all_true(ok: bool) -> bool:
    return WORLD.all_reduce_f64([0.0 if ok else 1.0], "max")[0] == 0.0


def with_backend(cfg: dict, device=DEVICE) -> dict:
    return backend_config(cfg, BACKEND, device)


def pipeline(layers, loss, cfg: dict, device=DEVICE, **kw):
    model = PipelineModule(layers, num_stages=STAGES, loss_fn=loss, seed_layers=True, device=device, **kw)
    engine, _, _, _ = zero8.initialize(model=model, config=with_backend(cfg, device))
    return engine


def plain(layers, loss, cfg: dict):
    """The plain engine over all the layers on this rank's GPU, alone in its data-parallel group."""
    comm = WORLD.split(RANK, RANK, "reference")
    model = LayerModule(layers, loss_fn=loss, seed_layers=True).to(DEVICE)
    engine = Zero8Engine(model, load_config(with_backend(cfg), 1, rank=RANK, warn=False), comm, WORLD)
    return engine, comm


def train_pipe(engine, data, steps: int, first: int = 0) -> list[float]:
    return [float(engine.train_batch(micro_batches(data, s, B, 0, 1, engine.micro_batches)))
            for s in range(first, first + steps)]


def stage_diff(engine, reference: torch.nn.Module) -> float:
    """The largest difference between this stage's weights and the reference model's of the same names
    (inf when the stage has none or a name is missing)."""
    ref = reference.state_dict()
    mine = engine.module.state_dict()
    if not mine or any(k not in ref for k in mine):
        return float("inf")
    return max(float((v.float() - ref[k].to(v.device).float()).abs().max()) for k, v in mine.items())


def test_stages_train_on_the_gpu_and_report_the_loss_there():
    engine = pipeline(regression_layers(), mse, config(gas=2, zero8=FULL8))
    losses = [engine.train_batch(micro_batches(DATA, s, B, 0, 1, 2)) for s in range(4)]
    on_gpu = all(p.device == DEVICE for p in engine.module.parameters()) and engine.device == DEVICE
    loss_on_gpu = all(v.device == DEVICE and v.dtype == torch.float32 for v in losses)
    values = [float(v) for v in losses]
    ok = on_gpu and loss_on_gpu and values[-1] < values[0] and engine.global_steps == 4
    assert all_true(ok), (RANK, on_gpu, [v.device for v in losses], values)


@pytest.mark.parametrize("gas,stage", [(2, 1), (4, 2)])
def test_exact_settings_equal_the_plain_engine_on_the_gpu_bit_for_bit(gas, stage):
    cfg = config(gas=gas, stage=stage, zero8=EXACT)
    engine = pipeline(regression_layers(), mse, cfg, partition_method="uniform")
    losses = train_pipe(engine, DATA, 5)
    ref, comm = plain(regression_layers(), mse, cfg)
    ref_losses = train_plain(ref, DATA, 5, B, mse, 0, 1, comm)
    diff = stage_diff(engine, ref.module)
    assert all_true(losses == ref_losses and diff == 0.0), (RANK, losses, ref_losses, diff)
    assert losses[-1] < losses[0]


def test_int8_activations_quarter_the_bytes_and_keep_the_loss():
    """As dist_pipe.py's test on the CPU: bytes per boundary <= 0.26 x fp32, the loss within 1%."""
    runs = {}
    for int8 in (False, True):
        cfg = config(gas=4, lr=3e-4, zero8=dict(EXACT, int8_activations=int8))
        engine = pipeline(regression_layers(hidden=1024), mse, cfg, partition_method="uniform")
        runs[int8] = (train_pipe(engine, DATA, 6), engine.boundary_stats())
    (fp, fp_bytes), (q, q_bytes) = runs[False], runs[True]
    ratios = [b["bytes"] / f["bytes"] for b, f in zip(q_bytes, fp_bytes)]
    close = all(abs(a - b) <= 0.01 * b for a, b in zip(q, fp)) and q != fp
    ok = len(ratios) == 1 and all(r <= 0.26 for r in ratios) and close
    assert all_true(ok), (RANK, ratios, fp, q)


def test_tied_embedding_and_head_stay_identical_on_both_stages():
    cfg = config(gas=2, zero8=EXACT)
    engine = pipeline(lm_layers(3), lm_loss, cfg, partition_method="uniform")
    losses = train_pipe(engine, TOKENS, 5)
    tied = engine.module.tied_modules["embed"].weight  # 2 stages: both hold the tie
    holders = WORLD.all_gather_bytes(digest([tied]))
    ref, comm = plain(lm_layers(3), lm_loss, cfg)
    ref_losses = train_plain(ref, TOKENS, 5, B, lm_loss, 0, 1, comm)
    diff = float((tied - ref.module.tied_modules["embed"].weight).detach().abs().max())
    # The tie's gradient adds its two uses in another order than one backward does: rounding (see dist_pipe.py).
    close = diff <= 1e-5 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, ref_losses))
    assert all_true(holders[0] == holders[1] and close), (RANK, losses, ref_losses, diff)
    assert losses[-1] < losses[0]


def test_eval_batch_equals_the_plain_engines_loss():
    cfg = config(gas=2, zero8=EXACT)
    engine = pipeline(regression_layers(), mse, cfg)
    train_pipe(engine, DATA, 2)
    value = engine.eval_batch(micro_batches(DATA, 9, B, 0, 1, 4), num_micro_batches=4)
    ref, comm = plain(regression_layers(), mse, cfg)
    train_plain(ref, DATA, 2, B, mse, 0, 1, comm)
    ref.eval()
    with torch.no_grad():
        total = sum(float(mse(ref(x), y).double()) for x, y in micro_batches(DATA, 9, B, 0, 1, 4)) / 4
    expected = float(torch.tensor(total, dtype=torch.float32))
    assert all_true(value.device == DEVICE and float(value) == expected), (RANK, value, expected)


@pytest.mark.skipif(EARLY is None, reason="the backend asked for is not the one 'auto' makes on this machine")
def test_a_pipeline_built_before_the_world_puts_its_stage_on_this_ranks_gpu():
    """DeepSpeed's order, PipelineModule before initialize: the stage is on the rank's GPU and the world
    was made for it (NCCL where each rank has a GPU), so the backend asked for gets that world, and the
    pipeline trains as one built after the world."""
    on_gpu = all(p.device == DEVICE for p in EARLY.parameters())
    cfg = config(gas=2, zero8=EXACT)
    engine, _, _, _ = zero8.initialize(model=EARLY, config=with_backend(cfg))
    early = train_pipe(engine, DATA, 3)
    later = train_pipe(pipeline(regression_layers(), mse, cfg, partition_method="uniform"), DATA, 3)
    ok = on_gpu and WORLD.backend == BACKEND and engine.device == DEVICE and early == later
    assert all_true(ok), (RANK, on_gpu, WORLD.backend, early, later)


def test_each_stage_moves_only_what_it_reads_to_the_gpu():
    """As DeepSpeed's: the first stage moves a CPU micro-batch's inputs to its GPU, the last its labels; the
    part a stage does not read is a meta tensor here, which moving would fail on."""
    cfg = config(gas=2, zero8=EXACT)
    engine = pipeline(regression_layers(), mse, cfg, partition_method="uniform")
    unread = torch.empty(0, device="meta")
    host = on(CPU, DATA)

    def batches(s):
        for x, y in micro_batches(host, s, B, 0, 1, 2):
            yield x if engine.is_first_stage() else unread, y if engine.is_last_stage() else unread

    losses = [engine.train_batch(batches(s)) for s in range(3)]
    ref = train_pipe(pipeline(regression_layers(), mse, cfg, partition_method="uniform"), DATA, 3)
    ok = [float(v) for v in losses] == ref and all(v.device == DEVICE for v in losses)
    assert all_true(ok), (RANK, losses, ref)


class Pair(nn.Module):
    """A last layer with two outputs: the float32 input and a bfloat16 copy."""

    def forward(self, x):
        return x, x.to(torch.bfloat16)


def test_eval_batch_averages_outputs_on_the_gpu_in_their_dtype():
    """compute_loss=False, reduce_output "avg": each output tensor's mean stays on the GPU, in its dtype (no
    copy to the host, bfloat16 kept), as DeepSpeed's _reduce_outputs; the values: test_pipe.py, dist_pipe.py."""
    layers = [*regression_layers(), LayerSpec(Pair)]
    engine = pipeline(layers, None, config(gas=2, zero8=EXACT), partition_method="uniform")
    out = engine.eval_batch(micro_batches(DATA, 3, B, 0, 1, 4), compute_loss=False, num_micro_batches=4)
    want = [(DEVICE, torch.float32), (DEVICE, torch.bfloat16)]
    ok = (isinstance(out, tuple) and [(t.device, t.dtype) for t in out] == want) if engine.is_last_stage() else (
        out is None)
    assert all_true(ok), (RANK, out)


@pytest.fixture(scope="module")
def saved():
    """A GPU pipeline's checkpoint after 2 steps: (path, its weights then, the next 2 losses and the weights
    after them, trained on)."""
    path = SHARED / "pipe_ckpt"
    a = pipeline(regression_layers(), mse, config(gas=2, zero8=FULL8))
    train_pipe(a, DATA, 2)
    a.save_checkpoint(path)
    at_save = digest(a.module.parameters())
    after = train_pipe(a, DATA, 2, first=2)
    return path, at_save, after, digest(a.module.parameters())


def test_gpu_checkpoint_resumes_bit_exactly_on_the_gpu(saved):
    path, _, after, weights_after = saved
    b = pipeline(regression_layers(), mse, config(gas=2, zero8=FULL8))
    b.load_checkpoint(path)
    resumed = train_pipe(b, DATA, 2, first=2)
    same = resumed == after and digest(b.module.parameters()) == weights_after and b.global_steps == 4
    assert all_true(same), (RANK, after, resumed)


@on_cpu_too
def test_gpu_checkpoint_loads_into_the_pipeline_on_the_cpu(saved):
    path, at_save, _, _ = saved
    c = pipeline(regression_layers(), mse, config(gas=2, zero8=FULL8), device=CPU)
    c.load_checkpoint(path)
    loaded = digest(c.module.parameters()) == at_save and c.global_steps == 2
    losses = train_pipe(c, on(CPU, DATA), 2, first=2)
    assert all_true(loaded and all(v == v for v in losses)), (RANK, loaded, losses)
