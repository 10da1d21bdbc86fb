"""zero8's optimizers built for DeepSpeed's engine (and the Hugging Face Trainer): the parameter names and the
embedding rule a flat ZeRO partition cannot tell. zero8.optim's classes step DeepSpeed's partitions by
parameter (zero8.optim.partition); these add names for messages and checkpoints, and 32-bit states for
``torch.nn.Embedding`` weights.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Iterable, Optional, Tuple, Type, Union

import torch

from .. import optim as _optim
from .._C import Zero8ValueError

__all__ = ["embedding_weights", "optimizer", "optimizer_class", "trainer_optimizer_cls_and_kwargs"]


def embedding_weights(module: torch.nn.Module) -> list:
    """The weights of every ``torch.nn.Embedding`` in `module` (``zero8.nn.StableEmbedding`` included), each
    once: the tensors that keep 32-bit optimizer states under the embedding rule (Dettmers et al. 2022, section
    2.3; the Hugging Face Trainer applies it to bitsandbytes' 8-bit optimizers)."""
    seen, out = set(), []
    for m in module.modules():
        if isinstance(m, torch.nn.Embedding) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            out.append(m.weight)
    return out


def _base_class(optimizer: Union[str, type]) -> type:
    if isinstance(optimizer, str):
        cls = getattr(_optim, optimizer, None)
        if not (isinstance(cls, type) and issubclass(cls, _optim.Optimizer8bit)):
            names = sorted(n for n in _optim.__all__ if isinstance(getattr(_optim, n), type)
                           and issubclass(getattr(_optim, n), _optim.Optimizer8bit) and n != "Optimizer8bit")
            raise Zero8ValueError(f"optimizer {optimizer!r} is not a zero8.optim optimizer; one of {', '.join(names)}")
        return cls
    if isinstance(optimizer, type) and issubclass(optimizer, _optim.Optimizer8bit):
        return optimizer
    raise Zero8ValueError(f"optimizer must be a zero8.optim optimizer class or its name, got {optimizer!r}")


@functools.lru_cache(maxsize=None)
def optimizer_class(optimizer: Union[str, type]) -> type:
    """A subclass of zero8.optim's `optimizer` (class or name, e.g. ``"AdamW8bit"``) whose constructor also
    takes ``module=`` (the model: parameter names for messages and the saved layout, and the embeddings) and
    ``fp32_embeddings=`` (default True: 32-bit states for the embedding weights unless an override says
    otherwise). Its name is the base's; everything else is the base class's."""
    base = _base_class(optimizer)

    def __init__(self, params, *args, module: Optional[torch.nn.Module] = None, fp32_embeddings: bool = True,
                 **kwargs):
        if isinstance(params, torch.nn.Module):
            module = params if module is None else module
            params = [p for p in params.parameters() if p.requires_grad]
        base.__init__(self, params, *args, **kwargs)
        if module is not None:
            _attach_module(self, module, fp32_embeddings)

    __init__.__doc__ = (f"{base.__name__}'s arguments, plus module= (the model: names and embeddings) and "
                        f"fp32_embeddings= (32-bit states for torch.nn.Embedding weights, default True).")
    return type(base.__name__, (base,), {"__init__": __init__, "__module__": __name__,
                                         "__qualname__": base.__name__, "__doc__": base.__doc__})


def _attach_module(opt: "_optim.Optimizer8bit", module: torch.nn.Module, fp32_embeddings: bool) -> None:
    opt.set_param_names(module.named_parameters())
    if not fp32_embeddings:
        return
    known = opt._known_params()
    for w in embedding_weights(module):
        # A lower rank than an explicit choice: an optim_bits override the user set (global or on this
        # optimizer) stays.
        if id(w) in known and "optim_bits" not in opt.overrides_for(w):
            opt.override_config(w, optim_bits=32)


def optimizer(module: torch.nn.Module, optimizer: Union[str, type] = "AdamW8bit", params=None, *,
              fp32_embeddings: bool = True, **kwargs) -> "_optim.Optimizer8bit":
    """zero8's `optimizer` (name or class of zero8.optim, default ``"AdamW8bit"``) over `module`'s trainable
    parameters (or `params`: tensors or param-group dicts), for ``deepspeed.initialize(model=module,
    optimizer=...)``::

        opt = zero8.deepspeed.optimizer(model, "AdamW8bit", lr=3e-4, weight_decay=0.1)
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)

    The config needs ``"zero_allow_untested_optimizer": true`` with ZeRO. kwargs are the class's
    (``lr``, ``betas``, ``min_8bit_size``, ``block_size``...). Under ZeRO stage 1, 2 and 3 each rank's flat
    partition is stepped by parameter (zero8.optim.partition); names come from `module`, and with
    `fp32_embeddings` (default) every ``torch.nn.Embedding`` weight keeps 32-bit states."""
    if params is None:
        params = [p for p in module.parameters() if p.requires_grad]
    return optimizer_class(optimizer)(params, module=module, fp32_embeddings=fp32_embeddings, **kwargs)


# TrainingArguments -> the optimizer's keywords (the Trainer's own AdamW takes the same).
_TRAINING_ARGS = (("learning_rate", "lr"), ("weight_decay", "weight_decay"), ("adam_epsilon", "eps"))


def trainer_optimizer_cls_and_kwargs(model: torch.nn.Module, args=None, optimizer: Union[str, type] = "AdamW8bit",
                                     *, fp32_embeddings: bool = True, **kwargs) -> Tuple[type, Dict[str, Any]]:
    """``(cls, kwargs)`` for the Hugging Face Trainer's ``optimizer_cls_and_kwargs=``, alone or under DeepSpeed
    (which drops ``optimizers=(instance, None)``; the Trainer builds this one itself, from its param groups)::

        cls_kwargs = zero8.deepspeed.trainer_optimizer_cls_and_kwargs(model, training_args)
        trainer = Trainer(model=model, args=training_args, optimizer_cls_and_kwargs=cls_kwargs, ...)

    The learning rate, weight decay, betas and epsilon come from `args` (a ``TrainingArguments``) when given;
    kwargs win over them. With `fp32_embeddings` (default) the embedding weights keep 32-bit states, the rule
    the Trainer applies to bitsandbytes' 8-bit optimizers only."""
    values: Dict[str, Any] = {}
    if args is not None:
        for attr, key in _TRAINING_ARGS:
            if hasattr(args, attr):
                values[key] = getattr(args, attr)
        if hasattr(args, "adam_beta1") and hasattr(args, "adam_beta2"):
            values["betas"] = (args.adam_beta1, args.adam_beta2)
    cls = optimizer_class(optimizer)
    accepted = set(_optimizer_keywords(cls))
    values = {k: v for k, v in values.items() if k in accepted}
    values.update(kwargs)
    values.update(module=model, fp32_embeddings=fp32_embeddings)
    return cls, values


def _optimizer_keywords(cls: type) -> Iterable[str]:
    import inspect
    base = cls.__mro__[1]
    return inspect.signature(base.__init__).parameters
