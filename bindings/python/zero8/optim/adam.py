"""Adam with 8-bit or 32-bit states (bitsandbytes' Adam / Adam8bit / Adam32bit names, arguments and update):
Kingma & Ba 2015, with weight decay decoupled as bitsandbytes applies it, or torch.optim.Adam's L2 term on request.
"""

from __future__ import annotations

from .. import _C
from .._C import Zero8ValueError
from .optimizer import Optimizer8bit, _check_bool, _num, _unsupported, fixed_bits

__all__ = ["Adam", "Adam8bit", "Adam32bit"]


class Adam(Optimizer8bit, algo="adam"):
    """Adam over zero8's fused kernel: ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``,
    ``p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)`` (torch.optim.Adam), computed in Kingma & Ba's
    equivalent epsilon-hat form (one division per element: the result differs from torch's by float32
    rounding only).

    ``weight_decay`` is decoupled by default, ``p *= 1 - lr * wd`` before the update, because bitsandbytes'
    Adam, Adam8bit and Adam32bit apply it so (their update is torch.optim.AdamW's): these classes replace
    them without changing a run. ``decoupled_weight_decay=False`` (torch.optim.Adam's keyword and default)
    adds ``wd * p`` to the gradient instead, torch.optim.Adam's L2 rule. The rule is the optimizer's, for
    all its param groups (a group that names the other one is refused), and a state dict that records the
    other one (torch.optim's ``decoupled_weight_decay``; bitsandbytes' groups, always decoupled) is refused
    when it has weight decay.

    ``optim_bits`` (8 or 32) picks the state format; see ``Optimizer8bit`` for ``min_8bit_size``,
    ``block_size``, ``args``, ``master_weights`` (False: no float32 master of bfloat16/float16 parameters,
    as bitsandbytes) and per-parameter overrides. ``amsgrad``, ``percentile_clipping`` != 100 and
    ``is_paged`` are bitsandbytes arguments zero8 rejects (Zero8UnsupportedArgumentError).
    """

    @property
    def _decoupled(self) -> bool:
        return self.algo == _C.Algo.adamw

    def _rule(self) -> str:
        return "decoupled" if self._decoupled else "L2"

    def _check_hyper(self, group, where):
        super()._check_hyper(group, where)
        # One algorithm per optimizer: a group may not ask for the other rule (checked again at each step).
        value = group.get("decoupled_weight_decay")
        if value is not None and _check_bool(value, "decoupled_weight_decay" + where) != self._decoupled:
            raise Zero8ValueError(
                f"decoupled_weight_decay{where}: {value} in a group of {type(self).__name__}, which applies "
                f"{self._rule()} weight decay to all its groups (torch.optim.Adam takes one rule per group; "
                f"zero8 one per optimizer): use one optimizer for each rule")

    def _check_saved_group(self, saved, index):
        super()._check_saved_group(saved, index)
        # torch.optim.Adam/AdamW and zero8 record the rule they applied; bitsandbytes' 2-state groups (with
        # its AdEMAMix keys) come from its Adam or AdamW, which both decouple.
        decoupled = saved.get("decoupled_weight_decay")
        if decoupled is None and any(k in saved for k in ("t_alpha", "t_beta3")):
            decoupled = True
        if decoupled is not None and bool(decoupled) != self._decoupled \
                and _num(saved.get("weight_decay", 0), "weight_decay") != 0:
            other = "Adam(..., decoupled_weight_decay=False)" if self._decoupled else \
                "Adam (decoupled by default) or AdamW"
            _unsupported(f"decoupled_weight_decay (saved param_groups[{index}])", decoupled,
                         f"the saved optimizer applied {'decoupled' if decoupled else 'L2'} weight decay and "
                         f"{type(self).__name__} applies {self._rule()} weight decay; load this state into "
                         f"{other} instead")


Adam8bit = fixed_bits(Adam, 8, "Adam8bit", "Adam with 8-bit block-wise states (bitsandbytes' Adam8bit: "
                                          "decoupled weight decay unless decoupled_weight_decay=False).")
Adam32bit = fixed_bits(Adam, 32, "Adam32bit", "Adam with float32 states (bitsandbytes' Adam32bit: decoupled "
                                             "weight decay unless decoupled_weight_decay=False).")
