"""Lion with an 8-bit or 32-bit momentum (bitsandbytes' Lion / Lion8bit / Lion32bit names and arguments):
Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Program 1.
"""

from __future__ import annotations

from .optimizer import Optimizer8bit, fixed_bits

__all__ = ["Lion", "Lion8bit", "Lion32bit"]


class Lion(Optimizer8bit, algo="lion"):
    """Lion: ``p *= 1 - lr wd``; ``p -= lr sign(b1 m + (1-b1) g)``; ``m = b2 m + (1-b2) g`` (decoupled
    weight decay; ``sign(0) = 0``, ``sign(NaN) = NaN``: a NaN gradient makes its parameter NaN, as in every
    zero8 optimizer, instead of stopping it silently as torch.sign's 0 would). Defaults as the paper and
    bitsandbytes: ``lr=1e-4, betas=(0.9, 0.99)``.
    ``master_weights=False`` keeps no float32 master of bfloat16/float16 parameters (see ``Optimizer8bit``).
    """


Lion8bit = fixed_bits(Lion, 8, "Lion8bit", "Lion with an 8-bit block-wise momentum (bitsandbytes' Lion8bit).")
Lion32bit = fixed_bits(Lion, 32, "Lion32bit", "Lion with a float32 momentum (bitsandbytes' Lion32bit).")
