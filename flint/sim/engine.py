"""The event-driven simulator over per-rank node graphs.

Model
-----
Every simulated rank has four in-order streams: ``compute`` (COMP and MEM
nodes), ``coll`` (collectives), ``send`` and ``recv``, plus one more
in-order stream per named communication stream of the trace
(``NodeTable.comm_stream``, set by the ``assign-streams`` pass: e.g. FSDP2's
all-gather and reduce-scatter streams). A node is *issued*
when all its data and control dependencies have finished and every earlier
node of its stream (in table row order, the program's schedule) has
finished. A compute node then runs for its duration. A communication node
waits, holding its stream, until its partners have issued too:

- a collective starts when every member of its group has issued it (the
  ``k``-th collective a rank issues on group ``g`` meets the ``k``-th of every
  other member), i.e. at the latest member's issue time; all members finish
  together after :func:`~flint.cost.collective_time_us`;
- a send and a recv pair by ``(src, dst, tag)`` in issue order and run
  together for latency + bytes / bandwidth (:meth:`Network.p2p_time_us`).

There is no contention between transfers (uncongested network) and no
contention between streams. Compute durations are the node's
``duration_us`` when present, else the device roofline from ``flops`` and
``tensor_bytes`` (class ``gemm`` when the node has FLOPs, else
``elementwise``), else 0. Collective and send/recv durations always come
from the network model (a trace's own ``duration_us`` on them is ignored).

Symmetric ranks
---------------
Ranks sharing one table object form a *class*. When, for every class, every
group its collectives use (per symbolic slot) has only members of that class,
each member resolves the same slot to that same group, all those groups cost
the same, and the send/recv of every class mirror its representative's (the
representative's peers are representatives, every member's peer lies in the
class of the representative's peer, at the same transfer cost: pipeline
stages), then all ranks of a class follow identical timelines: every
collective and every transfer meets only peers that are in the same state
at the same time. The simulator then runs
one representative per class (the smallest rank) and copies its results to
the class. Otherwise (e.g. a straggler rank with its own table inside a
group, or send/recv to a peer outside the mirrored class) every rank is simulated.
Pass ``symmetric=False`` to force the full simulation.

Deadlock (a node that can never start, e.g. a collective some member never
issues or a recv without a send) raises :class:`SimDeadlock` naming the
rank, the node and the missing partners.
"""

from __future__ import annotations

import gc
import heapq
import math
import sys
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from flint.cost.collective import CollKind, collective_time_us
from flint.cost.device import Device
from flint.cost.network import Network
from flint.errors import FlintError
from flint.mesh import Mesh
from flint.trace import NodeKind, NodeTable, Trace

COMPUTE, COLL, SEND, RECV = 0, 1, 2, 3
STREAM_NAMES = ("compute", "coll", "send", "recv")


class SimDeadlock(FlintError):
    """A rank waits forever on a collective or a send/recv."""


@dataclass
class _TablePlan:
    """What every rank of one table shares: streams, successors, compute durations."""

    table: NodeTable
    stream: list[int]
    stream_rows: list[list[int]]
    succ: list[tuple[int, ...]]
    npred: list[int]
    comp_dur: np.ndarray
    coll_rows: np.ndarray  # rows of COLL nodes
    p2p_rows: np.ndarray   # rows of SEND / RECV nodes
    stream_names: tuple[str, ...] = STREAM_NAMES


