"""zero8's DeepSpeed config and schedule classes against DeepSpeed's documented behaviour, where the
Python layer decides it (the C++ parser's side is tests/cpp/test_config.cpp), and the monitor sections against
DeepSpeed's own parser (the test extra's deepspeed)."""

from __future__ import annotations

import copy
import json
import warnings

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


# ---- schedules per param group, against DeepSpeed's own scheduler classes ----

_TWO_GROUP_LRS = (1e-2, 1e-3)  # group 0's own lr; group 1 takes the optimizer's


def _two_groups(model: torch.nn.Module) -> list[dict]:
    first, second = list(model.children())
    return [{"params": list(first.parameters()), "lr": _TWO_GROUP_LRS[0]}, {"params": list(second.parameters())}]


def _groups_state(opt) -> list:
    return [(g["lr"], tuple(g["betas"]) if "betas" in g else g.get("momentum")) for g in opt.param_groups]


def _deepspeed_run(opt, cls_name: str, params: dict, steps: int) -> list:
    """What DeepSpeed's scheduler class sets in opt's groups at construction and after each step()."""
    from deepspeed.runtime import lr_schedules as ds

    sched = getattr(ds, cls_name)(opt, **params)
    out = [_groups_state(opt)]
    for _ in range(steps):
        sched.step()
        out.append(_groups_state(opt))
    return out


_SCHEDULES = [
    ("WarmupLR", {"warmup_num_steps": 4, "warmup_type": "linear"}),  # warmup_max_lr: each group's own lr
    ("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 5e-3, "warmup_num_steps": 5}),
    ("WarmupDecayLR", {"total_num_steps": 10, "warmup_num_steps": 4, "warmup_type": "linear"}),  # max 0.001
    ("WarmupDecayLR", {"total_num_steps": 10, "warmup_min_lr": 1e-4, "warmup_max_lr": 5e-3, "warmup_num_steps": 3}),
    ("WarmupCosineLR", {"warmup_num_steps": 4, "total_num_steps": 10, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"warmup_num_steps": 3, "total_num_steps": 12, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05}),
    ("OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 3, "cycle_second_step_size": 5,
                  "decay_step_size": 2, "decay_lr_rate": 0.5, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 3, "lr_range_test_step_rate": 2.0}),
    ("LRRangeTest", {"lr_range_test_min_lr": 2e-3, "lr_range_test_step_size": 4, "lr_range_test_staircase": True}),
]


@pytest.mark.parametrize("name, params", _SCHEDULES)
def test_config_schedules_set_each_group_lr_as_deepspeeds(name, params):
    # The config's scheduler over two param groups of model_parameters (group 0 with its own lr), as DeepSpeed's
    # engine builds it: its class over the optimizer's groups. WarmupCosineLR scales each group's own lr, WarmupLR
    # without warmup_max_lr ramps each to its own; the others set the same lr everywhere. zero8 gave every group the
    # first two's optimizer lr.
    pytest.importorskip("deepspeed", reason="the parity tests need the test extra (pip install .[test])")
    import zero8

    steps = 16  # past every warmup, cycle and total_num_steps above
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": _TWO_GROUP_LRS[1]}},
           "scheduler": {"type": name, "params": params}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # OneCycle's beta2, WarmupLR's reading of warmup_max_lr (tested below)
        engine, opt, _, _ = zero8.initialize(model=model, model_parameters=_two_groups(model), config=cfg)
    ours = [_groups_state(opt)]
    for _ in range(steps):
        engine.backward(engine(torch.ones(1, 4)).sum())
        engine.step()
        ours.append(_groups_state(opt))
    reference = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    theirs = _deepspeed_run(torch.optim.Adam(_two_groups(reference), lr=_TWO_GROUP_LRS[1]), name, params, steps)
    if name != "OneCycle":  # only OneCycle sets betas (the config's Adam holds its own as float32 values)
        ours, theirs = ([[lr for lr, _ in state] for state in run] for run in (ours, theirs))
    assert ours == theirs  # the same double operations in C++ as in lr_schedules.py: equal to the bit


