"""The DeepSpeed-style engine (zero8.initialize) in one process: it must train like torch.optim.AdamW
(bit-close with 32-bit states and fp32 wire, close with the full 8-bit configuration), accumulate
gradients, clip, run fp16 with dynamic loss scaling (an overflow is skipped) and bf16, apply DeepSpeed's
schedules at DeepSpeed's positions, take client optimizers and schedulers, save and resume exactly, and
reject malformed configs with the key path. Multi-rank runs: test_engine_dist.py.

Tolerances: "exact" runs (32-bit states, fp32 wire) differ from torch's fp32 AdamW by rounding only, so
they must stay within 2x torch's own fp32 error (its distance to the same run in float64). 8-bit and
16-bit runs are judged on the loss: they must keep 98% of the loss reduction torch achieves,
|L - L_torch| <= 0.02 * (L0 - L_torch) on the mean loss of the last 10 steps (measured: 8-bit states with
int8 communication, bf16 and fp16 stay within 0.2% of it on 1, 2 and 4 ranks). Their exact arithmetic
(lr positions, accumulation, clipping, scaling) is checked by the exact runs.
"""

from __future__ import annotations

import copy
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import zero8
from zero8.config import Zero8ConfigWarning, load_config
from zero8.engine import MODEL_STATES_FILE
from engine_util import (
    EXACT,
    FULL8,
    clone_params,
    config,
    dump_diff,
    engine_dump,
    fp32_baseline_error,
    global_batch,
    loss_fn,
    make_data,
    make_model,
    max_param_diff,
    mean_tail,
    micro_batch,
    params_equal,
    train_engine,
    train_torch,
)

torch.set_num_threads(1)
DATA = make_data()
B = 32
STEPS = 40


def engine_for(cfg, seed=0, **kw):
    model = make_model(seed)
    engine, optimizer, loader, sched = zero8.initialize(model=model, config=cfg, **kw)
    return engine, model, optimizer, sched


def loss_close(losses, ref_losses):
    """8/16-bit runs keep 98% of torch's loss reduction (see the module docstring)."""
    got, want = mean_tail(losses), mean_tail(ref_losses)
    drop = ref_losses[0] - want
    assert drop > 0.05, f"the reference run does not learn (L0 {ref_losses[0]}, final {want})"
    assert abs(got - want) <= 0.02 * drop, f"final loss {got} vs torch {want} (L0 {ref_losses[0]})"


@pytest.fixture(scope="module")
def baseline():
    """torch AdamW fp32 over STEPS steps, its losses, and its own fp32 error."""
    ref, err = fp32_baseline_error(DATA, STEPS, B)
    _, losses = train_torch(make_model(), DATA, STEPS, B)
    return ref, losses, err


# ---- agreement with torch.optim.AdamW ----

@pytest.mark.parametrize("stage", [1, 2])
def test_matches_torch_adamw_exact(baseline, stage):
    ref, ref_losses, err = baseline
    engine, model, _, _ = engine_for(config(stage=stage, zero8=EXACT))
    losses = train_engine(engine, DATA, STEPS, B)
    assert ref_losses[0] - ref_losses[-1] > 0.05  # it learns
    d = max_param_diff(model, ref)
    assert d <= 2 * err, f"engine vs torch AdamW: {d:.3g} > 2 x fp32 error {err:.3g}"
    assert engine.global_steps == STEPS and engine.micro_steps == STEPS and engine.skipped_steps == 0


def test_full_8bit_close_to_torch(baseline):
    _, ref_losses, _ = baseline
    engine, model, _, _ = engine_for(config(zero8=FULL8))
    losses = train_engine(engine, DATA, STEPS, B)
    loss_close(losses, ref_losses)
    # 8-bit states really in use: Adam's two 8-bit states + absmax per 256 block for the 8-bit group
    # (Linear(32,128) and Linear(128,64) weights: 12288 elements), 8 bytes/element for the rest.
    n8 = 32 * 128 + 128 * 64
    rest = sum(p.numel() for p in model.parameters()) - n8
    assert engine.memory_stats()["state"] == 2 * n8 + 2 * 4 * (n8 // 256) + 8 * rest


def test_gradient_accumulation_matches_bigger_micro_batch(baseline):
    ref, _, err = baseline
    e1, m1, _, _ = engine_for(config(gas=1, zero8=EXACT))
    e2, m2, _, _ = engine_for(config(gas=2, zero8=EXACT))
    assert e2.train_micro_batch_size_per_gpu() == B // 2 and e2.train_batch_size() == B
    train_engine(e1, DATA, STEPS, B)
    train_engine(e2, DATA, STEPS, B)
    assert e2.global_steps == STEPS and e2.micro_steps == 2 * STEPS
    # Two half-batch means scaled by 1/2 and summed vs one mean: rounding-level differences.
    assert max_param_diff(m1, m2) <= 2 * err
    assert max_param_diff(m2, ref) <= 2 * err


def test_comm_timeout_defaults_to_ten_minutes(monkeypatch):
    # torch's NCCL default: a live but hung rank ends the job within 10 minutes, naming it (docs/FAILURES.md);
    # the config's key changes it.
    monkeypatch.delenv("ZERO8_COMM_TIMEOUT", raising=False)
    engine, _, _, _ = zero8.initialize(model=make_model(), config=config(zero8=EXACT))
    assert engine.zero8_config.typed.zero8.comm_timeout_s == 600.0 and engine._dp.timeout == 600.0
    engine, _, _, _ = zero8.initialize(model=make_model(), config=config(zero8=dict(EXACT, comm_timeout_s=42)))
    assert engine._dp.timeout == 42.0


def test_boundary_bookkeeping():
    engine, _, _, _ = engine_for(config(batch=30, gas=3, zero8=EXACT))
    boundaries = []
    for s in range(6):
        x, y = global_batch(DATA, s, 10)
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(loss_fn(engine(x), y))
        with pytest.raises(RuntimeError, match="twice"):
            engine.backward(loss_fn(engine(x), y))
        engine.step()
    assert boundaries == [False, False, True, False, False, True]
    assert engine.global_steps == 2 and engine.micro_steps == 6


def _micro(s: int, k: int, gas: int = 3, batch: int = 30):
    return micro_batch(DATA, s, batch, 0, 1, gas, k)


def _train_manual(engine, steps: int, pattern: str, gas: int = 3) -> list:
    """Accumulations of `gas` micro-batches with DeepSpeed's set_gradient_accumulation_boundary, as training
    loops use it. "one_step": False before the first micro-batch, True before the last, one step() after
    the last backward (Megatron-DeepSpeed); "each_step": the boundary set before every micro-batch and a
    step() after each (FlagAI); "late": False for all backwards, True just before the one step()."""
    applied = []
    for s in range(steps):
        engine.set_gradient_accumulation_boundary(pattern == "each_step" and gas == 1)
        for k in range(gas):
            if pattern != "late":
                engine.set_gradient_accumulation_boundary(k == gas - 1)
            x, y = _micro(s, k, gas)
            engine.backward(loss_fn(engine(x), y))
            if pattern == "each_step":
                engine.step()
                applied.append(engine.was_step_applied())
        if pattern == "late":
            engine.set_gradient_accumulation_boundary(True)
        if pattern != "each_step":
            engine.step()
            applied.append(engine.was_step_applied())
    return applied


@pytest.mark.parametrize("stage", [1, 2])
def test_manual_accumulation_boundary_equals_the_counted_one(stage):
    """set_gradient_accumulation_boundary, in the three ways loops use it, gives the bits of the counted
    accumulation (backward and step() per micro-batch), and was_step_applied says which step() stepped."""
    cfg = config(batch=30, gas=3, stage=stage, zero8=EXACT)
    ref, _, _, _ = engine_for(cfg)
    applied = []
    for s in range(4):
        for k in range(3):
            x, y = _micro(s, k)
            ref.backward(loss_fn(ref(x), y))
            ref.step()
            applied.append(ref.was_step_applied())
    assert applied == [False, False, True] * 4
    want = engine_dump(ref)
    for pattern, steps_applied in (("one_step", [True] * 4), ("each_step", [False, False, True] * 4),
                                   ("late", [True] * 4)):
        engine, _, _, _ = engine_for(cfg)
        assert _train_manual(engine, 4, pattern) == steps_applied, pattern
        assert dump_diff(want, engine_dump(engine)) == [], pattern
        assert engine.global_steps == 4 and engine.global_samples == 4 * 30, pattern


@pytest.mark.parametrize("stage", [1, 2])
def test_coalesce_grad_reduction_is_one_accumulation(stage):
    """DeepSpeed's coalesce_grad_reduction(): the backwards of its block accumulate, its exit ends the
    accumulation, the step() after it applies it: the bits of the counted accumulation (gas 3), the same
    bytes as it at 2 ranks (dist_engine.py covers the other controls there)."""
    cfg = config(batch=30, gas=3, stage=stage, zero8=EXACT)
    ref, _, _, _ = engine_for(cfg)
    engine, _, _, _ = engine_for(cfg)
    for s in range(3):
        for k in range(3):
            x, y = _micro(s, k)
            ref.backward(loss_fn(ref(x), y))
            ref.step()
        with engine.coalesce_grad_reduction():
            for k in range(3):
                x, y = _micro(s, k)
                engine.backward(loss_fn(engine(x), y))
            with pytest.raises(RuntimeError, match="inside coalesce_grad_reduction"):
                engine.step()
        engine.step()
        assert engine.was_step_applied() and engine.global_steps == s + 1
    assert dump_diff(engine_dump(ref), engine_dump(engine)) == []
    with engine.coalesce_grad_reduction():
        x, y = _micro(3, 0)
        engine.backward(loss_fn(engine(x), y))
    with pytest.raises(RuntimeError, match="ended the gradient accumulation"):  # two blocks for one step
        with engine.coalesce_grad_reduction():
            engine.backward(loss_fn(engine(x), y))
    engine.step()
    assert engine.was_step_applied() and engine.is_gradient_accumulation_boundary() is False


def test_manual_accumulation_boundary_rules():
    engine, _, _, _ = engine_for(config(batch=30, gas=3, zero8=EXACT))
    with pytest.raises(TypeError, match="a bool"):
        engine.set_gradient_accumulation_boundary(1)
    engine.set_gradient_accumulation_boundary(True)
    x, y = _micro(0, 0)
    engine.backward(loss_fn(engine(x), y))
    # The accumulation ended with that backward: another one would add to the step about to be applied.
    with pytest.raises(RuntimeError, match="ended the gradient accumulation"):
        engine.backward(loss_fn(engine(x), y))
    engine.step()
    assert engine.was_step_applied() and engine.global_steps == 1
    # None: counted again, from the start of an accumulation.
    engine.set_gradient_accumulation_boundary(None)
    got = []
    for k in range(3):
        got.append(engine.is_gradient_accumulation_boundary())
        x, y = _micro(1, k)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    assert got == [False, False, True] and engine.global_steps == 2


@pytest.mark.parametrize("stage", [1, 2])
def test_unmanaged_accumulation_makes_each_step_the_boundary(stage):
    """DeepSpeed's managed_gradient_accumulation false: backwards only accumulate, each step() ends the
    accumulation, whatever its count: the bits of the counted engine, and global_samples counts the
    micro-batches stepped."""
    ref, _, _, _ = engine_for(config(batch=30, gas=3, stage=stage, zero8=EXACT))
    engine, _, _, _ = engine_for(config(batch=30, gas=3, stage=stage, zero8=EXACT,
                                        managed_gradient_accumulation=False))
    for s in range(3):
        for k in range(3):
            x, y = _micro(s, k)
            ref.backward(loss_fn(ref(x), y))
            ref.step()
            assert not engine.is_gradient_accumulation_boundary()
            engine.backward(loss_fn(engine(x), y))
        engine.step()
        assert engine.was_step_applied() and engine.global_steps == s + 1
    assert dump_diff(engine_dump(ref), engine_dump(engine)) == []
    assert engine.global_samples == ref.global_samples == 90
    x, y = _micro(3, 0)
    engine.backward(loss_fn(engine(x), y))
    engine.step()  # a step of one micro-batch (its loss still divided by gradient_accumulation_steps)
    assert engine.global_steps == 4 and engine.global_samples == 100
    with pytest.raises(RuntimeError, match="every step\\(\\) is the boundary"):
        engine.set_gradient_accumulation_boundary(False)
    with pytest.raises(RuntimeError, match="every step\\(\\) ends the accumulation already"):
        with engine.coalesce_grad_reduction():
            pass
    with pytest.raises(zero8.Zero8ValueError, match="managed_gradient_accumulation"):
        load_config(config(managed_gradient_accumulation="no"))


def test_set_train_batch_size_changes_the_accumulation():
    """DeepSpeed's batch-size setters: set_train_batch_size changes gradient_accumulation_steps (a ramp-up
    of the batch), set_train_micro_batch_size the micro-batch; an engine that starts at gas 1 and goes to
    2 gives the bits of one that was configured at 2 and set to 1 for the same first steps."""
    a, _, _, _ = engine_for(config(batch=16, gas=1, zero8=EXACT))
    b, _, _, _ = engine_for(config(batch=32, gas=2, zero8=EXACT))
    b.set_train_batch_size(16)
    assert a.get_batch_info() == b.get_batch_info() == (16, 16, 1)
    for e in (a, b):
        train_engine(e, DATA, 3, 16)
        e.set_train_batch_size(32)
        assert e.get_batch_info() == (32, 16, 2) and e.config["gradient_accumulation_steps"] == 2
        assert [e.is_gradient_accumulation_boundary()] == [False]
        train_engine(e, DATA, 3, 32)
        assert e.global_steps == 6 and e.global_samples == 3 * 16 + 3 * 32
    assert dump_diff(engine_dump(a), engine_dump(b)) == []
    with pytest.raises(zero8.Zero8ValueError, match="positive multiple of train_micro_batch_size_per_gpu x"):
        a.set_train_batch_size(24)
    x, y = _micro(0, 0, gas=2, batch=32)
    a.backward(loss_fn(a(x), y))
    a.step()
    with pytest.raises(RuntimeError, match="in the middle of a gradient accumulation"):
        a.set_train_batch_size(64)
    with pytest.raises(RuntimeError, match="in the middle of a gradient accumulation"):
        a.set_train_micro_batch_size(8)
    a.backward(loss_fn(a(x), y))
    a.step()
    a.set_train_micro_batch_size(8)
    assert a.get_batch_info() == (16, 8, 2) and a.train_batch_size() == 16
    with pytest.raises(zero8.Zero8ValueError, match="positive integer"):
        a.set_train_micro_batch_size(0)


def test_gradient_clipping():
    clip = 0.05  # well below the gradient norm (~0.5-1) so every step clips
    ref, err = fp32_baseline_error(DATA, 20, B, clip=clip)
    engine, model, _, _ = engine_for(config(zero8=EXACT, gradient_clipping=clip))
    # The reported norm is the unclipped global norm, as torch's clip_grad_norm_ returns it.
    check = make_model()
    check.load_state_dict(model.state_dict())
    x, y = global_batch(DATA, 0, B)
    loss_fn(check(x), y).backward()
    want = torch.nn.utils.clip_grad_norm_(check.parameters(), clip).item()
    train_engine(engine, DATA, 1, B)
    assert want > 5 * clip
    assert engine.get_global_grad_norm() == pytest.approx(want, rel=1e-5)  # fp32 sums vs torch's
    for s in range(1, 20):
        x, y = global_batch(DATA, s, B)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    assert max_param_diff(model, ref) <= 2 * err


def test_stage1_equals_stage2_single_process():
    # One rank, fp32 wire: stage 1 reduces the accumulated sum once, stage 2 adds per-micro-batch
    # reductions to a zeroed buffer; both sum the same values in the same order.
    e1, m1, _, _ = engine_for(config(gas=2, stage=1, zero8=EXACT))
    e2, m2, _, _ = engine_for(config(gas=2, stage=2, zero8=EXACT))
    train_engine(e1, DATA, 10, B)
    train_engine(e2, DATA, 10, B)
    assert params_equal(m1, m2)


@pytest.mark.parametrize("stage", [1, 2])
def test_stage2_reduces_buckets_during_backward(stage):
    # Small buckets (2048 elements); the first layer's weight gets its gradient last in backward. By then
    # stage 2 has already reduced the buckets of the later layers (overlap); stage 1 reduces nothing
    # before the accumulation boundary's backward_end.
    engine, model, _, _ = engine_for(config(stage=stage, zero8=FULL8,
                                            zero_optimization={"stage": stage, "reduce_bucket_size": 2048}))

    def reductions():
        return sum(int(v["calls"]) for k, v in engine._dp.stats().items()
                   if k in ("all_to_all", "all_to_all_v", "reduce_scatter"))

    seen = []
    model[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(reductions()))
    before = reductions()
    x, y = global_batch(DATA, 0, B)
    engine.backward(loss_fn(engine(x), y))
    after = reductions()
    engine.step()
    assert len(seen) == 1 and after > before
    if stage == 2:
        assert seen[0] > before, "no bucket was reduced while backward ran"
    else:
        assert seen[0] == before


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_stage2_holds_the_buckets_in_flight(dtype):
    # Stage 2 keeps no full-size gradient buffer: each gradient goes to the bucket that carries it
    # (param.grad is dropped), and a bucket's buffer serves the next one once it is reduced; with
    # zero8.release_gradients it is freed instead, so nothing is held between backwards. Either way the
    # training is bit-identical to stage 1's full buffer (one rank: the same sums). Two 1024x1024 layers
    # in buckets of 2^18 elements (1 MiB): 8 MiB of weight gradients, 4 buckets each.
    def run(stage, release=False):
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1024))
        cfg = config(zero8=dict(FULL8, release_gradients=release),
                     zero_optimization={"stage": stage, "reduce_bucket_size": 1 << 18})
        if dtype == "bf16":
            cfg["bf16"] = {"enabled": True}
        engine, _, _, _ = zero8.initialize(model=model, config=cfg)
        full = 4 * sum(p.numel() for p in model.parameters())
        during = []
        model[0].weight.register_post_accumulate_grad_hook(lambda p: during.append(engine.memory_stats()["grads"]))
        held, losses = [], []
        for step in range(3):
            x = torch.randn(16, 1024, generator=torch.Generator().manual_seed(step))
            x = x.to(torch.bfloat16) if dtype == "bf16" else x
            loss = engine(x).float().square().mean()
            engine.backward(loss)
            held.append(engine.memory_stats()["grads"])
            engine.step()
            losses.append(loss.item())
        grads = [p.grad for p in model.parameters()]
        peak = engine.memory_stats()["grads_peak"]
        return full, during, held, peak, grads, losses, [p.detach().float().clone() for p in model.parameters()]

    full, _, held_one, peak_one, _, losses_one, params_one = run(stage=1)
    _, during_keep, held_keep, peak_keep, grads, losses_keep, params_keep = run(stage=2)
    _, during_rel, held_rel, peak_rel, _, losses_rel, params_rel = run(stage=2, release=True)
    assert all(h >= full for h in held_one) and peak_one >= full  # stage 1: the full buffer
    # The second layer's weight takes four bucket buffers of 1 MiB and the biases' bucket (in the fp32-state
    # group) one of 8 KiB; once those four are reduced, the first layer's weight reuses them: 4 MiB and
    # 8 KiB at most, not 8 MiB.
    held = 4 * (4 << 18) + 4 * 2048
    assert all(d == held for d in during_keep), (during_keep, full)
    assert all(d <= held for d in during_rel), (during_rel, full)
    assert peak_keep == peak_rel == held < full
    assert held_keep == [held] * 3 and held_rel == [0] * 3  # the pool, or nothing, between backwards
    assert all(g is None for g in grads)  # the gradients live in the buckets only
    assert losses_rel == losses_keep == losses_one
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(params_rel, params_keep, params_one))


