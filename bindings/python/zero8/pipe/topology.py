"""Process topologies under DeepSpeed's names (deepspeed.runtime.pipe.topology): a grid of ranks with named
axes laid out row-major, so that ``PipeDataParallelTopology(num_pp, num_dp)`` (axes ["pipe", "data"]) puts
the data-parallel ranks of a stage next to each other: rank = stage * num_dp + data_rank, the order in which
``_C.topology_split`` builds the engine's data-parallel and pipeline communicators.
"""

from __future__ import annotations

import itertools
from collections import namedtuple

from .._C import Zero8ValueError


class ProcessTopology:
    """Ranks as the cells of a grid with named axes (``axes``, each of length ``dims[i]``), numbered
    row-major: the last axis varies fastest."""

    def __init__(self, axes, dims):
        axes, dims = list(axes), [int(d) for d in dims]
        if len(axes) != len(dims) or len(set(axes)) != len(axes):
            raise Zero8ValueError(f"ProcessTopology: axes {axes} and dims {dims} must pair up, names unique")
        if any(d < 1 for d in dims):
            raise Zero8ValueError(f"ProcessTopology: every dimension must be >= 1, got {dims}")
        self.axes = axes
        self.dims = dims
        self.ProcessCoord = namedtuple("ProcessCoord", axes)
        self._coords = [self.ProcessCoord(*c) for c in itertools.product(*(range(d) for d in dims))]
        self.mapping = {c: r for r, c in enumerate(self._coords)}

    def world_size(self) -> int:
        return len(self._coords)

    def get_axis_names(self) -> list:
        return list(self.axes)

    def get_dim(self, axis: str) -> int:
        """The length of ``axis``; 0 for an axis this topology does not have (as DeepSpeed's)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_rank(self, **coord) -> int:
        if set(coord) != set(self.axes):
            raise Zero8ValueError(f"get_rank: give one coordinate per axis {self.axes}, got {sorted(coord)}")
        key = self.ProcessCoord(**coord)
        if key not in self.mapping:
            raise Zero8ValueError(f"get_rank: {coord} is outside the grid {dict(zip(self.axes, self.dims))}")
        return self.mapping[key]

    def get_coord(self, rank: int):
        if not 0 <= rank < len(self._coords):
            raise Zero8ValueError(f"get_coord: rank {rank} is outside a topology of {len(self._coords)} ranks")
        return self._coords[rank]

    def filter_match(self, **filter_kwargs) -> list[int]:
        """The ranks whose coordinates equal every given one, in rank order."""
        unknown = set(filter_kwargs) - set(self.axes)
        if unknown:
            raise Zero8ValueError(f"filter_match: no axis {sorted(unknown)} in {self.axes}")
        return [r for r, c in enumerate(self._coords)
                if all(getattr(c, k) == v for k, v in filter_kwargs.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks whose coordinate on ``axis`` is ``idx``."""
        return self.filter_match(**{axis: idx})

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The groups of ranks that differ only along ``axis`` (the members of one communicator over it),
        each in rank order; [] for an axis this topology does not have."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        groups = []
        for fixed in itertools.product(*(range(self.get_dim(a)) for a in others)):
            groups.append(self.filter_match(**dict(zip(others, fixed))))
        return groups

    def get_rank_repr(self, rank: int, omit_axes=("data", "pipe"), inner_sep: str = "_",
                      outer_sep: str = "-") -> str:
        """The rank's coordinates as text for file names ("model_01"), leaving out ``omit_axes``."""
        coord = self.get_coord(rank)
        return outer_sep.join(f"{a}{inner_sep}{getattr(coord, a):02d}" for a in self.axes if a not in omit_axes)

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallelism: axes ["pipe", "data"], so a stage's data-parallel ranks are consecutive
    (the gradient reductions, the heavy traffic, stay within a node) and the lighter stage-to-stage traffic
    crosses nodes."""

    def __init__(self, num_pp: int, num_dp: int):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """DeepSpeed's pipeline x data x tensor-slicing grid (axes ["pipe", "data", "model"]); zero8's pipeline
    engine runs it with num_mp == 1 only (it has no tensor parallelism)."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


class PipelineParallelGrid:
    """Where a rank sits in a pipe x data topology, under DeepSpeed's PipelineParallelGrid method names
    (``engine.grid``); the communicators themselves are the engine's."""

    def __init__(self, topology: ProcessTopology, global_rank: int):
        self._topo = topology
        self.global_rank = global_rank
        coord = topology.get_coord(global_rank)
        self.stage_id = coord.pipe
        self.data_parallel_id = coord.data
        self.pipe_parallel_size = topology.get_dim("pipe")
        self.data_parallel_size = topology.get_dim("data")

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_slice_parallel_rank(self) -> int:
        return 0  # no tensor slicing

    def get_slice_parallel_world_size(self) -> int:
        return 1

    def stage_to_global(self, stage_id: int, **kwargs) -> int:
        """The global rank of ``stage_id`` in this rank's pipeline (or at the given ``data`` coordinate)."""
        coord = {"pipe": stage_id, "data": kwargs.get("data", self.data_parallel_id)}
        coord.update({a: 0 for a in self._topo.get_axis_names() if a not in coord})
        return self._topo.get_rank(**coord)

    def topology(self) -> ProcessTopology:
        return self._topo
