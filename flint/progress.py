"""Progress bars (tqdm on stderr) for the long steps: emit and long simulations (capture prints its stages).

Bars appear only when stderr is a terminal (or ``FLINT_PROGRESS=1``) and the
work is long enough to be worth one (``min_total`` items); ``FLINT_PROGRESS=0``
turns them off. Output to pipes and files stays clean and deterministic.
"""

from __future__ import annotations

import os
import sys
from typing import Iterable, TypeVar

T = TypeVar("T")


def enabled() -> bool:
    env = os.environ.get("FLINT_PROGRESS")
    if env is not None:
        return env not in ("0", "", "false", "no")
    return sys.stderr.isatty()


def progress(items: Iterable[T], *, desc: str, total: int | None = None, unit: str = "it",
             min_total: int = 0) -> Iterable[T]:
    """``items``, with a tqdm bar on stderr when :func:`enabled` and ``total >= min_total``."""
    n = total if total is not None else (len(items) if hasattr(items, "__len__") else None)
    if not enabled() or (n is not None and n < min_total):
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, total=n, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True)
