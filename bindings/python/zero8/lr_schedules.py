"""DeepSpeed's learning-rate schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest) as
torch-scheduler-like objects. The schedule itself is computed in C++ (``_C.Scheduler``, the same code the
config parser validates), so the engine's config scheduler, these classes and DeepSpeed agree; this file
only keeps the position and writes lr (and OneCycle's betas) into the optimizer's param groups.

Per param group as DeepSpeed: where its scheduler reads a group's own lr (WarmupCosineLR's base, WarmupLR's
top when warmup_max_lr is not given) or takes a list with one value per group (the classes' lr and momentum
bounds), each group runs its own C++ schedule; else one schedule sets the same values in every group.
OneCycle cycles momentum only for an optimizer whose defaults have betas, as DeepSpeed decides.

Position semantics are DeepSpeed's: ``last_batch_iteration`` is -1 at construction (the optimizer gets
the schedule's initial lr) and +1 per ``step()``; the engine steps the scheduler after every applied
(not skipped) optimizer step.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

from . import _C
from .config import Zero8ConfigWarning

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
# The constructor arguments DeepSpeed's classes take as a list with one value per param group (_format_param).
_PER_GROUP_PARAMS = ("warmup_min_lr", "warmup_max_lr", "cycle_min_lr", "cycle_max_lr", "cycle_min_mom",
                     "cycle_max_mom", "lr_range_test_min_lr")


def _torch_optimizer(optimizer):
    """The torch optimizer whose defaults DeepSpeed's OneCycle reads: a client optimizer's, when zero8's
    optimizer wraps one (as DeepSpeed's ZeRO optimizer wraps it), else ``optimizer`` itself."""
    client = getattr(optimizer, "client_optimizer", None)
    return client if client is not None else optimizer


class Zero8LRScheduler:
    """A schedule (``_C.Scheduler``) driving an optimizer's param groups.

    ``group_schedules``: one schedule per param group where the groups differ (None: ``schedule`` for every
    group). Methods as torch's LRScheduler and DeepSpeed's schedulers: ``step(last_batch_iteration=None)``,
    ``get_lr()``, ``get_last_lr()``, ``state_dict()`` (``{'last_batch_iteration': i}``, DeepSpeed's
    format) and ``load_state_dict()``, which also re-applies the lr of the restored position.
    """

    def __init__(self, optimizer, schedule: "_C.Scheduler", last_batch_iteration: int = -1,
                 group_schedules: "list[_C.Scheduler] | None" = None, warn: bool = True):
        self.optimizer = optimizer
        self.schedule = schedule
        self.group_schedules = None if group_schedules is None else list(group_schedules)
        # DeepSpeed's OneCycle turns momentum cycling off, with a warning, for an optimizer without betas (SGD's
        # momentum is never cycled); the C++ parse decides it only for a config's own optimizer section.
        self.cycle_momentum = bool(schedule.momentum_cycled)
        torch_optimizer = _torch_optimizer(optimizer)
        if self.cycle_momentum and "betas" not in getattr(torch_optimizer, "defaults", {}):  # DeepSpeed's test
            self.cycle_momentum = False
            if warn:
                name = type(torch_optimizer).__name__
                warnings.warn(f"{self.type}: cycle_momentum is disabled because optimizer {name} does not support "
                              "momentum, no betas attribute in defaults (DeepSpeed's warning; its momentum is "
                              "left as it is)", Zero8ConfigWarning, stacklevel=3)
        self.last_batch_iteration = int(last_batch_iteration)
        self._last_lr: list[float] = []
        self._apply()

    @property
    def type(self) -> str:
        return self.schedule.type

    def _schedules(self) -> "list[_C.Scheduler]":
        if self.group_schedules is not None:
            return self.group_schedules
        return [self.schedule] * len(self.optimizer.param_groups)

    def get_lr(self) -> list[float]:
        return [float(s.lr_at(self.last_batch_iteration)) for s in self._schedules()]

    def get_mom(self) -> list[Any] | None:
        """OneCycle's (beta1, 0.99) per group when it cycles momentum, else None."""
        if not self.cycle_momentum:
            return None
        return [(float(s.momentum_at(self.last_batch_iteration)), _ONE_CYCLE_BETA2) for s in self._schedules()]

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def _apply(self) -> None:
        lrs = self.get_lr()
        moms = self.get_mom()
        for m, _ in moms or []:
            if not 0.0 <= m < 1.0:
                raise _C.Zero8ValueError(
                    f"{self.type}: scheduler step {self.last_batch_iteration} sets beta1 (momentum) to {m:.6g}, "
                    "outside [0, 1): after the cycle momentum is cycle_max_mom * (1 + decay_mom_rate * k) for the "
                    "k-th decay interval, without a bound; set scheduler.params.decay_mom_rate to 0 (momentum stays "
                    "at cycle_max_mom) or small enough for the run's length")
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        for group, betas in zip(self.optimizer.param_groups, moms or []):
            group["betas"] = betas  # DeepSpeed writes betas only
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
                          base_lr: float | None = None, warn: bool = True):
    """The scheduler of a config's "scheduler" section, or None when it has none. ``config_json``: a typed
    config (``_C.Config``, as ``zero8.config.Zero8Config.typed``), or a normalized config's JSON text for
    the data-parallel size ``world_size``. ``base_lr``: the client optimizer's lr when the config has no
    optimizer section (as DeepSpeed reads it). ``warn``: issue the warnings (rank 0)."""
    if isinstance(config_json, _C.Config):
        if config_json.scheduler.type == _C.SchedulerType.none:
            return None
        schedule = _C.Scheduler(config_json.scheduler, base_lr=base_lr)
        cfg, source = json.loads(config_json.to_json()), config_json.source
    else:
        cfg, source = json.loads(config_json), "config"
        if not isinstance(cfg.get("scheduler"), dict) or not cfg["scheduler"].get("type"):
            return None
        schedule = _C.Scheduler(config_json, base_lr=base_lr, world_size=world_size)
    groups = _own_lr_schedules(optimizer, schedule, cfg)
    return Zero8LRScheduler(optimizer, schedule, group_schedules=groups, warn=warn)


