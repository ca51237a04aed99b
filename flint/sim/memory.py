"""Peak memory of one rank from tensor lifetimes along its schedule.

Input is one rank's allocations in columnar form: allocation ``i`` of
``alloc_bytes[i]`` bytes becomes live at schedule position ``alloc_pos[i]``
(default ``i``: one allocation per scheduled op, in order) and stays live
through position ``free_after[i]`` inclusive; ``free_after = -1`` means never
freed within the step (parameters, optimizer state, gradients kept for the
optimizer). ``category[i]`` says what it is: ``params``, ``grads``,
``optimizer``, ``activations``, ``comm`` (collective buffers) or ``other``.

The live bytes at position ``p`` are the sum over allocations with
``alloc_pos <= p <= free_after`` (or ``free_after == -1``). The report gives
the peak, where it happens, the per-category split at the peak, each
category's own peak, and whether it fits a device's HBM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from flint.errors import FlintError

CATEGORIES = ("params", "grads", "optimizer", "activations", "comm", "other")


@dataclass(frozen=True)
class MemoryReport:
    """Peak memory of one rank (module docstring)."""

    peak_bytes: int
    peak_position: int
    at_peak_bytes: dict[str, int]        # category -> live bytes at the peak position
    category_peak_bytes: dict[str, int]  # category -> its own peak over the step
    live_bytes: np.ndarray               # live bytes at every position
    capacity_bytes: int | None = None

    @property
    def fits(self) -> bool | None:
        """Whether the peak fits ``capacity_bytes`` (``None`` when no capacity was given)."""
        return None if self.capacity_bytes is None else self.peak_bytes <= self.capacity_bytes

    def summary(self) -> str:
        gib = 2 ** 30
        parts = ", ".join(f"{c} {b / gib:.2f}" for c, b in self.at_peak_bytes.items() if b)
        cap = "" if self.capacity_bytes is None else \
            f" of {self.capacity_bytes / gib:.1f} GiB ({'fits' if self.fits else 'DOES NOT FIT'})"
        return f"peak {self.peak_bytes / gib:.2f} GiB at position {self.peak_position}{cap}: {parts} GiB"


def peak_memory(alloc_bytes: Sequence[int] | np.ndarray, free_after: Sequence[int] | np.ndarray,
                category: Sequence[str], alloc_pos: Sequence[int] | np.ndarray | None = None,
                capacity_bytes: int | None = None) -> MemoryReport:
    """Peak live memory of one rank's allocations (module docstring)."""
    nbytes = np.asarray(alloc_bytes, dtype=np.int64)
    free = np.asarray(free_after, dtype=np.int64)
    pos = np.arange(nbytes.size, dtype=np.int64) if alloc_pos is None else np.asarray(alloc_pos, dtype=np.int64)
    if not (nbytes.size == free.size == pos.size == len(category)):
        raise FlintError(f"memory events need equal lengths: {nbytes.size} sizes, {free.size} free positions, "
                         f"{pos.size} alloc positions, {len(category)} categories")
    if nbytes.size == 0:
        return MemoryReport(0, 0, dict.fromkeys(CATEGORIES, 0), dict.fromkeys(CATEGORIES, 0),
                            np.zeros(0, dtype=np.int64), capacity_bytes)
    bad = np.nonzero(nbytes < 0)[0]
    if bad.size:
        raise FlintError(f"memory event {int(bad[0])} allocates {int(nbytes[bad[0]])} bytes; sizes must be >= 0")
    bad = np.nonzero(pos < 0)[0]
    if bad.size:
        raise FlintError(f"memory event {int(bad[0])} is allocated at position {int(pos[bad[0]])}; positions must be >= 0")
    bad = np.nonzero((free != -1) & (free < pos))[0]
    if bad.size:
        i = int(bad[0])
        raise FlintError(f"memory event {i} ({category[i]}) is freed after position {int(free[i])}, "
                         f"before its allocation at position {int(pos[i])}")
    cats = np.asarray(category, dtype=object)
    unknown = sorted(set(cats.tolist()) - set(CATEGORIES))
    if unknown:
        raise FlintError(f"unknown memory categories {unknown} (valid: {', '.join(CATEGORIES)})")
    n_pos = int(max(pos.max(), free.max())) + 1
    end = np.where(free == -1, n_pos, free + 1)  # first position where the allocation is no longer live

    def live(mask: np.ndarray) -> np.ndarray:
        delta = np.zeros(n_pos + 1, dtype=np.int64)
        np.add.at(delta, pos[mask], nbytes[mask])
        np.add.at(delta, end[mask], -nbytes[mask])
        return np.cumsum(delta)[:n_pos]

    per_cat = {c: live(cats == c) for c in CATEGORIES}
    total = sum(per_cat.values())
    p = int(np.argmax(total))
    return MemoryReport(int(total[p]), p, {c: int(v[p]) for c, v in per_cat.items()},
                        {c: int(v.max()) for c, v in per_cat.items()}, total, capacity_bytes)
