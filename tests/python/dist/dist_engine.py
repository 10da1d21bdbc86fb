"""The engine on K ranks (run by test_engine_dist.py as
``mpirun -np K python3 -m pytest -q -p no:cacheprovider tests/python/dist/dist_engine.py``; the name does
not start with test_ so the single-process pytest run does not collect it).

Every rank trains on its share of each global batch and compares with the single-process reference
(torch.optim.AdamW on the whole batch), which every rank computes itself. Tolerances as in
test_engine.py: exact settings (32-bit states, fp32 wire) within 2x torch's own fp32 error (its distance
to float64); the full 8-bit configuration keeps 98% of torch's loss reduction. Assertions come after a
test's collectives where possible, so one failing rank does not leave the others waiting.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # engine_util

import zero8  # noqa: E402
from zero8 import _C  # noqa: E402
from zero8.engine import world_comm  # noqa: E402
from zero8.utils.zero_to_fp32 import (  # noqa: E402
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)
from engine_util import (  # noqa: E402
    EXACT,
    FULL8,
    clone_params,
    config,
    global_batch,
    loss_fn,
    make_data,
    make_model,
    max_param_diff,
    mean_tail,
    micro_batch,
    params_equal,
    reference,
    reference_model,
    train_engine,
)

torch.set_num_threads(1)
WORLD = world_comm("auto")
RANK, N = WORLD.rank, WORLD.size
DATA = make_data()
B = 32  # divisible by N * gas for N in 1, 2, 4 and gas in 1, 2
STEPS = 30  # test_engine_dist.py's reference file is made for these


def engine_for(cfg, seed=0):
    model = make_model(seed)
    engine, _, _, _ = zero8.initialize(model=model, config=cfg)
    return engine, model


def train(engine, steps=STEPS, dtype=torch.float32):
    return train_engine(engine, DATA, steps, B, rank=RANK, world=N, dtype=dtype)


def replicas_equal(model) -> bool:
    """Every rank holds bit-identical weights (the parameter sync applies the same bytes everywhere)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return len(set(WORLD.all_gather_bytes(h.digest()))) == 1


def global_mean_loss(losses):
    """The mean over ranks of each step's micro-batch losses: the loss of the whole global batch."""
    return [v / N for v in WORLD.all_reduce_f64(list(losses), "sum")]


@pytest.fixture(scope="module")
def baseline():
    """(torch AdamW's final model, its losses, its fp32 error): from the file test_engine_dist.py
    computed once (ZERO8_ENGINE_REF), else computed here."""
    path = os.environ.get("ZERO8_ENGINE_REF")
    ref = torch.load(path) if path else reference(DATA, STEPS, B)
    assert (ref["steps"], ref["batch"]) == (STEPS, B), "reference file made for another run"
    return reference_model(ref), ref["losses"], ref["err"]


def test_world():
    """The launcher's world, over the backend it implies: MPI under mpirun, TCP under torchrun."""
    assert N == int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("WORLD_SIZE", N))) and N >= 1
    assert WORLD.backend == ("mpi" if "OMPI_COMM_WORLD_SIZE" in os.environ else "tcp"), WORLD.backend


def test_rank0_weights_and_buffers_everywhere(capsys):
    # Each rank builds its model with its own seed and buffer; the engine starts from rank 0's.
    model = make_model(seed=RANK)
    model.register_buffer("stamp", torch.tensor([float(RANK)]))
    engine, _, _, _ = zero8.initialize(model=model, config=config(zero8=FULL8, steps_per_print=1))
    same = replicas_equal(model)
    equal_rank0 = params_equal(model, make_model(seed=0)) and model.stamp.item() == 0.0
    train(engine, 2)
    out = capsys.readouterr().out
    assert same and equal_rank0
    if RANK == 0:
        assert "step=1," in out and "step=2," in out
    else:
        assert "[zero8]" not in out, f"rank {RANK} printed: {out!r}"  # progress only from rank 0