def test_a_given_warmup_max_lr_is_every_groups_top_and_a_missing_one_each_groups_own():
    # DeepSpeed's WarmupLR: without warmup_max_lr each group ramps to its own lr; a given one is every group's top,
    # also when it equals the optimizer section's lr (the normalized config leaves a missing one out to tell).
    import zero8
    from zero8.config import Zero8ConfigWarning

    def top_lrs(params: dict, client: bool):
        """The groups' lrs after the warmup, and initialize's Zero8ConfigWarnings."""
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        cfg = {"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": "WarmupLR", "params": params}}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if client:
                client_opt = torch.optim.Adam(_two_groups(model), lr=_TWO_GROUP_LRS[1])
                _, opt, _, sched = zero8.initialize(model=model, optimizer=client_opt, config=cfg)
            else:
                cfg["optimizer"] = {"type": "Adam", "params": {"lr": _TWO_GROUP_LRS[1]}}
                _, opt, _, sched = zero8.initialize(model=model, model_parameters=_two_groups(model), config=cfg)
        sched.step(10)
        return [g["lr"] for g in opt.param_groups], [str(w.message) for w in caught
                                                      if issubclass(w.category, Zero8ConfigWarning)]

    ramp = {"warmup_num_steps": 4, "warmup_type": "linear"}
    top = _TWO_GROUP_LRS[1]
    for client in (False, True):
        assert top_lrs(ramp, client) == (list(_TWO_GROUP_LRS), [])
        assert top_lrs(dict(ramp, warmup_max_lr=top), client) == ([top, top], [])
        assert top_lrs(dict(ramp, warmup_max_lr=2e-3), client) == ([2e-3, 2e-3], [])


@pytest.mark.parametrize("name, args", [
    ("WarmupLR", {"warmup_num_steps": 4, "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_min_lr": [1e-4, 2e-4], "warmup_max_lr": [5e-3, 2e-2], "warmup_num_steps": 5}),
    ("WarmupDecayLR", {"total_num_steps": 10, "warmup_max_lr": None, "warmup_num_steps": 3}),
    ("WarmupDecayLR", {"total_num_steps": 10, "warmup_min_lr": [0.0, 1e-4], "warmup_num_steps": 3}),
    ("WarmupCosineLR", {"total_num_steps": 12, "warmup_num_steps": 3, "warmup_min_ratio": 0.2}),
    ("OneCycle", {"cycle_min_lr": [1e-3, 2e-3], "cycle_max_lr": [1e-2, 3e-2], "cycle_first_step_size": 3,
                  "decay_step_size": 2, "decay_lr_rate": 0.5, "cycle_min_mom": [0.8, 0.85], "cycle_max_mom": 0.95}),
    ("LRRangeTest", {"lr_range_test_min_lr": [1e-3, 5e-3], "lr_range_test_step_size": 3}),
])
def test_schedule_classes_per_group_as_deepspeeds(name, args):
    # zero8.lr_schedules' classes against DeepSpeed's on two groups with their own lrs: a missing warmup_max_lr is
    # each group's own lr, and the bounds DeepSpeed takes per group take a list.
    pytest.importorskip("deepspeed", reason="the parity tests need the test extra (pip install .[test])")
    from zero8 import lr_schedules

    steps = 16

    def optimizer():
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        return torch.optim.Adam(_two_groups(model), lr=_TWO_GROUP_LRS[1])

    opt = optimizer()
    sched = getattr(lr_schedules, name)(opt, **args)
    ours = [_groups_state(opt)]
    for _ in range(steps):
        sched.step()
        ours.append(_groups_state(opt))
    assert ours == _deepspeed_run(optimizer(), name, args, steps)
    assert sched.get_last_lr() == [lr for lr, _ in ours[-1]]


