"""The DeepSpeed-style training engine: ``zero8.initialize(model=..., config=...)`` wraps a torch model
around zero8's ZeRO stage 1/2 sharded optimizer (``_C.ShardedOptimizer``). The model's trainable
parameters become zero-copy views into the optimizer's working buffer, and (fp32) their ``.grad`` views
into its gradient buffer, so autograd accumulates straight into C++ memory; post-accumulate-grad hooks
report each gradient as ready, so stage 2 reduces full buckets while backward is still running.

    engine, optimizer, _, lr_scheduler = zero8.initialize(model=model, model_parameters=model.parameters(),
                                                          config="ds_config.json")
    for batch in data:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()

Names, signatures and return values follow deepspeed.initialize / DeepSpeedEngine; differences are
listed in ``initialize``'s docstring.
"""

from __future__ import annotations

import atexit
import builtins
import copy
import gc
import io
import json
import math
import os
import re
import sys
import threading
import time
import types
import warnings
import weakref
from collections.abc import Mapping
from typing import Any, Callable, Iterable

import torch

from . import _C
from ._C import Zero8NotSupportedError, Zero8ValueError
from .config import Zero8Config, load_config, raw_value
from .lr_schedules import Zero8LRScheduler, scheduler_from_config
# The translation of client optimizers and param groups into the C++ Hyper, driven by the algorithm table.
from .optim._algos import GROUP_KEYS as _GROUP_KEYS
from .optim._algos import client_optimizer_spec as _client_optimizer_spec
from .optim._algos import f32 as _f32
from .optim._algos import group_from_hyper as _group_from_hyper
from .optim._algos import hyper_for_group as _hyper_for_group
from .optim._algos import hyper_from_group as _hyper_from_group
from .optim._algos import hyper_with_overrides as _hyper_with_overrides

__all__ = ["initialize", "Zero8Engine", "Zero8Optimizer", "MODEL_STATES_FILE", "world_comm"]

# DeepSpeed's file name for the model weights of model-parallel rank 0 (the only one here): a plain
# torch.save of {'module': state_dict, ...}, so torch.load alone rebuilds the model.
MODEL_STATES_FILE = "mp_rank_00_model_states.pt"
# The keys of that file a load consumes, which load_checkpoint leaves out of the client_state it returns
# (every other key comes back, as in DeepSpeed's _load_checkpoint): with load_module_only the module alone,
# else the module and the engine counters. Keys DeepSpeed writes and zero8 does not (optimizer, param_shapes,
# sparse_tensor_module_names, data_sampler, random_ltd, ...) are listed where DeepSpeed lists them.
_LOADED_KEYS_MODULE_ONLY = ("module",)
_LOADED_KEYS = ("module", "sparse_tensor_module_names", "skipped_steps", "global_steps", "dp_world_size",
                "mp_world_size", "data_sampler", "random_ltd")
# torch.nn.Module.state_dict's key suffix for a module's get_extra_state().
_EXTRA_STATE_SUFFIX = "_extra_state"
# DeepSpeed's deepspeed_io routes (deepspeed.runtime.constants.ROUTE_*).
ROUTE_TRAIN, ROUTE_EVAL, ROUTE_PREDICT, ROUTE_ENCODE = "train", "eval", "predict", "encode"
_ROUTES = (ROUTE_TRAIN, ROUTE_EVAL, ROUTE_PREDICT, ROUTE_ENCODE)
_ENGINE_STATE_FORMAT = "zero8-engine"
_ENGINE_STATE_VERSION = 1
# The words of the C++ layout check (zero8/src/checkpoint.cpp, ckpt::load) for a parameter in another hyper
# group than in the checkpoint, where the engine says which of the two are override groups
# (Zero8Engine._hyper_groups_named).
_HYPER_GROUP_MISMATCH = re.compile(
    r"is in param group (?P<saved>\d+) in the checkpoint, param group (?P<here>\d+) here")
# The torch dtypes the checkpoint's model_rest.safetensors stores (frozen parameters and buffers), by
# their safetensors names.
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}

# ---------------------------------------------------------------------------------------------
# The world communicator: one per process, kept for the process's lifetime (the MPI backend finalizes
# MPI when its last communicator is destroyed, after which no new one can be made).
# ---------------------------------------------------------------------------------------------
_world_lock = threading.Lock()
_world: dict[str, Any] = {}
_engines: "weakref.WeakSet[Zero8Engine]" = weakref.WeakSet()


def _shutdown() -> None:
    """At exit: release every engine (its parameters get their own memory, so nothing references the C++
    buffers), then the world communicator, so the last communicator is destroyed while the interpreter is
    whole and MPI is finalized (otherwise mpirun reports the ranks as exiting improperly).

    A rank that exits on an uncaught exception (Python has printed it and set sys.last_value) ends the
    whole job instead: its peers may be waiting for it in a collective, and a normal exit would leave
    them there until the communicator timeout (1800 s by default). A Zero8CommError is the exception: its
    world has already failed, and every rank reports its own view of that failure."""
    comm = _world.get("comm")
    exc = getattr(sys, "last_value", None)
    if comm is not None and comm.size > 1 and exc is not None and not isinstance(exc, _C.Zero8CommError):
        print(f"[zero8] rank {comm.rank}: exiting on an uncaught {type(exc).__name__}; ending the job so that "
              f"the other ranks do not wait for it", file=sys.stderr, flush=True)
        comm.abort(1)
    for engine in list(_engines):
        engine.destroy()
    _world.clear()
    gc.collect()


def world_comm(backend: str = "auto") -> "_C.Communicator":
    """The process's world communicator ('auto': MPI under mpirun, single-process otherwise), created on
    first use. Asking later for another backend than the one made is an error."""
    with _world_lock:
        comm = _world.get("comm")
        if comm is None:
            comm = _C.comm_create(backend)
            _world["comm"] = comm
            atexit.register(_shutdown)
            _world["backend"] = backend
        elif backend not in ("auto", comm.backend):
            raise Zero8ValueError(
                f"zero8.comm_backend: '{backend}' requested, but this process already uses the "
                f"'{comm.backend}' world communicator"
            )
        return comm


def _local_rank() -> int:
    for var in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"):
        v = os.environ.get(var)
        if v is not None and v.strip().lstrip("-").isdigit():
            return int(v)
    return 0


# ---------------------------------------------------------------------------------------------
# Client optimizers: their type and hyperparameters become the sharded optimizer's algorithm/Hyper.
# ---------------------------------------------------------------------------------------------

def _param_overrides(p: torch.Tensor, client) -> dict:
    """Per-parameter settings of zero8.optim (GlobalOptimManager, e.g. a StableEmbedding weight, and the
    client optimizer's override_config)."""
    cfg: dict = {}
    try:
        from .optim import param_config
    except ImportError:  # zero8.optim not installed: no overrides can exist
        return cfg
    cfg.update(param_config(p))
    own = getattr(client, "_overrides", None)
    if own is not None and p in own:
        cfg.update(own[p])
    return cfg


# Per-parameter overrides that choose the state format rather than a hyperparameter (master_weights: the
# engine keeps float32 masters of every parameter anyway).
_STATE_OVERRIDE_KEYS = ("optim_bits", "min_8bit_size", "master_weights")


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


class Zero8Optimizer(torch.optim.Optimizer):
    """The optimizer ``zero8.initialize`` returns (DeepSpeed returns its ZeRO optimizer wrapper): a
    ``torch.optim.Optimizer`` over the engine's parameters whose ``step()`` is the sharded step, so torch
    LR schedulers can drive it through ``param_groups``: one group per param group of model_parameters (or
    one for all), each group's lr/betas/momentum/alpha/weight_decay/eps read before every step; with a
    client optimizer, param_groups is the client's own list.

    The optimizer states live in C++ (sharded, 8-bit): ``state_dict()`` holds the hyperparameters and
    counters only; full states are saved by ``engine.save_checkpoint``. ``zero_grad()`` does nothing:
    the engine clears its gradient buffers after each reduction.
    """

    # torch wraps add_param_group to keep TorchDynamo out, which imports torch._dynamo (seconds of start-up
    # per process) on first use; this optimizer is never compiled, so the plain function is used.
    add_param_group = getattr(torch.optim.Optimizer.add_param_group, "__wrapped__",
                              torch.optim.Optimizer.add_param_group)

    def __init__(self, engine: "Zero8Engine", params: list, defaults: dict, client=None):
        # params: tensors (one group) or param-group dicts, one per hyper group of the sharded optimizer.
        super().__init__(params, defaults)
        if client is not None:
            self.param_groups = client.param_groups  # torch schedulers on the client drive this one too
        self._engine = engine
        self.client_optimizer = client

    @property
    def loss_scale(self) -> float:
        return float(self._engine._opt.loss_scale)

    cur_scale = loss_scale

    @property
    def overflow(self) -> bool:
        return self._engine._last_info is not None and bool(self._engine._last_info["skipped"])

    def step(self, closure=None):
        if closure is not None:
            raise Zero8NotSupportedError("Zero8Optimizer.step(closure): closures are not supported")
        if not self._engine._in_step:
            # loss.backward() + optimizer.step() would step on gradients no rank has reduced (stage 1) or
            # only the first time (stage 2), and the counters and LR scheduler would not advance.
            raise RuntimeError(
                "optimizer.step(): zero8's optimizer steps through the engine; use engine.backward(loss) and "
                "engine.step() (they reduce the gradients over the ranks, step at the accumulation boundary and "
                "advance the LR scheduler) instead of loss.backward() and optimizer.step()"
            )
        self._engine._optimizer_step()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def refresh_fp32_params(self) -> None:
        """This rank's fp32 masters from the model's weights, after they were changed in place (e.g.
        ``engine.module.load_state_dict(...)``); without it the next step starts from the old masters and
        overwrites the change. As DeepSpeed's ZeRO optimizer: not collective, every rank should hold the
        same weights. Under fp16/bf16 the masters take the 16-bit values."""
        self._engine._check_live()
        self._engine._opt.refresh_masters()

    def state_dict(self) -> dict:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"param_groups": groups, "steps": int(self._engine._opt.steps),
                "loss_scale": float(self._engine._opt.loss_scale)}

    def load_state_dict(self, state_dict: dict) -> None:
        for g, saved in zip(self.param_groups, state_dict.get("param_groups", [])):
            for k, v in saved.items():
                if k != "params":
                    g[k] = tuple(v) if k == "betas" else v


# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------

_engine_count = 0


class Zero8Engine(torch.nn.Module):
    """DeepSpeedEngine's training surface over zero8's sharded optimizer (see the module docstring).

    Not done here: pipeline/model parallelism (mpu), ZeRO stage 3, offload.
    """

    def __init__(self, model: torch.nn.Module, config: Zero8Config, dp: "_C.Communicator",
                 world: "_C.Communicator", model_parameters=None, client_optimizer=None, client_lr_scheduler=None):
        super().__init__()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.module = model
        self.zero8_config = config
        self.config = config.dict
        self._dp = dp
        self._world = world
        self.global_rank = world.rank
        self.world_size = world.size
        self.local_rank = _local_rank()
        self.dp_world_size = dp.size
        self.mp_world_size = 1
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._last_info: dict | None = None
        self._grad_norm: float | None = None  # of the last applied step (a skipped one computes none)
        self._step_applied = False
        self._backward_done = False
        self._in_step = False  # engine.step() is calling optimizer.step()
        self._bytes = {"gradients": 0, "step": 0}
        self._hooks: list = []
        self.collate_fn = None  # initialize's collate_fn, deepspeed_io's default
        self._dataloader_drop_last = False  # the config's dataloader_drop_last (initialize sets it)
        d = config.dict
        self._gas = int(d["gradient_accumulation_steps"])
        self._fp16 = bool(d["fp16"]["enabled"])
        self._bf16 = bool(d["bf16"]["enabled"])
        self._auto_cast = self._fp16 and bool(d["fp16"].get("auto_cast", False))
        self._steps_per_print = int(d.get("steps_per_print", 10))
        self._ignore_unused = bool(d["zero_optimization"].get("ignore_unused_parameters", True))
        # wall_clock_breakdown: seconds spent in forward / backward (of which gradient reduction) / step
        # since the last progress report, and the micro-batches and steps they cover.
        self._wall_clock = bool(d.get("wall_clock_breakdown", False))
        self._timers = self._new_timers()
        self._dtype = torch.float16 if self._fp16 else torch.bfloat16 if self._bf16 else torch.float32
        timeout = d.get("zero8", {}).get("comm_timeout_s")
        if timeout and os.environ.get("ZERO8_COMM_TIMEOUT") is None:
            dp.timeout = float(timeout)

        # A client optimizer given as a callable is built first, as DeepSpeed builds it: over model_parameters
        # as given (param-group dicts keep their own hyperparameters), or over all the module's parameters,
        # as one list (a generator is read once, here). The parameters to optimize are then read from it.
        if client_optimizer is not None and callable(client_optimizer) and not isinstance(
                client_optimizer, torch.optim.Optimizer):
            if isinstance(model_parameters, torch.Tensor):
                raise TypeError("model_parameters: expected an iterable of tensors or param-group dicts, got one "
                                "tensor (wrap it in a list)")
            if model_parameters is not None:
                model_parameters = list(model_parameters)
            client_optimizer = client_optimizer(
                list(model.parameters()) if model_parameters is None else model_parameters)

        # Parameters to optimize: the client's list (or param groups) or all trainable ones, in order.
        params = self._collect_params(model, model_parameters, client_optimizer)
        if not params:
            raise Zero8ValueError("model_parameters: no trainable parameters (requires_grad=True) to optimize")
        for p in params:
            if p.device.type != "cpu":
                raise Zero8NotSupportedError(f"parameter on {p.device}: zero8's engine trains CPU models")
        names = {id(p): n for n, p in model.named_parameters()}
        self._params = params
        self._param_names = [names.get(id(p), f"param{i}") for i, p in enumerate(params)]
        upcast = []
        for name, p in zip(self._param_names, params):
            if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise Zero8NotSupportedError(
                    f"parameter {name} is {p.dtype}: zero8's engine trains float32, bfloat16 or float16 parameters "
                    f"(cast the model first, e.g. model.float())")
            if p.dtype != self._dtype:
                upcast.append(name)
        if upcast and self._dtype == torch.float32 and world.rank == 0:
            warnings.warn(
                f"{len(upcast)} parameter(s) in 16 bits (first: {upcast[0]}) are trained in float32: the config "
                f"enables neither \"fp16\" nor \"bf16\", so the engine holds its working copy in float32",
                stacklevel=3)

        # The sharded optimizer: from the config's optimizer section, or the client optimizer's type.
        sc = _C.shard_config_from_json(config.json, dp.size)
        zero8_on = bool(config.info.get("zero8_enabled"))
        z8 = d.get("zero8", {})
        if client_optimizer is not None and config.info.get("optimizer_present"):
            raise Zero8ValueError(
                "optimizer: both a client optimizer and an \"optimizer\" config section were given; pass one"
            )
        if client_optimizer is not None:
            spec = _client_optimizer_spec(client_optimizer, zero8_on, int(z8.get("optim_bits", 8)))
            sc.algo = getattr(_C.Algo, spec["algo"])
            h = spec.get("hyper_obj")
            if h is None:
                h = _C.Hyper()
                for k, v in spec["hyper"].items():
                    setattr(h, k, v)
            sc.hyper = h
            group_hypers = spec.get("group_hypers")
            if group_hypers is None:  # torch / bitsandbytes: group 0's Hyper with each group's own values
                group_hypers = [_hyper_for_group(h, g, spec["algo"]) for g in client_optimizer.param_groups]
            sc.group_hypers = group_hypers
            sc.bits = spec["bits"]
            sc.initial_accumulator = float(spec["hyper"].get("initial_accumulator", 0.0))
            if "min_8bit_size" in spec:
                sc.min_8bit_size = spec["min_8bit_size"]
            if "state_block" in spec:
                sc.state_block = spec["state_block"]
            self._optimizer_name = spec["name"]
        elif config.info.get("optimizer_present"):
            self._optimizer_name = config.info["optimizer_name"]
        else:
            raise Zero8ValueError(
                "optimizer: no optimizer; give an \"optimizer\" section in the config or pass optimizer= "
                "(zero8's engine is for training)"
            )
        self._algo = str(sc.algo.name)  # "adamw", "sgd", ...
        _check_group_overrides(self._param_group_dicts, _group_from_hyper(self._algo, sc.hyper))
        if client_optimizer is None:
            # The config's optimizer: each param group of model_parameters steps with the config's values
            # and its own _GROUP_KEYS (a group of bare tensors with the config's alone).
            defaults = _group_from_hyper(self._algo, sc.hyper)
            sc.group_hypers = [
                _hyper_for_group(sc.hyper, {**defaults, **{k: v for k, v in d.items() if k in _GROUP_KEYS}}, self._algo)
                for d in self._hyper_group_dicts]
        if self._dtype != torch.float32:
            model.to(self._dtype)  # as DeepSpeed's engine casts the module (half() / bfloat16())
        hyper_of = self._override_hyper_groups(params, sc, client_optimizer)
        specs = [_C.ParamSpec(self._param_names[i], list(p.shape), self._fp32_state(p, i, sc, client_optimizer),
                              hyper_of[i])
                 for i, p in enumerate(params)]
        self._opt = _C.ShardedOptimizer(specs, sc, dp)
        self._shard_config = sc

        # Parameters become views into the working buffer (and fp32 grads views into the grad buffer).
        self._bind_params()
        self._opt.init(0)  # rank 0's weights everywhere; masters from them
        self._broadcast_rest()
        self._register_hooks()
        self._destroyed = False
        _engines.add(self)

        # The optimizer object handed back, and the LR scheduler.
        defaults = _group_from_hyper(self._algo, self._opt.hyper)
        groups: list = list(params)
        if client_optimizer is None and self._param_group_dicts:  # the dicts' groups, their other keys kept
            groups = []
            for h, d in enumerate(self._hyper_group_dicts):
                extra = {k: v for k, v in d.items() if k != "params" and k not in defaults}  # e.g. a "name"
                groups.append({**extra, **_group_from_hyper(self._algo, self._opt.group_hyper(h)),
                               "params": [p for p, hg in zip(params, self._hyper_group) if hg == h]})
        self.optimizer = Zero8Optimizer(self, groups, defaults, client=client_optimizer)
        self.client_optimizer = client_optimizer
        self.lr_scheduler = None
        if client_lr_scheduler is not None:
            # A class (which has a step attribute too) or a function is a factory called with the optimizer, as
            # DeepSpeed calls any callable; a scheduler instance is kept.
            if isinstance(client_lr_scheduler, type) or (
                    callable(client_lr_scheduler) and not hasattr(client_lr_scheduler, "step")):
                client_lr_scheduler = client_lr_scheduler(self.optimizer)
            self.lr_scheduler = client_lr_scheduler
        else:
            base_lr = None if config.info.get("optimizer_present") else float(self.optimizer.param_groups[0]["lr"])
            self.lr_scheduler = scheduler_from_config(self.optimizer, config.json, dp.size, base_lr)
        self._apply_hyper()
        if self.global_rank == 0:
            self._log(
                f"zero8 engine: {self._optimizer_name} ({self._algo}, {sc.bits}-bit states), ZeRO stage {sc.stage}, "
                f"{self.dp_world_size} rank(s) on "
                f"{dp.backend}, {self._dtype}, {sum(p.numel() for p in params)} parameters, "
                f"gradients on the wire: {'int8' if sc.int8_grads else 'bf16' if sc.bf16_grads else 'fp32'}"
                f"{' (stochastic rounding)' if sc.stochastic_wire and sc.int8_grads else ''}"
            )

    # ---- setup ----
    def _collect_params(self, model, model_parameters, client_optimizer) -> list:
        """The parameters to optimize, in order, without duplicates or frozen ones. A parameter in two param
        groups (two dicts, or a dict and the bare tensors) is an error, as in torch.optim; one listed twice in
        the same group is kept once, with a warning as torch gives. Sets self._hyper_group (each parameter's
        param group: the client optimizer's group, else the model_parameters dict it came from, the bare
        tensors of model_parameters forming one group) and self._hyper_group_dicts (those groups' dicts, {}
        for the bare tensors); the dicts of model_parameters are also kept in self._param_group_dicts for
        _check_group_overrides."""
        self._param_group_dicts = []
        self._hyper_group_dicts: list[dict] = []
        self._hyper_group: list[int] = []
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
        out = []
        where: dict[int, tuple[int, int]] = {}  # id(tensor) -> (its param group, its model_parameters index)
        names = {id(p): n for n, p in model.named_parameters()}
        warned = False
        for index, item in enumerate(source):
            if isinstance(item, dict) and "params" not in item:
                raise Zero8ValueError(f"model_parameters[{index}]: a param group without 'params'")
            if isinstance(item, dict) and model_parameters is not None:
                self._param_group_dicts.append(item)
            group = item["params"] if isinstance(item, dict) else [item]
            if isinstance(group, torch.Tensor):
                group = [group]
            if isinstance(item, dict) and model_parameters is not None:
                self._hyper_group_dicts.append(item)
                hg = len(self._hyper_group_dicts) - 1
            else:
                if bare_group is None:
                    self._hyper_group_dicts.append({})
                    bare_group = len(self._hyper_group_dicts) - 1
                hg = bare_group
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise TypeError(f"model_parameters: expected tensors or param-group dicts, got {type(p).__name__}")
                first = where.get(id(p))
                if first is None:
                    where[id(p)] = (hg, index)
                    if p.requires_grad:
                        out.append(p)
                        self._hyper_group.append(hg)
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
                        f"parameters\")", stacklevel=4)
        if not self._hyper_group_dicts:
            self._hyper_group_dicts.append({})
        if isinstance(client_optimizer, torch.optim.Optimizer):
            self._groups_from_client(out, client_optimizer)
        return out

    def _groups_from_client(self, params: list, client: torch.optim.Optimizer) -> None:
        """With a client optimizer, its param groups are the hyper groups (param_groups is its list)."""
        of: dict[int, int] = {}
        for gi, g in enumerate(client.param_groups):
            for p in g["params"]:
                of.setdefault(id(p), gi)
        missing = [i for i, p in enumerate(params) if id(p) not in of]
        if missing:
            p = params[missing[0]]
            raise Zero8ValueError(
                f"optimizer: {len(missing)} parameter(s) to train (first: one of shape {tuple(p.shape)}) are in none of "
                f"the client optimizer's param groups; build the optimizer over the parameters to train")
        self._hyper_group = [of[id(p)] for p in params]
        self._hyper_group_dicts = list(client.param_groups)

    def _override_hyper_groups(self, params: list, sc, client) -> list[int]:
        """Each parameter's hyper group in the sharded optimizer. A parameter with per-parameter
        hyperparameters (zero8.optim's override_config or GlobalOptimManager, bitsandbytes' too) steps in a
        hyper group of its own, after the param groups, shared by the parameters of one param group with the
        same overrides: its param group's values with the overrides in their place, at every step (so an
        overridden lr stays fixed while a scheduler changes the group's, as in bitsandbytes and zero8.optim).
        The others step in their param group's. Sets self._override_groups [(param group, overrides)] and
        appends their Hyper to sc.group_hypers. Overrides are read here, once."""
        self._override_groups: list[tuple[int, dict]] = []
        hypers = list(sc.group_hypers)
        known: dict[tuple[int, str], int] = {}
        out = []
        for i, p in enumerate(params):
            gi = self._hyper_group[i]
            over = {k: v for k, v in _param_overrides(p, client).items() if k not in _STATE_OVERRIDE_KEYS}
            if not over:
                out.append(gi)
                continue
            key = (gi, _override_key(over))
            if key not in known:
                known[key] = len(hypers)
                self._override_groups.append((gi, over))
                hypers.append(_hyper_with_overrides(hypers[gi], over, self._algo))
            out.append(known[key])
        sc.group_hypers = hypers
        return out

    def _fp32_state(self, p: torch.Tensor, i: int, sc, client) -> bool:
        """Whether parameter i keeps 32-bit states: zero8.optim's per-parameter optim_bits=32 (e.g.
        zero8.nn.StableEmbedding) or a per-parameter min_8bit_size above its size. (Per-parameter
        hyperparameters: _override_hyper_groups.)"""
        cfg = _param_overrides(p, client)
        if cfg.get("optim_bits") == 8 and sc.bits == 32:
            raise Zero8NotSupportedError(
                f"parameter {self._param_names[i]}: optim_bits=8 override while the engine keeps 32-bit states"
            )
        return cfg.get("optim_bits") == 32 or ("min_8bit_size" in cfg and p.numel() < int(cfg["min_8bit_size"]))

    def _bind_params(self) -> None:
        opt = self._opt
        wbuf, gbuf = {}, {}
        for g in range(_C.NUM_GROUPS):
            if opt.group_padded(g) > 0:
                wbuf[g] = torch.frombuffer(opt.working_buffer(g), dtype=self._dtype)
                gbuf[g] = torch.frombuffer(opt.grad_buffer(g), dtype=torch.float32)
        self._grad_views = []
        with torch.no_grad():
            for i, p in enumerate(self._params):
                g, off, n = opt.param_slot(i)
                wv = wbuf[g][off:off + n].view(p.shape)
                wv.copy_(p.data)
                p.data = wv
                gv = gbuf[g][off:off + n].view(p.shape)
                self._grad_views.append(gv)
                p.grad = gv if self._dtype == torch.float32 else None
        self._working_buffers, self._grad_buffers = wbuf, gbuf

    def _broadcast_rest(self) -> None:
        """Frozen parameters and buffers: rank 0's values everywhere (DeepSpeed broadcasts the module)."""
        if self._dp.size == 1:
            return
        managed = {id(p) for p in self._params}
        tensors = [p for p in self.module.parameters() if id(p) not in managed] + list(self.module.buffers())
        for t in tensors:
            if t.numel() == 0 or t.device.type != "cpu":
                continue
            src = t.data if t.data.is_contiguous() else t.data.contiguous()
            self._dp.broadcast_ptr(src.data_ptr(), src.numel() * src.element_size(), 0)
            if src is not t.data:
                t.data.copy_(src)

    def _register_hooks(self) -> None:
        # A parameter's gradient may arrive in several parts in one backward: a weight shared by segments
        # of reentrant activation checkpointing, where each segment runs a backward of its own (one backward
        # sums every use of a weight before its hook runs). Stage 2 reduces a bucket once all its
        # parameters are reported, so a parameter is reported at its last arrival, counted in earlier
        # backwards. The first backward counts them without reporting any (everything is reduced at its
        # end) when some parameter is not in the loss's graph (inside such a segment, or unused); otherwise
        # each arrives once and is reported at once. An arrival beyond the largest count seen is still in
        # time while its bucket waits, and raises if the bucket was reduced: that part would be lost.
        # (DeepSpeed's stage 2 asserts on any second arrival.)
        self._arrivals = [0] * len(self._params)  # this micro-batch
        self._expected = [0] * len(self._params)  # the most arrivals a backward has seen
        self._counting = False  # this backward only counts (the first one, when the graph hides parameters)
        self._backwards = 0
        self._in_backward = False
        fp32 = self._dtype == torch.float32
        for i, p in enumerate(self._params):
            gv = self._grad_views[i]

            def hook(param, i=i, gv=gv):
                grad = param.grad
                if grad is not None and grad.data_ptr() != gv.data_ptr():
                    # A 16-bit gradient (or one torch made after the user cleared .grad): accumulate it
                    # into the fp32 buffer the optimizer reads.
                    gv.add_(grad)
                    param.grad = gv if fp32 else None
                if not self._in_backward:
                    return  # a backward outside engine.backward (the torch loop): its gradient just stays
                self._arrivals[i] += 1
                if not self._counting:
                    self._gradient_arrived(i)

            self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    def _params_outside_graph(self, loss: torch.Tensor) -> bool:
        """Whether some trainable parameter is not a leaf of loss's autograd graph (walked once)."""
        wanted = {id(p) for p in self._params}
        seen, stack = set(), [loss.grad_fn]
        while stack and wanted:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            var = getattr(fn, "variable", None)  # AccumulateGrad: the leaf it accumulates into
            if var is not None:
                wanted.discard(id(var))
            stack.extend(nxt for nxt, _ in fn.next_functions)
        return bool(wanted)

    def _gradient_arrived(self, i: int) -> None:
        n, expected = self._arrivals[i], max(1, self._expected[i])
        if n == expected:
            self._opt.grad_ready(i)  # stage 2: reduces the buckets this gradient completes
        elif n > expected:
            self._expected[i] = n
            if self._opt.param_reduced(i):
                raise RuntimeError(
                    f"rank {self.global_rank}: parameter '{self._param_names[i]}' got a part of its gradient "
                    f"({n} parts in this backward, at most {expected} before) after ZeRO stage 2 had reduced it: "
                    f"that part would be lost. A weight shared by more uses in one backward than in earlier "
                    f"ones (reentrant activation checkpointing, data-dependent reuse) varies its count; the "
                    f"next backwards wait for {n} parts. Use stage 1, or torch.utils.checkpoint with "
                    f"use_reentrant=False, to avoid it altogether")

    def destroy(self) -> None:
        """Release the engine (DeepSpeed's engine.destroy()): hooks removed, the parameters keep their
        current values in their own memory (no longer views of the C++ buffers), and the sharded optimizer
        and communicator are dropped. The engine cannot train afterwards; runs at exit for live engines."""
        if self.__dict__.get("_destroyed", True):
            return
        self._destroyed = True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        with torch.no_grad():
            for p in self._params:
                p.data = p.data.clone()
                p.grad = None
        self._grad_views = []
        self._working_buffers, self._grad_buffers = {}, {}
        self._opt = None
        self._dp = None
        self._world = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """DeepSpeed's engine.zero_grad(): clears the gradients of the module's parameters the engine does
        not optimize (trainable ones left out of model_parameters). The others are the engine's: their
        gradients are its accumulation buffers (in fp32, param.grad is a view of one), which backward and
        step reduce and clear. Clearing them here would drop the micro-batches accumulated so far (stage 1),
        where DeepSpeed's zero_grad cannot reach its accumulated gradients, so they are left alone."""
        managed = set() if self.__dict__.get("_destroyed", True) else {id(p) for p in self._params}
        for p in self.module.parameters():
            if id(p) in managed or p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().requires_grad_(False)
                p.grad.zero_()

    def _check_live(self) -> None:
        if self._opt is None:
            raise RuntimeError("this zero8 engine was destroyed (engine.destroy() or interpreter exit)")

    # ---- DeepSpeed's accessors ----
    def train_batch_size(self) -> int:
        return int(self.config["train_batch_size"])

    def train_micro_batch_size_per_gpu(self) -> int:
        return int(self.config["train_micro_batch_size_per_gpu"])

    def gradient_accumulation_steps(self) -> int:
        return self._gas

    def steps_per_print(self) -> int:
        return self._steps_per_print

    def zero_optimization_stage(self) -> int:
        return int(self.config["zero_optimization"]["stage"])

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def gradient_clipping(self) -> float:
        return float(self.config.get("gradient_clipping", 0.0))

    def fp16_enabled(self) -> bool:
        return self._fp16

    def bfloat16_enabled(self) -> bool:
        return self._bf16

    def get_data_types(self):
        return self._dtype, torch.float32

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def loss_scale(self) -> float:
        return float(self._opt.loss_scale)

    cur_scale = loss_scale

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self._gas == 0

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_mom(self) -> list:
        out = []
        for g in self.optimizer.param_groups:
            out.append(tuple(g["betas"]) if "betas" in g else g.get("momentum"))
        return out

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm (before clipping) of the last applied step, None before the first.
        As in DeepSpeed, a step skipped on an fp16 overflow leaves the previous step's value."""
        return self._grad_norm

    def was_step_skipped(self) -> bool:
        return self._last_info is not None and bool(self._last_info["skipped"]) and not self._step_applied

    # ---- forward / backward / step ----
    def forward(self, *args, **kwargs):
        t0 = time.perf_counter()
        if self._auto_cast:
            args = tuple(_cast_floating(a, self._dtype) for a in args)
            kwargs = {k: _cast_floating(v, self._dtype) for k, v in kwargs.items()}
        out = self.module(*args, **kwargs)
        self._timers["forward"] += time.perf_counter() - t0
        return out

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is not None and hasattr(module, name):
                return getattr(module, name)
            raise

    def no_sync(self, *args, **kwargs):
        """DeepSpeed's context for backwards that skip the gradient all-reduce; not supported: zero8 runs one
        engine.backward per micro-batch, each followed by engine.step (a second backward before step is an
        error), and gradient_accumulation_steps already gives what no_sync is for."""
        raise Zero8NotSupportedError(
            "engine.no_sync(): not supported; zero8 runs one engine.backward(loss) and one engine.step() per "
            "micro-batch (two backwards without a step are an error). Set gradient_accumulation_steps in the config "
            "instead: at ZeRO stage 1 the gradients are reduced once per step, at the accumulation boundary, which "
            "is what no_sync gives; at stage 2 each backward reduces its buckets as they fill (DeepSpeed refuses "
            "no_sync at stage 2 too)")

    def train_batch(self, *args, **kwargs):
        """DeepSpeed's PipelineEngine.train_batch; not supported (no pipeline parallelism)."""
        raise Zero8NotSupportedError(
            "engine.train_batch(): DeepSpeed's PipelineEngine method; zero8 has no pipeline parallelism. Train "
            "each micro-batch with loss = engine(batch); engine.backward(loss); engine.step() (the optimizer steps "
            "at every gradient_accumulation_steps-th micro-batch)")

    def eval_batch(self, *args, **kwargs):
        """DeepSpeed's PipelineEngine.eval_batch; not supported (no pipeline parallelism)."""
        raise Zero8NotSupportedError(
            "engine.eval_batch(): DeepSpeed's PipelineEngine method; zero8 has no pipeline parallelism. Evaluate "
            "with engine.eval() and, under torch.no_grad(), engine(batch)")

    def _bytes_sent(self) -> int:
        return sum(int(s["bytes"]) for s in self._dp.stats().values())

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backpropagate ``loss`` (divided by gradient_accumulation_steps, times the fp16 loss scale);
        gradients are reduced as they become ready (stage 2) and at the end of this call. Returns the
        loss divided by gradient_accumulation_steps, as DeepSpeed does."""
        self._check_live()
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"backward(loss): loss must be a tensor, got {type(loss).__name__}")
        if self._backward_done:
            raise RuntimeError(
                "engine.backward() called twice without engine.step() in between (one backward per micro-batch)"
            )
        if scale_wrt_gas and self._gas > 1:
            loss = loss / self._gas
        scaled = loss.float() * float(self._opt.loss_scale) if self._fp16 else loss
        if self._backwards == 0:
            self._counting = self._params_outside_graph(scaled)
        self._backwards += 1
        b0 = self._bytes_sent()
        t0 = time.perf_counter()
        self._in_backward = True
        try:
            scaled.backward(retain_graph=retain_graph)
        finally:
            self._in_backward = False
        unused = [] if self._ignore_unused else [
            self._param_names[i] for i, n in enumerate(self._arrivals) if not n]
        t1 = time.perf_counter()
        self._backward_end()  # collective: every rank gets here before any raises below
        t2 = time.perf_counter()
        self._timers["backward"] += t2 - t0
        self._timers["reduce"] += t2 - t1
        self._timers["micro"] += 1
        self._bytes["gradients"] += self._bytes_sent() - b0
        if unused:
            shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
            raise RuntimeError(
                f"rank {self.global_rank}: {len(unused)} trainable parameter(s) got no gradient in this backward: "
                f"{shown}; with zero_optimization.ignore_unused_parameters false this is an error (set it true to "
                f"treat their gradients as zero, or freeze them with requires_grad_(False))"
            )
        return loss

    def _backward_end(self) -> None:
        self._opt.backward_end(self.is_gradient_accumulation_boundary())
        self._expected = [max(e, n) for e, n in zip(self._expected, self._arrivals)]
        self._arrivals = [0] * len(self._params)
        self._counting = False
        self._backward_done = True

    def _apply_hyper(self) -> None:
        """Each param group's current values into its hyper group of the sharded optimizer, and into the
        hyper groups of its parameters with overrides, the overrides in their place."""
        groups = self.optimizer.param_groups
        if len(groups) + len(self._override_groups) != self._opt.num_hyper_groups:
            raise Zero8NotSupportedError(
                f"optimizer.param_groups: {len(groups)} groups, but the engine was built with "
                f"{self._opt.num_hyper_groups - len(self._override_groups)}; param groups cannot be added after "
                f"zero8.initialize")
        for i, g in enumerate(groups):
            _hyper_from_group(g, self._algo, self._opt.group_hyper(i))
        for h, (gi, over) in enumerate(self._override_groups, len(groups)):
            _hyper_from_group({**groups[gi], **over}, self._algo, self._opt.group_hyper(h))

    def _optimizer_step(self) -> dict:
        """The sharded step with the param groups' current hyperparameters (collective)."""
        self._apply_hyper()
        b0 = self._bytes_sent()
        info = dict(self._opt.step())
        self._bytes["step"] += self._bytes_sent() - b0
        self._last_info = info
        return info

    def step(self, lr_kwargs: dict | None = None) -> None:
        """End of a micro-batch: at the gradient-accumulation boundary the sharded optimizer steps
        (skipped on an fp16 overflow anywhere), then the LR scheduler; counters advance as DeepSpeed's."""
        self._check_live()
        boundary = self.is_gradient_accumulation_boundary()
        if not self._backward_done:
            self._backward_end()  # no backward this micro-batch: still the same collectives on every rank
        self._backward_done = False
        self._step_applied = False
        if boundary:
            scaler_before = self._opt.loss_scaler_state
            self._in_step = True
            t0 = time.perf_counter()
            try:
                info = self.optimizer.step() or self._last_info
            finally:
                self._in_step = False
            self._timers["step"] += time.perf_counter() - t0
            self._timers["steps"] += 1
            if info["skipped"]:
                self.skipped_steps += 1
                if self.global_rank == 0 and self._fp16:
                    self._log(self._overflow_message(scaler_before))
                elif self.global_rank == 0:
                    self._log(f"Skipping step {self.global_steps + 1}: a gradient on some rank is inf or NaN "
                              f"(bf16/fp32: no loss scale to lower; the weights and states are unchanged)")
            else:
                self._step_applied = True
                self._grad_norm = float(info["grad_norm"])
                if self.lr_scheduler is not None:
                    opt = getattr(self.lr_scheduler, "optimizer", None)
                    if opt is not None:
                        opt._opt_called = True  # torch schedulers warn when their optimizer never stepped
                    self.lr_scheduler.step(**(lr_kwargs or {}))
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
            if self.global_rank == 0 and self.global_steps % self._steps_per_print == 0:
                self._report_progress()
        self.micro_steps += 1

    def _overflow_message(self, before: dict) -> str:
        """What an fp16 overflow did to the loss scale, worded as DeepSpeed's loss_scaler.py logs it: a static
        scale stays, hysteresis left absorbs the overflow, else the scale drops."""
        cfg = self._opt.config
        if not cfg.dynamic_loss_scale:
            return (f"OVERFLOW! Rank {self.global_rank}: gradient overflow at the static loss scale "
                    f"{before['scale']:g} (fp16.loss_scale): skipping the step")
        head = f"OVERFLOW! Rank {self.global_rank} Skipping step. Attempted loss scale: {before['scale']}"
        after = self._opt.loss_scaler_state
        if after["cur_hysteresis"] < before["cur_hysteresis"]:
            return f"{head}, but hysteresis is {before['cur_hysteresis']}. Reducing hysteresis to {after['cur_hysteresis']}"
        if after["scale"] == before["scale"]:
            return f"{head}: already at the minimum loss scale {cfg.min_loss_scale:g}, keeping it"
        return f"{head}, reducing to {after['scale']}"

    def _report_progress(self) -> None:
        norm = self._grad_norm
        self._log(
            f"step={self.global_steps}, skipped={self.skipped_steps}, lr={self.get_lr()}, mom={self.get_mom()}, "
            f"loss_scale={float(self._opt.loss_scale)}, grad_norm={0.0 if norm is None else norm:.6g}"
        )
        t = self._timers
        if self._wall_clock and t["micro"] and t["steps"]:
            per_micro = lambda k: 1e3 * t[k] / t["micro"]  # noqa: E731
            self._log(
                f"time (ms) per micro-batch | forward: {per_micro('forward'):.2f} | backward: "
                f"{per_micro('backward'):.2f} (gradient reduction {per_micro('reduce'):.2f}) | per step | "
                f"optimizer step: {1e3 * t['step'] / t['steps']:.2f} (rank 0, mean over the last {t['steps']} steps)"
            )
        self._timers = self._new_timers()

    @staticmethod
    def _new_timers() -> dict:
        return {"forward": 0.0, "backward": 0.0, "reduce": 0.0, "step": 0.0, "micro": 0, "steps": 0}

    @staticmethod
    def _log(msg: str) -> None:
        print(f"[zero8] {msg}", flush=True)

    def dataloader_drop_last(self) -> bool:
        return self._dataloader_drop_last

    def deepspeed_io(self, dataset, batch_size: int | None = None, route: str = ROUTE_TRAIN, pin_memory: bool = True,
                     data_sampler=None, collate_fn=None, num_local_io_workers: int | None = None, *,
                     drop_last: bool | None = None, shuffle: bool | None = None, seed: int = 0):
        """A DataLoader of this rank's micro-batches, with DeepSpeed's deepspeed_io arguments in its order.
        Without data_sampler, a DistributedSampler over the data-parallel ranks: shuffled (seed ``seed``) on
        the "train" route (and "encode", which DeepSpeed handles as train), in order on "eval" and "predict"
        (as DeepSpeed's, so each rank evaluates its share). batch_size None: train_micro_batch_size_per_gpu;
        collate_fn None: the one given to initialize; num_local_io_workers None: 0 (the batches are loaded
        in this process); pin_memory as the DataLoader's (it only applies with an accelerator: zero8 trains
        on the CPU). zero8's keyword-only extras: drop_last (None: the config's dataloader_drop_last) and
        shuffle (None: the route's)."""
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler

        if route not in _ROUTES:
            raise Zero8ValueError(
                f"deepspeed_io: route {route!r} is not one of DeepSpeed's routes {', '.join(map(repr, _ROUTES))}")
        if data_sampler is None:
            if shuffle is None:
                shuffle = route not in (ROUTE_EVAL, ROUTE_PREDICT)
            data_sampler = DistributedSampler(dataset, num_replicas=self.dp_world_size, rank=self._dp.rank,
                                              shuffle=shuffle, seed=seed)
        # The DataLoader ignores pin_memory without an accelerator, with a warning at every iteration.
        accelerator = getattr(torch, "accelerator", None)
        pin_memory = bool(pin_memory) and (accelerator.is_available() if accelerator else torch.cuda.is_available())
        return DataLoader(dataset, batch_size=batch_size or self.train_micro_batch_size_per_gpu(), sampler=data_sampler,
                          collate_fn=self.collate_fn if collate_fn is None else collate_fn, pin_memory=pin_memory,
                          num_workers=num_local_io_workers or 0,
                          drop_last=self._dataloader_drop_last if drop_last is None else bool(drop_last))

    # ---- statistics ----
    def comm_stats(self) -> dict:
        """Bytes this rank sent on the data-parallel communicator since the engine was made:
        ``ops`` {kind: {calls, bytes, seconds, bytes_to_peer}} for the kinds used, ``bytes`` (total),
        ``bytes_to_peer`` (per peer, all kinds), and by phase: ``gradient_bytes`` (reduction during
        backward), ``step_bytes`` (overflow/norm agreement and the parameter all-gather), ``other_bytes``
        (initial broadcast, checkpoints)."""
        ops = {k: dict(v) for k, v in self._dp.stats().items() if int(v["calls"]) > 0}
        total = sum(int(v["bytes"]) for v in ops.values())
        peers = [0] * self._dp.size
        for v in ops.values():
            for p, b in enumerate(v["bytes_to_peer"]):
                peers[p] += int(b)
        return {
            "rank": self._dp.rank, "world": self._dp.size, "backend": self._dp.backend, "ops": ops,
            "bytes": total, "bytes_to_peer": peers, "gradient_bytes": self._bytes["gradients"],
            "step_bytes": self._bytes["step"], "other_bytes": total - self._bytes["gradients"] - self._bytes["step"],
            "int8_gradients": bool(self._shard_config.int8_grads), "int8_params": bool(self._shard_config.int8_params),
        }

    def memory_stats(self) -> dict:
        """Bytes held by this rank: working copy, gradient buffers, fp32 master and optimizer state of its
        partition, scratch buffers; ``total`` and ``state_bytes_per_param`` (state of the whole model
        divided over its parameters, this rank's share)."""
        m = {k: int(v) for k, v in self._opt.memory().items()}
        m["total"] = sum(m.values())
        n = sum(p.numel() for p in self._params)
        m["params"] = n
        m["state_bytes_per_param"] = m["state"] / n if n else 0.0
        return m

    # ---- checkpoints ----
    def _checkpoint_tag(self, tag: str) -> str:
        """The tag every rank saves under: rank 0's. checkpoint.tag_validation (DeepSpeed's Warn, Ignore,
        Fail) says what another tag on some rank does: Fail raises on every rank, Warn warns (rank 0),
        Ignore says nothing. Either way the shards go under rank 0's tag, since shards under several tags
        are no checkpoint (DeepSpeed's Warn lets each rank write its own)."""
        if self._dp.size == 1:
            return tag
        mode = str(self.config.get("checkpoint", {}).get("tag_validation", "Warn")).lower()
        tags = [t.decode() for t in self._dp.all_gather_bytes(tag.encode())]
        if len(set(tags)) > 1:
            msg = f"checkpoint tag differs across ranks: {tags}"
            if mode == "fail":
                raise Zero8ValueError(f"checkpoint.tag_validation: {msg}")
            if mode != "ignore" and self.global_rank == 0:
                warnings.warn(f"{msg}; every rank saves under rank 0's tag '{tags[0]}'", stacklevel=3)
        return tags[0]

    def _engine_state(self) -> dict:
        return {
            "global_steps": self.global_steps, "global_samples": self.global_samples,
            "micro_steps": self.micro_steps, "skipped_steps": self.skipped_steps,
            "dp_world_size": self.dp_world_size,
        }

    def save_checkpoint(self, save_dir, tag=None, client_state: dict | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """Collective save to ``<save_dir>/<tag>/`` (tag default ``global_step<global_steps>``): the C++
        shards (fp32 masters and 8-bit states of every rank, model.safetensors, manifest) written
        atomically, and rank 0's ``mp_rank_00_model_states.pt`` ({'module': state_dict, ...} plus the
        client_state keys, as DeepSpeed) for ``torch.load``. Engine counters, the LR scheduler state and
        client_state (when JSON-serializable) go into the manifest's client state. tag="" (DeepSpeed: save_dir
        itself) raises Zero8ValueError. Returns True."""
        self._check_live()
        save_dir = os.fspath(save_dir)
        _check_tag_not_empty(tag, "save_checkpoint", "save_dir", "global_step<N> (N = engine.global_steps)")
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        client_state = dict(client_state or {})
        tag = self._checkpoint_tag(tag)
        done = self.micro_steps % self._gas + int(self._backward_done)
        if done and self.global_rank == 0:
            warnings.warn(
                f"save_checkpoint in the middle of gradient accumulation (micro-batch {done} of {self._gas} of step "
                f"{self.global_steps + 1}): the gradients of that step are not saved; a load resumes at its start",
                stacklevel=2)
        sched_state = self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None
        state = {
            "format": _ENGINE_STATE_FORMAT, "version": _ENGINE_STATE_VERSION, "engine": self._engine_state(),
            "optimizer": self.optimizer.state_dict()["param_groups"], "client_keys": list(client_state),
            "override_groups": [{"param_group": gi, "overrides": _jsonable(over)}
                                for gi, over in self._override_groups],
        }
        for key, value in (("lr_scheduler", sched_state), ("client_state", client_state)):
            if _json_exact(value):
                state[key] = value
            else:  # read back from the .pt file, which pickles it as it is (as DeepSpeed's does)
                state[key] = None
                state[f"{key}_in_model_states"] = True
        state["optimizer"] = _jsonable(state["optimizer"])
        keep_last = int(self.config.get("zero8", {}).get("checkpoint", {}).get("keep_last", 0) or 0)
        # The .pt file goes into the tag with the shards, before the tag is installed and `latest` moves,
        # so a crash or a full disk never leaves `latest` naming a tag without it.
        written = self._on_ranks_agreed(
            lambda: (self._model_states_bytes(client_state, sched_state, exclude_frozen_parameters),
                     self._module_rest(exclude_frozen_parameters)),
            f"save_checkpoint: writing {MODEL_STATES_FILE}")
        pt, (state_dict, module_tensors) = (None, ([], [])) if written is None else written
        extra = {} if pt is None else {MODEL_STATES_FILE: pt}
        # The C++ writer reads the tensors where they are: module_tensors keeps them alive until it returns.
        views = [(k, dtype, shape, t.data_ptr(), t.numel() * t.element_size()) for k, dtype, shape, t in module_tensors]
        _C.checkpoint_save(self._opt, save_dir, tag, json.dumps(state), self.zero8_config.json, keep_last, extra,
                           bool(save_latest), state_dict, views)
        return True

    def module_state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict:
        """The module's state dict, as DeepSpeed's engine gives it: ``module.state_dict`` (views of the
        weights), without the frozen parameters when ``exclude_frozen_parameters``."""
        sd = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, p in self.module.named_parameters():
                if not p.requires_grad:
                    sd.pop(prefix + name, None)
        return sd

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Rank 0 writes the module's weights as one plain state dict (``torch.load``-able, e.g. for
        ``from_pretrained``), in the working dtype (16-bit under fp16 or bf16, else float32), to
        ``save_dir/save_filename``: each tensor compact (_module_state_dict: views into the engine's buffers
        copied, nothing more), written to a temporary file and renamed into place, so the file is whole or
        absent. Not collective (the other ranks write nothing). Returns True."""
        self._check_live()
        if self.global_rank != 0:
            return True
        save_dir = os.fspath(save_dir)
        os.makedirs(save_dir, exist_ok=True)
        path = os.path.join(save_dir, save_filename)
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                torch.save(self._module_state_dict(exclude_frozen_parameters), f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return True

    save_fp16_model = save_16bit_model  # DeepSpeed's older name

    def _on_ranks_agreed(self, work: Callable[[], Any], what: str, all_ranks: bool = False) -> Any:
        """Run ``work`` on rank 0 (all_ranks: on every rank), then let every rank learn whether it failed
        anywhere (a collective), so that no rank goes on alone into the next collective: a failing rank
        re-raises its error; the others raise the first failing rank's, as the same kind of error,
        prefixed with ``what`` and that rank. Returns work's result where it ran, else None."""
        result, error = None, None
        if all_ranks or self.global_rank == 0:
            try:
                result = work()
            except Exception as e:  # every rank must reach the all-reduce below
                error = e
        if not self._dp.all_reduce_f64([1.0 if error is not None else 0.0], "max")[0]:
            return result
        mine = b"" if error is None else f"{type(error).__name__}\n{error}".encode()
        reports = self._dp.all_gather_bytes(mine)
        if error is not None:
            try:
                raise error
            finally:  # the error's traceback holds this frame: no cycle keeping what its frames hold
                error = None
        first = next(r for r, b in enumerate(reports) if b)
        kind, _, message = reports[first].decode(errors="replace").partition("\n")
        raise _error_class(kind)(f"{what}: rank {first} failed: {message}")

    def _module_entries(self, exclude_frozen: bool) -> dict:
        """The module's state_dict as a checkpoint saves it (the live tensors, not copies): without the
        frozen parameters when ``exclude_frozen``."""
        sd = self.module.state_dict(keep_vars=True)
        if not exclude_frozen:
            return sd
        frozen = {id(p) for p in self.module.parameters() if not p.requires_grad}
        return {k: v for k, v in sd.items() if id(v) not in frozen}

    def _module_state_dict(self, exclude_frozen: bool) -> dict:
        """The module's state_dict for torch.save, each tensor with a storage of its own and no more: a view
        into the engine's buffers (a trained parameter) is copied, or the file would hold the whole buffer,
        while a tensor that is all of its own storage (a frozen parameter, a buffer) is saved as it is. A
        large frozen embedding costs no copy; the file is byte for byte what copies of every entry gave."""
        seen: set[int] = set()
        return {k: _compact(v.detach(), seen) if isinstance(v, torch.Tensor) else v
                for k, v in self._module_entries(exclude_frozen).items()}

    def _module_rest(self, exclude_frozen: bool) -> tuple[list, list]:
        """The module's state_dict for the C++ checkpoint (zero8::ckpt::SaveOptions), so that ``zero8-checkpoint
        to-fp32`` gives all of it, as DeepSpeed's zero_to_fp32 does: every key in order as (key, source), the
        source being the trained parameter's name (the export takes it from the fp32 masters) or the key of
        the first entry holding the same tensor (tied weights); and the entries the optimizer does not train
        (frozen parameters, persistent buffers) as (name, safetensors dtype, shape, tensor) at their dtype, the
        tensor contiguous on the CPU: the module's own tensor when it is (no copy), else a contiguous copy.
        Without the frozen parameters when ``exclude_frozen``. Entries that are not tensors (a module's extra
        state) are left out; a tensor of a dtype safetensors cannot hold makes it ([], []) with a warning:
        the export then gives the trained parameters only, as before."""
        trained = {id(p): name for p, name in zip(self._params, self._param_names)}
        first: dict[int, str] = {}
        state_dict, tensors = [], []
        for key, v in self._module_entries(exclude_frozen).items():
            if not isinstance(v, torch.Tensor):
                continue
            if id(v) in trained:
                state_dict.append((key, trained[id(v)]))
                continue
            if id(v) in first:  # the same tensor under another name
                state_dict.append((key, first[id(v)]))
                continue
            dtype = _SAFETENSORS_DTYPES.get(v.dtype)
            if dtype is None:
                warnings.warn(f"save_checkpoint: {key} is {v.dtype}, which the checkpoint's model_rest.safetensors "
                              "cannot hold: zero8-checkpoint to-fp32 will give the trained parameters only (the "
                              f"whole state_dict is in {MODEL_STATES_FILE})", stacklevel=5)
                return [], []
            first[id(v)] = key
            tensors.append((key, dtype, list(v.shape), v.detach().to("cpu").contiguous()))
            state_dict.append((key, key))
        return state_dict, tensors

    def _model_states_bytes(self, client_state: dict, sched_state, exclude_frozen: bool) -> bytes:
        state = {
            "module": self._module_state_dict(exclude_frozen),
            "buffer_names": [n for n, _ in self.module.named_buffers()],
            "lr_scheduler": sched_state,
            "global_steps": self.global_steps,
            "global_samples": self.global_samples,
            "skipped_steps": self.skipped_steps,
            "dp_world_size": self.dp_world_size,
            "mp_world_size": self.mp_world_size,
            "ds_config": self.config,
            "ds_version": f"zero8 {_C.version()}",
        }
        state.update(client_state)
        buf = io.BytesIO()
        torch.save(state, buf)
        return buf.getvalue()

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn: Callable | None = None):
        """Collective load of ``<load_dir>/<tag>`` (tag None: the one ``latest`` names) at any world size.
        Returns ``(load_path, client_state)`` as DeepSpeed (load_path: the tag's model-states file;
        client_state: the keys of that file the load did not consume, the caller's saved client_state among
        them, see _returned_client_state), or ``(None, None)`` when load_dir has no ``latest``; tag=""
        (DeepSpeed: load_dir itself) raises Zero8ValueError. With load_optimizer_states (default) the C++
        load restores masters, 8-bit states, the working copy bit for bit, steps and loss scale; otherwise
        only the module weights are read (from the .pt file) and the masters are reset from them.
        Everything is read and checked on every rank before anything changes: a load that raises (on any
        rank, for any reason) leaves the engine as it was, on every rank."""
        self._check_live()
        if custom_load_fn is not None:
            raise Zero8NotSupportedError("load_checkpoint(custom_load_fn=...) is not supported")
        load_dir = os.fspath(load_dir)
        _check_tag_not_empty(tag, "load_checkpoint", "load_dir", "the tag 'latest' names")
        if tag is None and not os.path.isfile(os.path.join(load_dir, "latest")):
            if self.global_rank == 0:
                warnings.warn(f"load_checkpoint: no 'latest' file in {load_dir}; nothing loaded", stacklevel=2)
            return None, None
        tag = "" if tag is None else str(tag)
        full = load_optimizer_states and not load_module_only
        staged: dict = {}

        def stage(path: str, client_state_json: str) -> None:
            """Read and check everything the engine applies after the C++ load (which cannot fail then)."""
            model_states = self._read_model_states(path)
            module_sd = model_states.get("module") if isinstance(model_states, dict) else None
            if not isinstance(module_sd, dict):
                raise _C.Zero8IOError(f"{os.path.join(path, MODEL_STATES_FILE)}: no 'module' state dict")
            copies = self._check_module_states(module_sd, load_module_strict, managed_too=not full)
            state = json.loads(client_state_json) if client_state_json else None
            if not isinstance(state, dict) or state.get("format") != _ENGINE_STATE_FORMAT:
                state = None
            hyper_changes: list[str] = []
            override_changes: list[str] = []
            sched = None
            if state is not None and not load_module_only:
                src = f"{os.path.join(path, 'manifest.json')}: client_state"
                _check_engine_state(state, src)
                if load_optimizer_states:
                    hyper_changes = self._checked_resumed_groups(state.get("optimizer", []), src,
                                                                 load_lr_scheduler_states)
                    override_changes = self._override_changes(state.get("override_groups"))
                if load_lr_scheduler_states and self.lr_scheduler is not None:
                    sched = state.get("lr_scheduler")
                    if state.get("lr_scheduler_in_model_states"):
                        sched = model_states.get("lr_scheduler")
                    if sched is not None:
                        self._check_scheduler_state(sched, path)
            staged.update(path=path, model_states=model_states, state=state, hyper_changes=hyper_changes,
                          override_changes=override_changes, copies=copies, sched=sched)

        if full:
            try:
                res = _C.checkpoint_load(self._opt, load_dir, tag, True,
                                         lambda r: stage(r["path"], r["client_state_json"]))
            except _C.Zero8IOError as e:
                named = self._hyper_groups_named(str(e), load_dir, tag)
                if named is None:
                    raise
                raise _C.Zero8IOError(named) from None
            if self.global_rank == 0:
                for w in res.get("warnings", []):
                    warnings.warn(f"load_checkpoint: {w}", stacklevel=2)
            with torch.no_grad():  # frozen parameters and buffers (the C++ load restored the rest)
                for v, saved in staged["copies"]:
                    v.data.copy_(saved)
        else:
            def stage_module_only() -> None:
                path = _C.checkpoint_tag_path(load_dir, tag or _C.latest_read(load_dir))
                # checks the manifest and the .pt file; model_rest.safetensors, which no rank reads, on rank 0
                stage(path, _C.checkpoint_client_state(path, self._dp.rank == 0))

            self._on_ranks_agreed(stage_module_only, "load_checkpoint (nothing was loaded)", all_ranks=True)
            with torch.no_grad():
                self.module.load_state_dict(staged["model_states"]["module"], strict=load_module_strict)
            self._opt.init(0)  # masters from the loaded weights, everywhere equal
        path, model_states, state = staged["path"], staged["model_states"], staged["state"]
        if state is not None and not load_module_only:
            e = state["engine"]
            self.global_steps = int(e["global_steps"])
            self.global_samples = int(e["global_samples"])
            self.micro_steps = int(e["micro_steps"])
            self.skipped_steps = int(e["skipped_steps"])
            if load_optimizer_states:
                self.optimizer.load_state_dict({"param_groups": state.get("optimizer", [])})
                if staged["hyper_changes"] and self.global_rank == 0:
                    warnings.warn(
                        "load_checkpoint: the checkpoint's optimizer hyperparameters replace the ones this engine "
                        f"was configured with: {'; '.join(staged['hyper_changes'])}. As in DeepSpeed, the "
                        "checkpoint wins; to train with the new values, set them in engine.optimizer.param_groups "
                        "after loading", stacklevel=2)
                if staged["override_changes"] and self.global_rank == 0:
                    warnings.warn(
                        "load_checkpoint: this engine's per-parameter overrides differ from the checkpoint's: "
                        f"{'; '.join(staged['override_changes'])}. The optimizer states were loaded and this "
                        "engine's overrides apply (override_config is read at initialize, as bitsandbytes reads it "
                        "at every step)", stacklevel=2)
            if staged["sched"] is not None:
                self.lr_scheduler.load_state_dict(staged["sched"])
            self._apply_hyper()
            saved_config = model_states.get("ds_config") if isinstance(model_states, dict) else None
            saved_batch = saved_config.get("train_batch_size") if isinstance(saved_config, dict) else None
            if isinstance(saved_batch, int) and saved_batch != self.train_batch_size() and self.global_rank == 0:
                warnings.warn(
                    f"load_checkpoint: the checkpoint was trained with a global batch of {saved_batch} samples "
                    f"({e.get('dp_world_size', '?')} data-parallel rank(s)); this engine's is "
                    f"{self.train_batch_size()} ({self.dp_world_size} rank(s) x {self.train_micro_batch_size_per_gpu()} "
                    f"x {self._gas} accumulation steps). Training goes on from step {self.global_steps} with the new "
                    "batch; the LR schedule counts steps, not samples", stacklevel=2)
        # A load starts a step: the gradients of a step unfinished at the save were not saved (and those
        # accumulated here before the load belong to the replaced weights), so the next micro-batch is the
        # first of gradient_accumulation_steps, whatever it was at the save.
        self.micro_steps -= self.micro_steps % self._gas
        self._last_info = None
        self._grad_norm = None
        self._backward_done = False
        return os.path.join(path, MODEL_STATES_FILE), self._returned_client_state(
            model_states, state, load_module_only, load_optimizer_states, load_lr_scheduler_states)

    def _override_changes(self, recorded) -> list[str]:
        """The override groups whose overrides differ from the checkpoint's record of them (its engine state's
        override_groups; the count matched, or the C++ layout check failed). Empty for a checkpoint saved
        before the engine recorded them."""
        if not isinstance(recorded, list):
            return []
        changes = []
        for k, ((gi, over), saved) in enumerate(zip(self._override_groups, recorded)):
            here = {"param_group": gi, "overrides": _jsonable(over)}
            if saved != here:
                h = len(self.optimizer.param_groups) + k
                changes.append(f"group {h}: {saved.get('overrides') if isinstance(saved, dict) else saved} in the "
                               f"checkpoint, {here['overrides']} here (param group {gi})")
        return changes

    def _hyper_groups_named(self, message: str, load_dir: str, tag: str) -> str | None:
        """The C++ layout check's error for a parameter in another hyper group (_HYPER_GROUP_MISMATCH), with
        the override groups among its numbers said for what they are; None for another error, or one about
        param groups only. The C++ load numbers the hyper groups without knowing that those after the param
        groups are override groups (_override_hyper_groups): a user with one param group would not know
        "param group 1". The checkpoint's param groups and overrides are in its engine state, read here from
        the manifest (the load failed before handing it over)."""
        m = _HYPER_GROUP_MISMATCH.search(message)
        if m is None:
            return None
        saved, here = int(m["saved"]), int(m["here"])
        saved_what = here_what = None
        state = _saved_engine_state(load_dir, tag)
        saved_groups = state.get("optimizer") if state is not None else None
        if isinstance(saved_groups, list) and saved >= len(saved_groups):
            recorded = state.get("override_groups")
            k = saved - len(saved_groups)
            g = recorded[k] if isinstance(recorded, list) and k < len(recorded) else None
            if isinstance(g, dict) and isinstance(g.get("overrides"), dict):
                saved_what = _override_group_text(g.get("param_group"), g["overrides"])
            else:  # a checkpoint of an engine that did not record its overrides
                saved_what = f"an override group, numbered after the checkpoint's {len(saved_groups)} param group(s)"
        n = len(self.optimizer.param_groups)
        if here >= n:
            here_what = _override_group_text(*self._override_groups[here - n])
        if saved_what is None and here_what is None:
            return None
        head = (f"is in {'group' if saved_what else 'param group'} {saved} in the checkpoint, "
                f"{'group' if here_what else 'param group'} {here} here")
        what = ([f"group {saved} in the checkpoint is {saved_what}"] if saved_what else []) + (
            [f"group {here} here is {here_what}"] if here_what else [])
        return f"{message[:m.start()]}{head}, where {' and '.join(what)}{message[m.end():]}"

    @staticmethod
    def _returned_client_state(model_states: dict, state: dict | None, load_module_only: bool,
                               load_optimizer_states: bool, load_lr_scheduler_states: bool) -> dict:
        """What load_checkpoint returns as client_state: as DeepSpeed, every key of the model-states file but
        those the load consumed (_LOADED_KEYS_MODULE_ONLY or _LOADED_KEYS, and lr_scheduler / optimizer when
        their states were loaded), so engine keys such as ds_config and global_samples come back too. The
        keys the caller saved in client_state always come back, even one named like an engine key (the
        file holds the caller's value under it, since client_state is merged over the engine's keys)."""
        consumed = set(_LOADED_KEYS_MODULE_ONLY if load_module_only else _LOADED_KEYS)
        if load_lr_scheduler_states:
            consumed.add("lr_scheduler")
        if load_optimizer_states:
            consumed.add("optimizer")
        own = set(state.get("client_keys", [])) if state is not None else set()
        return {k: v for k, v in model_states.items() if k not in consumed or k in own}

    @staticmethod
    def _read_model_states(tag_path: str) -> dict:
        """The model-states file, its module tensors mapped from the file (torch.load with mmap) rather than
        read into memory: the load copies them into the module (the frozen parameters and buffers, or every
        entry without the optimizer states) straight from the page cache, so a large frozen tensor costs no
        rank a copy of its own. Everything else (the caller's client_state, the LR scheduler's state, a
        module's extra state) may outlive the load, so it is copied out of the mapping here: the mapping goes
        with the last module tensor, when the load returns."""
        path = os.path.join(tag_path, MODEL_STATES_FILE)
        # Our own file; client_state may hold arbitrary picklable objects, as in DeepSpeed. torch.save's
        # zipfile format (the only one zero8 writes) is what mmap needs.
        try:
            states = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except FileNotFoundError:
            raise
        except Exception as mapped_error:
            # A file system that cannot map files (some FUSE mounts) still reads it: load it into memory.
            try:
                states = torch.load(path, map_location="cpu", weights_only=False)
            except Exception as e:
                raise _C.Zero8IOError(f"{path}: cannot read the model states ({type(e).__name__}: {e}); "
                                      f"`zero8-checkpoint verify {tag_path}` checks its checksum") from e
            warnings.warn(f"load_checkpoint: {path} could not be mapped ({type(mapped_error).__name__}: "
                          f"{mapped_error}), so it was read into memory", stacklevel=3)
        if not isinstance(states, dict):
            return copy.deepcopy(states)
        # One deepcopy of every other key, so that entries sharing a tensor or a storage (client_state
        # {"ema": t, "head": t[:3]}) still share it, as torch.load gives them.
        rest = copy.deepcopy({k: v for k, v in states.items() if k != "module"})
        return {k: _module_entries_mapped(v) if k == "module" else rest[k] for k, v in states.items()}

    def _check_module_states(self, module_sd: dict, strict: bool, managed_too: bool) -> list:
        """The module entries a load will copy exist (strict) and have this model's shapes. managed_too:
        the parameters the optimizer manages as well (else the C++ load restores those). Returns the
        (model tensor, saved tensor) pairs to copy."""
        managed = set() if managed_too else {id(p) for p in self._params}
        own = {k: v for k, v in self.module.state_dict(keep_vars=True).items() if id(v) not in managed}
        missing = [k for k in own if k not in module_sd]
        unexpected = [k for k in module_sd if k not in own] if managed_too else []
        bad = [f"{k}: saved {tuple(module_sd[k].shape)}, model {tuple(v.shape)}" for k, v in own.items()
               if k in module_sd and (not isinstance(module_sd[k], torch.Tensor) or module_sd[k].shape != v.shape)]
        problems = []
        if strict and missing:
            problems.append(f"lacks module keys {missing}")
        if strict and unexpected:
            problems.append(f"has module keys this model lacks {unexpected}")
        if bad:
            problems.append(f"has other shapes ({'; '.join(bad)})")
        if problems:
            raise Zero8ValueError(f"load_checkpoint: {MODEL_STATES_FILE} {' and '.join(problems)}; nothing was loaded")
        return [(v, module_sd[k]) for k, v in own.items() if k in module_sd]

    def _check_scheduler_state(self, sd, tag_path: str) -> None:
        """The LR scheduler takes the saved state, tried on a copy so that this one stays as it is (a zero8
        schedule's load_state_dict writes lr into the param groups: its position is checked instead)."""
        sched = self.lr_scheduler
        try:
            if isinstance(sched, Zero8LRScheduler):
                int(sd["last_batch_iteration"])
            else:
                copy.copy(sched).load_state_dict(copy.deepcopy(sd))
        except Exception as e:
            raise Zero8ValueError(
                f"load_checkpoint: {tag_path}: the saved LR scheduler state does not load into this engine's "
                f"{type(sched).__name__} ({type(e).__name__}: {e}; saved by a scheduler of another kind?); nothing "
                f"was loaded (load_lr_scheduler_states=False loads the rest and keeps this scheduler's "
                f"position)") from e

    def _checked_resumed_groups(self, saved_groups, src: str, scheduler_restored: bool) -> list[str]:
        """The saved param groups convert to the C++ hyperparameters; returns the values that differ from
        this engine's (lr only without a restored LR scheduler, which sets it)."""
        if not isinstance(saved_groups, list) or not all(isinstance(g, dict) for g in saved_groups):
            raise _C.Zero8IOError(f"{src}: 'optimizer' is not a list of param groups")
        if len(saved_groups) != len(self.optimizer.param_groups):
            raise Zero8ValueError(
                f"{src}: the checkpoint has {len(saved_groups)} param group(s), this engine "
                f"{len(self.optimizer.param_groups)}; load with the same param groups, or with "
                f"load_optimizer_states=False")
        changes: list[str] = []
        several = len(saved_groups) > 1
        for i, (g, saved) in enumerate(zip(self.optimizer.param_groups, saved_groups)):
            merged = {**g, **{k: v for k, v in saved.items() if k != "params"}}
            try:
                _hyper_from_group(merged, self._algo, types.SimpleNamespace())  # conversion check only
            except (TypeError, ValueError, KeyError) as e:
                raise _C.Zero8IOError(f"{src}: param group {i} does not convert ({type(e).__name__}: {e})") from e
            for k, v in saved.items():
                if k == "params" or k not in g or (k == "lr" and scheduler_restored and self.lr_scheduler is not None):
                    continue
                if not _same_hyper(v, g[k]):
                    old = tuple(g[k]) if isinstance(g[k], (list, tuple)) else g[k]
                    new = tuple(v) if isinstance(v, list) else v
                    changes.append(f"{f'param group {i} ' if several else ''}{k} {new!r} (configured {old!r})")
        return changes


