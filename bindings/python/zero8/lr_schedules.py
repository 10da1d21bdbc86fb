"""DeepSpeed's learning-rate schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest) as
torch-scheduler-like objects. The schedule itself is computed in C++ (``_C.Scheduler``, the same code the
config parser validates), so the engine's config scheduler, these classes and DeepSpeed agree; this file
only keeps the position and writes lr (and OneCycle's betas) into the optimizer's param groups.

Position semantics are DeepSpeed's: ``last_batch_iteration`` is -1 at construction (the optimizer gets
the schedule's initial lr) and +1 per ``step()``; the engine steps the scheduler after every applied
(not skipped) optimizer step.
"""

from __future__ import annotations

import json
from typing import Any

from . import _C

__all__ = [
    "Zero8LRScheduler",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "OneCycle",
    "LRRangeTest",
    "scheduler_from_config",
]

_ONE_CYCLE_BETA2 = 0.99  # DeepSpeed's OneCycle sets betas = (momentum, 0.99)


class Zero8LRScheduler:
    """A schedule (``_C.Scheduler``) driving an optimizer's param groups.

    Methods as torch's LRScheduler and DeepSpeed's schedulers: ``step(last_batch_iteration=None)``,
    ``get_lr()``, ``get_last_lr()``, ``state_dict()`` (``{'last_batch_iteration': i}``, DeepSpeed's
    format) and ``load_state_dict()``, which also re-applies the lr of the restored position.
    """

    def __init__(self, optimizer, schedule: "_C.Scheduler", last_batch_iteration: int = -1):
        self.optimizer = optimizer
        self.schedule = schedule
        self.last_batch_iteration = int(last_batch_iteration)
        self._last_lr: list[float] = []
        self._apply()

    @property
    def type(self) -> str:
        return self.schedule.type

    def get_lr(self) -> list[float]:
        lr = float(self.schedule.lr_at(self.last_batch_iteration))
        return [lr for _ in self.optimizer.param_groups]

    def get_mom(self) -> list[Any] | None:
        """OneCycle's (beta1, 0.99) per group when it cycles momentum, else None."""
        if not self.schedule.momentum_cycled:
            return None
        m = float(self.schedule.momentum_at(self.last_batch_iteration))
        return [(m, _ONE_CYCLE_BETA2) for _ in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def _apply(self) -> None:
        lrs = self.get_lr()
        moms = self.get_mom()
        if moms is not None and not 0.0 <= moms[0][0] < 1.0:
            raise _C.Zero8ValueError(
                f"{self.type}: scheduler step {self.last_batch_iteration} sets beta1 (momentum) to {moms[0][0]:.6g}, "
                "outside [0, 1): after the cycle momentum is cycle_max_mom * (1 + decay_mom_rate * k) for the k-th "
                "decay interval, without a bound; set scheduler.params.decay_mom_rate to 0 (momentum stays at "
                "cycle_max_mom) or small enough for the run's length")
        for i, group in enumerate(self.optimizer.param_groups):
            group["lr"] = lrs[i]
            if moms is not None:
                if "betas" in group:
                    group["betas"] = moms[i]
                elif "momentum" in group:
                    group["momentum"] = moms[i][0]
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def step(self, last_batch_iteration: int | None = None) -> None:
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = int(last_batch_iteration)
        self._apply()

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict) -> None:
        self.last_batch_iteration = int(sd["last_batch_iteration"])
        self._apply()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(type={self.type!r}, last_batch_iteration={self.last_batch_iteration})"


def scheduler_from_config(optimizer, config_json: "str | _C.Config", world_size: int = 0,
                          base_lr: float | None = None):
    """The scheduler of a config's "scheduler" section, or None when it has none. ``config_json``: a typed
    config (``_C.Config``, as ``zero8.config.Zero8Config.typed``), or a normalized config's JSON text for
    the data-parallel size ``world_size``. ``base_lr``: the client optimizer's lr when the config has no
    optimizer section (as DeepSpeed reads it)."""
    if isinstance(config_json, _C.Config):
        if config_json.scheduler.type == _C.SchedulerType.none:
            return None
        return Zero8LRScheduler(optimizer, _C.Scheduler(config_json.scheduler, base_lr=base_lr))
    sched = json.loads(config_json).get("scheduler")
    if not isinstance(sched, dict) or not sched.get("type"):
        return None
    schedule = _C.Scheduler(config_json, base_lr=base_lr, world_size=world_size)
    return Zero8LRScheduler(optimizer, schedule)


def _optimizer_section(optimizer, lr: float | None = None) -> dict:
    # OneCycle cycles beta1 for optimizers with betas (the C++ rule); an Adam section says "has betas".
    group = optimizer.param_groups[0]
    lr = float(group["lr"]) if lr is None else lr
    if "betas" in group:
        b1, b2 = group["betas"]
        return {"type": "Adam", "params": {"lr": lr, "betas": [float(b1), float(b2)]}}
    return {"type": "SGD", "params": {"lr": lr}}


