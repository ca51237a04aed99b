"""How one tensor is laid out over the mesh: split dims and pending partial sums.

A :class:`Sharding` lists, for every tensor dim, the mesh axes splitting it
(outermost first), and the axes over which the value is *partial* (every rank
holds an addend; the real value is the sum over the group), as MLIR's shard
dialect and DTensor's ``Shard`` / ``Partial`` placements do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence


@dataclass(frozen=True)
class Sharding:
    """Split axes per tensor dim (``dims[d]``, outermost first) and partial axes."""

    dims: tuple[tuple[str, ...], ...]
    partial: tuple[str, ...] = ()

    @staticmethod
    def replicated(rank: int) -> "Sharding":
        return Sharding(((),) * rank)

    @staticmethod
    def split(rank: int, splits: Mapping[int, Sequence[str]], partial: Sequence[str] = ()) -> "Sharding":
        dims = [()] * rank
        for d, axes in splits.items():
            dims[d] = tuple(axes)
        return Sharding(tuple(dims), tuple(partial))

    @property
    def rank(self) -> int:
        return len(self.dims)

    def axes(self) -> set[str]:
        """Every axis that splits some dim."""
        return {a for d in self.dims for a in d}

    def dim_of(self, axis: str) -> int | None:
        for d, axes in enumerate(self.dims):
            if axis in axes:
                return d
        return None

    def with_dim(self, d: int, axes: Sequence[str]) -> "Sharding":
        dims = list(self.dims)
        dims[d] = tuple(axes)
        return Sharding(tuple(dims), self.partial)

    def with_partial(self, partial: Sequence[str]) -> "Sharding":
        return Sharding(self.dims, tuple(dict.fromkeys(partial)))

    def without_partial(self) -> "Sharding":
        return Sharding(self.dims)

    def local_shape(self, shape: Sequence[int], sizes: Mapping[str, int]) -> list[int]:
        """Per-rank shape: each dim divided (rounded up, as FSDP pads) by its axes' sizes."""
        out = []
        for s, axes in zip(shape, self.dims):
            n = 1
            for a in axes:
                n *= sizes[a]
            out.append(-(-s // n))
        return out

    def __str__(self) -> str:
        dims = ", ".join("{" + ",".join(d) + "}" if d else "R" for d in self.dims)
        return f"[{dims}]" + (f" partial({','.join(self.partial)})" if self.partial else "")