def test_one_cycle_leaves_the_momentum_of_an_optimizer_without_betas():
    # DeepSpeed's OneCycle cycles momentum only when the optimizer's defaults have betas; for a client SGD zero8
    # set its momentum to the cycle. Now it is left alone, with DeepSpeed's warning; a client Adam's betas cycle.
    pytest.importorskip("deepspeed", reason="the parity tests need the test extra (pip install .[test])")
    import zero8
    from zero8.config import Zero8ConfigWarning

    params = {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 4}
    cfg = {"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": "OneCycle", "params": params}}
    for client, cycled in ((lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5), False),
                           (lambda ps: torch.optim.Adam(ps, lr=0.1), True)):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine, opt, _, _ = zero8.initialize(model=model, optimizer=client(model.parameters()), config=cfg)
        said = [str(w.message) for w in caught if issubclass(w.category, Zero8ConfigWarning)]
        ours = [_groups_state(opt)]
        for _ in range(8):
            engine.backward(engine(torch.ones(1, 4)).sum())
            engine.step()
            ours.append(_groups_state(opt))
        reference = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        theirs = _deepspeed_run(client(reference.parameters()), "OneCycle", params, 8)
        assert ours == theirs
        if cycled:
            assert said == [] and len({b for s in ours for _, b in s}) > 2
        else:
            assert any("cycle_momentum is disabled because optimizer SGD does not support momentum" in m
                       for m in said)
            assert {b for s in ours for _, b in s} == {0.5}
            assert engine.get_mom() == [0.5]
    # The class too, on any torch optimizer.
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.5)
    with pytest.warns(Zero8ConfigWarning, match="cycle_momentum is disabled because optimizer SGD"):
        sched = zero8.lr_schedules.OneCycle(sgd, **params)
    sched.step(3)
    assert sgd.param_groups[0]["momentum"] == 0.5 and "betas" not in sgd.param_groups[0] and sched.get_mom() is None


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
    {"train_batch_size": 16, "bf16": {"enabled": True, "check_grad_overflow": False, "immediate_grad_update": True},
     "zero_optimization": {"stage": 2, "parameter_alignment": True, "compute_grad_norm": False},
     "gradient_clipping": 0.0},
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
        "bf16.immediate_grad_update": (z8.bf16.immediate_grad_update, ds.bfloat16_config.immediate_grad_update),
        "bf16.check_grad_overflow": (z8.bf16.check_grad_overflow, ds.bfloat16_config.check_grad_overflow),
        "zero.stage": (z8.zero.stage, ds.zero_optimization_stage),
        "steps_per_print": (z8.steps_per_print, ds.steps_per_print),
    }
    for key in ("enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                "consecutive_hysteresis", "min_loss_scale"):
        pairs[f"fp16.{key}"] = (getattr(z8.fp16, key), getattr(fp16, key))
    for key in ("reduce_bucket_size", "allgather_bucket_size", "ignore_unused_parameters", "contiguous_gradients",
                "reduce_scatter", "allgather_partitions", "round_robin_gradients", "load_from_fp32_weights",
                "overlap_comm", "parameter_alignment", "compute_grad_norm"):
        pairs[f"zero.{key}"] = (getattr(z8.zero, key, None), getattr(ds.zero_config, key))
    written = {k for k in pairs if k.split(".")[-1] in json.dumps(cfg)}
    differ = {k: v for k, v in pairs.items() if v[0] != v[1] and (k not in _OWN_DEFAULTS or k in written)}
    assert differ == {}, differ


def test_infinite_steps_per_print_reads_as_never():
    # Hugging Face Accelerate writes steps_per_print = float("inf") into the config dict; DeepSpeed takes it
    # (a step count modulo infinity is never 0: no report). zero8 refused the dict as not JSON-serializable.
    pytest.importorskip("deepspeed", reason="the parity tests need the test extra (pip install .[test])")
    from deepspeed.runtime.config import DeepSpeedConfig
    from zero8.config import load_config

    cfg = {"train_batch_size": 8, "steps_per_print": float("inf")}
    assert all((step + 1) % DeepSpeedConfig(dict(cfg)).steps_per_print != 0 for step in range(1000))
    z8 = load_config(cfg)
    assert z8.typed.steps_per_print == 2**63 - 1 and z8.dict["steps_per_print"] == 2**63 - 1
    assert cfg["steps_per_print"] == float("inf")  # the caller's dict is left as it was
    with pytest.raises(ValueError, match=r"steps_per_print: not JSON-serializable"):
        load_config({"train_batch_size": 8, "steps_per_print": float("nan")})


def test_compute_grad_norm_false_refused_where_deepspeed_refuses_it():
    # DeepSpeed 0.19.8 refuses zero_optimization.compute_grad_norm false below stage 1 (its ZeRO config), with
    # gradient clipping (its stage 1/2 optimizer; the default clipping is 1.0) and for bf16 stage 1 with fp32
    # gradient accumulation (its engine); zero8 refuses the same configs, naming the key.
    pytest.importorskip("deepspeed", reason="the parity tests need the test extra (pip install .[test])")
    from deepspeed.runtime.config import DeepSpeedConfig
    from zero8 import Zero8ValueError, _C

    def parse(cfg):
        return _C.Config(json.dumps(cfg), 1)

    off = {"train_batch_size": 8, "gradient_clipping": 0.0}
    with pytest.raises(ValueError, match="compute_grad_norm=false is supported only with ZeRO Stage 1 or 2"):
        DeepSpeedConfig({**off, "zero_optimization": {"stage": 0, "compute_grad_norm": False}})
    with pytest.raises(Zero8ValueError, match=r"zero_optimization\.compute_grad_norm: false is supported only with "
                                              r"ZeRO stage 1 or 2 .*the stage is 0"):
        parse({**off, "zero_optimization": {"stage": 0, "compute_grad_norm": False}})
    with pytest.raises(Zero8ValueError, match=r"zero_optimization\.compute_grad_norm: false requires "
                                              r"gradient_clipping 0 .*got 1"):
        parse({"train_batch_size": 8, "zero_optimization": {"stage": 2, "compute_grad_norm": False}})
    with pytest.raises(Zero8ValueError, match=r"compute_grad_norm: false does not support ZeRO stage 1 with bf16"):
        parse({**off, "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
               "zero_optimization": {"stage": 1, "compute_grad_norm": False}})
    for stage in (1, 2):
        typed = parse({**off, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage,
                                                                               "compute_grad_norm": False}})
        assert not typed.zero.compute_grad_norm