def _plan_table(t: NodeTable, device: Device | None, dtype: str) -> _TablePlan:
    n = len(t)
    kind = t.kind.astype(np.int64)
    stream_arr = np.full(n, COMPUTE, dtype=np.int64)
    stream_arr[kind == NodeKind.COLL] = COLL
    stream_arr[kind == NodeKind.SEND] = SEND
    stream_arr[kind == NodeKind.RECV] = RECV
    names = STREAM_NAMES
    if t.comm_stream is not None and t.stream_names:
        named = (kind == NodeKind.COLL) & (t.comm_stream >= 0)
        stream_arr[named] = len(STREAM_NAMES) + t.comm_stream[named].astype(np.int64)
        names = STREAM_NAMES + tuple(t.stream_names)
    # dependencies, deduplicated, as successor lists
    dst = np.concatenate([np.repeat(np.arange(n), np.diff(t.data_dep_ptr)),
                          np.repeat(np.arange(n), np.diff(t.ctrl_dep_ptr))])
    src = np.concatenate([t.data_dep_idx, t.ctrl_dep_idx]).astype(np.int64)
    if src.size:
        pairs = np.unique(src * n + dst)
        src, dst = pairs // n, pairs % n
    npred = np.bincount(dst, minlength=n).tolist()
    order = np.argsort(src, kind="stable")
    src_s, dst_s = src[order], dst[order]
    bounds = np.searchsorted(src_s, np.arange(n + 1))
    dl = dst_s.tolist()
    bl = bounds.tolist()
    succ = [tuple(dl[bl[i]:bl[i + 1]]) for i in range(n)]
    # compute durations: the node's own, else the roofline, else 0
    dur = np.where(np.isnan(t.duration_us), 0.0, t.duration_us)
    is_comp = stream_arr == COMPUTE
    missing = is_comp & np.isnan(t.duration_us) & ((t.flops > 0) | (t.tensor_bytes > 0))
    if missing.any():
        if device is None:
            raise FlintError("the trace has compute nodes without duration_us; give a device to price them")
        f, b = t.flops[missing], t.tensor_bytes[missing]
        gemm = device.compute_time_us_array(f, b, "gemm", dtype)
        elem = device.compute_time_us_array(f, b, "elementwise", dtype)
        dur[missing] = np.where(f > 0, gemm, elem)
    dur = np.where(is_comp, dur, 0.0)
    stream = stream_arr.tolist()
    rows = [np.nonzero(stream_arr == k)[0].tolist() for k in range(len(names))]
    return _TablePlan(t, stream, rows, succ, npred, dur, np.nonzero(kind == NodeKind.COLL)[0],
                      np.nonzero((stream_arr == SEND) | (stream_arr == RECV))[0], names)


class _Groups:
    """Members and network levels of communicator groups (0 / -1: all ranks)."""

    def __init__(self, trace: Trace, network: Network) -> None:
        self.world = trace.world_size
        self.groups = trace.comm_groups
        self.network = network
        self._levels: dict[int, tuple] = {}
        self._sets: dict[int, frozenset] = {}

    def members(self, gid: int) -> tuple[int, ...]:
        if gid <= 0:
            return tuple(range(self.world))
        try:
            return self.groups[gid]
        except KeyError:
            raise FlintError(f"collective names communicator group {gid}, which the trace does not define "
                             f"(defined: {sorted(self.groups)[:10]}...)") from None

    def member_set(self, gid: int) -> frozenset:
        ms = self._sets.get(gid)
        if ms is None:
            ms = self._sets[gid] = frozenset(self.members(gid))
        return ms

    def levels(self, gid: int) -> tuple:
        lv = self._levels.get(gid)
        if lv is None:
            m = self.members(gid)
            lv = tuple(self.network.group_levels(m)) if len(m) > 1 else ()
            self._levels[gid] = lv
        return lv


def _cumcount(values: np.ndarray) -> np.ndarray:
    """For each element, how many earlier elements have the same value."""
    order = np.argsort(values, kind="stable")
    v = values[order]
    first = np.ones(v.size, dtype=bool)
    first[1:] = v[1:] != v[:-1]
    start_idx = np.maximum.accumulate(np.where(first, np.arange(v.size), 0))
    out = np.empty(v.size, dtype=np.int64)
    out[order] = np.arange(v.size) - start_idx
    return out


