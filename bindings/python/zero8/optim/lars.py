"""LARS with an 8-bit or 32-bit momentum (bitsandbytes' LARS / LARS8bit / LARS32bit names and arguments):
You et al. 2017, "Large Batch Training of Convolutional Networks", as timm's Lars implements it.
"""

from __future__ import annotations

from .. import _C
from .optimizer import _num, fixed_bits
from .sgd import SGD

__all__ = ["LARS", "LARS8bit", "LARS32bit"]


class LARS(SGD):
    """LARS: SGD whose step direction ``d = g + wd p`` is scaled per tensor by the trust ratio
    ``r = trust_coefficient ||p|| / ||d||`` (1 when either norm is 0; clipped at ``max_trust_ratio``,
    default 10, 0: no clip, and raised to ``min_trust_ratio``, default 0) before the momentum. Arguments as ``SGD``; bitsandbytes' ``max_unorm`` is
    accepted and ignored with a warning when not its default.
    ``master_weights=False`` keeps no float32 master of bfloat16/float16 parameters (see ``Optimizer8bit``).
    """

    algo = _C.Algo.lars
    _GROUP_KEYS = SGD._GROUP_KEYS + ("trust_coefficient", "max_trust_ratio", "min_trust_ratio")
    _ALGORITHM = "lars"
    _LOADS_FROM = ("sgd",)  # the same momentum buffer; the group gains LARS's defaults
    _MAX_UNORM_DEFAULT = 0.02

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False, *,
                 optim_bits=32, args=None, min_8bit_size=4096, max_unorm=0.02, trust_coefficient=0.001,
                 max_trust_ratio=10.0, min_trust_ratio=0.0, percentile_clipping=100, block_wise=True, is_paged=False,
                 block_size=256, master_weights=True):
        # SGD's group keys plus the two trust-ratio keys (skipping SGD's constructor, which has no room
        # for them).
        super(SGD, self).__init__(
            params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                         nesterov=nesterov, trust_coefficient=trust_coefficient, max_trust_ratio=max_trust_ratio,
                         min_trust_ratio=min_trust_ratio),
            optim_bits=optim_bits, args=args, min_8bit_size=min_8bit_size, percentile_clipping=percentile_clipping,
            block_wise=block_wise, is_paged=is_paged, block_size=block_size, max_unorm=max_unorm,
            master_weights=master_weights)

    def _hyper(self, c):
        h = super()._hyper(c)
        h.trust_coefficient = _num(c["trust_coefficient"], "trust_coefficient")
        h.max_trust_ratio = _num(c["max_trust_ratio"], "max_trust_ratio")
        h.min_trust_ratio = _num(c.get("min_trust_ratio", 0.0), "min_trust_ratio")
        return h


LARS8bit = fixed_bits(LARS, 8, "LARS8bit", "LARS with an 8-bit block-wise momentum (bitsandbytes' LARS8bit).")
LARS32bit = fixed_bits(LARS, 32, "LARS32bit", "LARS with a float32 momentum (bitsandbytes' LARS32bit).")
