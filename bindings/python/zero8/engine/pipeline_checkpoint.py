"""The pipeline engine's checkpoints. A tag holds every stage's checkpoint (the plain engine's: fp32
masters, 8-bit state shards, model files, counters) in ``stage_<s>/``, one file per layer in DeepSpeed's
naming (``layer_<index>-model_states.pt``, a torch.save of the layer's state_dict), and ``pipeline.json``
(the topology, the partition, the counters):

    <dir>/latest
    <dir>/<tag>/pipeline.json
    <dir>/<tag>/layer_00-model_states.pt ...
    <dir>/<tag>/stage_00/<tag>/manifest.json, zero8_shard_rank0.bin, ...   (a zero8 checkpoint directory)

A save writes all of it into ``<dir>/.tmp-pipe-<nonce>/``, every stage at once, and world rank 0 renames it
to ``<dir>/<tag>`` once every rank has written its part, then replaces ``latest``. A load with the optimizer
states needs the same number of stages and partition (any data-parallel size: each stage's checkpoint
re-cuts its shards); a weights-only load (load_module_only, or load_optimizer_states=False) reads the layer
files, so it works at any pipeline degree, as DeepSpeed's.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
import warnings

import torch

from .. import _C
from .._C import Zero8NotSupportedError, Zero8ValueError
from .checkpoint import EngineCheckpoints, _check_tag_not_empty, _json_exact

PIPELINE_FILE = "pipeline.json"
_FORMAT = "zero8-pipeline"
_VERSION = 1
_TMP_PREFIX = ".tmp-pipe-"
_REPLACED_PREFIX = ".replaced-pipe-"


def stage_dir(tag_dir: str, stage: int) -> str:
    """The zero8 checkpoint directory of one stage inside a pipeline tag."""
    return os.path.join(tag_dir, f"stage_{stage:02d}")


class PipelineCheckpoints:
    """PipelineEngine's save_checkpoint / load_checkpoint (DeepSpeed's names and return values), over the
    plain engine's per-stage ones."""

    def save_checkpoint(self, save_dir, tag=None, client_state: dict | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """Collective over every rank: ``<save_dir>/<tag>/`` (tag default ``global_step<global_steps>``) with
        each stage's checkpoint, the layer files and pipeline.json, installed whole or not at all, then
        ``latest`` (unless save_latest is false). zero8.checkpoint.keep_last counts pipeline tags. Returns
        True."""
        self._check_live()
        save_dir = os.fspath(save_dir)
        _check_tag_not_empty(tag, "save_checkpoint", "save_dir", "global_step<N> (N = engine.global_steps)")
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        tag = self._checkpoint_tag(tag, comm=self._world)
        nonce = self._on_ranks_agreed(lambda: _staging_begin(save_dir), "save_checkpoint: preparing the directory",
                                      comm=self._world)
        nonce = self._world.broadcast_bytes((nonce or "").encode(), 0).decode()
        staging = os.path.join(save_dir, _TMP_PREFIX + nonce)
        try:
            def write_stage() -> None:
                # stacklevel: _save_tag, write_stage, _on_ranks_agreed, save_checkpoint, its caller
                self._save_tag(stage_dir(staging, self.stage_id), tag, client_state, False,
                               exclude_frozen_parameters, 0, stacklevel=5)
                if self._dp.rank == 0:
                    self.module.save_layer_files(staging, exclude_frozen_parameters)

            self._on_ranks_agreed(write_stage, "save_checkpoint", all_ranks=True, comm=self._world)
            meta = self._pipeline_meta(tag)
            keep_last = int(self._cfg.zero8.checkpoint_keep_last)
            self._on_ranks_agreed(lambda: _install(save_dir, staging, tag, meta, bool(save_latest), keep_last),
                                  "save_checkpoint: installing the tag", comm=self._world)
        except BaseException:
            if self._world.rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
            raise
        return True

    def _pipeline_meta(self, tag: str) -> dict:
        m = self.module
        sched = self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None
        return {
            "format": _FORMAT, "version": _VERSION, "tag": tag, "saved_unix_s": time.time(),
            "num_stages": m.num_stages, "dp_world_size": self.dp_world_size, "parts": list(m.parts),
            "num_layers": m._num_layers, "partition_method": m.partition_method,
            "engine": self._engine_state(),
            "lr_scheduler": sched if _json_exact(sched) else None,
        }

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        raise Zero8NotSupportedError(
            "save_16bit_model: a pipeline engine's weights are spread over its stages; save_checkpoint writes them "
            "as layer files (<tag>/layer_<index>-model_states.pt), which zero8.pipe.LayerModule(...).read_layer_files "
            "or a PipelineModule of any partition loads")

    save_fp16_model = save_16bit_model

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn=None, allow_pickle: bool | None = None):
        """Collective over every rank. Returns (load_path, client_state) as the plain engine's (this stage's),
        or (None, None) when load_dir has no ``latest``. With the optimizer states (the default): every
        stage loads its own checkpoint (any data-parallel size), bit-exact at the same one; the pipeline
        degree and partition must be the checkpoint's. Weights only (load_module_only, or
        load_optimizer_states=False): each stage reads its layers' files, at any pipeline degree; the
        counters and LR scheduler come back unless load_module_only. Whatever fails, on any rank, nothing
        changes anywhere. allow_pickle: as the plain engine's (the layer files always load weights-only)."""
        self._check_live()
        load_dir = self._load_dir_checked(load_dir, tag, custom_load_fn)
        if load_dir is None:
            return None, None
        found: dict = {}

        def locate() -> None:
            t = _C.latest_read(load_dir) if tag is None else str(tag)
            path = _tag_dir(load_dir, t)
            found.update(tag=t, path=path, meta=_read_meta(path))

        self._on_ranks_agreed(locate, "load_checkpoint (nothing was loaded)", all_ranks=True, comm=self._world)
        t, path, meta = found["tag"], found["path"], found["meta"]
        full = load_optimizer_states and not load_module_only
        if full:
            self._check_same_pipeline(meta, path)
            self._load_agreed = False
            try:
                result = EngineCheckpoints.load_checkpoint(
                    self, stage_dir(path, self.stage_id), t, load_module_strict=load_module_strict,
                    load_optimizer_states=True, load_lr_scheduler_states=load_lr_scheduler_states,
                    allow_pickle=allow_pickle)
            except Exception as e:
                if not self._load_agreed:  # this stage failed before its check: the others wait for its word
                    self._load_agreed = True
                    self._on_ranks_agreed(_raiser(e), "load_checkpoint (nothing was loaded)", all_ranks=True,
                                          comm=self._world)
                raise
        else:
            result = self._load_layers(path, meta, load_module_strict, load_module_only, load_lr_scheduler_states)
        self._after_load()
        return result

    def _load_before_commit(self, check) -> None:
        # Every stage reaches this point of its load or fails before it: the stages agree here, so that
        # none changes anything unless all can.
        self._load_agreed = True
        self._on_ranks_agreed(check, "load_checkpoint (nothing was loaded)", all_ranks=True, comm=self._world)

    def _check_same_pipeline(self, meta: dict, path: str) -> None:
        m = self.module
        if meta["num_stages"] != m.num_stages:
            raise Zero8ValueError(
                f"load_checkpoint: {path} was saved by a pipeline of {meta['num_stages']} stages, this engine has "
                f"{m.num_stages}; the optimizer states load at the same pipeline degree only (any data-parallel "
                f"size). load_module_only=True (or load_optimizer_states=False) loads the weights from the layer "
                f"files at any degree")
        if list(meta["parts"]) != list(m.parts) or meta["num_layers"] != m._num_layers:
            raise Zero8ValueError(
                f"load_checkpoint: {path} was saved with the layers partitioned as {meta['parts']} "
                f"({meta['num_layers']} layers), this engine has {m.parts} ({m._num_layers} layers); the optimizer "
                f"states load with the same partition only. load_module_only=True (or load_optimizer_states=False) "
                f"loads the weights from the layer files")

    def _load_layers(self, path: str, meta: dict, strict: bool, module_only: bool, load_sched: bool):
        """Weights from the layer files (any pipeline degree); the masters are set from them."""
        staged: dict = {}

        def read() -> None:
            if meta["num_layers"] != self.module._num_layers:
                raise Zero8ValueError(f"{path}: saved a model of {meta['num_layers']} layers, this one has "
                                      f"{self.module._num_layers}")
            staged["layers"] = self.module.read_layer_files(path, strict=strict)
            sched = meta.get("lr_scheduler")
            if not module_only and load_sched and self.lr_scheduler is not None and sched is not None:
                self._check_scheduler_state(sched, path)
                staged["sched"] = sched

        self._on_ranks_agreed(read, "load_checkpoint (nothing was loaded)", all_ranks=True, comm=self._world)
        with torch.no_grad():
            for module, sd in staged["layers"]:
                module.load_state_dict(sd, strict=strict)
        with self._stream_order():  # the weights were copied in on the current stream
            self._opt.init(0)  # masters from the loaded weights, everywhere equal
        if not module_only:
            e = meta["engine"]
            self.global_steps = int(e["global_steps"])
            self.global_samples = int(e["global_samples"])
            self.micro_steps = int(e["micro_steps"])
            self.skipped_steps = int(e["skipped_steps"])
            if "sched" in staged:
                self.lr_scheduler.load_state_dict(staged["sched"])
                self._apply_hyper()
            elif load_sched and self.lr_scheduler is not None and self.global_rank == 0:
                warnings.warn(f"load_checkpoint: {path} holds no LR scheduler state this engine can read; the "
                              "scheduler keeps its position", stacklevel=3)
        self._restart_accumulation()
        return path, {}

    def _after_load(self) -> None:
        """The tied copies from their owners again, and no replica gradient left from before the load."""
        for acc in self._tied_acc.values():
            acc.zero_()
        with self._batch_stream():  # on the engine's stream, where the pipe communicator receives the copies
            self._sync_tied_weights(everything=True)


