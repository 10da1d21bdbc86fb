"""LAMB with 8-bit or 32-bit states (bitsandbytes' LAMB / LAMB8bit / LAMB32bit names and arguments):
You et al. 2020, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes", Algorithm 2.
"""

from __future__ import annotations

from .. import _C
from .optimizer import Optimizer8bit, _num, _unsupported, fixed_bits

__all__ = ["LAMB", "LAMB8bit", "LAMB32bit"]


class LAMB(Optimizer8bit):
    """LAMB: Adam's moments, ``u = m_hat / (sqrt(v_hat) + eps) + wd p``, ``p -= lr * r * u`` with the
    per-tensor trust ratio ``r = ||p|| / ||u||`` (1 when either norm is 0), clipped at ``max_trust_ratio``
    (default 10; 0: no clip) and raised to ``min_trust_ratio`` (default 0: none; DeepSpeed's Lamb uses
    ``min_coeff=0.01``). Both phases (norms, then the update) run in one ``_C.step_tensor`` call.

    bitsandbytes' ``max_unorm`` (its approximation of the trust ratio by update-norm clipping) is accepted
    and ignored with a warning when not its default; ``adam_w_mode=False`` and ``amsgrad=True`` are
    rejected (the paper's decay is decoupled).
    ``master_weights=False`` keeps no float32 master of bfloat16/float16 parameters (see ``Optimizer8bit``).
    """

    algo = _C.Algo.lamb
    _GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "bias_correction", "max_trust_ratio", "min_trust_ratio")
    _ALGORITHM = "lamb"
    _LOADS_FROM = ("adam",)  # the same two moments; the group gains LAMB's defaults
    _TORCH_STATE_KEYS = ("exp_avg", "exp_avg_sq")
    _BNB_ONLY_KEYS = ("alpha", "t_alpha", "t_beta3")
    _MAX_UNORM_DEFAULT = 1.0

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, adam_w_mode=True, *, optim_bits=32, args=None, min_8bit_size=4096,
                 max_unorm=1.0, max_trust_ratio=10.0, min_trust_ratio=0.0, percentile_clipping=100, block_wise=True, is_paged=False,
                 block_size=256, master_weights=True):
        if amsgrad:
            _unsupported("amsgrad", amsgrad, "zero8 keeps no running maximum of the second moment")
        if not adam_w_mode:
            _unsupported("adam_w_mode", adam_w_mode, "zero8's LAMB decouples weight decay as the paper does")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction, max_trust_ratio=max_trust_ratio,
                                      min_trust_ratio=min_trust_ratio),
                         optim_bits=optim_bits, args=args, min_8bit_size=min_8bit_size,
                         percentile_clipping=percentile_clipping, block_wise=block_wise, is_paged=is_paged,
                         block_size=block_size, max_unorm=max_unorm,
                         master_weights=master_weights)

    def _hyper(self, c):
        b1, b2 = c["betas"][:2]
        return _C.Hyper(lr=_num(c["lr"], "lr"), beta1=_num(b1, "betas[0]"), beta2=_num(b2, "betas[1]"),
                        eps=_num(c["eps"], "eps"), weight_decay=_num(c["weight_decay"], "weight_decay"),
                        bias_correction=bool(c["bias_correction"]),
                        max_trust_ratio=_num(c["max_trust_ratio"], "max_trust_ratio"),
                        min_trust_ratio=_num(c.get("min_trust_ratio", 0.0), "min_trust_ratio"))


LAMB8bit = fixed_bits(LAMB, 8, "LAMB8bit", "LAMB with 8-bit block-wise states (bitsandbytes' LAMB8bit).")
LAMB32bit = fixed_bits(LAMB, 32, "LAMB32bit", "LAMB with float32 states (bitsandbytes' LAMB32bit).")
