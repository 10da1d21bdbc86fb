"""Adam with 8-bit or 32-bit states (torch.optim.Adam's update; bitsandbytes' Adam / Adam8bit / Adam32bit
names and arguments): Kingma & Ba 2015, weight decay as an L2 term added to the gradient.
"""

from __future__ import annotations

from .. import _C
from .optimizer import Optimizer8bit, _num, _unsupported, fixed_bits

__all__ = ["Adam", "Adam8bit", "Adam32bit"]


class Adam(Optimizer8bit):
    """Adam over zero8's fused kernel: ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``,
    ``p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)`` (torch.optim.Adam), computed in Kingma & Ba's
    equivalent epsilon-hat form (one division per element: the result differs from torch's by float32
    rounding only). ``weight_decay`` adds ``wd * p`` to the gradient as torch.optim.Adam does (bitsandbytes'
    Adam decouples it instead, like AdamW: use AdamW for that).

    ``optim_bits`` (8 or 32) picks the state format; see ``Optimizer8bit`` for ``min_8bit_size``,
    ``block_size``, ``args`` and per-parameter overrides. ``amsgrad``, ``percentile_clipping`` != 100 and
    ``is_paged`` are bitsandbytes arguments zero8 rejects (Zero8UnsupportedArgumentError).
    """

    algo = _C.Algo.adam
    _GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")
    _TORCH_STATE_KEYS = ("exp_avg", "exp_avg_sq")
    _BNB_ONLY_KEYS = ("alpha", "t_alpha", "t_beta3")  # bitsandbytes' AdEMAMix knobs in every 2-state group

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, *,
                 optim_bits=32, args=None, min_8bit_size=4096, percentile_clipping=100, block_wise=True,
                 is_paged=False, block_size=256):
        if amsgrad:
            _unsupported("amsgrad", amsgrad, "zero8 keeps no running maximum of the second moment")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay),
                         optim_bits=optim_bits, args=args, min_8bit_size=min_8bit_size,
                         percentile_clipping=percentile_clipping, block_wise=block_wise, is_paged=is_paged,
                         block_size=block_size)

    def _check_saved_group(self, saved, index):
        super()._check_saved_group(saved, index)
        # torch.optim.Adam/AdamW record which weight decay they applied.
        decoupled = saved.get("decoupled_weight_decay")
        if decoupled is not None and bool(decoupled) != (self.algo == _C.Algo.adamw) \
                and _num(saved.get("weight_decay", 0), "weight_decay") != 0:
            _unsupported(f"decoupled_weight_decay (saved param_groups[{index}])", decoupled,
                         f"{type(self).__name__} applies {'decoupled' if self.algo == _C.Algo.adamw else 'L2'} "
                         f"weight decay; load this state into {'Adam' if decoupled is False else 'AdamW'} instead")

    def _hyper(self, c):
        b1, b2 = c["betas"][:2]
        return _C.Hyper(lr=_num(c["lr"], "lr"), beta1=_num(b1, "betas[0]"), beta2=_num(b2, "betas[1]"),
                        eps=_num(c["eps"], "eps"), weight_decay=_num(c["weight_decay"], "weight_decay"),
                        bias_correction=True)


Adam8bit = fixed_bits(Adam, 8, "Adam8bit", "Adam with 8-bit block-wise states (bitsandbytes' Adam8bit).")
Adam32bit = fixed_bits(Adam, 32, "Adam32bit", "Adam with float32 states (bitsandbytes' Adam32bit).")