def _raiser(error: Exception):
    def work():
        raise error
    return work


def _staging_begin(save_dir: str) -> str:
    """World rank 0: the save directory exists, leftovers of interrupted saves are gone, and a fresh
    staging directory is made; returns its nonce."""
    os.makedirs(save_dir, exist_ok=True)
    for name in os.listdir(save_dir):
        if name.startswith(_TMP_PREFIX):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
    nonce = secrets.token_hex(8)
    os.makedirs(os.path.join(save_dir, _TMP_PREFIX + nonce))
    return nonce


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _install(save_dir: str, staging: str, tag: str, meta: dict, save_latest: bool, keep_last: int) -> None:
    """World rank 0, after every rank wrote its part: pipeline.json, then the staging directory becomes
    <save_dir>/<tag> (an existing tag of that name is moved aside first and removed last), then latest."""
    _write_synced(os.path.join(staging, PIPELINE_FILE), json.dumps(meta, indent=1).encode())
    _fsync_dir(staging)
    final = os.path.join(save_dir, tag)
    replaced = None
    if os.path.exists(final):
        replaced = os.path.join(save_dir, f"{_REPLACED_PREFIX}{tag}-{os.path.basename(staging)[len(_TMP_PREFIX):]}")
        os.rename(final, replaced)
    os.rename(staging, final)
    _fsync_dir(save_dir)
    if save_latest:
        tmp = os.path.join(save_dir, "latest.tmp")
        _write_synced(tmp, tag.encode())
        os.replace(tmp, os.path.join(save_dir, "latest"))
        _fsync_dir(save_dir)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    if keep_last > 0:
        _keep_last(save_dir, tag, keep_last)