def test_seq_parallel_communication_data_type_is_deepspeeds_name():
    # zero8 ignored "seq_parallel_comm_data_type", a key DeepSpeed does not have, and warned about DeepSpeed's
    # own seq_parallel_communication_data_type as an unknown key.
    from zero8.config import load_config

    cfg = {"train_batch_size": 8, "seq_parallel_communication_data_type": "bf16"}
    assert load_config(cfg, warn=False).warnings == []
    assert any("seq_parallel_comm_data_type: unknown key" in w for w in
               load_config({"train_batch_size": 8, "seq_parallel_comm_data_type": "bf16"}, warn=False).warnings)


def test_bf16_check_grad_overflow_false_warns_that_zero8_skips_anyway():
    # DeepSpeed's bf16 ZeRO steps apply a non-finite gradient with check_grad_overflow false; zero8 skips such
    # a step in every precision, so it says that false has no effect.
    from zero8.config import load_config

    def warnings_of(bf16):
        return load_config({"train_batch_size": 8, "bf16": bf16}, warn=False).warnings

    assert any("check_grad_overflow: false has no effect" in w
               for w in warnings_of({"enabled": True, "check_grad_overflow": False}))
    assert warnings_of({"enabled": True}) == warnings_of({"enabled": False, "check_grad_overflow": False}) == []


@pytest.mark.parametrize("data_types", [
    {},
    {"buffer_dtype": "bf16", "param_dtype": "bfloat16", "grad_accum_dtype": "fp32"},
    {"buffer_dtype": "torch.float32", "keep_in_fp32_modules": ["rotary*", "bias"]},
    {"buffer_dtype": None, "keep_in_fp32_modules": []},
])
def test_data_types_read_as_deepspeed_reads_them(data_types):
    pytest.importorskip("deepspeed", reason="the parity tests need the test extra (pip install .[test])")
    from deepspeed.runtime.config import DeepSpeedConfig, DtypeEnum

    ds = DeepSpeedConfig({"train_batch_size": 8, "bf16": {"enabled": True}, "data_types": data_types})
    z8 = _normalized_data_types(data_types)
    names = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, None: None}
    for key in ("grad_accum_dtype", "param_dtype", "buffer_dtype"):
        want = getattr(ds, key)
        assert names[z8.get(key)] == (None if want is None else DtypeEnum(want).value), key
    assert z8["keep_in_fp32_modules"] == ds.keep_in_fp32_modules