# ---- mixed precision ----

@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_non_finite_gradient_skips_the_step_without_a_loss_scale_message(dtype, capsys):
    # bf16 and fp32 have no loss scale: the skip is logged as what it is (the audit saw "Attempted loss
    # scale: 1.0, reducing to 1.0"), and nothing changes.
    cfg = config(zero8=EXACT, bf16={"enabled": dtype == "bf16"})
    engine, model, _, _ = engine_for(cfg)
    before = clone_params(model)
    x, y = global_batch(DATA, 0, B)
    x = x.to(torch.bfloat16) if dtype == "bf16" else x
    engine.backward(loss_fn(engine(x), y) * float("nan"))
    engine.step()
    out = capsys.readouterr()
    assert engine.skipped_steps == 1 and engine.was_step_skipped()
    assert "Skipping step 1: a gradient on some rank is inf or NaN" in out.out + out.err
    assert "loss scale" not in (out.out + out.err).replace("no loss scale", "")
    assert all(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), before))


def test_bf16(baseline):
    _, ref_losses, _ = baseline
    engine, model, _, _ = engine_for(config(zero8=EXACT, bf16={"enabled": True}))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    losses = train_engine(engine, DATA, STEPS, B, dtype=torch.bfloat16)
    loss_close(losses, ref_losses)
    # The optimizer keeps fp32 masters: most are not bf16 numbers (the working copy is their rounding).
    master = torch.frombuffer(engine._opt.master_values(1), dtype=torch.float32)
    assert (master.to(torch.bfloat16).float() != master).float().mean() > 0.5
    assert engine.loss_scale == 1.0


class _Buffered(torch.nn.Module):
    """make_model's network with the buffers a cast meets: a float one the forward uses (as a rotary inv_freq),
    an integer one, and a float one its transformers list keeps in fp32 (as an MoE routing bias)."""

    _keep_in_fp32_modules_strict = ["routing_bias"]

    def __init__(self):
        super().__init__()
        self.net = make_model()
        self.register_buffer("scale", torch.full((1,), 1 / 3))
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))
        self.register_buffer("routing_bias", torch.full((1,), 1 / 3))

    def forward(self, x):
        return self.net(x) * self.scale.to(x.dtype) + self.routing_bias.to(x.dtype)


@pytest.mark.parametrize("data_types, scale_dtype", [(None, torch.float32), ({"buffer_dtype": "bf16"}, torch.bfloat16)],
                         ids=["default", "buffer_dtype-bf16"])
def test_bf16_casts_the_parameters_and_keeps_the_buffers(data_types, scale_dtype):
    # As DeepSpeed 0.19.8's engine (its _cast_module_mixed_precision): bf16 casts the parameters only, so a
    # float buffer stays float32 unless data_types.buffer_dtype names a dtype, and the buffers the model's
    # transformers list names stay float32 even then. zero8 cast the whole module (model.to(bfloat16)).
    model = _Buffered()
    extra = {"data_types": data_types} if data_types else {}
    engine, _, _, _ = zero8.initialize(model=model, config=config(zero8=EXACT, bf16={"enabled": True}, **extra))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.scale.dtype == scale_dtype and model.scale.item() == torch.tensor(1 / 3).to(scale_dtype).item()
    assert model.routing_bias.dtype == torch.float32 and model.routing_bias.item() == torch.tensor(1 / 3).item()
    assert model.count.dtype == torch.int64
    losses = train_engine(engine, DATA, 3, B, dtype=torch.bfloat16)
    assert all(math.isfinite(x) for x in losses) and engine.skipped_steps == 0
    assert model.scale.dtype == scale_dtype and model.routing_bias.dtype == torch.float32


def test_fp16_dynamic_loss_scale_and_overflow_skip(baseline):
    _, ref_losses, _ = baseline
    window = 4
    cfg = config(zero8=EXACT, fp16={"enabled": True, "initial_scale_power": 10, "hysteresis": 1,
                                    "loss_scale_window": window})
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 3e-3,
                                                       "warmup_num_steps": 100, "warmup_type": "linear"}}
    engine, model, _, sched = engine_for(cfg)
    assert all(p.dtype == torch.float16 for p in model.parameters())
    s0 = 2.0 ** 10
    assert engine.loss_scale == s0
    train_engine(engine, DATA, window - 1, B, dtype=torch.float16)  # DeepSpeed doubles after `window` clean steps
    assert engine.loss_scale == s0 and not engine.was_step_skipped()
    before, lr_before = clone_params(model), engine.get_lr()
    x, y = global_batch(DATA, 3, B)
    engine.backward(loss_fn(engine(x.half()), y) * math.inf)  # injected overflow
    engine.step()
    assert engine.was_step_skipped() and engine.skipped_steps == 1 and engine.global_steps == window
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "a skipped step changed weights"
    assert engine.loss_scale == s0 / 2  # hysteresis 1: the first overflow halves the scale
    assert engine.get_lr() == lr_before and sched.last_batch_iteration == window - 2  # scheduler not stepped
    # DeepSpeed's rule: the scale doubles when the clean run since the last overflow, not counting the
    # step right after it, reaches a multiple of the window: on the (window + 1)-th clean step.
    train_engine(engine, DATA, window, B, dtype=torch.float16)
    assert engine.loss_scale == s0 / 2
    train_engine(engine, DATA, 1, B, dtype=torch.float16)
    assert engine.loss_scale == s0
    # And it trains like torch's fp32 AdamW (same lr schedule shape is not needed: loss only).
    engine2, _, _, _ = engine_for(config(zero8=EXACT, fp16={"enabled": True, "initial_scale_power": 12}))
    losses = train_engine(engine2, DATA, STEPS, B, dtype=torch.float16)
    loss_close(losses, ref_losses)


def test_fp16_skipped_step_keeps_the_last_grad_norm(capsys):
    # DeepSpeed's ZeRO optimizer returns before computing the norm when it skips an fp16 step, so
    # get_global_grad_norm() still gives the last applied step's; zero8 used to report 0.0 instead, a
    # value that reads like vanishing gradients in a log.
    engine, _, _, _ = engine_for(config(zero8=EXACT, fp16={"enabled": True, "initial_scale_power": 10},
                                        steps_per_print=1))
    assert engine.get_global_grad_norm() is None  # no step yet
    train_engine(engine, DATA, 1, B, dtype=torch.float16)
    norm = engine.get_global_grad_norm()
    assert norm > 0.1
    x, y = global_batch(DATA, 1, B)
    engine.backward(loss_fn(engine(x.half()), y) * math.inf)
    engine.step()
    assert engine.was_step_skipped() and engine.get_global_grad_norm() == norm
    assert "step=2, skipped=1" in capsys.readouterr().out.splitlines()[-1]
    train_engine(engine, DATA, 1, B, dtype=torch.float16)
    assert not engine.was_step_skipped() and engine.get_global_grad_norm() not in (norm, 0.0)


def test_fp16_overflow_log_says_what_happens_to_the_scale(capsys):
    # The log used to read "Attempted loss scale: 256.0, reducing to 256.0" when hysteresis absorbed the
    # overflow or the scale was static; it now says what DeepSpeed's loss_scaler.py says.
    def overflow(engine):
        x, y = global_batch(DATA, 0, B)
        engine.backward(loss_fn(engine(x.half()), y) * math.inf)
        engine.step()
        return [l for l in capsys.readouterr().out.splitlines() if "OVERFLOW" in l][-1]

    engine, _, _, _ = engine_for(config(zero8=EXACT, fp16={"enabled": True, "initial_scale_power": 8,
                                                           "hysteresis": 2}))
    assert overflow(engine).endswith("Attempted loss scale: 256.0, but hysteresis is 2. Reducing hysteresis to 1")
    assert engine.loss_scale == 256.0
    assert overflow(engine).endswith("Attempted loss scale: 256.0, reducing to 128.0")
    assert engine.loss_scale == 128.0
    static, _, _, _ = engine_for(config(zero8=EXACT, fp16={"enabled": True, "loss_scale": 256}))
    assert overflow(static).endswith("gradient overflow at the static loss scale 256 (fp16.loss_scale): "
                                     "skipping the step")
    assert static.loss_scale == 256.0 and static.skipped_steps == 1


def test_fp16_auto_cast():
    engine, model, _, _ = engine_for(config(zero8=EXACT, fp16={"enabled": True, "auto_cast": True}))
    x, _ = global_batch(DATA, 0, B)
    assert engine(x).dtype == torch.float16  # fp32 input cast by the engine

    # A batch as one container, as DeepSpeed casts it too: floating tensors inside lists, tuples and dicts
    # (it used to cast only top-level arguments, so the model got fp32 and failed on the dtype).
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = make_model()

        def forward(self, batch):
            x, (mask,) = batch["x"], batch["aux"]
            assert mask.dtype == torch.int64  # integer tensors are left alone
            return self.body(x)

    engine, _, _, _ = zero8.initialize(model=Net(), config=config(zero8=EXACT, fp16={"enabled": True,
                                                                                  "auto_cast": True}))
    assert engine({"x": x, "aux": (torch.ones(3, dtype=torch.int64),)}).dtype == torch.float16


# ---- schedules: DeepSpeed's positions ----

def test_scheduler_lr_applied_at_deepspeed_positions():
    # SGD without momentum or decay: the update is exactly -lr * grad, which reveals the lr each step
    # used. DeepSpeed: WarmupLR sets warmup_min_lr at construction (t = -1); the engine steps the
    # scheduler after each applied step, so step n runs with t = n - 2; linear warmup over W = 4:
    # lr(t) = min + (max - min) * t / W for 0 <= t < W, then max.
    lo, hi, w = 0.01, 0.05, 4
    cfg = config(zero8=EXACT)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": hi}}
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": lo, "warmup_max_lr": hi,
                                                       "warmup_num_steps": w, "warmup_type": "linear"}}
    engine, model, opt, sched = engine_for(cfg)
    assert sched is engine.lr_scheduler and opt is engine.optimizer
    want = [lo] + [lo + (hi - lo) * max(t, 0) / w if t < w else hi for t in range(0, 6)]
    used = []
    for s in range(7):
        x, y = global_batch(DATA, s, B)
        probe = make_model()
        probe.load_state_dict(model.state_dict())
        loss_fn(probe(x), y).backward()
        g = torch.cat([p.grad.flatten() for p in probe.parameters()])
        before = torch.cat([p.detach().flatten() for p in model.parameters()])
        engine.backward(loss_fn(engine(x), y))
        engine.step()
        delta = torch.cat([p.detach().flatten() for p in model.parameters()]) - before
        used.append((-(delta.double() @ g.double()) / (g.double() @ g.double())).item())
    assert used == pytest.approx(want, rel=1e-4)  # fp32 rounding of w - lr*g relative to lr*g
    assert engine.get_lr() == pytest.approx([hi])


def test_one_cycle_cycles_betas():
    cfg = config(zero8=EXACT)
    cfg["scheduler"] = {"type": "OneCycle", "params": {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2,
                                                       "cycle_first_step_size": 4, "cycle_min_mom": 0.85,
                                                       "cycle_max_mom": 0.95}}
    with pytest.warns(Zero8ConfigWarning, match="beta2 0.999 is replaced by 0.99"):  # DeepSpeed's OneCycle
        engine, _, opt, sched = engine_for(cfg)
    moms, lrs = [], []
    for s in range(4):
        moms.append(engine.get_mom()[0])
        lrs.append(engine.get_lr()[0])
        train_engine(engine, DATA, 1, B)
    # DeepSpeed's OneCycle sets (cycle_min_mom, 0.99) at construction; in the first half of the cycle lr
    # rises from cycle_min_lr and momentum falls from cycle_max_mom.
    assert moms[0] == pytest.approx((0.85, 0.99)) and lrs[0] == pytest.approx(1e-3)
    assert 0.95 >= moms[1][0] > moms[2][0] > moms[3][0] > 0.85 and lrs[1] < lrs[2] < lrs[3]
    assert engine._opt.hyper.beta1 == pytest.approx(moms[3][0])  # what the kernel ran the 4th step with
    assert engine._opt.hyper.beta2 == pytest.approx(0.99)


def test_one_cycle_momentum_decay_past_one_is_named():
    # decay_mom_rate raises momentum after the cycle without a bound: 0.9 * (1 + 0.1 k) is 0.99 at
    # scheduler step 4 (k = 1) and 1.08 at step 5. Initialize says so, and step 5 stops with an error
    # naming the key, not with the optimizer's "beta1 must be in [0, 1)" (or, in DeepSpeed, silently).
    cfg = config(zero8=EXACT)
    cfg["scheduler"] = {"type": "OneCycle", "params": {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2,
                                                       "cycle_first_step_size": 2, "decay_step_size": 1,
                                                       "decay_mom_rate": 0.1}}
    with pytest.warns(Zero8ConfigWarning, match=r"decay_mom_rate: .*leaves \[0, 1\) at scheduler step 5 "
                                                r"\(beta1 1\.08\)"):
        engine, _, _, _ = engine_for(cfg)
    for _ in range(5):  # the scheduler steps after each optimizer step: at step 4 after the fifth
        train_engine(engine, DATA, 1, B)
    assert engine.get_mom()[0] == pytest.approx((0.99, 0.99))
    with pytest.raises(zero8.Zero8ValueError, match=r"OneCycle: scheduler step 5 sets beta1 \(momentum\) to 1\.08.*"
                                                   r"scheduler\.params\.decay_mom_rate"):
        train_engine(engine, DATA, 1, B)


def test_lr_schedule_classes_match_deepspeed_rules():
    from zero8.lr_schedules import WarmupDecayLR, WarmupLR

    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.1)
    s = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear")
    assert opt.param_groups[0]["lr"] == 0.0  # t = -1: warmup_min_lr
    for _ in range(5):
        s.step()
    assert s.get_last_lr() == pytest.approx([0.1 * 4 / 10])
    sd = s.state_dict()
    assert sd == {"last_batch_iteration": 4}
    d = WarmupDecayLR(opt, total_num_steps=20, warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=10,
                      warmup_type="linear")
    d.load_state_dict({"last_batch_iteration": 15})
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * (20 - 15) / (20 - 10))


def test_warmup_cosine_class_scales_each_group_lr():
    # DeepSpeed's WarmupCosineLR multiplies each param group's own lr (as at construction) by the
    # schedule's ratio; the class used to write group 0's scaled lr into every group.
    from zero8.lr_schedules import WarmupCosineLR

    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.01}])
    s = WarmupCosineLR(opt, total_num_steps=100, warmup_num_steps=10, warmup_type="linear")
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]  # t = -1: warmup_min_ratio 0
    for _ in range(20):
        s.step()
    t, w, total, rc = 19, 10, 100, 1e-4  # docs/CONFIG.md, "Scheduler"
    ratio = rc + (1 - rc) * (1 + math.cos(math.pi * min(1, (t - w + 1) / (total - w)))) / 2
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1 * ratio, 0.01 * ratio], rel=1e-12)
    assert s.get_last_lr() == [g["lr"] for g in opt.param_groups]
    s.load_state_dict({"last_batch_iteration": 4})  # warmup, linear: ratio t / W
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1 * 0.4, 0.01 * 0.4], rel=1e-12)


