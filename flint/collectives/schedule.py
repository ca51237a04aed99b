"""Step schedules of collective algorithms: the one place they are defined.

A collective over a group is a sequence of *actions*, every rank running the
same sequence (SPMD). An action is one send or one recv along one group axis:

- ``offsets``: the peer of the rank at coordinate ``c`` on that axis is
  ``(c + offsets[c]) mod n``; an offset of ``0`` means the rank does not take
  part in this action (a tree leaf has no children to receive from). When
  every rank uses the same offset the action is *uniform* (``offset`` set).
- ``nblocks``: how many blocks move (the same for every taking-part rank, so
  the payload has one static tensor type); a block is ``1/blocks`` of the
  collective's full buffer (times ``1/chunks`` when pipelined).
- ``reduce`` (recv only): add what arrives into the local blocks (a
  reduction kernel follows the recv) instead of storing it.
- ``keys(coords)``: which block keys this rank sends / receives, for the
  numeric interpreter (:mod:`flint.collectives.interpret`) and the byte count.

The pass ``decompose-collectives`` turns each action into a ``dist.send`` /
``dist.recv`` (+ ``aten.add`` after a reducing recv); the interpreter runs
the same actions on real tensors; ``verify-p2p`` checks what the pass
emitted. All three read this module, so they cannot disagree.

Block keys: for all-reduce, reduce-scatter, all-gather and broadcast a key is
``(block, chunk)``, ``block`` in ``range(blocks)`` being the group-order slice
of the full buffer; for all-to-all ``(src, dst, chunk)`` (the slice ``src``
sends to ``dst``). Group order is :mod:`flint.mesh`'s: over two axes
``[a0, a1]`` the member at coordinates ``(c0, c1)`` has group rank
``c0 * n1 + c1``.

Algorithms (``n`` = group size along the axis; ``S`` the full buffer):

- ``ring``: all-reduce = reduce-scatter + all-gather around the ring, 2(n-1)
  steps of S/n to ``c+1``; all-gather / reduce-scatter n-1 steps;
  all-to-all as pairwise exchange (step d: S/n to ``c+d``); broadcast a
  pipelined chain from the root. Any n.
- ``direct``: every rank sends each peer its block in one phase (step d to
  ``c+d``): reduce-scatter, all-gather, all-reduce (both), all-to-all;
  broadcast: the root sends S to every peer. Any n.
- ``halving-doubling``: reduce-scatter by distance halving (step k: the
  blocks whose distance to their owner has bit k set go to ``c+2^k``, S/2 ..
  S/n), all-gather by distance doubling (to ``c-2^k``), all-reduce both,
  all-to-all as Bruck (log2 n steps of S/2), broadcast binomial. The peers
  are shifts ``c±2^k`` rather than ``c xor 2^k``: same steps, bytes and
  distances as the textbook recursive halving/doubling, and uniform SPMD
  offsets. Power-of-two n only (as the cost formula).
- ``tree``: all-reduce as NCCL's double binary tree: two heap-ordered binary
  trees, the second mirrored (``c -> n-1-c``), each reducing then
  broadcasting half of the buffer, pipelined in chunks; a rank is an inner
  node in at most one tree. Any n (uneven subtrees). Broadcast: the same two
  trees over the other n-1 ranks, the root feeding half of the buffer to
  each tree's top. The two trees are two *lanes* (``Action.lane``): the
  pass queues them on separate channels, as NCCL runs its two trees on
  separate channels.
- ``hierarchical`` (two axes, the second the inner one): all-reduce =
  ring reduce-scatter along the inner axis, ring all-reduce of the owned
  part along the outer axis, ring all-gather along the inner axis;
  reduce-scatter = inner then outer; all-gather = outer then inner;
  all-to-all = pairwise exchange along the inner axis (each message the
  n0 blocks for one inner coordinate), then along the outer axis (the n1
  blocks for one rank); broadcast = a pipelined chain along the outer axis
  in the root's column (``Action.where``: only the ranks at the root's inner
  coordinate), then a chain along the inner axis in every row, chunk by
  chunk (a rank of the root's column forwards chunk j along its row as
  soon as it has it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Sequence

from flint.errors import FlintError

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
ALGORITHMS = ("ring", "tree", "direct", "halving-doubling", "hierarchical")
_FLAT = ("ring", "tree", "direct", "halving-doubling")
_SUPPORTS = {
    "ring": set(KINDS),
    "direct": set(KINDS),
    "halving-doubling": set(KINDS),
    "tree": {"all_reduce", "broadcast"},
    "hierarchical": set(KINDS),
}

Key = tuple
Coords = tuple[int, ...]


@dataclass(frozen=True)
class Action:
    """One send or recv every rank runs (module docstring)."""

    send: bool
    axis: int                      # index into the collective's grid axes
    offsets: tuple[int, ...]       # per coordinate on ``axis``; 0 = not taking part
    nblocks: int
    keys: Callable[[Coords], list[Key]]
    reduce: bool = False
    step: int = 0                  # logical step (for names and goldens)
    tag: int = 0                   # a send with tag t on c matches the recv with tag t on its peer
    chunk: int = 0                 # which of the ``chunks`` pieces it moves
    lane: int = 0                  # independent pipeline it belongs to (tree h of a double binary tree)
    # (group axis, coordinate): only ranks at that coordinate of that other axis take part (the root's
    # column in a hierarchical broadcast); None: every rank along the other axes
    where: tuple[int, int] | None = None

    @cached_property
    def uniform(self) -> int | None:
        """The offset every rank uses, or None."""
        first = self.offsets[0]
        return first if first != 0 and self.offsets.count(first) == len(self.offsets) else None

    def active(self, c: int) -> bool:
        return self.offsets[c] != 0

    def runs(self, coords: Coords) -> bool:
        """Does the rank at group coordinates ``coords`` take part?"""
        return self.offsets[coords[self.axis]] != 0 and (self.where is None or coords[self.where[0]] == self.where[1])


@dataclass(frozen=True)
class Schedule:
    """A collective's actions: ``blocks`` blocks per full buffer, each split into ``chunks``."""

    kind: str
    algorithm: str
    sizes: tuple[int, ...]         # group size along each axis (outer first, as the grid axes)
    blocks: int
    chunks: int
    actions: tuple[Action, ...]
    root: int = 0

    @property
    def n(self) -> int:
        return math.prod(self.sizes)

    @property
    def units(self) -> int:
        """Pieces the full buffer is cut into: blocks x chunks."""
        return self.blocks * self.chunks

    def group_rank(self, coords: Coords) -> int:
        g = 0
        for c, s in zip(coords, self.sizes):
            g = g * s + c
        return g

    def coords(self, g: int) -> Coords:
        out = []
        for s in reversed(self.sizes):
            out.append(g % s)
            g //= s
        return tuple(reversed(out))


