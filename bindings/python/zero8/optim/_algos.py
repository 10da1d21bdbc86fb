"""The optimizer-algorithm table (``_C.algo_table()``, kernels/include/zero8/kernels/optim_table.h) as Python
uses it: zero8.optim's constructors, group keys, argument checks and state-dict names, and the engine's
translation of client optimizers (torch.optim, zero8.optim, bitsandbytes) and param groups into the C++
``Hyper``. Every name and default comes from the table's rows; nothing here lists an algorithm.

A row's entries have a key in each library: ``key`` (zero8's, which is torch.optim's where torch has it),
``deepspeed``, ``torch`` and ``bnb`` (None: that library has no such argument). ``"betas[1]"`` is element 1
of the sequence ``betas`` (the k-th entry whose key names it: bitsandbytes' RMSprop keeps alpha and momentum
as betas, with other arguments between them in the row).
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from .. import _C
from .._C import Zero8NotSupportedError, Zero8ValueError

__all__ = [
    "GROUP_KEYS",
    "client_optimizer_spec",
    "f32",
    "group_from_hyper",
    "hyper_for_group",
    "hyper_from_group",
    "hyper_with_overrides",
    "rows",
    "spec",
    "with_bnb_names",
]

ROWS: Tuple["_C.AlgoSpec", ...] = tuple(_C.algo_table())
_BY_NAME = {r.name: r for r in ROWS}

# The keys every bitsandbytes group holds whatever its algorithm (Optimizer1State/2State), and the AdEMAMix
# knobs its 2-state groups add: facts about bitsandbytes' base classes, not about an algorithm.
BNB_COMMON_KEYS = ("lr", "betas", "eps", "weight_decay")
BNB_2STATE_KEYS = ("alpha", "t_alpha", "t_beta3")

# The engine's param groups may differ in these (each gets its own hyper group); the other hyperparameters
# must be equal across groups.
GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "momentum", "alpha")

_VALUE_ROLES = ("value", "init")
_ABSENT = object()


def rows() -> Tuple["_C.AlgoSpec", ...]:
    """The table's rows, in Algo order."""
    return ROWS


def spec(algo) -> "_C.AlgoSpec":
    """The row of an algorithm: a ``_C.Algo`` or its name ("adamw")."""
    name = algo.name if isinstance(algo, _C.Algo) else str(algo)
    row = _BY_NAME.get(name)
    if row is None:
        raise Zero8ValueError(f"unknown optimizer algorithm {algo!r}; the table has {', '.join(_BY_NAME)}")
    return row


def split_key(key: str) -> Tuple[str, Optional[int]]:
    """'betas[1]' -> ('betas', 1); 'lr' -> ('lr', None)."""
    base, bracket, rest = key.partition("[")
    return (base, int(rest.rstrip("]"))) if bracket else (key, None)


class Arg(NamedTuple):
    """One argument or group key of a row in one library's naming: a scalar entry, or the entries of one
    sequence (``betas``)."""

    name: str
    entries: Tuple["_C.HyperSpec", ...]
    lib: str = "key"

    @property
    def is_sequence(self) -> bool:
        return split_key(getattr(self.entries[0], self.lib))[1] is not None

    @property
    def first(self) -> "_C.HyperSpec":
        return self.entries[0]

    def default(self, which: str = "py_default"):
        """The default (py_default, torch_default or ds_default): a tuple for a sequence."""
        values = tuple(getattr(e, which) for e in self.entries)
        return values if self.is_sequence else values[0]


@functools.lru_cache(maxsize=None)
def args(name: str, lib: str = "key", roles: Tuple[str, ...] = ()) -> Tuple[Arg, ...]:
    """The row's entries that `lib` ("key", "deepspeed", "torch", "bnb") names, grouped into arguments by that
    name, in the row's order; only `roles` when given."""
    out: List[Arg] = []
    for e in spec(name).hyper:
        k = getattr(e, lib)
        if k is None or (roles and e.role not in roles):
            continue
        base, index = split_key(k)
        at = next((i for i, a in enumerate(out) if a.name == base), None) if index is not None else None
        if at is None:
            out.append(Arg(base, (e,), lib))
        else:
            out[at] = Arg(base, out[at].entries + (e,), lib)
    return tuple(out)