# ---- client optimizers and schedulers ----

def test_client_torch_adamw_equals_config_optimizer():
    cfg = config(zero8=EXACT)
    e1, m1, _, _ = engine_for(cfg)
    del cfg["optimizer"]
    m2 = make_model()
    client = torch.optim.AdamW(m2.parameters(), lr=3e-3, weight_decay=0.01)
    e2, opt2, _, _ = zero8.initialize(model=m2, optimizer=client, config=cfg)
    assert opt2.param_groups is client.param_groups
    train_engine(e1, DATA, 10, B)
    train_engine(e2, DATA, 10, B)
    assert params_equal(m1, m2)


def test_client_sgd_nesterov_matches_torch():
    kw = dict(lr=0.05, weight_decay=1e-3, momentum=0.9, nesterov=True)
    ref, err = fp32_baseline_error(DATA, 20, B, opt_cls=torch.optim.SGD, **kw)
    cfg = config(zero8=EXACT)
    del cfg["optimizer"]
    model = make_model()
    engine, _, _, _ = zero8.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), **kw), config=cfg)
    train_engine(engine, DATA, 20, B)
    assert max_param_diff(model, ref) <= 2 * err


def test_client_torch_scheduler_drives_lr(baseline):
    cfg = config(zero8=EXACT)
    del cfg["optimizer"]
    model = make_model()
    client = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(client, step_size=5, gamma=0.5)
    engine, _, _, got_sched = zero8.initialize(model=model, optimizer=client, lr_scheduler=sched, config=cfg)
    assert got_sched is sched
    train_engine(engine, DATA, 12, B)
    assert engine.get_lr() == pytest.approx([3e-3 * 0.25])
    # torch with the same scheduler
    ref = make_model()
    ropt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.01)
    rsched = torch.optim.lr_scheduler.StepLR(ropt, step_size=5, gamma=0.5)
    for s in range(12):
        x, y = global_batch(DATA, s, B)
        ropt.zero_grad()
        loss_fn(ref(x), y).backward()
        ropt.step()
        rsched.step()
    assert max_param_diff(model, ref) <= 2 * baseline[2]


def test_callable_scheduler_gets_the_engine_optimizer():
    seen = []

    def make(opt):
        seen.append(opt)
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))

    engine, _, opt, sched = engine_for(config(zero8=EXACT), lr_scheduler=make)
    assert seen == [opt] and isinstance(opt, torch.optim.Optimizer)
    train_engine(engine, DATA, 3, B)
    assert engine.get_lr() == pytest.approx([3e-3 / 4])


@pytest.mark.parametrize("cls", [torch.optim.lr_scheduler.ConstantLR, zero8.lr_schedules.WarmupLR])
def test_scheduler_class_is_called_with_the_engine_optimizer(cls):
    # DeepSpeed calls any callable lr_scheduler with the optimizer; a class has a step attribute, and was
    # returned as it was, so the first engine.step() failed calling step on the class.
    engine, _, optimizer, sched = engine_for(config(zero8=EXACT), lr_scheduler=cls)
    assert type(sched) is cls and sched.optimizer is optimizer and engine.lr_scheduler is sched
    train_engine(engine, DATA, 3, B)
    ref_opt = torch.optim.SGD(make_model().parameters(), lr=3e-3)
    ref = cls(ref_opt)
    for _ in range(3):
        ref_opt.step()
        ref.step()
    assert engine.get_lr() == pytest.approx([g["lr"] for g in ref_opt.param_groups])


def test_client_zero8_optimizer_equals_config_optimizer():
    # zero8.optim.AdamW8bit passed as the client optimizer runs the same sharded 8-bit AdamW as the
    # config's "AdamW" with a zero8 section (same state block 256 and min_8bit_size 4096 defaults).
    cfg = config(zero8=FULL8)
    e1, m1, _, _ = engine_for(cfg)
    del cfg["optimizer"]
    m2 = make_model()
    client = zero8.optim.AdamW8bit(m2.parameters(), lr=3e-3, weight_decay=0.01)
    e2, _, _, _ = zero8.initialize(model=m2, optimizer=client, config=cfg)
    assert e2._shard_config.bits == 8 and e2._algo == "adamw"
    train_engine(e1, DATA, 10, B)
    train_engine(e2, DATA, 10, B)
    assert params_equal(m1, m2)


@pytest.mark.parametrize("name,kw", [
    ("SGD8bit", dict(lr=0.05, momentum=0.9, weight_decay=1e-3)),
    ("LARS8bit", dict(lr=0.05, momentum=0.8)),
    ("RMSprop8bit", dict(lr=1e-3, alpha=0.9)),
])
def test_client_bitsandbytes_optimizer_keeps_its_hyperparameters(name, kw):
    # bitsandbytes keeps SGD's and LARS's momentum and RMSprop's alpha in betas[0]; the engine must read
    # them there (it used to fall back to momentum 0 and alpha 0.99 without a word).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install bitsandbytes)")
    cfg = config(zero8=FULL8)
    del cfg["optimizer"]
    m1, m2 = make_model(), make_model()
    e1, _, _, _ = zero8.initialize(model=m1, optimizer=getattr(bnb.optim, name)(m1.parameters(), **kw), config=cfg)
    e2, _, _, _ = zero8.initialize(model=m2, optimizer=getattr(zero8.optim, name)(m2.parameters(), **kw), config=cfg)
    got = e1._opt.hyper.beta1 if "momentum" in kw else e1._opt.hyper.beta2
    assert got == pytest.approx(kw.get("momentum", kw.get("alpha")))
    train_engine(e1, DATA, 5, B)
    train_engine(e2, DATA, 5, B)
    assert params_equal(m1, m2)


@pytest.mark.parametrize("lib,name,extra,decoupled", [
    ("bitsandbytes", "Adam32bit", {}, True),
    ("bitsandbytes", "Adam", {}, True),
    ("zero8", "Adam32bit", {}, True),
    ("zero8", "Adam32bit", {"decoupled_weight_decay": False}, False),
    ("torch", "Adam", {}, False),
    ("torch", "Adam", {"decoupled_weight_decay": True}, True),
])
def test_client_adam_runs_the_weight_decay_rule_of_its_class(lib, name, extra, decoupled):
    # bitsandbytes' Adam decouples weight decay (its update is AdamW's), and so do zero8.optim's classes of
    # the same names unless decoupled_weight_decay=False; torch.optim.Adam adds the L2 term unless
    # decoupled_weight_decay=True. The engine used to run bitsandbytes' Adam with the L2 term.
    if lib == "bitsandbytes":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed").optim
    else:
        mod = zero8.optim if lib == "zero8" else torch.optim
    kw = dict(lr=3e-3, weight_decay=0.5)  # strong decay: the two rules end far apart
    steps = 10
    refs = {d: fp32_baseline_error(DATA, steps, B, opt_cls=torch.optim.AdamW if d else torch.optim.Adam, **kw)
            for d in (True, False)}
    ref, err = refs[decoupled]
    assert max_param_diff(refs[True][0], refs[False][0]) > 100 * err
    cfg = config(zero8=EXACT)
    del cfg["optimizer"]
    model = make_model()
    engine, _, _, _ = zero8.initialize(model=model, optimizer=getattr(mod, name)(model.parameters(), **kw, **extra),
                                       config=cfg)
    assert engine._algo == ("adamw" if decoupled else "adam")
    train_engine(engine, DATA, steps, B)
    assert max_param_diff(model, ref) <= 2 * err


def _overriding_client(model, bits):
    """zero8.optim.AdamW with bitsandbytes-style per-parameter overrides: one weight with its own lr, a
    bias and a weight sharing another lr and no weight decay."""
    opt = zero8.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, optim_bits=bits)
    opt.override_config(model[0].weight, key_value_dict={"lr": 1e-3})
    opt.override_config([model[2].bias, model[4].weight], lr=2e-2, weight_decay=0.0)
    return opt


def test_master_weights_override_is_not_a_hyper_group():
    # zero8.optim's master_weights (keep a float32 master of a 16-bit parameter) chooses a state format, as
    # optim_bits does: the engine keeps masters of every parameter anyway, so it adds no hyper group.
    model = make_model(0)
    opt = zero8.optim.AdamW(model.parameters(), lr=3e-3)
    opt.override_config(model[0].weight, master_weights=False)
    cfg = config(zero8=EXACT)
    del cfg["optimizer"]
    engine, _, _, _ = zero8.initialize(model=model, optimizer=opt, config=cfg)
    assert engine._opt.num_hyper_groups == 1


def _decay(step):
    return 1.0 / (1 + step)


@pytest.mark.parametrize("bits", [32, 8])
def test_per_parameter_overrides_step_as_zero8_optim(bits):
    # override_config(p, lr=...) replaces p's group value and stays fixed while a scheduler changes the
    # group (bitsandbytes' GlobalOptimManager semantics, which zero8.optim has): the engine gives each
    # overridden set its own hyper group, and steps as zero8.optim does, bit for bit (the same kernels on
    # the same fp32 gradients; 8-bit states with the client's block size). It used to refuse overrides.
    ref = make_model()
    opt = _overriding_client(ref, bits)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _decay)
    steps = 12
    for s in range(steps):
        x, y = global_batch(DATA, s, B)
        opt.zero_grad()
        loss_fn(ref(x), y).backward()
        opt.step()
        sched.step()
    model = make_model()
    client = _overriding_client(model, bits)
    cfg = config(zero8={"optim_bits": bits, "int8_gradients": False, "int8_params": False})
    del cfg["optimizer"]
    engine, optimizer, _, _ = zero8.initialize(model=model, optimizer=client, config=cfg,
                                               lr_scheduler=torch.optim.lr_scheduler.LambdaLR(client, _decay))
    assert engine._opt.num_hyper_groups == 3 and len(optimizer.param_groups) == 1
    train_engine(engine, DATA, steps, B)
    assert params_equal(model, ref), max_param_diff(model, ref)
    assert engine.get_lr() == pytest.approx([3e-3 / (1 + steps)])
    assert [engine._opt.group_hyper(h).lr for h in (1, 2)] == pytest.approx([1e-3, 2e-2])
    # Not vacuous: without the overrides the run lands elsewhere.
    plain = make_model()
    client = zero8.optim.AdamW(plain.parameters(), lr=3e-3, weight_decay=0.01, optim_bits=bits)
    engine, _, _, _ = zero8.initialize(model=plain, optimizer=client, config=cfg,
                                       lr_scheduler=torch.optim.lr_scheduler.LambdaLR(client, _decay))
    train_engine(engine, DATA, steps, B)
    assert max_param_diff(plain, ref) > 1e-3


def test_global_overrides_with_the_config_optimizer_and_resume(tmp_path):
    # GlobalOptimManager overrides apply with the config's optimizer too; the override groups are part of
    # the checkpoint's layout: a resume is bit-exact, and a checkpoint saved without them loads its
    # weights only (the optimizer states belong to another grouping, as with other param groups).
    mng = zero8.optim.GlobalOptimManager.get_instance()
    over = {"lr": 1e-2, "betas": (0.8, 0.99)}  # held by weak references: gone with each model

    def build(seed, zero8_cfg=FULL8, override=True):
        model = make_model(seed)
        if override:
            mng.override_config(model[2].weight, key_value_dict=over)
        engine, _, _, _ = zero8.initialize(model=model, config=config(zero8=zero8_cfg))
        return engine, model

    ref = make_model()
    mng.override_config(ref[2].weight, key_value_dict=over)
    opt = zero8.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.01, optim_bits=32)
    for s in range(3):
        x, y = global_batch(DATA, s, B)
        opt.zero_grad()
        loss_fn(ref(x), y).backward()
        opt.step()
    exact, m32 = build(0, EXACT)
    train_engine(exact, DATA, 3, B)
    assert params_equal(m32, ref), max_param_diff(m32, ref)

    engine, model = build(0)
    train_engine(engine, DATA, 2, B)
    engine.save_checkpoint(tmp_path, tag="with")
    tail = train_engine(engine, DATA, 3, B)
    e2, m2 = build(5)
    e2.load_checkpoint(tmp_path, tag="with")
    assert train_engine(e2, DATA, 3, B) == tail and params_equal(m2, model)

    # The error says what the override groups are: "param group 1" would puzzle a user who has one.
    named = "the override group of param group 0 for parameters with override_config {'lr': 0.01, 'betas': (0.8, 0.99)}"
    plain, _ = build(0, override=False)
    with pytest.raises(zero8.Zero8IOError, match=re.escape(
            f"parameter '2.weight' is in group 1 in the checkpoint, param group 0 here, where group 1 in the "
            f"checkpoint is {named} (the optimizer states are laid out by param group")):
        plain.load_checkpoint(tmp_path, tag="with")
    train_engine(plain, DATA, 1, B)
    plain.save_checkpoint(tmp_path, tag="without")
    e3, m3 = build(5)
    with pytest.raises(zero8.Zero8IOError, match=re.escape(
            f"parameter '2.weight' is in param group 0 in the checkpoint, group 1 here, where group 1 here is {named} "
            f"(the optimizer states are laid out by param group")):
        e3.load_checkpoint(tmp_path, tag="without")
    e3.load_checkpoint(tmp_path, tag="without", load_optimizer_states=False)
    assert params_equal(m3, plain.module)


def test_equal_overrides_spelled_differently_share_a_group():
    # 0 and 0.0, a list and a tuple of betas: the same values, one override group (not one per spelling,
    # which a resume spelling them otherwise would find as another layout).
    mng = zero8.optim.GlobalOptimManager.get_instance()
    model = make_model()
    mng.override_config(model[0].weight, key_value_dict={"weight_decay": 0, "betas": [0.8, 0.99]})
    mng.override_config(model[2].weight, key_value_dict={"weight_decay": 0.0, "betas": (0.8, 0.99)})
    engine, _, _, _ = zero8.initialize(model=model, config=config(zero8=FULL8))
    assert len(engine._override_groups) == 1
    assert engine._opt.num_hyper_groups == 2