class UnsupportedAlgorithm(FlintError):
    """The algorithm cannot run this collective on this group."""


def supported(algorithm: str, kind: str, sizes: Sequence[int]) -> str | None:
    """Why ``algorithm`` cannot run ``kind`` over a group of ``sizes``, or None if it can."""
    n = math.prod(sizes)
    if algorithm not in _SUPPORTS:
        return f"unknown algorithm '{algorithm}' (valid: {', '.join(ALGORITHMS)}, auto)"
    if kind not in _SUPPORTS[algorithm]:
        return f"{algorithm} does not implement {kind}"
    if algorithm == "hierarchical":
        if len(sizes) != 2:
            return f"hierarchical needs a collective over two grid axes (outer, inner), got {len(sizes)}"
        return None
    if len(sizes) != 1:
        return f"{algorithm} runs over one grid axis; a collective over {len(sizes)} axes needs hierarchical"
    if algorithm == "halving-doubling" and n & (n - 1):
        return f"halving-doubling needs a power-of-two group size, got {n}"
    return None


def working_algorithms(kind: str, sizes: Sequence[int]) -> list[str]:
    return [a for a in ALGORITHMS if supported(a, kind, sizes) is None]


def build(kind: str, algorithm: str, sizes: Sequence[int], chunks: int = 1, root: int = 0) -> Schedule:
    """The schedule of ``kind`` by ``algorithm`` over a group of ``sizes`` (one entry per grid axis).

    Raises :class:`UnsupportedAlgorithm` naming the group size and the
    algorithms that would work.
    """
    sizes = tuple(int(s) for s in sizes)
    why = supported(algorithm, kind, sizes)
    if why is not None:
        ok = working_algorithms(kind, sizes)
        raise UnsupportedAlgorithm(f"{why}; for {kind} over a group of {math.prod(sizes)} "
                                   f"({'x'.join(map(str, sizes))}) use: {', '.join(ok) or 'none'}")
    if chunks < 1:
        raise FlintError(f"chunks must be >= 1, got {chunks}")
    if algorithm == "hierarchical":
        blocks, steps = _hierarchical(kind, sizes, root)
    else:
        n = sizes[0]
        blocks, steps = {"ring": _ring, "direct": _direct, "halving-doubling": _hd, "tree": _tree}[algorithm](
            kind, n, root)
    return Schedule(kind, algorithm, sizes, blocks, chunks, tuple(_pipeline(steps, chunks)), root)