def _own_lr_schedules(optimizer, schedule, cfg: dict) -> "list[_C.Scheduler] | None":
    """Each param group's schedule where DeepSpeed's reads the group's own lr (as at construction): WarmupCosineLR
    scales it, WarmupLR without warmup_max_lr ramps to it. None: the other schedules set the same lr in every
    group."""
    params = dict(cfg["scheduler"].get("params") or {})
    lrs = [float(g["lr"]) for g in optimizer.param_groups]
    if schedule.type not in ("WarmupLR", "WarmupCosineLR") or all(lr == schedule.base_lr for lr in lrs):
        return None  # one schedule: absolute lr parameters, or every group at the lr the schedule was built over
    if schedule.type == "WarmupLR":
        # The normalized config leaves out a warmup_max_lr the config did not give (SchedulerConfig's
        # warmup_max_lr_given): then each group ramps to its own lr; a given one is every group's top, as DeepSpeed.
        if "warmup_max_lr" in params:
            return None
        per_group = [dict(params, warmup_max_lr=lr) for lr in lrs]
        return _schedules_of(schedule.type, per_group, [None] * len(lrs))
    return _schedules_of(schedule.type, [params] * len(lrs), lrs)


def _build(type_name: str, params: dict, base_lr: float | None = None) -> "_C.Scheduler":
    """The C++ schedule of a scheduler section without an optimizer section: base_lr, the lr WarmupCosineLR
    scales; momentum cycling as cycle_momentum says (the scheduler then checks the optimizer for betas)."""
    cfg = {"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": type_name, "params": params}}
    normalized, _ = _C.config_parse(json.dumps(cfg), 1, f"zero8.lr_schedules.{type_name}")
    return _C.Scheduler(normalized, base_lr=base_lr, world_size=1)


def _schedules_of(type_name: str, params: list[dict], base_lrs: list) -> "list[_C.Scheduler]":
    """One schedule per param group (params[i] over base_lrs[i]), groups that agree sharing one."""
    built: dict = {}
    out = []
    for p, base in zip(params, base_lrs):
        key = (json.dumps(p, sort_keys=True), base)
        if key not in built:
            built[key] = _build(type_name, p, base)
        out.append(built[key])
    return out


def _class_schedules(optimizer, type_name: str, params: dict, base_lrs: list | None = None) -> "list[_C.Scheduler]":
    """The classes' per-group schedules: the values DeepSpeed takes per group (_PER_GROUP_PARAMS) as a scalar
    for every group or a list/tuple with one per group (DeepSpeed's _format_param); base_lrs the groups' lrs."""
    n = len(optimizer.param_groups)
    for k in _PER_GROUP_PARAMS:
        v = params.get(k)
        if isinstance(v, (list, tuple)) and len(v) != n:
            raise _C.Zero8ValueError(f"zero8.lr_schedules.{type_name}: {k}: expected {n} values, one per param "
                                     f"group, got {len(v)}")
    per_group = [{k: (v[i] if k in _PER_GROUP_PARAMS and isinstance(v, (list, tuple)) else v)
                  for k, v in params.items()} for i in range(n)]
    return _schedules_of(type_name, per_group, base_lrs or [None] * n)