def test_inspect_tells_override_groups_from_param_groups(tmp_path):
    # The manifest numbers the override groups after the param groups; the tool reads the engine's state
    # to say which is which (one param group here, not two).
    if not _tool().is_file():
        pytest.skip(f"no zero8-checkpoint in {_tool().parent} (run scripts/build.sh, or set ZERO8_BUILD_DIR)")
    model = make_model()
    zero8.optim.GlobalOptimManager.get_instance().override_config(model[2].weight, key_value_dict={"lr": 0.01})
    engine, _, _, _ = zero8.initialize(model=model, config=config(zero8=FULL8))
    engine.save_checkpoint(tmp_path, tag="t")
    r = subprocess.run([str(_tool()), "inspect", str(tmp_path / "t")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert re.search(r"param groups: 1, override groups: 1 \(0: \d+ tensors, \d+ elements; "
                     r'1 \[override of param group 0, \{"lr":0.01\}\]: 1 tensors, 8192 elements\)', r.stdout), r.stdout
    # A client state that is not the engine's, with keys of other types: the groups are counted as they are.
    manifest = tmp_path / "t" / "manifest.json"
    m = json.loads(manifest.read_text())
    m["client_state"] = {"format": 3, "optimizer": 5}
    del m["manifest_xxh3"]
    manifest.write_text(json.dumps(m))
    r = subprocess.run([str(_tool()), "inspect", str(tmp_path / "t")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "param groups: 2 (0: " in r.stdout, r.stdout + r.stderr


def test_changed_override_values_resume_with_a_warning(tmp_path):
    # The same overridden parameters with other values: the layout matches, the optimizer states load, and
    # the engine's own overrides apply; the warning names the group and both values. Equal values: silent.
    mng = zero8.optim.GlobalOptimManager.get_instance()

    def build(seed, lr):
        model = make_model(seed)
        mng.override_config(model[2].weight, key_value_dict={"lr": lr})
        engine, _, _, _ = zero8.initialize(model=model, config=config(zero8=FULL8))
        return engine

    engine = build(0, 1e-2)
    train_engine(engine, DATA, 1, B)
    engine.save_checkpoint(tmp_path, tag="t")
    with pytest.warns(UserWarning, match=r"group 1: \{'lr': 0.01\} in the checkpoint, \{'lr': 0.02\} here "
                                         r"\(param group 0\)"):
        changed = build(1, 2e-2)
        changed.load_checkpoint(tmp_path, tag="t")
    assert changed._override_groups == [(0, {"lr": 2e-2})]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build(1, 1e-2).load_checkpoint(tmp_path, tag="t")


def test_stable_embedding_weight_keeps_fp32_states():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = zero8.nn.StableEmbedding(1000, 16)  # 16000 elements: 8-bit by size, fp32 by override
            self.out = torch.nn.Linear(16, 512)            # 8192 weights: 8-bit

        def forward(self, idx):
            return self.out(self.emb(idx)).mean()

    net = Net()
    engine, _, _, _ = zero8.initialize(model=net, config=config(zero8=FULL8))
    names = engine._param_names
    group = {names[i]: engine._opt.param_slot(i)[0] for i in range(len(names))}
    assert group["emb.weight"] == zero8._C.GROUP_FP32 and group["out.weight"] == zero8._C.GROUP_8BIT
    idx = torch.randint(0, 1000, (8, 4))
    engine.backward(engine(idx))
    engine.step()
    assert engine.global_steps == 1


def _hf_groups(model, decay_lr=3e-3, other_lr=1e-2):
    """The usual transformer grouping: weights decay, biases do not (and here take their own lr too)."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": decay, "weight_decay": 0.1, "lr": decay_lr, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "lr": other_lr, "name": "no_decay"}]


def _torch_grouped(steps, dtype, lambdas=None):
    model = make_model().to(dtype)
    opt = torch.optim.AdamW([{k: v for k, v in g.items() if k != "name"} for g in _hf_groups(model)])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambdas) if lambdas else None
    for s in range(steps):
        x, y = global_batch(DATA, s, B)
        opt.zero_grad()
        loss_fn(model(x.to(dtype)), y).backward()
        opt.step()
        if sched is not None:
            sched.step()
    return model


@pytest.mark.parametrize("stage", [1, 2])
def test_param_groups_step_with_their_own_hyperparameters(stage):
    # model_parameters as param-group dicts with their own lr and weight decay (and a per-group LR
    # schedule) train as torch's AdamW over the same groups: within 2x torch's own fp32 error.
    lambdas = [lambda s: 1.0 / (1 + s), lambda s: 0.5 ** s]
    steps = 12
    ref32, ref64 = _torch_grouped(steps, torch.float32, lambdas), _torch_grouped(steps, torch.float64, lambdas)
    err = max_param_diff(ref32, ref64)
    model = make_model()
    engine, optimizer, _, _ = zero8.initialize(
        model=model, model_parameters=_hf_groups(model), config=config(stage=stage, zero8=EXACT),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambdas))
    assert [(g["name"], g["weight_decay"], len(g["params"])) for g in optimizer.param_groups] == [
        ("decay", 0.1, 3), ("no_decay", 0.0, 3)]
    train_engine(engine, DATA, steps, B)
    assert max_param_diff(model, ref32) <= 2 * err + 1e-7, (max_param_diff(model, ref32), err)
    # Not vacuous: one set of hyperparameters for both groups lands far away.
    one = _torch_grouped(0, torch.float32)
    opt = torch.optim.AdamW(one.parameters(), lr=3e-3, weight_decay=0.1)
    for s in range(steps):
        x, y = global_batch(DATA, s, B)
        opt.zero_grad()
        loss_fn(one(x), y).backward()
        opt.step()
    assert max_param_diff(one, ref32) > 100 * (2 * err + 1e-7)
    assert engine.get_lr() == pytest.approx([3e-3 / (1 + steps), 1e-2 * 0.5 ** steps])


def test_param_groups_of_a_client_optimizer():
    # A torch client's groups train as torch does; a zero8.optim 8-bit client's group with lr 0 and no
    # decay stays exactly where it was while the other group moves.
    model = make_model()
    client = torch.optim.AdamW([{k: v for k, v in g.items() if k != "name"} for g in _hf_groups(model)])
    cfg = config(zero8=EXACT)
    del cfg["optimizer"]
    engine, optimizer, _, _ = zero8.initialize(model=model, optimizer=client, config=cfg)
    assert optimizer.param_groups is client.param_groups
    train_engine(engine, DATA, 8, B)
    ref32, ref64 = _torch_grouped(8, torch.float32), _torch_grouped(8, torch.float64)
    assert max_param_diff(model, ref32) <= 2 * max_param_diff(ref32, ref64) + 1e-7

    model = make_model()
    before = clone_params(model)
    groups = _hf_groups(model, other_lr=0.0)
    client = zero8.optim.AdamW8bit([{k: v for k, v in g.items() if k != "name"} for g in groups], min_8bit_size=16)
    cfg8 = config(zero8=FULL8)
    del cfg8["optimizer"]
    engine, _, _, _ = zero8.initialize(model=model, optimizer=client, config=cfg8)
    train_engine(engine, DATA, 4, B)
    for (n, p), p0 in zip(model.named_parameters(), before):
        assert torch.equal(p, p0) == n.endswith("bias"), n


def test_callable_optimizer_is_built_over_model_parameters_as_given():
    # DeepSpeed calls a callable optimizer with model_parameters as given: param-group dicts keep their own
    # weight decay and lr (once they got a flat list and trained with one group's values), and without
    # model_parameters it gets every module parameter, frozen ones too, of which the engine trains the
    # trainable ones, each once.
    cfg = config(zero8=EXACT)
    del cfg["optimizer"]
    model = make_model()
    groups = [{k: v for k, v in g.items() if k != "name"} for g in _hf_groups(model)]
    got = []

    def build(params):
        got.append(params)
        return torch.optim.AdamW(params)

    engine, optimizer, _, _ = zero8.initialize(model=model, optimizer=build, model_parameters=iter(groups),
                                               config=cfg)
    assert got == [groups]
    assert [(g["weight_decay"], g["lr"]) for g in optimizer.param_groups] == [(0.1, 3e-3), (0.0, 1e-2)]
    train_engine(engine, DATA, 8, B)
    ref32, ref64 = _torch_grouped(8, torch.float32), _torch_grouped(8, torch.float64)
    assert max_param_diff(model, ref32) <= 2 * max_param_diff(ref32, ref64) + 1e-7

    model = make_model()
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    got.clear()
    engine, _, _, _ = zero8.initialize(model=model, optimizer=build, config=cfg)
    assert len(got) == 1 and [id(p) for p in got[0]] == [id(p) for p in model.parameters()]
    assert engine.memory_stats()["params"] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    train_engine(engine, DATA, 2, B)
    assert torch.equal(model[0].weight, frozen) and engine.global_steps == 2


def test_param_groups_may_differ_only_in_their_own_keys():
    model = make_model()
    groups = _hf_groups(model)
    groups[1]["bias_correction"] = False
    with pytest.raises(zero8.Zero8NotSupportedError, match=r"model_parameters\[1\]\.bias_correction"):
        zero8.initialize(model=model, model_parameters=groups, config=config(zero8=EXACT))
    cfg = config(zero8=EXACT)
    del cfg["optimizer"]
    m = make_model()
    sgd = torch.optim.SGD([{"params": [m[0].weight], "momentum": 0.9, "nesterov": True},
                           {"params": [m[2].weight], "momentum": 0.9}], lr=0.1)
    with pytest.raises(zero8.Zero8NotSupportedError, match=r"param_groups\[1\]\.nesterov"):
        zero8.initialize(model=m, optimizer=sgd, config=cfg)
    # A group added after initialize has no place in the sharded optimizer: the next step says so.
    m = make_model()
    engine, optimizer, _, _ = zero8.initialize(model=m, model_parameters=list(m.parameters())[:4],
                                               config=config(zero8=EXACT))
    optimizer.add_param_group({"params": list(m.parameters())[4:]})
    x, y = global_batch(DATA, 0, B)
    engine.backward(loss_fn(engine(x), y))
    with pytest.raises(zero8.Zero8NotSupportedError, match="cannot be added after zero8.initialize"):
        engine.step()


def test_param_groups_resume_exactly_and_must_match_on_load(tmp_path):
    def build():
        model = make_model()
        engine, _, _, _ = zero8.initialize(model=model, model_parameters=_hf_groups(model),
                                           config=config(zero8=FULL8))
        return engine, model

    straight, m1 = build()
    train_engine(straight, DATA, 6, B)
    first, _ = build()
    train_engine(first, DATA, 3, B)
    first.save_checkpoint(tmp_path)
    resumed, m2 = build()
    resumed.load_checkpoint(tmp_path)
    for s in range(3, 6):  # steps 3..5 on the same batches as the straight run
        x, y = global_batch(DATA, s, B)
        resumed.backward(loss_fn(resumed(x), y))
        resumed.step()
    assert params_equal(m1, m2)
    # Another grouping lays the states out differently, and the model order is another parameter order:
    # each load fails naming a parameter, and nothing moves.
    for case in ("one group", "model order"):
        other = make_model()
        groups = _hf_groups(other)
        params = [{"params": groups[0]["params"] + groups[1]["params"]}] if case == "one group" else None
        engine, _, _, _ = zero8.initialize(model=other, model_parameters=params, config=config(zero8=FULL8))
        before = clone_params(other)
        want = ("parameter '0.bias' is in param group 1 in the checkpoint, param group 0 here" if case == "one group"
                else "the same parameters in another order: parameter 1 is '2.weight' in the checkpoint")
        with pytest.raises(zero8.Zero8Error, match=want):
            engine.load_checkpoint(tmp_path)
        assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_refresh_fp32_params_keeps_weights_loaded_into_the_module(dtype):
    # lr 0: a step leaves the weights at the masters. Weights loaded into the module after initialize are
    # lost at the next step unless the masters are refreshed from them (DeepSpeed's refresh_fp32_params).
    extra = {"bf16": {"enabled": True}} if dtype == "bf16" else {}
    other = make_model(seed=5).to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    for refresh, z8 in ((False, EXACT), (True, EXACT), (True, FULL8)):
        engine, model, optimizer, _ = engine_for(config(lr=0.0, weight_decay=0.0, zero8=z8, **extra))
        start = clone_params(model)
        train_engine(engine, DATA, 1, B, dtype=other[0].weight.dtype)
        model.load_state_dict(other.state_dict())
        if refresh:
            optimizer.refresh_fp32_params()
        train_engine(engine, DATA, 2, B, dtype=other[0].weight.dtype)
        want = list(other.parameters()) if refresh else start
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), want)), f"refresh={refresh} {z8}"


def test_save_16bit_model_writes_the_weights_whole(tmp_path):
    model = make_model()
    model[0].weight.requires_grad_(False)
    engine, _, _, _ = zero8.initialize(model=model, config=config(zero8=FULL8, bf16={"enabled": True}))
    train_engine(engine, DATA, 2, B, dtype=torch.bfloat16)
    assert engine.save_16bit_model(tmp_path / "export") is True
    saved = torch.load(tmp_path / "export" / "pytorch_model.bin", weights_only=True)
    assert list(saved) == list(model.state_dict())
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, model.state_dict()[k]) for k, v in saved.items())
    # Compact copies: the file holds the weights, not the engine's whole flat buffers once per tensor.
    weights = sum(v.numel() * v.element_size() for v in saved.values())
    assert (tmp_path / "export" / "pytorch_model.bin").stat().st_size < weights + 20000
    engine.save_16bit_model(tmp_path / "export", "trainable.bin", exclude_frozen_parameters=True)
    trainable = torch.load(tmp_path / "export" / "trainable.bin", weights_only=True)
    assert "0.weight" not in trainable and set(trainable) == set(engine.module_state_dict(
        exclude_frozen_parameters=True))
    # A failed write leaves no partial file behind.
    (tmp_path / "export" / "blocked.bin").mkdir()
    with pytest.raises(OSError):
        engine.save_16bit_model(tmp_path / "export", "blocked.bin")
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["blocked.bin", "pytorch_model.bin",
                                                                      "trainable.bin"]


def test_frozen_parameters_are_left_alone():
    model = make_model()
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    engine, _, _, _ = zero8.initialize(model=model, config=config(zero8=EXACT))
    assert len(engine._params) == 5
    train_engine(engine, DATA, 3, B)
    assert torch.equal(model[0].weight, frozen) and model[0].weight.grad is None


def test_destroy_keeps_weights_and_stops_training():
    engine, model, _, _ = engine_for(config(zero8=EXACT))
    train_engine(engine, DATA, 2, B)
    before = clone_params(model)
    engine.destroy()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    x, y = global_batch(DATA, 0, B)
    loss_fn(model(x), y).backward()  # a plain torch model again
    with pytest.raises(RuntimeError, match="destroyed"):
        engine.step()


def test_client_optimizer_errors():
    cfg = config(zero8=EXACT)
    model = make_model()
    with pytest.raises(zero8.Zero8ValueError, match="both a client optimizer"):
        zero8.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=cfg)
    del cfg["optimizer"]
    with pytest.raises(zero8.Zero8NotSupportedError, match="NAdam"):
        zero8.initialize(model=make_model(), optimizer=torch.optim.NAdam(make_model().parameters()), config=cfg)
    with pytest.raises(zero8.Zero8NotSupportedError, match="amsgrad"):
        m = make_model()
        zero8.initialize(model=m, optimizer=torch.optim.Adam(m.parameters(), amsgrad=True), config=cfg)
    with pytest.raises(zero8.Zero8ValueError, match="no optimizer"):
        zero8.initialize(model=make_model(), config=cfg)


def _sgd(**kw):
    # SGD: a gradient twice too large moves the weights twice as far (Adam's update would hide it).
    return config(zero8=EXACT, optimizer={"type": "SGD", "params": {"lr": 0.05}}, **kw)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_direct_backward_computes_what_engine_backward_does(stage):
    """loss.backward() on the engine's output, then engine.step() (DeepSpeed 0.19's torch-style backward):
    each gradient is divided by gradient_accumulation_steps as it arrives, as engine.backward divides the
    loss, so the two loops train alike (to rounding: the division happens at another place)."""
    ref, m_ref, _, _ = engine_for(_sgd(batch=30, gas=3, stage=stage))
    direct, m_direct, _, _ = engine_for(_sgd(batch=30, gas=3, stage=stage))
    for s in range(3):
        for k in range(3):
            x, y = _micro(s, k)
            ref.backward(loss_fn(ref(x), y))
            ref.step()
            loss_fn(direct(x), y).backward()
            direct.step()
    assert direct.global_steps == ref.global_steps == 3
    assert max_param_diff(m_direct, m_ref) < 1e-6, max_param_diff(m_direct, m_ref)
    assert max_param_diff(m_ref, make_model()) > 1e-3  # it moved


def test_a_direct_backward_under_fp16_needs_the_scaled_loss():
    """fp16: loss.backward() without engine.scale(loss) is refused before anything accumulates (the engine
    then trains as one that never saw it); engine.scale(loss).backward() trains as engine.backward(loss)."""
    cfg = _sgd(batch=30, gas=3, fp16={"enabled": True, "initial_scale_power": 8})
    ref, m_ref, _, _ = engine_for(cfg)
    direct, m_direct, _, _ = engine_for(cfg)
    x, y = _micro(0, 0)
    with pytest.raises(RuntimeError, match=r"fp16 needs the loss times the engine's loss scale.*"
                                           r"engine\.scale\(loss\)\.backward\(\)"):
        loss_fn(direct(x.half()), y).backward()
    with pytest.raises(TypeError, match="scalar tensor with a grad_fn"):
        direct.scale(torch.tensor(1.0))
    for s in range(2):
        for k in range(3):
            x, y = _micro(s, k)
            ref.backward(loss_fn(ref(x.half()), y))
            ref.step()
            direct.scale(loss_fn(direct(x.half()), y)).backward()
            direct.step()
    assert direct.global_steps == 2 and direct.loss_scale == ref.loss_scale
    assert max_param_diff(m_direct, m_ref) < 1e-3, max_param_diff(m_direct, m_ref)
    assert max_param_diff(m_ref, make_model()) > 1e-3


def test_optimizer_step_outside_the_engine_is_an_error():
    # loss.backward() + optimizer.step() (the torch loop) would step on unreduced gradients and leave the
    # counters and scheduler behind; it must say to use engine.backward/engine.step instead.
    engine, model, opt, _ = engine_for(config(zero8=EXACT))
    x, y = global_batch(DATA, 0, B)
    before = clone_params(model)
    loss_fn(engine(x), y).backward()
    with pytest.raises(RuntimeError, match=r"engine\.backward\(loss\) and engine\.step\(\)"):
        opt.step()
    same = lambda: all(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), before))  # noqa: E731
    assert same() and engine.global_steps == 0
    # the engine's own loop still steps (through the same optimizer.step)
    train_engine(engine, DATA, 2, B)
    assert engine.global_steps == 2 and not same()


# ---- checkpoints ----

def _resume_config():
    cfg = config(gas=2, zero8=FULL8)
    cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 3e-3, "warmup_num_steps": 4,
                                                            "total_num_steps": 30}}
    return cfg


def test_checkpoint_resume_is_exact(tmp_path):
    engine, model, _, sched = engine_for(_resume_config())
    train_engine(engine, DATA, 6, B)
    engine.save_checkpoint(tmp_path, client_state={"epoch": 3, "note": "x"})
    assert (tmp_path / "latest").read_text().strip() == "global_step6"
    tail = train_engine(engine, DATA, 6, B)  # steps 6..11 of the data (train_engine restarts at 0)
    want_params, want_lr = clone_params(model), engine.get_lr()

    e2, m2, _, s2 = engine_for(_resume_config(), seed=5)  # different initial weights: all must be loaded
    path, client = e2.load_checkpoint(tmp_path)
    assert path == os.path.join(str(tmp_path), "global_step6", MODEL_STATES_FILE)
    assert {k: client[k] for k in ("epoch", "note")} == {"epoch": 3, "note": "x"}
    assert e2.global_steps == 6 and e2.micro_steps == 12 and s2.last_batch_iteration == sched.last_batch_iteration - 6
    tail2 = train_engine(e2, DATA, 6, B)
    assert tail2 == tail
    assert all(torch.equal(a, b) for a, b in zip(want_params, m2.parameters()))
    assert e2.get_lr() == want_lr


def test_model_states_file_is_part_of_the_atomic_save(tmp_path, monkeypatch):
    # The .pt file is written into the tag with the shards and listed (with its checksum) in the
    # manifest before the tag is installed; a save that fails while making it leaves `latest` alone.
    engine, model, _, _ = engine_for(_resume_config())
    train_engine(engine, DATA, 2, B)
    engine.save_checkpoint(tmp_path)
    manifest = json.loads((tmp_path / "global_step2" / "manifest.json").read_text())
    listed = {f["name"]: f["role"] for f in manifest["files"]}
    assert listed[MODEL_STATES_FILE] == "extra"
    pt = tmp_path / "global_step2" / MODEL_STATES_FILE
    assert zero8._C.checkpoint_verify(str(tmp_path / "global_step2"))["problems"] == []
    raw = bytearray(pt.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    pt.write_bytes(bytes(raw))
    problems = zero8._C.checkpoint_verify(str(tmp_path / "global_step2"))["problems"]
    assert any(MODEL_STATES_FILE in p and "checksum mismatch" in p for p in problems), problems

    train_engine(engine, DATA, 1, B)

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", no_space)
    with pytest.raises(OSError, match="No space left"):
        engine.save_checkpoint(tmp_path)
    assert (tmp_path / "latest").read_text().strip() == "global_step2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step2", "latest"]


def _flip_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def _edit_client_state(tag_dir: Path) -> None:
    """A changed digit in the manifest's client state, its checksum field left as saved."""
    p = tag_dir / "manifest.json"
    m = json.loads(p.read_text())
    m["client_state"]["engine"]["global_steps"] += 2
    p.write_text(json.dumps(m, indent=1))


@pytest.mark.parametrize("full", [True, False], ids=["with_optimizer_states", "module_only"])
def test_failed_load_leaves_the_engine_untouched(tmp_path, full):
    # Every check runs before the C++ load installs anything: a load that raises leaves masters, 8-bit
    # states, weights, buffers and counters as they were. Twin engines A and B train alike; only A
    # tries the bad loads, then both take a step and must still agree bit for bit.
    other, _, _, _ = engine_for(config(zero8=FULL8), seed=5)
    train_engine(other, DATA, 4, B)
    other.module.register_buffer("counter", torch.tensor([7.0]))
    other.save_checkpoint(tmp_path / "good", tag="t")
    twins = []
    for _ in range(2):
        e, m, _, _ = engine_for(config(zero8=FULL8))
        m.register_buffer("counter", torch.tensor([1.0]))
        train_engine(e, DATA, 2, B)
        twins.append((e, m))
    (a, ma), (b, mb) = twins
    kw = {} if full else {"load_optimizer_states": False, "load_module_only": True}

    def case(name: str, mutate, error, match: str) -> None:
        d = tmp_path / name
        shutil.copytree(tmp_path / "good", d)
        mutate(d / "t")
        with pytest.raises(error, match=match):
            a.load_checkpoint(d, tag="t", **kw)
        assert a.global_steps == 2 and ma.counter[0].item() == 1.0, name

    case("pt_corrupt", lambda t: _flip_byte(t / MODEL_STATES_FILE), zero8.Zero8IOError,
         f"{MODEL_STATES_FILE}: checksum mismatch")
    case("client_state", _edit_client_state, zero8.Zero8IOError, "manifest.json: checksum mismatch")
    case("rest_corrupt", lambda t: _flip_byte(t / "model_rest.safetensors"), zero8.Zero8IOError,
         "model_rest.safetensors: checksum mismatch")  # no load reads it; rank 0 still checks it
    ma.register_buffer("extra", torch.zeros(3))  # a key the checkpoint lacks (strict load)
    case("missing_key", lambda t: None, zero8.Zero8ValueError, "lacks module keys \\['extra'\\]")
    del ma.extra
    ma.counter = torch.tensor([1.0, 1.0])
    case("other_shape", lambda t: None, zero8.Zero8ValueError, "counter: saved \\(1,\\), model \\(2,\\)")
    ma.counter = torch.tensor([1.0])
    train_engine(a, DATA, 1, B)
    train_engine(b, DATA, 1, B)
    assert params_equal(ma, mb)
    # The untouched copy loads, and brings its weights.
    a.load_checkpoint(tmp_path / "good", tag="t", **kw)
    assert params_equal(ma, other.module) and ma.counter.item() == 7.0
    assert a.global_steps == (4 if full else 3)


def test_resumed_hyperparameters_that_differ_from_the_config_warn(tmp_path):
    engine, _, _, _ = engine_for(config(zero8=FULL8, weight_decay=0.01))
    train_engine(engine, DATA, 1, B)
    engine.save_checkpoint(tmp_path)
    same, _, _, _ = engine_for(config(zero8=FULL8, weight_decay=0.01))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_checkpoint(tmp_path)
    changed, _, opt, _ = engine_for(config(zero8=FULL8, weight_decay=0.1, lr=1e-3))
    with pytest.warns(UserWarning, match=r"lr 0.003 \(configured 0.001\); weight_decay 0.01 \(configured 0.1\)"
                                         r".*checkpoint wins"):
        changed.load_checkpoint(tmp_path)
    assert opt.param_groups[0]["weight_decay"] == 0.01  # as DeepSpeed: the checkpoint's value


class _PeakRss:
    """Peak resident bytes of this process above the level at entry, sampled every millisecond; with
    ``anonymous``, its anonymous part only (resident minus file-backed and shared pages: what the process
    allocated, without the page cache of the files it maps)."""

    def __init__(self, anonymous: bool = False):
        self.anonymous = anonymous

    def __enter__(self):
        import threading

        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            fields = f.read().split()
        pages = int(fields[1]) - (int(fields[2]) if self.anonymous else 0)
        return pages * os.sysconf("SC_PAGE_SIZE")

    def _sample(self):
        import time

        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.above = max(self.peak, self._rss()) - self.base


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident size from /proc")
def test_a_large_frozen_tensor_costs_one_copy_to_save(tmp_path):
    # A LoRA-style job: a 64 MB frozen embedding. Rank 0 held four copies of it at the peak of a save: a
    # clone for the .pt file, the .pt bytes, and two for model_rest.safetensors (its bytes, then their C++
    # copy). The writer now reads the tensor where it is and torch.save takes it uncloned, which leaves
    # the serialized .pt bytes. (benchmarks/bench_checkpoint_frozen.py measures 300 MB: +1200 -> +300 MB.)
    model = make_model(0)
    model.register_parameter("frozen", torch.nn.Parameter(torch.randn(16 << 20), requires_grad=False))
    engine, _, _, _ = zero8.initialize(model=model, config=config(zero8=FULL8))
    train_engine(engine, DATA, 1, B)
    size = model.frozen.numel() * 4
    with _PeakRss() as m:
        engine.save_checkpoint(tmp_path, tag="t")
    assert m.above < 1.5 * size, f"save_checkpoint took {m.above / 1e6:.0f} MB more for a {size / 1e6:.0f} MB tensor"
    rest = (tmp_path / "t" / "model_rest.safetensors").read_bytes()
    assert rest[-size:] == model.frozen.detach().numpy().tobytes()
    assert torch.equal(torch.load(tmp_path / "t" / MODEL_STATES_FILE, weights_only=True)["module"]["frozen"],
                       model.frozen)


def _mapped(path: Path) -> bool:
    with open("/proc/self/maps") as f:
        return any(line.rstrip("\n").endswith(str(path)) for line in f)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident size from /proc")
@pytest.mark.parametrize("full", [True, False], ids=["with_optimizer_states", "module_only"])
def test_a_large_frozen_tensor_is_loaded_without_a_copy(tmp_path, full):
    # Every rank reads the .pt file: a plain torch.load put all of it in memory, so a 200 MB frozen
    # embedding cost each rank 200 MB more during a load. Mapped from the file, the tensors are copied
    # into the module from the page cache (file-backed pages, not counted here), and the mapping is gone
    # when the load returns, also after a load that failed. (benchmarks/bench_checkpoint_frozen.py
    # measures 300 MB.)
    model = make_model(0)
    model.register_parameter("frozen", torch.nn.Parameter(torch.randn(50 << 20), requires_grad=False))
    engine, _, _, _ = zero8.initialize(model=model, config=config(zero8=FULL8))
    train_engine(engine, DATA, 1, B)
    rng = torch.get_rng_state()
    engine.save_checkpoint(tmp_path, tag="t", client_state={"rng": rng})
    saved = model.frozen.detach().clone()
    kw = {} if full else {"load_optimizer_states": False, "load_module_only": True}
    pt = tmp_path / "t" / MODEL_STATES_FILE
    with torch.no_grad():
        model.frozen.zero_()
    size = model.frozen.numel() * 4
    with _PeakRss(anonymous=True) as m:
        _, client_state = engine.load_checkpoint(tmp_path, tag="t", **kw)
    assert m.above < size / 4, f"load_checkpoint took {m.above / 1e6:.0f} MB more for a {size / 1e6:.0f} MB tensor"
    assert torch.equal(model.frozen, saved)
    assert torch.equal(client_state["rng"], rng)  # a tensor of the file, copied out of it
    assert not _mapped(pt), "the loaded model states still map the file"
    model.register_buffer("extra", torch.zeros(3))  # a key the checkpoint lacks: a strict load fails
    with pytest.raises(zero8.Zero8ValueError, match="lacks module keys"):
        engine.load_checkpoint(tmp_path, tag="t", **kw)
    assert not _mapped(pt), "a failed load left the file mapped"


def test_the_model_states_file_is_what_copies_of_every_entry_gave(tmp_path, monkeypatch):
    # torch.save writes a tensor's whole storage, once per storage: the .pt file copies the views into
    # the engine's buffers (trained parameters) and the entries that share a storage (tied weights, a
    # buffer that is a view of another), and saves a tensor that is all of its own storage as it is. The
    # bytes are those of copying every entry, as the engine did before.
    model = make_model(0)
    model.register_parameter("frozen", torch.nn.Parameter(torch.randn(8, 4), requires_grad=False))
    model.register_parameter("tied", model.frozen)
    base = torch.randn(40)
    for name, t in (("base", base), ("part", base[10:20]), ("tr", torch.randn(5, 4).t()), ("pos", torch.arange(9)),
                    ("empty", torch.zeros(0, 3)), ("empty2", torch.zeros(0)), ("scalar", torch.tensor(3.5))):
        model.register_buffer(name, t)
    engine, _, _, _ = zero8.initialize(model=model, config=config(zero8=FULL8))
    train_engine(engine, DATA, 1, B)
    saved = []
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f, **kw: (saved.append(obj), real_save(obj, f, **kw))[1])
    engine.save_checkpoint(tmp_path, tag="t")
    module = saved[0]["module"]
    assert module["frozen"].data_ptr() == model.frozen.data_ptr()  # no copy
    assert module["tied"].data_ptr() != module["frozen"].data_ptr()
    copied = {**saved[0], "module": {k: v.clone() for k, v in module.items()}}
    monkeypatch.setattr(torch, "save", real_save)
    want = io.BytesIO()
    torch.save(copied, want)
    assert (tmp_path / "t" / MODEL_STATES_FILE).read_bytes() == want.getvalue()


def test_model_states_file_loads_with_torch_alone(tmp_path):
    engine, model, _, _ = engine_for(config(zero8=FULL8, bf16={"enabled": True}))
    model.register_buffer("counter", torch.tensor([7.0]))
    train_engine(engine, DATA, 3, B, dtype=torch.bfloat16)
    engine.save_checkpoint(tmp_path, tag="t1", client_state={"rng": torch.tensor([1, 2])})  # not JSON
    x, _ = global_batch(DATA, 0, 4)
    torch.save({"x": x, "y": model(x.bfloat16()).detach()}, tmp_path / "probe.pt")
    script = f"""
import sys, torch
sd = torch.load({str(tmp_path / 't1' / MODEL_STATES_FILE)!r})  # weights_only: plain tensors and values
m = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64), torch.nn.Tanh(),
                        torch.nn.Linear(64, 1)).bfloat16()
m.register_buffer("counter", torch.zeros(1))
m.load_state_dict(sd["module"], strict=True)
probe = torch.load({str(tmp_path / 'probe.pt')!r})
assert torch.equal(m(probe["x"].bfloat16()), probe["y"]), "rebuilt model differs"
assert m.counter.item() == 7.0 and sd["global_steps"] == 3 and torch.equal(sd["rng"], torch.tensor([1, 2]))
assert not any(k.startswith("zero8") for k in sys.modules), "zero8 was imported"
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    # The non-JSON client state comes back from the .pt file.
    e2, _, _, _ = engine_for(config(zero8=FULL8, bf16={"enabled": True}))
    e2.module.register_buffer("counter", torch.zeros(1))
    _, client = e2.load_checkpoint(tmp_path, tag="t1")
    assert torch.equal(client["rng"], torch.tensor([1, 2])) and e2.module.counter.item() == 7.0


def test_client_and_scheduler_states_come_back_as_saved(tmp_path):
    # DeepSpeed pickles both, so they come back as they were. JSON would turn int keys into strings (a
    # MultiStepLR's milestones Counter: the resumed lr never decays), tuples into lists and ints past
    # 64 bits into floats, and NaN or inf made the save fail.
    import collections

    def build(seed=0):
        model = make_model(seed)
        engine, _, _, sched = zero8.initialize(
            model=model, config=config(zero8=EXACT),
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[3, 5], gamma=0.1))
        return engine, sched

    engine, sched = build()
    train_engine(engine, DATA, 2, B)
    client = {"loss_by_epoch": {1: 0.5, 2: float("nan")}, "shape": (4, 2), "seen": 2**70, "best": float("inf"),
              "order": collections.OrderedDict(b=1, a=2), "plain": {"epoch": 3, "name": "x", "lrs": [0.1, None]}}
    engine.save_checkpoint(tmp_path, client_state=client)
    train_engine(engine, DATA, 4, B)
    e2, s2 = build(seed=5)
    _, got = e2.load_checkpoint(tmp_path)
    got = {k: got[k] for k in client}
    assert repr(got) == repr(client)  # the same types, keys and values (NaN compares unequal to itself)
    assert s2.state_dict()["milestones"] == sched.state_dict()["milestones"] == collections.Counter({3: 1, 5: 1})
    train_engine(e2, DATA, 4, B)
    assert e2.get_lr() == engine.get_lr() == [pytest.approx(3e-5)]


def test_a_model_states_file_that_cannot_be_mapped_is_read(tmp_path, monkeypatch):
    # Some file systems (FUSE mounts) cannot map files: the load reads the file instead, and says so.
    model = make_model()
    engine, _, _, _ = zero8.initialize(model=model, config=config(zero8=EXACT))
    train_engine(engine, DATA, 1, B)
    engine.save_checkpoint(tmp_path, client_state={"epoch": 3})
    real_load = torch.load

    def no_mmap(*args, **kwargs):
        if kwargs.get("mmap"):
            raise RuntimeError("mmap: operation not supported")
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", no_mmap)
    e2, _, _, _ = zero8.initialize(model=make_model(1), config=config(zero8=EXACT))
    with pytest.warns(UserWarning, match="could not be mapped .*mmap: operation not supported.*read into memory"):
        _, client = e2.load_checkpoint(tmp_path)
    assert client["epoch"] == 3 and params_equal(e2.module, model)


def test_a_resume_with_another_global_batch_says_so(tmp_path):
    # Resuming at another world size (or batch config) changes the global batch; the steps go on.
    engine, _, _, _ = zero8.initialize(model=make_model(), config=config(batch=32, zero8=EXACT))
    train_engine(engine, DATA, 2, 32)
    engine.save_checkpoint(tmp_path)
    e2, _, _, _ = zero8.initialize(model=make_model(1), config=config(batch=16, zero8=EXACT))
    with pytest.warns(UserWarning, match=r"trained with a global batch of 32 samples \(1 data-parallel rank\(s\)\); "
                                         r"this engine's is 16 \(1 rank\(s\) x 16 x 1 accumulation steps\)"):
        e2.load_checkpoint(tmp_path)
    assert e2.global_steps == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zero8.initialize(model=make_model(1), config=config(batch=32, zero8=EXACT))[0].load_checkpoint(tmp_path)


def test_a_resume_with_another_gradient_clipping_says_so(tmp_path):
    # A run saved without clipping (zero8's and DeepSpeed's default before DeepSpeed PR #8068) and resumed with
    # a config that does not say: the default is 1.0 now, which changes the run; the load says so.
    engine, _, _, _ = zero8.initialize(model=make_model(), config=config(zero8=EXACT, gradient_clipping=0))
    train_engine(engine, DATA, 2, 32)
    engine.save_checkpoint(tmp_path)
    cfg = config(zero8=EXACT)
    del cfg["gradient_clipping"]
    e2, _, _, _ = zero8.initialize(model=make_model(1), config=cfg)
    assert e2.gradient_clipping() == 1.0
    with pytest.warns(UserWarning, match=r"trained with gradient_clipping 0; this engine's config gives 1 .*"
                                         r"set \"gradient_clipping\": 0 in the config"):
        e2.load_checkpoint(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zero8.initialize(model=make_model(1), config=config(zero8=EXACT))[0].load_checkpoint(tmp_path)


def test_client_state_tensors_that_share_storage_still_share_it(tmp_path):
    # As torch.load gives them (and DeepSpeed returns them): one tensor under two keys is one tensor, and a
    # view shares its base's storage, not a copy of it each (the file is mapped; these are copied out).
    engine, _, _, _ = zero8.initialize(model=make_model(), config=config(zero8=EXACT))
    t = torch.arange(10.0)
    engine.save_checkpoint(tmp_path, client_state={"ema": t, "head": t[:3], "same": t})
    e2, _, _, _ = zero8.initialize(model=make_model(1), config=config(zero8=EXACT))
    _, got = e2.load_checkpoint(tmp_path)
    assert got["same"] is got["ema"] and torch.equal(got["ema"], t)
    assert got["head"].untyped_storage().data_ptr() == got["ema"].untyped_storage().data_ptr()
    got["ema"] += 1
    assert got["head"].tolist() == [1.0, 2.0, 3.0]


def test_a_scheduler_state_of_another_kind_fails_the_load_before_anything_changes(tmp_path):
    # A checkpoint of a torch StepLR run loaded into an engine with the config's WarmupLR (or a LambdaLR,
    # as Hugging Face's linear warmup, loading a config scheduler's state): the scheduler refuses the
    # state. That used to raise (KeyError) after the weights and optimizer states were installed.
    def build(kind, seed=0):
        cfg = config(zero8=FULL8)
        kw = {}
        if kind == "config":
            cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}
        elif kind == "steplr":
            kw["lr_scheduler"] = lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
        else:
            kw["lr_scheduler"] = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
        model = make_model(seed)
        engine, _, _, sched = zero8.initialize(model=model, config=cfg, **kw)
        return engine, model, sched

    for saved, loading in (("steplr", "config"), ("config", "lambdalr")):
        engine, _, _ = build(saved)
        train_engine(engine, DATA, 3, B)
        engine.save_checkpoint(tmp_path, tag=saved)
        e2, m2, s2 = build(loading, seed=5)
        train_engine(e2, DATA, 1, B)
        before, sched_before, lr_before = clone_params(m2), s2.state_dict(), e2.get_lr()
        with pytest.raises(zero8.Zero8ValueError, match=f"LR scheduler state does not load into this engine's "
                                                        f"{type(s2).__name__}.*nothing was loaded"):
            e2.load_checkpoint(tmp_path, tag=saved)
        assert all(torch.equal(a, b) for a, b in zip(before, m2.parameters())), saved
        assert e2.global_steps == 1 and s2.state_dict() == sched_before and e2.get_lr() == lr_before
        # Without the scheduler state the rest loads.
        e2.load_checkpoint(tmp_path, tag=saved, load_lr_scheduler_states=False)
        assert params_equal(m2, engine.module) and e2.global_steps == 3


def test_trying_a_scheduler_state_leaves_child_schedulers_as_they_are(tmp_path):
    # The load checks the saved scheduler state before the ranks agree to commit; should another rank then
    # fail, this rank's scheduler must be as it was. SequentialLR loads into its children, which a shallow copy
    # shared: the check rewound them.
    def sequential(opt):
        first = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=10)
        return torch.optim.lr_scheduler.SequentialLR(
            opt, [first, torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=1)], milestones=[10])

    engine, _, _, sched = zero8.initialize(model=make_model(), config=config(zero8=FULL8), lr_scheduler=sequential)
    train_engine(engine, DATA, 3, B)
    saved = copy.deepcopy(sched.state_dict())
    train_engine(engine, DATA, 4, B)
    before = [s.last_epoch for s in (sched, *sched._schedulers)]
    engine._check_scheduler_state(saved, str(tmp_path))
    assert [s.last_epoch for s in (sched, *sched._schedulers)] == before == [7, 7, -1]
    # What was tried is what a load installs.
    trial = copy.deepcopy(sched)
    trial.load_state_dict(saved)
    assert trial._schedulers[0].last_epoch == 3


def _micro_steps(engine, step: int, ks) -> None:
    """Micro-batches ks of global step `step` (one rank), each a backward and an engine.step()."""
    for k in ks:
        x, y = micro_batch(DATA, step, B, 0, 1, engine.gradient_accumulation_steps(), k)
        engine.backward(loss_fn(engine(x), y))
        engine.step()


def test_a_save_in_the_middle_of_accumulation_resumes_at_the_start_of_that_step(tmp_path):
    # The gradients of an unfinished step are not saved (nor are they by DeepSpeed, whose loaded engine
    # starts counting micro-batches afresh). The loaded engine used to take the saved micro_steps, so its
    # first step ended after the remaining micro-batches alone, and every later step straddled two global
    # batches; the same with another gradient_accumulation_steps (another world size, the same batch).
    straight, ms, _, _ = engine_for(config(gas=2, zero8=FULL8))
    train_engine(straight, DATA, 3, B)
    first, mf, _, _ = engine_for(config(gas=2, zero8=FULL8))
    train_engine(first, DATA, 1, B)
    _micro_steps(first, 1, [0])
    with pytest.warns(UserWarning, match=r"middle of gradient accumulation \(micro-batch 1 of 2 of step 2\)"):
        first.save_checkpoint(tmp_path)
    _micro_steps(first, 1, [1])
    _micro_steps(first, 2, [0, 1])
    assert params_equal(ms, mf)  # the save leaves the accumulation it interrupts alone

    resumed, mr, _, _ = engine_for(config(gas=2, zero8=FULL8), seed=5)
    resumed.load_checkpoint(tmp_path)
    assert resumed.global_steps == 1 and resumed.micro_steps == 2 and not resumed.is_gradient_accumulation_boundary()
    _micro_steps(resumed, 1, [0, 1])
    _micro_steps(resumed, 2, [0, 1])
    assert params_equal(ms, mr) and resumed.global_steps == 3

    four, _, _, _ = engine_for(config(gas=4, zero8=FULL8), seed=5)
    first.save_checkpoint(tmp_path, tag="gas2")  # 3 steps, 6 micro-batches of 2
    four.load_checkpoint(tmp_path, tag="gas2")
    _micro_steps(four, 3, [0, 1, 2])
    assert four.global_steps == 3
    _micro_steps(four, 3, [3])
    assert four.global_steps == 4


@pytest.mark.parametrize("stage", [1, 2])
def test_a_load_in_the_middle_of_accumulation_drops_the_gradients_so_far(tmp_path, stage):
    # E.g. a loop that reloads the last checkpoint when a loss spikes, between two micro-batches: the
    # gradients accumulated so far belong to the replaced weights. They used to be added to the next step
    # (in grad_input in stage 1, reduced into the partition in stage 2).
    cfg = config(gas=2, stage=stage, zero8=FULL8)
    first, mf, _, _ = engine_for(cfg)
    train_engine(first, DATA, 1, B)
    first.save_checkpoint(tmp_path)
    _micro_steps(first, 1, [0, 1])
    for kw in ({}, {"load_optimizer_states": False}):
        e, m, _, _ = engine_for(cfg, seed=5)
        train_engine(e, DATA, 1, B)
        _micro_steps(e, 7, [0])
        if kw:  # the weights only: the other states must be the ones the reference has too
            e2, m2, _, _ = engine_for(cfg, seed=5)
            train_engine(e2, DATA, 1, B)
            e2.load_checkpoint(tmp_path, **kw)
        e.load_checkpoint(tmp_path, **kw)
        assert e.micro_steps == 2 and not e.is_gradient_accumulation_boundary()
        _micro_steps(e, 1, [0, 1])
        if kw:
            _micro_steps(e2, 1, [0, 1])
            assert params_equal(m, m2), kw
        else:
            assert params_equal(m, mf)


def test_frozen_parameters_and_another_model_on_load(tmp_path):
    def build(seed, extra=False):
        model = make_model(seed)
        model[0].weight.requires_grad_(False)
        if extra:
            model.register_parameter("extra", torch.nn.Parameter(torch.ones(3)))
        engine, _, _, _ = zero8.initialize(model=model, config=config(zero8=FULL8))
        return engine, model

    engine, model = build(0)
    train_engine(engine, DATA, 2, B)
    engine.save_checkpoint(tmp_path, tag="all")
    engine.save_checkpoint(tmp_path, tag="trainable", exclude_frozen_parameters=True)
    saved = torch.load(tmp_path / "trainable" / MODEL_STATES_FILE, weights_only=False)["module"]
    assert "0.weight" not in saved and "0.bias" in saved
    e2, m2 = build(5)
    e2.load_checkpoint(tmp_path, tag="all")  # the frozen weight comes from the .pt file
    assert params_equal(m2, model)
    e3, m3 = build(5)
    own = m3[0].weight.detach().clone()
    with pytest.raises(zero8.Zero8ValueError, match=r"lacks module keys \['0.weight'\]"):
        e3.load_checkpoint(tmp_path, tag="trainable")
    e3.load_checkpoint(tmp_path, tag="trainable", load_module_strict=False)
    assert torch.equal(m3[0].weight, own) and torch.equal(m3[2].weight, model[2].weight)
    # A parameter more: the optimizer states do not fit, strict or not; the weights load without them.
    e4, m4 = build(5, extra=True)
    with pytest.raises(zero8.Zero8Error, match="another model.*'extra'"):
        e4.load_checkpoint(tmp_path, tag="all", load_module_strict=False)
    e4.load_checkpoint(tmp_path, tag="all", load_module_strict=False, load_optimizer_states=False)
    assert torch.equal(m4[2].weight, model[2].weight) and torch.equal(m4.extra, torch.ones(3))


# ---- the consolidated weights (zero8-checkpoint to-fp32) ----

ROOT = Path(__file__).resolve().parents[2]
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}


def _safetensors_read(path: Path) -> dict:
    """A safetensors file read by the format's definition (u64 header length, JSON header, raw data), in
    header order: the test needs neither the safetensors package nor zero8."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        b, e = t["data_offsets"]
        data = bytearray(raw[8 + n + b:8 + n + e])
        out[name] = torch.frombuffer(data, dtype=_ST_DTYPES[t["dtype"]]).reshape(t["shape"]) if data else \
            torch.empty(t["shape"], dtype=_ST_DTYPES[t["dtype"]])
    return out


class _TiedLM(torch.nn.Module):
    """A model whose state_dict holds more than the trained parameters: a frozen position embedding, a
    tied output weight (the token embedding under a second name), BatchNorm's running statistics and
    step count, a registered integer position-id buffer, and a non-persistent buffer (not in state_dict)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(16, 8)
        self.pos = torch.nn.Embedding(6, 8)
        self.pos.weight.requires_grad_(False)
        self.norm = torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("position_ids", torch.arange(6).unsqueeze(0))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, ids):
        h = self.embed(ids) + self.pos(self.position_ids[:, :ids.shape[1]])
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h)


def _tied_lm_checkpoint(tmp_path: Path, dtype: str):
    cfg = config(batch=4, zero8=EXACT)
    if dtype == "bf16":
        # BatchNorm's kernel wants its running statistics in its weight's dtype: the buffers go to bf16 too
        # (the engine casts the parameters only, as DeepSpeed's).
        cfg["bf16"] = {"enabled": True}
        cfg["data_types"] = {"buffer_dtype": "bf16"}
    model = _TiedLM(0)
    engine, _, _, _ = zero8.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        ids = torch.randint(0, 16, (4, 6), generator=g)
        logits = engine(ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 16).float(), ids[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(tmp_path, tag="t")
    return engine, model, tmp_path / "t"


def _check_full_state_dict(sd: dict, model: torch.nn.Module, dtype: str) -> None:
    """sd (a to-fp32 output) loads strictly into a fresh model and equals the engine's module: the trained
    weights as fp32 (the masters: the bf16 working copy is them rounded), the rest exactly, floats as fp32."""
    want = model.state_dict()
    assert list(sd) == list(want)  # every key, in state_dict order, the tied one included
    fresh = _TiedLM(7)
    fresh.load_state_dict(sd, strict=True)
    trained = {k for k, v in model.state_dict(keep_vars=True).items()
               if isinstance(v, torch.nn.Parameter) and v.requires_grad}
    assert trained == {"embed.weight", "head.weight", "norm.weight", "norm.bias"}
    for k, v in want.items():
        got = sd[k]
        assert got.dtype == (torch.float32 if v.is_floating_point() else v.dtype), k
        if k in trained and dtype == "bf16":
            assert torch.equal(got.to(torch.bfloat16), v), k  # the master rounds to the working copy
        else:
            assert torch.equal(got.to(v.dtype), v) and torch.equal(got, v.to(got.dtype)), k
    assert torch.equal(sd["head.weight"], sd["embed.weight"])
    assert sd["norm.num_batches_tracked"].item() == 3 and sd["position_ids"].dtype == torch.int64


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_to_fp32_gives_the_whole_state_dict(tmp_path, dtype):
    # As DeepSpeed's zero_to_fp32: frozen parameters, persistent buffers and tied names are in the output,
    # so a model loads it with strict=True (zero8's: 16-bit floats widened to fp32, integers as saved).
    engine, model, tag_dir = _tied_lm_checkpoint(tmp_path / "ckpt", dtype)
    assert zero8._C.checkpoint_verify(str(tag_dir))["ok"]
    out = tmp_path / "model_fp32.safetensors"
    r = zero8._C.checkpoint_export_fp32(str(tag_dir), str(out))
    assert r == {"tensors": 9, "trained": 4, "rest": 5, "complete": True}
    _check_full_state_dict(_safetensors_read(out), model, dtype)
    # The checkpoint still resumes, and the frozen weight and buffers come back from it.
    e2, _, _, _ = zero8.initialize(model=_TiedLM(5), config=engine.config)
    e2.load_checkpoint(tmp_path / "ckpt", tag="t")
    for k, v in model.state_dict().items():
        assert torch.equal(e2.module.state_dict()[k], v), k
    # exclude_frozen_parameters leaves the frozen weight out of the export too (as out of DeepSpeed's).
    engine.save_checkpoint(tmp_path / "ckpt", tag="trainable", exclude_frozen_parameters=True)
    zero8._C.checkpoint_export_fp32(str(tmp_path / "ckpt" / "trainable"), str(out))
    assert list(_safetensors_read(out)) == [k for k in model.state_dict() if k != "pos.weight"]


def test_a_buffer_safetensors_cannot_hold_leaves_to_fp32_as_before(tmp_path):
    model = make_model(0)
    model.register_buffer("freqs", torch.ones(4, dtype=torch.complex64))
    engine, _, _, _ = zero8.initialize(model=model, config=config(zero8=EXACT))
    train_engine(engine, DATA, 1, B)
    with pytest.warns(UserWarning, match=r"freqs is torch.complex64, which .* cannot hold: zero8-checkpoint to-fp32 "
                                         r"will give the trained parameters only") as w:
        engine.save_checkpoint(tmp_path, tag="t")
    assert w[0].filename == __file__  # the warning points at the caller's save_checkpoint
    assert not (tmp_path / "t" / "model_rest.safetensors").exists()
    r = zero8._C.checkpoint_export_fp32(str(tmp_path / "t"), str(tmp_path / "out.safetensors"))
    assert not r["complete"] and r["tensors"] == len(list(model.parameters()))
    assert "freqs" in torch.load(tmp_path / "t" / MODEL_STATES_FILE, weights_only=False)["module"]

def _tool() -> Path:
    return Path(os.environ.get("ZERO8_BUILD_DIR", ROOT / "build")) / "tools" / "zero8-checkpoint"


def test_to_fp32_tool_gives_the_whole_state_dict(tmp_path):
    if not _tool().is_file():
        pytest.skip(f"no zero8-checkpoint in {_tool().parent} (run scripts/build.sh, or set ZERO8_BUILD_DIR)")
    engine, model, tag_dir = _tied_lm_checkpoint(tmp_path / "ckpt", "bf16")

    def tool(*args):
        return subprocess.run([str(_tool()), *map(str, args)], capture_output=True, text=True, timeout=60)

    assert tool("verify", tag_dir).returncode == 0
    out = tmp_path / "model_fp32.safetensors"
    r = tool("to-fp32", tmp_path / "ckpt", out)
    assert r.returncode == 0, r.stderr
    assert "9 tensors: 4 trained (fp32 masters), 5 frozen parameters and buffers" in r.stdout, r.stdout
    _check_full_state_dict(_safetensors_read(out), model, "bf16")
    python_out = tmp_path / "python.safetensors"
    zero8._C.checkpoint_export_fp32(str(tag_dir), str(python_out))
    assert python_out.read_bytes() == out.read_bytes()
    assert "state_dict: 9 keys: 3 trained, 5 frozen parameters and buffers, 1 tied aliases" in \
        tool("inspect", tag_dir).stdout
    # A corrupt model_rest file: verify names it, to-fp32 fails and writes nothing.
    rest = tag_dir / "model_rest.safetensors"
    good = rest.read_bytes()
    _flip_byte(rest)
    r = tool("verify", tag_dir)
    assert r.returncode == 1 and "model_rest.safetensors: checksum mismatch" in r.stderr, r.stderr
    assert tool("to-fp32", tag_dir, tmp_path / "bad.safetensors").returncode == 1
    assert not (tmp_path / "bad.safetensors").exists()
    rest.write_bytes(good)
    # A checkpoint saved before the manifest listed the state_dict: the trained parameters, with a note.
    manifest = tag_dir / "manifest.json"
    m = json.loads(manifest.read_text())
    del m["state_dict"], m["manifest_xxh3"]
    manifest.write_text(json.dumps(m))
    r = tool("to-fp32", tag_dir, out)
    assert r.returncode == 0 and "note: this checkpoint lists no state_dict" in r.stdout, r.stdout
    assert "frozen parameters and buffers, if any, are in its mp_rank_00_model_states.pt" in r.stdout, r.stdout
    assert list(_safetensors_read(out)) == ["embed.weight", "norm.weight", "norm.bias"]


def test_checkpoint_latest_handling(tmp_path):
    engine, _, _, _ = engine_for(config(zero8=FULL8))
    with pytest.warns(UserWarning, match="no 'latest' file"):
        assert engine.load_checkpoint(tmp_path) == (None, None)  # nothing saved yet, as DeepSpeed
    train_engine(engine, DATA, 1, B)
    engine.save_checkpoint(tmp_path, tag="a")
    train_engine(engine, DATA, 1, B)
    engine.save_checkpoint(tmp_path, tag="b", save_latest=False)
    assert (tmp_path / "latest").read_text().strip() == "a"
    assert (tmp_path / "b" / MODEL_STATES_FILE).is_file()
    path, _ = engine.load_checkpoint(tmp_path)
    assert path.endswith(os.path.join("a", MODEL_STATES_FILE)) and engine.global_steps == 1


@pytest.mark.parametrize("kw, consumed", [
    ({}, {"module", "global_steps", "skipped_steps", "dp_world_size", "mp_world_size", "lr_scheduler"}),
    ({"load_lr_scheduler_states": False}, {"module", "global_steps", "skipped_steps", "dp_world_size",
                                           "mp_world_size"}),
    ({"load_optimizer_states": False, "load_module_only": True}, {"module", "lr_scheduler"}),
    ({"load_module_only": True, "load_lr_scheduler_states": False}, {"module"}),
], ids=["full", "no_scheduler", "module_only", "module_only_no_scheduler"])
@pytest.mark.filterwarnings("ignore:load_checkpoint. the checkpoint's optimizer hyperparameters")
def test_load_returns_the_model_states_keys_deepspeed_returns(tmp_path, kw, consumed):
    # DeepSpeed's _load_checkpoint returns as client_state every key of the model-states file but those it
    # loaded: the module alone with load_module_only (so global_steps etc. come back for a warm start), else
    # the module and its counters; lr_scheduler when the scheduler state was loaded. zero8 returned the
    # caller's keys only. The caller's keys come back in every mode, one named like an engine key too.
    cfg = config(zero8=FULL8)
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}
    engine, _, _, _ = engine_for(cfg)
    train_engine(engine, DATA, 2, B)
    engine.save_checkpoint(tmp_path, client_state={"epoch": 3, "rng": torch.tensor([1, 2]), "global_samples": -1})
    saved = torch.load(tmp_path / "global_step2" / MODEL_STATES_FILE, weights_only=False)
    e2, _, _, _ = engine_for(cfg, seed=5)
    _, client = e2.load_checkpoint(tmp_path, **kw)
    assert list(client) == [k for k in saved if k not in consumed]
    assert client["epoch"] == 3 and torch.equal(client["rng"], torch.tensor([1, 2])) and client["global_samples"] == -1
    assert client["ds_config"] == engine.config and client["buffer_names"] == []
    if kw.get("load_module_only"):
        assert client["global_steps"] == 2 and client["dp_world_size"] == 1 and e2.global_steps == 0
    if "lr_scheduler" not in consumed:
        assert client["lr_scheduler"] == engine.lr_scheduler.state_dict()


def test_an_empty_tag_is_refused_naming_what_to_pass(tmp_path):
    # DeepSpeed's tag="" saves into save_dir itself (and loads from load_dir itself); zero8 used to read it
    # as the default tag, saving global_step<N> and loading the latest, without a word.
    engine, model, _, _ = engine_for(config(zero8=FULL8))
    train_engine(engine, DATA, 1, B)
    with pytest.raises(zero8.Zero8ValueError, match=r"save_checkpoint: tag='' means save_dir itself in DeepSpeed.*"
                                                    r"pass tag=None for global_step<N>"):
        engine.save_checkpoint(tmp_path, tag="")
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
    engine.save_checkpoint(tmp_path)
    before = clone_params(model)
    train_engine(engine, DATA, 1, B)
    moved = clone_params(model)
    with pytest.raises(zero8.Zero8ValueError, match=r"load_checkpoint: tag='' means load_dir itself in DeepSpeed.*"
                                                    r"pass tag=None for the tag 'latest' names"):
        engine.load_checkpoint(tmp_path, tag="")
    assert all(torch.equal(a, b) for a, b in zip(moved, model.parameters())) and engine.global_steps == 2
    engine.load_checkpoint(tmp_path, tag=None)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and engine.global_steps == 1


def test_load_module_only(tmp_path):
    engine, model, _, _ = engine_for(config(zero8=EXACT))
    train_engine(engine, DATA, 3, B)
    engine.save_checkpoint(tmp_path)
    e2, m2, _, _ = engine_for(config(zero8=EXACT), seed=3)
    e2.load_checkpoint(tmp_path, load_optimizer_states=False, load_module_only=True)
    assert params_equal(model, m2) and e2.global_steps == 0
    # The masters follow the loaded weights: one more step moves from them, not from the old init.
    train_engine(e2, DATA, 1, B)
    assert max_param_diff(model, m2) < 0.01


# ---- statistics, data, module surface ----

def test_stats_and_dataloader():
    x, y = DATA
    dataset = torch.utils.data.TensorDataset(x, y)
    model = make_model()
    engine, _, loader, _ = zero8.initialize(model=model, config=config(gas=2, zero8=FULL8), training_data=dataset)
    assert loader is not None and len(next(iter(loader))[0]) == B // 2
    for i, (xb, yb) in enumerate(loader):
        engine.backward(loss_fn(engine(xb), yb))
        engine.step()
        if i == 3:
            break
    c = engine.comm_stats()
    # One process sends nothing, so it quantizes nothing (test_one_rank_int8_communication_is_exact).
    assert c["world"] == 1 and c["bytes"] == 0 and not c["int8_gradients"] and not c["int8_params"]
    assert "all_to_all_v" in c["ops"] or "all_to_all" in c["ops"] or "reduce_scatter" in c["ops"]
    m = engine.memory_stats()
    assert m["working"] >= 4 * m["params"]
    assert m["total"] == sum(m[k] for k in ("working", "grads", "master", "state", "buffers"))
    assert engine.local_rank == 0 and engine.global_rank == 0 and engine.world_size == 1 and engine.dp_world_size == 1


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2])
def test_one_rank_int8_communication_is_exact(stage, dtype, capsys):
    # One data-parallel rank sends nothing, so it quantizes nothing (sharded.h, WirePlan): the full int8
    # configuration, with error feedback and stochastic rounding, trains bit for bit as with int8
    # communication off (8-bit states both), holds no int8 scratch and no residual, and says so.
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    int8 = {**FULL8, "error_feedback": True, "stochastic_rounding": True, "seed": 5}
    off = {**FULL8, "int8_gradients": False, "int8_params": False}
    runs = []
    for z in (int8, off):
        engine, _, _, _ = engine_for(config(gas=2, stage=stage, zero8=z, bf16={"enabled": dtype == "bf16"}))
        losses = train_engine(engine, DATA, 4, B, dtype=torch_dtype)
        runs.append((engine_dump(engine), losses, engine.comm_stats(), engine.memory_stats()))
        engine.destroy()
    (d8, l8, c8, m8), (d32, l32, _, m32) = runs
    assert dump_diff(d8, d32) == [] and l8 == l32
    assert not c8["int8_gradients"] and not c8["int8_params"] and c8["bytes"] == 0
    assert m8["buffers"] == m32["buffers"] and d8["parts"][(0, "residual")] == b""
    out = capsys.readouterr().out
    assert out.count("one data-parallel rank: nothing on the wire, gradients and parameters exact") == 2, out
    assert "on the wire: int8" not in out


def test_deepspeed_io_takes_deepspeed_arguments():
    # DeepSpeed's deepspeed_io(dataset, batch_size, route, pin_memory, data_sampler, collate_fn,
    # num_local_io_workers): positional route "eval" was taken for the collate_fn, route= and pin_memory=
    # were refused. Eval and predict read each rank's share in order, train shuffles; collate_fn and
    # dataloader_drop_last default to initialize's.
    dataset = torch.utils.data.TensorDataset(torch.arange(5.0))
    seen = []

    def collate(rows):
        seen.append(len(rows))
        return torch.stack([r[0] for r in rows])

    engine, _, _, _ = zero8.initialize(model=make_model(), config=config(zero8=EXACT), collate_fn=collate)
    for route in ("eval", "predict"):
        loader = engine.deepspeed_io(dataset, 2, route, True, None, None, 0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "pin_memory ... no accelerator" warning at each iteration
            assert [b.tolist() for b in loader] == [[0.0, 1.0], [2.0, 3.0], [4.0]]
        assert seen == [2, 2, 1] and not loader.sampler.shuffle
        seen.clear()
    train = engine.deepspeed_io(dataset, route="train", pin_memory=False, num_local_io_workers=None)
    assert train.sampler.shuffle and train.batch_size == B and train.num_workers == 0
    assert sorted(x for b in train for x in b.tolist()) == [0.0, 1.0, 2.0, 3.0, 4.0]
    with pytest.raises(zero8.Zero8ValueError, match=r"deepspeed_io: route 'test' is not one of DeepSpeed's routes"):
        engine.deepspeed_io(dataset, 2, "test")
    engine, _, _, _ = zero8.initialize(model=make_model(), config=config(zero8=EXACT, dataloader_drop_last=True))
    assert engine.dataloader_drop_last()
    assert [b[0].tolist() for b in engine.deepspeed_io(dataset, 2, "eval")] == [[0.0, 1.0], [2.0, 3.0]]


class _Mpu:
    """Megatron's parallel_state as DeepSpeed's mpu argument sees it (sizes only)."""

    def __init__(self, tensor=1, pipeline=1, data=1, old_names=False):
        name = "get_model_parallel_world_size" if old_names else "get_tensor_model_parallel_world_size"
        setattr(self, name, lambda: tensor)
        self.get_pipeline_model_parallel_world_size = lambda: pipeline
        self.get_data_parallel_world_size = lambda: data


def test_an_mpu_of_data_parallelism_alone_is_accepted_and_any_other_named():
    """Megatron-DeepSpeed passes its parallel_state as mpu even with tensor and pipeline size 1: then every
    rank is a data-parallel rank and the engine trains as without it; other sizes are refused by name."""
    ref, m_ref, _, _ = engine_for(config(zero8=EXACT))
    for mpu in (_Mpu(), _Mpu(old_names=True)):
        engine, _, _, _ = zero8.initialize(model=make_model(), config=config(zero8=EXACT), mpu=mpu)
        train_engine(engine, DATA, 3, 32)
        assert engine.dp_world_size == 1
    train_engine(ref, DATA, 3, 32)
    assert params_equal(engine.module, m_ref)
    for mpu, match in ((_Mpu(tensor=2), "tensor-parallel size 2 and pipeline size 1"),
                       (_Mpu(pipeline=4), "tensor-parallel size 1 and pipeline size 4"),
                       (object(), "has no get_tensor_model_parallel_world_size")):
        with pytest.raises(zero8.Zero8NotSupportedError, match=match):
            zero8.initialize(model=make_model(), config=config(zero8=EXACT), mpu=mpu)
    with pytest.raises(zero8.Zero8ValueError, match="mpu reports data-parallel size 2, but zero8's world has 1"):
        zero8.initialize(model=make_model(), config=config(zero8=EXACT), mpu=_Mpu(data=2))
    with pytest.raises(zero8.Zero8NotSupportedError, match="mesh_param"):
        zero8.initialize(model=make_model(), config=config(zero8=EXACT), mesh_param=(1, 2))


def test_no_sync_and_pipeline_methods_say_what_to_do_instead():
    # They raised a bare AttributeError (the module has no such attribute).
    engine, _, _, _ = engine_for(config(zero8=EXACT))
    with pytest.raises(zero8.Zero8NotSupportedError, match=r"engine\.no_sync\(\): not supported.*"
                                                           r"gradient_accumulation_steps"):
        with engine.no_sync():
            pass
    with pytest.raises(zero8.Zero8NotSupportedError, match=r"engine\.train_batch\(\): DeepSpeed's PipelineEngine.*"
                                                           r"engine\.backward\(loss\); engine\.step\(\)"):
        engine.train_batch(iter([]))
    with pytest.raises(zero8.Zero8NotSupportedError, match=r"engine\.eval_batch\(\): .*zero8\.pipe\.PipelineModule.*"
                                                           r"torch\.no_grad\(\)"):
        engine.eval_batch(data_iter=iter([]))


def test_module_surface_and_progress_print(capsys):
    cfg = config(zero8=EXACT, steps_per_print=2)
    engine, model, _, _ = engine_for(cfg)
    assert engine.module is model and isinstance(engine, torch.nn.Module)
    engine.eval()
    assert not model.training
    engine.train()
    assert model.training
    model.custom_attr = 5
    assert engine.custom_attr == 5  # unknown attributes fall through to the module, as in DeepSpeed
    train_engine(engine, DATA, 4, B)
    out = capsys.readouterr().out
    assert "step=2," in out and "step=4," in out and "step=3," not in out and "grad_norm=" in out


def test_infinite_steps_per_print_never_reports(capsys):
    # Hugging Face Accelerate sets steps_per_print = float("inf") in the config dict it hands DeepSpeed, which
    # then never reports; zero8 refused the dict ("not JSON-serializable: Out of range float values").
    engine, _, _, _ = engine_for(config(zero8=EXACT, steps_per_print=float("inf")))
    assert engine.steps_per_print() == 2**63 - 1
    train_engine(engine, DATA, 3, B)
    assert "step=" not in capsys.readouterr().out


def test_compute_grad_norm_false_gives_no_grad_norm():
    # DeepSpeed's zero_optimization.compute_grad_norm: false leaves get_global_grad_norm() None (zero8 refused
    # the key as unknown). The step itself is the same.
    def run(compute):
        engine, model, _, _ = engine_for(config(zero8=EXACT, zero_optimization={"stage": 2,
                                                                                "compute_grad_norm": compute}))
        train_engine(engine, DATA, 2, B)
        return engine.get_global_grad_norm(), model

    off, model_off = run(False)
    on, model_on = run(True)
    assert off is None and on > 0 and params_equal(model_off, model_on)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_engine_zero_grad_keeps_the_accumulated_gradients(set_to_none):
    # A torch habit kept in a DeepSpeed loop: engine.zero_grad() before every micro-batch. DeepSpeed's
    # accumulated gradients live in its optimizer, out of zero_grad's reach. zero8's stage 1 accumulates
    # fp32 gradients in param.grad (a view of its buffer); zeroing it in place used to drop the earlier
    # micro-batches of the accumulation without a word.
    def run(zero_grad):
        body, spare = make_model(), torch.nn.Linear(2, 2)  # spare: trainable, but not given to the engine
        model = torch.nn.ModuleDict({"body": body, "spare": spare})
        model.forward = body.forward
        engine, _, _, _ = zero8.initialize(model=model, model_parameters=body.parameters(),
                                           config=config(gas=2, stage=1, zero8=EXACT))
        for s in range(3):
            for k in range(2):
                x, y = global_batch(DATA, 2 * s + k, B // 2)
                if zero_grad:
                    spare(torch.ones(2)).sum().backward()
                    engine.zero_grad(set_to_none=set_to_none)
                    assert spare.weight.grad is None if set_to_none else torch.count_nonzero(spare.weight.grad) == 0
                engine.backward(loss_fn(engine(x), y))
                engine.step()
        return body

    assert params_equal(run(False), run(True))


def test_wall_clock_breakdown_prints_times(capsys):
    engine, _, _, _ = engine_for(config(zero8=EXACT, steps_per_print=2, wall_clock_breakdown=True))
    train_engine(engine, DATA, 4, B)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "time (ms)" in ln]
    assert len(lines) == 2 and all("forward:" in ln and "backward:" in ln and "optimizer step:" in ln
                                   for ln in lines), lines
    engine, _, _, _ = engine_for(config(zero8=EXACT, steps_per_print=2))
    train_engine(engine, DATA, 2, B)
    assert "time (ms)" not in capsys.readouterr().out


def test_ignore_unused_parameters_false_names_the_parameter():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.spare = make_model(), torch.nn.Linear(3, 3)

        def forward(self, x):
            return self.body(x)

    for ignore in (True, False):
        cfg = config(zero8=EXACT)
        cfg["zero_optimization"]["ignore_unused_parameters"] = ignore
        engine, _, _, _ = zero8.initialize(model=Net(), config=cfg)
        x, y = global_batch(DATA, 0, B)
        if ignore:
            engine.backward(loss_fn(engine(x), y))
            engine.step()
            assert engine.global_steps == 1
        else:
            with pytest.raises(RuntimeError, match=r"2 trainable parameter\(s\) got no gradient.*spare\.weight, "
                                                   r"spare\.bias.*ignore_unused_parameters"):
                engine.backward(loss_fn(engine(x), y))


class _SharedLayerNet(torch.nn.Module):
    """ALBERT's pattern: one layer applied `uses` times, each application under reentrant activation
    checkpointing (each runs a backward of its own, so the shared weight's gradient arrives in `uses`
    parts); uses=0 applies it once without checkpointing."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.shared, self.out = torch.nn.Linear(16, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)
        self.uses = 3

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x)
        if self.uses == 0:
            return self.out(torch.tanh(self.shared(h)))
        for _ in range(self.uses):
            h = checkpoint(lambda t: torch.tanh(self.shared(t)), h, use_reentrant=True)
        return self.out(h)


@pytest.mark.parametrize("bucket", [1000, 10**8])
def test_stage2_reentrant_checkpointing_of_a_shared_weight_matches_torch(bucket):
    # The audit's ALBERT case: stage 2 reduced the shared weight's bucket at the first of its three
    # gradient parts, and the other two were lost (0.005 off after one SGD step, no warning). The first
    # backward now counts the parts (the shared weight is not in the loss's graph) and reduces at its end;
    # later ones report the weight at its third part, and reduce the other buckets during backward.
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": bucket}, "zero8": EXACT, "gradient_clipping": 0}
    engine, _, _, _ = zero8.initialize(model=_SharedLayerNet(), config=cfg)
    ref = _SharedLayerNet()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    reduced_during = []
    engine.module.inp.weight.register_post_accumulate_grad_hook(
        lambda p: reduced_during.append(engine._opt.param_reduced(engine._param_names.index("shared.weight"))))
    for step in range(4):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        y = torch.randn(4, 4, generator=torch.Generator().manual_seed(100 + step))
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
        for (name, a), b in zip(engine.module.named_parameters(), ref.parameters()):
            assert (a - b).abs().max().item() < 1e-6, (step, name)
    expected = dict(zip(engine._param_names, engine._expected))
    assert expected["shared.weight"] == 3 and expected["inp.weight"] == 1
    if bucket == 1000:  # shared's own buckets: reduced before inp's gradient arrives, after the first step
        assert reduced_during == [False, True, True, True]


def test_stage2_a_gradient_part_after_its_bucket_was_reduced_raises():
    # One use in the first backward (every weight in the graph: reported at once), then three reentrant
    # parts: the first part completes the shared weight's buckets, which are reduced, and the second would
    # be lost. Never silently: the error names the weight; the next backwards wait for three parts.
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000}, "zero8": EXACT}
    model = _SharedLayerNet()
    model.uses = 0
    engine, _, _, _ = zero8.initialize(model=model, config=cfg)
    x, y = torch.randn(4, 16), torch.randn(4, 4)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    model.uses = 3
    with pytest.raises(RuntimeError, match=r"rank 0: parameter 'shared\.(weight|bias)' got a part of its gradient "
                                           r"\(2 parts in this backward, at most 1 before\) after ZeRO stage 2 had "
                                           r"reduced it.*Use stage 1, or torch.utils.checkpoint with use_reentrant=False"):
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))


