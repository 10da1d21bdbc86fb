"""The optimizer-algorithm table (``_C.algo_table()``) against the libraries whose names it records and the
code it drives, walked row by row with nothing listed by hand:

- every argument of torch.optim's and bitsandbytes' class for a row is an entry of the row, with the same
  default (a row that dropped a hyperparameter fails here; tests/cpp/test_optim_table.cpp checks the rows
  against the kernels and the DeepSpeed config);
- zero8.optim's class of each row takes each hyperparameter under its name, writes it to its Hyper field
  and steps as the kernel with that field set, as torch.optim's class does where there is one, and as
  bitsandbytes' names of it (state-dict aliases) say;
- state dicts keep their keys (bitsandbytes' group keys and values, torch's state names);
- the engine's translation of a client optimizer of each kind (zero8.optim, torch.optim, bitsandbytes where
  installed) gives the row's Hyper.
"""

from __future__ import annotations

import inspect
import math
import warnings

import pytest
import torch

import zero8.optim as zo
from zero8 import _C
from zero8.optim import _algos

ROWS = _C.algo_table()
IDS = [r.name for r in ROWS]
FIELDS = [f for f in dir(_C.Hyper()) if not f.startswith("_") and f not in ("step", "grad_scale")]
# torch.optim's implementation flags (which kernel runs, not what it computes): not hyperparameters.
TORCH_IMPL_FLAGS = {"foreach", "maximize", "capturable", "differentiable", "fused"}
# bitsandbytes' 8-bit knobs, which zero8.optim takes too (Optimizer8bit), not per algorithm.
BNB_KNOBS = {"params", "optim_bits", "args", "min_8bit_size", "percentile_clipping", "block_wise", "is_paged"}


def _bnb():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install bitsandbytes)")


def _f32(x: float) -> float:
    return float(torch.tensor(float(x), dtype=torch.float32).item())


def _pick(e, index: int):
    """A value of entry e in its range that differs from its defaults and from other entries' values."""
    if e.is_flag:
        return not e.py_default
    lo, hi, lo_open, hi_open = e.range
    t = 0.2 + 0.07 * index
    return lo + (hi - lo) * t if math.isfinite(hi) else e.py_default * 1.5 + t


def _value_args(row, with_arg=True):
    return [a for a in _algos.value_args(row.name) if not with_arg or a.first.py_arg != "none"]


def _with_rules(row, kwargs: dict) -> dict:
    """kwargs made valid by the rules between fields: Nesterov momentum needs momentum > 0 and no dampening."""
    by_field = {e.field: a.name for a in _algos.value_args(row.name) for e in a.entries if e.field}
    if kwargs.get(by_field.get("nesterov")):
        kwargs[by_field["dampening"]] = 0.0
        if not kwargs.get(by_field["beta1"]):
            kwargs[by_field["beta1"]] = 0.5
    return kwargs


def _base_kwargs(row) -> dict:
    """zero8.optim keyword arguments with every real hyperparameter in play (not at its default)."""
    out = {}
    index = 0
    for a in _value_args(row):
        values = []
        for e in a.entries:
            values.append(e.py_default if e.is_flag else _pick(e, index))
            index += 1
        out[a.name] = tuple(values) if a.is_sequence else values[0]
    return _with_rules(row, out)


def _perturbations(row):
    """(arg, kwargs off, kwargs on) per hyperparameter: the base, and the base with that one changed so that
    any step reading it moves (a trust-ratio clip to a bound every ratio hits, the other clip off)."""
    base = _base_kwargs(row)
    by_field = {e.field: a.name for a in _algos.value_args(row.name) for e in a.entries if e.field}
    for a in _value_args(row):
        on = dict(base)
        field = a.first.field
        if a.is_sequence:
            on[a.name] = tuple(v + 0.05 for v in base[a.name])
        elif a.first.is_flag:
            on[a.name] = not base[a.name]
        elif field == "max_trust_ratio":
            on[a.name] = 1e-3
            on[by_field.get("min_trust_ratio", a.name)] = 0.0 if "min_trust_ratio" in by_field else 1e-3
        elif field == "min_trust_ratio":
            on[a.name] = 1e3
            on[by_field.get("max_trust_ratio", a.name)] = 0.0 if "max_trust_ratio" in by_field else 1e3
        else:
            on[a.name] = base[a.name] * 0.5 + (0.0 if a.first.role == "init" else 0.01)
        on = _with_rules(row, on)
        # The base with the same companions (Nesterov's dampening, the other clip): only `a` differs.
        off = {k: (base[k] if k == a.name else on[k]) for k in on}
        yield a, off, on


