"""zero8's DeepSpeed config and schedule classes against DeepSpeed's documented behaviour, where the
Python layer decides it (the C++ parser's side is tests/cpp/test_config.cpp), and the monitor sections against
DeepSpeed's own parser (the test extra's deepspeed)."""

from __future__ import annotations

import json

import pytest
import torch


def test_warmup_lr_class_ramps_to_the_optimizer_lr_by_default():
    # DeepSpeed's WarmupLR takes warmup_max_lr from the optimizer's lr when it is not given (DeepSpeed
    # PR #7360), as zero8's config path does; the class used to ramp to 0.001 instead.
    from zero8.lr_schedules import WarmupLR

    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.05)
    s = WarmupLR(opt, warmup_num_steps=10, warmup_type="linear")
    assert opt.param_groups[0]["lr"] == 0.0  # t = -1: warmup_min_lr
    for _ in range(6):
        s.step()
    assert s.get_last_lr() == pytest.approx([0.05 * 5 / 10], rel=1e-12)
    for _ in range(10):
        s.step()
    assert s.get_last_lr() == pytest.approx([0.05], rel=1e-12)
    # An explicit maximum still wins.
    opt2 = torch.optim.SGD([p], lr=0.05)
    s2 = WarmupLR(opt2, warmup_max_lr=0.2, warmup_num_steps=10, warmup_type="linear")
    s2.step(15)
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.2, rel=1e-12)


@pytest.mark.parametrize("sections", [
    {},
    {"tensorboard": {"enabled": True}, "csv_monitor": {"enabled": False, "output_path": "csv/"}},
    {"tensorboard": {"output_path": "tb/", "job_name": "bert"}, "csv_monitor": {"enabled": True, "job_name": "j"},
     "wandb": {"enabled": True, "group": "g", "team": "t", "project": "p"}},
    {"wandb": {"group": None, "team": "auto", "project": "auto"}, "tensorboard": {"output_path": "auto"}},
])
def test_monitor_sections_read_as_deepspeed_reads_them(sections):
    # Every key of DeepSpeed's three monitor models, with its default, "auto" dropped as DeepSpeed drops it.
    pytest.importorskip("deepspeed", reason="the parity tests need the test extra (pip install .[test])")
    from deepspeed.monitor.config import get_monitor_config
    from zero8 import _C

    ds = get_monitor_config(sections)
    typed = _C.Config(json.dumps({"train_batch_size": 1, **sections}), 1)
    for key in ("tensorboard", "csv_monitor", "wandb"):
        want = getattr(ds, key).model_dump()
        assert {k: getattr(getattr(typed, key), k) for k in want} == want, key
    enabled = typed.tensorboard.enabled or typed.csv_monitor.enabled or typed.wandb.enabled
    assert enabled == ds.enabled


# Deliberate differences from DeepSpeed's defaults (docs/CONFIG.md says why, in bold): zero8 overlaps
# communication and reduces in buckets of 2^22 elements unless told otherwise, and reports progress every 10
# steps, where DeepSpeed 0.19.8 reports none by default.
_OWN_DEFAULTS = {"zero.overlap_comm", "zero.reduce_bucket_size", "steps_per_print"}


@pytest.mark.parametrize("cfg", [
    {"train_batch_size": 8},
    {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "fp16": {"enabled": True}},
    {"train_batch_size": 16, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}},
    {"train_batch_size": 16, "fp16": {"enabled": True, "loss_scale": 128, "hysteresis": 4},
     "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000, "overlap_comm": False},
     "gradient_clipping": 0.5, "prescale_gradients": True, "managed_gradient_accumulation": False},
])
def test_values_and_defaults_read_as_deepspeed_reads_them(cfg):
    """Every key zero8 and DeepSpeed both model, read from the same config by zero8's parser and by DeepSpeed's
    own (the pinned version), written or defaulted: a default DeepSpeed changes shows here (its gradient
    clipping went from off to 1.0 in its PR #8068, which zero8 followed)."""
    pytest.importorskip("deepspeed", reason="the parity tests need the test extra (pip install .[test])")
    from deepspeed.runtime.config import DeepSpeedConfig
    from zero8 import _C

    ds = DeepSpeedConfig(dict(cfg))
    z8 = _C.Config(json.dumps(cfg), 1)
    fp16 = ds.float16_config
    pairs = {
        "train_batch_size": (z8.batch.train_batch_size, ds.train_batch_size),
        "train_micro_batch_size_per_gpu": (z8.batch.train_micro_batch_size_per_gpu, ds.train_micro_batch_size_per_gpu),
        "gradient_accumulation_steps": (z8.batch.gradient_accumulation_steps, ds.gradient_accumulation_steps),
        "gradient_clipping": (z8.gradient_clipping, ds.gradient_clipping),
        "prescale_gradients": (z8.prescale_gradients, ds.prescale_gradients),
        "gradient_predivide_factor": (z8.gradient_predivide_factor, ds.gradient_predivide_factor),
        "wall_clock_breakdown": (z8.wall_clock_breakdown, ds.wall_clock_breakdown),
        "managed_gradient_accumulation": (z8.managed_gradient_accumulation, ds.managed_gradient_accumulation),
        "zero_allow_untested_optimizer": (z8.zero_allow_untested_optimizer, ds.zero_allow_untested_optimizer),
        "bf16.enabled": (z8.bf16.enabled, ds.bfloat16_config.enabled),
        "zero.stage": (z8.zero.stage, ds.zero_optimization_stage),
        "steps_per_print": (z8.steps_per_print, ds.steps_per_print),
    }
    for key in ("enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                "consecutive_hysteresis", "min_loss_scale"):
        pairs[f"fp16.{key}"] = (getattr(z8.fp16, key), getattr(fp16, key))
    for key in ("reduce_bucket_size", "allgather_bucket_size", "ignore_unused_parameters", "contiguous_gradients",
                "reduce_scatter", "allgather_partitions", "round_robin_gradients", "load_from_fp32_weights",
                "overlap_comm"):
        pairs[f"zero.{key}"] = (getattr(z8.zero, key), getattr(ds.zero_config, key))
    written = {k for k in pairs if k.split(".")[-1] in json.dumps(cfg)}
    differ = {k: v for k, v in pairs.items() if v[0] != v[1] and (k not in _OWN_DEFAULTS or k in written)}
    assert differ == {}, differ
