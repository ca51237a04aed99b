"""The device mesh: the one rank <-> mesh-coordinate mapping in Flint.

A mesh has a shape, e.g. ``(128, 8)`` with axis names ``("dp", "tp")``; rank
``r`` sits at the row-major coordinate of ``r`` in that shape, exactly like
``torch.distributed.device_mesh.init_device_mesh`` lays out ``arange(world)``.
Passes, the Chakra writer and the simulator all derive groups and peers from
this module, so they can never disagree.

A *group along axes* ``A`` of rank ``r`` is the set of ranks whose coordinates
equal ``r``'s on every axis not in ``A``; its members are ordered row-major
over ``A``. A *peer at offset k along axis a* is the rank whose coordinate on
``a`` is ``(c_a + k) mod shape[a]`` (peers wrap around).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np

from flint.errors import FlintError


@dataclass(frozen=True)
class Mesh:
    """A device mesh of ``prod(shape)`` ranks."""

    shape: tuple[int, ...]
    axis_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.shape or any(int(s) < 1 for s in self.shape):
            raise FlintError(f"mesh shape {list(self.shape)} must be non-empty positive integers")
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        names = tuple(self.axis_names) or tuple(f"d{i}" for i in range(len(self.shape)))
        if len(names) != len(self.shape):
            raise FlintError(
                f"mesh has {len(self.shape)} axes {list(self.shape)} but {len(names)} axis names {list(names)}"
            )
        if len(set(names)) != len(names):
            raise FlintError(f"mesh axis names {list(names)} are not unique")
        object.__setattr__(self, "axis_names", names)

    @property
    def world_size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @cached_property
    def _ranks(self) -> np.ndarray:
        return np.arange(self.world_size, dtype=np.int64).reshape(self.shape)

    def axis_index(self, axis: int | str) -> int:
        """The index of an axis given by index or name."""
        if isinstance(axis, str):
            if axis not in self.axis_names:
                raise FlintError(f"mesh has no axis '{axis}' (axes: {', '.join(self.axis_names)})")
            return self.axis_names.index(axis)
        if not 0 <= axis < self.ndim:
            raise FlintError(f"mesh axis {axis} out of range for a {self.ndim}-d mesh {list(self.shape)}")
        return axis

    def _axes(self, axes: Sequence[int | str]) -> tuple[int, ...]:
        out = tuple(self.axis_index(a) for a in axes)
        if len(set(out)) != len(out):
            raise FlintError(f"mesh axes {list(axes)} repeat an axis")
        return out

    def coords(self, rank: int) -> tuple[int, ...]:
        """Row-major coordinates of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise FlintError(f"rank {rank} out of range for world size {self.world_size}")
        return tuple(int(c) for c in np.unravel_index(rank, self.shape))

    def coordinate(self, axis: int | str) -> np.ndarray:
        """Every rank's coordinate along ``axis``: int array ``[world]``."""
        return np.unravel_index(np.arange(self.world_size), self.shape)[self.axis_index(axis)].astype(np.int64)

    def rank(self, coords: Sequence[int]) -> int:
        """The rank at ``coords``."""
        return int(np.ravel_multi_index(tuple(coords), self.shape))

    def group_size(self, axes: Sequence[int | str]) -> int:
        return int(np.prod([self.shape[a] for a in self._axes(axes)], dtype=np.int64))

    def groups(self, axes: Sequence[int | str]) -> np.ndarray:
        """All groups along ``axes``: an int array ``[n_groups, group_size]``.

        Rows are ordered by their smallest member; members row-major over ``axes``.
        """
        ax = self._axes(axes)
        rest = [i for i in range(self.ndim) if i not in ax]
        moved = np.transpose(self._ranks, rest + list(ax))
        return moved.reshape(-1, self.group_size(ax)) if ax else moved.reshape(-1, 1)

    def group_index(self, axes: Sequence[int | str]) -> np.ndarray:
        """For every rank, the row of its group in :meth:`groups` (int array ``[world]``)."""
        g = self.groups(axes)
        out = np.empty(self.world_size, dtype=np.int64)
        out[g] = np.arange(g.shape[0])[:, None]
        return out

    def group(self, rank: int, axes: Sequence[int | str]) -> tuple[int, ...]:
        """The members of ``rank``'s group along ``axes``."""
        return tuple(int(r) for r in self.groups(axes)[self.group_index(axes)[rank]])

    def peers(self, axis: int | str, offset: int) -> np.ndarray:
        """For every rank, its peer at ``offset`` along ``axis`` (wrapping): int array ``[world]``."""
        a = self.axis_index(axis)
        return np.roll(self._ranks, -offset, axis=a).reshape(-1).copy()

    def peer(self, rank: int, axis: int | str, offset: int) -> int:
        return int(self.peers(axis, offset)[rank])


def assign_group_ids(mesh: Mesh, axes_sets: Sequence[Sequence[int]]) -> tuple[dict[int, tuple[int, ...]], dict[tuple[int, ...], np.ndarray]]:
    """Number every communicator group the given axis sets need, from 1.

    Returns ``(groups, lookup)``: ``groups`` maps id -> member ranks (the
    Chakra comm-group file); ``lookup[axes]`` gives each rank's group id along
    ``axes``. Ids are assigned axis set by axis set in sorted order, then
    group by group in order of the smallest member, so they are deterministic.
    Groups with one member are still numbered; the caller decides whether to
    emit collectives over them.
    """
    groups: dict[int, tuple[int, ...]] = {}
    lookup: dict[tuple[int, ...], np.ndarray] = {}
    next_id = 1
    for axes in sorted({tuple(sorted(mesh._axes(a))) for a in axes_sets}):
        rows = mesh.groups(axes)
        ids = np.arange(next_id, next_id + rows.shape[0], dtype=np.int64)
        for gid, row in zip(ids, rows):
            groups[int(gid)] = tuple(int(r) for r in row)
        lookup[axes] = ids[mesh.group_index(axes)]
        next_id += rows.shape[0]
    return groups, lookup