@functools.lru_cache(maxsize=None)
def value_args(name: str) -> Tuple[Arg, ...]:
    """The row's hyperparameters (value and init entries), by zero8's keys."""
    return args(name, "key", _VALUE_ROLES)


# ---------------------------------------------------------------------------------------------------
# Reading a param group whatever library named its keys

def _lookup(group: dict, e: "_C.HyperSpec", name: str):
    """The value of entry `e` of row `name` in a param group that uses zero8's (= torch's), bitsandbytes' or
    DeepSpeed's key for it (tried in that order); _ABSENT when it has none. A sequence must hold exactly the
    elements the row reads from it (ValueError)."""
    for lib in ("key", "bnb", "deepspeed"):
        k = getattr(e, lib)
        if k is None:
            continue
        base, index = split_key(k)
        if base not in group:
            continue
        value = group[base]
        if index is None:
            return value
        count = sum(1 for f in spec(name).hyper if getattr(f, lib) and split_key(getattr(f, lib))[0] == base)
        try:
            items = tuple(value)
        except TypeError:
            raise ValueError(f"{base} must be a sequence of {count} numbers, got {value!r}") from None
        if len(items) != count:
            raise ValueError(f"{base} must hold {count} values, got {value!r}")
        return items[index]
    return _ABSENT


def _convert(e: "_C.HyperSpec", value):
    if e.is_flag:
        return bool(value)
    return 0.0 if value is None else float(value)


# ---------------------------------------------------------------------------------------------------
# zero8.optim: what a class of a row holds and reads

@functools.lru_cache(maxsize=None)
def group_keys(name: str) -> Tuple[str, ...]:
    """zero8.optim's group hyperparameters of a row: its value and init entries that are constructor
    arguments (e.g. Adam's bias_correction is DeepSpeed's only)."""
    return tuple(a.name for a in value_args(name) if a.first.py_arg != "none")


@functools.lru_cache(maxsize=None)
def defaults_keys(name: str) -> Tuple[Arg, ...]:
    """What a zero8.optim constructor puts in ``defaults``: the group hyperparameters and the decouple flag
    (AdamW's too, which is not an argument: its groups record the rule they apply)."""
    return tuple(a for a in args(name) if (a.first.role in _VALUE_ROLES and a.first.py_arg != "none")
                 or a.first.role == "decouple")


@functools.lru_cache(maxsize=None)
def constructor_args(name: str) -> Tuple[Arg, ...]:
    """The row's zero8.optim constructor arguments, in its order."""
    return tuple(a for a in args(name) if a.first.py_arg != "none")


@functools.lru_cache(maxsize=None)
def decouple_arg(name: str) -> Optional[Arg]:
    return next((a for a in args(name) if a.first.role == "decouple"), None)


@functools.lru_cache(maxsize=None)
def init_arg(name: str) -> Optional[Arg]:
    return next((a for a in args(name) if a.first.role == "init"), None)


def hyper_of_config(name: str, cfg: Dict[str, Any], num) -> "_C.Hyper":
    """The C++ Hyper of a zero8.optim parameter config (group values with overrides) for row `name`: each of
    the class's hyperparameters from cfg (its default when cfg lacks it, e.g. a group saved before the key
    existed), the others at the row's defaults. `num(value, name)` converts and names a bad value."""
    h = _C.Hyper()
    keys = group_keys(name)
    for a in value_args(name):
        given = cfg.get(a.name, _ABSENT) if a.name in keys else _ABSENT
        if given is _ABSENT:
            values = [e.py_default for e in a.entries]
        elif a.is_sequence:
            values = list(given)[:len(a.entries)]
        else:
            values = [given]
        for e, v in zip(a.entries, values):
            where = e.key if a.is_sequence else a.name
            setattr(h, e.field, bool(v) if e.is_flag else num(v, where))
    return h