def test_wire_keys_reach_the_sharded_optimizer():
    # communication_data_type (unquantized gradients) and zero8.stochastic_rounding / seed (int8 blocks on
    # the wire); the byte counts and draws themselves are checked with several ranks (dist_engine.py,
    # tests/dist/test_sharded.cpp).
    def shard(cfg):
        engine, _, _, _ = engine_for(cfg)
        return engine._shard_config

    off = {"int8_gradients": False}
    assert not shard(config(zero8=off)).bf16_grads
    assert shard(config(zero8=off, communication_data_type="bf16")).bf16_grads
    assert shard(config(zero8=off, bf16={"enabled": True})).bf16_grads  # null: the training dtype
    assert not shard(config(zero8=off, bf16={"enabled": True}, communication_data_type="fp32")).bf16_grads
    with pytest.warns(Zero8ConfigWarning, match="communication_data_type: zero8 has no fp16 wire format"):
        assert not shard(config(zero8=off, communication_data_type="fp16")).bf16_grads
    sc = shard(config(zero8=dict(FULL8, stochastic_rounding=True, seed=12345)))
    assert sc.stochastic_wire and sc.wire_seed == 12345
    assert not shard(config(zero8=FULL8)).stochastic_wire
    with pytest.warns(Zero8ConfigWarning, match="zero8.stochastic_rounding: has no effect without int8_gradients"):
        shard(config(zero8=dict(EXACT, stochastic_rounding=True)))


