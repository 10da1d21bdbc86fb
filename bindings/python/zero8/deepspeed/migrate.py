"""A DeepSpeed checkpoint resumed by zero8's engine: ``engine.load_checkpoint(dir, tag)`` of a
``zero8.initialize`` engine, given a DeepSpeed ZeRO-1/2 (torch's AdamW/Adam, or zero8's optimizer under
DeepSpeed) or universal checkpoint, takes each parameter's fp32 master and states by name
(zero8.deepspeed.read_checkpoint), quantizes the states into this rank's partition (8-bit where the engine keeps
8-bit states) and goes on from the checkpoint's step, LR scheduler and engine counters: a run moved from
DeepSpeed mid-training. Any world size on either side.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from typing import TYPE_CHECKING

import torch

from .. import _C
from .._C import Zero8IOError, Zero8ValueError
from ..optim import _algos
from ..optim.optimizer import _encode
from .universal import read_checkpoint

if TYPE_CHECKING:
    from ..engine.training import Zero8Engine

__all__ = ["load_into_engine"]

# Model-states keys the load consumes (the others come back as the client state, as DeepSpeed returns them).
_CONSUMED = ("module", "optimizer", "lr_scheduler", "global_steps", "global_samples", "skipped_steps",
             "dp_world_size", "mp_world_size", "param_shapes", "frozen_param_shapes", "shared_params",
             "buffer_names", "sparse_tensor_module_names", "ds_config", "ds_version", "universal_checkpoint_info")
_HYPER_KEYS = ("lr", "betas", "eps", "weight_decay")


def _bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def load_into_engine(engine: "Zero8Engine", load_dir: str, tag: str, *, load_module_strict: bool = True,
                     load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                     load_module_only: bool = False, allow_pickle: bool = False):
    """Load DeepSpeed checkpoint ``<load_dir>/<tag>`` into zero8 engine `engine` (collective; every rank reads
    the files). Returns DeepSpeed's ``(load_path, client_state)``. Everything is read and checked on every rank
    before anything changes."""
    tag_dir = os.path.join(load_dir, tag)
    opt = engine._opt
    full = load_optimizer_states and not load_module_only
    names = tuple(n for n in _algos.spec(engine._algo).torch_states if n)
    staged: dict = {}

    def stage() -> None:
        states = read_checkpoint(tag_dir, allow_pickle=allow_pickle)
        module_sd = states.model_states.get("module")
        if not isinstance(module_sd, dict):
            raise Zero8IOError(f"{tag_dir}: its model-states file has no 'module' state dict")
        # A tied weight is under one of its names (DeepSpeed keeps the last, e.g. lm_head.weight for GPT-2's
        # tied embedding; the engine the first).
        aliases: dict = {}
        for n, q in engine.module.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(q), []).append(n)
        ckpt_names = []
        for name, p in zip(engine._param_names, engine._params):
            found = [n for n in [name] + aliases.get(id(p), []) if n in states.params]
            if not found:
                raise Zero8ValueError(f"{tag_dir}: the checkpoint has no parameter {name}; it holds "
                                      f"{', '.join(list(states.params)[:5])}...")
            ckpt_names.append(found[0])
        parts = {}
        for i, (name, p) in enumerate(zip(ckpt_names, engine._params)):
            got = states.params[name]["fp32"]
            if got.numel() != p.numel():
                raise Zero8ValueError(f"{tag_dir}: {name} has {got.numel()} elements in the checkpoint, "
                                      f"{p.numel()} here")
            if full:
                absent = [k for k in names if k not in states.params[name]]
                if absent:
                    raise Zero8ValueError(f"{tag_dir}: {name} has no {absent[0]} state in the checkpoint, which "
                                          f"{engine._algo} needs (saved by another optimizer?)")
        if full:
            for g in range(_C.NUM_GROUPS):
                begin, valid = opt.part_range(g)
                if valid <= 0:
                    continue
                master = torch.zeros(valid)
                values = [torch.zeros(valid) for _ in names]
                for i, name in enumerate(ckpt_names):
                    gg, off, n = opt.param_slot(i)
                    a, b = max(off, begin), min(off + n, begin + valid)
                    if gg != g or a >= b:
                        continue
                    src = states.params[name]
                    master[a - begin:b - begin] = src["fp32"].reshape(-1)[a - off:b - off]
                    for v, key in zip(values, names):
                        v[a - begin:b - begin] = src[key].reshape(-1)[a - off:b - off]
                parts[g] = _parts(engine, g, master, values)
        staged.update(states=states, module_sd=module_sd, parts=parts)

    engine._on_ranks_agreed(stage, "load_checkpoint (nothing was loaded)", all_ranks=True)
    states = staged["states"]
    with torch.no_grad():
        engine.module.load_state_dict(staged["module_sd"], strict=load_module_strict)
    # The optimizer's work on its stream, after the weights' copies on the current one (device.StreamOrder).
    with engine._stream_order():
        if not full:
            opt.init(0)  # masters from the loaded weights
        else:
            for g, parts in staged["parts"].items():
                for part, data in parts.items():
                    opt.copy_from_host(g, part, data)
            opt.steps = states.step
            opt.sync_working_from_master()
    if full:
        ms = states.model_states
        engine.global_steps = int(ms.get("global_steps", states.step))
        engine.skipped_steps = int(ms.get("skipped_steps", 0))
        engine.global_samples = int(ms.get("global_samples", engine.global_steps * engine.train_batch_size()))
        engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
        _apply_saved_groups(engine, states.param_groups, tag_dir)
        sched = ms.get("lr_scheduler")
        if load_lr_scheduler_states and engine.lr_scheduler is not None and sched is not None:
            engine.lr_scheduler.load_state_dict(sched)
        engine._apply_hyper()
    engine._last_info = None
    engine._grad_norm = None
    engine._backward_done = False
    consumed = {"module"} if load_module_only else set(_CONSUMED)
    client = {k: v for k, v in states.model_states.items() if k not in consumed}
    if engine.global_rank == 0:
        warnings.warn(f"load_checkpoint: {tag_dir} is a DeepSpeed {states.kind} checkpoint; its float32 states were "
                      f"quantized into zero8's (step {states.step})", stacklevel=3)
    return os.path.join(tag_dir, "mp_rank_00_model_states.pt"), client


def _parts(engine, g: int, master: torch.Tensor, values: list) -> dict:
    """The bytes of this rank's buffers of group g: master, and per state its codes and block scales (8-bit)
    or its floats, in the sharded optimizer's layout (blocks from the partition's first element, a multiple of
    the state block)."""
    opt = engine._opt
    out = {"master": _bytes(master)}
    row = _algos.spec(engine._algo)
    block = engine._shard_config.state_block
    for i, v in enumerate(values, start=1):
        if opt.part_bytes(g, f"codes{i}") > 0:
            codes, absmax = _encode(v, block, row.state_maps[i - 1])
            out[f"codes{i}"], out[f"absmax{i}"] = _bytes(codes), _bytes(absmax)
        else:
            out[f"state{i}"] = _bytes(v)
    for part, data in out.items():
        want = opt.part_bytes(g, part)
        if len(data) != want:
            raise Zero8ValueError(f"load_checkpoint: {part} of group {g} is {len(data)} bytes, the optimizer holds "
                                  f"{want}")
    return out


def _apply_saved_groups(engine, saved: list, tag_dir: str) -> None:
    """The checkpoint's hyperparameters into the engine's param groups (DeepSpeed's rule: the checkpoint's win),
    when it has as many groups."""
    groups = engine.optimizer.param_groups
    if len(saved) != len(groups):
        if engine.global_rank == 0:
            warnings.warn(f"load_checkpoint: {tag_dir} has {len(saved)} param group(s), this engine "
                          f"{len(groups)}; the engine's hyperparameters stay", stacklevel=4)
        return
    for g, s in zip(groups, saved):
        for k in _HYPER_KEYS:
            if k in s and k in g:
                g[k] = tuple(s[k]) if k == "betas" else s[k]