def _expected_hyper(row, kwargs: dict):
    """The Hyper the table says kwargs mean: each value entry's field, the row's default where not given."""
    h = _C.Hyper()
    for a in _algos.value_args(row.name):
        given = kwargs.get(a.name)
        values = (list(given) if a.is_sequence else [given]) if given is not None else [e.py_default for e in a.entries]
        for e, v in zip(a.entries, values):
            setattr(h, e.field, bool(v) if e.is_flag else float(v))
    return h


def _same_fields(h, want):
    return {f: (getattr(h, f), getattr(want, f)) for f in FIELDS if getattr(h, f) != getattr(want, f)}


def _bnb_kwargs(cls, kwargs: dict) -> dict:
    """The kwargs a bitsandbytes class takes and accepts (its Adagrad refuses lr_decay and
    initial_accumulator_value other than 0; its SGD a momentum of 0)."""
    names = inspect.signature(cls).parameters
    out = {k: v for k, v in kwargs.items() if k in names and k in ("lr", "momentum")}
    for k, v in kwargs.items():
        if k in names and k not in out:
            try:
                cls([_param()], **out, **{k: v})
            except ValueError:
                continue
            out[k] = v
    return out


def _cls(row, bits=32):
    return getattr(zo, f"{row.class_name}{bits}bit")


def _decoupled_as_torch(row) -> dict:
    """The decouple flag at torch.optim's default (zero8.optim's Adam decouples by default, torch's does not)."""
    arg = _algos.decouple_arg(row.name)
    return {arg.name: arg.default("torch_default")} if arg is not None and arg.first.py_arg != "none" else {}


def _steps(opt, p, steps=3):
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        p.grad = torch.randn(p.shape, generator=g) * 0.3
        opt.step()
    return p.detach().clone()


def _param():
    g = torch.Generator().manual_seed(3)
    return torch.nn.Parameter(torch.randn(300, generator=g) + 2.0)


# ---- the rows against torch.optim and bitsandbytes ----

def test_every_row_has_its_classes_and_enum_value():
    assert list(_C.Algo.__members__) == IDS
    for row in ROWS:
        for name in (row.class_name, f"{row.class_name}8bit", f"{row.class_name}32bit"):
            cls = getattr(zo, name)
            assert cls._GROUP_KEYS == _algos.group_keys(row.name)
            assert cls._TORCH_STATE_KEYS == tuple(row.torch_states)
            opt = cls([_param()])
            switch = _algos.decouple_arg(row.name)
            on = switch is not None and switch.first.py_arg != "none" and switch.default()
            assert opt.algo == (row.decoupled if on else row.algo)
            assert opt.num_states == row.num_states


@pytest.mark.parametrize("row", [r for r in ROWS if r.torch], ids=[r.name for r in ROWS if r.torch])
def test_row_has_every_torch_optim_argument_with_its_default(row):
    cls = getattr(torch.optim, row.torch)
    torch_args = {n: p.default for n, p in inspect.signature(cls).parameters.items()
                  if n != "params" and n not in TORCH_IMPL_FLAGS}
    group = {k: v for k, v in cls([_param()]).param_groups[0].items() if k != "params"}
    mine = {a.name: a for a in _algos.args(row.name, "torch")}
    assert set(torch_args) <= set(mine), f"torch.optim.{row.torch} arguments missing from the row"
    for name, a in mine.items():
        assert name in torch_args or name in group, f"{name}: not an argument or group key of torch.optim.{row.torch}"
        want = torch_args.get(name, group.get(name))
        got = a.default("torch_default")
        assert (tuple(want) if a.is_sequence else want) == got, name


@pytest.mark.parametrize("row", [r for r in ROWS if r.bnb], ids=[r.name for r in ROWS if r.bnb])
def test_row_has_every_bitsandbytes_argument_and_group_key(row):
    bnb = _bnb()
    ctor = {a.name: a for a in _algos.constructor_args(row.name)}
    group_keys = {a.name for a in _algos.args(row.name, "bnb")} | set(_algos.BNB_2STATE_KEYS)
    for stem in row.bnb:
        cls = getattr(bnb.optim, f"{stem}8bit")
        for name, p in inspect.signature(cls).parameters.items():
            if name in BNB_KNOBS:
                continue
            assert name in ctor, f"bitsandbytes' {stem}8bit argument {name} is not an argument of the row"
            if stem == row.class_name and p.default is not inspect.Parameter.empty:
                assert p.default == ctor[name].default(), name
        kw = {"momentum": 0.9} if "momentum" in inspect.signature(cls).parameters else {}
        saved = cls([_param()], lr=0.01, **kw).param_groups[0]
        assert set(saved) - {"params"} <= group_keys, f"{stem}8bit keeps keys the row does not name"


