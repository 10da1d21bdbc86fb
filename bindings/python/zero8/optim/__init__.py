"""zero8.optim: drop-in replacements for bitsandbytes' optimizers (same class names and arguments), as
``torch.optim.Optimizer`` subclasses over zero8's fused 8-bit block-wise kernels::

    opt = zero8.optim.AdamW8bit(model.parameters(), lr=1e-3)   # was: bnb.optim.AdamW8bit(...)
    opt.override_config(model.lm_head.weight, optim_bits=32)     # 32-bit states for one tensor

Each algorithm of the table (``_C.algo_table()``) comes as ``X`` (``optim_bits=32`` by default, 8 on
request), ``X8bit`` and ``X32bit``: Adam, AdamW, SGD, Lion, RMSprop, Adagrad, LAMB, LARS; a row without a
module here gets generated classes. Per-parameter settings: ``override_config`` on an
optimizer, or ``GlobalOptimManager`` for all of them (bitsandbytes' API; ``zero8.nn.StableEmbedding``
registers its weight there for 32-bit states). State dicts load bitsandbytes' and torch.optim's.
"""

from __future__ import annotations

from .adagrad import Adagrad, Adagrad8bit, Adagrad32bit
from .adam import Adam, Adam8bit, Adam32bit
from .adamw import AdamW, AdamW8bit, AdamW32bit
from .lamb import LAMB, LAMB8bit, LAMB32bit
from .lars import LARS, LARS8bit, LARS32bit
from .lion import Lion, Lion8bit, Lion32bit
from . import _algos
from .optimizer import (
    GlobalOptimManager,
    Optimizer8bit,
    Zero8UnsupportedArgumentError,
    param_config,
    table_classes,
    wants_fp32_state,
)
from .rmsprop import RMSprop, RMSprop8bit, RMSprop32bit
from .sgd import SGD, SGD8bit, SGD32bit

__all__ = [
    "Adam", "Adam8bit", "Adam32bit",
    "AdamW", "AdamW8bit", "AdamW32bit",
    "SGD", "SGD8bit", "SGD32bit",
    "Lion", "Lion8bit", "Lion32bit",
    "RMSprop", "RMSprop8bit", "RMSprop32bit",
    "Adagrad", "Adagrad8bit", "Adagrad32bit",
    "LAMB", "LAMB8bit", "LAMB32bit",
    "LARS", "LARS8bit", "LARS32bit",
    "GlobalOptimManager",
    "Optimizer8bit",
    "Zero8UnsupportedArgumentError",
    "param_config",
    "wants_fp32_state",
]



def _add_table_classes() -> None:
    """The thin classes of the table rows no module above writes out."""
    for row in _algos.rows():
        if row.class_name not in globals():
            for cls in table_classes(row.name, __name__):
                globals()[cls.__name__] = cls
                __all__.append(cls.__name__)


_add_table_classes()
