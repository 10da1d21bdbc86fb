"""Adagrad with an 8-bit or 32-bit sum of squares (torch.optim.Adagrad's update; bitsandbytes' Adagrad /
Adagrad8bit / Adagrad32bit names and arguments): Duchi et al. 2011.
"""

from __future__ import annotations

from .._C import Zero8ValueError
from .optimizer import Optimizer8bit, _num, fixed_bits

__all__ = ["Adagrad", "Adagrad8bit", "Adagrad32bit"]


class Adagrad(Optimizer8bit, algo="adagrad"):
    """torch.optim.Adagrad: ``clr = lr / (1 + (t-1) lr_decay)``; ``g += wd p``; ``s += g^2`` (``s`` starts
    at ``initial_accumulator_value``); ``p -= clr g / (sqrt(s) + eps)``. Unlike bitsandbytes, ``lr_decay``
    and ``initial_accumulator_value`` may be nonzero.
    ``master_weights=False`` keeps no float32 master of bfloat16/float16 parameters (see ``Optimizer8bit``).
    """

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
