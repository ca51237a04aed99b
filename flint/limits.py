"""What one machine can hold: the limits Flint checks before any work.

Every command refuses input beyond these figures up front, naming the
figure and the limit, instead of running for minutes into a ``MemoryError``.
The node limit follows the machine: each unrolled node costs about
:data:`BYTES_PER_NODE` bytes in the simulator's and writer's tables.
"""

from __future__ import annotations

import os

#: Ranks of a world (grid, trace, capture): 2**20 = 1,048,576. The simulator keeps
#: a program per rank and the writer a file per rank.
MAX_WORLD_SIZE = 1 << 20
#: Axes of a device grid.
MAX_GRID_AXES = 16
#: Times one function (``flint.schedule``) or one ``chakra.repeat`` body may run.
MAX_REPEAT = 10_000_000
#: Chakra's ``comm_tag``, ``comm_src``/``comm_dst`` and group ids are int32 in ASTRA-sim and Flint's tables.
INT32_MAX = (1 << 31) - 1
#: Elements of one tensor: 2**48 (a 512 TiB bf16 tensor), far beyond any device; sizes stay exact in int64.
MAX_TENSOR_ELEMENTS = 1 << 48
#: SMs one communication kernel may hold (calibration ``comm_sms``, a send's ``sms``).
MAX_SMS = 1024
#: Memory one unrolled node costs in the simulator's and writer's per-rank tables (measured ~150 B; margin).
BYTES_PER_NODE = 256


def physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def max_nodes_per_rank() -> int:
    """Unrolled nodes of one rank role this machine can hold (its memory / :data:`BYTES_PER_NODE`)."""
    return physical_memory_bytes() // BYTES_PER_NODE


def fmt(n: int) -> str:
    return f"{n:,}"
