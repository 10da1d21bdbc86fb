"""The engine's checkpoints, DeepSpeed's layout: save_checkpoint / load_checkpoint over the C++ checkpoint
(fp32 masters and 8-bit states of every rank, manifest, model.safetensors, written atomically) plus rank
0's ``mp_rank_00_model_states.pt`` for ``torch.load``; the engine counters, param groups, LR scheduler and
client_state in the manifest's client state; the module's state dict and the 16-bit model file.
Zero8Engine takes these methods from EngineCheckpoints.
"""

from __future__ import annotations

import builtins
import copy
import io
import json
import math
import os
import re
import types
import warnings
from typing import Any, Callable

import torch

from .. import _C
from .._C import Zero8NotSupportedError, Zero8ValueError
from .._torch_load import torch_load, torch_save_atomic
from ..lr_schedules import Zero8LRScheduler
from .client_optim import _f32, _hyper_from_group
from .params import override_group_text

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
_ENGINE_STATE_FORMAT = "zero8-engine"
_ENGINE_STATE_VERSION = 1
# The words of the C++ layout check (zero8/src/checkpoint/load.cpp, ckpt::load) for a parameter in another hyper
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


class EngineCheckpoints:
    """Zero8Engine's checkpoint methods (DeepSpeed's names); they use the engine's optimizer, module,
    communicator, counters and typed config (self._cfg)."""

    def _checkpoint_tag(self, tag: str, comm=None) -> str:
        """The tag every rank of ``comm`` (default: the data-parallel group) saves under: rank 0's.
        checkpoint.tag_validation (DeepSpeed's Warn, Ignore, Fail) says what another tag on some rank does:
        Fail raises on every rank, Warn warns (rank 0), Ignore says nothing. Either way the shards go under
        rank 0's tag, since shards under several tags are no checkpoint (DeepSpeed's Warn lets each rank
        write its own)."""
        comm = self._dp if comm is None else comm
        if comm.size == 1:
            return tag
        mode = self._cfg.checkpoint.tag_validation
        tags = [t.decode() for t in comm.all_gather_bytes(tag.encode())]
        if len(set(tags)) > 1:
            msg = f"checkpoint tag differs across ranks: {tags}"
            if mode == _C.TagValidation.fail:
                raise Zero8ValueError(f"checkpoint.tag_validation: {msg}")
            if mode != _C.TagValidation.ignore and self.global_rank == 0:
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
        self._wait_gather()  # the working copy holds the last step's update
        save_dir = os.fspath(save_dir)
        _check_tag_not_empty(tag, "save_checkpoint", "save_dir", "global_step<N> (N = engine.global_steps)")
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        tag = self._checkpoint_tag(tag)
        self._save_tag(save_dir, tag, client_state, save_latest, exclude_frozen_parameters,
                       int(self._cfg.zero8.checkpoint_keep_last), stacklevel=3)
        return True

    def _save_tag(self, save_dir: str, tag: str, client_state: dict | None, save_latest: bool,
                  exclude_frozen_parameters: bool, keep_last: int, stacklevel: int) -> None:
        """save_checkpoint under a tag the ranks agreed on (collective over the data-parallel group).
        ``stacklevel``: the frame of the user's save_checkpoint call, counted from here, for warnings."""
        client_state = dict(client_state or {})
        gas = self.gradient_accumulation_steps()
        done = max(self._backwards_pending, self._accum_steps + int(self._backward_done))
        if done and self.global_rank == 0:
            warnings.warn(
                f"save_checkpoint in the middle of gradient accumulation (micro-batch {done} of {gas} of step "
                f"{self.global_steps + 1}): the gradients of that step are not saved; a load resumes at its start",
                stacklevel=stacklevel)
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
        # The .pt file goes into the tag with the shards, before the tag is installed and `latest` moves,
        # so a crash or a full disk never leaves `latest` naming a tag without it.
        written = self._on_ranks_agreed(
            lambda: (self._model_states_bytes(client_state, sched_state, exclude_frozen_parameters),
                     self._module_rest(exclude_frozen_parameters, stacklevel + 3)),
            f"save_checkpoint: writing {MODEL_STATES_FILE}")
        pt, (state_dict, module_tensors) = (None, ([], [])) if written is None else written
        extra = {} if pt is None else {MODEL_STATES_FILE: pt}
        # The C++ writer reads the tensors where they are: module_tensors keeps them alive until it returns.
        views = [(k, dtype, shape, t.data_ptr(), t.numel() * t.element_size()) for k, dtype, shape, t in module_tensors]
        with self._stream_order():  # a device optimizer's parts are copied out on its stream
            _C.checkpoint_save(self._opt, save_dir, tag, json.dumps(state), self.zero8_config.json, keep_last, extra,
                               bool(save_latest), state_dict, views)

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
        torch_save_atomic(self._module_state_dict(exclude_frozen_parameters), path)
        return True

    save_fp16_model = save_16bit_model  # DeepSpeed's older name

    def _on_ranks_agreed(self, work: Callable[[], Any], what: str, all_ranks: bool = False, comm=None) -> Any:
        """Run ``work`` on rank 0 of ``comm`` (default: the data-parallel group; all_ranks: on every rank),
        then let every rank learn whether it failed anywhere (a collective), so that no rank goes on alone
        into the next collective: a failing rank re-raises its error; the others raise the first failing
        rank's, as the same kind of error, prefixed with ``what`` and that rank (of ``comm``). Returns
        work's result where it ran, else None."""
        comm = self._dp if comm is None else comm
        result, error = None, None
        if all_ranks or comm.rank == 0:
            try:
                result = work()
            except Exception as e:  # every rank must reach the all-reduce below
                error = e
        if not comm.all_reduce_f64([1.0 if error is not None else 0.0], "max")[0]:
            return result
        mine = b"" if error is None else f"{type(error).__name__}\n{error}".encode()
        reports = comm.all_gather_bytes(mine)
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

    def _module_rest(self, exclude_frozen: bool, stacklevel: int) -> tuple[list, list]:
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
                              f"whole state_dict is in {MODEL_STATES_FILE})", stacklevel=stacklevel)
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

    def _load_dir_checked(self, load_dir, tag, custom_load_fn) -> str | None:
        """load_checkpoint's argument checks, the plain engine's and the pipeline engine's: load_dir as a str,
        or None when tag is None and load_dir has no ``latest`` (rank 0 warns; the load returns (None, None)
        without reading anything). First the pending parameter gather, whose writes the load replaces."""
        self._wait_gather()
        if custom_load_fn is not None:
            raise Zero8NotSupportedError("load_checkpoint(custom_load_fn=...) is not supported")
        load_dir = os.fspath(load_dir)
        _check_tag_not_empty(tag, "load_checkpoint", "load_dir", "the tag 'latest' names")
        if tag is None and not os.path.isfile(os.path.join(load_dir, "latest")):
            if self.global_rank == 0:
                # stacklevel: here, load_checkpoint, its caller
                warnings.warn(f"load_checkpoint: no 'latest' file in {load_dir}; nothing loaded", stacklevel=3)
            return None
        return load_dir

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn: Callable | None = None, allow_pickle: bool | None = None):
        """Collective load of ``<load_dir>/<tag>`` (tag None: the one ``latest`` names) at any world size.
        Returns ``(load_path, client_state)`` as DeepSpeed (load_path: the tag's model-states file;
        client_state: the keys of that file the load did not consume, the caller's saved client_state among
        them, see _returned_client_state), or ``(None, None)`` when load_dir has no ``latest``; tag=""
        (DeepSpeed: load_dir itself) raises Zero8ValueError. With load_optimizer_states (default) the C++
        load restores masters, 8-bit states, the working copy bit for bit, steps and loss scale; otherwise
        only the module weights are read (from the .pt file) and the masters are reset from them.
        Everything is read and checked on every rank before anything changes: a load that raises (on any
        rank, for any reason) leaves the engine as it was, on every rank. allow_pickle (default: the config's
        zero8.checkpoint.allow_pickle, false): unpickle any object of the model-states file, such as a
        client_state of custom classes, which can run code from the file; else an object other than tensors
        and plain values fails the load with Zero8ValueError naming it."""
        self._check_live()
        load_dir = self._load_dir_checked(load_dir, tag, custom_load_fn)
        if load_dir is None:
            return None, None
        if allow_pickle is None:
            allow_pickle = bool(self._cfg.zero8.checkpoint_allow_pickle)
        tag = "" if tag is None else str(tag)
        from ..deepspeed.universal import is_deepspeed_checkpoint
        ds_tag = tag or _latest_text(load_dir)
        if ds_tag and "/" not in ds_tag and not ds_tag.startswith(".") and \
                is_deepspeed_checkpoint(os.path.join(load_dir, ds_tag)):
            # A run moved from DeepSpeed: its fp32 states quantized into this engine's (zero8.deepspeed.migrate).
            from ..deepspeed.migrate import load_into_engine
            return load_into_engine(self, load_dir, ds_tag, load_module_strict=load_module_strict,
                                    load_optimizer_states=load_optimizer_states,
                                    load_lr_scheduler_states=load_lr_scheduler_states,
                                    load_module_only=load_module_only, allow_pickle=allow_pickle)
        full = load_optimizer_states and not load_module_only
        staged: dict = {}

        def stage(path: str, client_state_json: str) -> None:
            """Read and check everything the engine applies after the C++ load (which cannot fail then)."""
            model_states = self._read_model_states(path, allow_pickle)
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
                with self._stream_order():
                    res = _C.checkpoint_load(self._opt, load_dir, tag, True, lambda r: self._load_before_commit(
                        lambda: stage(r["path"], r["client_state_json"])))
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
            with self._stream_order():
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
                    f"x {self.gradient_accumulation_steps()} accumulation steps). Training goes on from step "
                    f"{self.global_steps} with the new "
                    "batch; the LR schedule counts steps, not samples", stacklevel=2)
            saved_clip = saved_config.get("gradient_clipping") if isinstance(saved_config, dict) else None
            if isinstance(saved_clip, (int, float)) and float(saved_clip) != self.gradient_clipping() \
                    and self.global_rank == 0:
                warnings.warn(
                    f"load_checkpoint: the checkpoint was trained with gradient_clipping {float(saved_clip):g}; this "
                    f"engine's config gives {self.gradient_clipping():g} (DeepSpeed's default, and so zero8's, is 1.0 "
                    f"since DeepSpeed PR #8068, where it was 0: off). Training goes on with "
                    f"{self.gradient_clipping():g}; set \"gradient_clipping\": {float(saved_clip):g} in the config to "
                    f"go on as saved", stacklevel=2)
        self._restart_accumulation()
        return os.path.join(path, MODEL_STATES_FILE), self._returned_client_state(
            model_states, state, load_module_only, load_optimizer_states, load_lr_scheduler_states)

    def _load_before_commit(self, check: Callable[[], None]) -> None:
        """Runs the load's last checks, inside the C++ load before it changes anything (a raise here on any
        rank fails the load on every rank of the data-parallel group, changing nothing). The pipeline engine
        makes every stage agree here."""
        check()

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
                saved_what = override_group_text(g.get("param_group"), g["overrides"])
            else:  # a checkpoint of an engine that did not record its overrides
                saved_what = f"an override group, numbered after the checkpoint's {len(saved_groups)} param group(s)"
        n = len(self.optimizer.param_groups)
        if here >= n:
            here_what = override_group_text(*self._override_groups[here - n])
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
    def _read_model_states(tag_path: str, allow_pickle: bool) -> dict:
        """The model-states file, its module tensors mapped from the file (torch.load with mmap) rather than
        read into memory: the load copies them into the module (the frozen parameters and buffers, or every
        entry without the optimizer states) straight from the page cache, so a large frozen tensor costs no
        rank a copy of its own. Everything else (the caller's client_state, the LR scheduler's state, a
        module's extra state) may outlive the load, so it is copied out of the mapping here: the mapping goes
        with the last module tensor, when the load returns. Tensors and plain values only, unless
        `allow_pickle` (client_state may hold any picklable object, as in DeepSpeed, but unpickling one can run
        code from the file). torch.save's zipfile format (the only one zero8 writes) is what mmap needs."""
        path = os.path.join(tag_path, MODEL_STATES_FILE)
        option = "load_checkpoint(..., allow_pickle=True) or zero8.checkpoint.allow_pickle in the config"
        try:
            states = torch_load(path, allow_pickle=allow_pickle, option=option, mmap=True)
        except (FileNotFoundError, Zero8ValueError):
            raise
        except Exception as mapped_error:
            # A file system that cannot map files (some FUSE mounts) still reads it: load it into memory.
            try:
                states = torch_load(path, allow_pickle=allow_pickle, option=option)
            except Zero8ValueError:
                raise
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
        schedule's load_state_dict writes lr into the param groups: its position is checked instead). The copy
        is deep but for the optimizer: SequentialLR and ChainedScheduler load into their child schedulers, and
        LambdaLR into its callable objects, which a shallow copy would share with this scheduler."""
        sched = self.lr_scheduler
        try:
            if isinstance(sched, Zero8LRScheduler):
                int(sd["last_batch_iteration"])
            else:
                opt = getattr(sched, "optimizer", None)
                try:
                    trial = copy.deepcopy(sched, memo={id(opt): opt} if opt is not None else None)
                except Exception:  # a member that cannot be copied: try on this one, then put its state back
                    now = copy.deepcopy(sched.state_dict())
                    try:
                        sched.load_state_dict(copy.deepcopy(sd))
                    finally:
                        sched.load_state_dict(now)
                else:
                    trial.load_state_dict(copy.deepcopy(sd))
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
    before), else a copy: torch.save writes a tensor's whole storage, once per storage. A GPU tensor is
    copied to the CPU, so that the file loads on any machine, as the checkpoint's other files do."""
    if t.device.type != "cpu":
        return t.to("cpu")
    exact = (t.layout == torch.strided and t.device.type == "cpu" and t.is_contiguous() and not t.is_conj()
             and not t.is_neg() and t.storage_offset() == 0
             and t.untyped_storage().nbytes() == t.numel() * t.element_size())
    ptr = t.untyped_storage().data_ptr() if exact else None
    if not exact or ptr in seen:
        return t.clone()
    seen.add(ptr)
    return t


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


def _latest_text(load_dir: str) -> str:
    """The tag `<load_dir>/latest` names, "" when unreadable (the C++ load then reports it)."""
    try:
        with open(os.path.join(load_dir, "latest")) as f:
            return f.read().strip()
    except OSError:
        return ""