def _check_tag_not_empty(tag, call: str, dir_arg: str, default: str) -> None:
    """tag="" is DeepSpeed's way to save into (load from) the directory itself, without a tag directory.
    zero8 keeps every checkpoint in a tag directory (the atomic save renames it into place), so instead of
    reading "" as the default tag, as it once did silently, it refuses it."""
    if tag is not None and str(tag) == "":
        raise Zero8ValueError(
            f"{call}: tag='' means {dir_arg} itself in DeepSpeed, but zero8 keeps each checkpoint in a tag "
            f"directory of {dir_arg}; pass tag=None for {default}, or a tag name")


def _compact(t: torch.Tensor, seen: set[int]) -> torch.Tensor:
    """t itself when it is the whole of a CPU storage not in ``seen`` (data pointers of the storages given out
    before), else a copy: torch.save writes a tensor's whole storage, once per storage."""
    exact = (t.layout == torch.strided and t.device.type == "cpu" and t.is_contiguous() and not t.is_conj()
             and not t.is_neg() and t.storage_offset() == 0
             and t.untyped_storage().nbytes() == t.numel() * t.element_size())
    ptr = t.untyped_storage().data_ptr() if exact else None
    if not exact or ptr in seen:
        return t.clone()
    seen.add(ptr)
    return t


