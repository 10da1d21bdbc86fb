"""The base of zero8's drop-in optimizers (bitsandbytes' ``Optimizer8bit`` API): a real
``torch.optim.Optimizer`` whose step runs zero8's fused kernel (``_C.step_tensor``: dequantize -> update ->
requantize per block, GIL released) on each parameter, with its states as torch tensors in ``self.state``,
per-parameter overrides (``GlobalOptimManager``, ``override_config``), and state dicts that load
bitsandbytes' and torch.optim's formats.

State of one parameter ``p`` (the keys of bitsandbytes' optimizers, so state dicts interchange):

- ``step``: int, the number of steps taken.
- 8-bit: ``state1`` (uint8 codes, ``p.shape``), ``absmax1`` (float32, one scale per block of
  ``block_size`` = 256 elements in flat order; negative when the block's extreme element is negative, see
  ``zero8.functional``), ``qmap1`` (the 256-value dynamic signed map); 2-state algorithms also
  ``state2``/``absmax2``/``qmap2`` (dynamic unsigned map).
- 32-bit: ``state1`` (and ``state2``) float32 of ``p.shape``.
- bfloat16/float16 parameters: ``master``, the float32 master copy the update is applied to (the
  parameter is its rounding), as a mixed-precision optimizer must keep, 4 bytes per parameter on top of
  the states (8-bit AdamW: 6.03 bytes per parameter instead of 2.03). ``master_weights=False`` keeps none,
  as bitsandbytes: each step then widens the 16-bit parameter into a temporary float32 buffer, runs the
  same kernel with it as the master and writes the rounded result to the parameter, so an update smaller
  than half a 16-bit ulp is lost (rounded away) at every step. With a master, the parameter stays the truth:
  an element changed outside the optimizer since its last step (``model.load_state_dict``, a rollback,
  an EMA swap, clamping, re-initialisation, ``p.data.zero_()``, ``p.data = t``) is no longer the
  rounding of its master, and the next step re-seeds that element's master from the parameter, keeping
  the edit as torch.optim does; untouched elements keep their float32 master bits. Detection, against
  the parameter as each step left it: torch's version counter and the data pointer (they catch every
  edit made through the parameter itself, and rebinding ``.data``) and its bits, for in-place edits
  through ``p.data``, which torch does not version: all of them for a parameter of up to 64 KiB, else
  about 1000 evenly spaced elements, so such an edit of only a few elements of a larger parameter can
  go unseen (edit under ``torch.no_grad()`` instead; on a GPU the bits are not compared at all, since
  reading them would make every step wait for the GPU). ``load_state_dict`` restores the saved masters
  and holds to the same rule: the next step compares every element of each parameter with the rounding
  of its loaded master (all elements, once) and re-seeds those that differ. So weights loaded into the
  model before or after the optimizer's state (EMA or averaged weights) are where training goes on from,
  as in torch and bitsandbytes, and weights restored from the same checkpoint, being the masters'
  rounding, keep the exact float32 masters.

Non-finite gradients: a NaN or Inf gradient element makes its parameter element NaN or Inf, as in
torch, in every optimizer (Lion too: the sign of NaN is NaN here, where torch.sign's 0 would stop the
element without a word; an Inf moves a Lion parameter by ``lr``), and no other element. 32-bit states
keep the NaN or Inf, as torch's do. An 8-bit state block cannot hold one (its scale would turn NaN, and
with it all ``block_size`` elements of the block at the next step), so a non-finite 8-bit state is
stored as 0 and the rest of its block trains on. LAMB and LARS compute a per-tensor trust ratio: a NaN
norm makes it 1 for that tensor, an infinite update norm 0 for that step (as timm's). Skip such steps:
``torch.amp.GradScaler`` does (its ``step`` calls no ``optimizer.step()`` when the unscaled gradients
hold an Inf or NaN), as zero8's engine does in every precision; or check the gradients before stepping
(``torch.nn.utils.clip_grad_norm_(..., error_if_nonfinite=True)``). docs/ARCHITECTURE.md, "Non-finite
gradients in the optimizers", has the details.

Devices: CPU parameters, or CUDA parameters in a build with zero8's CUDA kernels (``zero8.build_info()``).
The states live on the parameter's device (``load_state_dict`` places them there, as torch.optim does, so
a state dict saved on a GPU loads on the CPU and back), and a CUDA step runs the same fused kernel, with
the same bits, on torch's current stream without waiting for the GPU (LAMB and LARS included). DTensor
parameters (FSDP2's ``fully_shard``, tensor parallelism) step shard by shard, their states DTensors laid out
so that torch.distributed.checkpoint reshards them (``zero8/optim/dtensor.py``, docs/FSDP2.md).

What a step checks: a parameter's first step checks it, its gradient and its states in full and keeps
the kernel's arguments (a ``_Plan``). Its later steps check the gradient (dense, contiguous, on the
parameter's device, of its shape and a float dtype) and that the parameter's storage, dtype and size and
its state tensors are still those the plan was made from; anything else (a rebound ``p.data``, a
strided or resized parameter, replaced or loaded states, a bad gradient) takes the full checks again,
which name what is wrong. For a model of many small tensors that halves the Python time per tensor.

torch.compile and CUDA graphs: ``step()`` (and ``state_dict``, ``load_state_dict``, ``add_param_group``, as
torch.optim marks its own) is kept out of dynamo's graphs (``torch._disable_dynamo``): a compiled training step
that calls it, or ``torch.compile(opt.step)``, runs the step eagerly between graphs, with the eager bits. It
cannot be captured in a CUDA graph: the step count and learning rate are host values passed to the kernel as
arguments, so every replay would repeat the captured step's bias correction and learning rate while
``state["step"]`` stayed put, and a parameter's first step copies tables to the GPU and waits, which capture
forbids. As torch.optim's optimizers do without ``capturable=True``, ``step()`` refuses to run during capture
(Zero8NotSupportedError, a RuntimeError): capture the forward and backward only and step outside the graph. The
constructors take no ``capturable`` argument (a TypeError says why), and a loaded torch.optim group's
``capturable`` key is dropped with its other implementation flags (``foreach``, ``fused``...).

Whether a parameter gets 8-bit states is decided once, at its first step, on the WHOLE parameter:
8-bit when its config says ``optim_bits=8`` and ``p.numel() >= min_8bit_size``; whether a 16-bit one
gets a master too (its config's ``master_weights``).
"""

from __future__ import annotations

import copy
import ctypes
import functools
import inspect
import math
import numbers
import sys
import warnings
import weakref
from collections import defaultdict
from itertools import chain
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .. import _C
from .._C import Zero8NotSupportedError, Zero8ValueError
from .._tensors import (FLOAT_DTYPES, check_device, check_same_device, cuda_stream, dtype_code, float_code,
                        is_dtensor, on_device)
from . import _algos
from . import dtensor as _dt
from .partition import PartitionedStates, caller_stacklevel, whole_numel

__all__ = [
    "GlobalOptimManager",
    "Optimizer8bit",
    "Zero8UnsupportedArgumentError",
    "param_config",
    "table_classes",
    "wants_fp32_state",
]

BNB_BLOCK_SIZE = 256  # bitsandbytes' 8-bit optimizers: fixed state block (optimizer.py, init_state)
_BNB_WRAPPER_KEY = "__bnb_optimizer_quant_state__"  # bitsandbytes >= 0.45 nests the quantization tensors here
_F32_ULP = 2.0**-23
_SYNC_WHOLE_BYTES = 1 << 16  # a 16-bit parameter up to this size is compared whole at each step, ...
_SYNC_SAMPLE = 1024  # ... a larger one at every (n // _SYNC_SAMPLE | 1)-th element

_SIGNED = _C.MapKind.dynamic_signed
_UNSIGNED = _C.MapKind.dynamic_unsigned
_maps: Dict[tuple, torch.Tensor] = {}


def _map(kind, device=None) -> torch.Tensor:
    """The shared 256-value float32 map tensor of a MapKind on `device` (default: the CPU; one tensor per
    device for every parameter's qmap, which lives with its parameter as bitsandbytes' does)."""
    device = torch.device("cpu") if device is None else torch.device(device)
    key = (int(kind), str(device))
    t = _maps.get(key)
    if t is None:
        t = torch.tensor(_C.map_values(kind), dtype=torch.float32, device=device)
        _maps[key] = t
    return t


