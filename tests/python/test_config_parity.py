"""zero8's DeepSpeed config and schedule classes against DeepSpeed's documented behaviour, where the
Python layer decides it (the C++ parser's side is tests/cpp/test_config.cpp)."""

from __future__ import annotations

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
