"""SGD with (Nesterov) momentum and 8-bit or 32-bit momentum buffers (torch.optim.SGD's update;
bitsandbytes' SGD / SGD8bit / SGD32bit names and arguments).
"""

from __future__ import annotations

from .optimizer import Optimizer8bit, fixed_bits

__all__ = ["SGD", "SGD8bit", "SGD32bit"]


class SGD(Optimizer8bit, algo="sgd"):
    """torch.optim.SGD: ``d = g + wd p``; ``buf = d`` at the first step, then ``momentum buf +
    (1 - dampening) d``; ``p -= lr (d + momentum buf)`` (nesterov) or ``lr buf``. The momentum buffer is
    the one state (8-bit: dynamic signed map). ``momentum=0`` is plain SGD (the state is then untouched;
    bitsandbytes refuses it, zero8 allows it as torch does). ``lr`` defaults to 1e-3 as in torch.
    ``master_weights=False`` keeps no float32 master of bfloat16/float16 parameters (see ``Optimizer8bit``).
    """


SGD8bit = fixed_bits(SGD, 8, "SGD8bit", "SGD with an 8-bit block-wise momentum buffer (bitsandbytes' SGD8bit).")
SGD32bit = fixed_bits(SGD, 32, "SGD32bit", "SGD with a float32 momentum buffer (bitsandbytes' SGD32bit).")