@pytest.mark.parametrize("gas", [1, 2])
def test_exact_matches_torch_adamw(baseline, gas):
    ref, ref_losses, err = baseline
    engine, model = engine_for(config(gas=gas, zero8=EXACT))
    losses = global_mean_loss(train(engine))
    same = replicas_equal(model)
    assert engine.dp_world_size == N and engine.train_micro_batch_size_per_gpu() == B // (N * gas)
    # The ranks' mean losses average to the global batch's loss, step for step.
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    d = max_param_diff(model, ref)
    assert d <= 2 * err, f"{N} ranks, gas {gas}: {d:.3g} > 2 x fp32 error {err:.3g}"
    assert same


def test_param_groups_with_their_own_lr_and_decay_match_torch():
    # The decay / no-decay split with its own lr per group, over N ranks (partitions cut through both
    # groups' runs): within 2x torch's own fp32 error of torch's AdamW over the same groups.
    def groups(model):
        named = list(model.named_parameters())
        return [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1, "lr": 3e-3},
                {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0, "lr": 1e-2}]

    steps = 10
    model = make_model()
    engine, _, _, _ = zero8.initialize(model=model, model_parameters=groups(model), config=config(zero8=EXACT))
    train(engine, steps)
    same = replicas_equal(model)
    refs = {}
    for dtype in (torch.float32, torch.float64):
        ref = make_model().to(dtype)
        opt = torch.optim.AdamW(groups(ref))
        for s in range(steps):
            x, y = global_batch(DATA, s, B)
            opt.zero_grad()
            loss_fn(ref(x.to(dtype)), y).backward()
            opt.step()
        refs[dtype] = ref
    err = max_param_diff(refs[torch.float32], refs[torch.float64])
    d = max_param_diff(model, refs[torch.float32])
    assert d <= 2 * err + 1e-7, f"{N} ranks: {d:.3g} > 2 x fp32 error {err:.3g}"
    assert same


def test_stage1_equals_stage2(baseline):
    # gas 1: both stages reduce the same values with the same rank-order sums, once per step.
    e1, m1 = engine_for(config(stage=1, zero8=EXACT))
    e2, m2 = engine_for(config(stage=2, zero8=EXACT))
    train(e1, 10)
    train(e2, 10)
    assert params_equal(m1, m2)


@pytest.mark.parametrize("zero8_cfg", [EXACT, FULL8], ids=["exact", "full8"])
def test_overlap_comm_gives_the_same_bits(zero8_cfg):
    # overlap_comm (zero8's default): the reductions run on the optimizer's thread during backward and the
    # all-gather pieces while the step goes on and (zero8.overlap_param_gather, also a default) into the
    # next forward; off: both in the training loop's thread. The same collectives in the same order: the
    # same weights, bit for bit, and as stage 1's with exact settings.
    zo = {"stage": 2, "reduce_bucket_size": 2048, "allgather_bucket_size": 4096}
    on, m_on = engine_for(config(zero8=zero8_cfg, gas=2, zero_optimization=zo))
    off, m_off = engine_for(config(zero8=zero8_cfg, gas=2, zero_optimization=dict(zo, overlap_comm=False)))
    # Without zero8.overlap_param_gather engine.step() returns with the gather done.
    eager, m_eager = engine_for(config(zero8=dict(zero8_cfg, overlap_param_gather=False), gas=2,
                                       zero_optimization=zo))
    train(on, 6)
    pending = on._opt.gather_pending
    train(off, 6)  # its collectives wait for on's gather first
    train(eager, 6)
    assert pending == (N > 1) and not on._opt.gather_pending and not eager._opt.gather_pending
    o_on, o_off = on.comm_stats()["overlap"], off.comm_stats()["overlap"]
    assert params_equal(m_on, m_off) and params_equal(m_on, m_eager)
    assert on._defer_gather == (N > 1) and not off._defer_gather and not eager._defer_gather
    assert o_on["threaded"] == (N > 1) and not o_off["threaded"]
    assert o_on["reductions"] == o_off["reductions"] > 0 and o_on["gathers"] == o_off["gathers"] > 0
    # Without the thread the loop waits for every reduction: nothing is hidden.
    assert o_off["reduce_wait_seconds"] == pytest.approx(o_off["reduce_seconds"]) and o_off["reduce_hidden"] == 0.0