# A logical step: a list of (send, axis, offsets, nblocks, block-keys(coords), reduce, pair) whose keys
# name blocks only; a send and the recv it feeds share ``pair``. _pipeline repeats each step once per
# chunk and numbers the (step, chunk, pair) triples as tags.
_Step = list


def _pipeline(steps: list[_Step], chunks: int) -> list[Action]:
    out = []
    tags: dict = {}
    for si, step in enumerate(steps):
        for j in range(chunks):
            for send, axis, offsets, nb, keys, reduce, pair, *rest in step:
                tag = tags.setdefault((si, j, pair), len(tags))
                out.append(Action(send, axis, tuple(offsets), nb, _with_chunk(keys, j), reduce, si, tag, j,
                                  rest[0] if rest else 0, rest[1] if len(rest) > 1 else None))
    return out


def _with_chunk(keys, j):
    return lambda c: [k + (j,) for k in keys(c)]


def _uniform(n: int, off: int) -> tuple[int, ...]:
    return (off if off % n else 0,) * n


def _pair(axis: int, n: int, off: int, nb: int, send_keys, recv_keys, reduce: bool) -> list:
    """Send to c+off, recv from c-off: the two halves of one uniform exchange."""
    return [(True, axis, _uniform(n, off), nb, send_keys, False, 0),
            (False, axis, _uniform(n, -off), nb, recv_keys, reduce, 0)]


def _ring_rs(axis: int, n: int, owned: Callable[[Coords, int], list[Key]]) -> list[_Step]:
    """Ring reduce-scatter along ``axis``: after n-1 steps position p holds owned(c, p) reduced.

    ``owned(c, p)`` lists the block keys that end at the rank whose coordinate on the axis is p,
    for the rank at ``c`` (other axes fixed).
    """
    steps = []
    for s in range(n - 1):
        def send(c, s=s):
            return owned(c, (c[axis] - s - 1) % n)

        def recv(c, s=s):
            return owned(c, (c[axis] - s - 2) % n)

        steps.append(_pair(axis, n, 1, -1, send, recv, True))
    return steps


def _ring_ag(axis: int, n: int, owned: Callable[[Coords, int], list[Key]]) -> list[_Step]:
    steps = []
    for s in range(n - 1):
        def send(c, s=s):
            return owned(c, (c[axis] - s) % n)

        def recv(c, s=s):
            return owned(c, (c[axis] - s - 1) % n)

        steps.append(_pair(axis, n, 1, -1, send, recv, False))
    return steps


def _fix_nblocks(steps: list[_Step], nb: int) -> list[_Step]:
    return [[(a[0], a[1], a[2], nb if a[3] < 0 else a[3], a[4], a[5], a[6]) for a in step] for step in steps]


def _ring(kind: str, n: int, root: int):
    mine = lambda c, p: [(p,)]  # noqa: E731 - block p belongs to position p
    if kind == "all_reduce":
        return n, _fix_nblocks(_ring_rs(0, n, mine) + _ring_ag(0, n, mine), 1)
    if kind == "reduce_scatter":
        return n, _fix_nblocks(_ring_rs(0, n, mine), 1)
    if kind == "all_gather":
        return n, _fix_nblocks(_ring_ag(0, n, mine), 1)
    if kind == "all_to_all":
        return n, _pairwise(n)
    # broadcast: a chain root -> root+1 -> ... -> root-1, pipelined by chunks
    send = tuple(0 if (c - root) % n == n - 1 else 1 for c in range(n))
    recv = tuple(0 if c == root else -1 for c in range(n))
    whole = lambda c: [(0,)]  # noqa: E731
    return 1, [[(False, 0, recv, 1, whole, False, 0), (True, 0, send, 1, whole, False, 0)]]