def bnb_aliases(name: str, group: Dict[str, Any]) -> Dict[str, Any]:
    """The keys bitsandbytes' optimizer of the same algorithm reads from a group under its own names (SGD:
    betas = (momentum, dampening), eps = 0), for state dicts that bitsandbytes loads."""
    out: Dict[str, Any] = {}
    for a in args(name, "bnb"):
        if a.name in group or all(e.bnb == e.key and e.role != "bnb_const" for e in a.entries):
            continue
        values = tuple(e.py_default if e.role == "bnb_const" else group.get(e.key, e.py_default) for e in a.entries)
        out[a.name] = values if a.is_sequence else values[0]
    return out


def from_bnb_names(name: str, saved: Dict[str, Any]) -> Dict[str, Any]:
    """zero8's keys of a saved bitsandbytes group: the hyperparameters it keeps under other names (SGD's
    momentum as betas[0]) and the fixed arguments found there (RMSprop's momentum as betas[1]), for keys the
    group lacks (a sequence only when all its elements are found)."""
    out: Dict[str, Any] = {}
    for a in args(name, "key", _VALUE_ROLES + ("fixed",)):
        if a.name in saved or any(e.bnb is None or e.bnb == e.key for e in a.entries):
            continue
        values = []
        for e in a.entries:
            bbase, bindex = split_key(e.bnb)
            value = saved.get(bbase)
            if value is not None and bindex is not None:
                value = value[bindex] if len(value) > bindex else None
            values.append(value)
        if all(v is not None for v in values):
            out[a.name] = tuple(values) if a.is_sequence else values[0]
    return out


def dropped_on_load(name: str, num_states: int) -> Tuple[str, ...]:
    """Group keys a loaded state dict may hold that this row's zero8.optim class drops: bitsandbytes' names
    of its hyperparameters and constants, the arguments it accepts only at their default or ignores, and
    bitsandbytes' AdEMAMix knobs in 2-state groups."""
    own = set(group_keys(name))
    out: List[str] = []
    for e in spec(name).hyper:
        for k in (e.bnb, e.torch) if e.role in ("fixed", "ignored", "bnb_const") else (e.bnb,):
            base = split_key(k)[0] if k else None
            if base and base not in own and base not in out:
                out.append(base)
    if num_states == 2:
        out += [k for k in BNB_2STATE_KEYS if k not in out and k not in own]
    return tuple(out)


def state_dict_name(name: str) -> str:
    """The algorithm name zero8.optim records in state dicts: a decoupled form records the row it is the
    decoupled form of (AdamW's are Adam's: the same class family, the rule in decoupled_weight_decay)."""
    return next((r.name for r in ROWS if r.decoupled.name == name and r.name != name), name)


def loads_from(name: str) -> Tuple[str, ...]:
    """Other algorithms whose state dicts this row's class continues (LAMB: Adam's moments)."""
    other = spec(name).loads_from.name
    return () if other == name else (other,)


@functools.lru_cache(maxsize=None)
def all_value_keys() -> Tuple[str, ...]:
    """Every hyperparameter key of any row (zero8's names; value roles only), in table order."""
    out: List[str] = []
    for r in ROWS:
        for a in args(r.name, "key", ("value",)):
            if a.name not in out:
                out.append(a.name)
    return tuple(out)


@functools.lru_cache(maxsize=None)
def algo_group_keys() -> Tuple[str, ...]:
    """Group keys that tell the algorithms apart: every hyperparameter key and bitsandbytes' 2-state knobs,
    but the keys every bitsandbytes group holds."""
    keys = [k for r in ROWS for a in value_args(r.name) for k in (a.name,)]
    keys += list(BNB_2STATE_KEYS)
    out: List[str] = []
    for k in keys:
        if k not in BNB_COMMON_KEYS and k not in out:
            out.append(k)
    return tuple(out)


@functools.lru_cache(maxsize=None)
def torch_state_names() -> Tuple[str, ...]:
    out: List[str] = []
    for r in ROWS:
        out += [s for s in r.torch_states if s and s not in out]
    return tuple(out)


@functools.lru_cache(maxsize=None)
def value_specs() -> Dict[str, Arg]:
    """One Arg per hyperparameter key of the table (its checks: type and range), from the first row that has
    it; every row must give a key the same type, range and length (the table test checks)."""
    out: Dict[str, Arg] = {}
    for r in ROWS:
        for a in value_args(r.name):
            out.setdefault(a.name, a)
    return out