@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_accumulation_controls_give_the_same_bits_and_bytes(stage):
    """The boundary set after an accumulation's last backward (set_gradient_accumulation_boundary), each
    step() the boundary (managed_gradient_accumulation false), or a coalesce_grad_reduction() block: the
    bits of the counted accumulation, and not one byte more on the wire (stage 2 reduced every micro-batch
    already; stage 1 reduces at the step() or the block's exit)."""
    gas, steps = 2, 4
    cfg = config(stage=stage, gas=gas, zero8=FULL8)
    counted, m_counted = engine_for(cfg)
    late, m_late = engine_for(cfg)
    unmanaged, m_unmanaged = engine_for(dict(cfg, managed_gradient_accumulation=False))
    coalesced, m_coalesced = engine_for(cfg)
    train(counted, steps)
    for engine in (late, unmanaged, coalesced):
        for s in range(steps):
            if engine is late:
                engine.set_gradient_accumulation_boundary(False)
            with coalesced.coalesce_grad_reduction() if engine is coalesced else contextlib.nullcontext():
                for k in range(gas):
                    x, y = micro_batch(DATA, s, B, RANK, N, gas, k)
                    engine.backward(loss_fn(engine(x), y))
            if engine is late:
                engine.set_gradient_accumulation_boundary(True)
            engine.step()
            assert engine.was_step_applied()
    assert all(params_equal(m_counted, m) for m in (m_late, m_unmanaged, m_coalesced))
    sent = []
    for engine in (counted, late, unmanaged, coalesced):
        engine._wait_gather()
        stats = engine.comm_stats()
        sent.append((stats["bytes"], stats["gradient_bytes"]))
    assert len(set(sent)) == 1, sent
    assert replicas_equal(m_late) and replicas_equal(m_unmanaged)


