"""DeepSpeed checkpoints and zero8's states, both ways.

- ``to_universal``: a DeepSpeed ZeRO-1/2 checkpoint whose optimizer is zero8's (8-bit partition states,
  zero8.optim.partition) becomes a universal checkpoint through DeepSpeed's own ``ds_to_universal``: the
  states are first decoded into torch's names (``exp_avg``, ``exp_avg_sq`` over each partition, float32), the
  only ones that tool reads. A zero8 engine checkpoint (``zero8.initialize``'s ``save_checkpoint``) is
  written in the universal layout directly from its shards.
- ``read_checkpoint``: the float32 weights and states of each parameter of a DeepSpeed ZeRO-1/2 checkpoint
  (torch's or zero8's states) or of a universal one; the zero8 engine resumes such a checkpoint through it
  (zero8.deepspeed.migrate).

A universal checkpoint is per parameter: ``<tag>/zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt`` (each
``{"param": tensor}``) and ``step.pt``, ``<tag>/zero/optimizer_state.pt`` (the param groups), the model-states
file beside ``zero/``, and ``latest_universal`` beside the tag; DeepSpeed loads it at any world size with
``"checkpoint": {"load_universal": true}``. Adam, AdamW and LAMB have these two states; other algorithms have
no universal form.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import tempfile
from collections import OrderedDict
from typing import Any, Dict, List, NamedTuple, Optional

import torch

from .. import _C
from .._C import Zero8IOError, Zero8NotSupportedError, Zero8ValueError
from .._torch_load import torch_load
from ..optim import _algos
from ..optim.optimizer import _ALGORITHM_KEY
from ..optim.partition import LAYOUT_KEY, decode_partition_state

__all__ = ["DeepSpeedStates", "is_deepspeed_checkpoint", "read_checkpoint", "to_universal"]

# DeepSpeed's checkpoint keys (deepspeed/checkpoint/constants.py), spelled here so that writing a universal
# checkpoint needs no DeepSpeed.
_OPTIMIZER_STATE_DICT = "optimizer_state_dict"
_BASE_OPTIMIZER_STATE = "base_optimizer_state"
_FP32_GROUPS = "single_partition_of_fp32_groups"
_SLICE_MAPPINGS = "param_slice_mappings"
_GROUP_PADDINGS = "group_paddings"
_PARAM_SHAPES = "param_shapes"
_UNIVERSAL_INFO = "universal_checkpoint_info"
_PARAM = "param"
_MODEL_STATES = "mp_rank_00_model_states.pt"
_OPTIM_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
# The DeepSpeed release whose universal layout export_universal writes (the one the tests load it with). Its
# loader requires a parseable version in optimizer_state.pt.
_DS_LAYOUT_VERSION = "0.19.8"
_ADAM_STATES = ("exp_avg", "exp_avg_sq")
_ADAM_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")


class DeepSpeedStates(NamedTuple):
    """A DeepSpeed checkpoint's trained parameters by name: ``params[name]`` is a dict of float32 tensors of
    the parameter's shape, ``fp32`` (the master weight) and the optimizer states under torch's names
    (``exp_avg``, ``exp_avg_sq``); ``step`` the optimizer steps; ``param_groups`` the saved hyperparameters;
    ``model_states`` the ``mp_rank_00_model_states.pt`` dict; ``kind`` "zero" or "universal"."""

    params: "OrderedDict[str, Dict[str, torch.Tensor]]"
    step: int
    param_groups: List[dict]
    model_states: dict
    kind: str


# The classes DeepSpeed's own checkpoint files pickle besides tensors and plain values (its loss scaler in the
# optimizer files, its ZeRO stage enum, its fragment addresses), by module: reading them constructs these
# classes from their saved fields (no other code runs), so a DeepSpeed checkpoint reads weights-only too.
_DEEPSPEED_GLOBALS = {
    "deepspeed.runtime.fp16.loss_scaler": ("LossScaler", "DynamicLossScaler"),
    "deepspeed.runtime.zero.config": ("ZeroStageEnum",),
    "deepspeed.utils.tensor_fragment": ("fragment_address",),
}
_ALLOW_PICKLE = "allow_pickle=True (to read_checkpoint, to_universal or the engine's load_checkpoint)"


def _deepspeed_globals() -> list:
    """DeepSpeed's classes of _DEEPSPEED_GLOBALS that this DeepSpeed has (none without DeepSpeed)."""
    import importlib

    found = []
    for module, names in _DEEPSPEED_GLOBALS.items():
        try:
            m = importlib.import_module(module)
        except ImportError:
            continue
        found += [getattr(m, n) for n in names if hasattr(m, n)]
    return found