def _resolve_collectives(trace, sim_ranks, plans, groups, alg, is_sym, sync_arr, inst_expected, inst_dur,
                         inst_desc) -> None:
    """Number collective calls: the k-th call of every member on group g is one instance (vectorized)."""
    ent = {k: [] for k in ("s", "row", "rank", "gid", "kth", "ct", "nb")}
    for s, r in enumerate(sim_ranks):
        plan = plans[s]
        rows = plan.coll_rows
        if not rows.size:
            continue
        t = plan.table
        gids = trace.ranks[r].groups()[rows].astype(np.int64)
        ent["s"].append(np.full(rows.size, s, dtype=np.int64))
        ent["row"].append(rows)
        ent["rank"].append(np.full(rows.size, r, dtype=np.int64))
        ent["gid"].append(gids)
        ent["kth"].append(_cumcount(gids))
        ent["ct"].append(t.comm_type[rows].astype(np.int64))
        ent["nb"].append(t.comm_bytes[rows].astype(np.int64))
    if not ent["s"]:
        return
    e = {k: np.concatenate(v) for k, v in ent.items()}
    # membership: every issuing rank must belong to the group it names
    for r, gid in np.unique(np.stack([e["rank"], e["gid"]], axis=1), axis=0).tolist():
        if r not in groups.member_set(gid):
            i = int(np.nonzero((e["rank"] == r) & (e["gid"] == gid))[0][0])
            t = plans[int(e["s"][i])].table
            row = int(e["row"][i])
            raise FlintError(f"rank {r} node {int(t.node_ids[row])} '{t.names[row]}' issues a collective on group {gid}, "
                             f"which does not contain it (members {list(groups.members(gid))[:16]})")
    if is_sym:
        first = np.arange(e["s"].size)
        inv = first
    else:
        key = e["gid"] * (int(e["kth"].max()) + 1) + e["kth"]
        _, first, inv = np.unique(key, return_index=True, return_inverse=True)
        inv = inv.reshape(-1)
        bad = np.nonzero((e["ct"] != e["ct"][first][inv]) | (e["nb"] != e["nb"][first][inv]))[0]
        if bad.size:
            i = int(bad[0])
            j = int(first[inv[i]])
            t = plans[int(e["s"][i])].table
            row = int(e["row"][i])
            mine = ("c", int(e["ct"][i]), int(e["nb"][i]), int(e["gid"][i]), int(e["kth"][i]))
            other = ("c", int(e["ct"][j]), int(e["nb"][j]), int(e["gid"][j]), int(e["kth"][j]))
            raise FlintError(f"rank {int(e['rank'][i])} node {int(t.node_ids[row])} '{t.names[row]}': {_describe(mine)}, "
                             f"but rank {int(e['rank'][j])} issued {_describe(other)} as the same call; members must issue "
                             "a group's collectives in the same order with the same kind and size")
    base = len(inst_expected)
    gid_f, ct_f, nb_f, kth_f = (e[k][first].tolist() for k in ("gid", "ct", "nb", "kth"))
    cache: dict[tuple, float] = {}
    for gid, ct, nb, kth in zip(gid_f, ct_f, nb_f, kth_f):
        ck = (gid, ct, nb)
        d = cache.get(ck)
        if d is None:
            d = cache[ck] = _coll_duration(groups, gid, ct, nb, alg)
        inst_expected.append(1 if is_sym else len(groups.members(gid)))
        inst_dur.append(d)
        inst_desc.append(("c", ct, nb, gid, kth))
    ids = inv + base
    for s in np.unique(e["s"]).tolist():
        m = e["s"] == s
        sync_arr[s][e["row"][m]] = ids[m]


def _coll_duration(groups: _Groups, gid: int, comm_type: int, nbytes: int, algorithm: Mapping[CollKind, str]) -> float:
    m = groups.members(gid)
    if len(m) <= 1:
        return 0.0
    kind = CollKind(int(comm_type))
    return collective_time_us(kind, nbytes, len(m), list(groups.levels(gid)), algorithm.get(kind, "ring"))


