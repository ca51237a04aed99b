"""A numeric interpreter for collective schedules: real tensors, one per simulated rank.

:func:`run` executes a :class:`~flint.collectives.schedule.Schedule` on numpy
arrays, each rank following the actions in program order. A send delivers a
copy of the blocks as they are at that point of the sender's program (the
value the ``dist.send`` operand holds); a recv blocks until the matching
message ``(sender, receiver, action)`` arrived, checks that the sender's and
the receiver's block keys agree, and stores or adds what arrives. A rank
that can never progress is a deadlock (:class:`FlintError`).

:func:`expected` computes what the collective computes directly (sum for
all-reduce, concatenation in group order for all-gather, ...), so a test
compares the two and the bytes each rank sent.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from flint.collectives.schedule import Schedule
from flint.errors import FlintError


def _pieces(x: np.ndarray, units: int) -> tuple[list[np.ndarray], int]:
    flat = x.reshape(-1)
    size = -(-flat.size // units)
    padded = np.zeros(size * units, dtype=flat.dtype)
    padded[:flat.size] = flat
    return [padded[i * size:(i + 1) * size].copy() for i in range(units)], size


def run(s: Schedule, inputs: list[np.ndarray]) -> tuple[list[np.ndarray], list[int]]:
    """Run ``s`` with ``inputs[g]`` the input of group rank ``g``; returns (outputs, bytes sent per rank).

    Inputs are the full buffer for all-reduce, reduce-scatter, all-to-all and
    broadcast (only the root's matters), the local shard for all-gather.
    """
    n, C = s.n, s.chunks
    if len(inputs) != n:
        raise FlintError(f"interpreter: {len(inputs)} inputs for a group of {n}")
    numel = inputs[0].size
    state: list[dict] = [dict() for _ in range(n)]
    for g, x in enumerate(inputs):
        if s.kind in ("all_reduce", "reduce_scatter"):
            ps, size = _pieces(x, s.units)
            for b in range(s.blocks):
                for j in range(C):
                    state[g][(b, j)] = ps[b * C + j]
        elif s.kind == "all_gather":
            ps, size = _pieces(x, C)
            for j in range(C):
                state[g][(g, j)] = ps[j]
        elif s.kind == "broadcast":
            ps, size = _pieces(x, s.units)
            if g == s.root:
                for b in range(s.blocks):
                    for j in range(C):
                        state[g][(b, j)] = ps[b * C + j]
        else:  # all_to_all
            ps, size = _pieces(x, n * C)
            for dst in range(n):
                for j in range(C):
                    state[g][(g, dst, j)] = ps[dst * C + j]
    itemsize = inputs[0].dtype.itemsize
    sent = [0] * n
    mail: dict[tuple[int, int, int], deque] = {}
    pc = [0] * n
    coords = [s.coords(g) for g in range(n)]

    def peer(g: int, a) -> int:
        c = list(coords[g])
        c[a.axis] = (c[a.axis] + a.offsets[c[a.axis]]) % s.sizes[a.axis]
        return s.group_rank(tuple(c))

    acts = s.actions
    progress = True
    while progress:
        progress = False
        for g in range(n):
            while pc[g] < len(acts):
                i = pc[g]
                a = acts[i]
                c = coords[g]
                if not a.runs(c):
                    pc[g] += 1
                    continue
                keys = a.keys(c)
                if len(keys) != a.nblocks:
                    raise FlintError(f"schedule {s.algorithm}/{s.kind}: action {i} moves {len(keys)} blocks on rank "
                                     f"{g}, declared {a.nblocks}")
                p = peer(g, a)
                if a.send:
                    try:
                        data = [state[g][k].copy() for k in keys]
                    except KeyError as e:
                        raise FlintError(f"schedule {s.algorithm}/{s.kind}: rank {g} sends block {e} it does not hold "
                                         f"(action {i})") from None
                    mail.setdefault((g, p, a.tag), deque()).append((keys, data))
                    sent[g] += sum(d.size for d in data) * itemsize
                else:
                    q = mail.get((p, g, a.tag))
                    if not q:
                        break
                    skeys, data = q.popleft()
                    if list(skeys) != list(keys):
                        raise FlintError(f"schedule {s.algorithm}/{s.kind}: action {i}: rank {p} sends {skeys[:4]} but "
                                         f"rank {g} expects {keys[:4]}")
                    for k, d in zip(keys, data):
                        if a.reduce:
                            state[g][k] = state[g][k] + d
                        else:
                            state[g][k] = d
                pc[g] += 1
                progress = True
    stuck = [g for g in range(n) if pc[g] < len(acts)]
    if stuck:
        g = stuck[0]
        raise FlintError(f"schedule {s.algorithm}/{s.kind}: deadlock, rank {g} waits at action {pc[g]} "
                         f"({len(stuck)} ranks stuck)")
    leftover = [k for k, q in mail.items() if q]
    if leftover:
        raise FlintError(f"schedule {s.algorithm}/{s.kind}: message {leftover[0]} was sent but never received")

    outs = []
    for g in range(n):
        st = state[g]
        try:
            if s.kind == "all_reduce":
                parts = [st[(b, j)] for b in range(s.blocks) for j in range(C)]
                outs.append(np.concatenate(parts)[:numel].reshape(inputs[g].shape))
            elif s.kind == "reduce_scatter":
                # group rank g owns block g (blocks == n for every algorithm implementing it)
                full = np.concatenate([np.zeros(1, inputs[g].dtype)] * 0 + [st[(g, j)] for j in range(C)])
                outs.append(full)
            elif s.kind == "all_gather":
                outs.append(np.concatenate([np.concatenate([st[(b, j)] for j in range(C)])[:numel]
                                            for b in range(n)]))
            elif s.kind == "broadcast":
                parts = [st[(b, j)] for b in range(s.blocks) for j in range(C)]
                outs.append(np.concatenate(parts)[:numel].reshape(inputs[g].shape))
            else:
                outs.append(np.concatenate([np.concatenate([st[(src, g, j)] for j in range(C)]) for src in range(n)]))
        except KeyError as e:
            raise FlintError(f"schedule {s.algorithm}/{s.kind}: rank {g} ends without block {e}") from None
    return outs, sent


def expected(kind: str, inputs: list[np.ndarray], root: int = 0) -> list[np.ndarray]:
    """What ``kind`` computes over ``inputs`` (flattened, as :func:`run` returns it)."""
    n = len(inputs)
    if kind == "all_reduce":
        total = sum(inputs[1:], inputs[0].copy())
        return [total.copy() for _ in range(n)]
    if kind == "reduce_scatter":
        total = sum(inputs[1:], inputs[0].copy()).reshape(-1)
        return [p for p in np.split(total, n)]
    if kind == "all_gather":
        return [np.concatenate([x.reshape(-1) for x in inputs]) for _ in range(n)]
    if kind == "broadcast":
        return [inputs[root].copy() for _ in range(n)]
    parts = [np.split(x.reshape(-1), n) for x in inputs]
    return [np.concatenate([parts[src][dst] for src in range(n)]) for dst in range(n)]
