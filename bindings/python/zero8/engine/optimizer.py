"""The optimizer ``zero8.initialize`` returns: a torch.optim.Optimizer face on the engine's sharded step,
for LR schedulers and scripts that call optimizer methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .._C import Zero8NotSupportedError

if TYPE_CHECKING:
    from .training import Zero8Engine

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
        with self._engine._stream_order():  # the weights were written on the current stream
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
