"""The pipeline engine: what ``zero8.initialize`` returns for a ``zero8.pipe.PipelineModule``. Each rank
runs one stage of one pipeline (DeepSpeed's PipeDataParallelTopology); the stage is a Zero8Engine over the
stage's layers whose sharded optimizer spans the stage's data-parallel ranks, so the setup, config view,
step, LR scheduler and checkpoint machinery are the plain engine's. Here: the 1F1B schedule of
``train_batch`` and the forwards of ``eval_batch`` (zero8.pipe.schedule), activations and their gradients
between stages (zero8.pipe.p2p), tied weights, the loss reported from the last stage, the pipeline-wide
overflow and gradient norm (the sharded optimizer's step group), and the checkpoint layout
(pipeline_checkpoint.py).

On a GPU each stage is on its rank's device (``zero8.engine.local_device()``) and a batch runs on the
engine's CUDA stream (the current stream at initialize): forwards, backwards, the messages between stages
(NCCL between GPUs, or MPI staged through host memory where ranks share a GPU) and the step, ordered after
the caller's current stream and before its later work, as the plain engine's calls. The host waits for
each message, or with zero8.queued_stage_messages over NCCL, once per batch, before the step. The first
stage moves a micro-batch's inputs to the device and the last stage its labels, as DeepSpeed's pipeline
engine does.
"""

from __future__ import annotations

import contextlib
import json
import time
import warnings

import torch

from .. import _C
from .._C import Zero8ValueError
from ..pipe import schedule as sched
from ..pipe.module import PipelineError, PipelineModule
from ..pipe.p2p import TAG_TIED_GRAD, TAG_TIED_WEIGHT, StageLink
from ..pipe.topology import PipelineParallelGrid
from .config_view import comm_timeout_s
from .pipeline_checkpoint import PipelineCheckpoints
from .training import Zero8Engine


