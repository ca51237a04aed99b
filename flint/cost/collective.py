"""The one collective-cost formula of Flint.

:func:`collective_time_us` prices one collective for one group. Each
algorithm is a list of *steps*; in a step every rank sends ``m`` bytes to a
peer at ring distance ``d`` (all ranks at once), and the step costs::

    latency_us * hops(d) + m * load(d) / bandwidth

``hops`` and ``load`` (how many flows share the busiest link) depend on the
link's topology:

=================  ==========================  ============================
topology           hops(d)                     load(d)
=================  ==========================  ============================
switch             1                           1
fully-connected    1                           1 (a private link per peer)
ring (bidir.)      min(d, n-d)                 min(d, n-d)
mesh (a line)      max(d, n-d) (wraps back)    max(d, n-d)
=================  ==========================  ============================

A ring-algorithm step on a ``mesh`` line uses the snake embedding
(0, 2, 4, ..., 5, 3, 1): 2 hops, load 1.

Data-volume conventions (``input_bytes`` is Chakra's ``comm_size``: each
rank's *input* buffer; ``S`` below is the full buffer):

- all-reduce: ``S = input``; ring moves 2(n-1)/n·S per rank in 2(n-1) steps.
- reduce-scatter: ``S = input`` (the full buffer); ring (n-1)/n·S in n-1 steps.
- all-gather: input is the local shard, ``S = n × input``; ring (n-1)/n·S =
  (n-1)·input in n-1 steps.
- all-to-all: ``S = input`` (everything a rank sends, S/n per peer); (n-1)/n·S.
- broadcast / reduce: ``S = input``; pipelined, S once plus per-hop latency.
- barrier: a zero-byte all-reduce.

Algorithms: ``ring``, ``tree`` (double binary tree: all-reduce, broadcast,
reduce, barrier), ``direct`` (every rank talks to every peer in one step per
phase), ``halving-doubling`` (recursive halving / doubling; all-to-all as
Bruck; the group size must be a power of two).

Closer to NCCL (all optional on a :class:`Link`, so a bare link is the plain
alpha-beta model above):

- ``base_latency_us``: a fixed cost per collective per network level (NCCL's
  kernel launch and setup, its tuner's ``baseLat``), on top of the per-step
  ``latency_us`` (its ``hwLat`` per hop).
- ``bus_efficiency``: the fraction of the link bandwidth a collective reaches
  as a function of its buffer size ``S`` on that level, points ``[(bytes,
  fraction), ...]`` interpolated linearly in log(bytes) and held flat beyond
  the ends: the shape of the bus-bandwidth curves ``nccl-tests`` prints
  (few channels and protocol overheads at small sizes, a plateau below the
  wire speed at large ones). The bandwidth term of every step is divided by
  it.
- ``algorithm="auto"``: NCCL's choice, the faster of ``ring`` and ``tree``
  for all-reduce (tree wins for small buffers over many ranks), ``ring`` for
  everything else.

Several network levels (a group spanning several mesh axes placed on
different network dimensions, e.g. 8 GPUs of a node × 16 nodes) are passed as
``link=[(inner_link, n_inner), (outer_link, n_outer), ...]`` and priced
hierarchically: all-reduce = reduce-scatter inside each level from the inner
out, all-reduce at the outermost level on the remaining 1/Π(inner) of the
buffer, all-gather back; reduce-scatter / all-gather the same halves; every
level uses ``algorithm``. All-to-all over several levels is priced as a flat
all-to-all of the whole group on the slowest (least bandwidth) level's link:
every byte that leaves the inner level crosses it; pessimistic for the inner
share. Broadcast, reduce and barrier add up a full pass per level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Sequence

from flint.errors import FlintError
from flint.trace import CollKind


class Topology(StrEnum):
    """How the ranks along one network dimension are wired."""

    SWITCH = "switch"
    FULLY_CONNECTED = "fully-connected"
    RING = "ring"
    MESH = "mesh"


class Algorithm(StrEnum):
    """Collective algorithms :func:`collective_time_us` knows."""

    RING = "ring"
    TREE = "tree"
    DIRECT = "direct"
    HALVING_DOUBLING = "halving-doubling"
    AUTO = "auto"


def parse_topology(name: str) -> Topology:
    """Parse a topology name; ``FlintError`` lists the valid ones."""
    try:
        return Topology(str(name))
    except ValueError:
        raise FlintError(f"unknown topology '{name}' (valid: {', '.join(t.value for t in Topology)})") from None


def parse_algorithm(name: str) -> Algorithm:
    """Parse an algorithm name; ``FlintError`` lists the valid ones."""
    try:
        return Algorithm(str(name))
    except ValueError:
        raise FlintError(f"unknown collective algorithm '{name}' (valid: {', '.join(a.value for a in Algorithm)})") from None


@dataclass(frozen=True)
class Link:
    """One network dimension as a collective sees it.

    ``bandwidth_gbytes_per_s`` is what one rank can send in one direction
    (1e9 bytes/s; for ``fully-connected`` per peer link); ``latency_us`` is the
    cost of one message over one hop, software included.
    """

    bandwidth_gbytes_per_s: float
    latency_us: float
    topology: Topology = Topology.SWITCH
    name: str = ""
    base_latency_us: float = 0.0
    bus_efficiency: tuple[tuple[float, float], ...] = ()  # (buffer bytes, fraction of bandwidth), sorted

    def __post_init__(self) -> None:
        object.__setattr__(self, "topology", parse_topology(self.topology))
        if not self.bandwidth_gbytes_per_s > 0:
            raise FlintError(f"link '{self.name}': bandwidth_gbytes_per_s must be > 0, got {self.bandwidth_gbytes_per_s}")
        if not self.latency_us >= 0:
            raise FlintError(f"link '{self.name}': latency_us must be >= 0, got {self.latency_us}")
        if not self.base_latency_us >= 0:
            raise FlintError(f"link '{self.name}': base_latency_us must be >= 0, got {self.base_latency_us}")
        pts = tuple((float(b), float(f)) for b, f in self.bus_efficiency)
        for b, f in pts:
            if not (b > 0 and 0 < f <= 1):
                raise FlintError(f"link '{self.name}': bus_efficiency point [{b:g}, {f:g}] needs bytes > 0 and "
                                 "0 < fraction <= 1")
        if any(b2 <= b1 for (b1, _), (b2, _) in zip(pts, pts[1:])):
            raise FlintError(f"link '{self.name}': bus_efficiency points must have increasing bytes")
        object.__setattr__(self, "bus_efficiency", pts)

    @property
    def bytes_per_us(self) -> float:
        return self.bandwidth_gbytes_per_s * 1e3

    def efficiency(self, nbytes: float) -> float:
        """Fraction of the bandwidth a collective of an ``nbytes`` buffer reaches (module docstring)."""
        pts = self.bus_efficiency
        if not pts:
            return 1.0
        if nbytes <= pts[0][0]:
            return pts[0][1]
        if nbytes >= pts[-1][0]:
            return pts[-1][1]
        x = math.log(nbytes)
        for (b1, f1), (b2, f2) in zip(pts, pts[1:]):
            if nbytes <= b2:
                w = (x - math.log(b1)) / (math.log(b2) - math.log(b1))
                return f1 + w * (f2 - f1)
        return pts[-1][1]

    def at_size(self, nbytes: float) -> "Link":
        """This link as a collective of an ``nbytes`` buffer sees it: bandwidth times its efficiency."""
        eff = self.efficiency(nbytes)
        if eff == 1.0:
            return self
        return Link(self.bandwidth_gbytes_per_s * eff, self.latency_us, self.topology, self.name,
                    self.base_latency_us)


_KIND_NAMES = {k.name.lower(): k for k in CollKind}


def coll_kind(kind: CollKind | int | str) -> CollKind:
    """Accept a :class:`CollKind`, its value, or a name like ``"all_gather"`` / ``"ALL_GATHER"``."""
    if isinstance(kind, str):
        k = _KIND_NAMES.get(kind.lower().replace("-", "_"))
        if k is None:
            raise FlintError(f"unknown collective '{kind}' (valid: {', '.join(_KIND_NAMES)})")
        return k
    return CollKind(int(kind))


def _hops_load(topo: Topology, d: int, n: int) -> tuple[int, int]:
    if topo in (Topology.SWITCH, Topology.FULLY_CONNECTED):
        return 1, 1
    if topo is Topology.RING:
        h = min(d, n - d)
        return h, h
    h = max(d, n - d)  # mesh line: half the flows wrap back across the line
    return h, h


def _steps_time(link: Link, n: int, steps: Sequence[tuple[int, float]], ring_alg: bool = False) -> float:
    t = 0.0
    for d, m in steps:
        if ring_alg:
            hops, load = (2 if n > 2 else 1, 1) if link.topology is Topology.MESH else (1, 1)
        else:
            hops, load = _hops_load(link.topology, d, n)
        t += link.latency_us * hops + m * load / link.bytes_per_us
    return t


def _direct_time(link: Link, n: int, m: float) -> float:
    """One phase where every rank sends ``m`` bytes to each of its n-1 peers at once."""
    topo = link.topology
    if topo is Topology.SWITCH:
        hops, load = 1, n - 1
    elif topo is Topology.FULLY_CONNECTED:
        hops, load = 1, 1
    elif topo is Topology.RING:  # sum of shortest distances, split over two directions
        hops, load = n // 2, sum(min(d, n - d) for d in range(1, n)) / 2
    else:  # a line: the middle link carries floor(n/2)·ceil(n/2) flows each way
        hops, load = n - 1, (n // 2) * ((n + 1) // 2)
    return link.latency_us * hops + m * load / link.bytes_per_us


def _log2_exact(n: int, what: str) -> int:
    k = n.bit_length() - 1
    if 1 << k != n:
        raise FlintError(f"halving-doubling {what} needs a power-of-two group size, got {n}; use ring or direct")
    return k


def _tree_all_reduce_volume(n: int) -> float:
    """Bytes (in full buffers S) the busiest rank sends in NCCL's double binary tree all-reduce.

    Each tree reduces and broadcasts half of the buffer; a rank that is an
    inner node with two children in one tree (and a leaf in the mirrored
    other) sends S/2 up and 2 x S/2 down there plus S/2 up the other tree:
    2S, the "algorithm bandwidth = bus bandwidth / 2" of NCCL's tuning model
    for trees (``ncclTopoTuneModel``, src/graph/tuning.cc: tree ``ratio *=
    .5``). Groups of fewer than 5 ranks have no such rank: the busiest sends
    1.5S (3, 4 ranks) or S (2 ranks, each rank the other's only child).
    """
    return 1.0 if n <= 2 else 1.5 if n <= 4 else 2.0


def _flat(kind: CollKind, S: float, n: int, link: Link, alg: Algorithm) -> float:
    """Time of one collective on one level; ``S`` is the full-buffer size (module docstring)."""
    if n <= 1:
        return 0.0
    if alg is Algorithm.AUTO:
        if kind in (CollKind.ALL_REDUCE, CollKind.BARRIER):
            return min(_flat(kind, S, n, link, Algorithm.RING), _flat(kind, S, n, link, Algorithm.TREE))
        alg = Algorithm.RING
    link = link.at_size(S)
    return link.base_latency_us + _flat_steps(kind, S, n, link, alg)


def _flat_steps(kind: CollKind, S: float, n: int, link: Link, alg: Algorithm) -> float:
    if kind is CollKind.BARRIER:
        kind, S = CollKind.ALL_REDUCE, 0.0
    if kind in (CollKind.REDUCE_SCATTER_BLOCK,):
        kind = CollKind.REDUCE_SCATTER
    if kind in (CollKind.GATHER, CollKind.SCATTER):  # one root exchanges (n-1)/n·S with the others
        kind = CollKind.ALL_GATHER if kind is CollKind.GATHER else CollKind.REDUCE_SCATTER
    chunk = S / n
    if alg is Algorithm.RING:
        if kind is CollKind.ALL_REDUCE:
            return _steps_time(link, n, [(1, chunk)] * (2 * (n - 1)), ring_alg=True)
        if kind in (CollKind.ALL_GATHER, CollKind.REDUCE_SCATTER):
            return _steps_time(link, n, [(1, chunk)] * (n - 1), ring_alg=True)
        if kind is CollKind.ALL_TO_ALL:  # pairwise exchange: step k sends S/n to the rank k away
            return _steps_time(link, n, [(d, chunk) for d in range(1, n)])
        # broadcast / reduce: pipelined chain, S once plus n-1 hop latencies
        return _steps_time(link, n, [(1, 0.0)] * (n - 1), ring_alg=True) + S / link.bytes_per_us
    if alg is Algorithm.TREE:
        depth = math.ceil(math.log2(n))
        if kind is CollKind.ALL_REDUCE:  # double binary tree: reduce up + broadcast down, pipelined
            return 2 * depth * link.latency_us + _tree_all_reduce_volume(n) * S / link.bytes_per_us
        if kind in (CollKind.BROADCAST, CollKind.REDUCE):
            return depth * link.latency_us + S / link.bytes_per_us
        raise FlintError(f"the tree algorithm prices all_reduce, broadcast, reduce and barrier, not {kind.name.lower()}; "
                         "use ring, direct or halving-doubling")
    if alg is Algorithm.DIRECT:
        if kind is CollKind.ALL_REDUCE:
            return 2 * _direct_time(link, n, chunk)
        if kind in (CollKind.ALL_GATHER, CollKind.REDUCE_SCATTER, CollKind.ALL_TO_ALL):
            return _direct_time(link, n, chunk)
        return _direct_time(link, n, S)  # broadcast / reduce: the root exchanges all of S with every peer at once
    # halving-doubling
    k = _log2_exact(n, kind.name.lower())
    half = [(n >> (i + 1), S / (2 ** (i + 1))) for i in range(k)]  # distances n/2 .. 1, bytes S/2 .. S/n
    if kind is CollKind.REDUCE_SCATTER:
        return _steps_time(link, n, half)
    if kind is CollKind.ALL_GATHER:
        return _steps_time(link, n, half[::-1])
    if kind is CollKind.ALL_REDUCE:
        return _steps_time(link, n, half) + _steps_time(link, n, half[::-1])
    if kind is CollKind.ALL_TO_ALL:  # Bruck: log2 n steps of S/2
        return _steps_time(link, n, [(1 << i, S / 2) for i in range(k)])
    return _steps_time(link, n, [(1 << i, S) for i in range(k)])  # binomial broadcast / reduce


def collective_time_us(kind: CollKind | int | str, input_bytes: float, group_size: int,
                       link: Link | Sequence[tuple[Link, int]], algorithm: Algorithm | str = "ring") -> float:
    """Microseconds one collective takes for every member of its group.

    ``kind``: a :class:`~flint.trace.CollKind` (or its name); ``input_bytes``:
    Chakra ``comm_size`` (see the module docstring for each kind's meaning);
    ``group_size``: members; ``link``: one :class:`Link`, or ``[(link,
    n_ranks_along_it), ...]`` inner level first for a group spanning several
    network levels (the product of the sizes must equal ``group_size``);
    ``algorithm``: ``ring`` / ``tree`` / ``direct`` / ``halving-doubling``, or ``auto``
    (NCCL's choice: the faster of ring and tree for all-reduce, ring otherwise).
    """
    kind, alg, n, full, levels = _prepare(kind, input_bytes, group_size, link, algorithm)
    if not levels:
        return 0.0
    if len(levels) > 1 and kind in (CollKind.BROADCAST, CollKind.REDUCE, CollKind.BARRIER):  # a pass per level
        return sum(_flat(kind, full, m, lk, alg) for lk, m in levels)
    outer = _outer_level(kind, full, n, levels)
    top = _flat(*outer, alg)
    if len(levels) == 1 or kind is CollKind.ALL_TO_ALL:
        return top
    down, s = [], full
    for lk, m in levels[:-1]:  # reduce-scatter (or, for all-gather, the matching gather) inner -> outer
        down.append((lk, m, s))
        s /= m
    if kind is CollKind.ALL_REDUCE:
        return top + sum(_flat(CollKind.REDUCE_SCATTER, sz, m, lk, alg) + _flat(CollKind.ALL_GATHER, sz, m, lk, alg)
                         for lk, m, sz in down)
    return top + sum(_flat(outer[0], sz, m, lk, alg) for lk, m, sz in down)


def _outer_level(kind: CollKind, full: float, n: int, levels: list[tuple[Link, int]]
                 ) -> tuple[CollKind, float, int, Link]:
    """``(kind, full-buffer bytes, ranks, link)`` of the collective a (hierarchical) collective runs on its
    outermost network level (module docstring): the whole group on the slowest link for all-to-all, the
    remaining 1/prod(inner) of the buffer for all-reduce, reduce-scatter and all-gather."""
    if len(levels) == 1:
        return kind, full, n, levels[0][0]
    if kind is CollKind.ALL_TO_ALL:
        return kind, full, n, min((lk for lk, _ in levels), key=lambda lk: lk.bandwidth_gbytes_per_s)
    top_link, top_n = levels[-1]
    if kind in (CollKind.BROADCAST, CollKind.REDUCE, CollKind.BARRIER):
        return kind, full, top_n, top_link
    s = full
    for _, m in levels[:-1]:
        s /= m
    if kind is not CollKind.ALL_REDUCE:
        kind = CollKind.REDUCE_SCATTER if kind in (CollKind.REDUCE_SCATTER, CollKind.REDUCE_SCATTER_BLOCK,
                                                    CollKind.SCATTER) else CollKind.ALL_GATHER
    return kind, s, top_n, top_link


def _prepare(kind, input_bytes, group_size, link, algorithm):
    """``(kind, algorithm, n, full buffer bytes, [(link, ranks), ...] inner first)``, checked."""
    kind = coll_kind(kind)
    alg = parse_algorithm(algorithm)
    n = int(group_size)
    if n < 1:
        raise FlintError(f"collective group size must be >= 1, got {n}")
    if input_bytes < 0:
        raise FlintError(f"collective input_bytes must be >= 0, got {input_bytes}")
    full = float(input_bytes) * n if kind is CollKind.ALL_GATHER or kind is CollKind.GATHER else float(input_bytes)
    if isinstance(link, Link):
        return kind, alg, n, full, ([(link, n)] if n > 1 else [])
    levels = [(lk, int(m)) for lk, m in link if int(m) > 1]
    if math.prod(m for _, m in levels) != n:
        raise FlintError(f"collective over levels {[m for _, m in levels]} does not cover its group of {n} ranks")
    return kind, alg, n, full, levels


def _bandwidth(kind: CollKind, S: float, n: int, link: Link, alg: Algorithm) -> float:
    """The bytes-dependent part of :func:`_flat` (its time less the same algorithm's time for no bytes)."""
    if alg is Algorithm.AUTO:
        alg = Algorithm.RING
        if kind in (CollKind.ALL_REDUCE, CollKind.BARRIER) and \
                _flat(kind, S, n, link, Algorithm.TREE) < _flat(kind, S, n, link, Algorithm.RING):
            alg = Algorithm.TREE
    return max(0.0, _flat(kind, S, n, link, alg) - _flat(kind, 0.0, n, link, alg))


def outer_bandwidth_us(kind: CollKind | int | str, input_bytes: float, group_size: int,
                       link: Link | Sequence[tuple[Link, int]], algorithm: Algorithm | str = "ring") -> float:
    """The part of :func:`collective_time_us` that moves bytes over the group's outermost network level
    (latencies and inner levels excluded): the time each member's port on that level is busy, which the
    simulator shares with the other transfers crossing the port."""
    kind, alg, n, full, levels = _prepare(kind, input_bytes, group_size, link, algorithm)
    return _bandwidth(*_outer_level(kind, full, n, levels), alg) if levels else 0.0


def p2p_time_us(nbytes: float, link: Link, hops: int = 1) -> float:
    """One send/recv transfer: ``latency_us × hops + bytes / bandwidth``."""
    return link.latency_us * hops + float(nbytes) / link.bytes_per_us