# ---- configs ----

def _bad_configs():
    rows = []
    for line in (Path(__file__).parents[1] / "data" / "configs" / "bad" / "expected.tsv").read_text().splitlines():
        if line and not line.startswith("#"):
            name, world, code, msg = line.split("\t")
            rows.append(pytest.param(name, int(world), code, msg, id=name))
    return rows


@pytest.mark.parametrize("name,world,code,message", _bad_configs())
def test_malformed_config_raises_with_key_path(data_dir, name, world, code, message):
    exc = {"invalid_argument": zero8.Zero8ValueError, "unsupported": zero8.Zero8NotSupportedError}[code]
    path = data_dir / "configs" / "bad" / name
    with pytest.raises(exc) as info:
        load_config(str(path), world)
    assert message in str(info.value)
    if exc is zero8.Zero8ValueError:
        assert isinstance(info.value, ValueError)


def test_bad_config_through_initialize(data_dir):
    with pytest.raises(ValueError, match=r"optimizer\.params\.betas\[1\]"):
        zero8.initialize(model=make_model(), config=str(data_dir / "configs" / "bad" / "betas_out_of_range.json"))
    bad = config(zero8={"state_block_size": 100})
    with pytest.raises(zero8.Zero8ValueError, match=r"<config dict>: zero8\.state_block_size"):
        zero8.initialize(model=make_model(), config=bad)