def _keep_last(save_dir: str, tag: str, keep_last: int) -> None:
    """Removes all but the keep_last most recently saved pipeline tags (never the one just saved nor the
    one latest names; directories without a readable pipeline.json are never touched)."""
    try:
        latest = _C.latest_read(save_dir)
    except Exception:
        latest = None
    tags = []
    for name in os.listdir(save_dir):
        try:
            meta = _read_meta(os.path.join(save_dir, name))
        except Exception:
            continue
        tags.append((float(meta.get("saved_unix_s", 0.0)), name))
    tags.sort(reverse=True)
    for _, name in tags[keep_last:]:
        if name not in (tag, latest):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)


def _tag_dir(load_dir: str, tag: str) -> str:
    """<load_dir>/<tag>, or where an interrupted replace of it left the old one."""
    path = os.path.join(load_dir, tag)
    if "/" in tag or tag.startswith("."):
        raise Zero8ValueError(f"load_checkpoint: tag '{tag}' is not the name of a directory in {load_dir}")
    if os.path.isfile(os.path.join(path, PIPELINE_FILE)):
        return path
    for name in sorted(os.listdir(load_dir)):
        if name.startswith(f"{_REPLACED_PREFIX}{tag}-") and os.path.isfile(os.path.join(load_dir, name, PIPELINE_FILE)):
            return os.path.join(load_dir, name)
    if os.path.isfile(os.path.join(path, "manifest.json")):
        raise Zero8ValueError(f"load_checkpoint: {path} is a checkpoint of the plain engine (no {PIPELINE_FILE}); "
                              f"a pipeline engine loads the checkpoints of pipeline engines")
    raise _C.Zero8IOError(f"{path}: missing: tag '{tag}' is not a complete pipeline checkpoint (no {PIPELINE_FILE})")


def _read_meta(tag_dir: str) -> dict:
    path = os.path.join(tag_dir, PIPELINE_FILE)
    with open(path, encoding="utf-8") as f:
        meta = json.load(f)
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise _C.Zero8IOError(f"{path}: not a zero8 pipeline checkpoint description")
    if meta.get("version") != _VERSION:
        raise _C.Zero8IOError(f"{path}: version {meta.get('version')}, this zero8 reads version {_VERSION}")
    return meta
