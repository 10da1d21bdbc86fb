"""LARS with an 8-bit or 32-bit momentum (bitsandbytes' LARS / LARS8bit / LARS32bit names and arguments):
You et al. 2017, "Large Batch Training of Convolutional Networks", as timm's Lars implements it.
"""

from __future__ import annotations

from .optimizer import fixed_bits
from .sgd import SGD

__all__ = ["LARS", "LARS8bit", "LARS32bit"]


class LARS(SGD, algo="lars"):
    """LARS: SGD whose step direction ``d = g + wd p`` is scaled per tensor by the trust ratio
    ``r = trust_coefficient ||p|| / ||d||`` (1 when either norm is 0; clipped at ``max_trust_ratio``,
    default 10, 0: no clip, and raised to ``min_trust_ratio``, default 0) before the momentum. Arguments as ``SGD``; bitsandbytes' ``max_unorm`` is
    accepted and ignored with a warning when not its default.
    ``master_weights=False`` keeps no float32 master of bfloat16/float16 parameters (see ``Optimizer8bit``).
    """


LARS8bit = fixed_bits(LARS, 8, "LARS8bit", "LARS with an 8-bit block-wise momentum (bitsandbytes' LARS8bit).")
LARS32bit = fixed_bits(LARS, 32, "LARS32bit", "LARS with a float32 momentum (bitsandbytes' LARS32bit).")