def _override_key(overrides: dict) -> str:
    """The overrides as a key that equal values share however they are spelled (0 and 0.0, a list and a
    tuple of betas), so that they make one override group."""
    def norm(v):
        if isinstance(v, (list, tuple)):
            return tuple(norm(x) for x in v)
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
    return repr(sorted((k, norm(v)) for k, v in overrides.items()))


def _override_group_text(param_group, overrides) -> str:
    """What an override group is, for errors: its param group and the overrides (JSON lists as tuples)."""
    shown = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
    return f"the override group of param group {param_group} for parameters with override_config {shown}"


def _saved_engine_state(load_dir: str, tag: str) -> dict | None:
    """The engine state in a checkpoint's manifest (its client state), for an error's details: None when it
    cannot be read or is not the engine's."""
    try:
        path = _C.checkpoint_tag_path(load_dir, tag or _C.latest_read(load_dir))
        with open(os.path.join(path, "manifest.json"), encoding="utf-8") as f:
            state = json.load(f).get("client_state")
    except (OSError, ValueError, AttributeError, _C.Zero8IOError):
        return None
    return state if isinstance(state, dict) and state.get("format") == _ENGINE_STATE_FORMAT else None


def _module_entries_mapped(module_sd):
    """A loaded module state_dict with its tensors left in the file's mapping and its other entries (a
    module's extra state, which set_extra_state may keep) copied out of it."""
    if not isinstance(module_sd, dict):
        return copy.deepcopy(module_sd)
    return {k: v if isinstance(v, torch.Tensor) and not k.endswith(_EXTRA_STATE_SUFFIX) else copy.deepcopy(v)
            for k, v in module_sd.items()}