# ---- zero8.optim ----

@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_each_hyperparameter_reaches_its_hyper_field(row):
    for a, _, on in _perturbations(row):
        p = _param()
        opt = _cls(row)([p], **on)
        h = opt._hyper(opt._config(opt.param_groups[0], p))
        assert not _same_fields(h, _expected_hyper(row, on)), a.name
        # The same through a per-parameter override, where the key may be one.
        if a.name in zo.optimizer._OVERRIDE_KEYS:
            opt = _cls(row)([p], **{k: v for k, v in on.items() if k != a.name})
            opt.override_config(p, a.name, on[a.name])
            assert not _same_fields(opt._hyper(opt._config(opt.param_groups[0], p)), _expected_hyper(row, on)), a.name


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_one_step_is_the_kernel_with_the_table_fields(row):
    """Each hyperparameter moves the step (none is dropped on the way), and the step is the kernel's with the
    Hyper the table gives."""
    for a, off, on in _perturbations(row):
        results = []
        for kwargs in (off, on):
            p = _param()
            opt = _cls(row)([p], **kwargs)
            got = _steps(opt, p)
            q = _param()
            ref = _cls(row)([q], **kwargs)
            h = _expected_hyper(row, kwargs)
            ref._hyper = lambda cfg, h=h: _C.Hyper(**{f: getattr(h, f) for f in FIELDS})
            assert torch.equal(got, _steps(ref, q)), a.name
            results.append((got, opt.state[p]["state1"].clone()))
        if a.first.role == "init":  # read when the state is made: it shows in the state
            assert not torch.equal(results[0][1], results[1][1]), a.name
        else:
            assert not (torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])), \
                f"{a.name} does not change the step"


@pytest.mark.parametrize("row", [r for r in ROWS if r.torch], ids=[r.name for r in ROWS if r.torch])
def test_one_step_matches_torch_optim_for_each_hyperparameter(row):
    """torch.optim's class with the same arguments, under torch's names (the ones it has)."""
    torch_names = {a.name for a in _algos.args(row.name, "torch")}
    for a, _, on in _perturbations(row):
        if a.name not in torch_names:
            continue
        kwargs = {k: v for k, v in on.items() if k in torch_names}
        kwargs.update(_decoupled_as_torch(row))
        p, q = _param(), _param()
        got = _steps(_cls(row)([p], **kwargs), p)
        want = _steps(getattr(torch.optim, row.torch)([q], **kwargs, foreach=False), q)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{a.name}: {m}")


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_bitsandbytes_names_of_each_hyperparameter_load(row):
    """A state dict in bitsandbytes' naming (SGD's betas = (momentum, dampening)) loads as the same values."""
    aliased = [a for a in _value_args(row) if any(e.bnb not in (None, e.key) for e in a.entries)]
    p = _param()
    opt = _cls(row, 8)([p], min_8bit_size=0, **_base_kwargs(row))
    _steps(opt, p, steps=1)
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        assert _algos.bnb_aliases(row.name, {}).keys() <= g.keys()  # written for bitsandbytes
        for a in aliased:
            del g[a.name]
        del g["zero8_algorithm"]
    q = _param()
    fresh = _cls(row, 8)([q], min_8bit_size=0)
    fresh.load_state_dict(sd)
    for a in aliased:
        assert fresh.param_groups[0][a.name] == pytest.approx(opt.param_groups[0][a.name]), a.name
    assert not _same_fields(fresh._hyper(fresh._config(fresh.param_groups[0], q)),
                            opt._hyper(opt._config(opt.param_groups[0], p)))


@pytest.mark.parametrize("row", [r for r in ROWS if r.bnb], ids=[r.name for r in ROWS if r.bnb])
def test_state_dict_groups_carry_bitsandbytes_keys_and_values(row):
    bnb = _bnb()
    stem = row.class_name if row.class_name in row.bnb else row.bnb[0]
    kwargs = _bnb_kwargs(getattr(bnb.optim, f"{stem}8bit"), _base_kwargs(row))
    ours = _cls(row, 8)([_param()], **kwargs).state_dict()["param_groups"][0]
    theirs = getattr(bnb.optim, f"{stem}8bit")([_param()], **kwargs).param_groups[0]
    for k, v in theirs.items():
        if k != "params" and k not in _algos.BNB_2STATE_KEYS:
            assert k in ours, k
            assert (tuple(ours[k]) if isinstance(v, tuple) else ours[k]) == pytest.approx(v), k