# ---------------------------------------------------------------------------------------------------
# The engine: client optimizers and param groups -> the C++ Hyper

def f32(x: float) -> float:
    """A float32 hyperparameter as the shortest decimal that rounds to it (0.003, not 0.0030000000261)."""
    x32 = torch.tensor(x, dtype=torch.float32).item()
    for digits in range(1, 10):
        v = float(f"{x32:.{digits}g}")
        if torch.tensor(v, dtype=torch.float32).item() == x32:
            return v
    return x32


def with_bnb_names(group: dict, algo: str) -> dict:
    """A param group with zero8's (torch's) names for what bitsandbytes keeps under its own: its SGD and LARS
    store ``betas = (momentum, dampening)``, its RMSprop ``betas = (alpha, momentum)``. Groups that have
    zero8's names (torch.optim, zero8.optim, the engine's own) are returned as they are."""
    found = from_bnb_names(algo, group)
    if not found:
        return group
    out = dict(group)
    out.update(found)
    return out


def hyper_from_group(group: dict, algo: str, hyper) -> None:
    """Write a param group's (possibly scheduler-changed) hyperparameters into the C++ Hyper: every value and
    init entry of the row that the group holds, under zero8's, bitsandbytes' or DeepSpeed's key; lr is
    required."""
    hyper.lr = float(group["lr"])
    for e in spec(algo).hyper:
        if e.role not in _VALUE_ROLES or e.field == "lr":
            continue
        value = _lookup(group, e, algo)
        if value is not _ABSENT:
            setattr(hyper, e.field, _convert(e, value))


def hyper_for_group(base, group: dict, algo: str):
    """A copy of the C++ Hyper ``base`` with a param group's own values (hyper_from_group)."""
    h = copy.copy(base)
    hyper_from_group(group, algo, h)
    return h


def hyper_with_overrides(base, over: dict, algo: str):
    """A copy of a param group's C++ Hyper with per-parameter overrides (zero8.optim's override keys but
    optim_bits/min_8bit_size/master_weights) in place of its values."""
    return hyper_for_group(base, {**group_from_hyper(algo, base), **over}, algo)


def group_from_hyper(algo: str, h) -> dict:
    """The param-group hyperparameters of a C++ Hyper (what schedulers read and write): every value and init
    entry of the row, by zero8's keys."""
    g: dict[str, Any] = {}
    for a in value_args(algo):
        values = tuple(bool(getattr(h, e.field)) if e.is_flag else f32(getattr(h, e.field)) for e in a.entries)
        g[a.name] = values if a.is_sequence else values[0]
    return g


def check_groups_equal(groups: list[dict], keys) -> None:
    g0 = groups[0]
    for i, g in enumerate(groups[1:], 1):
        for k in keys:
            if k in g0 and g.get(k) != g0.get(k):
                raise Zero8NotSupportedError(
                    f"optimizer.param_groups[{i}].{k}: {g.get(k)!r} differs from param_groups[0]'s {g0.get(k)!r}; "
                    f"zero8's param groups may differ only in {', '.join(GROUP_KEYS)}"
                )


@functools.lru_cache(maxsize=None)
def _hyper_keys() -> Tuple[str, ...]:
    """Group keys that are hyperparameters or flags of some row, in any library's naming, and torch's
    maximize: the ones that must be equal across a client's groups unless in GROUP_KEYS."""
    out: List[str] = []
    for r in ROWS:
        for e in r.hyper:
            if e.role in ("bnb_const", "ignored"):
                continue
            for k in (e.key, e.torch, e.bnb, e.deepspeed):
                base = split_key(k)[0] if k else None
                if base and base not in out:
                    out.append(base)
    return tuple(out) + ("maximize",)


def _client_row(module: str, name: str, opt, bits: int):
    """(row, bits) of a torch.optim or bitsandbytes client class, or (None, bits)."""
    if module.startswith("torch.optim"):
        return next((r for r in ROWS if r.torch == name), None), bits
    if module.startswith("bitsandbytes"):
        base = name
        for suffix, b in (("8bit", 8), ("32bit", 32)):
            if base.endswith(suffix):
                base, bits = base[: -len(suffix)], b
                break
        base = base.removeprefix("Paged")
        ob = getattr(getattr(opt, "args", None), "optim_bits", None)
        if ob in (8, 32) and not name.endswith(("8bit", "32bit")):
            bits = int(ob)
        return next((r for r in ROWS if base in r.bnb), None), bits
    return None, bits