def _load(path: str, allow_pickle: bool) -> Any:
    try:
        return torch_load(path, allow_pickle=allow_pickle, option=_ALLOW_PICKLE, allowed=_deepspeed_globals())
    except FileNotFoundError:
        raise Zero8IOError(f"{path}: no such file") from None
    except ModuleNotFoundError as e:
        raise Zero8NotSupportedError(f"{path}: reading it needs the module {e.name!r} (a DeepSpeed checkpoint pickles "
                                     f"DeepSpeed's classes: pip install deepspeed)") from None


def _optim_files(tag_dir: str) -> List[str]:
    """The ZeRO-1/2 optimizer files of a tag, by data-parallel rank."""
    found = {}
    for path in glob.glob(os.path.join(tag_dir, "*_optim_states.pt")):
        m = _OPTIM_FILE.search(os.path.basename(path))
        if m is not None:
            found[int(m.group(1))] = path
    if found and sorted(found) != list(range(len(found))):
        raise Zero8IOError(f"{tag_dir}: optimizer files of ranks {sorted(found)}; ranks 0..{max(found)} are needed")
    return [found[r] for r in sorted(found)]


def is_deepspeed_checkpoint(tag_dir: str) -> bool:
    """Whether `tag_dir` is a DeepSpeed checkpoint tag (ZeRO-1/2 optimizer files, or a universal checkpoint's
    ``zero/``), not a zero8 engine one (manifest.json)."""
    if os.path.isfile(os.path.join(tag_dir, "manifest.json")):
        return False
    return bool(_optim_files(tag_dir)) or os.path.isfile(os.path.join(tag_dir, "zero", "optimizer_state.pt"))


def _state_names(param_groups: List[dict], where: str) -> tuple:
    """torch's names of the states of the algorithm a state dict's groups record (zero8's record its name);
    torch's AdamW and Adam by default."""
    algo = param_groups[0].get(_ALGORITHM_KEY) if param_groups else None
    if algo is None:
        return _ADAM_STATES
    names = tuple(n for n in _algos.spec(algo).torch_states if n)
    return names


def _torch_partition_states(state: dict, numel: int, names: tuple, where: str) -> Dict[str, torch.Tensor]:
    """One partition's saved state (zero8's segments or torch's names) as torch's names, float32 over `numel`
    elements."""
    if LAYOUT_KEY in state:
        flats = decode_partition_state(state, state[LAYOUT_KEY], numel, len(names), where)
        return dict(zip(names, flats))
    out = {}
    for name in names:
        value = state.get(name)
        if not isinstance(value, torch.Tensor):
            if "state1" in state:
                raise Zero8NotSupportedError(
                    f"{where}: 8-bit states of the whole partition (a zero8 older than zero8.optim.partition, or "
                    f"bitsandbytes): load the checkpoint into this zero8 under DeepSpeed and save it again first")
            raise Zero8ValueError(f"{where}: no {name!r} in the optimizer state (keys: {sorted(state)})")
        flat = torch.zeros(numel, dtype=torch.float32)
        v = value.detach().reshape(-1).to(torch.float32)
        flat[:min(numel, v.numel())] = v[:numel]
        out[name] = flat
    return out


def _step_of(value) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.item())
    return int(value or 0)


# ---------------------------------------------------------------------------------------------------
# DeepSpeed ZeRO checkpoint with zero8 states -> universal (through ds_to_universal)

