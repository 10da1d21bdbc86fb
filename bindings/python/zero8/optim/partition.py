"""zero8.optim's optimizers on DeepSpeed's flat fp32 partitions (ZeRO stage 1/2, and its BF16_Optimizer).

DeepSpeed's ZeRO optimizer replaces each param group's parameters by ONE flat fp32 tensor, this rank's
partition of the group's parameters laid end to end (cut at arbitrary elements, padded at the end), and
steps the client optimizer on it. Stepped as one tensor, its 8-bit blocks would straddle parameters, and the
per-parameter rules (``min_8bit_size`` on the whole parameter, 32-bit states for embeddings and for
``override_config`` / ``GlobalOptimManager`` overrides, per-parameter hyperparameters) would not apply.
DeepSpeed records which piece of which model parameter lies where in the partition, on the model parameter
itself (``p._hp_mapping``: the fragment's first element in the partition and in the parameter, and its
length); ``PartitionedStates`` reads that record and steps the partition as *segments*, one per parameter
fragment, each with the states its whole parameter would get:

- 8-bit or 32-bit from the parameter's config and its WHOLE size, as ``zero8.optim`` decides for a
  parameter it is given (``Optimizer8bit._state_bits``);
- 8-bit blocks on the parameter's own grid: block b covers its elements [b*B, (b+1)*B), so no block straddles
  two parameters, and a parameter cut by a partition boundary has one block cut in two (a scale each side);
- hyperparameters from its group, the global overrides and this optimizer's.

A partition's state (``self.state[flat]``) holds ``step``; ``state1``/``absmax1``/``qmap1`` (and ``2``): the
8-bit segments' codes end to end, their block scales and maps (bitsandbytes' key names); ``fp32_state1``
(and ``2``): the 32-bit segments' values end to end; ``zero8_segments``: the layout, one
``(name, start, numel, offset, bits, block)`` per segment, so a state dict says what its bytes are. Padding
has no state. DeepSpeed saves ``state_dict()`` per rank and gives it back at the same world size
(``load_state_dict``: bit-exact when the layout is the same, else decoded and re-encoded per segment). It
also accepts torch.optim's states of the partition (``exp_avg``, ``exp_avg_sq``...: a ZeRO checkpoint of
torch's AdamW) and those of a zero8 optimizer that stepped the partition as one tensor, quantized per
segment. DeepSpeed's universal-checkpoint load writes torch's names into the state directly; they are
quantized per segment at the next ``step()`` or ``state_dict()``.

ZeRO-3 steps the client optimizer on one flat fp32 partition per sub-group of a param group (its params are
empty otherwise), each holding the rank's piece of every parameter of the sub-group: elements
``[rank * partition_numel(), ...)`` of each, laid end to end, the last rank's padded. Its parameters carry no
``_hp_mapping``; the partition's ``ds_id`` ("<first>_<last>", the sub-group's first and last parameters'
ds_ids) names the run of the group's parameters it holds, and each parameter's ``partition_numel()``,
``ds_numel`` and partition rank give its piece (``_zero3_fragments``). Every parameter is cut between the
ranks, so an 8-bit one's piece usually begins and ends inside a block, each end with a scale of its own.

Limits: LAMB's and LARS's trust ratio is a norm over the parameter; for a parameter cut by a partition
boundary it is taken over this rank's fragment (a warning names such parameters), one ratio over all of it: an
8-bit fragment that begins inside a block (its head, with a scale of its own) steps in one kernel call on a
copy that starts on the parameter's block grid, padded in front with zeros, which add nothing to either norm
(the copies are made only for such fragments, and on a GPU queued on the step's stream with no host wait).
``master_weights`` overrides do not apply (DeepSpeed keeps the fp32 masters; a warning names the tensor). DeepSpeed's
``elastic_checkpoint`` (it cuts every state tensor of the partition by the padding) is not supported.

Devices: a partition on a GPU steps with the CUDA kernels on torch's current stream, its states on its device
(the layout and any re-encoding are made on the CPU, once).
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from .. import _C
from .._C import Zero8ValueError
from .._tensors import check_device, check_same_device, cuda_stream, dtype_code, on_device

__all__ = ["LAYOUT_KEY", "PartitionedStates", "Segment", "decode_partition_state", "whole_numel"]

LAYOUT_KEY = "zero8_segments"  # the partition state's layout record (see the module docstring)
_INSIDE = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (__file__, torch.__file__))


def caller_stacklevel() -> int:
    """warnings.warn's stacklevel, for the function that calls this, of the first frame outside zero8.optim and
    torch: the code that called step() (or a load), through however many frames torch's wrappers add (no_grad,
    dynamo's disable, the step hooks; Python 3.12's skip_file_prefixes would skip them)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    return level