def _p2p_symmetric(trace: Trace, cls: list[int], rows: np.ndarray, rep: np.ndarray, network: Network) -> bool:
    """Whether the send/recv of a class's members mirror its representative's (module docstring).

    True when the representative's peers are themselves representatives, every
    member's peer on each send/recv lies in the class of the representative's
    peer on that node, and every member's transfers cost what the
    representative's do (the same network dimensions crossed at the same
    distances). Then simulating the representatives alone pairs every send
    with its recv (a pipeline's stages: one representative per stage role).
    """
    base = trace.ranks[cls[0]].peers()[rows]
    if np.any(base < 0) or np.any(base >= rep.size) or np.any(rep[base] != base):
        return False
    pairs = np.unique(base)
    cost = {int(p): network.p2p_time_us(cls[0], int(p), 1 << 20) for p in pairs}
    for r in cls[1:]:
        peers = trace.ranks[r].peers()[rows]
        if np.any(peers < 0) or np.any(peers >= rep.size) or np.any(rep[peers] != base):
            return False
        for b in pairs.tolist():
            p = int(peers[np.argmax(base == b)])
            if not math.isclose(network.p2p_time_us(r, p, 1 << 20), cost[b], rel_tol=1e-12):
                return False
    return True


def _symmetric_classes(trace: Trace, groups: _Groups) -> list[list[int]] | None:
    """Classes of ranks that follow identical timelines, or None (module docstring)."""
    by_table: dict[int, list[int]] = {}
    for r, p in enumerate(trace.ranks):
        by_table.setdefault(id(p.table), []).append(r)
    classes = list(by_table.values())
    world = trace.world_size
    rep = np.empty(world, dtype=np.int64)
    for cls in classes:
        rep[cls] = cls[0]
    for cls in classes:
        t = trace.ranks[cls[0]].table
        kind = t.kind
        p2p = np.nonzero((kind == NodeKind.SEND) | (kind == NodeKind.RECV))[0]
        if len(cls) > 1 and p2p.size and not _p2p_symmetric(trace, cls, p2p, rep, groups.network):
            return None
        coll = kind == NodeKind.COLL
        if not coll.any():
            continue
        slots = np.unique(t.comm_group[coll])
        cls_arr = np.asarray(cls, dtype=np.int64)
        for slot in slots.tolist():
            g = np.full(world, -2, dtype=np.int64)
            for r in cls:
                p = trace.ranks[r]
                if p.group_ids is None or slot < 0:
                    g[r] = max(slot, 0)
                else:
                    g[r] = int(p.group_ids[slot]) if slot < len(p.group_ids) else -3
            gs = g[cls_arr]
            if np.any(gs == -3):
                return None
            sig = None
            for gid in np.unique(gs).tolist():
                mem = np.asarray(groups.members(gid), dtype=np.int64)
                if not np.all(g[mem] == gid):
                    return None
                s = (len(mem), tuple((id(lk), n) for lk, n in groups.levels(gid)))
                if sig is None:
                    sig = s
                elif s != sig:
                    return None
    return classes


@dataclass
class RawSim:
    """What the engine produced; :class:`~flint.sim.result.SimResult` summarizes it."""

    trace: Trace
    sim_ranks: list[int]            # the simulated rank of each simulated program
    classes: list[list[int]]        # ranks each simulated program stands for
    plans: list[_TablePlan]
    issue_us: list[np.ndarray]
    start_us: list[np.ndarray]
    finish_us: list[np.ndarray]
    duration_us: list[np.ndarray]
    events: int
    wall_s: float
    symmetric: bool


def run(trace: Trace, device: Device | None, network: Network, mesh: Mesh | None = None, *,
        algorithm: str | Mapping[str | CollKind, str] = "ring", dtype: str = "bf16",
        symmetric: bool = True) -> RawSim:
    """Simulate ``trace``; see the module docstring for the model."""
    was_enabled = gc.isenabled()
    gc.disable()  # millions of small lists and tuples, no cycles: the collector only costs time
    try:
        return _run(trace, device, network, mesh, algorithm, dtype, symmetric)
    finally:
        if was_enabled:
            gc.enable()