@pytest.mark.parametrize("data_types, error, message", [
    ({"param_dtype": "fp16"}, "Zero8ValueError", r"data_types\.param_dtype: \"fp16\" is not the training dtype, bf16"),
    ({"buffer_dtype": "float64"}, "Zero8ValueError",
     r"data_types\.buffer_dtype: expected one of \"fp32\", \"fp16\", \"bf16\""),
    ({"buffer_dtype": "int8"}, "Zero8NotSupportedError", r"data_types\.buffer_dtype: int8 is not supported"),
    ({"keep_in_fp32_modules": "lm_head"}, "Zero8ValueError",
     r"data_types\.keep_in_fp32_modules: expected \"auto\" or a list"),
    ({"keep_in_fp32_modules": ["a", 1]}, "Zero8ValueError",
     r"data_types\.keep_in_fp32_modules: expected \"auto\" or a list"),
    ({"buffer_dtypes": "bf16"}, "Zero8ValueError",
     r"data_types\.buffer_dtypes: unknown key; did you mean \"buffer_dtype\"\?"),
])
def test_data_types_errors_name_the_key(data_types, error, message):
    import zero8

    with pytest.raises(getattr(zero8, error), match=message):
        _normalized_data_types(data_types)


def _normalized_data_types(data_types: dict) -> dict:
    """data_types as zero8's parser normalizes it, under bf16."""
    from zero8 import _C

    cfg = {"train_batch_size": 8, "bf16": {"enabled": True}, "data_types": data_types}
    return json.loads(_C.Config(json.dumps(cfg), 1).to_json())["data_types"]


class _Gate(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
        self.register_buffer("e_score_correction_bias", torch.full((4,), 1 / 3))
        self.register_buffer("rotary_inv_freq", torch.full((2,), 1 / 3, dtype=torch.bfloat16))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


class _Block(torch.nn.Module):
    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]
    _keep_in_fp32_modules = ["rotary*"]

    def __init__(self):
        super().__init__()
        self.gate = _Gate()
        self.proj = torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("data_types", [
    {},
    {"buffer_dtype": "bf16"},
    {"buffer_dtype": "fp16", "keep_in_fp32_modules": ["norm.running_*"]},
    {"buffer_dtype": "fp32", "keep_in_fp32_modules": []},
])
def test_module_cast_is_deepspeeds(dtype, data_types):
    # zero8's cast under fp16/bf16 (engine/precision.py) against DeepSpeed 0.19.8's own on the same module: every
    # parameter's and buffer's dtype and value, with the keep_in_fp32 lists of a submodule ("auto") and
    # patterns given.
    pytest.importorskip("deepspeed", reason="the parity tests need the test extra (pip install .[test])")
    from types import SimpleNamespace

    from deepspeed.runtime.config import DtypeEnum
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.keep_in_fp32 import keep_in_fp32_pattern
    from zero8 import _C
    from zero8.engine.config_view import buffer_dtype
    from zero8.engine.precision import cast_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block(), torch.nn.Linear(4, 2))
    ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
    typed = _C.Config(json.dumps({"train_batch_size": 8, "data_types": data_types}), 1)
    cast_module(ours, dtype, buffer_dtype(typed), typed.data_types.keep_in_fp32_modules)
    keep = keep_in_fp32_pattern(theirs, data_types.get("keep_in_fp32_modules", "auto"), dtype)
    buffer_dtype = DtypeEnum(data_types["buffer_dtype"]).value if "buffer_dtype" in data_types else None
    DeepSpeedEngine._cast_module_mixed_precision(SimpleNamespace(module=theirs), dtype, buffer_dtype, False, keep)
    a, b = ours.state_dict(), theirs.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k