class Segment(NamedTuple):
    """One parameter fragment of a partition: elements [start, start + numel) of the flat partition are
    elements [offset, offset + numel) of the parameter `param` (named `name`); its states are `bits`-bit, in
    blocks of `block` on the parameter's grid. `first` is its first code (8-bit) or float (32-bit) in the
    partition's state buffers, `scale` its first block scale (8-bit)."""

    param: torch.Tensor
    name: str
    start: int
    numel: int
    offset: int
    bits: int
    block: int
    first: int
    scale: int

    def record(self) -> Tuple[str, int, int, int, int, int]:
        return (self.name, self.start, self.numel, self.offset, self.bits, self.block)

    def pieces(self):
        """(first element in the segment, count, first block scale relative to the segment's) of the kernel
        calls that step it on its parameter's block grid: a head cut by the partition boundary is one call
        of a single partial block, the rest another (block-aligned on the parameter)."""
        if self.bits != 8:
            yield 0, self.numel, 0
            return
        head = min(self.numel, (-self.offset) % self.block)
        if head:
            yield 0, head, 0
        if self.numel > head:
            yield head, self.numel - head, 1 if head else 0

    def head_cut(self) -> bool:
        """Whether an 8-bit segment has two pieces: a head block cut by the partition boundary, and more."""
        return self.bits == 8 and 0 < (-self.offset) % self.block < self.numel

    def num_scales(self) -> int:
        if self.bits != 8 or self.numel == 0:
            return 0
        head = min(self.numel, (-self.offset) % self.block)
        return (1 if head else 0) + -(-(self.numel - head) // self.block)


@functools.lru_cache(maxsize=None)
def _zero_code(kind) -> int:
    """The 8-bit code of 0.0 in map `kind` (the padding of _step_padded)."""
    return _C.map_values(kind).index(0.0)


class _Partition(NamedTuple):
    segments: Tuple[Segment, ...]
    n8: int  # codes of the 8-bit segments
    scales: int  # their block scales
    n32: int  # values of the 32-bit segments

    def record(self) -> tuple:
        return tuple(s.record() for s in self.segments)


def _hp_fragment(p: torch.Tensor):
    """DeepSpeed's (start in the partition, start in p, numel) of model parameter p's fragment on this rank,
    None when this rank holds none of p; raises AttributeError when DeepSpeed never mapped p."""
    m = p._hp_mapping
    if m is None:
        return None
    hp = m.get_hp_fragment_address()
    return int(hp.start), int(m.lp_fragment_address.start), int(hp.numel)


def _hp_fragments(params: list) -> list:
    """((start in the partition, start in the parameter, numel), index, parameter) of each fragment of `params`
    (a group's own parameters) that DeepSpeed's ZeRO 1/2 mapping puts in this rank's partition, by start."""
    found = []
    for i, q in enumerate(params):
        if not q.requires_grad:
            continue  # DeepSpeed does not partition frozen parameters
        try:
            frag = _hp_fragment(q)
        except AttributeError:
            continue
        if frag is not None and frag[2] > 0:
            found.append((frag, i, q))
    return sorted(found, key=lambda f: f[0][0])


def whole_numel(p: torch.Tensor) -> int:
    """The elements of model parameter p: under ZeRO-3 its tensor is empty outside the forward and backward that
    gather it, and ``ds_numel`` is its size."""
    n = getattr(p, "ds_numel", None)
    return int(n) if n is not None else p.numel()


def _is_zero3_partition(p: torch.Tensor, params: list) -> bool:
    """Whether p is ZeRO-3's fp32 partition of a sub-group of `params` (a group's own parameters): DeepSpeed
    names it by the ds_ids of the sub-group's first and last parameters, "<first>_<last>"."""
    ds_id = getattr(p, "ds_id", None)
    return isinstance(ds_id, str) and any(hasattr(q, "ds_tensor") for q in params)


def _zero3_fragments(p: torch.Tensor, params: list, where: str) -> list:
    """((start in the partition, start in the parameter, numel), index, parameter) of each parameter fragment
    in ZeRO-3's fp32 partition p: its sub-group is the run of the group's trainable parameters from the ds_id
    before p.ds_id's "_" to the one after (DeepSpeed cuts a group's trainable parameters into sub-groups in
    order), and each of them holds ``partition_numel()`` elements of the partition, the rank's piece of the
    parameter from ``rank * partition_numel()`` (DeepSpeed partitions every parameter evenly, the last rank's
    piece padded)."""
    first, _, last = p.ds_id.partition("_")
    index = {str(getattr(q, "ds_id", "")): i for i, q in enumerate(params)}
    if first not in index or last not in index or index[first] > index[last]:
        raise Zero8ValueError(f"{where}: DeepSpeed's ZeRO-3 partition names the parameters {p.ds_id!r} by ds_id, "
                              f"which are not a run of this optimizer's parameter group")
    found, start = [], 0
    for i in range(index[first], index[last] + 1):
        q = params[i]
        if not q.requires_grad:
            continue  # DeepSpeed partitions the trainable parameters only
        size = int(q.partition_numel())
        rank = int(q.ds_zero_partition_rank) if hasattr(q, "ds_zero_partition_rank") else \
            torch.distributed.get_rank(group=q.ds_process_group)
        offset = rank * size
        numel = max(0, min(size, whole_numel(q) - offset))
        if numel:
            found.append(((start, offset, numel), i, q))
        start += size
    if start != p.numel():
        raise Zero8ValueError(f"{where}: DeepSpeed's ZeRO-3 partition holds {p.numel()} elements, its parameters' "
                              f"pieces {start}: the optimizer's parameter group is not the one DeepSpeed partitioned")
    return found


def decode_partition_state(state: Dict[str, Any], record, numel: int, num_states: int,
                           where: str) -> List[torch.Tensor]:
    """float32 values over a partition of `numel` elements, one tensor per state, from a partition state
    saved with layout `record` (its ``zero8_segments``; elements of no segment, the padding: 0). Needs no
    optimizer: the checkpoint converters read saved states with it."""
    from .optimizer import _decode
    out = []
    for i in range(1, num_states + 1):
        flat = torch.zeros(numel, dtype=torch.float32)
        first8 = first32 = scale = 0
        for name, start, n, offset, bits, block in record:
            if start + n > numel:
                raise Zero8ValueError(f"{where}: segment {name} ends at element {start + n}, past the partition's "
                                      f"{numel}: was the state saved at another world size?")
            if bits == 8:
                codes, absmax = state[f"state{i}"].reshape(-1), state[f"absmax{i}"].reshape(-1)
                qmap = state[f"qmap{i}"].reshape(-1).to(torch.float32)
                seg = Segment(None, name, start, n, offset, 8, block, first8, scale)
                for at, k, sc in seg.pieces():
                    nb = -(-k // block)
                    flat[start + at:start + at + k] = _decode(
                        codes[first8 + at:first8 + at + k], absmax[scale + sc:scale + sc + nb], qmap, k,
                        f"{where}: {name}")
                first8 += n
                scale += seg.num_scales()
            else:
                flat[start:start + n] = state[f"fp32_state{i}"].reshape(-1)[first32:first32 + n].to(torch.float32)
                first32 += n
        out.append(flat)
    return out


class PartitionedStates:
    """The flat-partition support of ``Optimizer8bit`` (see the module docstring). The optimizer records each
    group's own parameters at construction (``_record_model_params``); a group whose parameters DeepSpeed
    replaced by its flat partition is stepped, saved and loaded by segments."""

    def _record_model_params(self) -> None:
        """The parameters each group was given (DeepSpeed replaces them with the partition later)."""
        self._model_params: List[Tuple[dict, list, set]] = [
            (g, list(g["params"]), {id(p) for p in g["params"]}) for g in self.param_groups]
        self._partitions: Dict[int, _Partition] = {}  # id(flat) -> layout, made at its first step or load
        self._partition_warned: set = set()
        if not hasattr(self, "_param_names"):
            self._param_names: Dict[int, str] = {}

    def set_param_names(self, named) -> None:
        """Names for messages and the saved layout: an iterable of (name, tensor), such as
        ``model.named_parameters()`` (zero8.deepspeed passes them)."""
        self._param_names = {id(p): str(n) for n, p in named}

    def _known_params(self) -> set:
        ids = {id(p) for g in self.param_groups for p in g["params"]}
        for _, _, own in getattr(self, "_model_params", ()):
            ids.update(own)
        return ids

    def _model_params_of(self, group: dict) -> Optional[Tuple[list, set]]:
        for g, params, ids in getattr(self, "_model_params", ()):
            if g is group:
                return params, ids
        return None

    def _param_name(self, p: torch.Tensor, group: dict, i: int) -> str:
        name = getattr(self, "_param_names", {}).get(id(p))
        if name is not None:
            return name
        names = group.get("param_names")
        if names is not None and i < len(names):
            return str(names[i])
        return f"parameter {i} of shape {tuple(p.shape)}"

    # ---- the layout ----

    def _is_partition(self, p: torch.Tensor, group: dict) -> bool:
        """Whether p is DeepSpeed's flat partition of `group`: not one of the group's own parameters, while
        those carry DeepSpeed's mapping."""
        return self._partition_test(group)(p)

    def _partition_test(self, group: dict) -> Callable[[torch.Tensor], bool]:
        """_is_partition for the tensors of one group, its lookups made once (step() asks it of every
        parameter at every step)."""
        partitions = getattr(self, "_partitions", {})  # filled in place as partitions are first stepped
        own = self._model_params_of(group)
        if own is None:
            return lambda p: id(p) in partitions
        params, ids = own
        mapped = any(hasattr(q, "_hp_mapping") for q in params)
        return lambda p: id(p) in partitions or (id(p) not in ids and (mapped or _is_zero3_partition(p, params)))

    def _partition(self, p: torch.Tensor, group: dict, gi: int) -> _Partition:
        """The segments of partition p (made once: DeepSpeed's mapping and the parameters' configs are read
        the first time p is stepped or loaded)."""
        part = self._partitions.get(id(p))
        if part is not None:
            return part
        own = self._model_params_of(group)[0]
        found = _zero3_fragments(p, own, f"param_groups[{gi}]") if _is_zero3_partition(p, own) else _hp_fragments(own)
        segments = []
        n8 = scales = n32 = 0
        end = 0
        lamb_cut = []
        trust = self._trust_ratio()
        for (start, offset, numel), i, q in found:
            name = self._param_name(q, group, i)
            if start < end or start + numel > p.numel() or offset + numel > whole_numel(q):
                raise Zero8ValueError(
                    f"param_groups[{gi}]: DeepSpeed's mapping puts {name} (elements [{offset}, {offset + numel}) of "
                    f"{whole_numel(q)}) at [{start}, {start + numel}) of a partition of {p.numel()} elements, "
                    f"overlapping another parameter or outside it")
            end = start + numel
            cfg = self._config(group, q)
            self._warn_unhonoured(q, name)
            bits = self._state_bits(q, cfg)
            block = cfg["block_size"]
            if bits == 8:
                seg = Segment(q, name, start, numel, offset, 8, block, n8, scales)
                n8 += numel
                scales += seg.num_scales()
            else:
                seg = Segment(q, name, start, numel, offset, 32, block, n32, 0)
                n32 += numel
            if trust and numel < whole_numel(q):
                lamb_cut.append(name)
            segments.append(seg)
        if lamb_cut:
            warnings.warn(
                f"{type(self).__name__}: DeepSpeed cut {', '.join(lamb_cut)} between ranks; the trust ratio of "
                f"{'each' if len(lamb_cut) > 1 else 'that'} parameter is taken over this rank's fragment only",
                stacklevel=caller_stacklevel())
        part = _Partition(tuple(segments), n8, scales, n32)
        self._partitions[id(p)] = part
        return part

    def _trust_ratio(self) -> bool:
        from . import _algos
        return bool(_algos.spec(self._ROW).trust_ratio) if self._ROW else False

    def _warn_unhonoured(self, q: torch.Tensor, name: str) -> None:
        over = self.overrides_for(q)
        if "master_weights" in over and id(q) not in self._partition_warned:
            self._partition_warned.add(id(q))
            warnings.warn(
                f"{type(self).__name__}: the override master_weights={over['master_weights']} of {name} does not "
                f"apply under DeepSpeed, which keeps an fp32 master partition of every parameter itself",
                stacklevel=caller_stacklevel())

    def _state_bits(self, p, cfg):  # Optimizer8bit's
        raise NotImplementedError

    def partition_segments(self, p: torch.Tensor) -> Tuple[Segment, ...]:
        """The segments of DeepSpeed partition `p` (a tensor of ``param_groups[i]['params']``, or a ZeRO-3
        partition stepped before: DeepSpeed puts those in the groups only to step, save and load them), made if
        needed: for tests and tools that look at the layout."""
        part = getattr(self, "_partitions", {}).get(id(p))
        if part is not None:
            return part.segments
        for gi, g in enumerate(self.param_groups):
            if any(q is p for q in g["params"]):
                if not self._is_partition(p, g):
                    raise Zero8ValueError(f"param_groups[{gi}] holds no DeepSpeed partition")
                return self._partition(p, g, gi).segments
        raise Zero8ValueError("partition_segments: the tensor is in no param group of this optimizer")

    # ---- states ----

    def _partition_new_state(self, p: torch.Tensor, part: _Partition, group: dict) -> Dict[str, Any]:
        init = self._initial_value(self._config(group, p))
        state: Dict[str, Any] = {"step": 0, LAYOUT_KEY: part.record()}
        values = torch.full((p.numel(),), init, dtype=torch.float32) if init != 0.0 else None
        if values is not None:
            self._partition_encode(state, part, [values] * self.num_states)
            return state
        for i in range(1, self.num_states + 1):
            if part.n8:
                state[f"state{i}"] = torch.zeros(part.n8, dtype=torch.uint8)
                state[f"absmax{i}"] = torch.zeros(part.scales, dtype=torch.float32)
                state[f"qmap{i}"] = self._map_tensor(i)
            if part.n32:
                state[f"fp32_state{i}"] = torch.zeros(part.n32, dtype=torch.float32)
        return state

    def _map_tensor(self, i: int) -> torch.Tensor:
        from .optimizer import _map
        return _map(self._state_map(i))

    def _partition_encode(self, state: Dict[str, Any], part: _Partition, flats: List[torch.Tensor]) -> None:
        """The states of the segments from float32 values over the whole partition (one per state)."""
        from .optimizer import _encode
        for i, flat in enumerate(flats, start=1):
            flat = flat.detach().to("cpu", torch.float32).reshape(-1)
            if part.n8:
                codes = torch.empty(part.n8, dtype=torch.uint8)
                absmax = torch.empty(part.scales, dtype=torch.float32)
                kind = self._state_map(i)
                for s in part.segments:
                    if s.bits != 8:
                        continue
                    for at, n, sc in s.pieces():
                        c, a = _encode(flat[s.start + at:s.start + at + n], s.block, kind)
                        codes[s.first + at:s.first + at + n] = c
                        absmax[s.scale + sc:s.scale + sc + a.numel()] = a
                state[f"state{i}"] = codes
                state[f"absmax{i}"] = absmax
                state[f"qmap{i}"] = self._map_tensor(i)
            if part.n32:
                values = torch.empty(part.n32, dtype=torch.float32)
                for s in part.segments:
                    if s.bits == 32:
                        values[s.first:s.first + s.numel] = flat[s.start:s.start + s.numel]
                state[f"fp32_state{i}"] = values

    def _partition_decode(self, state: Dict[str, Any], record: tuple, numel: int, where: str) -> List[torch.Tensor]:
        return decode_partition_state(state, record, numel, self.num_states, where)

    def _partition_state_from(self, p: torch.Tensor, part: _Partition, saved: Dict[str, Any], group: dict,
                              where: str) -> Dict[str, Any]:
        """This optimizer's state of partition p from a saved one: zero8's with the same layout (copied bit for
        bit) or another (decoded, re-encoded per segment); torch.optim's (exp_avg...) or that of an optimizer
        that stepped the partition as one tensor (state1/absmax1 over the whole partition), encoded per
        segment."""
        from .optimizer import _BNB_WRAPPER_KEY
        saved = dict(saved)
        if isinstance(saved.get(_BNB_WRAPPER_KEY), dict):
            saved.update(saved.pop(_BNB_WRAPPER_KEY))
        step = saved.get("step", 0)
        step = int(step.item()) if isinstance(step, torch.Tensor) else int(step or 0)
        n = p.numel()
        record = saved.get(LAYOUT_KEY)
        if record is not None:
            record = tuple(tuple(r) for r in record)
            if record == part.record():  # this layout: the saved bytes as they are
                out: Dict[str, Any] = {"step": step, LAYOUT_KEY: record}
                sizes = {}
                for i in range(1, self.num_states + 1):
                    if part.n8:
                        sizes.update({f"state{i}": part.n8, f"absmax{i}": part.scales, f"qmap{i}": 256})
                    if part.n32:
                        sizes[f"fp32_state{i}"] = part.n32
                for k, size in sizes.items():
                    v = saved.get(k)
                    if not isinstance(v, torch.Tensor) or v.numel() != size:
                        raise Zero8ValueError(f"{where}: {k} should be a tensor of {size} elements for its layout, "
                                              f"got {tuple(v.shape) if isinstance(v, torch.Tensor) else v!r}")
                    out[k] = v.detach().to("cpu").reshape(-1).clone()
                return out
            flats = self._partition_decode(saved, record, n, where)
        else:
            flats = []
            self._check_saved_states(saved, where)
            for i in range(1, self.num_states + 1):
                flats.append(self._whole_partition_values(saved, i, n, where))
            if any(f is None for f in flats):
                if all(f is None for f in flats):
                    return self._partition_new_state(p, part, group)
                raise Zero8ValueError(f"{where}: only some of the optimizer's states are saved")
        out = {"step": step, LAYOUT_KEY: part.record()}
        self._partition_encode(out, part, flats)
        return out

    def _whole_partition_values(self, saved: Dict[str, Any], i: int, n: int, where: str) -> Optional[torch.Tensor]:
        """State i of a saved state of the partition as one tensor (torch's name or bitsandbytes'), float32 of n
        elements (a state saved without the padding is padded with zeros); None when not saved."""
        from .optimizer import _decode, _infer_block
        key = f"state{i}"
        value = saved.get(key)
        if value is None and len(self._TORCH_STATE_KEYS) >= i:
            key = self._TORCH_STATE_KEYS[i - 1]
            value = saved.get(key)
        if value is None:
            return None
        if not isinstance(value, torch.Tensor):
            raise Zero8ValueError(f"{where}: {key} must be a tensor, got {type(value).__name__}")
        value = value.detach().to("cpu").reshape(-1)
        m = value.numel()
        if m > n:
            raise Zero8ValueError(f"{where}: {key} has {m} elements; this rank's partition has {n}: was it saved "
                                  f"at another world size or with other parameters?")
        if value.dtype == torch.uint8:
            absmax = saved.get(f"absmax{i}")
            if not isinstance(absmax, torch.Tensor):
                raise Zero8ValueError(f"{where}: {key} holds 8-bit codes but absmax{i} is missing")
            absmax = absmax.detach().to("cpu", torch.float32).reshape(-1)
            qmap = saved.get(f"qmap{i}")
            qmap = self._map_tensor(i) if qmap is None else qmap.detach().to("cpu", torch.float32).reshape(-1)
            _infer_block(m, absmax.numel(), f"{where}: absmax{i}")
            value = _decode(value, absmax, qmap, m, f"{where}: absmax{i}")
        flat = torch.zeros(n, dtype=torch.float32)
        flat[:m] = value.to(torch.float32)
        return flat

    def _adopt_torch_states(self) -> None:
        """Quantize the torch.optim states DeepSpeed's universal-checkpoint load wrote into a partition's state
        (exp_avg, exp_avg_sq as float32 over the partition, and step), and drop the torch.optim group flags it
        copied into the groups. A no-op when there are none."""
        if not getattr(self, "_model_params", None):
            return
        names = set(self._TORCH_STATE_KEYS)
        if not names:
            return
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                state = self.state.get(p)
                if not state or not names.intersection(state) or not self._is_partition(p, group):
                    continue
                where = f"param_groups[{gi}] (DeepSpeed partition)"
                self._clean_loaded_group(group, gi)
                part = self._partition(p, group, gi)
                loaded = {k: v for k, v in state.items() if k in names or k == "step"}
                new = _placed(self._partition_state_from(p, part, loaded, group, where), p.device)
                state.clear()
                state.update(new)

    def _clean_loaded_group(self, group: dict, gi: int) -> None:
        from .optimizer import _ALGORITHM_KEY, _TORCH_GROUP_KEYS_DROPPED
        self._check_saved_group(group, gi)
        for k in list(group):
            if k == _ALGORITHM_KEY or k in _TORCH_GROUP_KEYS_DROPPED or k in self._BNB_ONLY_KEYS:
                del group[k]

    # ---- step ----

    def _step_partition(self, p: torch.Tensor, group: dict, gi: int) -> None:
        """One step of DeepSpeed partition p of param_groups[gi], segment by segment."""
        where = f"param_groups[{gi}] (DeepSpeed partition of {p.numel()} elements)"
        check_device(p, where)
        grad = p.grad
        check_same_device(grad, f"{where}.grad", p, where)
        if p.dtype != torch.float32 or not p.is_contiguous() or grad.shape != p.shape or not grad.is_contiguous():
            raise Zero8ValueError(f"{where}: expected a contiguous float32 partition and a gradient of its shape, got "
                                  f"{p.dtype} {tuple(p.shape)} and {grad.dtype} {tuple(grad.shape)}")
        part = self._partition(p, group, gi)
        state = self.state[p]
        if not state:
            state.update(_placed(self._partition_new_state(p, part, group), p.device))
        _check_placed(state, p, where)
        state["step"] += 1
        step = state["step"]
        group_hyper = None
        from .optimizer import GlobalOptimManager
        check = GlobalOptimManager.get_instance().has_overrides() or len(self._overrides) > 0
        grad_code = dtype_code(grad, f"{where}.grad")
        trust = self._trust_ratio()
        states = range(1, self.num_states + 1)
        stream = cuda_stream(p) if p.device.type == "cuda" else 0  # torch's current one: ordered with DeepSpeed's
        for s in part.segments:
            if check and self.overrides_for(s.param):
                hyper = self._hyper(self._config(group, s.param))
            else:
                if group_hyper is None:
                    group_hyper = self._hyper(self._config(group, s.param, {}))
                hyper = group_hyper
            hyper.step = step
            if trust and s.head_cut():  # one trust ratio over the fragment: one call, not one per piece
                self._step_padded(s, p, grad, state, hyper, grad_code, stream)
                continue
            for at, n, sc in s.pieces():
                if s.bits == 8:
                    codes = [state[f"state{i}"].data_ptr() + s.first + at for i in states]
                    scales = [state[f"absmax{i}"].data_ptr() + 4 * (s.scale + sc) for i in states]
                    floats = []
                else:
                    codes, scales = [], []
                    floats = [state[f"fp32_state{i}"].data_ptr() + 4 * (s.first + at) for i in states]
                a = self._segment_args(s, hyper, n, p.data_ptr() + 4 * (s.start + at),
                                       grad.data_ptr() + grad.element_size() * (s.start + at), grad_code,
                                       codes, scales, floats)
                _launch(a, p, stream)

    def _segment_args(self, s: Segment, hyper, n: int, param: int, grad: int, grad_code, codes: List[int],
                      scales: List[int], floats: List[int]) -> "_C.StepArgs":
        """The kernel's arguments for n elements of segment s at pointers param (float32) and grad: 8-bit
        states at codes and scales (one pointer per state), or 32-bit ones at floats."""
        a = _C.StepArgs()
        a.algo = self.algo
        a.h = hyper
        a.n = n
        a.param = param
        a.param_dtype = _C.DType.f32
        a.grad = grad
        a.grad_dtype = grad_code
        if s.bits == 8:
            a.bits = 8
            a.block = s.block
            a.code1, a.absmax1, a.map1 = codes[0], scales[0], self._state_map(1)
            if len(codes) == 2:
                a.code2, a.absmax2, a.map2 = codes[1], scales[1], self._state_map(2)
        else:
            a.bits = 32
            a.state1 = floats[0]
            if len(floats) == 2:
                a.state2 = floats[1]
        return a

    def _step_padded(self, s: Segment, p: torch.Tensor, grad: torch.Tensor, state: Dict[str, Any], hyper,
                     grad_code, stream: int) -> None:
        """Segment s of a LAMB/LARS partition whose head block is cut by the partition boundary, in one kernel
        call, so that one trust ratio covers the fragment: on a copy whose first element sits on a block
        boundary of the parameter's grid, padded in front with zeros (parameter, gradient and state codes: they
        add nothing to the norms, and the head block's scale is the one its own elements give), then copied
        back. The block scales are the state's own (the copy has as many blocks as the segment has scales). On a
        GPU every copy is queued on the step's stream, as the kernel is: no host wait."""
        pad = s.offset % s.block
        n = pad + s.numel
        span, codes = slice(s.start, s.start + s.numel), slice(s.first, s.first + s.numel)
        work = torch.zeros(n, dtype=torch.float32, device=p.device)
        work[pad:] = p.detach()[span]
        g = torch.zeros(n, dtype=grad.dtype, device=p.device)
        g[pad:] = grad[span]
        held = []
        for i in range(1, self.num_states + 1):
            c = torch.full((n,), _zero_code(self._state_map(i)), dtype=torch.uint8, device=p.device)
            c[pad:] = state[f"state{i}"][codes]
            held.append(c)
        a = self._segment_args(s, hyper, n, work.data_ptr(), g.data_ptr(), grad_code, [c.data_ptr() for c in held],
                               [state[f"absmax{i}"].data_ptr() + 4 * s.scale for i in range(1, self.num_states + 1)],
                               [])
        _launch(a, p, stream)
        # As the kernel writes the partition in place, through .data: torch's version is not bumped.
        p.data[span] = work[pad:]
        for i, c in enumerate(held, start=1):
            state[f"state{i}"][codes] = c[pad:]

    # ---- state dicts ----

    def _has_partitions(self) -> bool:
        return any(self._is_partition(p, g) for g in self.param_groups for p in g["params"])

    def _load_partitioned(self, state_dict: Dict[str, Any]) -> None:
        """load_state_dict for an optimizer whose groups hold DeepSpeed partitions (DeepSpeed's rigid ZeRO
        checkpoint: this rank's state dict of the same world size)."""
        from collections import defaultdict
        new_groups = self._loaded_groups(state_dict["param_groups"])
        saved_groups = state_dict["param_groups"]
        state: Dict[Any, Dict[str, Any]] = defaultdict(dict)
        for gi, (group, saved) in enumerate(zip(new_groups, saved_groups)):
            for pi, (p, key) in enumerate(zip(group["params"], saved["params"])):
                value = state_dict["state"].get(key)
                where = f"state[{key}] (param_groups[{gi}]['params'][{pi}])"
                if not self._is_partition(p, self.param_groups[gi]):
                    if value is not None:
                        state[p] = self._load_param_state(p, value, self._config(group, p), where)
                    continue
                if value is None:
                    continue
                part = self._partition(p, self.param_groups[gi], gi)
                state[p] = _placed(self._partition_state_from(p, part, value, group, f"{where}, a DeepSpeed partition"),
                                   p.device)
        # The group dicts stay the ones DeepSpeed holds (it replaced their params and may swap param_groups).
        for g, new in zip(self.param_groups, new_groups):
            g.clear()
            g.update(new)
        self.state = state
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


def _launch(a: "_C.StepArgs", p: torch.Tensor, stream: int) -> None:
    """The one-tensor step of `a` on partition p's device (CUDA: queued on `stream`, no host wait)."""
    if p.device.type == "cuda":
        with on_device(p):
            _C.step_tensor_cuda(a, stream)
    else:
        _C.step_tensor(a)


def _placed(state: Dict[str, Any], device: torch.device) -> Dict[str, Any]:
    """``state`` with its tensors on the partition's device (they are made and re-encoded on the CPU, where
    the per-segment layout is built once; a GPU partition steps them where they are, as torch.optim keeps a
    parameter's states on its device)."""
    if device.type == "cpu":
        return state
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _check_placed(state: Dict[str, Any], p: torch.Tensor, where: str) -> None:
    """The kernels read every state tensor through p's device: one elsewhere (the partition moved after the
    state was made) is an error naming it, not a read of another device's memory."""
    for k, v in state.items():
        if isinstance(v, torch.Tensor) and k != "step" and v.device != p.device:
            raise Zero8ValueError(f"{where}: the state {k!r} is on {v.device} but the partition is on {p.device}: "
                                  f"load the optimizer's state after moving the model")
