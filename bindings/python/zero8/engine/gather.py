"""The deferred parameter all-gather, made safe for any reader of the weights.

With ``zero8.overlap_param_gather`` engine.step() returns while the optimizer's thread still gathers the
updated partitions into the working copy, piece by piece in parameter order, so that the next forward
runs over the first layers while the last ones arrive. Any read of a weight before its piece is in would
see part of the update: a module's forward, but also a parent slicing a child's weight, an EMA or a weight
norm logged after the step, a state_dict, a deepcopy. Module hooks only cover the first kind.

So after such a step every parameter's class becomes a subclass of ``torch.nn.Parameter`` (still a
Parameter for isinstance, the same tensor object, storage and autograd identity) whose
``__torch_function__`` waits for that parameter's piece and turns it back into a plain Parameter; torch
routes every function, method and attribute read of a tensor through it (``.data``, ``.shape``,
indexing, ``F.linear``, ``torch.save``), so the first touch of each weight, wherever it happens, waits
for just that weight. Only these first touches pay the Python hook; later ops see a plain Parameter.
"""

from __future__ import annotations

import weakref

import torch


class GatheringParameter(torch.nn.Parameter):
    """A parameter whose update is still being gathered. Each engine makes its own subclass, which knows
    the engine and each parameter's index; copies (deepcopy) are plain once touched."""

    _engine: "weakref.ref | None" = None
    _index: dict = {}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _settle_in(args)
        _settle_in(kwargs)
        return func(*args, **kwargs)

    def _settle(self) -> None:
        """Wait for this parameter's piece, then be a plain Parameter again: in that order, so that another
        thread touching it meanwhile waits too (nothing here touches the tensor, so nothing recurses)."""
        cls = type(self)
        engine = cls._engine() if cls._engine is not None else None
        i = cls._index.get(id(self))
        if engine is not None and i is not None:
            engine._wait_param(i)
        self.__class__ = torch.nn.Parameter


def _settle_in(obj) -> None:
    """Settle every gathering parameter in a torch call's arguments (tensors, lists, tuples, dicts)."""
    if isinstance(obj, GatheringParameter):
        obj._settle()
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _settle_in(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            _settle_in(o)


def gathering_class(engine, params: list) -> type:
    """The engine's subclass of GatheringParameter: a weak reference to the engine (a parameter outliving
    it settles without waiting) and the index of each parameter in the sharded optimizer."""
    return type("GatheringParameter", (GatheringParameter,),
                {"_engine": weakref.ref(engine), "_index": {id(p): i for i, p in enumerate(params)},
                 "__module__": __name__})


def unguardable(params: list) -> list:
    """The parameters whose class cannot be swapped: anything but exactly torch.nn.Parameter (a subclass
    with behaviour of its own, such as a quantized parameter type, or a plain tensor)."""
    return [i for i, p in enumerate(params) if type(p) is not torch.nn.Parameter]


def arm(params: list, cls: type) -> None:
    """After a step that left its all-gather running: every parameter waits for its piece on first touch."""
    for p in params:
        if type(p) is torch.nn.Parameter:
            p.__class__ = cls


def disarm(params: list) -> None:
    """The whole gather is done: every parameter a plain Parameter again."""
    for p in params:
        if isinstance(p, GatheringParameter):
            p.__class__ = torch.nn.Parameter
