"""zero8: ZeRO-sharded 8-bit block-wise optimizers with int8 communication, over PyTorch.

    import zero8
    opt = zero8.optim.AdamW8bit(model.parameters(), lr=1e-3)           # bitsandbytes' names
    engine, optimizer, _, lr_scheduler = zero8.initialize(model=model,   # DeepSpeed's names
                                                          model_parameters=model.parameters(),
                                                          config="ds_config.json")

Submodules: ``functional`` (block-wise quantization), ``optim``, ``nn``, ``engine``, ``pipe`` (pipeline models), ``config``,
``lr_schedules``, ``utils`` (``zero8.utils.zero_to_fp32``: DeepSpeed's consolidated-weights functions); they
are imported on first use. The ranks' communicator is ``zero8.init_distributed()`` (the engine's).
Errors from the C++ library are ``Zero8Error`` subclasses that are also the builtin exception for their
kind (``Zero8ValueError`` is a ``ValueError``, ``Zero8IOError`` an ``OSError``...); ``.code`` names the
kind (``"invalid_argument"``, ``"io"``, ...), on errors zero8's Python modules raise too.
"""

from __future__ import annotations

import importlib as _importlib

from . import _C
from ._C import (
    Zero8CommError,
    Zero8Error,
    Zero8InternalError,
    Zero8IOError,
    Zero8NotSupportedError,
    Zero8ValueError,
)

__version__ = _C.version()

# Imported on first attribute access (zero8.optim...). A name whose module is not installed raises
# AttributeError, so hasattr() works.
_SUBMODULES = ("functional", "optim", "nn", "engine", "pipe", "config", "lr_schedules", "utils")
# DeepSpeed's top-level names, from zero8.engine on first access.
_ENGINE_NAMES = ("initialize", "add_config_arguments", "init_distributed")

# What `from zero8 import *` gives: names that always exist (submodules are imported by name).
__all__ = [
    "__version__",
    "build_info",
    "Zero8Error",
    "Zero8ValueError",
    "Zero8NotSupportedError",
    "Zero8IOError",
    "Zero8CommError",
    "Zero8InternalError",
]


def build_info() -> dict:
    """What the compiled library contains: dict(cuda, nccl, mpi, x86_simd, isa, version)."""
    info = dict(_C.build_info())
    info["isa"] = _C.isa_active().name
    info["version"] = __version__
    return info


def _submodule(name: str):
    try:
        return _importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise  # a dependency of the submodule is missing: show that
        raise AttributeError(f"module 'zero8' has no attribute '{name}' (zero8.{name} is not installed)") from e


def __getattr__(name: str):
    # Lazy submodules (torch-heavy parts load on first use), and DeepSpeed's names from zero8.engine.
    if name in _SUBMODULES:
        module = _submodule(name)
        globals()[name] = module
        return module
    if name in _ENGINE_NAMES:
        value = getattr(_submodule("engine"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'zero8' has no attribute '{name}'")


def __dir__():
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES) | set(_ENGINE_NAMES))