class ReadsChildWeight(torch.nn.Module):
    """The test model under a parent that reads the last layer's bias before any layer runs (as a GPT
    slicing its position table), outside that layer's forward."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        shift = self.inner[-1].bias * 0.5
        return self.inner(x) + shift


def test_the_parameter_gather_runs_into_the_next_forward():
    # By default engine.step() returns with the all-gather pending; each parameter waits for its piece at
    # its first touch, in its module's forward, in a parent's, or outside any forward, so every read meets
    # this step's weights; the forward's end, a state_dict and a checkpoint wait for all of it.
    if N == 1:
        pytest.skip("one rank gathers nothing")
    zo = {"stage": 2, "allgather_bucket_size": 4096}
    model, m_ref = ReadsChildWeight(make_model(0)), ReadsChildWeight(make_model(0))
    engine, _, _, _ = zero8.initialize(model=model, config=config(zero8=FULL8, zero_optimization=zo))
    ref, _, _, _ = zero8.initialize(model=m_ref, config=config(zero8=dict(FULL8, overlap_param_gather=False),
                                                                  zero_optimization=zo))
    seen = []
    for m in model.modules():
        if list(m.parameters(recurse=False)):
            m.register_forward_pre_hook(lambda mod, args: seen.append(
                [p.detach().clone() for p in mod.parameters(recurse=False)]))
    x, y = micro_batch(DATA, 1, B, RANK, N, 1, 0)
    for e in (ref, engine):  # ref's collectives would wait for engine's gather
        e.backward(loss_fn(e(x), y))
        e.step()
    assert engine._opt.gather_pending and not ref._opt.gather_pending
    assert all(type(p) is not torch.nn.Parameter for p in model.parameters())  # armed
    seen.clear()
    with torch.no_grad():
        out = engine(x)
    assert not engine._opt.gather_pending
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(out, ref(x))  # the parent's read of the last bias saw the update
    want = [[p.detach().clone() for p in m.parameters(recurse=False)] for m in m_ref.modules()
            if list(m.parameters(recurse=False))]
    assert len(seen) == len(want) and all(torch.equal(a, b) for s, w in zip(seen, want) for a, b in zip(s, w))
    # Reads right after the step, outside any forward: the last layer first (its piece is gathered last).
    for e in (ref, engine):
        e.backward(loss_fn(e(x), y))
        e.step()
    last = model.inner[-1].weight.detach().clone()
    ema = torch.stack([p.detach().norm() for p in model.parameters()])
    assert torch.equal(last, m_ref.inner[-1].weight.detach())
    assert torch.equal(ema, torch.stack([p.detach().norm() for p in m_ref.parameters()]))
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    assert engine._opt.gather_pending
    sd = engine.module.state_dict()  # waits for the gather
    ref.backward(loss_fn(ref(x), y))
    ref.step()
    assert all(torch.equal(sd[k], v) for k, v in m_ref.state_dict().items())
    assert engine.comm_stats()["overlap"]["gathers"] > 0


def test_a_collective_of_the_training_loop_waits_for_the_pending_gather():
    # Between engine.step() and the next forward the optimizer's thread still gathers; the loop's own
    # collectives (a loss all-reduce on the world, or on the engine's communicator) first wait for it,
    # since one thread at a time may call MPI: no "still running" error, no mismatched collectives.
    if N == 1:
        pytest.skip("one rank gathers nothing")
    engine, model = engine_for(config(zero8=FULL8, zero_optimization={"stage": 2, "allgather_bucket_size": 4096}))
    ref, m_ref = engine_for(config(zero8=dict(FULL8, overlap_param_gather=False),
                                   zero_optimization={"stage": 2, "allgather_bucket_size": 4096}))
    x, y = micro_batch(DATA, 1, B, RANK, N, 1, 0)
    for comm in (WORLD, engine._dp):
        for e in (ref, engine):
            e.backward(loss_fn(e(x), y))
            e.step()
        assert engine._opt.gather_pending
        total = comm.all_reduce_f64([1.0], "sum")
        assert total == [float(comm.size)] and not engine._opt.gather_pending
        assert params_equal(model, m_ref)


def test_reductions_run_while_backward_goes_on():
    # Real processes: the first layer's weight is the last gradient of a backward. A hook on it waits (up
    # to 60 s) until the optimizer's thread has reduced buckets of this backward: they are reduced while
    # backward is still running, before engine.backward ends it.
    if N == 1:
        pytest.skip("one rank has nothing to overlap: its reductions are local")
    engine, model = engine_for(config(zero8=FULL8, zero_optimization={"stage": 2, "reduce_bucket_size": 2048}))
    train(engine, 1)
    seen = []

    def wait_for_reductions(_):
        before, t0 = seen[0], time.monotonic()
        while engine.comm_stats()["overlap"]["reductions"] == before and time.monotonic() - t0 < 60:
            time.sleep(0.001)
        seen.append(engine.comm_stats()["overlap"]["reductions"])

    model[0].weight.register_post_accumulate_grad_hook(wait_for_reductions)
    seen.append(engine.comm_stats()["overlap"]["reductions"])
    x, y = micro_batch(DATA, 1, B, RANK, N, 1, 0)
    engine.backward(loss_fn(engine(x), y))
    after = engine.comm_stats()["overlap"]
    engine.step()
    assert seen[1] > seen[0], "no bucket was reduced while backward ran"
    assert after["threaded"] and after["reductions"] >= seen[1] and 0.0 <= after["reduce_hidden"] <= 1.0, after


@pytest.mark.parametrize("overlap", [False, True])
def test_stage2_keeps_no_full_gradient_buffer(overlap):
    # Six 512x512 layers in buckets of 2^16 elements (256 KiB, four per weight): each rank holds its
    # reduced partition and the bucket buffers in flight, never the 6 MiB of the whole gradient. In the
    # training loop's thread a weight's four buckets are reduced when it arrives, and the next weight reuses
    # them (plus one for the biases, in the fp32-state group); with overlap the reductions may lag by four
    # buckets more. Stage 1 holds the whole buffer.
    def run(stage):
        torch.manual_seed(5)
        layers = []
        for _ in range(6):
            layers += [torch.nn.Linear(512, 512), torch.nn.Tanh()]
        model = torch.nn.Sequential(*layers)
        engine, _, _, _ = zero8.initialize(model=model, config=config(
            zero8=FULL8, zero_optimization={"stage": stage, "reduce_bucket_size": 1 << 16, "overlap_comm": overlap}))
        for s in range(3):
            x = torch.randn(8, 512, generator=torch.Generator().manual_seed(100 * s + RANK))
            engine.backward(engine(x).square().mean())
            engine.step()
        return engine, sum(p.numel() for p in model.parameters()), model

    e2, n, model2 = run(2)
    e1, _, model1 = run(1)
    m1, m2 = e1.memory_stats(), e2.memory_stats()
    same = params_equal(model1, model2) if N == 1 else replicas_equal(model2)
    bucket, biases = 4 * (1 << 16), 4 * e2._opt.group_padded(_C.GROUP_FP32)  # the biases: one bucket
    assert m1["grads_peak"] >= 4 * n
    if overlap and N > 1:
        assert m2["grads_peak"] <= 8 * bucket + biases < 4 * n, m2
    else:
        assert m2["grads_peak"] == 4 * bucket + biases, m2
    assert same


def test_full_8bit_int8_close_to_torch(baseline):
    _, ref_losses, _ = baseline
    engine, model = engine_for(config(zero8=FULL8))
    losses = global_mean_loss(train(engine))
    same = replicas_equal(model)
    got, want = mean_tail(losses), mean_tail(ref_losses)
    drop = ref_losses[0] - want
    assert abs(got - want) <= 0.02 * drop, f"final loss {got} vs torch {want} (L0 {ref_losses[0]})"
    assert same, "int8 parameter sync left the replicas different"


def test_int8_gradient_bytes_are_a_quarter():
    # Same model and steps; only the gradient wire format differs. int8 blocks of 2048 codes plus one
    # float32 absmax: (2048 + 4) / (2048 * 4) = 0.25049 of fp32's bytes (partitions are whole blocks).
    e8, _ = engine_for(config(zero8={"int8_gradients": True, "wire_block_size": 2048}))
    e32, _ = engine_for(config(zero8={"int8_gradients": False, "wire_block_size": 2048}))
    train(e8, 3)
    train(e32, 3)
    s8, s32 = e8.comm_stats(), e32.comm_stats()
    if N == 1:
        assert s8["gradient_bytes"] == s32["gradient_bytes"] == 0
        return
    assert s32["gradient_bytes"] > 0 and s8["int8_gradients"] and not s32["int8_gradients"]
    ratio = s8["gradient_bytes"] / s32["gradient_bytes"]
    assert ratio == pytest.approx((2048 + 4) / (2048 * 4), abs=5e-4), s8
    # Nothing sent to itself; traffic to each peer.
    assert s8["bytes_to_peer"][RANK] == 0 and all(b > 0 for r, b in enumerate(s8["bytes_to_peer"]) if r != RANK)


def test_int8_wire_between_ranks_none_at_one(capsys):
    # Over several ranks the full configuration sends int8 gradients and int8 parameter updates: the byte
    # counters show about a quarter of fp32 communication's, the int8 sync holds its scratch and the startup
    # line names both. One rank sends nothing, so it rounds nothing: the bits of fp32 communication.
    e8, m8 = engine_for(config(zero8=FULL8))
    e32, m32 = engine_for(config(zero8={**FULL8, "int8_gradients": False, "int8_params": False}))
    train(e8, 3)
    train(e32, 3)
    same = params_equal(m8, m32)  # reading every weight waits for the last step's deferred all-gather
    s8, s32 = e8.comm_stats(), e32.comm_stats()
    mem8, mem32 = e8.memory_stats(), e32.memory_stats()
    out = capsys.readouterr().out
    if N == 1:
        assert same and not s8["int8_gradients"] and not s8["int8_params"] and mem8["buffers"] == mem32["buffers"]
        return
    assert s8["int8_gradients"] and s8["int8_params"] and not s32["int8_gradients"] and not s32["int8_params"]
    assert not same, "int8 communication changed nothing"
    assert s8["gradient_bytes"] < 0.3 * s32["gradient_bytes"], (s8["gradient_bytes"], s32["gradient_bytes"])
    # The parameter all-gather (all_gather_v: int8 updates against fp32 weights; it may run past the step,
    # into the next forward, so step_bytes need not hold it).
    g8, g32 = (int(s["ops"]["all_gather_v"]["bytes"]) for s in (s8, s32))
    assert 0 < g8 < 0.3 * g32, (g8, g32)
    assert mem8["buffers"] > mem32["buffers"], "no int8 sync scratch"
    if RANK == 0:
        assert "gradients on the wire: int8, parameters: int8 updates" in out, out


def test_communication_data_type_bf16_halves_gradient_bytes():
    # zero8.int8_gradients off: communication_data_type picks the unquantized wire format, and its default
    # (null) follows the training dtype (bf16 training sends bf16), as DeepSpeed's does.
    off = {"int8_gradients": False}
    e16, _ = engine_for(config(zero8=off, communication_data_type="bf16"))
    e32, _ = engine_for(config(zero8=off))
    eb, _ = engine_for(config(zero8=off, bf16={"enabled": True}))
    train(e16, 2)
    train(e32, 2)
    train(eb, 2, dtype=torch.bfloat16)
    b16, b32, bb = (e.comm_stats()["gradient_bytes"] for e in (e16, e32, eb))
    if N == 1:
        assert b16 == b32 == bb == 0
        return
    assert b32 > 0 and b16 * 2 == b32 and bb == b16, (b16, b32, bb)


def test_stochastic_rounding_keeps_replicas_identical(baseline):
    _, ref_losses, _ = baseline
    engine, model = engine_for(config(zero8=dict(FULL8, stochastic_rounding=True, seed=3, int8_params=True)))
    losses = global_mean_loss(train(engine))
    same = replicas_equal(model)
    got, want = mean_tail(losses), mean_tail(ref_losses)
    assert engine._shard_config.stochastic_wire and engine._shard_config.wire_seed == 3
    assert abs(got - want) <= 0.02 * (ref_losses[0] - want) and same


def test_gradient_clipping_norm_agrees():
    clip = 0.05
    engine, model = engine_for(config(zero8=EXACT, gradient_clipping=clip))
    check = make_model()
    x, y = global_batch(DATA, 0, B)
    loss_fn(check(x), y).backward()
    want = torch.nn.utils.clip_grad_norm_(check.parameters(), clip).item()
    train(engine, 1)
    norms = WORLD.all_gather_bytes(repr(engine.get_global_grad_norm()).encode())
    assert len(set(norms)) == 1  # every rank computed the same global norm
    assert engine.get_global_grad_norm() == pytest.approx(want, rel=1e-5)


def test_fp16_overflow_on_one_rank_skips_everywhere():
    cfg = config(zero8=EXACT, fp16={"enabled": True, "initial_scale_power": 10, "hysteresis": 1})
    engine, model = engine_for(cfg)
    train(engine, 2, dtype=torch.float16)
    before = clone_params(model)
    x, y = micro_batch(DATA, 2, B, RANK, N, 1, 0)
    loss = loss_fn(engine(x.half()), y)
    bad_rank = N - 1
    engine.backward(loss * math.inf if RANK == bad_rank else loss)
    engine.step()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    train(engine, 2, dtype=torch.float16)
    same = replicas_equal(model)
    assert engine.skipped_steps == 1 and unchanged, f"rank {RANK}: a step with rank {bad_rank}'s overflow ran"
    assert engine.loss_scale == 2.0 ** 9 and same


def test_bf16_trains(baseline):
    _, ref_losses, _ = baseline
    engine, model = engine_for(config(zero8=FULL8, bf16={"enabled": True}))
    losses = global_mean_loss(train(engine, dtype=torch.bfloat16))
    same = replicas_equal(model)
    got, want = mean_tail(losses), mean_tail(ref_losses)
    assert abs(got - want) <= 0.02 * (ref_losses[0] - want) and same


@contextlib.contextmanager
def shared_checkpoint_dir():
    """A directory rank 0 makes and names to every rank (a shared file system: all ranks are on this
    machine), removed by rank 0 once every rank is done with it."""
    path = WORLD.broadcast_bytes(tempfile.mkdtemp(prefix="zero8_dist_ckpt_").encode() if RANK == 0 else b"", 0)
    try:
        yield path.decode()
    finally:
        WORLD.barrier()
        if RANK == 0:
            shutil.rmtree(path.decode(), ignore_errors=True)


def test_checkpoint_resume_is_exact():
    with shared_checkpoint_dir() as ckpt:
        cfg = config(gas=2, zero8=FULL8)
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}
        engine, model = engine_for(cfg)
        train(engine, 4)
        engine.save_checkpoint(ckpt, client_state={"rank0_says": RANK})
        tail = train(engine, 4)
        want = clone_params(model)
        e2, m2 = engine_for(cfg, seed=9)
        _, client = e2.load_checkpoint(ckpt)
        tail2 = train(e2, 4)
        ok = tail2 == tail and all(torch.equal(a, b) for a, b in zip(want, m2.parameters()))
        assert client["rank0_says"] == 0  # rank 0's client state is the one saved
        assert ok and e2.global_steps == 8


def test_only_rank0_writes_the_monitor():
    # Each rank names its own job directory: only rank 0's may exist, with one row per step.
    with shared_checkpoint_dir() as out:
        engine, _ = engine_for(config(gas=2, csv_monitor={"enabled": True, "output_path": out,
                                                          "job_name": f"rank{RANK}"}))
        train(engine, 2)
        engine.destroy()
        WORLD.barrier()
        jobs = sorted(os.listdir(out))
        with open(os.path.join(out, "rank0", "Train_Samples_lr.csv")) as f:
            rows = f.read().splitlines()
    assert jobs == ["rank0"] and rows[0] == "step,lr" and [r.split(",")[0] for r in rows[1:]] == ["32", "64"]


def test_to_fp32_of_a_sharded_checkpoint_is_the_whole_state_dict():
    # The trained weights come from every rank's master shard, the frozen layer and the buffers from
    # model_rest.safetensors: a fresh model loads the export strictly and equals the trained one.
    def build(seed):
        model = make_model(seed)
        model[0].weight.requires_grad_(False)
        model.register_buffer("seen", torch.arange(4))
        model.register_buffer("scale", torch.full((3,), 0.5))
        return model

    got, want = None, None
    with shared_checkpoint_dir() as ckpt:
        model = build(0)
        engine, _, _, _ = zero8.initialize(model=model, config=config(zero8=EXACT))
        train(engine, 2)
        engine.save_checkpoint(ckpt, tag="t")
        if RANK == 0:
            out = os.path.join(ckpt, "fp32.safetensors")
            r = zero8._C.checkpoint_export_fp32(os.path.join(ckpt, "t"), out)
            got = build(7)
            got.load_state_dict(_safetensors_load(out), strict=True)
            want = model
            # zero8.utils.zero_to_fp32 (DeepSpeed's names) gives the same, and loads it the same way.
            sd = get_fp32_state_dict_from_zero_checkpoint(ckpt)
            same = list(sd) == list(_safetensors_load(out)) and \
                all(torch.equal(sd[k], v) for k, v in _safetensors_load(out).items())
            via_utils = load_state_dict_from_zero_checkpoint(build(8), ckpt, tag="t", strict=True)
    if RANK == 0:
        assert r["complete"] and r["tensors"] == len(model.state_dict())
        assert same
        for k, v in want.state_dict().items():
            assert torch.equal(got.state_dict()[k], v), k
            assert torch.equal(via_utils.state_dict()[k], v), k


def _safetensors_load(path: str) -> dict:
    """A safetensors file by the format's definition (u64 header length, JSON header, raw data)."""
    import json

    dtypes = {"F32": torch.float32, "I64": torch.int64}
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    out = {}
    for name, t in json.loads(raw[8:8 + n]).items():
        if name != "__metadata__":
            b, e = t["data_offsets"]
            out[name] = torch.frombuffer(bytearray(raw[8 + n + b:8 + n + e]), dtype=dtypes[t["dtype"]]).reshape(t["shape"])
    return out

