"""DeepSpeed JSON configs on the Python side: a path, a dict or JSON text goes to the C++ parser
(``_C.Config``), which validates it (errors name the JSON key path) and returns the typed config, every
value resolved (``cfg.typed.zero.stage``, ``cfg.typed.zero8.optim_bits``), and its normalized JSON. Python
only loads the text and reports the parser's warnings (unknown top-level keys and the like) once, from
rank 0. The keys are documented in docs/CONFIG.md.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

from . import _C
from ._C import Zero8ValueError

__all__ = ["Zero8Config", "Zero8ConfigWarning", "load_config", "config_source_text"]


class Zero8ConfigWarning(UserWarning):
    """A config key zero8 ignores (an unknown top-level key, or a DeepSpeed feature without effect here)."""


@dataclass
class Zero8Config:
    """A parsed, validated and normalized DeepSpeed config for a data-parallel size.

    ``typed``: the C++ parse itself (``_C.Config``, read-only): its sections as attributes with every
    value resolved and typed (``typed.batch.gradient_accumulation_steps``, ``typed.fp16.enabled``,
    ``typed.checkpoint.tag_validation``, ...), what code should read; ``json``: the normalized JSON text
    (what checkpoints store and ``_C`` calls take); ``dict``: the same as a dict (DeepSpeed's
    ``engine.config``); ``warnings``: the parser's messages ("<source>: <key path>: ..."); ``info``:
    ``_C.config_info`` (optimizer name, algorithm, state bits, working dtype, zero8 on/off).
    """

    json: str
    dict: dict
    warnings: list[str]
    source: str
    world_size: int
    info: dict = field(default_factory=dict)
    typed: Any = None  # _C.Config

    # The values the engine reads most, by DeepSpeed's accessor names.
    def train_batch_size(self) -> int:
        return int(self.dict["train_batch_size"])

    def train_micro_batch_size_per_gpu(self) -> int:
        return int(self.dict["train_micro_batch_size_per_gpu"])

    def gradient_accumulation_steps(self) -> int:
        return int(self.dict["gradient_accumulation_steps"])

    def section(self, name: str) -> dict:
        """A normalized section ({} when the config has none, e.g. no scheduler)."""
        value = self.dict.get(name)
        return value if isinstance(value, dict) else {}


def _non_json_path(value: Any, path: str = "") -> str:
    """The key path of the first value json.dumps(allow_nan=False) refuses (NaN, inf, a tensor...)."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            found = _non_json_path(v, f"{path}.{k}" if path else str(k))
            if found:
                return found
        return ""
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = _non_json_path(v, f"{path}[{i}]")
            if found:
                return found
        return ""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return path
    return ""


# steps_per_print = float("inf") (Hugging Face Accelerate writes it, to stop DeepSpeed's reports, which it
# never makes: a step count modulo infinity is never 0) has no JSON form: it is read as the largest period
# the parser takes, which no run reaches.
STEPS_PER_PRINT_NEVER = 2**63 - 1


def config_source_text(config: Any) -> tuple[str | None, str | None, str]:
    """(json_text, path, source_name) of a config given as a dict, a path (str or os.PathLike) or JSON
    text (a str starting with '{'). Exactly one of json_text and path is set."""
    if isinstance(config, Mapping):
        every = config.get("steps_per_print")
        if isinstance(every, float) and every == math.inf:
            config = {**config, "steps_per_print": STEPS_PER_PRINT_NEVER}
        try:
            return json.dumps(config, allow_nan=False), None, "<config dict>"
        except (TypeError, ValueError) as e:
            where = _non_json_path(config)
            raise Zero8ValueError(f"<config dict>: {where + ': ' if where else ''}not JSON-serializable: {e}") from None
    if isinstance(config, os.PathLike):
        config = os.fspath(config)
    if isinstance(config, bytes):
        config = config.decode()
    if isinstance(config, str):
        if config.lstrip().startswith(("{", "[")):  # JSON text; the parser says when it is not an object
            return config, None, "<config text>"
        return None, config, config
    raise TypeError(
        f"config must be a dict, a path to a DeepSpeed JSON file or JSON text, got {type(config).__name__}"
    )


def load_config(config: Any, world_size: int = 1, *, rank: int = 0, warn: bool = True) -> Zero8Config:
    """Parse and validate a DeepSpeed config for a data-parallel size ``world_size``.

    ``config``: a dict, a path, or JSON text. Wrong types or values raise ``zero8.Zero8ValueError``
    (a ``ValueError``) whose message starts with "<source>: <key path>: "; a DeepSpeed feature zero8
    does not implement raises ``zero8.Zero8NotSupportedError``; an unreadable file ``zero8.Zero8IOError``.
    Unknown keys only warn: with ``warn`` and ``rank == 0`` each warning is issued once as a
    ``Zero8ConfigWarning`` (Python's warnings machinery prints it to stderr), so an N-rank job prints it once.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise Zero8ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    text, path, source = config_source_text(config)
    typed = _C.Config.from_file(path, world_size) if path is not None else _C.Config(text, world_size, source)
    normalized = typed.to_json()
    msgs = list(typed.warnings)
    if warn and rank == 0:
        for m in msgs:
            warnings.warn(m, Zero8ConfigWarning, stacklevel=2)
    return Zero8Config(json=normalized, dict=json.loads(normalized), warnings=msgs, source=source,
                       world_size=world_size, info=dict(_C.config_info(typed)), typed=typed)


def raw_value(config: Any, *keys: str, default: Any = None) -> Any:
    """A key of the config as the user wrote it, read before the config can be parsed (the
    communication backend decides the world size the parse needs). Comments are allowed, as in the
    parser; when the config cannot be read the default is returned, and the parse reports why."""
    try:
        text, path, source = config_source_text(config)
        if path is not None:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        value: Any = json.loads(_C.config_plain_json(text, source))
    except (OSError, ValueError, TypeError, UnicodeDecodeError):
        return default
    for k in keys:
        if not isinstance(value, dict) or k not in value:
            return default
        value = value[k]
    return value
