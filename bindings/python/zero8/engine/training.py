"""The training engine: Zero8Engine wraps a torch model around zero8's ZeRO stage 1/2 sharded optimizer
(``_C.ShardedOptimizer``). The trainable parameters become zero-copy views into the optimizer's working
buffer. Post-accumulate-grad hooks hand each gradient over as it is complete: in stage 2 to the bucket
that carries it (no full-size gradient buffer; ``param.grad`` is dropped), which is reduced while backward
is still running; in stage 1 ``.grad`` (fp32) is a view into the optimizer's gradient buffer, so autograd
accumulates straight into its memory until the boundary. A model on a GPU gets a device optimizer: the
same views, of CUDA memory, and the optimizer's work on the current CUDA stream (device.py). Here:
building the engine, DeepSpeed's accessors, forward / backward / step, the data loader and the
statistics; checkpoints are in checkpoint.py.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Mapping

import torch

from .. import _C
from .._C import Zero8NotSupportedError, Zero8ValueError
from .._tensors import dtype_code
from ..config import Zero8Config
from ..lr_schedules import scheduler_from_config
from .checkpoint import EngineCheckpoints
from .client_optim import (
    _GROUP_KEYS,
    _check_group_overrides,
    _client_optimizer_spec,
    _group_from_hyper,
    _hyper_for_group,
    _hyper_from_group,
)
from .config_view import buffer_dtype, comm_timeout_s, working_dtype
from . import gather
from .device import StreamOrder, check_device, model_device
from .monitor import Monitor
from .optimizer import Zero8Optimizer
from .params import built_client_optimizer, collect_params, fp32_state, override_hyper_groups
from .precision import cast_module
from .world import engines, local_rank

# DeepSpeed's deepspeed_io routes (deepspeed.runtime.constants.ROUTE_*).
ROUTE_TRAIN, ROUTE_EVAL, ROUTE_PREDICT, ROUTE_ENCODE = "train", "eval", "predict", "encode"
_ROUTES = (ROUTE_TRAIN, ROUTE_EVAL, ROUTE_PREDICT, ROUTE_ENCODE)


class Zero8Engine(EngineCheckpoints, torch.nn.Module):
    """DeepSpeedEngine's training surface over zero8's sharded optimizer (see the module docstring).

    Not done here: pipeline/model parallelism (mpu), ZeRO stage 3, offload.
    """

    def __init__(self, model: torch.nn.Module, config: Zero8Config, dp: "_C.Communicator",
                 world: "_C.Communicator", model_parameters=None, client_optimizer=None, client_lr_scheduler=None,
                 device: torch.device | None = None):
        super().__init__()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self._init_state(model, config, dp, world, device)
        client_optimizer, model_parameters = built_client_optimizer(model, model_parameters, client_optimizer)
        self._select_params(model, model_parameters, client_optimizer)
        sc = self._sharded_config(client_optimizer)
        if self._dtype != torch.float32:
            # As DeepSpeed's engine: the parameters; the buffers only as data_types says (precision.py).
            cast_module(model, self._dtype, buffer_dtype(self._cfg), self._cfg.data_types.keep_in_fp32_modules)
        self._build_sharded_optimizer(sc, client_optimizer)
        self.optimizer = self._returned_optimizer(client_optimizer)
        self.client_optimizer = client_optimizer
        self.lr_scheduler = None
        self.lr_scheduler = self._lr_scheduler(client_lr_scheduler)
        self._apply_hyper()
        self.monitor = Monitor(self._cfg, self.global_rank)
        if self.global_rank == 0:
            self._log(self._summary())

    # ---- setup, in the order __init__ runs it ----
    def _init_state(self, model: torch.nn.Module, config: Zero8Config, dp: "_C.Communicator",
                    world: "_C.Communicator", device: torch.device | None) -> None:
        """The module, the config (``config``: DeepSpeed's dict; ``_cfg``: the typed view the engine reads),
        the communicators, the device (its CUDA stream) and DeepSpeed's counters."""
        self.module = model
        self._device = model_device(model) if device is None else check_device(device)
        self._stream_order = StreamOrder(self._device)
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)  # the optimizer's buffers go to the current device
            # The engine's own calls with host buffers (agreements, checkpoint strings) and tensors go
            # through the optimizer's stream too.
            dp.stream = self._stream_order.stream.cuda_stream
        self.zero8_config = config
        self.config = config.dict
        self._cfg = config.typed if config.typed is not None else _C.Config.from_normalized(config.json,
                                                                                            config.world_size)
        self._dp = dp
        self._world = world
        self.global_rank = world.rank
        self.world_size = world.size
        self.local_rank = local_rank()
        self.dp_world_size = dp.size
        self.mp_world_size = 1
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._last_info: dict | None = None
        self._grad_norm: float | None = None  # of the last applied step (a skipped one computes none)
        # zero_optimization.compute_grad_norm false: get_global_grad_norm() gives None, as DeepSpeed's.
        self._keep_grad_norm = bool(self._cfg.zero.compute_grad_norm)
        self._step_applied = False
        self._backward_done = False
        # Gradient accumulation (is_gradient_accumulation_boundary): the step() calls of the running accumulation
        # so far, the boundary coming at gradient_accumulation_steps of them; or the boundary as
        # set_gradient_accumulation_boundary set it (None: counted); or, with managed_gradient_accumulation
        # false, every step() (_stepping: one runs). Whether the last backward ended the accumulation (its
        # reduction ran as the last one's), and the backwards since the last optimizer step.
        self._accum_steps = 0
        self._manual_boundary: bool | None = None
        self._managed = bool(self._cfg.managed_gradient_accumulation)
        self._stepping = False
        self._boundary_ended = False
        self._backwards_pending = 0
        # coalesce_grad_reduction: its block runs (step() raises), or it ended the accumulation (the next
        # step() applies it).
        self._coalescing = False
        self._coalesced = False
        # set_train_batch_size / set_train_micro_batch_size: (train_batch_size, micro, gas) as now in force.
        self._batch = (int(self._cfg.batch.train_batch_size), int(self._cfg.batch.train_micro_batch_size_per_gpu),
                       int(self._cfg.batch.gradient_accumulation_steps))
        self._in_step = False  # engine.step() is calling optimizer.step()
        self._defer_gather = False  # engine.step() leaves the parameter all-gather to the next forward
        self._gathering = None  # the parameters' class while it runs (gather.py)
        self._bytes = {"gradients": 0, "step": 0}
        self._backward_bytes0 = 0  # bytes sent when the running micro-batch's backward began
        self._hooks: list = []
        self.collate_fn = None  # initialize's collate_fn, deepspeed_io's default
        self._dataloader_drop_last = False  # the config's dataloader_drop_last (initialize sets it)
        self._dtype = working_dtype(self._cfg)
        self._auto_cast = self._cfg.fp16.enabled and self._cfg.fp16.auto_cast
        # wall_clock_breakdown: seconds spent in forward / backward (of which gradient reduction) / step
        # since the last progress report, and the micro-batches and steps they cover; _timers_written: their
        # values when the monitor last wrote them, so that it writes each step's own.
        self._timers = self._new_timers()
        self._timers_written = self._new_timers()
        timeout = comm_timeout_s(self._cfg)
        if timeout is not None:
            dp.timeout = timeout

    def _select_params(self, model: torch.nn.Module, model_parameters, client_optimizer) -> None:
        """The parameters to optimize (the client's list or param groups, model_parameters, or all trainable
        ones, in order), their names and param groups; they must be float tensors on the engine's device."""
        groups = collect_params(model, model_parameters, client_optimizer, stacklevel=4)
        params = groups.params
        if not params:
            raise Zero8ValueError("model_parameters: no trainable parameters (requires_grad=True) to optimize")
        names = {id(p): n for n, p in model.named_parameters()}
        for i, p in enumerate(params):
            if p.device != self._device:
                raise Zero8NotSupportedError(
                    f"parameter {names.get(id(p), f'param{i}')} is on {p.device}, the model on {self._device}: "
                    f"zero8's engine trains the parameters where the model is")
        self._params = params
        self._param_names = [names.get(id(p), f"param{i}") for i, p in enumerate(params)]
        self._hyper_group = groups.hyper_group
        self._hyper_group_dicts = groups.group_dicts
        self._param_group_dicts = groups.given_dicts
        upcast = []
        for name, p in zip(self._param_names, params):
            if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise Zero8NotSupportedError(
                    f"parameter {name} is {p.dtype}: zero8's engine trains float32, bfloat16 or float16 parameters "
                    f"(cast the model first, e.g. model.float())")
            if p.dtype != self._dtype:
                upcast.append(name)
        if upcast and self._dtype == torch.float32 and self.global_rank == 0:
            warnings.warn(
                f"{len(upcast)} parameter(s) in 16 bits (first: {upcast[0]}) are trained in float32: the config "
                f"enables neither \"fp16\" nor \"bf16\", so the engine holds its working copy in float32",
                stacklevel=4)

    def _sharded_config(self, client_optimizer) -> "_C.ShardConfig":
        """The sharded optimizer's config: the DeepSpeed config's, with the algorithm and hyperparameters of
        its optimizer section or of the client optimizer's type and param groups, one Hyper per param group."""
        cfg = self._cfg
        sc = _C.shard_config_from_json(self.zero8_config.json, self._dp.size)
        if self._device.type == "cuda":
            sc.memory = "device"  # every buffer on the current device (initialize made it the model's)
            sc.stream = self._stream_order.stream.cuda_stream
        if client_optimizer is not None and cfg.optimizer.present:
            raise Zero8ValueError(
                "optimizer: both a client optimizer and an \"optimizer\" config section were given; pass one"
            )
        if client_optimizer is not None:
            spec = _client_optimizer_spec(client_optimizer, cfg.zero8.enabled, cfg.zero8.optim_bits)
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
        elif cfg.optimizer.present:
            self._optimizer_name = cfg.optimizer_name
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
        return sc

    def _build_sharded_optimizer(self, sc: "_C.ShardConfig", client_optimizer) -> None:
        """The sharded optimizer over the parameters (each in its hyper group, 8-bit or 32-bit states); the
        parameters become views of its buffers, rank 0's weights everywhere, gradient hooks registered."""
        params = self._params
        hyper_of, self._override_groups = override_hyper_groups(params, self._hyper_group, sc, client_optimizer,
                                                                self._algo)
        specs = [_C.ParamSpec(self._param_names[i], list(p.shape),
                              fp32_state(p, self._param_names[i], sc, client_optimizer), hyper_of[i])
                 for i, p in enumerate(params)]
        self._opt = _C.ShardedOptimizer(specs, sc, self._dp)
        self._shard_config = sc
        # Parameters become views into the working buffer (and fp32 grads views into the grad buffer).
        self._bind_params()
        with self._stream_order():
            self._opt.init(0)  # rank 0's weights everywhere; masters from them
            self._broadcast_rest()
        self._register_hooks()
        self._prepare_deferred_gather()
        self._destroyed = False
        engines.add(self)

    def _returned_optimizer(self, client_optimizer) -> Zero8Optimizer:
        """The optimizer initialize hands back: one param group per hyper group of model_parameters' dicts
        (their other keys kept, e.g. a "name"), else all the parameters in one; the client's own groups
        with a client optimizer."""
        params = self._params
        defaults = _group_from_hyper(self._algo, self._opt.hyper)
        groups: list = list(params)
        if client_optimizer is None and self._param_group_dicts:
            groups = []
            for h, d in enumerate(self._hyper_group_dicts):
                extra = {k: v for k, v in d.items() if k != "params" and k not in defaults}
                groups.append({**extra, **_group_from_hyper(self._algo, self._opt.group_hyper(h)),
                               "params": [p for p, hg in zip(params, self._hyper_group) if hg == h]})
        return Zero8Optimizer(self, groups, defaults, client=client_optimizer)

    def _lr_scheduler(self, client_lr_scheduler):
        """initialize's lr_scheduler: a class (which has a step attribute too) or a function is a factory
        called with the optimizer, as DeepSpeed calls any callable; a scheduler instance is kept; None: the
        config's scheduler section (over the client optimizer's lr when the config has no optimizer)."""
        if client_lr_scheduler is not None:
            if isinstance(client_lr_scheduler, type) or (
                    callable(client_lr_scheduler) and not hasattr(client_lr_scheduler, "step")):
                client_lr_scheduler = client_lr_scheduler(self.optimizer)
            return client_lr_scheduler
        base_lr = None if self._cfg.optimizer.present else float(self.optimizer.param_groups[0]["lr"])
        return scheduler_from_config(self.optimizer, self._cfg, base_lr=base_lr, warn=self.global_rank == 0)

    def _summary(self) -> str:
        sc = self._shard_config
        return (f"zero8 engine: {self._optimizer_name} ({self._algo}, {sc.bits}-bit states), ZeRO stage {sc.stage}, "
                f"{self.dp_world_size} rank(s) on "
                f"{self._dp.backend}, {self._dtype}, {sum(p.numel() for p in self._params)} parameters, "
                f"{self._wire_summary()}")

    def _wire_summary(self) -> str:
        """What the data-parallel collectives carry, as the sharded optimizer planned it (``_opt.wire``): one
        rank sends nothing, so it quantizes nothing."""
        w = self._opt.wire
        if self.dp_world_size == 1:
            return "one data-parallel rank: nothing on the wire, gradients and parameters exact"
        grads = "fp32" if w["gradients"] == "f32" else w["gradients"]
        stochastic = self._shard_config.stochastic_wire
        return (f"gradients on the wire: {grads}{' (stochastic rounding)' if stochastic and grads == 'int8' else ''}, "
                f"parameters: {'int8 updates' if w['int8_params'] else str(self._dtype).replace('torch.', '')}"
                f"{' (stochastic rounding)' if stochastic and w['int8_params'] else ''}")

    def _bind_params(self) -> None:
        opt = self._opt
        # Stage 1 keeps the full gradient buffer until the boundary, so fp32 autograd accumulates into views
        # of it; stage 2 has none (the hooks hand each gradient to its bucket): no views.
        in_place = self._shard_config.stage == 1
        wbuf, gbuf = {}, {}
        for g in range(_C.NUM_GROUPS):
            if opt.group_padded(g) > 0 and self._device.type == "cuda":
                wbuf[g] = torch.from_dlpack(opt.device_buffer("working", g)).view(self._dtype)
                if in_place:  # in stage 2 asking for the buffer would make a full one
                    gbuf[g] = torch.from_dlpack(opt.device_buffer("grad", g)).view(torch.float32)
            elif opt.group_padded(g) > 0:
                wbuf[g] = torch.frombuffer(opt.working_buffer(g), dtype=self._dtype)
                if in_place:
                    gbuf[g] = torch.frombuffer(opt.grad_buffer(g), dtype=torch.float32)
        self._grad_views = []
        with torch.no_grad():
            for i, p in enumerate(self._params):
                g, off, n = opt.param_slot(i)
                wv = wbuf[g][off:off + n].view(p.shape)
                wv.copy_(p.data)
                p.data = wv
                gv = gbuf[g][off:off + n].view(p.shape) if in_place else None
                self._grad_views.append(gv)
                p.grad = gv if gv is not None and self._dtype == torch.float32 else None
        self._working_buffers, self._grad_buffers = wbuf, gbuf

    def _broadcast_rest(self) -> None:
        """Frozen parameters and buffers: rank 0's values everywhere (DeepSpeed broadcasts the module). Those
        on the engine's device and on the CPU (through the device when the communicator takes device memory
        only, NCCL)."""
        if self._dp.size == 1:
            return
        managed = {id(p) for p in self._params}
        tensors = [p for p in self.module.parameters() if id(p) not in managed] + list(self.module.buffers())
        staged = self._dp.memory == "device"
        for t in tensors:
            if t.numel() == 0 or t.device not in (torch.device("cpu"), self._device):
                continue
            data = t.data  # a new tensor object at every access: compared by identity below, so taken once
            src = data if data.is_contiguous() else data.contiguous()
            if staged and src.device.type == "cpu":
                src = src.to(self._device)
            self._dp.broadcast_ptr(src.data_ptr(), src.numel() * src.element_size(), 0)
            if src is not data:
                data.copy_(src)

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
        self._loss_scaled = False  # engine.scale(loss) since the last micro-batch ended (fp16's direct backward)
        fp32 = self._dtype == torch.float32
        for i, p in enumerate(self._params):
            gv = self._grad_views[i]

            def hook(param, i=i, gv=gv):
                # A backward outside engine.backward (the torch loop) only hands its gradient over.
                counted = self._in_backward and not self._counting
                late = False
                if self._in_backward:
                    self._arrivals[i] += 1
                    late = counted and self._arrivals[i] > max(1, self._expected[i])
                    if late:
                        self._gradient_arrived(i)  # raises if its bucket was reduced: this part would be lost
                grad = param.grad
                if grad is not None and (gv is None or grad.data_ptr() != gv.data_ptr()):
                    # Stage 2, a 16-bit gradient, or one torch made after the user cleared .grad: the
                    # optimizer adds it in fp32 to the bucket that carries it (stage 2) or to its buffer.
                    grad = grad.contiguous()
                    dtype = dtype_code(grad, f"the gradient of {self._param_names[i]}")
                    # The add runs on the optimizer's stream: after the current one (autograd's) has written
                    # the gradient, and before that stream may reuse the gradient's memory.
                    with self._stream_order():
                        self._opt.grad_add(i, grad.data_ptr(), dtype)
                    param.grad = gv if fp32 else None
                if counted and not late:
                    self._gradient_arrived(i)

            self._hooks.append(p.register_post_accumulate_grad_hook(hook))
            # Before anything accumulates: a backward outside engine.backward gets engine.backward's division
            # by the accumulation steps, or is refused while nothing has changed yet.
            self._hooks.append(p.register_hook(lambda grad, i=i: self._check_direct_backward(i, grad)))

    def _check_direct_backward(self, i: int, grad: torch.Tensor):
        """A gradient of parameter i arriving outside engine.backward: ``loss.backward()`` on the engine's
        output, as DeepSpeed 0.19 allows. As there, it is divided by gradient_accumulation_steps here (what
        engine.backward does to the loss), and under fp16 the loss must come from engine.scale(loss); else
        this raises before the gradient accumulates anywhere (the first parameter's hook aborts that backward,
        so nothing changed)."""
        if self._in_backward:
            return None
        if self.fp16_enabled() and not self._loss_scaled:
            raise RuntimeError(
                f"rank {self.global_rank}: a gradient of '{self._param_names[i]}' arrived from loss.backward() "
                f"outside engine.backward(), and fp16 needs the loss times the engine's loss scale: call "
                f"engine.backward(loss), or engine.scale(loss).backward() as in DeepSpeed (nothing was "
                f"accumulated from this backward)")
        gas = self.gradient_accumulation_steps()
        return grad / gas if gas > 1 else None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's: the loss times the fp16 loss scale (the loss itself otherwise), for a backward the
        caller runs itself, ``engine.scale(loss).backward()``; engine.step() then ends the micro-batch as after
        engine.backward(loss). Gradients are divided by gradient_accumulation_steps as they arrive."""
        self._check_live()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.grad_fn is None:
            raise TypeError("engine.scale(loss): loss must be a scalar tensor with a grad_fn (for a tensor that "
                            "is not a scalar use engine.backward's way: a loss)")
        self._loss_scaled = True
        return loss.float() * float(self._opt.loss_scale) if self.fp16_enabled() else loss

    def _params_outside_graph(self, roots: list) -> bool:
        """Whether some trainable parameter is not a leaf of the autograd graph of ``roots`` (walked once)."""
        wanted = {id(p) for p in self._params}
        seen, stack = set(), [t.grad_fn for t in roots]
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
            with self._stream_order():  # the gradient is written on the current stream (autograd's)
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

    def _prepare_deferred_gather(self) -> None:
        """zero8.overlap_param_gather (with the overlap thread on the CPU, the default): engine.step() returns with the
        all-gather of the updated partitions still running on the optimizer's thread (the C++ "Deferred
        all-gather"), and each parameter waits for its own piece at its first touch, in a module's forward or
        anywhere else (gather.py), so the gather overlaps the forward and nothing reads a half-updated
        weight. The end of engine's forward and every engine call that reads the weights wait for all of it.
        Off when a trainable parameter is not exactly a torch.nn.Parameter (its class cannot be swapped)."""
        self._defer_gather = bool(self._cfg.zero8.overlap_param_gather) and bool(self._opt.defers_gather)
        if not self._defer_gather:
            return
        odd = gather.unguardable(self._params)
        if odd:
            self._defer_gather = False
            if self.global_rank == 0:
                name = self._param_names[odd[0]]
                self._log(f"zero8.overlap_param_gather: off, parameter {name!r} is a "
                          f"{type(self._params[odd[0]]).__name__}, not a torch.nn.Parameter; the step's "
                          f"all-gather completes inside engine.step()")
            return
        self._gathering = gather.gathering_class(self, self._params)

    def _wait_param(self, i: int) -> None:
        """Parameter i holds the last step's update (GatheringParameter's first touch). On a GPU the current
        stream waits for its piece: the optimizer's stream waits for the piece's event, and the current
        stream for the optimizer's."""
        opt = self.__dict__.get("_opt")
        if opt is not None and opt.gather_pending:
            with self._stream_order():
                opt.wait_param(i)

    def _wait_gather(self) -> None:
        """The deferred parameter all-gather of the last step is done (at once when none is pending), for the
        host and, on a GPU, for the current stream."""
        opt = self.__dict__.get("_opt")
        if opt is not None and self._defer_gather:
            with self._stream_order():
                opt.wait_gather()
            gather.disarm(self._params)

    def destroy(self) -> None:
        """Release the engine (DeepSpeed's engine.destroy()): hooks removed, the parameters keep their
        current values in their own memory (no longer views of the C++ buffers), and the sharded optimizer
        and communicator are dropped. The engine cannot train afterwards; runs at exit for live engines."""
        if self.__dict__.get("_destroyed", True):
            return
        self._wait_gather()
        self._destroyed = True
        monitor = self.__dict__.get("monitor")
        if monitor is not None:
            monitor.close()
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
        gradients are in its accumulation buffers (in stage 1 with fp32, param.grad is a view of one), which
        backward and step reduce and clear. Clearing them here would drop the micro-batches accumulated so
        far (stage 1), where DeepSpeed's zero_grad cannot reach its accumulated gradients, so they are left
        alone."""
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
        return self._batch[0]

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._batch[1]

    def gradient_accumulation_steps(self) -> int:
        return self._batch[2]

    def get_batch_info(self) -> tuple[int, int, int]:
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps), as DeepSpeed's."""
        return self._batch

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """DeepSpeed's: a new global batch size, reached by changing gradient_accumulation_steps (the
        micro-batch size stays); it must be a multiple of micro-batch size x data-parallel ranks."""
        micro = self.train_micro_batch_size_per_gpu()
        if isinstance(train_batch_size, bool) or not isinstance(train_batch_size, int) or train_batch_size < 1 \
                or train_batch_size % (micro * self.dp_world_size):
            raise Zero8ValueError(
                f"set_train_batch_size({train_batch_size!r}): the batch size must be a positive multiple of "
                f"train_micro_batch_size_per_gpu x data-parallel ranks = {micro} x {self.dp_world_size}")
        self._set_batch(train_batch_size, micro, train_batch_size // (micro * self.dp_world_size),
                        "set_train_batch_size")

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """DeepSpeed's: a new micro-batch size per rank, gradient_accumulation_steps unchanged (so the global
        batch size changes with it). Data loaders made already (deepspeed_io) keep their batch size."""
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise Zero8ValueError(f"set_train_micro_batch_size({micro_batch_size!r}): the micro-batch size must be "
                                  f"a positive integer")
        gas = self.gradient_accumulation_steps()
        self._set_batch(micro_batch_size * gas * self.dp_world_size, micro_batch_size, gas,
                        "set_train_micro_batch_size")

    def _set_batch(self, batch: int, micro: int, gas: int, caller: str) -> None:
        # Between accumulations only: a micro-batch's loss is divided by the accumulation steps in force at
        # its backward, so a change halfway would mix two averages.
        done = max(self._backwards_pending, self._accum_steps)
        if done:
            raise RuntimeError(f"{caller}() in the middle of a gradient accumulation ({done} micro-batch(es) of step "
                               f"{self.global_steps + 1} done): call it after the step() that ends one")
        self._batch = (batch, micro, gas)
        # DeepSpeed's engine.config, which checkpoints store as ds_config.
        self.config.update(train_batch_size=batch, train_micro_batch_size_per_gpu=micro,
                           gradient_accumulation_steps=gas)

    def steps_per_print(self) -> int:
        return int(self._cfg.steps_per_print)

    def zero_optimization_stage(self) -> int:
        return int(self._cfg.zero.stage)

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def gradient_clipping(self) -> float:
        return float(self._cfg.gradient_clipping)

    def fp16_enabled(self) -> bool:
        return bool(self._cfg.fp16.enabled)

    def bfloat16_enabled(self) -> bool:
        return bool(self._cfg.bf16.enabled)

    def get_data_types(self):
        return self._dtype, torch.float32

    @property
    def device(self) -> torch.device:
        """Where the engine trains: the CPU, or the model's CUDA device (DeepSpeed's engine.device)."""
        return self._device

    @property
    def loss_scale(self) -> float:
        return float(self._opt.loss_scale)

    cur_scale = loss_scale

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the running micro-batch ends its gradient accumulation (its backward's reduction is the
        last one, its step() steps the optimizer): its gradient_accumulation_steps-th step() call, or as
        set_gradient_accumulation_boundary set it."""
        if not self._managed:
            return self._stepping
        if self._coalesced:
            return True
        if self._manual_boundary is not None:
            return self._manual_boundary
        return self._accum_steps + 1 >= self.gradient_accumulation_steps()

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """DeepSpeed's manual gradient accumulation: from now on the boundary is ``is_boundary`` instead of
        the count of step() calls (None counts again). Set False before the accumulation's first micro-batch
        and True before its last: its backwards may then follow each other without step() in between, and
        the step() after the last one (True) steps the optimizer. As in DeepSpeed, each backward still
        divides its loss by gradient_accumulation_steps."""
        if not self._managed:
            raise RuntimeError("set_gradient_accumulation_boundary(): with managed_gradient_accumulation false in the "
                               "config every step() is the boundary (DeepSpeed refuses it there too)")
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise TypeError(f"set_gradient_accumulation_boundary(is_boundary): a bool (or None to count "
                            f"micro-batches again), got {type(is_boundary).__name__}")
        self._manual_boundary = is_boundary

    @contextlib.contextmanager
    def coalesce_grad_reduction(self):
        """DeepSpeed's: one with-block is one accumulation. Its backwards only accumulate (step() inside it
        raises), its exit ends the accumulation (stage 1 reduces the gradients then, in one pass; stage 2 has
        reduced each backward's, as it holds no full gradient buffer), and the next step() applies it. Each
        backward still divides its loss by gradient_accumulation_steps, as in DeepSpeed."""
        if not self._managed:
            raise RuntimeError("coalesce_grad_reduction(): with managed_gradient_accumulation false in the config "
                               "every step() ends the accumulation already (DeepSpeed refuses it there too)")
        if self._coalescing:
            raise RuntimeError("coalesce_grad_reduction(): already inside one (they do not nest)")
        saved = self._manual_boundary
        self._manual_boundary = False
        self._coalescing = True
        try:
            yield
        finally:
            self._coalescing = False
            self._manual_boundary = saved
        if self._backward_done and not self._boundary_ended:
            self._end_accumulation()
        self._coalesced = True

    def was_step_applied(self) -> bool:
        """DeepSpeed's: whether the last step() changed the weights (False between accumulation boundaries
        and for a step skipped on an inf or NaN gradient)."""
        return self._step_applied

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_mom(self) -> list:
        out = []
        for g in self.optimizer.param_groups:
            out.append(tuple(g["betas"]) if "betas" in g else g.get("momentum"))
        return out

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm (before clipping) of the last applied step, None before the first (and
        always with zero_optimization.compute_grad_norm false, as in DeepSpeed). As in DeepSpeed, a step skipped
        on an fp16 overflow leaves the previous step's value."""
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
        self._wait_gather()  # the parameters this forward did not touch
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
        """DeepSpeed's context for backwards that skip the gradient all-reduce; not supported: the gradient
        accumulation (counted, or set_gradient_accumulation_boundary's) already gives what no_sync is for."""
        raise Zero8NotSupportedError(
            "engine.no_sync(): not supported; set gradient_accumulation_steps in the config and call "
            "engine.backward(loss) and engine.step() per micro-batch, or mark the accumulation with "
            "engine.set_gradient_accumulation_boundary(False) before its backwards and (True) before its last, "
            "then one engine.step(): at ZeRO stage 1 the gradients are reduced once per step, at the boundary, "
            "which is what no_sync gives; at stage 2 each backward reduces its buckets as they fill (DeepSpeed "
            "refuses no_sync at stage 2 too)")

    def train_batch(self, *args, **kwargs):
        """DeepSpeed's PipelineEngine.train_batch: the engine of a zero8.pipe.PipelineModule has it."""
        raise Zero8NotSupportedError(
            "engine.train_batch(): DeepSpeed's PipelineEngine method, which zero8.initialize returns for a "
            "zero8.pipe.PipelineModule; this engine trains a plain module: train each micro-batch with "
            "loss = engine(batch); engine.backward(loss); engine.step() (the optimizer steps at every "
            "gradient_accumulation_steps-th micro-batch)")

    def eval_batch(self, *args, **kwargs):
        """DeepSpeed's PipelineEngine.eval_batch: the engine of a zero8.pipe.PipelineModule has it."""
        raise Zero8NotSupportedError(
            "engine.eval_batch(): DeepSpeed's PipelineEngine method, which zero8.initialize returns for a "
            "zero8.pipe.PipelineModule; this engine evaluates a plain module with engine.eval() and, under "
            "torch.no_grad(), engine(batch)")

    def _bytes_sent(self) -> int:
        return sum(int(s["bytes"]) for s in self._dp.stats().values())

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backpropagate ``loss`` (divided by gradient_accumulation_steps, times the fp16 loss scale);
        gradients are reduced as they become ready (stage 2) and at the end of this call. Returns the
        loss divided by gradient_accumulation_steps, as DeepSpeed does."""
        self._check_live()
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"backward(loss): loss must be a tensor, got {type(loss).__name__}")
        if self._backward_done and self._manual_boundary is None and self._managed:
            raise RuntimeError(
                "engine.backward() called twice without engine.step() in between (one backward per micro-batch; "
                "or, as in DeepSpeed, engine.set_gradient_accumulation_boundary(False) before an accumulation's "
                "backwards and (True) before its last one, then one step())")
        if self._boundary_ended:
            raise RuntimeError(
                "engine.backward() after the backward that ended the gradient accumulation, without engine.step() "
                "in between: step() first (it applies that accumulation)")
        loss, scaled = self._scaled_loss(loss, scale_wrt_gas)
        self._autograd_backward([scaled], None, retain_graph)
        self._reduce_backward()
        return loss

    def _scaled_loss(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss / gradient_accumulation_steps, what backward differentiates: that times the fp16 loss scale)."""
        gas = self.gradient_accumulation_steps()
        if scale_wrt_gas and gas > 1:
            loss = loss / gas
        return loss, loss.float() * float(self._opt.loss_scale) if self.fp16_enabled() else loss

    def _autograd_backward(self, tensors: list, grads, retain_graph: bool = False) -> None:
        """The autograd part of a micro-batch's backward: from ``tensors`` (with ``grads``, None for a
        scalar loss), the gradients arriving through the hooks (stage 2 reduces full buckets meanwhile).
        _reduce_backward ends the micro-batch."""
        if self._backwards == 0:
            self._counting = self._params_outside_graph(tensors)
        self._backwards += 1
        self._backward_bytes0 = self._bytes_sent()
        t0 = time.perf_counter()
        self._in_backward = True
        try:
            torch.autograd.backward(tensors, grads, retain_graph=retain_graph)
        finally:
            self._in_backward = False
        self._timers["backward"] += time.perf_counter() - t0

    def _reduce_backward(self) -> None:
        """The end of a micro-batch's backward (collective): the gradients not reduced yet are (stage 2;
        stage 1 at the accumulation boundary), and a trainable parameter without a gradient is an error
        unless ignore_unused_parameters."""
        unused = [] if self._cfg.zero.ignore_unused_parameters else [
            self._param_names[i] for i, n in enumerate(self._arrivals) if not n]
        t1 = time.perf_counter()
        self._backward_end()  # collective: every rank gets here before any raises below
        self._backwards_pending += 1
        t2 = time.perf_counter()
        self._timers["backward"] += t2 - t1
        self._timers["reduce"] += t2 - t1
        self._timers["micro"] += 1
        self._bytes["gradients"] += self._bytes_sent() - self._backward_bytes0
        if unused:
            shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
            raise RuntimeError(
                f"rank {self.global_rank}: {len(unused)} trainable parameter(s) got no gradient in this backward: "
                f"{shown}; with zero_optimization.ignore_unused_parameters false this is an error (set it true to "
                f"treat their gradients as zero, or freeze them with requires_grad_(False))"
            )

    def _backward_end(self) -> None:
        boundary = self.is_gradient_accumulation_boundary()
        with self._stream_order():
            self._opt.backward_end(boundary)
        self._boundary_ended = boundary
        self._loss_scaled = False
        self._expected = [max(e, n) for e, n in zip(self._expected, self._arrivals)]
        self._arrivals = [0] * len(self._params)
        self._counting = False
        self._backward_done = True

    def _end_accumulation(self) -> None:
        """Ends the accumulation after its last backward (collective): stage 1 reduces the accumulated
        gradients now, stage 2 has reduced them in the backwards."""
        b0 = self._bytes_sent()
        with self._stream_order():
            self._opt.end_accumulation()
        self._bytes["gradients"] += self._bytes_sent() - b0
        self._boundary_ended = True

    def _new_accumulation(self) -> None:
        """The next micro-batch starts an accumulation (after its optimizer step, or a load)."""
        self._accum_steps = 0
        self._boundary_ended = False
        self._backwards_pending = 0

    def _restart_accumulation(self) -> None:
        """After a checkpoint load: the next micro-batch starts a step (the gradients of a step unfinished
        at the save were not saved, and those accumulated here belong to the replaced weights), whatever
        micro-batch it was at the save; micro_steps (the step() calls) goes back to a multiple of
        gradient_accumulation_steps, that step's start where one step() ends each micro-batch."""
        self.micro_steps -= self.micro_steps % self.gradient_accumulation_steps()
        self._new_accumulation()
        self._coalesced = False
        self._last_info = None
        self._grad_norm = None
        self._backward_done = False

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
        with self._stream_order():
            info = dict(self._opt.step(self._defer_gather and self._in_step))
        if self._opt.gather_pending:
            gather.arm(self._params, self._gathering)
        self._bytes["step"] += self._bytes_sent() - b0
        self._last_info = info
        return info

    def step(self, lr_kwargs: dict | None = None) -> None:
        """End of a micro-batch (or of a manual or unmanaged accumulation's last one): at the
        gradient-accumulation boundary the sharded optimizer steps (skipped on an fp16 overflow anywhere),
        then the LR scheduler; counters advance as DeepSpeed's."""
        self._check_live()
        if self._coalescing:
            raise RuntimeError("engine.step() inside coalesce_grad_reduction(): its block is one accumulation; "
                               "call step() after it")
        self._stepping = True
        try:
            boundary = self.is_gradient_accumulation_boundary()
            if not self._backward_done:
                self._backward_end()  # no backward this micro-batch: still the same collectives on every rank
            elif boundary and not self._boundary_ended:
                # The boundary came after the last backward (set late, or each step() without managed
                # accumulation).
                self._end_accumulation()
        finally:
            self._stepping = False
            self._coalesced = False
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
                if self.global_rank == 0 and self.fp16_enabled():
                    self._log(self._overflow_message(scaler_before))
                elif self.global_rank == 0:
                    self._log(f"Skipping step {self.global_steps + 1}: a gradient on some rank is inf or NaN "
                              f"(bf16/fp32: no loss scale to lower; the weights and states are unchanged)")
            else:
                self._step_applied = True
                self._grad_norm = float(info["grad_norm"]) if self._keep_grad_norm else None
                if self.lr_scheduler is not None:
                    opt = getattr(self.lr_scheduler, "optimizer", None)
                    if opt is not None:
                        opt._opt_called = True  # torch schedulers warn when their optimizer never stepped
                    self.lr_scheduler.step(**(lr_kwargs or {}))
            self.global_steps += 1
            if self._managed:
                self.global_samples += self.train_batch_size()
            else:  # as DeepSpeed counts: the micro-batches this step applied
                self.global_samples += self._backwards_pending * self.train_micro_batch_size_per_gpu() * \
                    self.dp_world_size
            self._new_accumulation()
            if self.monitor.writes:
                self.monitor.write_events(self._step_events())
            if self.global_rank == 0 and self.global_steps % self.steps_per_print() == 0:
                self._report_progress()
        else:
            self._accum_steps += 1
        self.micro_steps += 1

    # DeepSpeed's pipeline engine steps without its plain engine's step(), which writes the elapsed times.
    _monitor_times = True

    def _step_events(self) -> list:
        """DeepSpeed's monitor events of an optimizer step (applied or skipped), at x = global_samples after
        it: the first param group's lr (after the scheduler's step), fp16's loss scale, and with
        wall_clock_breakdown the step's times in ms, summed over its micro-batches: forward, backward (of
        which backward_inner, autograd, and backward_allreduce, the reduction at the end of each backward)
        and the optimizer step."""
        x = self.global_samples
        events = [("Train/Samples/lr", self.get_lr()[0], x)]
        if self.fp16_enabled():
            events.append(("Train/Samples/loss_scale", self.loss_scale, x))
        if self._cfg.wall_clock_breakdown and self._monitor_times:
            now, before = self._timers, self._timers_written
            ms = {k: 1e3 * (now[k] - before[k]) for k in ("forward", "backward", "reduce", "step")}
            events += [("Train/Samples/elapsed_time_ms_forward", ms["forward"], x),
                       ("Train/Samples/elapsed_time_ms_backward", ms["backward"], x),
                       ("Train/Samples/elapsed_time_ms_backward_inner", ms["backward"] - ms["reduce"], x),
                       ("Train/Samples/elapsed_time_ms_backward_allreduce", ms["reduce"], x),
                       ("Train/Samples/elapsed_time_ms_step", ms["step"], x)]
            self._timers_written = dict(now)
        return events

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
        if self._cfg.wall_clock_breakdown and t["micro"] and t["steps"]:
            per_micro = lambda k: 1e3 * t[k] / t["micro"]  # noqa: E731
            self._log(
                f"time (ms) per micro-batch | forward: {per_micro('forward'):.2f} | backward: "
                f"{per_micro('backward'):.2f} (gradient reduction {per_micro('reduce'):.2f}) | per step | "
                f"optimizer step: {1e3 * t['step'] / t['steps']:.2f} (rank 0, mean over the last {t['steps']} steps)"
            )
        self._timers = self._new_timers()
        self._timers_written = self._new_timers()

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
        in this process); pin_memory as the DataLoader's (it applies where a GPU is available, and speeds up
        copies of the batches to it). zero8's keyword-only extras: drop_last (None: the config's
        dataloader_drop_last) and shuffle (None: the route's)."""
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
        (initial broadcast, checkpoints). ``int8_gradients``, ``int8_params``: whether gradients and parameter
        updates cross the wire as int8 blocks (never at one data-parallel rank, which sends nothing and so
        keeps them exact). ``overlap``: the gradient reductions' and the parameter all-gather's seconds, the
        seconds the training loop waited for them (``reduce_wait_seconds``, ``gather_wait_seconds``), and the
        share of the reductions' time hidden behind backward (``reduce_hidden``: 1 - wait / seconds);
        ``threaded`` says whether they ran on the optimizer's thread (zero_optimization.overlap_comm, several
        ranks; on the CPU and on a GPU)."""
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
            "int8_gradients": self._opt.wire["gradients"] == "int8", "int8_params": bool(self._opt.wire["int8_params"]),
            "overlap": self._overlap_stats(),
        }

    def _overlap_stats(self) -> dict:
        o = dict(self._opt.overlap_stats())
        spent, waited = o["reduce_seconds"], o["reduce_wait_seconds"]
        o["reduce_hidden"] = max(0.0, 1.0 - waited / spent) if spent > 0 else 0.0
        return o

    def memory_stats(self) -> dict:
        """Bytes held by this rank: working copy, gradient buffers (stage 2: the buckets held now; stage 1:
        the full buffer), fp32 master and optimizer state of its partition, scratch buffers (with the
        reduced gradient of the partition): the optimizer's own memory, on the GPU for a model there;
        ``total`` of those, ``grads_peak`` (the most the gradient buffers held) and
        ``state_bytes_per_param`` (state of the whole model divided over its parameters, this rank's share).
        On a GPU also ``device`` and what torch's allocator holds there beside them (activations, 16-bit
        gradients, frozen weights): ``torch_allocated`` now and ``torch_max_allocated``, its peak
        (torch.cuda.max_memory_allocated)."""
        m = {k: int(v) for k, v in self._opt.memory().items()}
        m["total"] = sum(m[k] for k in ("working", "grads", "master", "state", "buffers"))
        n = sum(p.numel() for p in self._params)
        m["params"] = n
        m["state_bytes_per_param"] = m["state"] / n if n else 0.0
        if self._device.type == "cuda":
            m["device"] = str(self._device)
            m["torch_allocated"] = int(torch.cuda.memory_allocated(self._device))
            m["torch_max_allocated"] = int(torch.cuda.max_memory_allocated(self._device))
        return m


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
