"""Embeddings whose weight keeps 32-bit optimizer states under zero8's 8-bit optimizers (bitsandbytes'
``StableEmbedding`` and ``Embedding``): Dettmers et al. 2022, "8-bit Optimizers via Block-wise
Quantization", Section 2.3: xavier-uniform init plus a layer norm after the lookup, and 32-bit states for
the embedding, keep training stable where token frequencies make gradients very non-uniform.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..optim.optimizer import GlobalOptimManager

__all__ = ["StableEmbedding", "Embedding"]


def _register_fp32_state(module: torch.nn.Module) -> None:
    # A module override (not one on the tensor): it follows whatever module.weight is when the optimizer
    # creates the state, and is held weakly, so the module can be freed.
    GlobalOptimManager.get_instance().register_module_override(module, "weight", {"optim_bits": 32})


class StableEmbedding(torch.nn.Embedding):
    """``torch.nn.Embedding`` with bitsandbytes' StableEmbedding semantics:

    - the weight is initialised xavier-uniform (``U(-a, a)``, ``a = sqrt(6 / (num_embeddings +
      embedding_dim))``), with the ``padding_idx`` row zeroed;
    - the looked-up vectors go through ``self.norm``, a ``LayerNorm(embedding_dim)`` computed in the default
      dtype (float32) and cast back to the weight's dtype;
    - the weight is registered with ``zero8.optim.GlobalOptimManager`` for ``optim_bits=32``: every zero8
      optimizer (and the sharded engine, via ``zero8.optim.wants_fp32_state``) keeps float32 states for it,
      whatever its own ``optim_bits``. The registration follows ``module.weight`` by attribute, so
      replacing the weight tensor keeps it.

    Arguments are ``torch.nn.Embedding``'s. ``sparse=True`` makes sparse gradients, which zero8's optimizers
    reject.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 max_norm: Optional[float] = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, _weight: Optional[Tensor] = None, device=None, dtype=None) -> None:
        super().__init__(num_embeddings, embedding_dim, padding_idx, max_norm, norm_type, scale_grad_by_freq,
                         sparse, _weight, device=device, dtype=dtype)
        self.norm = torch.nn.LayerNorm(embedding_dim, device=device)
        _register_fp32_state(self)

    def reset_parameters(self) -> None:
        torch.nn.init.xavier_uniform_(self.weight)
        self._fill_padding_idx_with_zero()

    def forward(self, input: Tensor) -> Tensor:
        emb = F.embedding(input, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                          self.scale_grad_by_freq, self.sparse)
        # The layer norm in full precision, also for a 16-bit weight, and also after model.to(bfloat16) has
        # cast the norm's own affine parameters (CPU layer_norm refuses mixed input/parameter dtypes).
        emb = emb.to(torch.get_default_dtype())
        norm = self.norm
        weight = None if norm.weight is None else norm.weight.to(emb.dtype)
        bias = None if norm.bias is None else norm.bias.to(emb.dtype)
        return F.layer_norm(emb, norm.normalized_shape, weight, bias, norm.eps).to(self.weight.dtype)


class Embedding(torch.nn.Embedding):
    """``torch.nn.Embedding`` (its init and forward unchanged) whose weight keeps float32 optimizer states
    under zero8's optimizers, as bitsandbytes' ``nn.Embedding``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 max_norm: Optional[float] = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, _weight: Optional[Tensor] = None, device=None, dtype=None) -> None:
        super().__init__(num_embeddings, embedding_dim, padding_idx, max_norm, norm_type, scale_grad_by_freq,
                         sparse, _weight, device=device, dtype=dtype)
        _register_fp32_state(self)
