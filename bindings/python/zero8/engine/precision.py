"""The module's cast for fp16 / bf16 training, as DeepSpeed 0.19.8's engine makes it (its
``_cast_module_mixed_precision`` and ``runtime/keep_in_fp32.py``): the parameters to the training dtype; the
buffers (a rotary ``inv_freq``, BatchNorm's running statistics) keep their dtype unless
``data_types.buffer_dtype`` names one, and those ``data_types.keep_in_fp32_modules`` names stay, or become, fp32.
"""

from __future__ import annotations

import re

import torch

# What DeepSpeed's cast converts (its CASTABLE_DTYPES): integer, bool and complex tensors keep their dtype.
_CASTABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def keep_in_fp32_pattern(module: torch.nn.Module, setting, dtype: torch.dtype):
    """The compiled pattern of the buffer names of ``module`` to keep in fp32 when training in ``dtype``, or
    None when there are none (fp32 training keeps everything). ``setting`` "auto": the transformers lists of
    every submodule (``_keep_in_fp32_modules_strict``, and under fp16 ``_keep_in_fp32_modules`` too), each name
    under its submodule's prefix; a list: its patterns, ``*`` standing for any characters, matched anywhere in
    a buffer's full name (transformers' rule)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    if setting is None or setting == "auto":
        patterns = set()
        for module_name, child in module.named_modules():
            names = set(getattr(child, "_keep_in_fp32_modules_strict", None) or [])
            if dtype == torch.float16:
                names |= set(getattr(child, "_keep_in_fp32_modules", None) or [])
            for name in names:
                pattern = name.replace("*", ".*")
                patterns.add(rf"^{re.escape(module_name)}\..*{pattern}" if module_name else pattern)
    else:
        patterns = {name.replace("*", ".*") for name in setting}
    return re.compile("|".join(sorted(patterns))) if patterns else None


def _buffers_matching(module: torch.nn.Module, pattern) -> list[torch.Tensor]:
    """The floating buffers of ``module`` whose full names match ``pattern``."""
    found = []
    for module_name, owner in module.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, buf in owner.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point() and pattern.search(prefix + name):
                found.append(buf)
    return found


def cast_module(module: torch.nn.Module, dtype: torch.dtype, buffer_dtype: torch.dtype | None = None,
                keep_in_fp32_modules="auto") -> None:
    """Cast ``module`` for training in ``dtype`` (float16 or bfloat16) in place, as DeepSpeed's engine: every
    floating parameter to ``dtype``; the buffers ``keep_in_fp32_modules`` names (keep_in_fp32_pattern) to
    fp32; the other floating buffers to ``buffer_dtype``, or left as they are when it is None."""
    for p in module.parameters():
        if p.dtype in _CASTABLE and p.dtype != dtype:
            p.data = p.data.to(dtype)
    kept = set()
    pattern = keep_in_fp32_pattern(module, keep_in_fp32_modules, dtype)
    if pattern is not None:
        for buf in _buffers_matching(module, pattern):
            kept.add(id(buf))
            if buf.dtype != torch.float32:  # a listed buffer that arrived in a lower precision
                buf.data = buf.data.float()
    if buffer_dtype is not None:
        for buf in module.buffers():
            if id(buf) not in kept and buf.dtype in _CASTABLE and buf.dtype != buffer_dtype:
                buf.data = buf.data.to(buffer_dtype)
