"""The event-driven simulator over per-rank node graphs.

Model
-----
Every simulated rank has four in-order streams: ``compute`` (COMP and MEM
nodes), ``coll`` (collectives), ``send`` and ``recv``. A node is *issued*
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
the same, and no class of more than one rank has send/recv nodes, then all
ranks of a class follow identical timelines: every collective meets only
peers that are in the same state at the same time. The simulator then runs
one representative per class (the smallest rank) and copies its results to
the class. Otherwise (e.g. a straggler rank with its own table inside a
group, or pipeline send/recv between classes) every rank is simulated.
Pass ``symmetric=False`` to force the full simulation.

Deadlock (a node that can never start, e.g. a collective some member never
issues or a recv without a send) raises :class:`SimDeadlock` naming the
rank, the node and the missing partners.
"""

from __future__ import annotations

import heapq
import math
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
    sync_rows: np.ndarray  # rows of COLL / SEND / RECV nodes


def _plan_table(t: NodeTable, device: Device | None, dtype: str) -> _TablePlan:
    n = len(t)
    kind = t.kind.astype(np.int64)
    stream_arr = np.full(n, COMPUTE, dtype=np.int64)
    stream_arr[kind == NodeKind.COLL] = COLL
    stream_arr[kind == NodeKind.SEND] = SEND
    stream_arr[kind == NodeKind.RECV] = RECV
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
    rows = [np.nonzero(stream_arr == k)[0].tolist() for k in range(4)]
    return _TablePlan(t, stream, rows, succ, npred, dur, np.nonzero(~is_comp)[0])


@dataclass
class _Instance:
    """One collective call or one send/recv pair, across its participants."""

    expected: int
    duration_us: float
    label: str
    members: tuple[int, ...]  # ranks expected (for deadlock messages)
    arrived: list


class _Groups:
    """Members and network levels of communicator groups (0 / -1: all ranks)."""

    def __init__(self, trace: Trace, network: Network) -> None:
        self.world = trace.world_size
        self.groups = trace.comm_groups
        self.network = network
        self._levels: dict[int, tuple] = {}

    def members(self, gid: int) -> tuple[int, ...]:
        if gid <= 0:
            return tuple(range(self.world))
        try:
            return self.groups[gid]
        except KeyError:
            raise FlintError(f"collective names communicator group {gid}, which the trace does not define "
                             f"(defined: {sorted(self.groups)[:10]}...)") from None

    def levels(self, gid: int) -> tuple:
        lv = self._levels.get(gid)
        if lv is None:
            m = self.members(gid)
            lv = tuple(self.network.group_levels(m)) if len(m) > 1 else ()
            self._levels[gid] = lv
        return lv


def _coll_duration(groups: _Groups, gid: int, comm_type: int, nbytes: int, algorithm: Mapping[CollKind, str]) -> float:
    m = groups.members(gid)
    if len(m) <= 1:
        return 0.0
    kind = CollKind(int(comm_type))
    return collective_time_us(kind, nbytes, len(m), list(groups.levels(gid)), algorithm.get(kind, "ring"))


