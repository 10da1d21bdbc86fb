"""How the engine reads its config: the C++ parse's typed view (``zero8.config.Zero8Config.typed``, a
``_C.Config``: ``cfg.zero.stage``, ``cfg.zero8.optim_bits``, ``cfg.fp16.auto_cast``...) wherever it can,
and the config as written only for the values needed before the parse, or that the parser accepts
without modelling them.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .._tensors import torch_dtype
from ..config import raw_value

# The environment variable that sets every communicator's timeout (comm/), over the config's.
COMM_TIMEOUT_ENV = "ZERO8_COMM_TIMEOUT"


def working_dtype(cfg) -> torch.dtype:
    """The dtype of the engine's working copy of the weights: float16, bfloat16 or float32."""
    return torch_dtype(cfg.working_dtype)


def buffer_dtype(cfg) -> torch.dtype | None:
    """data_types.buffer_dtype: the dtype the engine casts the module's floating buffers to under fp16/bf16;
    None: they keep theirs (precision.py)."""
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}.get(cfg.data_types.buffer_dtype.name)


def comm_timeout_s(cfg) -> float | None:
    """zero8.comm_timeout_s for the engine's communicator, None when ZERO8_COMM_TIMEOUT is set (it wins)."""
    if os.environ.get(COMM_TIMEOUT_ENV) is not None:
        return None
    return float(cfg.zero8.comm_timeout_s)


def requested_backend(config: Any) -> str:
    """zero8.comm_backend as written: read before the parse, which needs the data-parallel size that the
    backend decides (device.comm_backend checks it against the model's device); a value that is not a
    string is left to the parser's error."""
    backend = raw_value(config, "zero8", "comm_backend", default="auto")
    return backend if isinstance(backend, str) else "auto"


def requested_timeout(config: Any) -> float | None:
    """zero8.comm_timeout_s as written, for the rendezvous of a world made before the parse (under torchrun);
    None where ZERO8_COMM_TIMEOUT is set (it wins) or the value is not a positive number (the parser names
    it later)."""
    if os.environ.get(COMM_TIMEOUT_ENV) is not None:
        return None
    value = raw_value(config, "zero8", "comm_timeout_s", default=None)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        return None
    return float(value)


def dataloader_drop_last(config: Any) -> bool:
    """DeepSpeed's dataloader_drop_last as written: the C++ parser accepts the key without modelling it
    (it is no business of the optimizer), so the typed view has no field for it."""
    return bool(raw_value(config, "dataloader_drop_last", default=False))