@pytest.mark.parametrize("mode", ["Warn", "Ignore", "Fail"])
def test_ranks_saving_different_tags(mode):
    # A tag made from a rank's own value (its loss, a timestamp): Fail raises on every rank, Warn and
    # Ignore save every rank's shards under rank 0's tag, a checkpoint that loads (rank 1 used to fail
    # creating its shard in a tag directory no rank had made).
    with shared_checkpoint_dir() as ckpt:
        engine, model = engine_for(config(zero8=FULL8, checkpoint={"tag_validation": mode}))
        train(engine, 2)
        if mode == "Fail":
            with pytest.raises(zero8.Zero8ValueError, match=r"checkpoint.tag_validation: checkpoint tag differs "
                                                            r"across ranks: \['r0', 'r1'"):
                engine.save_checkpoint(ckpt, tag=f"r{RANK}")
            return
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            engine.save_checkpoint(ckpt, tag=f"r{RANK}")
        said = [str(w.message) for w in seen if "differs across ranks" in str(w.message)]
        assert said == ([f"checkpoint tag differs across ranks: {[f'r{r}' for r in range(N)]}; every rank saves "
                         "under rank 0's tag 'r0'"] if mode == "Warn" and RANK == 0 else [])
        assert sorted(os.listdir(ckpt)) == ["latest", "r0"]
        e2, m2 = engine_for(config(zero8=FULL8), seed=9)
        e2.load_checkpoint(ckpt)
        assert params_equal(m2, model)


