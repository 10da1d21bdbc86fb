"""RMSprop with an 8-bit or 32-bit square average (torch.optim.RMSprop's update without momentum or
centering; bitsandbytes' RMSprop / RMSprop8bit / RMSprop32bit names and arguments).
"""

from __future__ import annotations

from .. import _C
from .optimizer import Optimizer8bit, _num, _unsupported, fixed_bits

__all__ = ["RMSprop", "RMSprop8bit", "RMSprop32bit"]


class RMSprop(Optimizer8bit):
    """RMSprop (Hinton, lecture 6e; torch.optim.RMSprop): ``g += wd p``; ``v = alpha v + (1-alpha) g^2``;
    ``p -= lr g / (sqrt(v) + eps)``. ``momentum`` != 0 and ``centered=True`` are not implemented
    (Zero8UnsupportedArgumentError; bitsandbytes' CPU path ignores momentum, zero8 refuses it).
    ``master_weights=False`` keeps no float32 master of bfloat16/float16 parameters (see ``Optimizer8bit``).
    """

    algo = _C.Algo.rmsprop
    _GROUP_KEYS = ("lr", "alpha", "eps", "weight_decay")
    _ALGORITHM = "rmsprop"
    _TORCH_STATE_KEYS = ("square_avg",)
    _BNB_ONLY_KEYS = ("betas", "momentum")

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0, centered=False, *,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True,
                 is_paged=False, block_size=256, master_weights=True):
        if momentum != 0:
            _unsupported("momentum", momentum, "zero8's RMSprop keeps one state (the square average)")
        if centered:
            _unsupported("centered", centered, "zero8's RMSprop keeps one state (the square average)")
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay),
                         optim_bits=optim_bits, args=args, min_8bit_size=min_8bit_size,
                         percentile_clipping=percentile_clipping, block_wise=block_wise, is_paged=is_paged,
                         block_size=block_size, master_weights=master_weights)

    def _hyper(self, c):
        return _C.Hyper(lr=_num(c["lr"], "lr"), beta2=_num(c["alpha"], "alpha"), eps=_num(c["eps"], "eps"),
                        weight_decay=_num(c["weight_decay"], "weight_decay"))

    # bitsandbytes' groups hold betas = (alpha, momentum); torch's hold momentum.
    def _bnb_group_aliases(self, g):
        return {"betas": (g["alpha"], 0.0)}

    def _from_bnb_group(self, saved):
        betas = saved.get("betas")
        momentum = saved.get("momentum", betas[1] if betas is not None and len(betas) >= 2 else 0)
        if momentum:
            _unsupported("momentum (saved param group)", momentum, "zero8's RMSprop keeps no momentum buffer")
        return {"alpha": betas[0]} if betas is not None and len(betas) >= 1 else {}


RMSprop8bit = fixed_bits(RMSprop, 8, "RMSprop8bit",
                         "RMSprop with an 8-bit block-wise square average (bitsandbytes' RMSprop8bit).")
RMSprop32bit = fixed_bits(RMSprop, 32, "RMSprop32bit",
                          "RMSprop with a float32 square average (bitsandbytes' RMSprop32bit).")