def _run(trace, device, network, mesh, algorithm, dtype, symmetric) -> RawSim:
    t0 = time.perf_counter()
    world = trace.world_size
    if mesh is not None and mesh.world_size != world:
        raise FlintError(f"mesh {list(mesh.shape)} has {mesh.world_size} ranks but the trace has {world}")
    net = network.for_world(world)
    if isinstance(algorithm, str):
        alg = {k: algorithm for k in CollKind}
    else:
        from flint.cost.collective import coll_kind
        alg = {coll_kind(k): v for k, v in algorithm.items()}
        for k in CollKind:
            alg.setdefault(k, "ring")
    groups = _Groups(trace, net)

    classes = _symmetric_classes(trace, groups) if symmetric else None
    is_sym = classes is not None
    if classes is None:
        classes = [[r] for r in range(world)]
    sim_ranks = [c[0] for c in classes]
    plan_cache: dict[int, _TablePlan] = {}
    plans = []
    for r in sim_ranks:
        t = trace.ranks[r].table
        if id(t) not in plan_cache:
            plan_cache[id(t)] = _plan_table(t, device, dtype)
        plans.append(plan_cache[id(t)])
    S = len(sim_ranks)
    sim_of_rank = {r: s for s, r in enumerate(sim_ranks)}

    # resolve synchronizing nodes into instances (one per collective call / send-recv pair)
    inst_expected: list[int] = []
    inst_dur: list[float] = []
    inst_desc: list[tuple] = []
    sync_arr = [np.full(len(p.table), -1, dtype=np.int64) for p in plans]
    _resolve_collectives(trace, sim_ranks, plans, groups, alg, is_sym, sync_arr, inst_expected, inst_dur, inst_desc)
    keyed: dict[tuple, int] = {}
    for s, r in enumerate(sim_ranks):
        plan = plans[s]
        t = plan.table
        rows = plan.p2p_rows
        if not rows.size:
            continue
        peers = trace.ranks[r].peers()[rows].tolist()
        count: dict[tuple, int] = {}
        for row, k, peer, nb, tag in zip(rows.tolist(), t.kind[rows].tolist(), peers, t.comm_bytes[rows].tolist(),
                                         t.comm_tag[rows].tolist()):
            if not 0 <= peer < world:
                raise FlintError(f"rank {r} node {int(t.node_ids[row])} '{t.names[row]}' names peer rank "
                                 f"{peer}, outside world size {world}")
            src, dst = (r, peer) if k == NodeKind.SEND else (peer, r)
            ck = (src, dst, tag, k)
            kth = count.get(ck, 0)
            count[ck] = kth + 1
            key = (src, dst, tag, kth)
            idx = keyed.get(key)
            if idx is None:
                idx = keyed[key] = len(inst_expected)
                inst_expected.append(2)
                inst_dur.append(net.p2p_time_us(src, dst, nb))
                inst_desc.append(("p", nb, src, dst, tag, kth))
            sync_arr[s][row] = idx
    sync = [x.tolist() for x in sync_arr]
    inst_arrived: list[list] = [[] for _ in inst_expected]

    # state
    pending = [list(p.npred) for p in plans]
    issue = [[math.nan] * len(p.table) for p in plans]
    start = [[math.nan] * len(p.table) for p in plans]
    finish = [[math.nan] * len(p.table) for p in plans]
    durs = [p.comp_dur.tolist() for p in plans]
    ptr = [[0] * len(p.stream_rows) for p in plans]
    busy = [[False] * len(p.stream_rows) for p in plans]
    heap: list[tuple[float, int, int, int]] = []
    seq = 0
    push = heapq.heappush

    def try_issue(s: int, k: int, now: float) -> None:
        nonlocal seq
        if busy[s][k]:
            return
        rows = plans[s].stream_rows[k]
        p = ptr[s][k]
        if p >= len(rows):
            return
        row = rows[p]
        if pending[s][row]:
            return
        busy[s][k] = True
        issue[s][row] = now
        inst = sync[s][row]
        if inst < 0:
            start[s][row] = now
            push(heap, (now + durs[s][row], seq, s, row))
            seq += 1
            return
        arrived = inst_arrived[inst]
        arrived.append((s, row))
        if len(arrived) == inst_expected[inst]:
            d = inst_dur[inst]
            end = now + d
            for s2, r2 in arrived:
                start[s2][r2] = now
                durs[s2][r2] = d
                push(heap, (end, seq, s2, r2))
                seq += 1

    for s in range(S):
        for k in range(len(plans[s].stream_rows)):
            try_issue(s, k, 0.0)
    events = _loop(heap, plans, ptr, busy, pending, finish, try_issue, sum(len(p.table) for p in plans))

    for s in range(S):
        if ptr[s] != [len(x) for x in plans[s].stream_rows]:
            _raise_deadlock(sim_ranks, plans, ptr, sync, inst_expected, inst_desc, inst_arrived, issue, groups, is_sym)

    return RawSim(trace, sim_ranks, classes, plans,
                  [_arr(x) for x in issue], [_arr(x) for x in start],
                  [_arr(x) for x in finish], [_arr(x) for x in durs],
                  events, time.perf_counter() - t0, is_sym)


