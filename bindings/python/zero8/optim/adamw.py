"""AdamW with 8-bit or 32-bit states (torch.optim.AdamW's update; bitsandbytes' AdamW / AdamW8bit /
AdamW32bit names and arguments): Loshchilov & Hutter 2019, decoupled weight decay.
"""

from __future__ import annotations

from .. import _C
from .adam import Adam
from .optimizer import fixed_bits

__all__ = ["AdamW", "AdamW8bit", "AdamW32bit"]


class AdamW(Adam):
    """AdamW: Adam's moments with decoupled weight decay, ``p *= 1 - lr * wd`` before the update
    (torch.optim.AdamW, bitsandbytes' AdamW; default ``weight_decay=1e-2`` as both). Arguments as ``Adam``.
    ``master_weights=False`` keeps no float32 master of bfloat16/float16 parameters (see ``Optimizer8bit``).
    """

    algo = _C.Algo.adamw

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True,
                 is_paged=False, block_size=256, master_weights=True):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits=optim_bits, args=args,
                         min_8bit_size=min_8bit_size, percentile_clipping=percentile_clipping,
                         block_wise=block_wise, is_paged=is_paged, block_size=block_size,
                         master_weights=master_weights)


AdamW8bit = fixed_bits(AdamW, 8, "AdamW8bit", "AdamW with 8-bit block-wise states (bitsandbytes' AdamW8bit).")
AdamW32bit = fixed_bits(AdamW, 32, "AdamW32bit", "AdamW with float32 states (bitsandbytes' AdamW32bit).")