@pytest.mark.parametrize("bits", [8, 32])
@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_state_dicts_keep_their_keys(row, bits):
    p = _param()
    opt = _cls(row, bits)([p], min_8bit_size=0, **_base_kwargs(row))
    _steps(opt, p, steps=2)
    sd = opt.state_dict()
    per_state = ("state", "absmax", "qmap") if bits == 8 else ("state",)
    assert set(sd["state"][0]) == {"step"} | {f"{k}{i}" for i in range(1, row.num_states + 1) for k in per_state}
    defaults = {a.name for a in _algos.defaults_keys(row.name)}
    assert set(sd["param_groups"][0]) == {"params", "zero8_algorithm"} | defaults | set(_algos.bnb_aliases(row.name, {}))
    if bits == 32:
        # torch.optim's names of the states (lion-pytorch's for Lion) load as the same states.
        renamed = {"state": {0: {"step": sd["state"][0]["step"]}}, "param_groups": sd["param_groups"]}
        for i, name in enumerate(row.torch_states, 1):
            renamed["state"][0][name] = sd["state"][0][f"state{i}"]
        q = p.detach().clone().requires_grad_()
        a, b = _cls(row)([q]), _cls(row)([p])
        a.load_state_dict(renamed)
        b.load_state_dict(sd)
        assert torch.equal(_steps(a, q, steps=1), _steps(b, p, steps=1))


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_generated_classes_step_as_the_written_ones(row):
    """The classes a row without a module gets (table_classes) have the written class's signature and steps."""
    gen, gen8, gen32 = zo.table_classes(row.name, __name__)
    assert gen.__name__ == row.class_name and gen8.__name__ == f"{row.class_name}8bit"
    written = getattr(zo, row.class_name)
    assert inspect.signature(gen) == inspect.signature(written)
    kwargs = _base_kwargs(row)
    p, q = _param(), _param()
    assert torch.equal(_steps(gen8([p], min_8bit_size=0, **kwargs), p),
                       _steps(written([q], optim_bits=8, min_8bit_size=0, **kwargs), q))


# ---- the engine's translation of client optimizers ----

def _client_hyper(opt):
    spec = _algos.client_optimizer_spec(opt, True, 8)
    h = spec.get("hyper_obj")
    if h is None:
        h = _C.Hyper()
        for k, v in spec["hyper"].items():
            setattr(h, k, v)
    return spec, h


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_engine_reads_each_kind_of_client_as_the_row(row):
    kwargs = _base_kwargs(row)
    want = _expected_hyper(row, kwargs)
    z8 = _cls(row, 8)([_param()], **kwargs)
    clients = [("zero8", z8, z8.algo)]
    if row.torch:
        torch_names = {a.name for a in _algos.args(row.name, "torch")}
        tk = {k: v for k, v in kwargs.items() if k in torch_names}
        tk.update(_decoupled_as_torch(row))
        clients.append(("torch", getattr(torch.optim, row.torch)([_param()], **tk), row.algo))
    try:
        bnb = _bnb() if row.bnb else None
    except pytest.skip.Exception:
        bnb = None
    for stem in row.bnb if bnb else ():
        cls = getattr(bnb.optim, f"{stem}8bit")
        bk = _bnb_kwargs(cls, kwargs)
        clients.append((f"bitsandbytes {stem}8bit", cls([_param()], **bk), row.algo))
    for kind, client, algo in clients:
        spec, h = _client_hyper(client)
        assert spec["algo"] == algo.name, kind
        # What the client holds reaches the Hyper; what its library cannot hold is the row's torch default.
        expect = _C.Hyper(**{f: getattr(want, f) for f in FIELDS})
        for e in row.hyper:
            if e.field and e.role in ("value", "init") and not _held(client, e):
                setattr(expect, e.field, e.torch_default)
        assert not _same_fields(h, expect), kind
        # A param group written back from the Hyper reads as the same Hyper (schedulers go through it).
        again = _algos.hyper_for_group(_C.Hyper(), _algos.group_from_hyper(algo.name, h), algo.name)
        assert not _same_fields(again, h), kind


def _held(client, e) -> bool:
    """Whether a client's group holds entry e under any library's key."""
    g = client.param_groups[0]
    return any(k and k.partition("[")[0] in g for k in (e.key, e.bnb, e.deepspeed))


def test_engine_runs_torch_adam_decoupled_as_adamw_by_the_row():
    row = _algos.spec("adam")
    switch = _algos.decouple_arg("adam")
    for on in (False, True):
        client = torch.optim.Adam([_param()], **{switch.name: on})
        assert _algos.client_optimizer_spec(client, True, 8)["algo"] == (row.decoupled if on else row.algo).name
