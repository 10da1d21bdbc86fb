"""DeepSpeed's entry points: ``initialize`` (config, world communicator, engine), ``init_distributed`` and
``add_config_arguments``.
"""

from __future__ import annotations

import itertools
import warnings

import torch

from .. import _C
from .._C import Zero8NotSupportedError, Zero8ValueError
from ..config import load_config
from .config_view import dataloader_drop_last, requested_backend, requested_timeout
from .device import check_nccl_device, comm_backend, local_device, model_device
from .pipeline import PipelineEngine
from .training import Zero8Engine
from .world import world_comm

# Each engine's data-parallel communicator is its own split of the world (its own byte counters), named
# by this count.
_engine_numbers = itertools.count(1)


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
    this process's world communicator (MPI under mpirun or zero8-launch, TCP under torchrun or DeepSpeed's
    launcher, else one process; on a machine with a GPU, for ``dist_backend="nccl"`` or None (DeepSpeed's
    default: the accelerator's backend), the world of models on GPUs: NCCL where every local rank has a GPU
    of its own, see world_comm; "gloo" or "mpi" keep the host world). zero8 does not start a
    torch.distributed process group, so the other arguments are accepted and ignored; use
    ``engine.global_rank`` / ``engine.world_size`` (or this communicator's ``rank`` and ``size``) instead of
    ``torch.distributed.get_rank()``."""
    gpu = (dist_backend is None or str(dist_backend).lower() == "nccl") and torch.cuda.is_available()
    return world_comm("auto", device=local_device() if gpu else None)


def _mpu_sizes(mpu) -> dict:
    """DeepSpeed's ``mpu`` argument: Megatron passes its parallel_state even without tensor or pipeline
    parallelism, where every rank is a data-parallel rank, which is what zero8 trains; any other
    decomposition is refused, naming it. Returns the sizes it reports ({} without an mpu): tensor (or model)
    parallel, pipeline, and data parallel where it has that method, for the caller to check against the
    world once made."""
    if mpu is None:
        return {}
    sizes = {}
    for key, names in (("tensor", ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size")),
                       ("pipeline", ("get_pipeline_model_parallel_world_size",)),
                       ("data", ("get_data_parallel_world_size",))):
        fn = next((getattr(mpu, n) for n in names if callable(getattr(mpu, n, None))), None)
        if fn is not None:
            sizes[key] = int(fn())
    if "tensor" not in sizes:
        raise Zero8NotSupportedError(
            f"initialize: mpu ({type(mpu).__name__}) has no get_tensor_model_parallel_world_size() or "
            f"get_model_parallel_world_size(); zero8 takes an mpu only to check that it describes data "
            f"parallelism alone")
    if sizes["tensor"] != 1 or sizes.get("pipeline", 1) != 1:
        raise Zero8NotSupportedError(
            f"initialize: mpu reports tensor-parallel size {sizes['tensor']} and pipeline size "
            f"{sizes.get('pipeline', 1)}; zero8 trains data-parallel ranks only (tensor parallelism is not "
            f"supported; for pipeline parallelism pass a zero8.pipe.PipelineModule as model)")
    return sizes


def initialize(args=None, model: torch.nn.Module | None = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port: int | None = None, mpu=None,
               dist_init_required: bool | None = None, collate_fn=None, config=None, mesh_param=None,
               config_params=None):
    """deepspeed.initialize for zero8: returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    - ``config``: a DeepSpeed config (dict, path or JSON text; ``args.deepspeed_config`` and
      ``config_params`` as in DeepSpeed, and as there config= with args.deepspeed_config is an error).
      It is validated in C++ (``zero8.Zero8ValueError`` naming the key path; an unknown key inside a
      section zero8 reads is one, with the key meant); unknown top-level keys warn once (rank 0). A
      ``"zero8"`` section turns on 8-bit states and int8
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

    - ``model``: a torch module, or a ``zero8.pipe.PipelineModule``: then the engine is the pipeline
      engine (``train_batch`` / ``eval_batch``, docs/PIPELINE.md), each stage's optimizer sharded over
      the stage's data-parallel ranks, and the config's batch sizes count those ranks.

    Processes: under mpirun every rank runs this (MPI backend, chosen automatically; under torchrun or
    DeepSpeed's launcher the tcp backend, docs/LAUNCH.md; no
    torch.distributed process group is needed: ``distributed_port`` and ``dist_init_required`` are
    accepted and ignored). ``mpu`` (Megatron's parallel_state) is accepted where it reports tensor and
    pipeline size 1; tensor parallelism and ``mesh_param`` are not supported (pipeline parallelism comes
    from a PipelineModule). ZeRO stage 0 runs as stage 1 (same arithmetic, states
    partitioned).

    Devices: the engine trains where the model is. A model on a CUDA device (under a launcher: this rank's,
    ``zero8.engine.local_device()``, cuda:LOCAL_RANK) keeps every optimizer buffer on that GPU and runs on
    the current CUDA stream; ``"comm_backend": "auto"`` is then NCCL when the launcher started several
    processes (one per GPU), and "mpi" stages device buffers through host memory (ranks may share a GPU).
    The model is not moved: a CPU model trains on the CPU, where "nccl" is an error.
    """
    from ..pipe.module import PipelineModule

    if model is None:
        raise Zero8ValueError("initialize: model is required")
    if mesh_param is not None:
        raise Zero8NotSupportedError("initialize: mesh_param (sequence parallelism) is not supported; for "
                                     "pipeline parallelism pass a zero8.pipe.PipelineModule as model")
    mpu_sizes = _mpu_sizes(mpu)  # before any world is made
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
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    device = model_device(model)
    backend = comm_backend(requested_backend(config), device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's set-up and the optimizer's buffers use the current device
    world = world_comm(backend, device, timeout_s=requested_timeout(config))
    if mpu_sizes.get("data", world.size) != world.size:
        raise Zero8ValueError(
            f"initialize: mpu reports data-parallel size {mpu_sizes['data']}, but zero8's world has {world.size} "
            f"rank(s): with tensor and pipeline size 1 every rank is a data-parallel rank")
    if device.type == "cuda":
        check_nccl_device(world, device)
        torch.cuda.set_device(device)
    elif world.memory == "device":
        raise Zero8NotSupportedError(
            f"this process's world communicator is {world.backend}, which takes device buffers only, and the "
            f"model is on the CPU: put the model on its rank's GPU (zero8.engine.local_device()), or make the "
            f"world for the CPU (init_distributed() without dist_backend=\"nccl\")")
    if isinstance(model, PipelineModule):
        # The engine's own world (its own counters), cut into the pipe x data grid of the module's topology.
        world = world.split(0, world.rank, f"zero8-pipe-{next(_engine_numbers)}")
        topo = _C.topology_split(world, model.num_stages)
        dp = topo["dp_group"]
        cfg = load_config(config, dp.size, rank=world.rank)
        if cfg.typed is not None and not cfg.typed.managed_gradient_accumulation:
            raise Zero8NotSupportedError(
                f"{cfg.source}: managed_gradient_accumulation: false is not supported with a PipelineModule "
                f"(train_batch() runs the accumulation itself; DeepSpeed refuses it too)")
        engine = PipelineEngine(model, cfg, dp, world, topo["pp_group"], model_parameters=model_parameters,
                                client_optimizer=optimizer, client_lr_scheduler=lr_scheduler)
    else:
        dp = world.split(0, world.rank, f"zero8-engine-{next(_engine_numbers)}")  # own counters per engine
        cfg = load_config(config, dp.size, rank=world.rank)
        for key, what in (("int8_activations", "quantizes the activations between pipeline stages"),
                          ("queued_stage_messages", "queues the messages between pipeline stages")):
            if cfg.typed is not None and getattr(cfg.typed.zero8, key) and world.rank == 0:
                warnings.warn(f"zero8.{key} has no effect here: it {what}, and this model is not a "
                              f"zero8.pipe.PipelineModule", stacklevel=2)
        engine = Zero8Engine(model, cfg, dp, world, model_parameters=model_parameters, client_optimizer=optimizer,
                             client_lr_scheduler=lr_scheduler, device=device)
    engine.collate_fn = collate_fn
    engine._dataloader_drop_last = dataloader_drop_last(config)
    loader = None
    if training_data is not None:
        loader = engine.deepspeed_io(training_data)
        if isinstance(engine, PipelineEngine):
            engine.set_dataloader(loader)
    return engine, engine.optimizer, loader, engine.lr_scheduler
