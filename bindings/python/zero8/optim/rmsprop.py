"""RMSprop with an 8-bit or 32-bit square average (torch.optim.RMSprop's update without momentum or
centering; bitsandbytes' RMSprop / RMSprop8bit / RMSprop32bit names and arguments).
"""

from __future__ import annotations

from .optimizer import Optimizer8bit, fixed_bits

__all__ = ["RMSprop", "RMSprop8bit", "RMSprop32bit"]


class RMSprop(Optimizer8bit, algo="rmsprop"):
    """RMSprop (Hinton, lecture 6e; torch.optim.RMSprop): ``g += wd p``; ``v = alpha v + (1-alpha) g^2``;
    ``p -= lr g / (sqrt(v) + eps)``. ``momentum`` != 0 and ``centered=True`` are not implemented
    (Zero8UnsupportedArgumentError; bitsandbytes' CPU path ignores momentum, zero8 refuses it).
    ``master_weights=False`` keeps no float32 master of bfloat16/float16 parameters (see ``Optimizer8bit``).
    """


RMSprop8bit = fixed_bits(RMSprop, 8, "RMSprop8bit",
                         "RMSprop with an 8-bit block-wise square average (bitsandbytes' RMSprop8bit).")
RMSprop32bit = fixed_bits(RMSprop, 32, "RMSprop32bit",
                          "RMSprop with a float32 square average (bitsandbytes' RMSprop32bit).")