def client_optimizer_spec(opt, zero8_enabled: bool, config_bits: int) -> dict:
    """{algo, bits, hyper: {field: value}, name, min_8bit_size?} of a client optimizer instance.

    Read from its class and param_groups[0]; "group_hypers" holds each group's Hyper (they may differ
    in GROUP_KEYS, the rest must be equal). The classes of the table: torch.optim's (Adam runs adamw when
    decoupled_weight_decay), zero8.optim's optimizers (their own ``algo``: Adam's follows its
    decoupled_weight_decay) and bitsandbytes' (8bit / 32bit by name or optim_bits; its Adam decoupled, as
    bitsandbytes applies it).
    """
    cls = type(opt)
    name = cls.__name__
    module = cls.__module__ or ""
    bits = config_bits if zero8_enabled else 32
    if module.startswith("zero8") and isinstance(getattr(opt, "algo", None), _C.Algo):
        # zero8.optim: its own algorithm (the instance's: Adam's depends on decoupled_weight_decay), state
        # bits, block size and Hyper construction.
        groups = opt.param_groups
        check_groups_equal(groups, tuple(k for k in groups[0] if k != "params" and k not in GROUP_KEYS))
        g0 = groups[0]
        out = {"algo": opt.algo.name, "bits": int(g0.get("optim_bits", opt.optim_bits)),
               "hyper_obj": opt._hyper(g0), "name": f"{module}.{name}",
               "min_8bit_size": int(g0.get("min_8bit_size", opt.min_8bit_size)),
               "state_block": int(g0.get("block_size", opt.block_size))}
        out["hyper"] = {"lr": float(g0["lr"])}
        out["group_hypers"] = [opt._hyper(g) for g in groups]
        init = init_arg(out["algo"])
        if init is not None:
            out["hyper"][init.first.field] = float(g0.get(init.name, init.default()))
        return out
    row, bits = _client_row(module, name, opt, bits)
    if row is None:
        torch_names = ", ".join(r.torch for r in ROWS if r.torch)
        bnb_names = ", ".join(r.class_name for r in ROWS if r.bnb)
        raise Zero8NotSupportedError(
            f"optimizer: a client optimizer of type {module}.{name} cannot run sharded; zero8 maps "
            f"torch.optim.{{{torch_names}}}, zero8.optim optimizers and bitsandbytes' 8-bit ones "
            f"({bnb_names}); or use an \"optimizer\" config section"
        )
    groups = opt.param_groups
    if not groups:
        raise Zero8ValueError("optimizer: the client optimizer has no param groups")
    check_groups_equal(groups, tuple(k for k in _hyper_keys() if k not in GROUP_KEYS))
    g0 = groups[0]
    for flag in ("amsgrad", "maximize", "centered"):
        if g0.get(flag):
            raise Zero8NotSupportedError(f"optimizer.param_groups[0].{flag}: {flag}=True is not supported")
    algo = row.name
    for e in row.hyper:
        value = _lookup(g0, e, algo)
        if value is _ABSENT:
            continue
        if e.role == "fixed" and _convert(e, value) != _convert(e, e.torch_default):
            raise Zero8NotSupportedError(f"optimizer.param_groups[0].{e.key}: {row.class_name} with {e.key} is "
                                         f"not supported ({e.key}={value!r}): {e.why}")
        if e.role == "decouple" and bool(value):
            algo = row.decoupled.name
    hyper: dict[str, Any] = {}
    for e in row.hyper:
        if e.role in _VALUE_ROLES:
            value = _lookup(g0, e, row.name)
            hyper[e.field] = _convert(e, e.torch_default if value is _ABSENT else value)
    out = {"algo": algo, "bits": bits, "hyper": hyper, "name": f"{module}.{name}"}
    m8 = getattr(getattr(opt, "args", None), "min_8bit_size", None)
    if isinstance(m8, int):
        out["min_8bit_size"] = m8
    return out