@pytest.mark.parametrize("full", [True, False], ids=["with_optimizer_states", "module_only"])
def test_a_load_that_fails_on_one_rank_changes_nothing_anywhere(full):
    # The last rank's model has a buffer the checkpoint lacks: every rank raises (the others name that
    # rank), no rank changes anything, and no rank is left waiting in a collective.
    kw = {} if full else {"load_optimizer_states": False, "load_module_only": True}
    with shared_checkpoint_dir() as ckpt:
        engine, model = engine_for(config(zero8=FULL8))
        train(engine, 3)
        engine.save_checkpoint(ckpt)
        e2, m2 = engine_for(config(zero8=FULL8), seed=9)
        train(e2, 1)
        before = clone_params(m2)
        if RANK == N - 1:
            m2.register_buffer("extra", torch.zeros(2))
        match = "lacks module keys" if RANK == N - 1 else f"rank {N - 1}.*lacks module keys"
        with pytest.raises(zero8.Zero8ValueError, match=match) as failed:
            e2.load_checkpoint(ckpt, **kw)
        assert failed.value.code == "invalid_argument"
        assert e2.global_steps == 1 and all(torch.equal(a, b) for a, b in zip(before, m2.parameters()))
        if RANK == N - 1:
            del m2.extra
        e2.load_checkpoint(ckpt, **kw)
        assert params_equal(m2, model) and replicas_equal(m2)