def _symmetric_classes(trace: Trace, groups: _Groups) -> list[list[int]] | None:
    """Classes of ranks that follow identical timelines, or None (module docstring)."""
    by_table: dict[int, list[int]] = {}
    for r, p in enumerate(trace.ranks):
        by_table.setdefault(id(p.table), []).append(r)
    classes = list(by_table.values())
    world = trace.world_size
    for cls in classes:
        t = trace.ranks[cls[0]].table
        kind = t.kind
        if len(cls) > 1 and np.any((kind == NodeKind.SEND) | (kind == NodeKind.RECV)):
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

    # resolve synchronizing nodes into instances
    instances: list[_Instance] = []
    sync: list[list[int]] = []
    coll_cache: dict[tuple, float] = {}
    keyed: dict[tuple, int] = {}
    for s, r in enumerate(sim_ranks):
        plan = plans[s]
        t = plan.table
        prog = trace.ranks[r]
        row_sync = [-1] * len(t)
        rows = plan.sync_rows
        if rows.size:
            gids = prog.groups()[rows].tolist()
            peers = prog.peers()[rows].tolist()
            kinds = t.kind[rows].tolist()
            ctypes = t.comm_type[rows].tolist()
            nbytes = t.comm_bytes[rows].tolist()
            tags = t.comm_tag[rows].tolist()
            count: dict[tuple, int] = {}
            for row, k, gid, peer, ct, nb, tag in zip(rows.tolist(), kinds, gids, peers, ctypes, nbytes, tags):
                if k == NodeKind.COLL:
                    mem = groups.members(gid)
                    if r not in mem:
                        raise FlintError(f"rank {r} node {int(t.node_ids[row])} '{t.names[row]}' issues a collective on "
                                         f"group {gid}, which does not contain it (members {list(mem)[:16]})")
                    ck = ("c", gid)
                    kth = count.get(ck, 0)
                    count[ck] = kth + 1
                    label = f"{CollKind(ct).name.lower()} of {nb} bytes on group {gid} (call #{kth})"
                    if is_sym:
                        key = ("c", s, row)
                        expected, who = 1, (r,)
                    else:
                        key = ("c", gid, kth)
                        expected, who = len(mem), mem
                    ckey = (gid, ct, nb)
                    dur = coll_cache.get(ckey)
                    if dur is None:
                        dur = coll_cache[ckey] = _coll_duration(groups, gid, ct, nb, alg)
                else:
                    if not 0 <= peer < world:
                        raise FlintError(f"rank {r} node {int(t.node_ids[row])} '{t.names[row]}' names peer rank "
                                         f"{peer}, outside world size {world}")
                    src, dst = (r, peer) if k == NodeKind.SEND else (peer, r)
                    ck = ("p", src, dst, tag, k)
                    kth = count.get(ck, 0)
                    count[ck] = kth + 1
                    key = ("p", src, dst, tag, kth)
                    expected, who = 2, (src, dst)
                    label = f"send/recv of {nb} bytes from rank {src} to rank {dst}, tag {tag} (#{kth})"
                    dur = net.p2p_time_us(src, dst, nb)
                idx = keyed.get(key)
                if idx is None:
                    idx = keyed[key] = len(instances)
                    instances.append(_Instance(expected, dur, label, tuple(who), []))
                elif k == NodeKind.COLL:
                    other = instances[idx]
                    if other.label != label:
                        raise FlintError(f"rank {r} node {int(t.node_ids[row])} '{t.names[row]}': {label}, but another "
                                         f"member issued {other.label} as the same call; members must issue a group's "
                                         "collectives in the same order with the same kind and size")
                row_sync[row] = idx
        sync.append(row_sync)

    # state
    pending = [list(p.npred) for p in plans]
    issue = [[math.nan] * len(p.table) for p in plans]
    start = [[math.nan] * len(p.table) for p in plans]
    finish = [[math.nan] * len(p.table) for p in plans]
    durs = [p.comp_dur.tolist() for p in plans]
    ptr = [[0, 0, 0, 0] for _ in range(S)]
    busy = [[False, False, False, False] for _ in range(S)]
    heap: list[tuple[float, int, int, int]] = []
    seq = 0
    push = heapq.heappush
    pop = heapq.heappop

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
        ins = instances[inst]
        ins.arrived.append((s, row))
        if len(ins.arrived) == ins.expected:
            end = now + ins.duration_us
            for s2, r2 in ins.arrived:
                start[s2][r2] = now
                durs[s2][r2] = ins.duration_us
                push(heap, (end, seq, s2, r2))
                seq += 1

    for s in range(S):
        for k in range(4):
            try_issue(s, k, 0.0)
    events = 0
    while heap:
        now, _, s, row = pop(heap)
        events += 1
        finish[s][row] = now
        plan = plans[s]
        k = plan.stream[row]
        ptr[s][k] += 1
        busy[s][k] = False
        pend = pending[s]
        stream = plan.stream
        for nxt in plan.succ[row]:
            pend[nxt] -= 1
            if not pend[nxt]:
                k2 = stream[nxt]
                if k2 != k:
                    try_issue(s, k2, now)
        try_issue(s, k, now)

    for s in range(S):
        if ptr[s] != [len(x) for x in plans[s].stream_rows]:
            _raise_deadlock(trace, sim_ranks, classes, plans, ptr, sync, instances, issue, is_sym)

    return RawSim(trace, sim_ranks, classes, plans,
                  [np.asarray(x) for x in issue], [np.asarray(x) for x in start],
                  [np.asarray(x) for x in finish], [np.asarray(x) for x in durs],
                  events, time.perf_counter() - t0, is_sym)


def _raise_deadlock(trace, sim_ranks, classes, plans, ptr, sync, instances, issue, is_sym) -> None:
    msgs = []
    for s, r in enumerate(sim_ranks):
        plan = plans[s]
        t = plan.table
        for k in range(4):
            rows = plan.stream_rows[k]
            if ptr[s][k] >= len(rows):
                continue
            row = rows[ptr[s][k]]
            inst = sync[s][row]
            if inst >= 0 and not math.isnan(issue[s][row]):
                ins = instances[inst]
                got = {sim_ranks[s2] for s2, _ in ins.arrived}
                missing = [m for m in ins.members if m not in got]
                msgs.append(f"rank {r} waits forever at node {int(t.node_ids[row])} '{t.names[row]}' ({ins.label}): "
                            f"{len(ins.arrived)} of {ins.expected} arrived; never arrived: ranks {missing[:16]}")
    if not msgs:  # nothing issued-and-waiting: report the first stuck node of each rank
        for s, r in enumerate(sim_ranks):
            plan = plans[s]
            for k in range(4):
                rows = plan.stream_rows[k]
                if ptr[s][k] < len(rows):
                    row = rows[ptr[s][k]]
                    msgs.append(f"rank {r} never starts node {int(plan.table.node_ids[row])} '{plan.table.names[row]}'")
                    break
    raise SimDeadlock("deadlock: " + "; ".join(msgs[:8]) + (f"; ... ({len(msgs)} waiting nodes)" if len(msgs) > 8 else ""))