def _snapshot(p: torch.Tensor) -> bytes:
    """The bits of contiguous 16-bit CPU parameter p: all its bytes if it is small, else its elements at an
    odd stride (not to follow the columns of a row-major matrix), about 1000 of them. Read by ctypes, not
    torch ops: with their dispatch (and, it seems, torch's threads competing with the step kernel's) a
    torch-op sample made the step of a 262144-element parameter 20% slower; this one, 3-8%."""
    n = p.numel()
    if 2 * n <= _SYNC_WHOLE_BYTES:
        return ctypes.string_at(p.data_ptr(), 2 * n)
    elements = memoryview((ctypes.c_uint16 * n).from_address(p.data_ptr())).cast("B").cast("H")
    return elements[::(n // _SYNC_SAMPLE) | 1].tobytes()


def _synced(p: torch.Tensor, master: torch.Tensor, bits: torch.Tensor) -> tuple:
    """The record of 16-bit p as the optimizer leaves it, its master current (bits: p itself, or its
    contiguous copy when p is a strided view). A GPU parameter's bits are not sampled: reading them would
    make the host wait for the step (see _step_param)."""
    return (p._version, p.data_ptr(), master, _snapshot(bits) if bits.device.type == "cpu" else None)


def _reseed_master(p: torch.Tensor, master: torch.Tensor) -> None:
    """Re-seed from 16-bit p the elements of its master that p is not the rounding of (kept: the others,
    with their float32 bits)."""
    pv, mv = p.detach().reshape(-1), master.view(-1)
    rounded = mv.to(p.dtype)
    keep = (rounded == pv) | (rounded.isnan() & pv.isnan())
    # On a GPU every element goes through the select (no host read of keep.all(), a wait for the GPU).
    if p.device.type != "cpu" or not bool(keep.all()):
        mv.copy_(torch.where(keep, mv, pv.to(torch.float32)))


_STATE_TENSORS = ("state1", "state2", "absmax1", "absmax2", "master")


def _on_cuda(p: torch.Tensor) -> bool:
    """Whether parameter p (a DTensor too) lives on a GPU, for the refusal of CUDA graph capture."""
    return p.device.type == "cuda"


class _Plan:
    """What a parameter's checked step (Optimizer8bit._step_param) established, for the steps after it: the
    kernel's arguments but the gradient and the step's hyperparameters, and what they were derived from (the
    parameter's storage, dtype and size, its state dict and state tensors). _step_planned uses it while all
    of that is unchanged: a step then costs the gradient's checks and the kernel call, not every check of
    the parameter and its states again (a model of many small tensors spends most of its step there). On a GPU
    the kernel's pointers are then known to be the plan's device memory, and the per-pointer queries of the
    CUDA entry are skipped (``pointers_checked``)."""
    __slots__ = ("param", "ptr", "dtype", "numel", "cuda", "device", "state", "slots", "args", "master")

    def __init__(self, p: torch.Tensor, state: Dict[str, Any], args: "_C.StepArgs", master) -> None:
        self.param = p
        self.ptr = p.data_ptr()
        self.dtype = p.dtype
        self.numel = p.numel()
        self.cuda = p.is_cuda
        self.device = p.device
        self.state = state
        # (key, the state's value, its storage's address): what the kernel's arguments were made from
        self.slots = tuple((k, t, t.data_ptr() if isinstance(t, torch.Tensor) else None)
                           for k, t in ((k, state.get(k)) for k in _STATE_TENSORS))
        self.args = args
        self.master = master  # a 16-bit parameter's float32 master: its bits are compared at each step

    def holds(self, p: torch.Tensor, state: Optional[Dict[str, Any]]) -> bool:
        """Whether p and its state are still what the plan was made from (the state tensors' storage too: a
        rebound ``.data`` keeps the tensor but not the pointer the kernel's arguments hold)."""
        if not (self.param is p and state is self.state and p.data_ptr() == self.ptr and p.dtype is self.dtype
                and p.is_cuda is self.cuda and p.numel() == self.numel and p.is_contiguous()):
            return False
        for k, t, ptr in self.slots:  # a plain loop: this runs for every tensor at every step
            if state.get(k) is not t or (ptr is not None and t.data_ptr() != ptr):
                return False
        return True


def _check_state_device(state: Dict[str, Any], p: torch.Tensor, name: str) -> None:
    """The tensors the step reads live on p's device (a model moved after its optimizer made or loaded
    states would otherwise hand the kernel pointers of another memory)."""
    for key in _STATE_TENSORS:
        t = state.get(key)
        if isinstance(t, torch.Tensor) and t.device != p.device:
            raise Zero8ValueError(f"the optimizer state {key!r} of {name} is on {t.device} but the parameter is on "
                                  f"{p.device}: move the model before the optimizer's first step, or move the states "
                                  f"with optimizer.load_state_dict(optimizer.state_dict()), which places each state "
                                  f"on its parameter's device")


def _named(group: Dict[str, Any], i: int) -> str:
    """" ('name')" for params[i] of a group made from named parameters (torch >= 2.6 keeps their names in
    the group's param_names), else ""."""
    names = group.get("param_names")
    return f" ({names[i]!r})" if names is not None and i < len(names) else ""


class Zero8UnsupportedArgumentError(Zero8ValueError, Zero8NotSupportedError):
    """An argument value that zero8 does not implement (amsgrad=True, centered RMSprop, paged states...).
    It is a ValueError (a bad argument for this optimizer) and a NotImplementedError (what bitsandbytes
    raises for some of them), so either ``except`` catches it."""


def _unsupported(name: str, value, why: str):
    raise Zero8UnsupportedArgumentError(f"{name}={value!r} is not supported: {why}")


# ---------------------------------------------------------------------------------------------------
# Per-parameter configuration overrides

# Keys an override may set: the 8-bit knobs and the hyperparameters of any algorithm of the table (each
# optimizer reads the ones it has; see its _GROUP_KEYS). Adagrad's initial accumulator is not one: it is
# read when a state is made, which per-parameter settings of a sharded engine cannot change.
_OVERRIDE_KEYS = frozenset({"optim_bits", "min_8bit_size", "master_weights", *_algos.all_value_keys()})


def _check_override(config: Dict[str, Any]) -> Dict[str, Any]:
    config = dict(config)
    for k, v in config.items():
        if k not in _OVERRIDE_KEYS:
            raise Zero8ValueError(f"override key {k!r} is unknown; valid keys: {', '.join(sorted(_OVERRIDE_KEYS))}")
        _GROUP_CHECKS[k](v, k)
    return config


def _as_params(parameters) -> list:
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    params = list(parameters)
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameters[{i}] must be a torch.Tensor, got {type(p).__name__}")
    return params


class GlobalOptimManager:
    """Per-parameter optimizer settings shared by every zero8 optimizer, with bitsandbytes' API::

        mng = zero8.optim.GlobalOptimManager.get_instance()
        mng.override_config(model.fc1.weight, "optim_bits", 32)        # 32-bit states for this tensor
        mng.override_config([w1, w2], key_value_dict={"lr": 1e-4})       # any hyperparameter
        mng.register_module_override(emb, "weight", {"optim_bits": 32})  # whatever emb.weight is at step time

    Overrides are looked up when a parameter's state is created (``optim_bits``, ``min_8bit_size``,
    ``master_weights``) and at
    every step (hyperparameters); they win over the parameter group's values. Parameters are held by
    identity through weak references (an override never keeps a tensor or module alive), so
    ``register_parameters`` is not needed and does nothing (kept for bitsandbytes code). Also consulted:
    bitsandbytes' own GlobalOptimManager, when bitsandbytes is imported, so code that configured it keeps
    working after switching the optimizer to zero8.
    """

    _instance: Optional["GlobalOptimManager"] = None

    def __init__(self):
        raise RuntimeError("Call GlobalOptimManager.get_instance() instead")

    def initialize(self) -> None:
        """Forget every override."""
        self._param_config = WeakIdKeyDictionary()
        self._module_overrides: list = []  # (weakref to module, attribute name, config)

    @classmethod
    def get_instance(cls) -> "GlobalOptimManager":
        if cls._instance is None:
            inst = cls.__new__(cls)
            inst.initialize()
            cls._instance = inst
        return cls._instance

    def register_parameters(self, params) -> None:
        """bitsandbytes compatibility; overrides follow the tensor itself, nothing to register."""

    def override_config(self, parameters, key: Optional[str] = None, value=None,
                        key_value_dict: Optional[Dict[str, Any]] = None) -> None:
        """Override `key` = `value` (or every item of `key_value_dict`) for one tensor or a list of them."""
        config = _override_dict(key, value, key_value_dict)
        for p in _as_params(parameters):
            self._param_config.setdefault(p, {}).update(config)

    def register_module_override(self, module: torch.nn.Module, param_name: str, config: Dict[str, Any]) -> None:
        """Override `config` for ``getattr(module, param_name)``, resolved when the optimizer steps (so the
        override survives the module's tensor being replaced, e.g. by ``load_state_dict(assign=True)``)."""
        config = _check_override(config)
        self._module_overrides = [(m, n, c) for m, n, c in self._module_overrides if m() is not None]
        self._module_overrides.append((weakref.ref(module), str(param_name), config))

    def has_overrides(self) -> bool:
        """Whether any override is registered (here or in bitsandbytes' manager): the optimizers skip the
        per-parameter lookups when none is."""
        if self._module_overrides or len(self._param_config) > 0:
            return True
        inst = _bnb_manager()
        return inst is not None and bool(getattr(inst, "pid2config", None)
                                         or getattr(inst, "module_weight_config_triple", None))

    def config_for(self, p: torch.Tensor) -> Dict[str, Any]:
        """The overrides that apply to `p` (module overrides, then tensor overrides); {} when none."""
        out: Dict[str, Any] = {}
        bnb = _bnb_overrides(p)
        if bnb:
            out.update(bnb)
        for mref, name, config in self._module_overrides:
            m = mref()
            if m is not None and getattr(m, name, None) is p:
                out.update(config)
        own = self._param_config.get(p)
        if own:
            out.update(own)
        return out


def _override_dict(key, value, key_value_dict) -> Dict[str, Any]:
    if key is not None:
        if key_value_dict is not None:
            raise Zero8ValueError("override_config: pass either key/value or key_value_dict, not both")
        key_value_dict = {key: value}
    if not key_value_dict:
        raise Zero8ValueError("override_config: nothing to override (give key and value, or key_value_dict)")
    return _check_override(key_value_dict)


def _bnb_manager():
    """bitsandbytes' GlobalOptimManager instance if bitsandbytes is imported and made one (never imports)."""
    mod = sys.modules.get("bitsandbytes.optim.optimizer")
    mng_cls = getattr(mod, "GlobalOptimManager", None) if mod is not None else None
    return getattr(mng_cls, "_instance", None) if mng_cls is not None else None


def _bnb_overrides(p: torch.Tensor) -> Dict[str, Any]:
    """bitsandbytes' GlobalOptimManager entries for p, if bitsandbytes is already imported (never imported
    here). Only the keys zero8 knows are taken."""
    inst = _bnb_manager()
    if inst is None:
        return {}
    out: Dict[str, Any] = {}
    for module, name, config in getattr(inst, "module_weight_config_triple", []):
        if getattr(module, name, None) is p:
            out.update(config)
    out.update(getattr(inst, "pid2config", {}).get(id(p), {}))
    return {k: v for k, v in out.items() if k in _OVERRIDE_KEYS}


def param_config(p: torch.Tensor) -> Dict[str, Any]:
    """The global overrides of tensor `p` (GlobalOptimManager, including StableEmbedding's weight)."""
    return GlobalOptimManager.get_instance().config_for(p)


def wants_fp32_state(p: torch.Tensor) -> bool:
    """Whether a global override asks for 32-bit optimizer states for `p` (e.g. a StableEmbedding weight):
    what the sharded engine passes as ParamSpec(fp32_state=...)."""
    return param_config(p).get("optim_bits") == 32


# ---------------------------------------------------------------------------------------------------
# Argument checks (the messages name the argument)

_F32_MAX = 3.4028234663852886e38   # the largest float32
_F32_TRUE_MIN = 1.401298464324817e-45  # the smallest positive float32 (subnormal)


def _num(value, name: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise Zero8ValueError(f"{name} must be a number, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    # numbers.Real: also numpy's scalars (a schedule table's np.float32 lr), which torch.optim accepts.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise Zero8ValueError(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


def _range_text(lo: float, hi: float, lo_open: bool, hi_open: bool) -> str:
    if hi == math.inf:
        return f"must be finite and {'>' if lo_open else '>='} {lo:g}"
    return f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"


def _check_range(value, name: str, bounds: Tuple[float, float, bool, bool]) -> float:
    """A number within (lo, hi, lo_open, hi_open), a table entry's range; the message names the argument."""
    v = _num(value, name)
    lo, hi, lo_open, hi_open = bounds
    ok = (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
        raise Zero8ValueError(f"Invalid {name}: {value} ({_range_text(lo, hi, lo_open, hi_open)})")
    # The kernels compute in float32, where a larger magnitude is inf and a smaller nonzero one 0.
    if v != 0 and not _F32_TRUE_MIN <= abs(v) <= _F32_MAX:
        raise Zero8ValueError(f"Invalid {name}: {value} (beyond float32's range, which zero8's kernels compute in: "
                              f"it would be {'inf' if abs(v) > 1 else '0'} there; largest float32 3.4028235e38)")
    return v


def _check_sequence(value, name: str, bounds: Tuple[Tuple[float, float, bool, bool], ...]) -> Tuple[float, ...]:
    """A sequence argument (betas), one range per element; also bitsandbytes' '(0.9, 0.999)' from command
    lines."""
    count = len(bounds)
    if isinstance(value, str):
        value = [float(b) for b in value.replace("(", "").replace(")", "").split(",") if b.strip()]
    try:
        items = tuple(value)
    except TypeError:
        what = "a pair of floats" if count == 2 else f"a sequence of {count} floats"
        raise Zero8ValueError(f"Invalid {name}: {value!r} (must be {what})") from None
    if len(items) != count:
        raise Zero8ValueError(f"Invalid {name}: {value!r} (must hold {count} values)")
    key, _, where = name.partition(" (")  # "betas (param_groups[1])" -> "betas[0] (param_groups[1])"
    for i, (b, r) in enumerate(zip(items, bounds)):
        _check_range(b, f"{key}[{i}]" + (f" ({where}" if where else ""), r)
    return items


def _check_bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise Zero8ValueError(f"{name} must be a bool, got {value!r}")
    return value


def _check_bits(value, name: str = "optim_bits") -> int:
    if isinstance(value, bool) or value not in (8, 32):
        raise Zero8ValueError(f"Invalid {name}: {value!r} (zero8 keeps 8-bit or 32-bit optimizer states)")
    return int(value)


def _check_min_8bit_size(value, name: str = "min_8bit_size") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise Zero8ValueError(f"Invalid {name}: {value!r} (must be an int >= 0)")
    return value


def _check_block_size(value, name: str = "block_size") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not (64 <= value <= 4096) or value & (value - 1):
        raise Zero8ValueError(f"Invalid {name}: {value!r} (must be a power of two in 64..4096)")
    return value


def _table_check(arg: "_algos.Arg") -> Callable[[Any, str], Any]:
    """The check of one hyperparameter key: its type, range and length, from the algorithm table."""
    if arg.is_sequence:
        bounds = tuple(e.range for e in arg.entries)
        return lambda v, n: _check_sequence(v, n, bounds)
    if arg.first.is_flag:
        return _check_bool
    bounds = arg.first.range
    return lambda v, n: _check_range(v, n, bounds)


# Checks of the parameter-group keys, by key (each optimizer lists the keys it has in _GROUP_KEYS): every
# hyperparameter of the table, and the 8-bit knobs.
_GROUP_CHECKS: Dict[str, Callable[[Any, str], Any]] = {
    **{key: _table_check(arg) for key, arg in _algos.value_specs().items()},
    "optim_bits": _check_bits,
    "master_weights": _check_bool,
    "min_8bit_size": _check_min_8bit_size,
}


# ---------------------------------------------------------------------------------------------------
# Saved states: decode and encode

def _infer_block(n: int, nblocks: int, where: str) -> int:
    """The block size of n elements stored with `nblocks` scales: unique when nblocks >= 2 (a power of
    two B with ceil(n / B) = nblocks); any B >= n when nblocks == 1."""
    if nblocks == 1:
        return max(n, 1)
    for k in range(31):
        b = 1 << k
        if -(-n // b) == nblocks:
            return b
    raise Zero8ValueError(f"{where}: {nblocks} block scales do not fit {n} elements with any power-of-two block")


def _decode(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor, n: int, where: str) -> torch.Tensor:
    """float32 values of a block-wise 8-bit state: qmap[code] * absmax of its block (bitsandbytes' and
    zero8's decoding, one float32 product)."""
    block = _infer_block(n, absmax.numel(), where)
    vals = qmap.to(torch.float32).reshape(-1)[codes.reshape(-1).long()]
    scale = absmax.to(torch.float32).reshape(-1).repeat_interleave(block)[:n]
    return vals * scale


def _encode(values: torch.Tensor, block: int, kind) -> Tuple[torch.Tensor, torch.Tensor]:
    """(codes, absmax) of float32 values with zero8's codec (exact nearest code, signed block scale)."""
    x = values.detach().to(torch.float32).contiguous().reshape(-1)
    n = x.numel()
    codes = torch.empty(n, dtype=torch.uint8)
    absmax = torch.zeros(-(-n // block), dtype=torch.float32)
    if n:
        _C.quantize_blockwise(x.data_ptr(), _C.DType.f32, n, block, kind, codes.data_ptr(), absmax.data_ptr())
    return codes, absmax


def _same_map(saved: torch.Tensor, kind) -> bool:
    """Whether a saved qmap is zero8's map of `kind` up to the rounding of the map's construction (at most
    4 float32 ulps per entry: bitsandbytes builds the same map in float32 arithmetic, and its values on
    current torch differ from the reference table by one ulp in some entries). Codes then mean the same
    values and are kept as they are."""
    ours = _map(kind)
    saved = saved.detach().to(torch.float32).reshape(-1)
    if saved.numel() != 256:
        return False
    return bool(((saved - ours).abs() <= 4 * _F32_ULP * ours.abs()).all())


# torch.optim group flags zero8 does not implement (loading a group that set one fails), and torch.optim
# group keys that do not apply to zero8's kernels (dropped on load).
_TORCH_FLAGS_UNSUPPORTED = ("amsgrad", "maximize", "centered")
_TORCH_GROUP_KEYS_DROPPED = frozenset({"amsgrad", "maximize", "centered", "foreach", "fused", "capturable",
                                       "differentiable", "decoupled_weight_decay"})

# Group keys that tell the algorithms apart (every hyperparameter of the table but those all of bitsandbytes'
# groups hold, and its 2-state groups' t_alpha, t_beta3), and torch.optim's state names (lion-pytorch's for
# Lion): a saved group or state holding one that this optimizer neither has nor reads was saved by another
# algorithm, and its values would be misread (e.g. SGD's bitsandbytes alias betas = (momentum, dampening)
# as Adam's betas).
_ALGO_GROUP_KEYS = _algos.algo_group_keys()
_TORCH_STATE_NAMES = _algos.torch_state_names()

# The group key naming the algorithm that saved a zero8 state dict. The keys above cannot tell every pair
# apart: Lion's group (lr, betas, weight_decay and bitsandbytes' eps alias) is also what SGD, RMSprop and
# Adagrad read from bitsandbytes' 1-state groups. Not kept in param_groups: added by state_dict(), read
# and dropped by load_state_dict().
_ALGORITHM_KEY = "zero8_algorithm"


def fixed_bits(base: type, bits: int, name: str, doc: str) -> type:
    """A subclass of `base` that always keeps `bits`-bit states (bitsandbytes' Adam8bit / Adam32bit
    twins). Same constructor without ``optim_bits`` (accepted only when equal to `bits`)."""
    def __init__(self, params, *args, optim_bits=None, **kwargs):
        if optim_bits is not None and optim_bits != bits:
            raise Zero8ValueError(f"Invalid optim_bits: {optim_bits!r} ({name} keeps {bits}-bit states; "
                                  f"{base.__name__}(..., optim_bits=...) chooses)")
        base.__init__(self, params, *args, optim_bits=bits, **kwargs)

    sig = inspect.signature(base.__init__)
    __init__.__signature__ = sig.replace(parameters=[q for q in sig.parameters.values() if q.name != "optim_bits"])
    __init__.__doc__ = base.__init__.__doc__
    return type(name, (base,), {"__init__": __init__, "__doc__": doc, "__module__": base.__module__,
                                "__qualname__": name})


# The 8-bit knobs of every constructor, around the row's keyword arguments (bitsandbytes' order): its own
# keyword arguments come after min_8bit_size, zero8's additions after block_size.
_KNOBS_FIRST = (("optim_bits", 32), ("args", None), ("min_8bit_size", 4096))
_KNOBS_MIDDLE = (("percentile_clipping", 100), ("block_wise", True), ("is_paged", False), ("block_size", BNB_BLOCK_SIZE))
_KNOBS_LAST = (("master_weights", True),)


def _constructor(algo: str) -> Callable[..., None]:
    """The ``__init__`` of the zero8.optim class of table row `algo`: params, the row's arguments in
    bitsandbytes' order with zero8.optim's defaults, and the 8-bit knobs. Arguments the row accepts only at
    their default are refused, ignored ones warn when set; the hyperparameters (and the decouple flag) become
    the optimizer's defaults."""
    P = inspect.Parameter
    cargs = _algos.constructor_args(algo)

    def keyword(pairs):
        return [P(name, P.KEYWORD_ONLY, default=default) for name, default in pairs]

    def row_args(slot):
        kind = P.POSITIONAL_OR_KEYWORD if slot == "positional" else P.KEYWORD_ONLY
        return [P(a.name, kind, default=a.default()) for a in cargs if a.first.py_arg == slot]

    sig = inspect.Signature(
        [P("self", P.POSITIONAL_OR_KEYWORD), P("params", P.POSITIONAL_OR_KEYWORD)] + row_args("positional")
        + keyword(_KNOBS_FIRST) + row_args("keyword") + keyword(_KNOBS_MIDDLE) + row_args("keyword_last")
        + keyword(_KNOBS_LAST))
    knobs = [name for name, _ in _KNOBS_FIRST + _KNOBS_MIDDLE + _KNOBS_LAST]
    in_defaults = _algos.defaults_keys(algo)

    def __init__(self, *args, **kwargs):
        if "capturable" in kwargs:  # torch.optim's keyword, which its optimizers without a capturable step lack too
            raise TypeError(f"{type(self).__name__} takes no capturable argument: its step cannot be captured in a "
                            f"CUDA graph (the step count and lr are host values, see Optimizer8bit.step); capture "
                            f"the forward and backward only and call step() outside the graph")
        bound = sig.bind(self, *args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        for a in cargs:
            value = given[a.name]
            if a.first.role == "fixed" and value != a.default():
                _unsupported(a.name, value, a.first.why)
            elif a.first.role == "ignored" and value != a.default():
                warnings.warn(f"{type(self).__name__}: {a.name}={value} is ignored: {a.first.why}", stacklevel=2)
            elif a.first.role == "decouple":
                _check_bool(value, a.name)
        # In defaults, hence in every group and state dict, as torch.optim keeps them.
        defaults = {a.name: given[a.name] if a.name in given else a.default() for a in in_defaults}
        Optimizer8bit.__init__(self, given["params"], defaults, **{k: given[k] for k in knobs})

    __init__.__signature__ = sig
    return __init__


def table_classes(algo: str, module: str) -> Tuple[type, type, type]:
    """``X``, ``X8bit`` and ``X32bit`` for a table row that no module of zero8.optim writes out: the thin
    classes bitsandbytes has, named by the row's class name, with generated docstrings."""
    row = _algos.spec(algo)
    name = row.class_name
    listed = ", ".join(f"{a.name}={a.default()!r}" for a in _algos.constructor_args(algo)
                       if a.first.role in ("value", "init"))
    doc = (f"{name} over zero8's fused kernel (the {row.name} row of the algorithm table), with 8-bit or 32-bit "
           f"states; hyperparameters {listed}. See ``Optimizer8bit`` for the 8-bit knobs and overrides.")
    base = type(name, (Optimizer8bit,), {"__doc__": doc, "__module__": module, "__qualname__": name}, algo=algo)
    return (base,
            fixed_bits(base, 8, f"{name}8bit", f"{name} with 8-bit block-wise states (bitsandbytes' {name}8bit)."),
            fixed_bits(base, 32, f"{name}32bit", f"{name} with float32 states (bitsandbytes' {name}32bit)."))


# ---------------------------------------------------------------------------------------------------
# The optimizer base

class Optimizer8bit(PartitionedStates, torch.optim.Optimizer):
    """Base of zero8's optimizers. A subclass names its row of the algorithm table,
    ``class SGD(Optimizer8bit, algo="sgd")``, which gives it everything else: ``algo`` (a ``_C.Algo``), its
    constructor (arguments and defaults), ``_GROUP_KEYS`` (the group hyperparameters, checked by
    ``_GROUP_CHECKS``), ``_hyper(config)`` (-> ``_C.Hyper``), the states and their maps, and for state dicts
    ``_TORCH_STATE_KEYS`` (torch.optim's names of state 1 and 2) and bitsandbytes' names of the same
    hyperparameters (``_bnb_group_aliases`` / ``_from_bnb_group``). A subclass may define its own
    ``__init__`` or ``algo``, which are then kept.

    Optimizer-wide 8-bit knobs: ``optim_bits`` (8 or 32), ``min_8bit_size`` (parameters with fewer
    elements keep 32-bit states), ``block_size`` (state block, 256 as bitsandbytes; other powers of two in
    64..4096 are zero8's), ``master_weights`` (bfloat16/float16 parameters: True, the default, keeps a
    float32 master copy, 4 bytes per parameter; False keeps none and updates the 16-bit parameter through
    a temporary float32 copy each step, as bitsandbytes does: 8-bit states then take 2 + 8/256 bytes per
    parameter in all, and updates below half a 16-bit ulp are rounded away). Each may also be set per
    parameter group (a group key of the same name) or per parameter (``override_config``/
    ``GlobalOptimManager``); ``optim_bits``, ``min_8bit_size`` and ``master_weights`` are read when the
    parameter's state is made, at its first step. bitsandbytes' ``args`` object, if given,
    supplies them instead (its ``optim_bits``, ``min_8bit_size``, ``percentile_clipping``...).
    """

    algo = None
    _ROW: Optional[str] = None  # the table row (its name) the class runs
    _GROUP_KEYS: Tuple[str, ...] = ()
    _TORCH_STATE_KEYS: Tuple[str, ...] = ()
    _BNB_ONLY_KEYS: Tuple[str, ...] = ()  # group keys bitsandbytes saves that this optimizer drops on load
    _ALGORITHM = ""  # the name state_dict() records (_ALGORITHM_KEY); Adam and AdamW share "adam"
    _LOADS_FROM: Tuple[str, ...] = ()  # other algorithms whose saved groups and states mean the same here

    def __init_subclass__(cls, algo: Optional[str] = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if algo is None:  # e.g. the 8bit/32bit twins: their base's row
            return
        row = _algos.spec(algo)
        cls._ROW = row.name
        if "algo" not in cls.__dict__:
            switch = _algos.decouple_arg(row.name)
            # A decouple flag the constructor takes picks the algorithm per instance (Adam's
            # decoupled_weight_decay), read from defaults, which copies and unpickled optimizers keep.
            cls.algo = property(Optimizer8bit._switched_algo) if switch and switch.first.py_arg != "none" else row.algo
        cls._GROUP_KEYS = _algos.group_keys(row.name)
        cls._TORCH_STATE_KEYS = tuple(name for name in row.torch_states if name)
        cls._BNB_ONLY_KEYS = _algos.dropped_on_load(row.name, row.num_states)
        cls._ALGORITHM = _algos.state_dict_name(row.name)
        cls._LOADS_FROM = _algos.loads_from(row.name)
        if "__init__" not in cls.__dict__:
            cls.__init__ = _constructor(row.name)

    def _switched_algo(self) -> "_C.Algo":
        row = _algos.spec(self._ROW)
        switch = _algos.decouple_arg(row.name)
        return row.decoupled if self.defaults.get(switch.name, switch.default()) else row.algo

    def __init__(self, params, defaults: Dict[str, Any], *, optim_bits: int = 32, args=None,
                 min_8bit_size: int = 4096, percentile_clipping: int = 100, block_wise: bool = True,
                 is_paged: bool = False, block_size: int = BNB_BLOCK_SIZE, master_weights: bool = True):
        if args is not None:  # bitsandbytes' MockArgs / argparse namespace
            optim_bits = getattr(args, "optim_bits", optim_bits)
            min_8bit_size = getattr(args, "min_8bit_size", min_8bit_size)
            percentile_clipping = getattr(args, "percentile_clipping", percentile_clipping)
            block_wise = getattr(args, "block_wise", block_wise)
            is_paged = getattr(args, "is_paged", is_paged)
        self.optim_bits = _check_bits(optim_bits)
        self.min_8bit_size = _check_min_8bit_size(min_8bit_size)
        self.block_size = _check_block_size(block_size)
        self.master_weights = _check_bool(master_weights, "master_weights")
        if percentile_clipping != 100:
            _unsupported("percentile_clipping", percentile_clipping,
                         "zero8 does not clip by gradient-norm percentiles; clip gradients before step() "
                         "(torch.nn.utils.clip_grad_norm_) or use the engine's gradient_clipping")
        if block_wise is not True:
            _unsupported("block_wise", block_wise, "zero8's 8-bit states are always block-wise")
        if is_paged:
            _unsupported("is_paged", is_paged, "zero8 keeps its states in the parameter's own memory (no paged "
                         "unified-memory states)")
        self._overrides = WeakIdKeyDictionary()  # per-optimizer overrides, over the global ones
        self._synced: Dict[int, tuple] = {}  # id of a 16-bit parameter -> _synced(p, master, bits), see _step_param
        self._plans: Dict[int, _Plan] = {}  # id of a parameter -> its _Plan, see _step_planned
        self._views: Dict[int, tuple] = {}  # id of a DTensor parameter -> its local view, see _local_view
        super().__init__(params, defaults)
        self._record_model_params()  # DeepSpeed may replace them by flat partitions (zero8.optim.partition)

    # torch's __getstate__ keeps only defaults, state and param_groups: add the 8-bit knobs and the
    # per-parameter overrides (as (tensor, config) pairs, so deepcopy/pickle map them to the copied
    # parameters), so that copy.deepcopy(opt) and pickling give a working optimizer.
    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()
        state.update(optim_bits=self.optim_bits, min_8bit_size=self.min_8bit_size, block_size=self.block_size,
                     master_weights=self.master_weights,
                     _override_pairs=[(p, dict(c)) for p, c in self._overrides.items()])
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state = dict(state)
        pairs = state.pop("_override_pairs", None)
        super().__setstate__(state)
        if pairs is not None or not hasattr(self, "_overrides"):
            self._overrides = WeakIdKeyDictionary()
            for p, c in pairs or ():
                self._overrides[p] = c
        if not hasattr(self, "_model_params"):
            self._record_model_params()
        if not hasattr(self, "_synced"):  # a copy or unpickled optimizer: its first step compares in full
            self._synced = {}
        self._plans = {}  # new states (a load, a copy): each parameter's next step is checked in full
        self._views = {}
        if not hasattr(self, "master_weights"):  # pickled before the knob existed
            self.master_weights = True

    # ---- configuration ----

    @torch._disable_dynamo
    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """torch's add_param_group, then the group's hyperparameters and tensors are checked (a bad
        value raises Zero8ValueError naming it, and the group is not added)."""
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        try:
            self._check_group(self.param_groups[index], index)
        except Exception:
            self.param_groups.pop()
            raise

    def _check_group(self, group: Dict[str, Any], index: int) -> None:
        where = "" if index == 0 else f" (param_groups[{index}])"
        for key in self._GROUP_KEYS:  # betas='(0.9, 0.999)' from a command line: the numbers
            if isinstance(group.get(key), str) and _algos.value_specs()[key].is_sequence:
                group[key] = _GROUP_CHECKS[key](group[key], key + where)
        self._check_hyper(group, where)
        for i, p in enumerate(group["params"]):
            if is_dtensor(p):
                self._check_dtensor_param(p, f"params[{i}]{where}{_named(group, i)}")
            # Another dtype (int8 codes, float64 or complex constants) may sit in a group as long as it is
            # frozen: torch.optim and bitsandbytes skip a parameter without a gradient, and so does step().
            if p.dtype not in FLOAT_DTYPES and p.requires_grad:
                raise Zero8ValueError(f"params[{i}]{where}{_named(group, i)} has dtype {p.dtype} and requires a "
                                      f"gradient; zero8 optimizers step float32, bfloat16 or float16 parameters "
                                      f"(one of another dtype is accepted only frozen, requires_grad=False)")

    def _check_dtensor_param(self, p: torch.Tensor, name: str) -> None:
        """A DTensor parameter (FSDP2, tensor parallelism; zero8.optim.dtensor) this optimizer can step: Shard or
        Replicate placements, and no per-tensor trust ratio (a norm over the whole parameter, which the step of
        one shard cannot take)."""
        if _C.algo_has_trust_ratio(self.algo):
            raise Zero8NotSupportedError(
                f"{name} is a DTensor (a parameter sharded by FSDP2's fully_shard or tensor parallelism): "
                f"{type(self).__name__}'s trust ratio is a norm over the whole parameter, which zero8.optim does "
                f"not reduce across ranks; use another optimizer there, or zero8's engine (zero8.initialize)")
        _dt.check_placements(p, name)

    def _check_hyper(self, group: Dict[str, Any], where: str) -> None:
        """The group's hyperparameters and 8-bit knobs, checked by name (at construction, add_param_group
        and load_state_dict, and at each step for values changed since)."""
        for key in self._GROUP_KEYS + ("optim_bits", "min_8bit_size", "master_weights"):
            if key in group:
                _GROUP_CHECKS[key](group[key], key + where)
        if "block_size" in group:
            _check_block_size(group["block_size"], "block_size" + where)
        if group.get("nesterov") and (_num(group.get("momentum", 0), "momentum") <= 0
                                      or _num(group.get("dampening", 0), "dampening") != 0):
            raise Zero8ValueError(f"Invalid nesterov{where}: Nesterov momentum requires a momentum > 0 and "
                                  f"zero dampening")

    def override_config(self, parameters, key: Optional[str] = None, value=None,
                        key_value_dict: Optional[Dict[str, Any]] = None, **kwargs) -> None:
        """Per-parameter settings for this optimizer only (over the group's values and the global
        GlobalOptimManager's): ``opt.override_config(emb.weight, optim_bits=32)``, or bitsandbytes'
        ``(param, "optim_bits", 32)`` / ``key_value_dict=`` forms. ``optim_bits``/``min_8bit_size`` take
        effect when the parameter's state is created (its first step); hyperparameters at every step."""
        if kwargs:
            if key is not None or key_value_dict is not None:
                raise Zero8ValueError("override_config: pass keywords, key/value or key_value_dict, not several")
            key_value_dict = kwargs
        config = _override_dict(key, value, key_value_dict)
        known = self._known_params()
        for p in _as_params(parameters):
            if id(p) not in known:
                raise Zero8ValueError(f"override_config: a tensor of shape {tuple(p.shape)} is not a parameter "
                                      f"of this optimizer")
            self._overrides.setdefault(p, {}).update(config)

    def overrides_for(self, p: torch.Tensor) -> Dict[str, Any]:
        """Every override that applies to parameter `p` here: the global ones, then this optimizer's."""
        cfg = param_config(p)
        cfg.update(self._overrides.get(p) or {})
        return cfg

    def _config(self, group: Dict[str, Any], p: torch.Tensor, global_cfg: Optional[Dict] = None) -> Dict[str, Any]:
        """Group values, then global overrides, then this optimizer's overrides."""
        cfg = dict(group)
        cfg.setdefault("optim_bits", self.optim_bits)
        cfg.setdefault("min_8bit_size", self.min_8bit_size)
        cfg.setdefault("block_size", self.block_size)
        cfg.setdefault("master_weights", self.master_weights)
        cfg.update(global_cfg if global_cfg is not None else param_config(p))
        own = self._overrides.get(p)
        if own:
            cfg.update(own)
        return cfg

    def _state_bits(self, p: torch.Tensor, cfg: Dict[str, Any]) -> int:
        """8 or 32 for a new state of p: min_8bit_size is compared with the whole parameter's numel (a
        DTensor's global one, a ZeRO-3 parameter's ds_numel), and a DTensor's 8-bit states need a last
        dimension of whole blocks (zero8.optim.dtensor)."""
        if cfg["optim_bits"] == 8 and whole_numel(p) >= cfg["min_8bit_size"]:
            return 8 if not is_dtensor(p) or _dt.eight_bit_fits(p, cfg["block_size"]) else 32
        return 32

    def _hyper(self, cfg: Dict[str, Any]) -> "_C.Hyper":
        """The C++ Hyper of a parameter's config (group values, then overrides): the row's hyperparameters."""
        if self._ROW is None:
            raise NotImplementedError(f"{type(self).__name__} names no row of the algorithm table")
        return _algos.hyper_of_config(self._ROW, cfg, _num)

    def _initial_value(self, cfg: Dict[str, Any]) -> float:
        """The value states start at: the row's init entry (Adagrad's initial_accumulator_value), else 0."""
        arg = _algos.init_arg(self._ROW) if self._ROW else None
        return 0.0 if arg is None else _num(cfg.get(arg.name, arg.default()), arg.name)

    def _state_map(self, i: int):
        """The MapKind of 8-bit state i (1 or 2)."""
        if self._ROW is None:
            return _SIGNED if i == 1 else _UNSIGNED
        return _algos.spec(self._ROW).state_maps[i - 1]

    @property
    def num_states(self) -> int:
        """1 or 2 states per parameter."""
        return self._num_states

    @functools.cached_property
    def _num_states(self) -> int:
        return _C.algo_num_states(self.algo)

    # ---- state ----

    def _new_state(self, p: torch.Tensor, cfg: Dict[str, Any], bits: Optional[int] = None) -> Dict[str, Any]:
        # The states live on the parameter's device (an initial value is encoded on the CPU: same codes).
        bits = self._state_bits(p, cfg) if bits is None else bits
        init = self._initial_value(cfg)
        dev = p.device
        values = torch.full((p.numel(),), init, dtype=torch.float32) if init != 0.0 else None
        state: Dict[str, Any] = {"step": 0}
        for i in range(1, self.num_states + 1):
            if bits == 8:
                block = cfg["block_size"]
                kind = self._state_map(i)
                if values is None:  # zero codes and scales decode to 0, as bitsandbytes initialises them
                    codes = torch.zeros(p.shape, dtype=torch.uint8, device=dev)
                    absmax = torch.zeros(-(-p.numel() // block), dtype=torch.float32, device=dev)
                else:
                    codes, absmax = _encode(values, block, kind)
                    codes, absmax = codes.reshape(p.shape).to(dev), absmax.to(dev)
                state[f"state{i}"] = codes
                state[f"absmax{i}"] = absmax
                state[f"qmap{i}"] = _map(kind, dev)
            else:
                state[f"state{i}"] = (torch.zeros(p.shape, dtype=torch.float32, device=dev) if values is None
                                      else values.reshape(p.shape).to(dev, copy=True))
        if p.dtype != torch.float32 and cfg["master_weights"]:
            state["master"] = p.detach().to(torch.float32).contiguous().clone()
        return state

    # ---- step ----

    # Out of dynamo's graphs: the kernels take raw pointers and host values (dynamo's guards on the pybind
    # objects the step builds fail on the frame that made them), so compiled code graph-breaks around it.
    @torch._disable_dynamo
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        """One optimization step over every parameter with a gradient (closure: re-evaluates the model and
        returns the loss, run with gradients enabled, as in torch.optim). Refused during CUDA graph capture
        (see the module docstring)."""
        self._refuse_graph_capture()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        mng = GlobalOptimManager.get_instance()
        check_global = mng.has_overrides()
        check_own = len(self._overrides) > 0
        self._adopt_torch_states()
        for gi, group in enumerate(self.param_groups):  # values changed since construction (a scheduler...)
            self._check_hyper(group, f" (param_groups[{gi}])")
        streams: Dict[torch.device, int] = {}  # torch's current stream per CUDA device, read once per step
        for gi, group in enumerate(self.param_groups):
            group_hyper = None
            is_partition = self._partition_test(group)
            for pi, p in enumerate(group["params"]):
                grad = p.grad
                if grad is None:
                    continue
                if is_partition(p):
                    self._step_partition(p, group, gi)
                    continue
                over = mng.config_for(p) if check_global else None
                own = self._overrides.get(p) if check_own else None
                if over or own:  # per-parameter hyperparameters
                    hyper = self._hyper(self._config(group, p, over))
                else:
                    if group_hyper is None:
                        group_hyper = self._hyper(self._config(group, p, {}))
                    hyper = group_hyper
                if is_dtensor(p):
                    self._step_dtensor(p, grad, group, over, hyper, gi, pi, streams)
                elif not self._step_planned(p, grad, hyper, streams):
                    self._step_param(p, group, over, hyper, gi, pi)
        return loss

    def _refuse_graph_capture(self) -> None:
        """Raise while torch's current CUDA stream is capturing a graph and a parameter is on a GPU: the step
        would be captured with this step's count and lr baked in (see the module docstring). Without CUDA in use
        this costs one bool; the parameters are looked at only during capture."""
        if not torch.cuda.is_initialized() or not torch.cuda.is_current_stream_capturing():
            return
        if any(_on_cuda(p) for g in self.param_groups for p in g["params"]):
            raise Zero8NotSupportedError(
                f"{type(self).__name__}.step() was called during CUDA graph capture, which zero8.optim does not "
                f"support: the step count and learning rate are host values passed to the kernels, so every replay "
                f"would repeat this step's bias correction and learning rate while state['step'] stays put, and "
                f"a parameter's first step waits for copies to the GPU, which capture forbids. Capture the forward "
                f"and backward only (torch.cuda.graph, torch.cuda.make_graphed_callables) and call step() outside "
                f"the graph")

    def _step_dtensor(self, p: torch.Tensor, grad: torch.Tensor, group: Dict[str, Any], over, hyper, gi: int,
                      pi: int, streams: Dict[torch.device, int]) -> None:
        """DTensor p's step (zero8.optim.dtensor): its local shard and its gradient's, with the local shards of
        its states (a view of its state dict, made again when a load replaces the states)."""
        name = f"param_groups[{gi}]['params'][{pi}]{_named(group, pi)}"
        if not is_dtensor(grad) or grad.device_mesh != p.device_mesh or tuple(grad.placements) != tuple(p.placements):
            got = f"placements {tuple(grad.placements)}" if is_dtensor(grad) else "a plain tensor"
            raise Zero8ValueError(f"{name}.grad is {got}; its DTensor parameter has placements {tuple(p.placements)}: "
                                  f"the gradient must be sharded as the parameter is (FSDP2 reduces it so)")
        state = self.state[p]
        if not state:  # checked here once, not at every step: also one put in a group after construction
            self._check_dtensor_param(p, name)
            state.update(self._new_dtensor_state(p, self._config(group, p, over), name))
        view = self._local_view(p, state)
        view["step"] = state["step"]
        lp, lg = _dt.local(p), _dt.local(grad)
        if not self._step_planned(lp, lg, hyper, streams, view):
            self._step_param(lp, group, over, hyper, gi, pi, grad=lg, state=view, owner=p)
        state["step"] = view["step"]

    def _local_view(self, p: torch.Tensor, state: Dict[str, Any]) -> Dict[str, Any]:
        """DTensor p's state with each DTensor replaced by its local shard (what the kernel steps); kept while
        the state's tensors are the same objects."""
        tensors = tuple(state.get(k) for k in _STATE_TENSORS)
        held = self._views.get(id(p))
        if held is not None and held[0] is p and all(a is b for a, b in zip(held[1], tensors)):
            return held[2]
        view = {k: _dt.local(v) if is_dtensor(v) else v for k, v in state.items()}
        self._views[id(p)] = (p, tensors, view)
        return view

    def _new_dtensor_state(self, p: torch.Tensor, cfg: Dict[str, Any], name: str) -> Dict[str, Any]:
        """A new state of DTensor p: its local shard's, as DTensors (zero8.optim.dtensor)."""
        bits = self._state_bits(p, cfg)
        if bits == 32 and cfg["optim_bits"] == 8 and p.numel() >= cfg["min_8bit_size"]:
            warnings.warn(f"{name} (shape {tuple(p.shape)}) keeps 32-bit optimizer states: 8-bit states of a DTensor "
                          f"parameter need at least 2 dimensions and a last one that is a multiple of block_size "
                          f"({cfg['block_size']}), so that resharding keeps their blocks",
                          stacklevel=caller_stacklevel())
        if bits == 8:
            _dt.check_grid(p, cfg["block_size"], name)
        state = self._new_state(_dt.local(p), cfg, bits)
        return self._as_dtensor_state(p, state, cfg["block_size"] if bits == 8 else 0)

    @staticmethod
    def _as_dtensor_state(p: torch.Tensor, state: Dict[str, Any], block: int) -> Dict[str, Any]:
        """The local state of DTensor p's shard as DTensors: the states and master with p's shape, the block
        scales with absmax_shape's (block: of the 8-bit states, 0 for 32-bit ones)."""
        lp = _dt.local(p)
        out = dict(state)
        for key, v in state.items():
            if key.startswith("absmax"):
                out[key] = _dt.wrap(v.reshape(_dt.absmax_shape(lp.shape, block)), p, _dt.absmax_shape(p.shape, block))
            elif key in _STATE_TENSORS:
                out[key] = _dt.wrap(v.reshape(lp.shape), p)
        out[_dt.BLOCK_KEY] = block
        return out

    def _step_planned(self, p: torch.Tensor, grad: torch.Tensor, hyper, streams: Dict[torch.device, int],
                      state: Optional[Dict[str, Any]] = None) -> bool:
        """p's step by its _Plan, when it has one that still holds and the gradient passes _step_param's checks
        (dense, contiguous, on p's device, p's shape, a float dtype); else False, with nothing done, and
        _step_param checks and steps in full (and raises, naming what is wrong). `state`: p's (a DTensor's
        local view), by default self.state's."""
        plan = self._plans.get(id(p))
        if plan is None:
            return False
        state = self.state.get(p) if state is None else state
        code = float_code(grad.dtype)
        if (code is None or grad.layout is not torch.strided or not plan.holds(p, state)
                or grad.device != plan.device or grad.shape != p.shape or not grad.is_contiguous()):
            return False
        if plan.master is not None:
            self._check_synced(p, plan.master, p)
        state["step"] += 1
        hyper.step = state["step"]
        a = plan.args
        a.h = hyper
        a.grad = grad.data_ptr()
        a.grad_dtype = code
        if plan.cuda:
            stream = streams.get(plan.device)
            if stream is None:
                stream = streams[plan.device] = cuda_stream(p)
            with on_device(p):  # every pointer the plan's device memory (holds), the gradient a tensor there
                _C.step_tensor_cuda(a, stream, pointers_checked=True)
        else:
            _C.step_tensor(a)
        if plan.master is not None:
            self._synced[id(p)] = _synced(p, plan.master, p)
        return True

    def _check_synced(self, p: torch.Tensor, master: torch.Tensor, work: torch.Tensor) -> None:
        """Re-seeds 16-bit p's master where p was changed outside the optimizer since it last left p (a step,
        or load_state_dict): through p itself bumps torch's version; rebinding p.data moves the pointer; in
        place through p.data shows only in the bits. (A record's master is held, so an id reused by a new
        parameter never matches.) A GPU parameter's bits are not compared: reading them would make the host
        wait for the GPU at every step, so an in-place edit through p.data goes unseen there (edit under
        no_grad instead)."""
        rec = self._synced.get(id(p))
        if (rec is None or rec[0] != p._version or rec[1] != p.data_ptr() or rec[2] is not master
                or (rec[3] is not None and _snapshot(work) != rec[3])):
            _reseed_master(p, master)

    def _step_param(self, p: torch.Tensor, group: Dict[str, Any], over, hyper, gi: int, pi: int,
                    grad: Optional[torch.Tensor] = None, state: Optional[Dict[str, Any]] = None,
                    owner: Optional[torch.Tensor] = None) -> None:
        """p's checked step. For a DTensor parameter `owner`, p and grad are the local shards and state the local
        view of owner's state (which exists); by default p.grad and self.state[p]."""
        name = f"param_groups[{gi}]['params'][{pi}]{_named(group, pi)}"
        owner = p if owner is None else owner  # what the configuration is looked up by
        if p.dtype not in FLOAT_DTYPES:  # accepted frozen (_check_group), and now it has a gradient
            raise Zero8ValueError(f"{name} has dtype {p.dtype} and a gradient; zero8 optimizers step float32, "
                                  f"bfloat16 or float16 parameters (one of another dtype is accepted only while "
                                  f"it has no gradient)")
        grad = p.grad if grad is None else grad
        if grad.layout != torch.strided:
            raise Zero8ValueError(f"{name} (shape {tuple(p.shape)}) has a sparse gradient; zero8 optimizers "
                                  f"take dense gradients (e.g. nn.Embedding(sparse=False))")
        check_same_device(grad, f"{name}.grad", p, name)
        check_device(p, name)
        if grad.shape != p.shape:
            raise Zero8ValueError(f"{name}.grad has shape {tuple(grad.shape)}; the parameter has {tuple(p.shape)}")
        # The states follow the parameter's row-major order. A strided parameter (a transposed view, a
        # channels_last weight) is stepped in a contiguous copy and copied back: as torch.optim, the update
        # is in place, keeping its storage and strides.
        strided = not p.is_contiguous()
        work = p.detach().contiguous() if strided else p.data
        if not grad.is_contiguous():
            grad = grad.contiguous()

        state = self.state[p] if state is None else state
        fresh = len(state) == 0
        if fresh:
            state.update(self._new_state(p, self._config(group, owner, over)))
        n = p.numel()
        s1 = state["state1"]
        if s1.numel() != n:
            raise Zero8ValueError(f"{name} has {n} elements but its optimizer state1 has {s1.numel()}")
        _check_state_device(state, p, name)
        master = state.get("master")
        if master is not None and p.dtype == torch.float32:
            raise Zero8ValueError(f"{name} is {p.dtype} but its optimizer state has a float32 master copy (was "
                                  f"the parameter's dtype changed after its first step?)")
        if master is None and p.dtype != torch.float32 and self._config(group, owner, over)["master_weights"]:
            raise Zero8ValueError(f"{name} is {p.dtype} but its optimizer state lacks the float32 master copy "
                                  f"that master_weights=True asks for (was the parameter's dtype changed after "
                                  f"its first step, or master_weights set after it? It is decided then)")
        state["step"] += 1
        if n == 0:
            return
        if master is not None and not fresh:
            self._check_synced(p, master, work)
        hyper.step = state["step"]
        a = _C.StepArgs()
        a.algo = self.algo
        a.h = hyper
        a.n = n
        a.param = work.data_ptr()
        a.param_dtype = dtype_code(p, name)
        if master is not None:
            a.master = master.data_ptr()
        elif p.dtype != torch.float32:  # master_weights=False: a float32 copy for this step only
            step_master = work.to(torch.float32)  # row-major as work; held until the kernel has run
            a.master = step_master.data_ptr()
        a.grad = grad.data_ptr()
        a.grad_dtype = dtype_code(grad, f"{name}.grad")
        two = self._num_states == 2
        if s1.dtype == torch.uint8:
            a.bits = 8
            a.block = self._state_block(state, n)
            a.code1 = s1.data_ptr()
            a.absmax1 = state["absmax1"].data_ptr()
            a.map1 = self._state_map(1)
            if two:
                a.code2 = state["state2"].data_ptr()
                a.absmax2 = state["absmax2"].data_ptr()
                a.map2 = self._state_map(2)
        else:
            a.bits = 32
            a.state1 = s1.data_ptr()
            if two:
                a.state2 = state["state2"].data_ptr()
        if p.device.type == "cuda":  # queued on torch's current stream, no host sync (LAMB/LARS included)
            with on_device(p):
                _C.step_tensor_cuda(a, cuda_stream(p))
        else:
            _C.step_tensor(a)
        if strided:  # as the kernel's write: through .data, torch's version is not bumped
            p.data.copy_(work)
        if master is not None:  # the kernel writes through the pointer: torch's version is not bumped
            self._synced[id(p)] = _synced(p, master, work)
        if not strided and (master is not None or p.dtype == torch.float32):  # no per-step copy in `a`
            self._plans[id(p)] = _Plan(p, state, a, master)
        else:
            self._plans.pop(id(p), None)

    @staticmethod
    def _state_block(state: Dict[str, Any], n: int) -> int:
        """The block of an 8-bit state, from its number of scales (the state records its own layout, so a
        group's block_size changing later cannot misread it)."""
        nb = state["absmax1"].numel()
        if nb == 1:  # one block: the smallest power of two >= n that the kernels accept
            return max(64, 1 << max(0, (n - 1).bit_length()))
        return _infer_block(n, nb, "absmax1")

    # ---- state dicts ----

    def _bnb_group_aliases(self, group: Dict[str, Any]) -> Dict[str, Any]:
        """Keys bitsandbytes' optimizer of the same algorithm reads from a group (added to saved groups
        so that bitsandbytes can load zero8's state dicts): SGD's betas = (momentum, dampening), eps = 0."""
        return _algos.bnb_aliases(self._ROW, group) if self._ROW else {}

    def _from_bnb_group(self, saved: Dict[str, Any]) -> Dict[str, Any]:
        """This optimizer's group keys from bitsandbytes' aliases, for keys the saved group lacks; an argument
        accepted only at its default (RMSprop's momentum, bitsandbytes' betas[1]) is refused otherwise."""
        if self._ROW is None:
            return {}
        found = _algos.from_bnb_names(self._ROW, saved)
        out: Dict[str, Any] = {}
        for a in _algos.args(self._ROW):
            if a.first.role == "fixed":
                value = saved.get(a.name, found.get(a.name))
                if value is not None and value != a.default():
                    _unsupported(f"{a.name} (saved param group)", value, a.first.why)
            elif a.name in found:
                out[a.name] = found[a.name]
        return out

    def _check_saved_group(self, saved: Dict[str, Any], index: int) -> None:
        """Refuse a saved group whose torch.optim flags ask for an update this optimizer does not make, or
        that holds another algorithm's hyperparameters."""
        for flag in _TORCH_FLAGS_UNSUPPORTED:
            if saved.get(flag):
                _unsupported(f"{flag} (saved param_groups[{index}])", saved[flag],
                             f"{type(self).__name__} cannot continue an optimizer that used it")
        foreign = [k for k in _ALGO_GROUP_KEYS
                   if k in saved and k not in self._GROUP_KEYS and k not in self._BNB_ONLY_KEYS]
        if foreign:
            raise Zero8ValueError(f"saved param_groups[{index}] has {', '.join(foreign)}, which "
                                  f"{type(self).__name__} does not have: was this state dict saved by another "
                                  f"optimizer?")
        algorithm = saved.get(_ALGORITHM_KEY)
        if algorithm is not None and algorithm != self._ALGORITHM and algorithm not in self._LOADS_FROM:
            raise Zero8ValueError(f"saved param_groups[{index}] has {_ALGORITHM_KEY} = {algorithm!r}, which "
                                  f"{type(self).__name__} ({self._ALGORITHM}) cannot continue: was this state "
                                  f"dict saved by another optimizer?")

    def _check_saved_states(self, saved: Dict[str, Any], where: str) -> None:
        """Refuse a saved parameter state with another algorithm's states (or number of states)."""
        name = type(self).__name__
        own = self._TORCH_STATE_KEYS[:self.num_states]
        foreign = [k for k in _TORCH_STATE_NAMES if k not in own and saved.get(k) is not None]
        if self.num_states == 1 and saved.get("state2") is not None:
            foreign.append("state2")
        if foreign:
            raise Zero8ValueError(f"{where} holds {', '.join(foreign)}, which {name} does not keep: was this "
                                  f"state dict saved by another optimizer?")
        if self.num_states == 2:
            has = [saved.get(f"state{i}") is not None or saved.get(self._TORCH_STATE_KEYS[i - 1]) is not None
                   for i in (1, 2)]
            if has[0] != has[1]:
                i = 2 if has[0] else 1
                raise Zero8ValueError(f"{where} lacks state{i} ({self._TORCH_STATE_KEYS[i - 1]}), which {name} "
                                      f"keeps: was this state dict saved by another optimizer?")

    @torch._disable_dynamo
    def state_dict(self) -> Dict[str, Any]:
        """torch's state_dict (the live state tensors, parameters by index) with bitsandbytes' group
        aliases added (e.g. SGD's ``betas = (momentum, dampening)``), so bitsandbytes can load it, and the
        algorithm's name (group key ``zero8_algorithm``), so zero8 refuses to load it into another algorithm."""
        self._adopt_torch_states()
        sd = super().state_dict()
        for g in sd["param_groups"]:
            for k, v in self._bnb_group_aliases(g).items():
                g.setdefault(k, v)
            g[_ALGORITHM_KEY] = self._ALGORITHM
        return sd

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state dict saved by this optimizer (bit-exact: the next steps are identical), by
        bitsandbytes' optimizer of the same algorithm (flat or nested ``__bnb_optimizer_quant_state__``
        form), or by torch.optim's (``exp_avg``, ``momentum_buffer``...). Each state is converted to what
        this optimizer's config chooses for the parameter: 8-bit codes are kept as they are when the map
        and block size agree, and otherwise decoded and re-encoded; 8-bit <-> 32-bit converts values. The
        tensors are copied (the loaded optimizer never shares memory with the saved dict). A state dict
        with another algorithm's hyperparameters (SGD's momentum in AdamW...), states (a second moment
        in SGD, none in Adam) or name (zero8's ``zero8_algorithm`` group key: Lion's in SGD) is refused
        (Zero8ValueError), the optimizer unchanged. LAMB also loads Adam's and AdamW's, LARS SGD's. One pair
        cannot be told apart: bitsandbytes' Lion and SGD save the same group keys and state, so bitsandbytes'
        Lion8bit state dict loads into SGD (as it does into bitsandbytes' SGD8bit).
        """
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        if self._has_partitions():
            self._load_partitioned(state_dict)
            return
        groups = self.param_groups
        new_groups = self._loaded_groups(state_dict["param_groups"])
        saved_groups = state_dict["param_groups"]
        id_map = dict(zip(chain.from_iterable(g["params"] for g in saved_groups),
                          chain.from_iterable(g["params"] for g in groups)))
        group_of = {id(p): (gi, pi) for gi, g in enumerate(new_groups) for pi, p in enumerate(g["params"])}
        state: Dict[Any, Dict[str, Any]] = defaultdict(dict)
        for key, value in state_dict["state"].items():
            if key not in id_map:
                state[key] = value
                continue
            p = id_map[key]
            gi, pi = group_of[id(p)]
            state[p] = self._load_param_state(p, value, self._config(new_groups[gi], p),
                                              f"state[{key}] (param_groups[{gi}]['params'][{pi}])")
        self.__setstate__({"state": state, "param_groups": new_groups})
        for p in id_map.values():
            # The parameter stays the truth: without a record, the next step compares all its elements with
            # the rounding of the loaded master and re-seeds those that differ (weights loaded into the model
            # before this win, as in torch; the same checkpoint's weights keep the exact masters).
            self._synced.pop(id(_dt.local(p) if is_dtensor(p) else p), None)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _loaded_groups(self, saved_groups: list) -> list:
        """The param groups a load installs: each of this optimizer's groups (its params) with the saved
        group's hyperparameters (bitsandbytes' aliases mapped, torch.optim flags that do not apply dropped),
        checked; a saved group of another algorithm or with an unsupported flag is refused."""
        groups = self.param_groups
        saved_groups = copy.deepcopy(saved_groups)  # a tensor lr is updated in place by schedulers
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                             "optimizer's group")

        new_groups = []
        for index, (group, saved) in enumerate(zip(groups, saved_groups)):
            self._check_saved_group(saved, index)
            new = {k: v for k, v in group.items() if k != "params"}
            mapped = self._from_bnb_group(saved)
            for k, v in saved.items():
                if k == "params" or k == _ALGORITHM_KEY or k in self._BNB_ONLY_KEYS or k in _TORCH_GROUP_KEYS_DROPPED:
                    continue
                new[k] = v
            for k, v in mapped.items():
                if k not in saved:
                    new[k] = v
            new["params"] = group["params"]
            self._check_group(new, index)
            new_groups.append(new)
        return new_groups

    def _load_param_state(self, p: torch.Tensor, saved: Dict[str, Any], cfg: Dict[str, Any], where: str,
                          bits: Optional[int] = None) -> Dict[str, Any]:
        """Parameter p's state from a saved one (bits: 8 or 32 as decided for the parameter; by default
        _state_bits(p, cfg)). A DTensor's goes through _load_dtensor_state."""
        if is_dtensor(p):
            return self._load_dtensor_state(p, saved, cfg, where)
        if p.dtype not in FLOAT_DTYPES:
            raise Zero8ValueError(f"{where} is a state of a parameter of dtype {p.dtype}, which zero8 optimizers "
                                  f"do not step (float32, bfloat16 or float16)")
        saved = dict(saved)
        if isinstance(saved.get(_BNB_WRAPPER_KEY), dict):
            saved.update(saved.pop(_BNB_WRAPPER_KEY))
        self._check_saved_states(saved, where)
        n = p.numel()
        step = saved.get("step")
        if step is not None:
            step = int(step.item()) if isinstance(step, torch.Tensor) else int(step)
            if step < 0:
                raise Zero8ValueError(f"{where}: step {step} < 0")
        bits = self._state_bits(p, cfg) if bits is None else bits
        fresh = None
        out: Dict[str, Any] = {"step": step}
        block = cfg["block_size"]
        for i in range(1, self.num_states + 1):
            kind = self._state_map(i)
            found = self._saved_state(saved, i, n, where)
            if found is None:  # not saved (torch's SGD without momentum): start fresh
                if fresh is None:
                    fresh = self._new_state(p, cfg, bits)
                for k in (f"state{i}", f"absmax{i}", f"qmap{i}"):
                    if k in fresh:
                        out[k] = fresh[k]
                continue
            codes, absmax, qmap, values = found
            if out["step"] is None:
                # A state saved without a step (torch.optim.SGD's momentum_buffer, lion-pytorch's exp_avg):
                # it exists, so steps were taken and the next one is not the first, as torch resumes (SGD
                # and LARS would otherwise replace the loaded momentum by the gradient at step 1).
                out["step"] = 1
            if bits == 8 and codes is not None and absmax.numel() == -(-n // block) and _same_map(qmap, kind):
                # zero8's layout already: the codes and scales are kept bit for bit.
                out[f"state{i}"] = codes.reshape(p.shape)
                out[f"absmax{i}"] = absmax
                out[f"qmap{i}"] = _map(kind)
                continue
            if codes is not None:
                values = _decode(codes, absmax, qmap, n, f"{where}: absmax{i}")
            if bits == 8:
                codes, absmax = _encode(values, block, kind)
                out[f"state{i}"] = codes.reshape(p.shape)
                out[f"absmax{i}"] = absmax
                out[f"qmap{i}"] = _map(kind)
            else:
                out[f"state{i}"] = values.reshape(p.shape)
        if out["step"] is None:  # nothing saved (torch's SGD without momentum): a fresh start
            out["step"] = 0
        if p.dtype != torch.float32 and cfg["master_weights"]:
            master = saved.get("master")
            if isinstance(master, torch.Tensor):
                if master.numel() != n:
                    raise Zero8ValueError(f"{where}: master has {master.numel()} elements; the parameter has {n}")
                out["master"] = master.detach().to(torch.float32).reshape(p.shape).contiguous().clone()
            else:  # bitsandbytes and torch keep none: the parameter's value is the best master there is
                out["master"] = p.detach().to(torch.float32).contiguous().clone()
        # Each state on its parameter's device, as torch.optim loads (saved on a GPU, loaded on the CPU, and back).
        for key, value in out.items():
            if isinstance(value, torch.Tensor):
                out[key] = (_map(_SIGNED if key == "qmap1" else _UNSIGNED, p.device) if key.startswith("qmap")
                            else value.to(p.device))
        return out  # other saved keys (bitsandbytes' unorm_vec, torch's max_exp_avg_sq; a master under
        # master_weights=False, the parameter being the truth) have no use here

    def _load_dtensor_state(self, p: torch.Tensor, saved: Dict[str, Any], cfg: Dict[str, Any],
                            where: str) -> Dict[str, Any]:
        """DTensor p's state from a saved one: its states as DTensors (torch.distributed.checkpoint's sharded
        state dicts, redistributed where their placements differ) or whole tensors (a full state dict: a plain
        zero8, bitsandbytes or torch.optim state, or a DTensor state gathered), cut to this rank's shard and
        loaded by _load_param_state's rules for the local shard; 8-bit codes whose blocks do not lie on this
        layout are decoded first (zero8.optim.dtensor)."""
        self._check_dtensor_param(p, where)
        saved = dict(saved)
        if isinstance(saved.get(_BNB_WRAPPER_KEY), dict):
            saved.update(saved.pop(_BNB_WRAPPER_KEY))
        self._check_saved_states(saved, where)
        bits, block = self._state_bits(p, cfg), cfg["block_size"]
        if bits == 8:
            _dt.check_grid(p, block, where)
        tag = saved.pop(_dt.BLOCK_KEY, None)
        shaped = ("state1", "state2", "master") + self._TORCH_STATE_KEYS  # tensors of the parameter's shape
        local: Dict[str, Any] = {}
        for key, v in saved.items():
            if key not in shaped or not isinstance(v, torch.Tensor):
                if not key.startswith("absmax"):  # cut with their codes
                    local[key] = v  # step, qmaps (whole on every rank), keys a load does not read
                continue
            if key in ("state1", "state2") and v.dtype == torch.uint8:
                local.update(self._local_codes(p, saved, int(key[-1]), block, where))
                continue
            if tag and key in ("state1", "state2"):
                raise Zero8ValueError(
                    f"{where}: {key} was saved as 8-bit codes in blocks of {tag} but arrives as {v.dtype}: "
                    f"torch.distributed.checkpoint copies a checkpoint's tensors into this optimizer's own states, "
                    f"which are {bits}-bit{f' in blocks of {block}' if bits == 8 else ''} here, and cannot "
                    f"convert them. Load with the optim_bits, block_size and min_8bit_size of the run that saved "
                    f"it, or through a full state dict (StateDictOptions(full_state_dict=True))")
            local[key] = _dt.local_of(v, p, p.shape, f"{where}: {key}")
        out = self._load_param_state(_dt.local(p), local, cfg, where, bits)
        return self._as_dtensor_state(p, out, block if bits == 8 else 0)

    def _local_codes(self, p: torch.Tensor, saved: Dict[str, Any], i: int, block: int, where: str) -> Dict[str, Any]:
        """This rank's part of DTensor p's saved 8-bit state i: its codes and block scales when they lie on the
        layout of zero8.optim.dtensor in blocks of `block`, else its float32 values (decoded locally when the
        saved blocks lie on the parameter's last dimension, else from the whole tensor)."""
        codes, absmax = saved[f"state{i}"], saved.get(f"absmax{i}")
        if not isinstance(absmax, torch.Tensor):
            raise Zero8ValueError(f"{where}: state{i} holds 8-bit codes but absmax{i} is missing")
        qmap = saved.get(f"qmap{i}")
        qmap = _map(self._state_map(i)) if qmap is None else qmap.detach().to("cpu", torch.float32).reshape(-1)
        lp = _dt.local(p)
        saved_block = _infer_block(p.numel(), absmax.numel(), f"{where}: absmax{i}")
        if _dt.eight_bit_fits(p, saved_block) and _dt.grid_error(p, saved_block, where) is None:
            c = _dt.local_of(codes, p, p.shape, f"{where}: state{i}")
            a = _dt.local_of(absmax, p, _dt.absmax_shape(p.shape, saved_block), f"{where}: absmax{i}").reshape(-1)
            if saved_block == block:  # kept as they are where the maps agree (_load_param_state)
                return {f"state{i}": c, f"absmax{i}": a, f"qmap{i}": qmap}
            values = qmap.to(c.device)[c.reshape(-1).long()] * a.repeat_interleave(saved_block)[:c.numel()]
            return {f"state{i}": values.reshape(lp.shape)}
        # Blocks across the shards (a whole-tensor state of a parameter whose last dimension is not a multiple of
        # its block): decoded whole (a DTensor gathered: every rank loads the same parameters in the same order).
        full = [t.full_tensor() if is_dtensor(t) else t for t in (codes, absmax)]
        values = _decode(full[0].cpu(), full[1].cpu(), qmap, p.numel(), f"{where}: absmax{i}")
        return {f"state{i}": _dt.local_of(values, p, p.shape, f"{where}: state{i}")}

    def _saved_state(self, saved: Dict[str, Any], i: int, n: int, where: str):
        """State i of a saved parameter state as (codes, absmax, qmap, None) for 8-bit codes (a missing
        qmap is zero8's map for state i) or (None, None, None, float32 values); None when not saved.
        Copies, flattened, on the CPU."""
        key = f"state{i}"
        value = saved.get(key)
        if value is None and len(self._TORCH_STATE_KEYS) >= i:
            key = self._TORCH_STATE_KEYS[i - 1]
            value = saved.get(key)
        if value is None:
            return None
        if not isinstance(value, torch.Tensor):
            raise Zero8ValueError(f"{where}: {key} must be a tensor, got {type(value).__name__}")
        if value.numel() != n:
            raise Zero8ValueError(f"{where}: {key} has {value.numel()} elements; the parameter has {n}")
        value = value.detach().to("cpu")
        if value.dtype != torch.uint8:
            return None, None, None, value.to(torch.float32).reshape(-1).contiguous().clone()
        absmax = saved.get(f"absmax{i}")
        if not isinstance(absmax, torch.Tensor):
            raise Zero8ValueError(f"{where}: {key} holds 8-bit codes but absmax{i} is missing")
        absmax = absmax.detach().to("cpu", torch.float32).reshape(-1).contiguous().clone()
        qmap = saved.get(f"qmap{i}")
        qmap = _map(self._state_map(i)) if qmap is None else qmap.detach().to("cpu", torch.float32)
        qmap = qmap.reshape(-1)
        if qmap.numel() != 256:
            raise Zero8ValueError(f"{where}: qmap{i} has {qmap.numel()} values; a code map has 256")
        _infer_block(n, absmax.numel(), f"{where}: absmax{i}")  # a consistent layout, or a clear error
        return value.reshape(-1).contiguous().clone(), absmax, qmap, None
