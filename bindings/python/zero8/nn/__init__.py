"""zero8.nn: modules that work with zero8's optimizers (bitsandbytes' ``nn`` names).

- ``StableEmbedding``: xavier-uniform init, LayerNorm after the lookup, 32-bit optimizer states.
- ``Embedding``: torch's Embedding with 32-bit optimizer states.
"""

from __future__ import annotations

from .stable_embedding import Embedding, StableEmbedding

__all__ = ["StableEmbedding", "Embedding"]
from .linear8bit import Linear8bitLt, bnb_state_dict, convert_linear8bit  # noqa: E402  (int8 layers)
from .int8_linear import Int8Linear  # noqa: E402
__all__ += ["Linear8bitLt", "bnb_state_dict", "convert_linear8bit", "Int8Linear"]