def _build(optimizer, type_name: str, params: dict, base_lr: float | None = None) -> "_C.Scheduler":
    """The C++ schedule; base_lr: the optimizer lr the schedule scales (default: param group 0's)."""
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": _optimizer_section(optimizer, base_lr),
        "scheduler": {"type": type_name, "params": params},
    }
    normalized, _ = _C.config_parse(json.dumps(cfg), 1, f"zero8.lr_schedules.{type_name}")
    return _C.Scheduler(normalized, world_size=1)


class WarmupLR(Zero8LRScheduler):
    """deepspeed.runtime.lr_schedules.WarmupLR: from warmup_min_lr up to warmup_max_lr over
    warmup_num_steps (log or linear), then constant. warmup_max_lr None: param group 0's lr, as DeepSpeed
    (since its PR #7360; before, 0.001)."""

    def __init__(self, optimizer, warmup_min_lr: float = 0.0, warmup_max_lr: float | None = None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1):
        params = dict(warmup_min_lr=warmup_min_lr, warmup_num_steps=warmup_num_steps, warmup_type=warmup_type)
        if warmup_max_lr is not None:  # else the parser takes the optimizer section's lr (group 0's)
            params["warmup_max_lr"] = warmup_max_lr
        super().__init__(optimizer, _build(optimizer, "WarmupLR", params), last_batch_iteration)


class WarmupDecayLR(Zero8LRScheduler):
    """deepspeed.runtime.lr_schedules.WarmupDecayLR: WarmupLR, then linear decay to warmup_min_lr at
    total_num_steps."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_lr: float = 0.0, warmup_max_lr: float = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1):
        params = dict(total_num_steps=total_num_steps, warmup_min_lr=warmup_min_lr, warmup_max_lr=warmup_max_lr,
                      warmup_num_steps=warmup_num_steps, warmup_type=warmup_type)
        super().__init__(optimizer, _build(optimizer, "WarmupDecayLR", params),
                         last_batch_iteration)


class WarmupCosineLR(Zero8LRScheduler):
    """deepspeed.runtime.lr_schedules.WarmupCosineLR: a ratio of each param group's lr (as it was at
    construction), warmed up from warmup_min_ratio to 1, then cosine down to cos_min_ratio at
    total_num_steps."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0, warmup_num_steps: int = 1000,
                 cos_min_ratio: float = 0.0001, warmup_type: str = "log", last_batch_iteration: int = -1):
        params = dict(total_num_steps=total_num_steps, warmup_min_ratio=warmup_min_ratio,
                      warmup_num_steps=warmup_num_steps, cos_min_ratio=cos_min_ratio, warmup_type=warmup_type)
        # The schedule over a base lr of 1 is the ratio; every group scales its own lr by it, as DeepSpeed.
        self.org_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        super().__init__(optimizer, _build(optimizer, "WarmupCosineLR", params, base_lr=1.0),
                         last_batch_iteration)

    def get_lr(self) -> list[float]:
        ratio = float(self.schedule.lr_at(self.last_batch_iteration))
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(Zero8LRScheduler):
    """deepspeed.runtime.lr_schedules.OneCycle (1cycle policy, with beta1 cycling for optimizers with
    betas; beta2 is then 0.99 as in DeepSpeed)."""

    def __init__(self, optimizer, cycle_min_lr: float, cycle_max_lr: float, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: float = 0.8,
                 cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0, last_batch_iteration: int = -1):
        params = dict(cycle_min_lr=cycle_min_lr, cycle_max_lr=cycle_max_lr, decay_lr_rate=decay_lr_rate,
                      cycle_first_step_size=cycle_first_step_size, cycle_first_stair_count=cycle_first_stair_count,
                      decay_step_size=decay_step_size, cycle_momentum=cycle_momentum, cycle_min_mom=cycle_min_mom,
                      cycle_max_mom=cycle_max_mom, decay_mom_rate=decay_mom_rate)
        if cycle_second_step_size is not None:
            params["cycle_second_step_size"] = cycle_second_step_size
        if cycle_second_stair_count is not None:
            params["cycle_second_stair_count"] = cycle_second_stair_count
        super().__init__(optimizer, _build(optimizer, "OneCycle", params), last_batch_iteration)


class LRRangeTest(Zero8LRScheduler):
    """deepspeed.runtime.lr_schedules.LRRangeTest: lr growing from lr_range_test_min_lr."""

    def __init__(self, optimizer, lr_range_test_min_lr: float = 1e-3, lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False,
                 last_batch_iteration: int = -1):
        params = dict(lr_range_test_min_lr=lr_range_test_min_lr, lr_range_test_step_size=lr_range_test_step_size,
                      lr_range_test_step_rate=lr_range_test_step_rate, lr_range_test_staircase=lr_range_test_staircase)
        super().__init__(optimizer, _build(optimizer, "LRRangeTest", params),
                         last_batch_iteration)
