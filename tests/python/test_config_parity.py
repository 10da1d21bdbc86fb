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