def _zero_file_as_torch(sd: dict, path: str) -> bool:
    """Rewrite one rank's ZeRO file dict in place: zero8's partition states as torch's names (step as torch
    keeps it, a float tensor). False when it holds no zero8 state."""
    osd = sd.get(_OPTIMIZER_STATE_DICT)
    base = osd.get(_BASE_OPTIMIZER_STATE) if isinstance(osd, dict) else None
    if not isinstance(base, dict) or "state" not in base:
        raise Zero8ValueError(f"{path}: not a DeepSpeed ZeRO stage 1/2 optimizer file (no {_BASE_OPTIMIZER_STATE})")
    groups = base.get("param_groups", [])
    changed = False
    for key, state in list(base["state"].items()):
        if not isinstance(state, dict) or LAYOUT_KEY not in state:
            continue
        names = _state_names(groups, path)
        if names != _ADAM_STATES:
            algo = groups[0].get(_ALGORITHM_KEY)
            raise Zero8NotSupportedError(
                f"{path}: a universal checkpoint holds Adam's exp_avg and exp_avg_sq; this optimizer ({algo}) keeps "
                f"{', '.join(names) or 'no state'}")
        gi = int(key)
        numel = osd[_FP32_GROUPS][gi].numel() + int(osd.get(_GROUP_PADDINGS, [0] * (gi + 1))[gi])
        new = _torch_partition_states(state, numel, names, f"{path}: group {gi}")
        new["step"] = torch.tensor(float(_step_of(state.get("step"))))
        base["state"][key] = new
        changed = True
    for g in groups:
        g.pop(_ALGORITHM_KEY, None)
    return changed