def test_config_values_json_cannot_hold_name_their_key():
    cfg = config(zero8=EXACT)
    cfg["optimizer"]["params"]["lr"] = float("nan")
    with pytest.raises(zero8.Zero8ValueError, match=r"<config dict>: optimizer\.params\.lr: not JSON-serializable"):
        zero8.initialize(model=make_model(), config=cfg)
    with pytest.raises(zero8.Zero8ValueError, match=r"<config text>: malformed JSON: number overflow parsing '1e999'"):
        zero8.initialize(model=make_model(), config='{"train_batch_size": 32, "gradient_clipping": 1e999}')
    with pytest.raises(zero8.Zero8ValueError, match=r"<config text>: the config must be a JSON object"):
        zero8.initialize(model=make_model(), config="[1, 2]")


def test_keys_read_before_the_parse_allow_comments(tmp_path):
    # dataloader_drop_last and zero8.comm_backend are read before the config is parsed; a config file
    # with comments (which the parser accepts) must not lose them.
    path = tmp_path / "ds.json"
    path.write_text('{\n  // a comment\n  "train_micro_batch_size_per_gpu": 4, "dataloader_drop_last": true,\n'
                    '  "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, /* another */ "zero8": {}\n}\n')
    assert zero8.config.raw_value(str(path), "dataloader_drop_last") is True
    assert zero8.config.raw_value(str(path), "zero8", "comm_backend", default="auto") == "auto"
    data = torch.utils.data.TensorDataset(torch.randn(10, 8), torch.randn(10, 1))
    _, _, loader, _ = zero8.initialize(model=make_model(), config=str(path), training_data=data)
    assert [len(b[0]) for b in loader] == [4, 4]