class PipelineEngine(PipelineCheckpoints, Zero8Engine):
    """DeepSpeed's PipelineEngine over zero8's sharded optimizer: ``train_batch(data_iter)`` pulls
    gradient_accumulation_steps micro-batches ``(inputs, labels)`` on the first and last stages (the middle
    stages need no data), runs them through the 1F1B schedule and steps every stage's optimizer once;
    ``eval_batch`` runs forwards only. forward / backward / step of the plain engine raise PipelineError,
    as DeepSpeed's do."""

    _monitor_times = False  # DeepSpeed's pipeline engine writes no elapsed-time events

    def __init__(self, model: PipelineModule, config, dp: "_C.Communicator", world: "_C.Communicator",
                 pipe: "_C.Communicator", model_parameters=None, client_optimizer=None, client_lr_scheduler=None):
        if not isinstance(model, PipelineModule):
            raise TypeError(f"PipelineEngine: model must be a zero8.pipe.PipelineModule, got {type(model).__name__}")
        replicas = _tied_replicas(model)
        # Every rank learns which stages cannot build an optimizer, so all of them raise, none waits.
        own = any(p.requires_grad and id(p) not in replicas for p in model.parameters())
        flags = world.all_gather_bytes(b"1" if own else b"0")
        empty = sorted({r * model.num_stages // world.size for r, f in enumerate(flags) if f == b"0"})
        if empty:
            shown = ", ".join(f"stage {s} (layers {model.parts[s]}..{model.parts[s + 1] - 1})" for s in empty)
            raise Zero8ValueError(
                f"PipelineModule: {shown} holds no trainable parameters of its own; every stage needs some for its "
                f"optimizer: choose another partition_method, or fewer stages")
        super().__init__(model, config, dp, world, model_parameters=_without(model, model_parameters, replicas),
                         client_optimizer=client_optimizer, client_lr_scheduler=client_lr_scheduler)
        self._pipe = pipe
        timeout = comm_timeout_s(self._cfg)
        if timeout is not None:
            pipe.timeout = timeout
        self.num_stages = model.num_stages
        self.stage_id = model.stage_id
        self.grid = PipelineParallelGrid(model.topology(), self.global_rank)
        self.micro_batch_size = self.train_micro_batch_size_per_gpu()
        self.micro_batches = self.gradient_accumulation_steps()
        self.mp_world_size = 1
        if self.num_stages > 1:
            self._opt.set_step_group(pipe)  # overflow and gradient norm over every stage
        z = self._cfg.zero8
        if self._device.type == "cuda":
            pipe.stream = self._stream_order.stream.cuda_stream  # the stage's messages on the engine's stream
        if z.queued_stage_messages and not pipe.queues_p2p and self.global_rank == 0 and self.num_stages > 1:
            warnings.warn(f"zero8.queued_stage_messages has no effect here: the stages' messages go over "
                          f"{pipe.backend}, whose calls block (queued messages need NCCL between GPUs)", stacklevel=3)
        self._link = StageLink(pipe, self.stage_id, self.num_stages, bool(z.enabled and z.int8_activations),
                               int(z.wire_block_size), self._device, queued=bool(z.queued_stage_messages))
        self.data_iterator = None
        self.training_dataloader = None
        self.batch_fn = None
        # DeepSpeed's flag (its GPT-2 pipe model sets it); zero8 sends a bool mask as it is (see the setter).
        self.has_attention_mask = type(model).__name__ == "GPT2ModelPipe"
        self.agg_train_loss = None
        self._pipe_timers = {"batch": 0.0, "batches": 0}
        self._setup_ties(replicas)

    # ---- setup ----
    def _build_sharded_optimizer(self, sc: "_C.ShardConfig", client_optimizer) -> None:
        # Between a micro-batch's backward and its END_BACKWARD this stage sends and receives on the pipe
        # communicator, and one world's communicators take calls from one thread at a time: stage 2's
        # reductions stay in this thread (no overlap thread) when there are several stages.
        if self.module.num_stages > 1:
            sc.overlap = False
        super()._build_sharded_optimizer(sc, client_optimizer)

    def _summary(self) -> str:
        m = self.module
        return (f"{super()._summary()}; pipeline of {m.num_stages} stage(s) x {self.dp_world_size} data-parallel "
                f"rank(s), partition '{m.partition_method}' {m.parts}, activations on the wire: "
                f"{'int8' if self._cfg.zero8.enabled and self._cfg.zero8.int8_activations else 'as computed'}"
                f"\n{m.describe()}")

    def _setup_ties(self, replicas: dict) -> None:
        """Tied modules held by more than one stage: the owner (first stage) steps them; the others keep
        fp32 sums of their gradients (hooks), sent to the owner before its last reduction, and take the
        owner's weights now and after each applied step."""
        self._ties = []  # (key, owner stage, other stages, this stage's parameters of the module, in order)
        self._param_index = index = {id(p): i for i, p in enumerate(self._params)}
        self._tied_owned: set[int] = set()  # indices into self._params of tied parameters this stage steps
        self._tied_acc: dict[int, torch.Tensor] = {}  # id(replica parameter) -> fp32 gradient sum
        for key in self.module.tie_keys():
            stages = self.module.tied_stages(key)
            if len(stages) < 2 or self.stage_id not in stages:
                continue
            params = list(self.module.tied_modules[key].parameters())
            self._ties.append((key, stages[0], stages[1:], params))
            if self.stage_id == stages[0]:
                self._tied_owned.update(index[id(p)] for p in params if id(p) in index)
        for p in replicas.values():
            if not p.requires_grad:
                continue
            acc = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            self._tied_acc[id(p)] = acc

            def hook(param, acc=acc):
                if param.grad is not None:
                    acc.add_(param.grad)
                    param.grad = None

            self._hooks.append(p.register_post_accumulate_grad_hook(hook))
        self._defer_tied = False
        self._sync_tied_weights(everything=True)

    def _sync_tied_weights(self, everything: bool = False) -> None:
        """The owner's weights of each tied module to the other stages holding it (trainable parameters;
        with ``everything`` the frozen ones too). Point-to-point within this pipeline."""
        with torch.no_grad():
            for _key, owner, others, params in self._ties:
                for p in params:
                    if not (everything or p.requires_grad):
                        continue
                    t = p.data
                    if self.stage_id == owner:
                        src = t if t.is_contiguous() else t.contiguous()
                        for s in others:
                            self._pipe.send_ptr(src.data_ptr(), src.numel() * src.element_size(), s, TAG_TIED_WEIGHT)
                    else:
                        buf = torch.empty_like(t, memory_format=torch.contiguous_format)
                        self._pipe.recv_ptr(buf.data_ptr(), buf.numel() * buf.element_size(), owner, TAG_TIED_WEIGHT)
                        t.copy_(buf)

    def _reduce_tied_grads(self) -> None:
        """The other stages' gradient sums of each tied module join the owner's before its last reduction of
        the batch (so the tied weights step on the gradient of every use)."""
        for _key, owner, others, params in self._ties:
            for p in params:
                if not p.requires_grad:
                    continue
                if self.stage_id == owner:
                    # Stage 1: into the gradient buffer; stage 2 (no full buffer): into the bucket that
                    # carries it, not reduced yet (_gradient_arrived defers it).
                    i = self._param_index[id(p)]
                    buf = torch.empty(p.shape, dtype=torch.float32, device=p.device)
                    for s in others:
                        self._pipe.recv_ptr(buf.data_ptr(), buf.numel() * 4, s, TAG_TIED_GRAD)
                        self._opt.grad_add(i, buf.data_ptr(), _C.DType.f32)
                else:
                    acc = self._tied_acc[id(p)]
                    self._pipe.send_ptr(acc.data_ptr(), acc.numel() * 4, owner, TAG_TIED_GRAD)
                    acc.zero_()

    def _gradient_arrived(self, i: int) -> None:
        # In the last micro-batch a tied parameter's gradient is not whole until the other stages' sums
        # are added (REDUCE_TIED): stage 2 must not reduce its bucket before that.
        if self._defer_tied and i in self._tied_owned:
            return
        super()._gradient_arrived(i)

    def _optimizer_step(self) -> dict:
        info = super()._optimizer_step()
        if not info["skipped"]:
            self._sync_tied_weights()
        return info

    # ---- DeepSpeed's accessors ----
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def get_pipeline_parallel_rank(self) -> int:
        return self.stage_id

    def set_dataloader(self, loader) -> None:
        """The loader train_batch() reads when called without data_iter (first and last stages)."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = loader
            self.data_iterator = iter(loader)

    def set_dataiterator(self, iterator) -> None:
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = None
            self.data_iterator = iterator

    def set_batch_fn(self, fn) -> None:
        """DeepSpeed's: ``fn(batch)`` turns each item the data iterator yields into ``(inputs, labels)``
        before the stage reads it (Megatron-DeepSpeed's get_batch_pipe takes its dict of tokens); None
        removes it. First and last stages, train_batch and eval_batch."""
        if fn is not None and not callable(fn):
            raise TypeError(f"set_batch_fn: fn must be callable or None, got {type(fn).__name__}")
        self.batch_fn = fn

    def reset_activation_shape(self) -> None:
        """DeepSpeed's call before the activations' shape changes (curriculum learning's sequence length):
        nothing to reset here, as every batch agrees on its messages' shapes again with its first
        micro-batch."""

    def set_has_attention_mask(self, value: bool) -> None:
        """DeepSpeed's flag for a bool attention mask as the last tensor of the activations, which it casts
        to half for NCCL and back; zero8's messages carry any dtype, and never a gradient for a bool
        tensor, so the mask crosses as it is whatever the flag."""
        if not isinstance(value, bool):
            raise TypeError(f"set_has_attention_mask: value must be a bool, got {type(value).__name__}")
        self.has_attention_mask = value

    def forward(self, *args, **kwargs):
        raise PipelineError("the pipeline engine runs the model through train_batch() and eval_batch() only")

    def backward(self, *args, **kwargs):
        raise PipelineError("the pipeline engine runs backward inside train_batch(); call train_batch(data_iter)")

    def step(self, *args, **kwargs):
        raise PipelineError("the pipeline engine steps inside train_batch(); call train_batch(data_iter)")

    def set_gradient_accumulation_boundary(self, *args, **kwargs):
        raise PipelineError("the pipeline engine's accumulation is train_batch()'s gradient_accumulation_steps "
                            "micro-batches; change their count with set_train_batch_size()")

    coalesce_grad_reduction = set_gradient_accumulation_boundary

    def _set_batch(self, batch: int, micro: int, gas: int, caller: str) -> None:
        super()._set_batch(batch, micro, gas, caller)
        self.micro_batch_size, self.micro_batches = micro, gas  # train_batch's schedule from the next batch on

    # ---- the schedules ----
    def train_batch(self, data_iter=None) -> torch.Tensor:
        """Trains one batch: gradient_accumulation_steps micro-batches through the 1F1B schedule, then one
        optimizer step in every stage (skipped in all of them on an overflow anywhere). Returns the mean
        loss of the batch's micro-batches over every data-parallel rank, on every rank (a float32 tensor),
        as DeepSpeed's train_batch."""
        self._check_live()
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() needs gradients enabled (it runs backward); use eval_batch() instead")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        t0 = time.perf_counter()
        with self._batch_stream():
            losses = self._run(sched.train_schedule(self.stage_id, self.num_stages, self.micro_batches),
                               training=True)
            self.agg_train_loss = self._reported_loss(losses, self.micro_batches)
        self._pipe_timers["batch"] += time.perf_counter() - t0
        self._pipe_timers["batches"] += 1
        if self.monitor.writes:  # after the step's lr, at the same x, as DeepSpeed's
            self.monitor.write_events([("Train/Samples/train_loss", float(self.agg_train_loss), self.global_samples)])
        if self.global_rank == 0 and self.global_steps % self.steps_per_print() == 0:
            t = self._pipe_timers
            per_batch = t["batch"] / t["batches"]
            self._log(f"steps: {self.global_steps} loss: {float(self.agg_train_loss):0.4f} iter time (s): "
                      f"{per_batch:0.3f} samples/sec: {self.train_batch_size() / per_batch:0.3f}")
            self._pipe_timers = {"batch": 0.0, "batches": 0}
        return self.agg_train_loss

    def eval_batch(self, data_iter, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True, num_micro_batches: int | None = None):
        """Forwards only, under torch.no_grad(), over num_micro_batches (default gradient_accumulation_steps)
        micro-batches of data_iter. Returns the mean loss (reduce_output "avg": over the micro-batches and the
        data-parallel ranks; None: the list of the micro-batches' losses, last stage only) on every rank when
        bcast_loss, else on the last stage (None elsewhere); with return_logits, (loss, outputs of the last
        micro-batch on the last stage, None elsewhere), as DeepSpeed's. With a monitor enabled the mean loss
        is broadcast (and returned) even without bcast_loss, and rank 0 writes it as Train/Samples/eval_loss
        at x = global_samples, as DeepSpeed's does. With compute_loss=False the last stage's outputs take the
        losses' place: "avg" is their mean per tensor (a tuple's too) on the device, in each one's dtype
        (_dp_mean_outputs), on the last stage only."""
        self._check_live()
        if reduce_output not in ("avg", None):
            raise Zero8ValueError(f"eval_batch: reduce_output {reduce_output!r} (DeepSpeed's choices: 'avg', None)")
        micro = self.micro_batches if num_micro_batches is None else int(num_micro_batches)
        if micro < 1:
            raise Zero8ValueError(f"eval_batch: num_micro_batches must be >= 1, got {micro}")
        saved = self.data_iterator
        self.data_iterator = data_iter if (self.is_first_stage() or self.is_last_stage()) else None
        self.module.eval()
        self._eval_outputs = None
        try:
            with torch.no_grad(), self._batch_stream():
                outputs = self._run(sched.eval_schedule(self.stage_id, self.num_stages, micro), training=False,
                                    compute_loss=compute_loss, keep_last_output=return_logits)
                if reduce_output is None:
                    result = outputs if self.is_last_stage() else None
                elif compute_loss and (bcast_loss or self.monitor.enabled):
                    result = self._reported_loss(outputs, micro)
                elif not self.is_last_stage():
                    result = None
                elif compute_loss:
                    result = self._dp_mean(outputs, micro)
                else:
                    result = self._dp_mean_outputs(outputs, micro)
        finally:
            self.data_iterator = saved
        if self.monitor.writes and compute_loss and reduce_output is not None:
            self.monitor.write_events([("Train/Samples/eval_loss", float(result), self.global_samples)])
        if return_logits:
            logits, self._eval_outputs = self._eval_outputs, None
            return result, logits
        return result

    @contextlib.contextmanager
    def _batch_stream(self):
        """A batch's work on the engine's stream, after the caller's current stream's and before its later
        work (StreamOrder); nothing on the CPU."""
        with self._stream_order():
            if self._device.type == "cuda":
                with torch.cuda.stream(self._stream_order.stream):
                    yield
            else:
                yield

    def _next_batch(self, micro: int) -> tuple:
        """The next micro-batch as (inputs, labels), the part this stage reads on its device (first stage:
        inputs, last: labels)."""
        if self.data_iterator is None:
            raise Zero8ValueError(
                f"stage {self.stage_id} reads the micro-batches but has no data: pass data_iter to train_batch / "
                f"eval_batch, or training_data to zero8.initialize")
        try:
            batch = next(self.data_iterator)
        except StopIteration:
            raise StopIteration(f"stage {self.stage_id}: the data iterator ended at micro-batch {micro} of "
                                f"{self.micro_batches} (wrap it to repeat, as DeepSpeed's RepeatingLoader)") from None
        if self.batch_fn is not None:
            batch = self.batch_fn(batch)
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise Zero8ValueError(
                f"stage {self.stage_id}: micro-batch {micro} is a {type(batch).__name__}"
                f"{f' of {len(batch)}' if isinstance(batch, (tuple, list)) else ''}; a pipeline micro-batch is "
                f"(inputs, labels): the first stage takes inputs, the last labels")
        inputs, labels = batch
        # Each stage moves only what it reads (the other part may be anything, as in DeepSpeed).
        if self.is_first_stage():
            # A DataLoader hands a tuple of inputs as a list; the first layer gets the tuple, as in DeepSpeed.
            inputs = _to_device(tuple(inputs) if isinstance(inputs, list) else inputs, self._device)
            if self.module.reentrant_checkpointing():
                # A reentrant segment whose inputs all lack requires_grad returns an output without a graph:
                # no gradient for its parameters. detach(): the caller's tensors keep their flags.
                inputs = _requiring_grad(inputs)
        if self.is_last_stage():
            labels = _to_device(tuple(labels) if isinstance(labels, list) else labels, self._device)
        return inputs, labels

    def _run(self, program: list, training: bool, compute_loss: bool = True, keep_last_output: bool = False) -> list:
        """Executes one stage's instructions. Returns the last stage's per-micro-batch losses (detached;
        the outputs when there is no loss), [] on the other stages."""
        link = self._link
        link.new_batch()
        first, last = self.is_first_stage(), self.is_last_stage()
        inputs: dict[int, object] = {}    # received activations (their .grad goes back), or first-stage inputs
        outputs: dict[int, object] = {}   # this stage's outputs (the loss on the last stage)
        labels: dict[int, object] = {}
        back: dict[int, tuple] = {}       # (tensors, gradients) received for backward
        losses: list = []
        n_micro = max((ins.micro for ins in program), default=-1) + 1
        for ins in program:
            kind, i = ins.kind, ins.micro
            if kind == sched.RECV_ACT:
                inputs[i] = link.recv_activations()
            elif kind == sched.FORWARD:
                if first or last:
                    x, y = self._next_batch(i)
                    if first:
                        inputs[i] = x
                    if last:
                        labels[i] = y
                out = Zero8Engine.forward(self, inputs[i])
                if last:
                    if keep_last_output and i == n_micro - 1:
                        self._eval_outputs = out
                    loss_fn = self.module.loss_fn
                    out = loss_fn(out, labels.pop(i)) if (loss_fn is not None and compute_loss) else out
                    losses.append(out.detach() if isinstance(out, torch.Tensor) else out)
                if training or not last:
                    outputs[i] = out
                if not training:
                    inputs.pop(i, None)
            elif kind == sched.SEND_ACT:
                link.send_activations(outputs[i], i)
                if not training:
                    outputs.pop(i)
            elif kind == sched.RECV_GRAD:
                back[i] = link.recv_grads(outputs[i])
            elif kind == sched.BACKWARD:
                self._defer_tied = i == n_micro - 1
                if last:
                    loss = outputs.pop(i)
                    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                        raise Zero8ValueError(
                            f"stage {self.stage_id}: the loss of micro-batch {i} is "
                            f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}; "
                            f"train_batch needs one scalar (PipelineModule's loss_fn, or the last layer's output)")
                    _, scaled = self._scaled_loss(loss)
                    self._autograd_backward([scaled], None)
                else:
                    tensors, grads = back.pop(i)
                    outputs.pop(i)
                    if tensors:
                        self._autograd_backward(tensors, grads)
                    else:  # nothing of this stage's output needs a gradient: no parameter of it either
                        self._backwards += 1
                self._defer_tied = False
                if first:
                    inputs.pop(i, None)
            elif kind == sched.SEND_GRAD:
                link.send_grads(inputs.pop(i))
            elif kind == sched.REDUCE_TIED:
                self._reduce_tied_grads()
            elif kind == sched.END_BACKWARD:
                self._reduce_backward()
                if i < n_micro - 1:
                    Zero8Engine.step(self)  # counters only: not the accumulation boundary
            elif kind == sched.STEP:
                link.sync()  # a neighbour lost on a queued message is named here, before the step's calls
                Zero8Engine.step(self)
            else:
                raise RuntimeError(f"unknown pipeline instruction {ins!r}")
        link.sync()  # eval_batch's messages (train_batch's: nothing left after STEP)
        return losses

    # ---- the reported loss ----
    def _dp_mean(self, values: list, micro: int) -> torch.Tensor:
        """Last stage: the mean of the micro-batches' values (scalars or same-shaped tensors), then over the
        data-parallel ranks (a sum in rank order, divided)."""
        total = sum(v.detach().double() for v in values) / micro
        flat = total.reshape(-1).tolist()
        if self.dp_world_size > 1:
            flat = [v / self.dp_world_size for v in self._dp.all_reduce_f64(flat, "sum")]
        return torch.tensor(flat, dtype=torch.float32, device=self._device).reshape(total.shape)

    def _dp_mean_outputs(self, outputs: list, micro: int):
        """Last stage: eval_batch's "avg" of the micro-batches' outputs (tensors or tuples of them), per
        tensor over the micro-batches and the data-parallel ranks, as DeepSpeed's _reduce_outputs: on the
        device, with the data-parallel sum there too (no copy to the host), summed in float32 (float64 for
        float64) and returned in the output's dtype (float32 for a non-floating one)."""
        is_tuple = isinstance(outputs[0], (tuple, list))
        rows = [tuple(o) if isinstance(o, (tuple, list)) else (o,) for o in outputs]
        out = []
        for j, first in enumerate(rows[0]):
            for i, row in enumerate(rows):
                v = row[j] if len(row) == len(rows[0]) else None
                if not (isinstance(v, torch.Tensor) and isinstance(first, torch.Tensor) and v.shape == first.shape):
                    got = (f"{type(v).__name__}{tuple(v.shape) if isinstance(v, torch.Tensor) else ''}"
                           if len(row) == len(rows[0]) else f"one of {len(row)} outputs, not {len(rows[0])}")
                    raise Zero8ValueError(
                        f"eval_batch(reduce_output='avg'): output {j} of micro-batch {i} is {got}; the average "
                        f"needs tensors of one shape in every micro-batch (reduce_output=None returns the outputs)")
            dtype = first.dtype
            acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
            total = first.detach().to(acc_dtype, memory_format=torch.contiguous_format, copy=True)
            for row in rows[1:]:
                total += row[j].detach()
            total /= micro
            if self.dp_world_size > 1 and total.numel():
                kind = "f64" if acc_dtype == torch.float64 else "f32"
                self._dp.all_reduce_ptr(total.data_ptr(), total.numel(), kind, "sum")
                total /= self.dp_world_size
            out.append(total.to(dtype) if dtype.is_floating_point else total)
        return tuple(out) if is_tuple else out[0]

    def _reported_loss(self, losses: list, micro: int) -> torch.Tensor:
        """The batch's mean loss, computed on the last stage and broadcast to every stage of the pipeline."""
        if self.is_last_stage():
            for i, v in enumerate(losses):
                if not isinstance(v, torch.Tensor) or v.numel() != 1:
                    raise Zero8ValueError(f"stage {self.stage_id}: the loss of micro-batch {i} is not a scalar tensor")
            loss = self._dp_mean(losses, micro).reshape(())
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self._device)
        if self.num_stages > 1:
            self._pipe.broadcast_ptr(loss.data_ptr(), 4, self.num_stages - 1)
        return loss

    # ---- statistics ----
    def comm_stats(self) -> dict:
        """The plain engine's statistics of the data-parallel communicator, plus ``pipeline``: what this rank
        sent to the next stage (activations) and to the previous one (their gradients), with what fp32 would
        have cost, and the pipeline communicator's own counters (all kinds, tied weights and the step's
        agreements included)."""
        out = super().comm_stats()
        link = self._link
        ops = {k: dict(v) for k, v in self._pipe.stats().items() if int(v["calls"]) > 0}
        out["pipeline"] = {
            "stage": self.stage_id, "stages": self.num_stages, "int8_activations": link.int8,
            "activations_to_next": link.activations.as_dict(), "gradients_to_prev": link.gradients.as_dict(),
            "pipe_group_bytes": sum(int(v["bytes"]) for v in ops.values()), "pipe_group_ops": ops,
        }
        return out

    def boundary_stats(self) -> list[dict]:
        """Collective over the pipeline group: per stage boundary (s, s + 1) of this pipeline, the bytes of
        activations sent forward and of gradients sent back since the engine was made, and what they would
        have been in fp32; the same list on every stage."""
        mine = self.comm_stats()["pipeline"]
        every = [json.loads(b) for b in self._pipe.all_gather_bytes(json.dumps(mine).encode())]
        out = []
        for s in range(self.num_stages - 1):
            act, grad = every[s]["activations_to_next"], every[s + 1]["gradients_to_prev"]
            out.append({"boundary": (s, s + 1), "activation_bytes": act["bytes"], "gradient_bytes": grad["bytes"],
                        "bytes": act["bytes"] + grad["bytes"], "fp32_bytes": act["fp32_bytes"] + grad["fp32_bytes"]})
        return out


def _to_device(x, device: torch.device):
    """A micro-batch's inputs or labels on the stage's device: tensors, and tensors in tuples and lists. A host
    tensor goes to a GPU through a pinned copy of its own, queued on the current stream: from pageable memory
    CUDA syncs the stream before the copy, so the host would wait for every kernel queued so far, at each
    micro-batch, and the GPU would idle while it queues the next ones. The copy is ours (even of a pinned
    tensor, which its owner may refill once we return), and torch's pinned-memory allocator keeps it until the
    transfer is done."""
    if isinstance(x, torch.Tensor):
        if device.type == "cuda" and x.device.type == "cpu":
            return torch.empty_like(x, pin_memory=True).copy_(x).to(device, non_blocking=True)
        return x.to(device)
    if isinstance(x, (tuple, list)):
        out = [_to_device(v, device) for v in x]
        return tuple(out) if isinstance(x, tuple) else out
    return x


def _requiring_grad(x):
    """First-stage inputs (a tensor or a tuple of them) with each floating tensor a new leaf that requires
    grad."""
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_() if x.is_floating_point() else x
    if isinstance(x, tuple):
        return tuple(_requiring_grad(v) for v in x)
    return x


def _tied_replicas(model: PipelineModule) -> dict:
    """{id: parameter} of the tied modules this stage holds but does not own (another stage steps them)."""
    out = {}
    for key in model.tie_keys():
        stages = model.tied_stages(key)
        if model.stage_id in stages and model.stage_id != stages[0]:
            for p in model.tied_modules[key].parameters():
                out[id(p)] = p
    return out


def _without(model: PipelineModule, model_parameters, replicas: dict):
    """model_parameters (None: all the stage's parameters) without the tied replicas."""
    if not replicas:
        return model_parameters
    if model_parameters is None:
        return [p for p in model.parameters() if id(p) not in replicas]
    if isinstance(model_parameters, torch.Tensor):
        return model_parameters  # collect_params names the mistake
    out = []
    for item in model_parameters:
        if isinstance(item, dict) and "params" in item:
            params = item["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            out.append({**item, "params": [p for p in params if id(p) not in replicas]})
        elif not (isinstance(item, torch.Tensor) and id(item) in replicas):
            out.append(item)
    return out
