"""The one way zero8 reads a ``torch.save`` file it did not just write (a checkpoint's model-states file, a
DeepSpeed checkpoint's files): ``torch.load(weights_only=True)`` unless the caller opted in to full unpickling,
because unpickling runs whatever code the file names, and a checkpoint's checksums only catch accidents, not
a forged directory. A refused file is an error that names the file, the object and the option that allows it.
"""

from __future__ import annotations

import os
import pickle
import re
from typing import Any, Iterable

import torch

from ._C import Zero8ValueError

# torch's weights-only unpickler names what it refused: "Unsupported global: GLOBAL module.Class was not an
# allowed global by default", or "Unsupported operand ..." for pickle opcodes it never runs.
_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def refused_object(error: BaseException) -> str:
    """What torch's weights-only unpickler refused, as it says it: "the class mymod.Note" or its first line."""
    text = str(error)
    m = _REFUSED_GLOBAL.search(text)
    if m is not None:
        return f"the object {m.group(1)}"
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return f"something only a full unpickling rebuilds ({first[:200]})"


def torch_load(path: str, *, allow_pickle: bool, option: str, allowed: Iterable[Any] = (), mmap: bool = False) -> Any:
    """``torch.load(path, map_location="cpu")``: tensors and plain values only (weights_only=True, with the
    classes in `allowed` too), unless `allow_pickle`, which unpickles anything (and may run code from the file).
    `option` says how the caller allows it ("load_checkpoint(allow_pickle=True)"), for the error. Other errors
    (a missing or damaged file) propagate as torch raises them."""
    if allow_pickle:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise Zero8ValueError(
            f"{path}: holds {refused_object(e)}, which only a full unpickling can rebuild, and unpickling can run "
            f"code from the file; zero8 reads only tensors and plain values from it unless allowed: {option}, for a "
            f"file from a source you trust") from None


def torch_save_atomic(obj: Any, path: str) -> None:
    """torch.save of obj to path, whole or not at all: written to a temporary file beside it, synced, then
    renamed into place; the temporary file is removed on any error."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
