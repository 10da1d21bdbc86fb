"""Adagrad with an 8-bit or 32-bit sum of squares (torch.optim.Adagrad's update; bitsandbytes' Adagrad /
Adagrad8bit / Adagrad32bit names and arguments): Duchi et al. 2011.
"""

from __future__ import annotations

from .. import _C
from .._C import Zero8ValueError
from .optimizer import Optimizer8bit, _num, fixed_bits

__all__ = ["Adagrad", "Adagrad8bit", "Adagrad32bit"]


class Adagrad(Optimizer8bit):
    """torch.optim.Adagrad: ``clr = lr / (1 + (t-1) lr_decay)``; ``g += wd p``; ``s += g^2`` (``s`` starts
    at ``initial_accumulator_value``); ``p -= clr g / (sqrt(s) + eps)``. Unlike bitsandbytes, ``lr_decay``
    and ``initial_accumulator_value`` may be nonzero.
    ``master_weights=False`` keeps no float32 master of bfloat16/float16 parameters (see ``Optimizer8bit``).
    """

    algo = _C.Algo.adagrad
    _GROUP_KEYS = ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps")
    _ALGORITHM = "adagrad"
    _TORCH_STATE_KEYS = ("sum",)
    _BNB_ONLY_KEYS = ("betas",)

    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0, eps=1e-10, *,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True,
                 is_paged=False, block_size=256, master_weights=True):
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                                      initial_accumulator_value=initial_accumulator_value, eps=eps),
                         optim_bits=optim_bits, args=args, min_8bit_size=min_8bit_size,
                         percentile_clipping=percentile_clipping, block_wise=block_wise, is_paged=is_paged,
                         block_size=block_size, master_weights=master_weights)

    def _hyper(self, c):
        return _C.Hyper(lr=_num(c["lr"], "lr"), lr_decay=_num(c["lr_decay"], "lr_decay"),
                        weight_decay=_num(c["weight_decay"], "weight_decay"), eps=_num(c["eps"], "eps"),
                        initial_accumulator=_num(c["initial_accumulator_value"], "initial_accumulator_value"))

    def _initial_value(self, c):
        return _num(c["initial_accumulator_value"], "initial_accumulator_value")

    def _bnb_group_aliases(self, g):
        return {"betas": (0.0, 0.0)}

    def _check_saved_group(self, saved, index):
        super()._check_saved_group(saved, index)
        # bitsandbytes' Adagrad saves betas = (0, 0); other betas are another 1-state algorithm's (Lion's, whose
        # eps alias 0 would be read as Adagrad's eps and divide by a zero root).
        betas = saved.get("betas")
        if betas is not None and any(_num(b, f"betas (saved param_groups[{index}])") != 0 for b in betas):
            raise Zero8ValueError(f"saved param_groups[{index}] has betas = {tuple(betas)}, which Adagrad does not "
                                  f"have (bitsandbytes' Adagrad saves (0, 0)): was this state dict saved by "
                                  f"another optimizer?")


Adagrad8bit = fixed_bits(Adagrad, 8, "Adagrad8bit",
                         "Adagrad with an 8-bit block-wise sum of squares (bitsandbytes' Adagrad8bit).")
Adagrad32bit = fixed_bits(Adagrad, 32, "Adagrad32bit",
                          "Adagrad with a float32 sum of squares (bitsandbytes' Adagrad32bit).")