def _same_hyper(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_hyper(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return _f32(float(a)) == _f32(float(b))  # the C++ hyperparameters are float32
    return a == b


def _error_class(name: str) -> type[Exception]:
    """The exception class another rank reported by name: a zero8 error or a builtin one, else RuntimeError."""
    cls = getattr(_C, name, None) if name.startswith("Zero8") else getattr(builtins, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, Exception) else RuntimeError


def _check_engine_state(state: dict, src: str) -> None:
    e = state.get("engine")
    keys = ("global_steps", "global_samples", "micro_steps", "skipped_steps")
    if not isinstance(e, dict) or not all(isinstance(e.get(k), int) for k in keys):
        raise _C.Zero8IOError(f"{src}: 'engine' must hold the integer counters {list(keys)}")


def _cast_floating(x, dtype):
    """fp16 auto_cast of a forward input: floating tensors, also inside lists, tuples and mappings (a
    batch passed as one container, which DeepSpeed casts too); other values as they are."""
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, Mapping):
        cast = {k: _cast_floating(v, dtype) for k, v in x.items()}
        try:
            return cast if type(x) is dict else type(x)(cast)
        except TypeError:  # a mapping type that cannot be built from a dict
            return cast
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
        return type(x)(*(_cast_floating(v, dtype) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_cast_floating(v, dtype) for v in x)
    return x


def _json_exact(x) -> bool:
    """x comes back from JSON (Python's dump, the C++ manifest's parse) as it was: plain dicts with str
    keys, lists, str, bool, None, ints that fit 64 bits and finite floats. Int keys, tuples, Counters and
    other subclasses would come back changed, NaN and inf not at all."""
    t = type(x)
    if x is None or t is bool or t is str:
        return True
    if t is int:
        return -2**63 <= x < 2**64
    if t is float:
        return math.isfinite(x)
    if t is list:
        return all(_json_exact(v) for v in x)
    if t is dict:
        return all(type(k) is str and _json_exact(v) for k, v in x.items())
    return False


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, torch.Tensor):
        return x.item() if x.numel() == 1 else x.tolist()
    return x


# ---------------------------------------------------------------------------------------------
# initialize
# ---------------------------------------------------------------------------------------------


def add_config_arguments(parser):
    """DeepSpeed's command-line arguments on an argparse parser, for scripts that pass ``args`` to
    ``initialize``: ``--deepspeed`` (accepted; the engine runs whenever ``initialize`` is called) and
    ``--deepspeed_config PATH``. Returns the parser."""
    group = parser.add_argument_group("zero8 (DeepSpeed arguments)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="accepted for DeepSpeed scripts; zero8's engine runs when the script calls initialize")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="the DeepSpeed JSON config (with its \"zero8\" section) that initialize(args=...) reads")
    return parser


def init_distributed(dist_backend=None, auto_mpi_discovery: bool = True, distributed_port=None, verbose: bool = True,
                     timeout=None, init_method=None, dist_init_required=None, config=None, rank: int = -1,
                     world_size: int = -1) -> "_C.Communicator":
    """For scripts that call ``deepspeed.init_distributed()`` before ``initialize``: creates (or returns)
    this process's world communicator (MPI under mpirun or zero8-launch, else one process). zero8 does
    not start a torch.distributed process group, so the arguments are accepted and ignored; use
    ``engine.global_rank`` / ``engine.world_size`` (or this communicator's ``rank`` and ``size``) instead
    of ``torch.distributed.get_rank()``."""
    return world_comm("auto")


def initialize(args=None, model: torch.nn.Module | None = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port: int | None = None, mpu=None,
               dist_init_required: bool | None = None, collate_fn=None, config=None, mesh_param=None,
               config_params=None):
    """deepspeed.initialize for zero8: returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    - ``config``: a DeepSpeed config (dict, path or JSON text; ``args.deepspeed_config`` and
      ``config_params`` as in DeepSpeed, and as there config= with args.deepspeed_config is an error).
      It is validated in C++ (``zero8.Zero8ValueError`` naming the key path); unknown keys warn once
      (rank 0). A ``"zero8"`` section turns on 8-bit states and int8
      communication (docs/CONFIG.md).
    - ``optimizer``: None (the config's "optimizer" section), a torch.optim Adam/AdamW/SGD/RMSprop/
      Adagrad, a zero8.optim / bitsandbytes 8-bit optimizer (its class and hyperparameters are read; its
      param groups may differ in lr, weight_decay, eps and betas/momentum/alpha), or a callable that
      builds one: called with model_parameters as a list (param-group dicts as given, their own values
      kept), or with all the module's parameters when model_parameters is None, as DeepSpeed calls it.
    - ``model_parameters``: tensors, or param-group dicts that may set their own lr, weight_decay, eps
      and betas/momentum/alpha (docs/ENGINE.md, "Param groups").
    - ``lr_scheduler``: None (the config's "scheduler"), a scheduler over the client optimizer or over
      the returned optimizer, or a callable taking the returned optimizer (a function, or a scheduler
      class such as ``torch.optim.lr_scheduler.ConstantLR`` or ``zero8.lr_schedules.WarmupLR``).
    - ``training_data``: a torch Dataset; the returned DataLoader (``engine.deepspeed_io(training_data)``)
      yields micro-batches of this rank's share (DistributedSampler over the data-parallel ranks), made
      by ``collate_fn``, else None.

    Processes: under mpirun every rank runs this (MPI backend, chosen automatically; no
    torch.distributed process group is needed: ``distributed_port`` and ``dist_init_required`` are
    accepted and ignored). Not supported: ``mpu``/``mesh_param`` (model or pipeline parallelism).
    ZeRO stage 0 runs as stage 1 (same arithmetic, states partitioned).
    """
    if model is None:
        raise Zero8ValueError("initialize: model is required")
    if mpu is not None or mesh_param is not None:
        raise Zero8NotSupportedError("initialize: mpu / mesh_param (model or pipeline parallelism) are not supported")
    if config is None and config_params is not None:
        config = config_params
    args_key = next((k for k in ("deepspeed_config", "zero8_config") if getattr(args, k, None) is not None), None)
    if config is not None and args_key is not None:
        raise Zero8ValueError(
            f"initialize: both config= and args.{args_key} ({getattr(args, args_key)!r}) were given; pass one "
            f"(DeepSpeed refuses both too)")
    if config is None and args_key is not None:
        config = getattr(args, args_key)
    if config is None:
        raise Zero8ValueError("initialize: no config (pass config=, or args.deepspeed_config)")
    backend = raw_value(config, "zero8", "comm_backend", default="auto")
    if isinstance(backend, str) and backend.lower() == "nccl":
        # Refused before world_comm would set NCCL up (load_config refuses it too, with the same words).
        raise Zero8NotSupportedError(
            'zero8.comm_backend: "nccl" cannot run the engine: its buffers (parameters, gradients, optimizer '
            'state, checkpoints) are host memory, and NCCL takes device buffers only; use "auto", "mpi" or '
            '"single" (the NCCL backend is for device buffers through the C++ Communicator API, '
            'comm_create("nccl"))')
    world = world_comm(backend if isinstance(backend, str) else "auto")
    global _engine_count
    _engine_count += 1
    dp = world.split(0, world.rank, f"zero8-engine-{_engine_count}")  # own counters per engine
    cfg = load_config(config, dp.size, rank=world.rank)
    engine = Zero8Engine(model, cfg, dp, world, model_parameters=model_parameters, client_optimizer=optimizer,
                         client_lr_scheduler=lr_scheduler)
    engine.collate_fn = collate_fn
    engine._dataloader_drop_last = bool(raw_value(config, "dataloader_drop_last", default=False))
    loader = None
    if training_data is not None:
        loader = engine.deepspeed_io(training_data)
    return engine, engine.optimizer, loader, engine.lr_scheduler