@pytest.mark.parametrize("full", [True, False], ids=["with_optimizer_states", "module_only"])
def test_a_corrupt_model_rest_fails_the_load_on_every_rank(full):
    # No load reads model_rest.safetensors (frozen parameters and buffers come from the .pt file), so only
    # rank 0 checks it; its corruption still fails the load on every rank and changes nothing.
    kw = {} if full else {"load_optimizer_states": False, "load_module_only": True}
    with shared_checkpoint_dir() as ckpt:
        engine, model = engine_for(config(zero8=FULL8))
        model.register_buffer("counter", torch.arange(1000.0))
        train(engine, 2)
        engine.save_checkpoint(ckpt, tag="t")
        rest = Path(ckpt) / "t" / "model_rest.safetensors"
        if RANK == 0:
            raw = bytearray(rest.read_bytes())
            raw[-5] ^= 0xFF
            rest.write_bytes(bytes(raw))
        WORLD.barrier()
        e2, m2 = engine_for(config(zero8=FULL8), seed=9)
        m2.register_buffer("counter", torch.zeros(1000))
        train(e2, 1)
        before = clone_params(m2)
        match = "model_rest.safetensors: checksum mismatch"
        with pytest.raises(zero8.Zero8IOError, match=match if RANK == 0 else f"rank 0.*{match}"):
            e2.load_checkpoint(ckpt, tag="t", **kw)
        unchanged = e2.global_steps == 1 and m2.counter.sum().item() == 0.0 and \
            all(torch.equal(a, b) for a, b in zip(before, m2.parameters()))
        if RANK == 0:
            raw[-5] ^= 0xFF
            rest.write_bytes(bytes(raw))
        WORLD.barrier()
        e2.load_checkpoint(ckpt, tag="t", **kw)
    assert unchanged
    assert params_equal(m2, model) and torch.equal(m2.counter, model.counter)
