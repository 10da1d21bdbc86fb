"""Pipeline models under DeepSpeed's names (deepspeed.pipe): a model written as a list of layers
(``LayerSpec``: a module class and its arguments, built where it runs; ``TiedLayerSpec``: one module shared
by several places of the list, e.g. the input embedding and the output head; plain modules; functions),
cut into consecutive stages by ``PipelineModule``, each process building only its stage's layers.
``LayerModule`` builds all of them in one process: the same model for zero8's plain engine and for
inference, with the same parameter names ("<layer index>.<name>", "tied_modules.<key>.<name>").
"""

from __future__ import annotations

import functools
import os
import re
from typing import Callable

import torch
from torch import nn

from .._C import Zero8NotSupportedError, Zero8ValueError
from .._torch_load import torch_save_atomic
from .topology import PipeDataParallelTopology, ProcessTopology

PARTITION_METHODS = ("parameters", "uniform", "type:<regex>")


class PipelineError(Exception):
    """A pipeline model used where only the pipeline engine's train_batch / eval_batch can run it."""


class LayerSpec:
    """A layer to build later, where it runs: ``LayerSpec(nn.Linear, 512, 512, bias=False)`` builds
    ``nn.Linear(512, 512, bias=False)`` on the stage that owns it only."""

    def __init__(self, typename, *module_args, **module_kwargs):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec: {typename!r} is not a torch.nn.Module class (LayerSpec builds modules)")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A module shared by every TiedLayerSpec with the same ``key``: built once per stage that uses it,
    called as ``forward_fn(module, x)`` when given (a head reusing an embedding's matrix) else as the module.
    Across stages the copies are kept identical: the gradients of every stage holding the key are summed
    into the first one's (its owner, which steps them), and the owner's weights go to the others after each
    step. zero8 ties every parameter of the module; ``tied_weight_attr`` (DeepSpeed's list of the tied
    attributes) must name parameters of it."""

    def __init__(self, key, typename, *module_args, forward_fn: Callable | None = None,
                 tied_weight_attr=("weight",), **module_kwargs):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = str(key)
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` consecutive parts with equal counts, the first ``num_items % num_parts``
    parts one longer (DeepSpeed's uniform partition)."""
    base, extra = divmod(num_items, num_parts)
    parts = [0]
    for p in range(num_parts):
        parts.append(parts[-1] + base + (1 if p < extra else 0))
    return parts


def partition_balanced(weights: list[float], num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` non-empty consecutive parts whose largest total weight is as small as it
    can be (the slowest stage sets the pipeline's pace); among those, the one with the smallest sum of
    squared part weights, then of squared part lengths, so that ties spread evenly."""
    n = len(weights)
    if num_parts > n:
        raise Zero8ValueError(f"cannot cut {n} layer(s) into {num_parts} non-empty stages")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = (float("inf"),) * 3
    # best[j][i]: the best cost of the first i layers in j parts, and where its last part starts
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = (0.0, 0.0, 0.0)
    for j in range(1, num_parts + 1):
        for i in range(j, n - (num_parts - j) + 1):
            for k in range(j - 1, i):
                prev = best[j - 1][k]
                if prev[0] == float("inf"):
                    continue
                w = prefix[i] - prefix[k]
                cost = (max(prev[0], w), prev[1] + w * w, prev[2] + float(i - k) ** 2)
                if cost < best[j][i]:
                    best[j][i] = cost
                    cut[j][i] = k
    parts = [n]
    for j in range(num_parts, 0, -1):
        parts.append(cut[j][parts[-1]])
    return parts[::-1]


def _layer_name(layer) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


def _count_trainable(layer) -> int:
    """Trainable parameters of one layer; a LayerSpec is built on the meta device (no memory, no RNG draws
    from the caller's stream), or for real when its module cannot be."""
    if isinstance(layer, LayerSpec):
        with torch.random.fork_rng(devices=[]):
            try:
                with torch.device("meta"):
                    module = layer.build()
            except Exception:  # a module whose constructor needs real tensors
                module = layer.build()
        return sum(p.numel() for p in module.parameters() if p.requires_grad)
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0


def _stage_device(device) -> torch.device:
    """Where a PipelineModule's stage goes (see its ``device``)."""
    if device is not None:
        return torch.device(device)
    from .. import _tensors
    from ..engine import device as engine_device  # through the module: tests stand in for local_device

    if _tensors.CUDA_BUILT and torch.cuda.is_available():
        return engine_device.local_device()
    return torch.device("cpu")


class LayerModule(nn.Module):
    """Every layer of a pipeline model in this process, run in order: the non-pipelined model of the same
    layer list (parameter names as the PipelineModule's, so state dicts and layer files are shared).
    ``loss_fn(outputs, labels)`` is kept for the caller (the plain engine computes its own loss).

    seed_layers: layer i is built right after ``seed_fn(base_seed + i)`` (default torch.manual_seed), so a
    layer starts from the same weights whichever process builds it; the caller's RNG stream is left as it
    was. activation_checkpoint_interval > 0: consecutive groups of that many layers run under
    ``activation_checkpoint_func`` (default torch.utils.checkpoint.checkpoint with use_reentrant=False) when
    they hold a layer with parameters (or, with ``checkpointable_layers``, only layers of those class names).
    """

    def __init__(self, layers, loss_fn: Callable | None = None, seed_layers: bool = False,
                 seed_fn: Callable | None = None, base_seed: int = 1234, activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable | None = None, checkpointable_layers=None):
        super().__init__()
        self._layer_specs = list(layers)
        if not self._layer_specs:
            raise Zero8ValueError("pipeline model: the layer list is empty")
        self._num_layers = len(self._layer_specs)
        self.loss_fn = loss_fn
        self.seed_layers = bool(seed_layers)
        self.seed_fn = seed_fn
        self.base_seed = int(base_seed)
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
            raise TypeError("checkpointable_layers must be a list of layer class names")
        self.checkpointable_layers = checkpointable_layers
        self.activation_checkpoint_func = activation_checkpoint_func or functools.partial(
            torch.utils.checkpoint.checkpoint, use_reentrant=False)
        self.set_checkpoint_interval(activation_checkpoint_interval)
        self._tie_layers = {}  # key -> the layer indices of its TiedLayerSpecs (all of them, any stage)
        for idx, layer in enumerate(self._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                self._tie_layers.setdefault(layer.key, []).append(idx)
            elif isinstance(layer, LayerModule):
                raise Zero8NotSupportedError(f"layer {idx}: a pipeline module inside a pipeline module is not supported")
        self._local_start, self._local_stop = self._select_layers()
        self._build()

    def _select_layers(self) -> tuple[int, int]:
        """The range of layers this process builds: all of them."""
        return 0, self._num_layers

    def _build(self) -> None:
        """Builds the layers [_local_start, _local_stop): modules registered as str(index), tied modules
        once each under tied_modules[key]."""
        self.forward_funcs: list = []
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        with torch.random.fork_rng(devices=[], enabled=self.seed_layers):
            for idx in range(self._local_start, self._local_stop):
                layer = self._layer_specs[idx]
                if self.seed_layers:
                    (self.seed_fn or torch.manual_seed)(self.base_seed + idx)
                if isinstance(layer, TiedLayerSpec):
                    if layer.key not in self.tied_modules:
                        module = layer.build()
                        names = dict(module.named_parameters())
                        bad = [a for a in layer.tied_weight_attr if a not in names]
                        if bad:
                            raise Zero8ValueError(
                                f"layer {idx}: TiedLayerSpec '{layer.key}': tied_weight_attr {bad} are not parameters "
                                f"of {type(module).__name__} (it has {sorted(names)})")
                        self.tied_modules[layer.key] = module
                        self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                    module = self.tied_modules[layer.key]
                    self.forward_funcs.append(module if layer.forward_fn is None
                                              else functools.partial(layer.forward_fn, module))
                elif isinstance(layer, LayerSpec):
                    module = layer.build()
                    self.add_module(str(idx), module)
                    self.forward_funcs.append(module)
                elif isinstance(layer, nn.Module):
                    self.add_module(str(idx), layer)
                    self.forward_funcs.append(layer)
                elif callable(layer):
                    self.forward_funcs.append(layer)
                else:
                    raise TypeError(f"layer {idx}: {type(layer).__name__} is not a LayerSpec, a module or a callable")

    def set_checkpoint_interval(self, interval: int) -> None:
        if not isinstance(interval, int) or interval < 0:
            raise Zero8ValueError(f"activation_checkpoint_interval must be an integer >= 0, got {interval!r}")
        self.activation_checkpoint_interval = interval

    def reentrant_checkpointing(self) -> bool:
        """Whether activation checkpointing runs a reentrant function, whose segment's output requires grad
        only when one of its inputs does: the pipeline engine then makes a stage's floating inputs require
        grad, as DeepSpeed's does. Any function but torch's non-reentrant checkpoint counts (DeepSpeed's rule
        with its own non-reentrant function)."""
        if self.activation_checkpoint_interval <= 0:
            return False
        f = self.activation_checkpoint_func
        return not (isinstance(f, functools.partial) and f.func is torch.utils.checkpoint.checkpoint
                    and f.keywords.get("use_reentrant") is False)

    def _checkpointable(self, funcs) -> bool:
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for f in funcs)

    def _run(self, start: int, end: int):
        def run(*inputs):
            x = inputs[0] if len(inputs) == 1 else inputs
            for f in self.forward_funcs[start:end]:
                x = f(x)
            return x
        return run

    def forward(self, forward_input):
        n = len(self.forward_funcs)
        interval = self.activation_checkpoint_interval
        if interval == 0:
            return self._run(0, n)(forward_input)
        x = forward_input
        for start in range(0, n, interval):
            end = min(start + interval, n)
            args = x if isinstance(x, tuple) else (x,)
            if self._checkpointable(self.forward_funcs[start:end]):
                x = self.activation_checkpoint_func(self._run(start, end), *args)
            else:
                x = self._run(start, end)(*args)
        return x

    # ---- layer files (DeepSpeed's names: layer_<index>-model_states.pt, a torch.save of the layer's
    # state_dict), so a model saved with one partition loads with any other ----
    def _layer_modules(self):
        """(global index, module) of this process's layers that have a state: modules, and tied modules
        under each of their layer indices."""
        for idx in range(self._local_start, self._local_stop):
            layer = self._layer_specs[idx]
            if isinstance(layer, TiedLayerSpec):
                yield idx, self.tied_modules[layer.key]
            elif isinstance(layer, (LayerSpec, nn.Module)):
                yield idx, self._modules[str(idx)]

    @staticmethod
    def ckpt_layer_path(ckpt_dir, idx: int) -> str:
        return os.path.join(os.fspath(ckpt_dir), f"layer_{idx:02d}-model_states.pt")

    def save_layer_files(self, save_dir, exclude_frozen_params: bool = False) -> list[str]:
        """Writes this process's layers' files into save_dir (each to a temporary name, then renamed);
        returns their paths."""
        os.makedirs(save_dir, exist_ok=True)
        written = []
        for idx, module in self._layer_modules():
            sd = module.state_dict()
            if exclude_frozen_params:
                frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
                sd = {k: v for k, v in sd.items() if k not in frozen}
            # CPU copies: a layer file of a GPU run loads anywhere (torch.load needs no GPU), as the engine's.
            sd = {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
            path = self.ckpt_layer_path(save_dir, idx)
            torch_save_atomic(sd, path)
            written.append(path)
        return written

    def read_layer_files(self, load_dir, strict: bool = True) -> list[tuple[nn.Module, dict]]:
        """Reads and checks this process's layers' files (every key and shape, with strict), changing
        nothing; returns (module, state_dict) pairs for load_state_dict."""
        out = []
        for idx, module in self._layer_modules():
            path = self.ckpt_layer_path(load_dir, idx)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path}: no file for layer {idx} ({_layer_name(self._layer_specs[idx])})")
            sd = torch.load(path, map_location="cpu", weights_only=True)
            own = module.state_dict()
            missing = [k for k in own if k not in sd]
            unexpected = [k for k in sd if k not in own]
            bad = [f"{k}: saved {tuple(sd[k].shape)}, model {tuple(v.shape)}" for k, v in own.items()
                   if k in sd and isinstance(v, torch.Tensor) and tuple(sd[k].shape) != tuple(v.shape)]
            problems = ([f"lacks {missing}"] if strict and missing else []) + (
                [f"has keys the layer lacks {unexpected}"] if strict and unexpected else []) + (
                [f"has other shapes ({'; '.join(bad)})"] if bad else [])
            if problems:
                raise Zero8ValueError(f"{path}: layer {idx} ({_layer_name(self._layer_specs[idx])}) "
                                      f"{' and '.join(problems)}")
            out.append((module, sd))
        return out


class PipelineModule(LayerModule):
    """A layer list cut into ``num_stages`` consecutive stages; this process builds the layers of its own
    stage only. ``zero8.initialize(model=PipelineModule(...), config=...)`` returns the pipeline engine
    (``train_batch`` / ``eval_batch``). Ranks form DeepSpeed's PipeDataParallelTopology: stage =
    rank // (world_size / num_stages).

    partition_method: "parameters" (balance trainable parameter counts), "uniform" (balance layer counts)
    or "type:<regex>" (balance the layers whose class name matches the regex, case-insensitive); every
    stage gets at least one layer. loss_fn(outputs, labels) runs on the last stage (without one, the last
    stage's output is the loss). Other arguments: see LayerModule.

    device: where the built stage goes. None (default): this rank's GPU (zero8.engine.local_device(),
    cuda:LOCAL_RANK) where torch sees one and zero8 was built with CUDA, as DeepSpeed's PipelineModule moves
    itself to cuda:LOCAL_RANK, else the CPU; "cpu" keeps a stage on the CPU of a GPU machine. Where no world
    communicator was made yet, it is made here for that device, as ``zero8.init_distributed()`` makes it:
    NCCL where every rank has a GPU of its own, so a script need not make the world before the model.
    """

    def __init__(self, layers, num_stages: int | None = None, topology: ProcessTopology | None = None,
                 loss_fn: Callable | None = None, seed_layers: bool = False, seed_fn: Callable | None = None,
                 base_seed: int = 1234, partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable | None = None, checkpointable_layers=None,
                 dynamic_shape: bool = False, device=None):
        # For _select_layers, which LayerModule.__init__ calls before building (nn.Module's attribute
        # handling is not set up yet here, so straight into __dict__).
        self.__dict__["_stage_args"] = (num_stages, topology, partition_method, device)
        super().__init__(layers, loss_fn=loss_fn, seed_layers=seed_layers, seed_fn=seed_fn, base_seed=base_seed,
                         activation_checkpoint_interval=activation_checkpoint_interval,
                         activation_checkpoint_func=activation_checkpoint_func,
                         checkpointable_layers=checkpointable_layers)
        self.dynamic_shape = bool(dynamic_shape)  # accepted: zero8 agrees on the shapes at every batch
        # Built on the CPU first (seeded layers get the same weights as a LayerModule's), then moved whole.
        self.to(self._stage_device)

    def _select_layers(self) -> tuple[int, int]:
        """This stage's layers: the topology from the world communicator, then the partition."""
        from ..engine.world import world_comm  # the engine's world, made here as DeepSpeed's needs dist

        num_stages, topology, partition_method, device = self.__dict__.pop("_stage_args")
        stages = topology.get_dim("pipe") if num_stages is None and isinstance(topology, ProcessTopology) else num_stages
        if isinstance(stages, int) and self._num_layers < stages:
            raise Zero8ValueError(f"PipelineModule: {stages} stages but only {self._num_layers} layer(s); "
                                  f"every stage needs at least one layer")
        self._stage_device = _stage_device(device)
        # A world made here without the device would be the host's (MPI, TCP), and initialize would get it
        # back for a model on a GPU: NCCL only where it is made for the device.
        world = world_comm("auto", device=self._stage_device)
        self.global_rank, self.world_size = world.rank, world.size
        self._topo = self._topology(num_stages, topology)
        self.num_stages = self._topo.get_dim("pipe")
        coord = self._topo.get_coord(self.global_rank)
        self.stage_id = coord.pipe
        self.dp_rank = coord.data
        self.partition_method = partition_method
        self.parts = self._partition(partition_method)
        return self.parts[self.stage_id], self.parts[self.stage_id + 1]

    def _topology(self, num_stages, topology) -> ProcessTopology:
        if topology is None:
            if num_stages is None:
                raise Zero8ValueError("PipelineModule: give num_stages or topology")
            if not isinstance(num_stages, int) or num_stages < 1:
                raise Zero8ValueError(f"PipelineModule: num_stages must be an integer >= 1, got {num_stages!r}")
            if self.world_size % num_stages:
                raise Zero8ValueError(
                    f"PipelineModule: num_stages ({num_stages}) must divide the world size ({self.world_size}): "
                    f"each stage runs on world_size / num_stages data-parallel ranks")
            return PipeDataParallelTopology(num_pp=num_stages, num_dp=self.world_size // num_stages)
        if not isinstance(topology, ProcessTopology):
            raise TypeError(f"PipelineModule: topology must be a zero8.pipe ProcessTopology, got {type(topology).__name__}")
        axes = topology.get_axis_names()
        extra = [a for a in axes if a not in ("pipe", "data") and topology.get_dim(a) > 1]
        if extra:
            raise Zero8NotSupportedError(f"PipelineModule: topology axes {extra} (tensor/model parallelism) are not "
                                         f"supported; zero8 runs pipeline x data parallelism")
        if axes[:2] != ["pipe", "data"]:
            raise Zero8NotSupportedError(
                f"PipelineModule: topology axes {axes}: zero8 builds its groups in PipeDataParallelTopology's order "
                f"(axes ['pipe', 'data']: a stage's data-parallel ranks consecutive)")
        if num_stages is not None and num_stages != topology.get_dim("pipe"):
            raise Zero8ValueError(f"PipelineModule: num_stages {num_stages} but the topology has "
                                  f"{topology.get_dim('pipe')} pipeline stages")
        if topology.world_size() != self.world_size:
            raise Zero8ValueError(f"PipelineModule: the topology has {topology.world_size()} ranks, the world "
                                  f"{self.world_size}")
        return topology

    def _partition(self, method: str) -> list[int]:
        if not isinstance(method, str):
            raise Zero8ValueError(f"partition_method must be a string ({', '.join(PARTITION_METHODS)}), got {method!r}")
        low = method.lower()
        if low == "uniform":
            return partition_uniform(self._num_layers, self.num_stages)
        if low == "parameters":
            return partition_balanced([_count_trainable(l) for l in self._layer_specs], self.num_stages)
        if low.startswith("type:"):
            pattern = re.compile(method[len("type:"):], re.IGNORECASE)
            weights = [1 if pattern.search(_layer_name(l)) else 0 for l in self._layer_specs]
            if not any(weights):
                names = sorted({_layer_name(l) for l in self._layer_specs})
                raise Zero8ValueError(f"partition_method '{method}': no layer's class name matches (layers: {names})")
            return partition_balanced(weights, self.num_stages)
        raise Zero8ValueError(f"partition_method '{method}': not one of {', '.join(PARTITION_METHODS)}")

    # ---- DeepSpeed's accessors ----
    def partitions(self) -> list[int]:
        return list(self.parts)

    def stage_owner(self, layer_idx: int) -> int:
        if not 0 <= layer_idx < self._num_layers:
            raise Zero8ValueError(f"stage_owner: layer {layer_idx} of {self._num_layers}")
        return next(s for s in range(self.num_stages) if self.parts[s] <= layer_idx < self.parts[s + 1])

    def topology(self) -> ProcessTopology:
        return self._topo

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def tied_stages(self, key: str) -> list[int]:
        """The stages holding tied module ``key``, in order; the first owns it (steps it)."""
        return sorted({self.stage_owner(i) for i in self._tie_layers[key]})

    def tie_keys(self) -> list[str]:
        return sorted(self._tie_layers)

    def describe(self) -> str:
        """The stages and their layers, for the log."""
        lines = []
        for s in range(self.num_stages):
            names = [f"{i}: {_layer_name(self._layer_specs[i])}" for i in range(self.parts[s], self.parts[s + 1])]
            lines.append(f"stage {s}: layers {self.parts[s]}..{self.parts[s + 1] - 1} ({', '.join(names)})")
        return "\n".join(lines)