def test_comm_backend_nccl_for_a_cpu_model_is_refused_naming_the_key():
    # A CPU model's buffers are host memory; NCCL takes device buffers only, so "nccl" is refused before any
    # communicator is made (NCCL set-up would need a GPU). The config parser takes it: the config does not
    # know where the model is (a GPU model trains over NCCL, test_engine_cuda.py).
    for value in ("nccl", "NCCL"):
        with pytest.raises(zero8.Zero8NotSupportedError,
                           match=r'zero8\.comm_backend: "nccl" needs a model on a GPU, and this one is on cpu: NCCL '
                                 r'takes device buffers only; use "auto", "mpi" or "single" for a CPU model'):
            zero8.initialize(model=make_model(), config=config(zero8={"comm_backend": value}))
    assert zero8.config.load_config(config(zero8={"comm_backend": "nccl"}), 1).typed.zero8.comm_backend == \
        zero8._C.CommBackend.nccl


def test_model_parameters_and_dtypes_are_checked():
    model = make_model()
    with pytest.raises(TypeError, match="got one tensor"):
        zero8.initialize(model=model, model_parameters=model[0].weight, config=config(zero8=EXACT))
    with pytest.raises(zero8.Zero8ValueError, match=r"model_parameters\[1\]: a param group without 'params'"):
        zero8.initialize(model=model, model_parameters=[{"params": [model[0].weight]}, {"weight_decay": 0.0}],
                         config=config(zero8=EXACT))
    with pytest.raises(zero8.Zero8NotSupportedError, match=r"parameter 0\.weight is torch\.float64"):
        zero8.initialize(model=make_model().double(), config=config(zero8=EXACT))
    with pytest.warns(UserWarning, match=r"parameter\(s\) in 16 bits \(first: 0\.weight\) are trained in float32"):
        zero8.initialize(model=make_model().bfloat16(), config=config(zero8=EXACT))


def test_a_parameter_in_two_param_groups_is_an_error():
    # torch.optim (and so DeepSpeed) refuses a parameter in two param groups; it was kept in the first one,
    # silently training the bias with weight decay. A parameter listed twice in one group trains once, with
    # a warning, as torch warns.
    model = make_model()
    groups = [{"params": list(model.parameters()), "weight_decay": 0.1},
              {"params": [model[4].bias], "weight_decay": 0.0}]
    with pytest.raises(ValueError, match="more than one parameter group"):
        torch.optim.AdamW(groups)
    both = r"model_parameters\[0\] and model_parameters\[1\]: parameter '4\.bias' is in both \(param groups 0 and 1\)"
    with pytest.raises(zero8.Zero8ValueError, match=both):
        zero8.initialize(model=model, model_parameters=groups, config=config(zero8=EXACT))
    mixed = [model[0].weight, {"params": [model[2].weight]}, {"params": [model[0].weight]}]  # the bare ones: a group
    with pytest.raises(zero8.Zero8ValueError, match=r"model_parameters\[0\] and model_parameters\[2\]: parameter "
                                                    r"'0\.weight' is in both"):
        zero8.initialize(model=model, model_parameters=mixed, config=config(zero8=EXACT))
    params = list(model.parameters())
    with pytest.warns(UserWarning, match=r"param group 0 lists parameter '0\.weight' more than once; it is trained"):
        engine, _, _, _ = zero8.initialize(model=model, model_parameters=params + params[:1],
                                           config=config(zero8=EXACT))
    assert engine.memory_stats()["params"] == sum(p.numel() for p in params)


def test_config_from_args_or_config_not_both(tmp_path):
    # DeepSpeed reads args.deepspeed_config (a path) when config= is not given, and refuses both at once;
    # zero8 used to take config= and ignore the file without a word.
    import argparse

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config(gas=2, zero8=EXACT)))
    engine, _, _, _ = zero8.initialize(args=argparse.Namespace(deepspeed_config=str(path), local_rank=0),
                                       model=make_model())
    assert engine.gradient_accumulation_steps() == 2
    with pytest.raises(zero8.Zero8ValueError, match=r"both config= and args\.deepspeed_config"):
        zero8.initialize(args=argparse.Namespace(deepspeed_config=str(path)), model=make_model(),
                         config=config(zero8=EXACT))


def test_init_distributed_without_a_backend_means_the_gpus_world_where_there_is_a_gpu(monkeypatch):
    """deepspeed.init_distributed()'s dist_backend=None is the accelerator's backend (NCCL on GPUs): zero8 makes
    the world of GPU models for it, as for "nccl", where a GPU is; "gloo" keeps the host world, and so does None
    without a GPU. (What the GPU world is, NCCL or staging, is world_comm's, tested in test_engine_cuda.py.)"""
    import zero8.engine.entry as entry
    asked = []
    monkeypatch.setattr(entry, "world_comm", lambda backend, device=None: asked.append((backend, device)))
    monkeypatch.setattr(entry, "local_device", lambda: torch.device("cuda", 0))
    for gpu, backend in ((True, None), (True, "nccl"), (True, "NCCL"), (True, "gloo"), (False, None),
                         (False, "nccl")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda gpu=gpu: gpu)
        entry.init_distributed(dist_backend=backend)
    cuda = ("auto", torch.device("cuda", 0))
    assert asked == [cuda, cuda, cuda, ("auto", None), ("auto", None), ("auto", None)]


def test_deepspeed_script_entry_points(tmp_path):
    # A DeepSpeed script's set-up: add_config_arguments on its parser, init_distributed, then
    # initialize(args=...) reading --deepspeed_config.
    import argparse

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config(gas=2, zero8=EXACT)))
    parser = zero8.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    assert args.deepspeed is True and args.deepspeed_config == str(path)
    assert parser.parse_args([]).deepspeed_config is None
    comm = zero8.init_distributed(dist_backend="nccl")  # DeepSpeed's arguments are accepted
    assert comm is zero8.init_distributed() and (comm.rank, comm.size) == (0, 1)
    engine, _, _, _ = zero8.initialize(args=args, model=make_model())
    assert engine.gradient_accumulation_steps() == 2 and engine.global_rank == comm.rank
    assert {"initialize", "add_config_arguments", "init_distributed"} <= set(dir(zero8))


def test_the_engine_package_keeps_the_names_of_the_engine_module():
    # zero8.engine was one module; its public names stay where scripts import them from.
    import zero8.engine as eng

    names = set(eng.__all__) | {"add_config_arguments", "init_distributed", "ROUTE_TRAIN", "ROUTE_EVAL",
                                "ROUTE_PREDICT", "ROUTE_ENCODE"}
    assert set(eng.__all__) == {"initialize", "Zero8Engine", "PipelineEngine", "Zero8Optimizer", "MODEL_STATES_FILE",
                                "world_comm"}
    assert all(hasattr(eng, n) for n in names)
    assert (zero8.initialize, zero8.init_distributed, zero8.add_config_arguments) == (
        eng.initialize, eng.init_distributed, eng.add_config_arguments)
    assert (eng.MODEL_STATES_FILE, eng.ROUTE_TRAIN, eng.ROUTE_EVAL) == ("mp_rank_00_model_states.pt", "train", "eval")


def test_the_engine_reads_the_typed_config():
    # Every accessor from the C++ parse's typed view (zero8_config.typed), the dict kept as engine.config.
    cfg = config(batch=8, gas=2, stage=1, zero8=EXACT, steps_per_print=7, gradient_clipping=0.5,
                 zero_optimization={"stage": 1, "ignore_unused_parameters": False})
    engine, _, _, _ = zero8.initialize(model=make_model(), config=cfg)
    typed = engine.zero8_config.typed
    assert isinstance(typed, zero8._C.Config) and engine.config == json.loads(typed.to_json())
    assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(),
            engine.zero_optimization_stage(), engine.steps_per_print(), engine.gradient_clipping()) == (
            8, 4, 2, 1, 7, 0.5)
    assert not (engine.fp16_enabled() or engine.bfloat16_enabled()) and engine.get_data_types()[0] == torch.float32
    with pytest.raises(RuntimeError, match="ignore_unused_parameters false"):  # zero.ignore_unused_parameters
        engine.backward(engine.module[0].bias.sum())  # the other parameters get no gradient


def test_unknown_keys_warn_at_the_top_and_fail_in_sections():
    cfg = config(zero8=EXACT, my_custom_key=1)
    with pytest.warns(Zero8ConfigWarning) as rec:
        zero8.initialize(model=make_model(), config=cfg)
    msgs = [str(w.message) for w in rec]
    assert any("my_custom_key: unknown key" in m for m in msgs)
    # Inside a section zero8 reads (DeepSpeed's own models refuse them too), and a misspelt section.
    cfg = config(zero8=EXACT)
    cfg["zero_optimization"]["bogus_knob"] = True
    with pytest.raises(zero8.Zero8ValueError, match=r"<config dict>: zero_optimization.bogus_knob: unknown key"):
        zero8.initialize(model=make_model(), config=cfg)
    cfg = config(zer08=EXACT)
    with pytest.raises(zero8.Zero8ValueError, match=r'<config dict>: zer08: unknown top-level key; did you mean "zero8"\?'):
        zero8.initialize(model=make_model(), config=cfg)


def test_good_configs_from_files_initialize(data_dir):
    # The DeepSpeed example configs in tests/data/configs build an engine as they are (world size 1),
    # except that one asks for the MPI backend, which this process (world: single) cannot switch to.
    for path in sorted((data_dir / "configs").glob("*.json")):
        cfg = load_config(str(path), 1, warn=False)
        source = str(path)
        if cfg.dict["zero8"].get("comm_backend", "auto") != "auto":
            source = json.loads(path.read_text())
            source["zero8"]["comm_backend"] = "auto"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Zero8ConfigWarning)  # e.g. "auto" values: tested in C++
            engine, _, _, _ = zero8.initialize(model=make_model(), config=source)
        assert engine.train_batch_size() == cfg.train_batch_size(), path
        assert engine.fp16_enabled() == cfg.dict["fp16"]["enabled"]
