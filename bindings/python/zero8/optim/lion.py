"""Lion with an 8-bit or 32-bit momentum (bitsandbytes' Lion / Lion8bit / Lion32bit names and arguments):
Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Program 1.
"""

from __future__ import annotations

from .. import _C
from .optimizer import Optimizer8bit, _num, fixed_bits

__all__ = ["Lion", "Lion8bit", "Lion32bit"]


class Lion(Optimizer8bit):
    """Lion: ``p *= 1 - lr wd``; ``p -= lr sign(b1 m + (1-b1) g)``; ``m = b2 m + (1-b2) g`` (decoupled
    weight decay; ``sign(0) = 0``). Defaults as the paper and bitsandbytes: ``lr=1e-4, betas=(0.9, 0.99)``.
    ``master_weights=False`` keeps no float32 master of bfloat16/float16 parameters (see ``Optimizer8bit``).
    """

    algo = _C.Algo.lion
    _GROUP_KEYS = ("lr", "betas", "weight_decay")
    _ALGORITHM = "lion"
    _TORCH_STATE_KEYS = ("exp_avg",)  # lion-pytorch's name of the momentum
    _BNB_ONLY_KEYS = ("eps",)

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0, *, optim_bits=32, args=None,
                 min_8bit_size=4096, percentile_clipping=100, block_wise=True, is_paged=False, block_size=256,
                 master_weights=True):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay), optim_bits=optim_bits,
                         args=args, min_8bit_size=min_8bit_size, percentile_clipping=percentile_clipping,
                         block_wise=block_wise, is_paged=is_paged, block_size=block_size,
                         master_weights=master_weights)

    def _hyper(self, c):
        b1, b2 = c["betas"][:2]
        return _C.Hyper(lr=_num(c["lr"], "lr"), beta1=_num(b1, "betas[0]"), beta2=_num(b2, "betas[1]"),
                        weight_decay=_num(c["weight_decay"], "weight_decay"))

    def _bnb_group_aliases(self, g):
        return {"eps": 0.0}


Lion8bit = fixed_bits(Lion, 8, "Lion8bit", "Lion with an 8-bit block-wise momentum (bitsandbytes' Lion8bit).")
Lion32bit = fixed_bits(Lion, 32, "Lion32bit", "Lion with a float32 momentum (bitsandbytes' Lion32bit).")