def _pairwise(n: int) -> list[_Step]:
    """All-to-all: step d, S/n to c+d and from c-d (ring and direct share it; direct posts all at once)."""
    steps = []
    for d in range(1, n):
        steps.append(_pair(0, n, d, 1, lambda c, d=d: [(c[0], (c[0] + d) % n)],
                           lambda c, d=d: [((c[0] - d) % n, c[0])], False))
    return steps


def _direct(kind: str, n: int, root: int):
    mine = lambda c: [(c[0],)]  # noqa: E731
    if kind == "all_to_all":
        # one phase: every send first, then every recv (the simulator's send and recv streams overlap them)
        steps = _pairwise(n)
        steps = [[a[:6] + (d,) for a in st] for d, st in enumerate(steps)]
        return n, [[a for st in steps for a in st if a[0]] + [a for st in steps for a in st if not a[0]]]
    rs = [(True, 0, _uniform(n, d), 1, (lambda c, d=d: [((c[0] + d) % n,)]), False, d) for d in range(1, n)]
    rs += [(False, 0, _uniform(n, -d), 1, mine, True, d) for d in range(1, n)]
    ag = [(True, 0, _uniform(n, d), 1, mine, False, d) for d in range(1, n)]
    ag += [(False, 0, _uniform(n, -d), 1, (lambda c, d=d: [((c[0] - d) % n,)]), False, d) for d in range(1, n)]
    if kind == "reduce_scatter":
        return n, [rs]
    if kind == "all_gather":
        return n, [ag]
    if kind == "all_reduce":
        return n, [rs, ag]
    whole = lambda c: [(0,)]  # noqa: E731
    step = [(True, 0, tuple(d if c == root else 0 for c in range(n)), 1, whole, False, d) for d in range(1, n)]
    step += [(False, 0, tuple(-d if (c - root) % n == d else 0 for c in range(n)), 1, whole, False, d)
             for d in range(1, n)]
    return 1, [step]


