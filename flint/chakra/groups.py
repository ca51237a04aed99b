"""Chakra communicator-group files: ``{"1": [0, 1], "2": [2, 3]}``.

ASTRA-sim takes this file as ``--comm-group-configuration``. Ids are positive
integers written as JSON string keys (0 is rejected by ASTRA-sim); a node's
``pg_name`` attribute is the id as a string, and an empty or absent
``pg_name`` means "all ranks". Flint writes the ids in increasing order and
the members in the order the trace gives them, so the file is deterministic.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence

from flint.chakra.wire import TraceError
from flint.errors import FlintError
from flint.limits import MAX_WORLD_SIZE


def validate_comm_groups(groups: Mapping[int, Sequence[int]], world_size: int) -> None:
    """Raise :class:`FlintError` unless ids are >= 1 and members are distinct ranks in range."""
    for gid, members in groups.items():
        if not isinstance(gid, int) or gid < 1:
            raise FlintError(f"comm group id {gid!r} is invalid: Chakra group ids are integers from 1 (0 is rejected by ASTRA-sim)")
        if len(members) == 0:
            raise FlintError(f"comm group {gid} has no members")
        if len(set(members)) != len(members):
            raise FlintError(f"comm group {gid} lists a rank twice: {list(members)}")
        lo, hi = min(members), max(members)
        if lo < 0 or hi >= world_size:
            raise FlintError(f"comm group {gid} names rank {lo if lo < 0 else hi}, outside world size {world_size}")


def format_comm_groups(groups: Mapping[int, Sequence[int]]) -> str:
    """The comm-group JSON text: keys are the ids as strings, in increasing order."""
    body = ", ".join(f'"{gid}": [{", ".join(str(int(r)) for r in groups[gid])}]' for gid in sorted(groups))
    return "{" + body + "}\n"


def parse_comm_groups(text: str, source: str = "<comm groups>") -> dict[int, tuple[int, ...]]:
    """Parse a comm-group JSON text; ``source`` names the file in errors."""
    try:
        raw = json.loads(text)
    except RecursionError:
        raise TraceError(f"{source}: JSON nested too deeply") from None
    except json.JSONDecodeError as e:
        raise TraceError(f"{source}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise TraceError(f"{source}: expected a JSON object mapping group ids to rank lists")
    groups: dict[int, tuple[int, ...]] = {}
    for k, v in raw.items():
        try:
            gid = int(k)
        except ValueError:
            raise TraceError(f"{source}: group id {k!r} is not an integer") from None
        if not 1 <= gid <= (1 << 31) - 1:
            raise TraceError(f"{source}: group id {gid} is invalid (ids are 1..2147483647)")
        if isinstance(v, list) and len(v) > MAX_WORLD_SIZE:
            raise TraceError(f"{source}: group {k} lists {len(v):,} members; the limit is {MAX_WORLD_SIZE:,} ranks")
        if not isinstance(v, list) or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in v):
            raise TraceError(f"{source}: group {k} must be a list of non-negative rank numbers")
        groups[gid] = tuple(v)
    return groups


def load_comm_groups(path: str | Path) -> dict[int, tuple[int, ...]]:
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: byte {e.start} is not UTF-8: not a comm-group JSON file") from None
    except OSError as e:
        raise TraceError(f"{path}: cannot read comm-group file ({e.strerror})") from None
    return parse_comm_groups(text, str(path))
