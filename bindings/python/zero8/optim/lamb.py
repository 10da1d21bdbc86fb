"""LAMB with 8-bit or 32-bit states (bitsandbytes' LAMB / LAMB8bit / LAMB32bit names and arguments):
You et al. 2020, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes", Algorithm 2.
"""

from __future__ import annotations

from .optimizer import Optimizer8bit, fixed_bits

__all__ = ["LAMB", "LAMB8bit", "LAMB32bit"]


class LAMB(Optimizer8bit, algo="lamb"):
    """LAMB: Adam's moments, ``u = m_hat / (sqrt(v_hat) + eps) + wd p``, ``p -= lr * r * u`` with the
    per-tensor trust ratio ``r = ||p|| / ||u||`` (1 when either norm is 0), clipped at ``max_trust_ratio``
    (default 10; 0: no clip) and raised to ``min_trust_ratio`` (default 0: none; DeepSpeed's Lamb uses
    ``min_coeff=0.01``). Both phases (norms, then the update) run in one ``_C.step_tensor`` call.

    bitsandbytes' ``max_unorm`` (its approximation of the trust ratio by update-norm clipping) is accepted
    and ignored with a warning when not its default; ``adam_w_mode=False`` and ``amsgrad=True`` are
    rejected (the paper's decay is decoupled).
    ``master_weights=False`` keeps no float32 master of bfloat16/float16 parameters (see ``Optimizer8bit``).
    """


LAMB8bit = fixed_bits(LAMB, 8, "LAMB8bit", "LAMB with 8-bit block-wise states (bitsandbytes' LAMB8bit).")
LAMB32bit = fixed_bits(LAMB, 32, "LAMB32bit", "LAMB with float32 states (bitsandbytes' LAMB32bit).")
