"""How a client optimizer becomes the sharded optimizer's algorithm and hyperparameters: its class and
param groups read into a spec (algorithm, state bits, C++ Hyper), and param-group dicts turned into Hyper
values and back (what LR schedulers read and write). Per-parameter overrides (zero8.optim's override_config)
give a Hyper of their own.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from .. import _C
from .._C import Zero8NotSupportedError, Zero8ValueError


# torch.optim classes by name -> zero8 algorithm (torch's Adam: adamw when decoupled_weight_decay is set).
_TORCH_ALGOS = {"Adam": "adam", "AdamW": "adamw", "SGD": "sgd", "RMSprop": "rmsprop", "Adagrad": "adagrad"}
# bitsandbytes class names (without the Paged prefix and the 8bit/32bit suffix) -> algorithm. Its Adam
# decouples weight decay as its AdamW does (p *= 1 - lr wd: bitsandbytes 0.50's Adam32bit steps as
# torch.optim.AdamW), so both are adamw. (zero8.optim's optimizers name their own algorithm: their algo.)
_BNB_ALGOS = {
    "Adam": "adamw", "AdamW": "adamw", "SGD": "sgd", "Lion": "lion", "RMSprop": "rmsprop",
    "Adagrad": "adagrad", "LAMB": "lamb", "LARS": "lars", "Momentum": "sgd",
}
_BETA_ALGOS = ("adam", "adamw", "lamb", "lion")
_MOMENTUM_ALGOS = ("sgd", "lars")
# Group keys that are hyperparameters. Each param group steps with its own values of _GROUP_KEYS (the
# sharded optimizer's hyper groups); the others must be equal across groups.
_HYPER_KEYS = ("lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov", "alpha", "lr_decay",
               "initial_accumulator_value", "trust_coefficient", "max_trust_ratio", "max_coeff",
               "min_trust_ratio", "min_coeff",
               "bias_correction", "amsgrad", "maximize", "centered", "decoupled_weight_decay")
_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "momentum", "alpha")


def _client_optimizer_spec(opt, zero8_enabled: bool, config_bits: int) -> dict:
    """{algo, bits, hyper: {field: value}, name, min_8bit_size?} of a client optimizer instance.

    Read from its class and param_groups[0]; "group_hypers" holds each group's Hyper (they may differ
    in _GROUP_KEYS, the rest must be equal):
    torch.optim Adam (L2 weight decay; adamw when decoupled_weight_decay), AdamW, SGD, RMSprop, Adagrad;
    zero8.optim's optimizers (their own ``algo``: Adam's follows its decoupled_weight_decay) and bitsandbytes'
    Adam/AdamW/SGD/Lion/RMSprop/Adagrad/LAMB/LARS (8bit / 32bit by name or optim_bits; Adam decoupled, as
    bitsandbytes applies it).
    """
    cls = type(opt)
    name = cls.__name__
    module = cls.__module__ or ""
    bits = config_bits if zero8_enabled else 32
    algo = None
    if module.startswith("torch.optim") and name in _TORCH_ALGOS:
        algo = _TORCH_ALGOS[name]
    elif module.startswith("zero8") and isinstance(getattr(opt, "algo", None), _C.Algo):
        # zero8.optim: its own algorithm (the instance's: Adam's depends on decoupled_weight_decay), state
        # bits, block size and Hyper construction.
        groups = opt.param_groups
        _check_groups_equal(groups, tuple(k for k in groups[0] if k != "params" and k not in _GROUP_KEYS))
        g0 = groups[0]
        spec = {"algo": opt.algo.name, "bits": int(g0.get("optim_bits", opt.optim_bits)),
                "hyper_obj": opt._hyper(g0), "name": f"{module}.{name}",
                "min_8bit_size": int(g0.get("min_8bit_size", opt.min_8bit_size)),
                "state_block": int(g0.get("block_size", opt.block_size))}
        spec["hyper"] = {"lr": float(g0["lr"])}
        spec["group_hypers"] = [opt._hyper(g) for g in groups]
        if spec["algo"] == "adagrad":
            spec["hyper"]["initial_accumulator"] = float(g0.get("initial_accumulator_value", 0.0))
        return spec
    elif module.startswith("bitsandbytes"):
        base = name
        for suffix, b in (("8bit", 8), ("32bit", 32)):
            if base.endswith(suffix):
                base, bits = base[: -len(suffix)], b
                break
        base = base.removeprefix("Paged")
        algo = _BNB_ALGOS.get(base)
        ob = getattr(getattr(opt, "args", None), "optim_bits", None)
        if ob in (8, 32) and not name.endswith(("8bit", "32bit")):
            bits = int(ob)
    if algo is None:
        raise Zero8NotSupportedError(
            f"optimizer: a client optimizer of type {module}.{name} cannot run sharded; zero8 maps "
            f"torch.optim.{{{', '.join(_TORCH_ALGOS)}}}, zero8.optim optimizers and bitsandbytes' 8-bit ones "
            f"(Adam, AdamW, SGD, Lion, RMSprop, Adagrad, LAMB, LARS); or use an \"optimizer\" config section"
        )
    groups = opt.param_groups
    if not groups:
        raise Zero8ValueError("optimizer: the client optimizer has no param groups")
    _check_groups_equal(groups, tuple(k for k in _HYPER_KEYS if k not in _GROUP_KEYS))
    g0 = _with_bnb_names(groups[0], algo)
    for flag in ("amsgrad", "maximize", "centered"):
        if g0.get(flag):
            raise Zero8NotSupportedError(f"optimizer.param_groups[0].{flag}: {flag}=True is not supported")
    if algo == "rmsprop" and g0.get("momentum", 0):
        raise Zero8NotSupportedError("optimizer.param_groups[0].momentum: RMSprop with momentum is not supported")
    if algo == "adam" and g0.get("decoupled_weight_decay"):
        algo = "adamw"
    hyper: dict[str, Any] = {"lr": float(g0["lr"])}
    if "eps" in g0:
        hyper["eps"] = float(g0["eps"])
    hyper["weight_decay"] = float(g0.get("weight_decay", 0.0) or 0.0)
    if algo in _BETA_ALGOS:
        b1, b2 = g0.get("betas", (0.9, 0.999))
        hyper["beta1"], hyper["beta2"] = float(b1), float(b2)
        if "bias_correction" in g0:
            hyper["bias_correction"] = bool(g0["bias_correction"])
    if algo in _MOMENTUM_ALGOS:
        hyper["beta1"] = float(g0.get("momentum", 0.0) or 0.0)
        hyper["dampening"] = float(g0.get("dampening", 0.0) or 0.0)
        hyper["nesterov"] = bool(g0.get("nesterov", False))
        if "trust_coefficient" in g0:
            hyper["trust_coefficient"] = float(g0["trust_coefficient"])
    if algo in ("lamb", "lars"):  # the trust-ratio clips (DeepSpeed's Lamb calls them max/min_coeff)
        for k in ("max_trust_ratio", "max_coeff"):
            if k in g0:
                hyper["max_trust_ratio"] = float(g0[k])
        for k in ("min_trust_ratio", "min_coeff"):
            if k in g0:
                hyper["min_trust_ratio"] = float(g0[k])
    if algo == "rmsprop":
        hyper["beta2"] = float(g0.get("alpha", 0.99))
    if algo == "adagrad":
        hyper["lr_decay"] = float(g0.get("lr_decay", 0.0))
        hyper["initial_accumulator"] = float(g0.get("initial_accumulator_value", 0.0))
    spec = {"algo": algo, "bits": bits, "hyper": hyper, "name": f"{module}.{name}"}
    m8 = getattr(getattr(opt, "args", None), "min_8bit_size", None)
    if isinstance(m8, int):
        spec["min_8bit_size"] = m8
    return spec


def _with_bnb_names(group: dict, algo: str) -> dict:
    """A param group with torch's names for what bitsandbytes keeps in ``betas``: its SGD and LARS store
    ``betas = (momentum, dampening)``, its RMSprop ``betas = (alpha, momentum)``. Groups that have torch's
    names (torch.optim, zero8.optim, the engine's own) are returned as they are."""
    betas = group.get("betas")
    if betas is None or len(betas) < 2:
        return group
    if algo in _MOMENTUM_ALGOS and "momentum" not in group:
        return {**group, "momentum": betas[0], "dampening": betas[1]}
    if algo == "rmsprop" and "alpha" not in group:
        return {**group, "alpha": betas[0], "momentum": betas[1]}
    return group


def _check_groups_equal(groups: list[dict], keys) -> None:
    g0 = groups[0]
    for i, g in enumerate(groups[1:], 1):
        for k in keys:
            if k in g0 and g.get(k) != g0.get(k):
                raise Zero8NotSupportedError(
                    f"optimizer.param_groups[{i}].{k}: {g.get(k)!r} differs from param_groups[0]'s {g0.get(k)!r}; "
                    f"zero8's param groups may differ only in {', '.join(_GROUP_KEYS)}"
                )


def _param_overrides(p: torch.Tensor, client) -> dict:
    """Per-parameter settings of zero8.optim (GlobalOptimManager, e.g. a StableEmbedding weight, and the
    client optimizer's override_config)."""
    cfg: dict = {}
    try:
        from ..optim import param_config
    except ImportError:  # zero8.optim not installed: no overrides can exist
        return cfg
    cfg.update(param_config(p))
    own = getattr(client, "_overrides", None)
    if own is not None and p in own:
        cfg.update(own[p])
    return cfg


def _hyper_from_group(group: dict, algo: str, hyper) -> None:
    """Write a param group's (possibly scheduler-changed) hyperparameters into the C++ Hyper."""
    group = _with_bnb_names(group, algo)
    hyper.lr = float(group["lr"])
    if "weight_decay" in group:
        hyper.weight_decay = float(group["weight_decay"] or 0.0)
    if "eps" in group:
        hyper.eps = float(group["eps"])
    if algo in _BETA_ALGOS and "betas" in group:
        b1, b2 = group["betas"]
        hyper.beta1, hyper.beta2 = float(b1), float(b2)
    elif algo in _MOMENTUM_ALGOS and "momentum" in group:
        hyper.beta1 = float(group["momentum"] or 0.0)
    elif algo == "rmsprop" and "alpha" in group:
        hyper.beta2 = float(group["alpha"])


def _hyper_for_group(base, group: dict, algo: str):
    """A copy of the C++ Hyper ``base`` with a param group's own values (_hyper_from_group)."""
    h = copy.copy(base)
    _hyper_from_group(group, algo, h)
    return h


# Per-parameter overrides that choose the state format rather than a hyperparameter (master_weights: the
# engine keeps float32 masters of every parameter anyway).
_STATE_OVERRIDE_KEYS = ("optim_bits", "min_8bit_size", "master_weights")
# Per-parameter hyperparameters that _hyper_from_group does not write (the same in every param group of
# the engine), by their C++ Hyper field.
_OVERRIDE_FIELDS = {"dampening": float, "nesterov": bool, "lr_decay": float, "bias_correction": bool,
                    "trust_coefficient": float, "max_trust_ratio": float, "min_trust_ratio": float}


def _hyper_with_overrides(base, over: dict, algo: str):
    """A copy of a param group's C++ Hyper with per-parameter overrides (zero8.optim's _OVERRIDE_KEYS but
    optim_bits/min_8bit_size) in place of its values."""
    h = _hyper_for_group(base, {**_group_from_hyper(algo, base), **over}, algo)
    for k, v in over.items():
        if k in _OVERRIDE_FIELDS:
            setattr(h, k, _OVERRIDE_FIELDS[k](v))
    return h


def _f32(x: float) -> float:
    """A float32 hyperparameter as the shortest decimal that rounds to it (0.003, not 0.0030000000261)."""
    x32 = torch.tensor(x, dtype=torch.float32).item()
    for digits in range(1, 10):
        v = float(f"{x32:.{digits}g}")
        if torch.tensor(v, dtype=torch.float32).item() == x32:
            return v
    return x32


def _group_from_hyper(algo: str, h) -> dict:
    """The torch-style param-group hyperparameters of a C++ Hyper (what schedulers read and write)."""
    g: dict[str, Any] = {"lr": _f32(h.lr), "weight_decay": _f32(h.weight_decay)}
    if algo in _BETA_ALGOS:
        g["betas"] = (_f32(h.beta1), _f32(h.beta2))
        g["eps"] = _f32(h.eps)
        g["bias_correction"] = bool(h.bias_correction)
    elif algo in _MOMENTUM_ALGOS:
        g["momentum"] = _f32(h.beta1)
        g["dampening"] = _f32(h.dampening)
        g["nesterov"] = bool(h.nesterov)
    elif algo == "rmsprop":
        g["alpha"] = _f32(h.beta2)
        g["eps"] = _f32(h.eps)
    elif algo == "adagrad":
        g["lr_decay"] = _f32(h.lr_decay)
        g["eps"] = _f32(h.eps)
    return g


def _check_group_overrides(groups: list[dict], resolved: dict) -> None:
    """model_parameters given as param-group dicts may set their own _GROUP_KEYS (e.g. weight_decay 0 for
    biases and norms); other hyperparameters must equal the optimizer's."""
    for i, g in enumerate(groups):
        for k, v in g.items():
            if k == "params" or k not in resolved or k in _GROUP_KEYS:
                continue
            want = resolved[k]
            same = (tuple(float(a) for a in v) == tuple(want)) if k == "betas" else (
                v == want or (isinstance(v, (int, float)) and _f32(float(v)) == want))
            if not same:
                raise Zero8NotSupportedError(
                    f"model_parameters[{i}].{k}: {v!r} differs from the optimizer's {want!r}; zero8's param "
                    f"groups may set their own {', '.join(_GROUP_KEYS)} only"
                )