def _hd(kind: str, n: int, root: int):
    k = n.bit_length() - 1
    if kind == "all_to_all":  # Bruck: keys (src, dst) travel +2^i while bit i of (dst - holder) is set
        steps = []
        for i in range(k):
            def send(c, i=i):
                return _bruck_held(c[0], i, n, True)

            def recv(c, i=i):
                return [kk for kk in _bruck_held((c[0] - (1 << i)) % n, i, n, True)]

            steps.append(_pair(0, n, 1 << i, n // 2, send, recv, False))
        return n, steps
    if kind == "broadcast":  # binomial: step i, relative positions p < 2^i send to p + 2^i
        whole = lambda c: [(0,)]  # noqa: E731
        steps = []
        for i in range(k):
            b = 1 << i
            send = tuple(b if (c - root) % n < b else 0 for c in range(n))
            recv = tuple(-b if b <= (c - root) % n < 2 * b else 0 for c in range(n))
            steps.append([(True, 0, send, 1, whole, False, 0), (False, 0, recv, 1, whole, False, 0)])
        return 1, steps
    rs = []
    for i in reversed(range(k)):  # distance halving: blocks at distance with bit i set, 2^i of them
        b = 1 << i

        def send(c, i=i):
            return [((c[0] + r) % n,) for r in range(n) if (r >> i) & 1 and r < (2 << i)]

        def recv(c, i=i, b=b):
            return [((c[0] + r) % n,) for r in range(b)]

        rs.append(_pair(0, n, b, b, send, recv, True))
    ag = []
    for i in range(k):  # distance doubling: rank c holds c .. c+2^i-1, sends them to c-2^i
        b = 1 << i

        def send(c, b=b):
            return [((c[0] + r) % n,) for r in range(b)]

        def recv(c, b=b):
            return [((c[0] + b + r) % n,) for r in range(b)]

        ag.append(_pair(0, n, -b, b, send, recv, False))
    if kind == "reduce_scatter":
        return n, rs
    if kind == "all_gather":
        return n, ag
    return n, rs + ag


def _bruck_held(c: int, i: int, n: int, sending: bool) -> list[Key]:
    """Keys rank ``c`` holds before Bruck step ``i`` that must move on at step ``i``.

    Before step i a key (src, dst) sits at ``src + (dst - src) mod 2^i``; it moves at step i iff bit i
    of ``(dst - src) mod n`` is set.
    """
    out = []
    low = (1 << i) - 1
    for src in range(n):
        for dst in range(n):
            d = (dst - src) % n
            if (src + (d & low)) % n == c and (d >> i) & 1:
                out.append((src, dst))
    return out


def _tree_phases(n: int, pos, blk, tag: str, reduce_up: bool, up: bool, down: bool, lane: int = 0,
                 ) -> tuple[list, list]:
    """The reduce (up) and broadcast (down) actions of one heap-ordered binary tree.

    ``pos(c)`` is the coordinate's position in the heap (position 0 the root; children of p are 2p+1
    and 2p+2); a child's send to its parent is split by side so that it pairs with the parent's recv
    of that side.
    """
    coord = {pos(c): c for c in range(n)}
    P = [pos(c) for c in range(n)]

    def kid(side):
        return tuple(coord[2 * p + 1 + side] - c if 2 * p + 1 + side < n else 0 for c, p in enumerate(P))

    def parent(side):
        return tuple(coord[(p - 1) // 2] - c if p > 0 and (p - 1) % 2 == side else 0 for c, p in enumerate(P))

    ups, downs = [], []
    if up:
        ups = [(False, 0, kid(s), 1, blk, reduce_up, f"{tag}u{s}", 4 * lane + s) for s in range(2)]
        ups += [(True, 0, parent(s), 1, blk, False, f"{tag}u{s}", 4 * lane) for s in range(2)]
    if down:
        downs = [(False, 0, parent(s), 1, blk, False, f"{tag}d{s}", 4 * lane + 2) for s in range(2)]
        downs += [(True, 0, kid(s), 1, blk, False, f"{tag}d{s}", 4 * lane + 2 + s) for s in range(2)]
    return ups, downs


def _tree_broadcast(n: int, root: int) -> list:
    """Broadcast down two binary trees over the n-1 other ranks, half of the buffer each.

    The root hands half h to the top of tree h; tree 0 is heap-ordered over
    ``q = c - root - 1`` (mod n), tree 1 mirrored (``n - 2 - q``), so a rank is
    an inner node in at most one tree and every rank, the root included,
    sends and receives the buffer once: S/bandwidth, as the pipelined chain,
    in ceil(log2 n) hops instead of n-1 (the two-tree broadcast of Sanders,
    Speck and Traeff, "Two-tree algorithms for full bandwidth broadcast,
    reduction and scan", Parallel Computing 35(12), 2009).
    """
    m = n - 1
    acts = []
    for h in range(2):
        def pos(c, h=h):
            q = (c - root - 1) % n
            return q if h == 0 else m - 1 - q
        coord = {pos(c): c for c in range(n) if c != root}
        P = [pos(c) if c != root else -1 for c in range(n)]
        blk = (lambda c, h=h: [(h,)])
        top = coord[0]
        acts.append((False, 0, tuple(root - c if p == 0 else 0 for c, p in enumerate(P)), 1, blk, False,
                     f"b{h}r", 2 * h))
        for s in range(2):
            acts.append((False, 0, tuple(coord[(p - 1) // 2] - c if p > 0 and (p - 1) % 2 == s else 0
                                         for c, p in enumerate(P)), 1, blk, False, f"b{h}d{s}", 2 * h))
        acts.append((True, 0, tuple(top - root if c == root else 0 for c in range(n)), 1, blk, False, f"b{h}r",
                     2 * h))
        for s in range(2):
            acts.append((True, 0, tuple(coord[2 * p + 1 + s] - c if p >= 0 and 2 * p + 1 + s < m else 0
                                        for c, p in enumerate(P)), 1, blk, False, f"b{h}d{s}", 2 * h + s))
    return acts


def _tree(kind: str, n: int, root: int):
    if kind == "broadcast":
        return 2, [_tree_broadcast(n, root)]
    # all-reduce: double binary tree, block h on tree h (the second mirrored: position n-1-c)
    up, down = [], []
    for h, pos in ((0, lambda c: c), (1, lambda c: n - 1 - c)):
        u, d = _tree_phases(n, pos, lambda c, h=h: [(h,)], f"t{h}", True, True, True, lane=h)
        up += u
        down += d
    return 2, [up, down]


def _chain(axis: int, n: int, root: int, pair: str, where=None) -> list:
    """A broadcast chain root -> root+1 -> ... -> root-1 along ``axis`` (recv, then forward)."""
    send = tuple(0 if (c - root) % n == n - 1 else 1 for c in range(n))
    recv = tuple(0 if c == root else -1 for c in range(n))
    whole = lambda c: [(0,)]  # noqa: E731
    return [(False, axis, recv, 1, whole, False, pair, 0, where), (True, axis, send, 1, whole, False, pair, 0, where)]


def _hierarchical_broadcast(n0: int, n1: int, root: int) -> list:
    """Chain along the outer axis in the root's column, then along the inner axis in every row."""
    r0, r1 = divmod(root, n1)
    return (_chain(0, n0, r0, "o", (1, r1)) if n0 > 1 else []) + (_chain(1, n1, r1, "i") if n1 > 1 else [])


def _hierarchical(kind: str, sizes: tuple[int, ...], root: int = 0):
    n0, n1 = sizes  # outer, inner
    blocks = n0 * n1
    if kind == "all_to_all":
        return blocks, _hierarchical_a2a(n0, n1)
    if kind == "broadcast":
        return 1, [_hierarchical_broadcast(n0, n1, root)]

    # inner phase: position p on the inner axis owns blocks g with g % n1 == p (its "column")
    def col(c, p):
        return [(g0 * n1 + p,) for g0 in range(n0)]

    # outer phase, within column c1: position p on the outer axis owns block p*n1 + c1
    def cell(c, p):
        return [(p * n1 + c[1],)]

    rs_in = _fix_nblocks(_ring_rs_axis(1, n1, col), n0)
    ag_in = _fix_nblocks(_ring_ag_axis(1, n1, col), n0)
    rs_out = _fix_nblocks(_ring_rs_axis(0, n0, cell), 1)
    ag_out = _fix_nblocks(_ring_ag_axis(0, n0, cell), 1)
    if kind == "all_reduce":
        return blocks, rs_in + rs_out + ag_out + ag_in
    if kind == "reduce_scatter":
        return blocks, rs_in + rs_out
    return blocks, ag_out + ag_in


def _hierarchical_a2a(n0: int, n1: int) -> list[_Step]:
    """All-to-all in two pairwise-exchange phases: inner axis, then outer axis.

    Phase 1, step d: (c0, c1) sends (c0, c1+d) its blocks for every rank whose inner coordinate is
    c1+d (n0 blocks). Phase 2, step d: (c0, c1) sends (c0+d, c1) the blocks its row holds for
    (c0+d, c1) (n1 blocks). Every rank then holds (src, itself) for every src.
    """
    def g(c0, c1):
        return (c0 % n0) * n1 + c1 % n1

    steps = []
    for d in range(1, n1):
        steps.append(_pair(1, n1, d, n0, lambda c, d=d: [(g(*c), g(o, c[1] + d)) for o in range(n0)],
                           lambda c, d=d: [(g(c[0], c[1] - d), g(o, c[1])) for o in range(n0)], False))
    for d in range(1, n0):
        steps.append(_pair(0, n0, d, n1, lambda c, d=d: [(g(c[0], i), g(c[0] + d, c[1])) for i in range(n1)],
                           lambda c, d=d: [(g(c[0] - d, i), g(*c)) for i in range(n1)], False))
    return steps


def _ring_rs_axis(axis, n, owned):
    return _ring_rs(axis, n, owned)


def _ring_ag_axis(axis, n, owned):
    return _ring_ag(axis, n, owned)


def volume_blocks(s: Schedule, coords: Coords) -> int:
    """Units (block x chunk pieces) the rank at ``coords`` sends."""
    return sum(a.nblocks for a in s.actions if a.send and a.runs(coords))