def _arr(x: list) -> np.ndarray:
    return np.fromiter(x, dtype=np.float64, count=len(x))


_PROGRESS_MIN_EVENTS = 500_000
_PROGRESS_EVERY = 1 << 16


def _loop(heap, plans, ptr, busy, pending, finish, try_issue, total: int = 0) -> int:
    """Pop completion events in time order until none is left; returns the event count.

    Simulations of at least 500,000 node events show a progress bar (:mod:`flint.progress`)."""
    from flint.progress import enabled

    bar = None
    if total >= _PROGRESS_MIN_EVENTS and enabled():
        from tqdm import tqdm

        bar = tqdm(total=total, desc="simulating", unit="node", file=sys.stderr, leave=False, dynamic_ncols=True)
    pop = heapq.heappop
    events = 0
    while heap:
        now, _, s, row = pop(heap)
        events += 1
        if bar is not None and not events % _PROGRESS_EVERY:
            bar.update(_PROGRESS_EVERY)
        finish[s][row] = now
        plan = plans[s]
        stream = plan.stream
        k = stream[row]
        ptr[s][k] += 1
        busy[s][k] = False
        pend = pending[s]
        for nxt in plan.succ[row]:
            pend[nxt] -= 1
            if not pend[nxt]:
                k2 = stream[nxt]
                if k2 != k:
                    try_issue(s, k2, now)
        try_issue(s, k, now)
    if bar is not None:
        bar.close()
    return events


def _describe(desc: tuple) -> str:
    if desc[0] == "c":
        _, ct, nb, gid, k = desc
        return f"{CollKind(ct).name.lower()} of {nb} bytes on group {gid} (call #{k})"
    _, nb, src, dst, tag, k = desc
    return f"send/recv of {nb} bytes from rank {src} to rank {dst}, tag {tag} (#{k})"


def _raise_deadlock(sim_ranks, plans, ptr, sync, inst_expected, inst_desc, inst_arrived, issue, groups, is_sym) -> None:
    msgs = []
    for s, r in enumerate(sim_ranks):
        plan = plans[s]
        t = plan.table
        for k in range(len(plan.stream_rows)):
            rows = plan.stream_rows[k]
            if ptr[s][k] >= len(rows):
                continue
            row = rows[ptr[s][k]]
            inst = sync[s][row]
            if inst >= 0 and not math.isnan(issue[s][row]):
                desc = inst_desc[inst]
                who = (groups.members(desc[3]) if not is_sym else (r,)) if desc[0] == "c" else desc[2:4]
                got = {sim_ranks[s2] for s2, _ in inst_arrived[inst]}
                missing = [m for m in who if m not in got]
                msgs.append(f"rank {r} waits forever at node {int(t.node_ids[row])} '{t.names[row]}' ({_describe(desc)}): "
                            f"{len(inst_arrived[inst])} of {inst_expected[inst]} arrived; never arrived: ranks {missing[:16]}")
    if not msgs:  # nothing issued-and-waiting: report the first stuck node of each rank
        for s, r in enumerate(sim_ranks):
            plan = plans[s]
            for k in range(len(plan.stream_rows)):
                rows = plan.stream_rows[k]
                if ptr[s][k] < len(rows):
                    row = rows[ptr[s][k]]
                    msgs.append(f"rank {r} never starts node {int(plan.table.node_ids[row])} '{plan.table.names[row]}'")
                    break
    raise SimDeadlock("deadlock: " + "; ".join(msgs[:8]) + (f"; ... ({len(msgs)} waiting nodes)" if len(msgs) > 8 else ""))
