"""AdamW with 8-bit or 32-bit states (torch.optim.AdamW's update; bitsandbytes' AdamW / AdamW8bit /
AdamW32bit names and arguments): Loshchilov & Hutter 2019, decoupled weight decay.
"""

from __future__ import annotations

from .adam import Adam
from .optimizer import fixed_bits

__all__ = ["AdamW", "AdamW8bit", "AdamW32bit"]


class AdamW(Adam, algo="adamw"):
    """AdamW: Adam's moments with decoupled weight decay, ``p *= 1 - lr * wd`` before the update
    (torch.optim.AdamW, bitsandbytes' AdamW; default ``weight_decay=1e-2`` as both). Arguments as ``Adam``.
    ``master_weights=False`` keeps no float32 master of bfloat16/float16 parameters (see ``Optimizer8bit``).
    """


AdamW8bit = fixed_bits(AdamW, 8, "AdamW8bit", "AdamW with 8-bit block-wise states (bitsandbytes' AdamW8bit).")
AdamW32bit = fixed_bits(AdamW, 32, "AdamW32bit", "AdamW with float32 states (bitsandbytes' AdamW32bit).")
