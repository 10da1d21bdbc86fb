"""SGD with (Nesterov) momentum and 8-bit or 32-bit momentum buffers (torch.optim.SGD's update;
bitsandbytes' SGD / SGD8bit / SGD32bit names and arguments).
"""

from __future__ import annotations

from .. import _C
from .optimizer import Optimizer8bit, _num, fixed_bits

__all__ = ["SGD", "SGD8bit", "SGD32bit"]


class SGD(Optimizer8bit):
    """torch.optim.SGD: ``d = g + wd p``; ``buf = d`` at the first step, then ``momentum buf +
    (1 - dampening) d``; ``p -= lr (d + momentum buf)`` (nesterov) or ``lr buf``. The momentum buffer is
    the one state (8-bit: dynamic signed map). ``momentum=0`` is plain SGD (the state is then untouched;
    bitsandbytes refuses it, zero8 allows it as torch does). ``lr`` defaults to 1e-3 as in torch.
    ``master_weights=False`` keeps no float32 master of bfloat16/float16 parameters (see ``Optimizer8bit``).
    """

    algo = _C.Algo.sgd
    _GROUP_KEYS = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
    _ALGORITHM = "sgd"
    _TORCH_STATE_KEYS = ("momentum_buffer",)
    _BNB_ONLY_KEYS = ("betas", "eps")

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False, *,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True,
                 is_paged=False, block_size=256, master_weights=True):
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov),
                         optim_bits=optim_bits, args=args, min_8bit_size=min_8bit_size,
                         percentile_clipping=percentile_clipping, block_wise=block_wise, is_paged=is_paged,
                         block_size=block_size, master_weights=master_weights)

    def _hyper(self, c):
        return _C.Hyper(lr=_num(c["lr"], "lr"), beta1=_num(c["momentum"], "momentum"),
                        dampening=_num(c["dampening"], "dampening"), nesterov=bool(c["nesterov"]),
                        weight_decay=_num(c["weight_decay"], "weight_decay"))

    # bitsandbytes' 1-state groups hold betas = (momentum, dampening) and eps.
    def _bnb_group_aliases(self, g):
        return {"betas": (g["momentum"], g["dampening"]), "eps": 0.0}

    def _from_bnb_group(self, saved):
        betas = saved.get("betas")
        return {"momentum": betas[0], "dampening": betas[1]} if betas is not None and len(betas) >= 2 else {}


SGD8bit = fixed_bits(SGD, 8, "SGD8bit", "SGD with an 8-bit block-wise momentum buffer (bitsandbytes' SGD8bit).")
SGD32bit = fixed_bits(SGD, 32, "SGD32bit", "SGD with a float32 momentum buffer (bitsandbytes' SGD32bit).")
