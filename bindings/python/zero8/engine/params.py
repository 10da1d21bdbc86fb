"""Which parameters the engine trains, and with which hyperparameters: the parameters of model_parameters
(tensors or param-group dicts), of a client optimizer or of the whole module, each in its param group; the
hyper groups of parameters with per-parameter overrides (zero8.optim's override_config); and which
parameters keep 32-bit states.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Iterable

import torch

from .._C import Zero8NotSupportedError, Zero8ValueError
from .client_optim import _STATE_OVERRIDE_KEYS, _hyper_with_overrides, _param_overrides


@dataclass
class ParamGroups:
    """The parameters to optimize, in order, and their param groups.

    ``hyper_group``: each parameter's param group: the client optimizer's group, else the model_parameters
    dict it came from, the bare tensors of model_parameters forming one group; ``group_dicts``: those
    groups' dicts ({} for the bare tensors; the client's param_groups list with a client optimizer);
    ``given_dicts``: the dicts of model_parameters as given (checked by _check_group_overrides)."""

    params: list = field(default_factory=list)
    hyper_group: list = field(default_factory=list)
    group_dicts: list = field(default_factory=list)
    given_dicts: list = field(default_factory=list)


def collect_params(model: torch.nn.Module, model_parameters, client_optimizer, stacklevel: int) -> ParamGroups:
    """The parameters to optimize, in order, without duplicates or frozen ones. A parameter in two param
    groups (two dicts, or a dict and the bare tensors) is an error, as in torch.optim; one listed twice in
    the same group is kept once, with a warning as torch gives (``stacklevel``: the caller's own, one frame
    added here)."""
    out = ParamGroups()
    bare_group = None
    source: Iterable
    if model_parameters is not None:
        if isinstance(model_parameters, torch.Tensor):
            raise TypeError("model_parameters: expected an iterable of tensors or param-group dicts, got one "
                            "tensor (wrap it in a list)")
        source = model_parameters
    elif isinstance(client_optimizer, torch.optim.Optimizer):
        source = [p for g in client_optimizer.param_groups for p in g["params"]]
    else:
        source = model.parameters()
    where: dict[int, tuple[int, int]] = {}  # id(tensor) -> (its param group, its model_parameters index)
    names = {id(p): n for n, p in model.named_parameters()}
    warned = False
    for index, item in enumerate(source):
        if isinstance(item, dict) and "params" not in item:
            raise Zero8ValueError(f"model_parameters[{index}]: a param group without 'params'")
        if isinstance(item, dict) and model_parameters is not None:
            out.given_dicts.append(item)
        group = item["params"] if isinstance(item, dict) else [item]
        if isinstance(group, torch.Tensor):
            group = [group]
        if isinstance(item, dict) and model_parameters is not None:
            out.group_dicts.append(item)
            hg = len(out.group_dicts) - 1
        else:
            if bare_group is None:
                out.group_dicts.append({})
                bare_group = len(out.group_dicts) - 1
            hg = bare_group
        for p in group:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"model_parameters: expected tensors or param-group dicts, got {type(p).__name__}")
            first = where.get(id(p))
            if first is None:
                where[id(p)] = (hg, index)
                if p.requires_grad:
                    out.params.append(p)
                    out.hyper_group.append(hg)
                continue
            name = f"'{names[id(p)]}'" if id(p) in names else f"of shape {tuple(p.shape)}"
            if first[0] != hg:
                raise Zero8ValueError(
                    f"model_parameters[{first[1]}] and model_parameters[{index}]: parameter {name} is in both "
                    f"(param groups {first[0]} and {hg}); a parameter may be in one param group only, as in "
                    f"torch.optim")
            if not warned:
                warned = True
                warnings.warn(
                    f"model_parameters: param group {hg} lists parameter {name} more than once; it is trained "
                    f"once (torch.optim warns too: \"optimizer contains a parameter group with duplicate "
                    f"parameters\")", stacklevel=stacklevel + 1)
    if not out.group_dicts:
        out.group_dicts.append({})
    if isinstance(client_optimizer, torch.optim.Optimizer):
        _groups_from_client(out, client_optimizer)
    return out


def _groups_from_client(groups: ParamGroups, client: torch.optim.Optimizer) -> None:
    """With a client optimizer, its param groups are the hyper groups (param_groups is its list)."""
    of: dict[int, int] = {}
    for gi, g in enumerate(client.param_groups):
        for p in g["params"]:
            of.setdefault(id(p), gi)
    missing = [i for i, p in enumerate(groups.params) if id(p) not in of]
    if missing:
        p = groups.params[missing[0]]
        raise Zero8ValueError(
            f"optimizer: {len(missing)} parameter(s) to train (first: one of shape {tuple(p.shape)}) are in none of "
            f"the client optimizer's param groups; build the optimizer over the parameters to train")
    groups.hyper_group = [of[id(p)] for p in groups.params]
    groups.group_dicts = list(client.param_groups)


def override_hyper_groups(params: list, hyper_group: list[int], sc, client, algo: str) -> tuple[list[int], list]:
    """Each parameter's hyper group in the sharded optimizer, and the override groups [(param group,
    overrides)]. A parameter with per-parameter hyperparameters (zero8.optim's override_config or
    GlobalOptimManager, bitsandbytes' too) steps in a hyper group of its own, after the param groups, shared
    by the parameters of one param group with the same overrides: its param group's values with the
    overrides in their place, at every step (so an overridden lr stays fixed while a scheduler changes the
    group's, as in bitsandbytes and zero8.optim). The others step in their param group's. Appends the
    override groups' Hyper to sc.group_hypers. Overrides are read here, once."""
    override_groups: list[tuple[int, dict]] = []
    hypers = list(sc.group_hypers)
    known: dict[tuple[int, str], int] = {}
    out = []
    for i, p in enumerate(params):
        gi = hyper_group[i]
        over = {k: v for k, v in _param_overrides(p, client).items() if k not in _STATE_OVERRIDE_KEYS}
        if not over:
            out.append(gi)
            continue
        key = (gi, override_key(over))
        if key not in known:
            known[key] = len(hypers)
            override_groups.append((gi, over))
            hypers.append(_hyper_with_overrides(hypers[gi], over, algo))
        out.append(known[key])
    sc.group_hypers = hypers
    return out, override_groups


def fp32_state(p: torch.Tensor, name: str, sc, client) -> bool:
    """Whether a parameter keeps 32-bit states: zero8.optim's per-parameter optim_bits=32 (e.g.
    zero8.nn.StableEmbedding) or a per-parameter min_8bit_size above its size. (Per-parameter
    hyperparameters: override_hyper_groups.)"""
    cfg = _param_overrides(p, client)
    if cfg.get("optim_bits") == 8 and sc.bits == 32:
        raise Zero8NotSupportedError(
            f"parameter {name}: optim_bits=8 override while the engine keeps 32-bit states"
        )
    return cfg.get("optim_bits") == 32 or ("min_8bit_size" in cfg and p.numel() < int(cfg["min_8bit_size"]))


def override_key(overrides: dict) -> str:
    """The overrides as a key that equal values share however they are spelled (0 and 0.0, a list and a
    tuple of betas), so that they make one override group."""
    def norm(v):
        if isinstance(v, (list, tuple)):
            return tuple(norm(x) for x in v)
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
    return repr(sorted((k, norm(v)) for k, v in overrides.items()))


def override_group_text(param_group, overrides) -> str:
    """What an override group is, for errors: its param group and the overrides (JSON lists as tuples)."""
    shown = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
    return f"the override group of param group {param_group} for parameters with override_config {shown}"


def built_client_optimizer(model: torch.nn.Module, model_parameters, client_optimizer):
    """(client optimizer, model_parameters): a client optimizer given as a callable is built first, as
    DeepSpeed builds it: over model_parameters as given (param-group dicts keep their own hyperparameters),
    or over all the module's parameters, as one list (a generator is read once, here, and its list returned
    for the parameters to optimize to be read from)."""
    if not callable(client_optimizer) or isinstance(client_optimizer, torch.optim.Optimizer):
        return client_optimizer, model_parameters  # None or an optimizer instance
    if isinstance(model_parameters, torch.Tensor):
        raise TypeError("model_parameters: expected an iterable of tensors or param-group dicts, got one "
                        "tensor (wrap it in a list)")
    if model_parameters is not None:
        model_parameters = list(model_parameters)
    client_optimizer = client_optimizer(list(model.parameters()) if model_parameters is None else model_parameters)
    return client_optimizer, model_parameters