def _to_universal_from_zero(tag_dir: str, out_dir: str, workers: int, allow_pickle: bool) -> None:
    from deepspeed.checkpoint import ds_to_universal  # DeepSpeed's converter does the rest

    files = _optim_files(tag_dir)
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".zero8-to-universal-", dir=parent)
    try:
        for path in files:
            sd = _load(path, allow_pickle)
            _zero_file_as_torch(sd, path)
            torch.save(sd, os.path.join(tmp, os.path.basename(path)))
        for path in glob.glob(os.path.join(tag_dir, "*model_states.pt")):
            sd = _load(path, allow_pickle)
            sd.setdefault(_UNIVERSAL_INFO, {"universal_checkpoint_version": 0.2})
            torch.save(sd, os.path.join(tmp, os.path.basename(path)))
        args = _ds_args(tmp, out_dir, workers)
        ds_to_universal.main(args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _ds_args(input_folder: str, output_folder: str, workers: int):
    import argparse
    return argparse.Namespace(input_folder=input_folder, output_folder=output_folder, num_extract_workers=workers,
                              num_merge_workers=max(1, workers // 2), keep_temp_folder=False, strict=True,
                              inject_missing_state=True)


# ---------------------------------------------------------------------------------------------------
# zero8 engine checkpoint -> universal (written here)

def _sections(tag_dir: str, manifest: dict) -> Dict[int, Dict[str, torch.Tensor]]:
    """Every group's flat arrays from the shards: master and states over [0, numel), absmax over its blocks."""
    groups = manifest["groups"]
    dtypes = {"float32": torch.float32, "uint8": torch.uint8}
    out: Dict[int, Dict[str, torch.Tensor]] = {}
    for f in manifest["files"]:
        if f.get("role") != "shard":
            continue
        path = os.path.join(tag_dir, f["name"])
        with open(path, "rb") as fh:
            data = fh.read()
        for sec in f.get("sections", []):
            kind = sec["kind"]
            if kind == "residual":
                continue
            g = 0 if sec["group"] in (0, "8bit") else 1
            info = groups[g] if isinstance(groups, list) else groups[sec["group"]]
            size = info["num_blocks"] if sec["unit"] == "block" else info["numel"]
            dt = dtypes[sec["dtype"]]
            arrays = out.setdefault(g, {})
            if kind not in arrays:
                arrays[kind] = torch.zeros(size, dtype=dt)
            chunk = torch.frombuffer(bytearray(data[sec["offset"]:sec["offset"] + sec["bytes"]]), dtype=dt)
            arrays[kind][sec["begin"]:sec["end"]] = chunk
    return out


def _map_kind(manifest: dict, state: int, tag_dir: str):
    for m in manifest.get("maps", []):
        if m["state"] == state:
            kind = {"dynamic": _C.MapKind.dynamic_signed, "dynamic_unsigned": _C.MapKind.dynamic_unsigned}.get(m["kind"])
            if kind is None:
                raise Zero8NotSupportedError(f"{tag_dir}/manifest.json: state {state} uses the {m['kind']} map; the "
                                             f"universal export decodes dynamic maps only")
            return kind
    raise Zero8IOError(f"{tag_dir}/manifest.json: no map for 8-bit state {state}")


def _zero8_tag_dir(path: str, tag: Optional[str]) -> str:
    if os.path.isfile(os.path.join(path, "manifest.json")) and tag is None:
        return path
    return _C.checkpoint_tag_path(path, tag if tag is not None else _C.latest_read(path))


def _export_zero8(tag_dir: str, out_dir: str, allow_pickle: bool) -> None:
    check = _C.checkpoint_verify(tag_dir)
    if not check["ok"]:
        raise Zero8IOError(f"{tag_dir}: " + "; ".join(check["problems"]))
    with open(os.path.join(tag_dir, "manifest.json")) as fh:
        manifest = json.load(fh)
    algo = manifest["optimizer"]["algo"]
    names = tuple(n for n in _algos.spec(algo).torch_states if n)
    if names != _ADAM_STATES:
        raise Zero8NotSupportedError(f"{tag_dir}: a universal checkpoint holds Adam's exp_avg and exp_avg_sq; this "
                                     f"checkpoint's optimizer ({algo}) keeps {', '.join(names) or 'no state'}")
    arrays = _sections(tag_dir, manifest)
    block = int(manifest["blocks"]["state_block"])
    values: Dict[int, Dict[str, torch.Tensor]] = {}
    for g, parts in arrays.items():
        n = manifest["groups"][g]["numel"]
        vals = {"fp32": parts["master"]}
        for i, name in enumerate(names, start=1):
            if f"codes{i}" in parts:
                qmap = torch.tensor(_C.map_values(_map_kind(manifest, i, tag_dir)), dtype=torch.float32)
                # Global block b covers the group's elements [b * block, (b + 1) * block).
                scale = parts[f"absmax{i}"].repeat_interleave(block)[:n]
                vals[name] = qmap[parts[f"codes{i}"].long()] * scale
            else:
                vals[name] = parts[f"state{i}"]
        values[g] = vals
    step = int(manifest["step"])
    model_states = _load(os.path.join(tag_dir, _MODEL_STATES), allow_pickle)
    zero = os.path.join(out_dir, "zero")
    shapes: "OrderedDict[str, torch.Size]" = OrderedDict()
    for p in manifest["params"]:
        g = 0 if p["group"] in (0, "8bit") else 1
        shape = torch.Size(p["shape"])
        shapes[p["name"]] = shape
        d = os.path.join(zero, p["name"])
        os.makedirs(d, exist_ok=True)
        for key, flat in values[g].items():
            t = flat[p["offset"]:p["offset"] + p["numel"]].clone().view(shape)
            torch.save({_PARAM: t}, os.path.join(d, f"{key}.pt"))
        torch.save(torch.tensor(float(step)), os.path.join(d, "step.pt"))
    # A tied weight under its other names too (as ds_to_universal writes it): DeepSpeed names it by either.
    for entry in manifest.get("state_dict") or []:
        name, target = entry.get("name"), entry.get("tensor")
        if entry.get("source") == "param" and name != target and target in shapes and name not in shapes:
            shutil.copytree(os.path.join(zero, target), os.path.join(zero, name))
    client = manifest.get("client_state") or {}
    groups = client.get("optimizer") if isinstance(client, dict) else None
    if not isinstance(groups, list) or not groups:
        groups = [dict(lr=manifest["optimizer"]["hyper"]["lr"])]
    # torch's Adam keys only: DeepSpeed copies every saved key into the loading optimizer's groups.
    groups = [{k: (tuple(g[k]) if k == "betas" else g[k]) for k in _ADAM_GROUP_KEYS if k in g} for g in groups]
    torch.save({"ds_version": _DS_LAYOUT_VERSION, "param_groups": groups},
               os.path.join(zero, "optimizer_state.pt"))
    model_states[_PARAM_SHAPES] = [shapes]
    model_states["ds_version"] = _DS_LAYOUT_VERSION
    model_states.setdefault(_UNIVERSAL_INFO, {"universal_checkpoint_version": 0.2})
    torch.save(model_states, os.path.join(out_dir, _MODEL_STATES))
    parent, tag = os.path.split(os.path.abspath(out_dir))
    with open(os.path.join(parent, "latest_universal"), "w") as fh:
        fh.write(tag)


def to_universal(input_path: str, output_dir: str, tag: Optional[str] = None, workers: int = 1,
                 allow_pickle: bool = False) -> str:
    """Convert a checkpoint into a DeepSpeed universal checkpoint at `output_dir` (a tag directory; its parent
    gets ``latest_universal``, as DeepSpeed's ``ds_to_universal`` writes it):

    - a DeepSpeed ZeRO-1/2 checkpoint tag (`input_path` is the tag directory) whose optimizer was zero8's or
      torch's: zero8's 8-bit partition states are decoded to float32 ``exp_avg``/``exp_avg_sq`` and DeepSpeed's
      ``ds_to_universal`` (needs ``deepspeed``) converts the result;
    - a zero8 engine checkpoint (its directory, ``tag`` or the one ``latest`` names; or the tag directory): its
      verified shards are decoded and written in the universal layout (needs only torch).

    Returns `output_dir`. A DeepSpeed engine loads the result at any world size with
    ``"checkpoint": {"load_universal": true}`` and ``engine.load_checkpoint(<parent of output_dir>)``; its
    optimizer must have as many param groups as the checkpoint (DeepSpeed pairs them by position).
    allow_pickle: as read_checkpoint's."""
    input_path = os.fspath(input_path)
    output_dir = os.fspath(output_dir)
    if os.path.exists(output_dir) and os.listdir(output_dir):
        raise Zero8ValueError(f"to_universal: {output_dir} exists and is not empty")
    if _optim_files(input_path):
        _refuse_zero3(input_path, "to_universal")
        if tag is not None:
            raise Zero8ValueError("to_universal: tag is for a zero8 engine checkpoint; give a DeepSpeed checkpoint's "
                                  "tag directory itself")
        _to_universal_from_zero(input_path, output_dir, workers, allow_pickle)
        return output_dir
    if not os.path.isdir(input_path):
        raise Zero8IOError(f"to_universal: {input_path}: no such directory")
    tag_dir = _zero8_tag_dir(input_path, tag)
    os.makedirs(output_dir, exist_ok=True)
    _export_zero8(tag_dir, output_dir, allow_pickle)
    return output_dir


# ---------------------------------------------------------------------------------------------------
# Reading a DeepSpeed checkpoint by parameter

def _refuse_zero3(tag_dir: str, what: str) -> None:
    """A ZeRO-3 checkpoint (each rank's model file, no mp_rank_00_model_states.pt) is refused by name: what reads
    stage 1/2 checkpoints cannot map its per-rank pieces of every parameter."""
    if not os.path.isfile(os.path.join(tag_dir, _MODEL_STATES)) and \
            os.path.isfile(os.path.join(tag_dir, "zero_pp_rank_0_mp_rank_00_model_states.pt")):
        raise Zero8ValueError(f"{tag_dir}: a DeepSpeed ZeRO-3 checkpoint; {what} reads ZeRO stage 1/2 and universal "
                              f"checkpoints. Resume it with DeepSpeed at the same world size (engine.load_checkpoint), "
                              f"or take its fp32 weights with DeepSpeed's zero_to_fp32")


def read_checkpoint(tag_dir: str, allow_pickle: bool = False) -> DeepSpeedStates:
    """The trained parameters of a DeepSpeed checkpoint tag directory, by name (see DeepSpeedStates): a ZeRO
    stage 1/2 checkpoint (every rank's optimizer file, states of torch's AdamW/Adam or of zero8) or a universal
    one (``zero/``). The files are read weights-only (tensors, plain values and DeepSpeed's own checkpoint
    classes, _DEEPSPEED_GLOBALS); any other object fails with Zero8ValueError naming it unless allow_pickle,
    which unpickles anything (as DeepSpeed's own load does) and so may run code from the files."""
    tag_dir = os.fspath(tag_dir)
    model_states_path = os.path.join(tag_dir, _MODEL_STATES)
    if os.path.isfile(os.path.join(tag_dir, "zero", "optimizer_state.pt")):
        return _read_universal(tag_dir, model_states_path, allow_pickle)
    _refuse_zero3(tag_dir, "read_checkpoint")
    files = _optim_files(tag_dir)
    if not files:
        raise Zero8IOError(f"{tag_dir}: not a DeepSpeed ZeRO stage 1/2 or universal checkpoint (no "
                           f"*_optim_states.pt, no zero/optimizer_state.pt)")
    model_states = _load(model_states_path, allow_pickle)
    shapes = OrderedDict()
    for group in model_states.get(_PARAM_SHAPES) or []:
        shapes.update(group)
    if not shapes:
        raise Zero8IOError(f"{model_states_path}: no {_PARAM_SHAPES} (saved without a ZeRO optimizer?)")
    pieces: Dict[str, Dict[str, list]] = {}
    steps, param_groups = set(), []
    for rank, path in enumerate(files):
        osd = _load(path, allow_pickle).get(_OPTIMIZER_STATE_DICT)
        if not isinstance(osd, dict) or _BASE_OPTIMIZER_STATE not in osd:
            raise Zero8IOError(f"{path}: not a DeepSpeed ZeRO stage 1/2 optimizer file")
        base = osd[_BASE_OPTIMIZER_STATE]
        if not isinstance(base, dict) or "state" not in base:
            raise Zero8NotSupportedError(f"{path}: saved with elastic_checkpoint, which zero8 does not read")
        param_groups = base.get("param_groups", [])
        names = _state_names(param_groups, path)
        for gi, fp32 in enumerate(osd[_FP32_GROUPS]):
            numel = fp32.numel() + int(osd.get(_GROUP_PADDINGS, [0] * len(osd[_FP32_GROUPS]))[gi])
            state = base["state"].get(gi, {})
            if state:
                steps.add(_step_of(state.get("step")))
            flats = _torch_partition_states(state, numel, names, f"{path}: group {gi}") if state else \
                {n: torch.zeros(numel) for n in names}
            flats["fp32"] = fp32.detach().reshape(-1).to(torch.float32)
            for name, frag in osd[_SLICE_MAPPINGS][gi].items():
                start, n = int(frag.start), int(frag.numel)
                entry = pieces.setdefault(name, {k: [] for k in flats})
                for k, flat in flats.items():
                    entry[k].append(flat[start:start + n])
    params: "OrderedDict[str, Dict[str, torch.Tensor]]" = OrderedDict()
    for name, shape in shapes.items():
        if name not in pieces:
            raise Zero8IOError(f"{tag_dir}: parameter {name} is in {_PARAM_SHAPES} but in no rank's optimizer file")
        params[name] = {k: torch.cat(v).view(shape) for k, v in pieces[name].items()}
    if len(steps) > 1:
        raise Zero8IOError(f"{tag_dir}: the ranks' optimizer files hold different steps {sorted(steps)}")
    return DeepSpeedStates(params, steps.pop() if steps else 0, param_groups, model_states, "zero")


def _read_universal(tag_dir: str, model_states_path: str, allow_pickle: bool) -> DeepSpeedStates:
    zero = os.path.join(tag_dir, "zero")
    optim = _load(os.path.join(zero, "optimizer_state.pt"), allow_pickle)
    model_states = _load(model_states_path, allow_pickle) if os.path.isfile(model_states_path) else {}
    params: "OrderedDict[str, Dict[str, torch.Tensor]]" = OrderedDict()
    steps = set()
    names = sorted(d for d in os.listdir(zero) if os.path.isdir(os.path.join(zero, d)))
    for group in model_states.get(_PARAM_SHAPES) or []:  # model order when the checkpoint records it
        ordered = [n for n in group if n in names]
        names = ordered + [n for n in names if n not in ordered]
    for name in names:
        d = os.path.join(zero, name)
        entry = {}
        for f in os.listdir(d):
            key, ext = os.path.splitext(f)
            if ext != ".pt":
                continue
            value = _load(os.path.join(d, f), allow_pickle)
            if key == "step":
                steps.add(_step_of(value))
            else:
                entry[key] = value[_PARAM].to(torch.float32)
        if "fp32" not in entry:
            raise Zero8IOError(f"{d}: no fp32.pt")
        params[name] = entry
    if len(steps) > 1:
        raise Zero8IOError(f"{zero}: the parameters hold different steps {sorted(steps)}")
    return DeepSpeedStates(params, steps.pop() if steps else 0, optim.get("param_groups", []), model_states,
                           "universal")