class _ClassScheduler(Zero8LRScheduler):
    """The classes' common part: their constructor arguments as a scheduler section, split by group."""

    def __init__(self, optimizer, type_name: str, params: dict, last_batch_iteration: int,
                 base_lrs: list | None = None):
        schedules = _class_schedules(optimizer, type_name, params, base_lrs)
        same = all(s is schedules[0] for s in schedules)
        super().__init__(optimizer, schedules[0], last_batch_iteration, None if same else schedules)


class WarmupLR(_ClassScheduler):
    """deepspeed.runtime.lr_schedules.WarmupLR: from warmup_min_lr up to warmup_max_lr over
    warmup_num_steps (log or linear), then constant. warmup_max_lr None: each param group's own lr (as at
    construction), as DeepSpeed (since its PR #7360; before, 0.001). The lr bounds take a list with one value
    per group too."""

    def __init__(self, optimizer, warmup_min_lr: float = 0.0, warmup_max_lr: float | None = None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1):
        if warmup_max_lr is None:
            warmup_max_lr = [float(g["lr"]) for g in optimizer.param_groups]
        params = dict(warmup_min_lr=warmup_min_lr, warmup_max_lr=warmup_max_lr, warmup_num_steps=warmup_num_steps,
                      warmup_type=warmup_type)
        super().__init__(optimizer, "WarmupLR", params, last_batch_iteration)


class WarmupDecayLR(_ClassScheduler):
    """deepspeed.runtime.lr_schedules.WarmupDecayLR: WarmupLR, then linear decay to warmup_min_lr at
    total_num_steps (warmup_max_lr None: each group's own lr, as WarmupLR)."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_lr: float = 0.0, warmup_max_lr: float = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1):
        if warmup_max_lr is None:
            warmup_max_lr = [float(g["lr"]) for g in optimizer.param_groups]
        params = dict(total_num_steps=total_num_steps, warmup_min_lr=warmup_min_lr, warmup_max_lr=warmup_max_lr,
                      warmup_num_steps=warmup_num_steps, warmup_type=warmup_type)
        super().__init__(optimizer, "WarmupDecayLR", params, last_batch_iteration)


class WarmupCosineLR(_ClassScheduler):
    """deepspeed.runtime.lr_schedules.WarmupCosineLR: a ratio of each param group's lr (as it was at
    construction), warmed up from warmup_min_ratio to 1, then cosine down to cos_min_ratio at
    total_num_steps."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0, warmup_num_steps: int = 1000,
                 cos_min_ratio: float = 0.0001, warmup_type: str = "log", last_batch_iteration: int = -1):
        params = dict(total_num_steps=total_num_steps, warmup_min_ratio=warmup_min_ratio,
                      warmup_num_steps=warmup_num_steps, cos_min_ratio=cos_min_ratio, warmup_type=warmup_type)
        self.org_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        super().__init__(optimizer, "WarmupCosineLR", params, last_batch_iteration, base_lrs=self.org_lrs)


class OneCycle(_ClassScheduler):
    """deepspeed.runtime.lr_schedules.OneCycle (1cycle policy, with beta1 cycling for optimizers whose
    defaults have betas; beta2 is then 0.99 as in DeepSpeed; for others a warning, as DeepSpeed's). The lr and
    momentum bounds take a list with one value per param group too."""

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
        super().__init__(optimizer, "OneCycle", params, last_batch_iteration)


class LRRangeTest(_ClassScheduler):
    """deepspeed.runtime.lr_schedules.LRRangeTest: lr growing from lr_range_test_min_lr (a list: one per
    param group)."""

    def __init__(self, optimizer, lr_range_test_min_lr: float = 1e-3, lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False,
                 last_batch_iteration: int = -1):
        params = dict(lr_range_test_min_lr=lr_range_test_min_lr, lr_range_test_step_size=lr_range_test_step_size,
                      lr_range_test_step_rate=lr_range_test_step_rate, lr_range_test_staircase=lr_range_test_staircase)
        super().__init__(optimizer, "LRRangeTest", params, last_batch_iteration)
