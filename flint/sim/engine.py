"""The event-driven simulator over per-rank node graphs.

Model
-----
Every simulated rank has in-order streams: ``compute`` (COMP and MEM
nodes), ``coll`` (collectives), one ``send`` and one ``recv`` stream per
peer (``comm_peer``: NCCL runs point-to-point operations on one communicator
and stream per pair of ranks), plus one more
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
  together for latency + bytes / bandwidth (:meth:`Network.p2p_time_us`):
  the transfer starts when both are issued, as an NCCL send larger than its
  buffers waits for the receiver to drain them.

Sends and recvs on a named stream (a *channel*, ``stream = "ch<k>"`` from
``decompose-collectives``) get one in-order send and one recv queue per
channel, and are eager: a send goes out when issued (the receiver's
buffers are pre-posted, as NCCL's channel slots are) and finishes when its
last byte left; its recv finishes when the data arrived (latency later).
Only channel sends are eager (the per-peer queues of other sends once were
too, by mistake: a send issued long before its recv finished early).
A compute node on a named stream (a decomposed collective's reduction) runs
in that stream's own queue, not the compute stream's.

Every transfer occupies its sender's egress and its receiver's ingress
port on the outermost network dimension it crosses, and every collective
each member's egress and ingress port on the outermost dimension its group
spans (for the part of its time that moves bytes on that level,
:func:`~flint.cost.collective.outer_bandwidth_us`; its latencies and inner
levels are not shared); transfers and collectives sharing a port share its
bandwidth max-min fairly (:class:`_Ports`): the NIC sharing of collectives
of different communicators that overlap (a pipeline's sends beside the
data-parallel reduce-scatters, HSDP's two groups, two named streams), and of
a channel's sends. Collectives of one communicator do not overlap when the
trace orders them (``lower-to-chakra`` chains each communicator's
collectives, as NCCL runs a communicator's calls in issue order), so they
never share. There is no contention
inside the network (uncongested fabric) and none between compute streams.

SM sharing: on a device whose calibration gives ``comm_sms``, every
collective holds that many SMs from its issue (NCCL's kernel is launched and
spins while its peers arrive) to its finish, and a compute-stream node runs
meanwhile at :meth:`Device.compute_rate` of its speed: its remaining work is
re-timed whenever a collective of its rank is issued or finishes, and its
duration is the slowed one. A send holds SMs only when its node says so
(``NodeTable.comm_sms``: Transformer Engine's userbuffers reduce-scatter
kernels, ``micro-pipeline-tp{sms=N}``), from issue to finish, adding to the
collectives'; other sends and recvs hold none (torch's async TP copies with
the copy engines; NCCL's point-to-point CTA count has no sourced figure).
Compute durations are the node's
``duration_us`` when present, else the device roofline from ``flops`` and
``tensor_bytes`` (class ``gemm`` when the node has FLOPs, else
``elementwise``), else 0. Collective and send/recv durations always come
from the network model (a trace's own ``duration_us`` on them is ignored).

Symmetric ranks
---------------
Ranks sharing one table object start as one *class*; a class is split
(:func:`_refine`, to a fixed point) until, for each peer slot of its
send/recv, all its members' transfers go to ranks of one class at the same
latency and bandwidth on the same network dimension (a ring whose hops leave
a node at some positions only becomes one class per position). Then, when
every rank of the class's table that a group of the class's collectives (per
symbolic slot) holds resolves the slot to that group (a group may also hold
ranks of other tables, as many of each class it spans, each calling it:
gradient clipping's all-reduce over the pipeline stages), all those groups
cost the same and span the same classes, the representative's group holds the
representative of each class it spans, and the send/recv of every class pair
uniformly (for each send/recv row of the class's table there is one row of
one class such that EVERY member's node pairs, by (src, dst, tag,
occurrence), with that row of its peer, and both ends move the same bytes:
:func:`_p2p_pairing`), all ranks of a class follow identical timelines, by
induction over time: every collective and every transfer meets only ranks
whose classes are in the same state at the same time. Uniform shifts are such
pairings: a context-parallel ring inside a class (every rank sends to its +k
neighbour on an axis and receives from its -k neighbour), a decomposed ring
collective's steps, and pipeline stages (one class per stage, each member
paired with a member of the next). The simulator then runs one
representative per class (the smallest rank): a collective instance waits
for the representatives in its group, each send/recv pairs with its partner
row of the partner class's representative (of its own class for a ring), and
the results are copied to the class. Port sharing is simulated on the
representatives' ports: the full simulation's ports cover them one to one
(each port carries the same rows at the same times), so the max-min fair
rates are the same. Otherwise (e.g. a straggler rank with its own table
inside a group, groups of different sizes, or members pairing with different
rows of their peers) every rank is simulated. Pass ``symmetric=False`` to
force the full simulation.

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

from flint.cost.collective import CollKind, collective_time_us, outer_bandwidth_us
from flint.cost.device import Device
from flint.cost.network import Network
from flint.errors import FlintError
from flint.mesh import Mesh
from flint.trace import NodeKind, NodeTable, Trace

COMPUTE, COLL, SEND, RECV = 0, 1, 2, 3
STREAM_NAMES = ("compute", "coll", "send", "recv")
_NAMED = ((NodeKind.COLL, ""), (NodeKind.SEND, "send:"), (NodeKind.RECV, "recv:"), (NodeKind.COMP, "comp:"))


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
    shares_sms: list[bool] | None = None  # compute-stream rows that run on the SMs communication leaves
    holds: list[int] | None = None  # SMs each row's communication kernel holds while in flight


def _plan_table(t: NodeTable, device: Device | None, dtype: str) -> _TablePlan:
    n = len(t)
    kind = t.kind.astype(np.int64)
    stream_arr = np.full(n, COMPUTE, dtype=np.int64)
    stream_arr[kind == NodeKind.COLL] = COLL
    names = STREAM_NAMES
    if t.comm_stream is not None and t.stream_names:
        # a named stream is one in-order queue per node kind: collectives, sends and recvs on stream
        # "x" are three queues (a send must never wait behind a recv of its own rank)
        # (compute nodes on a named stream: the reduction kernels of a decomposed collective, which run in
        # the communication kernel, not in the compute stream's order)
        for k, prefix in _NAMED:  # a block of queues per node kind that uses named streams
            named = (kind == k) & (t.comm_stream >= 0)
            if k == NodeKind.COLL or named.any():
                stream_arr[named] = len(names) + t.comm_stream[named].astype(np.int64)
                names = names + tuple(f"{prefix}{n}" for n in t.stream_names)
    # Point-to-point without a named stream: one in-order queue per direction and peer (slot), as
    # NCCL runs send/recv on one communicator and stream per pair of ranks: a send to one peer never
    # waits behind a send to another (pipeline schedules rely on that, e.g. torch's zero-bubble orders).
    p2p = (kind == NodeKind.SEND) | (kind == NodeKind.RECV)
    free = p2p if t.comm_stream is None or not t.stream_names else p2p & (t.comm_stream < 0)
    if free.any():
        keys = sorted({(int(k), int(q)) for k, q in zip(kind[free].tolist(), t.comm_peer[free].tolist())})
        index = {key: len(names) + i for i, key in enumerate(keys)}
        stream_arr[free] = [index[(int(k), int(q))] for k, q in zip(kind[free].tolist(), t.comm_peer[free].tolist())]
        names = names + tuple(f"{'send' if k == NodeKind.SEND else 'recv'} {q}" for k, q in keys)
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
    is_comp = (kind != NodeKind.COLL) & (kind != NodeKind.SEND) & (kind != NodeKind.RECV)
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
    # SMs held in flight: every collective the calibration's comm_sms, a send its own sms (none: 0)
    holds = np.where(kind == NodeKind.COLL, device.calibration.comm_sms if device is not None else 0, 0)
    if t.comm_sms is not None:
        holds = np.where(kind == NodeKind.SEND, t.comm_sms.astype(np.int64), holds)
    return _TablePlan(t, stream, rows, succ, npred, dur, np.nonzero(kind == NodeKind.COLL)[0],
                      np.nonzero(p2p)[0], names, ((stream_arr == COMPUTE) & is_comp & (dur > 0)).tolist(),
                      holds.tolist())


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
                         inst_desc, inst_port) -> None:
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
    # the k-th call of every simulated member of group g is one instance (in a reduced simulation the
    # simulated members of g are the representatives of the classes with members in g)
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
    simulated = set(sim_ranks)
    count: dict[int, int] = {}  # group -> simulated members
    gid_f, ct_f, nb_f, kth_f = (e[k][first].tolist() for k in ("gid", "ct", "nb", "kth"))
    cache: dict[tuple, tuple[float, float]] = {}
    group_ports: dict[int, tuple] = {}  # group -> its simulated members' ports on its outermost dimension
    for gid, ct, nb, kth in zip(gid_f, ct_f, nb_f, kth_f):
        ck = (gid, ct, nb)
        d = cache.get(ck)
        if d is None:
            d = cache[ck] = _coll_duration(groups, gid, ct, nb, alg)
        n = count.get(gid)
        if n is None:
            n = count[gid] = (len(simulated & groups.member_set(gid)) if is_sym else len(groups.members(gid)))
        if d[1] > 0:  # its bytes cross the members' ports on the group's outermost network dimension
            ports = group_ports.get(gid)
            if ports is None:
                ports = group_ports[gid] = _group_ports(groups, gid, simulated if is_sym else None)
            inst_port[len(inst_expected)] = (ports, d[1])
        inst_expected.append(n)
        inst_dur.append(d[0])
        inst_desc.append(("c", ct, nb, gid, kth))
    ids = inv + base
    for s in np.unique(e["s"]).tolist():
        m = e["s"] == s
        sync_arr[s][e["row"][m]] = ids[m]


def _coll_duration(groups: _Groups, gid: int, comm_type: int, nbytes: int, algorithm: Mapping[CollKind, str]
                   ) -> tuple[float, float]:
    """A collective's time and the part of it that moves bytes over its outermost network level."""
    m = groups.members(gid)
    if len(m) <= 1:
        return 0.0, 0.0
    kind = CollKind(int(comm_type))
    levels, a = list(groups.levels(gid)), algorithm.get(kind, "ring")
    return collective_time_us(kind, nbytes, len(m), levels, a), outer_bandwidth_us(kind, nbytes, len(m), levels, a)


def _group_ports(groups: _Groups, gid: int, simulated: set | None) -> tuple:
    """The egress and ingress ports of a group's (simulated) members on the outermost network dimension the
    group spans: a collective's bytes on that level leave and enter every member there."""
    members = groups.members(gid)
    dim = groups.network.spans(members)[-1][0]
    ranks = sorted(simulated & groups.member_set(gid)) if simulated is not None else sorted(members)
    return tuple(p for r in ranks for p in (("out", r, dim), ("in", r, dim)))


def _p2p_pairing(trace: Trace, classes: list[list[int]], network: Network) -> dict | None:
    """Pair every representative's send/recv with its partner's, or None when a class's members do not
    pair uniformly (module docstring, "Symmetric ranks").

    Returns ``{(class, row): (partner class, partner row)}`` over the send/recv rows of every class's
    table. It holds when, for every class ``C`` and send/recv row ``a`` of its table, there is one
    row ``b`` of one class ``C'`` such that for EVERY member ``x`` of ``C`` the node that pairs with
    ``x``'s row ``a`` in the full simulation (same (src, dst, tag) and the same occurrence count) is
    row ``b`` of ``x``'s peer, that peer lies in ``C'``, both ends move the same bytes, and every
    member's transfer has the same latency and bandwidth on the same network dimension. A uniform
    shift inside a class (a context-parallel ring: every rank sends to its +k neighbour on an axis and
    receives from its -k neighbour) and pipeline stages (each stage a class) are such pairings.
    Peers are checked per symbolic peer slot (a table names few), occurrence counts per row only when
    some member sends two slots to one rank.
    """
    world = trace.world_size
    cls_of = np.empty(world, dtype=np.int64)
    pos_of = np.empty(world, dtype=np.int64)
    for c, cls in enumerate(classes):
        cls_of[cls] = c
        pos_of[cls] = np.arange(len(cls))
    info = []  # per class: rows, slot index per row, peer per (member, slot), occurrence counts
    for c, cls in enumerate(classes):
        t = trace.ranks[cls[0]].table
        rows = np.nonzero((t.kind == NodeKind.SEND) | (t.kind == NodeKind.RECV))[0]
        if not rows.size:
            info.append(None)
            continue
        used, ui = np.unique(t.comm_peer[rows].astype(np.int64), return_inverse=True)
        ui = ui.reshape(-1)
        S = _slot_peers(trace, cls, used, world)
        if S is None:
            return None  # the full simulation names the bad peer
        # occurrence count of (peer, tag, kind), as the full simulation pairs them: the same for every
        # member when each member's slots name distinct ranks (then equal peers <=> equal slots)
        _, code = np.unique(t.comm_tag[rows].astype(np.int64) * 2 + (t.kind[rows] == NodeKind.SEND),
                            return_inverse=True)
        code = code.reshape(-1)
        ncode = int(code.max()) + 1
        srt = np.sort(S, axis=1)
        if not np.any(srt[:, 1:] == srt[:, :-1]):
            kth = _cumcount(ui * ncode + code)[None, :]  # broadcast over members
        else:
            key = (np.arange(len(cls), dtype=np.int64)[:, None] * world + S[:, ui]) * ncode + code[None, :]
            kth = _cumcount(key.reshape(-1)).reshape(len(cls), rows.size)
        info.append((rows, ui, S, kth, t))
    # the representative's partner rows
    index: dict[tuple[int, int], dict] = {}
    pairing: dict[tuple[int, int], tuple[int, int]] = {}
    partner = []
    for c, cls in enumerate(classes):
        if info[c] is None:
            partner.append(None)
            continue
        rows, ui, S, kth, t = info[c]
        pc = np.empty(rows.size, dtype=np.int64)
        pb = np.empty(rows.size, dtype=np.int64)
        peers0 = S[0, ui].tolist()
        k0 = kth[0].tolist()
        for a, row in enumerate(rows.tolist()):
            y = peers0[a]
            c2, p2 = int(cls_of[y]), int(pos_of[y])
            if info[c2] is None:
                return None
            rows2, ui2, S2, kth2, t2 = info[c2]
            look = index.get((c2, p2))
            if look is None:
                look = index[(c2, p2)] = {
                    key: b for b, key in enumerate(zip(S2[p2, ui2].tolist(), t2.comm_tag[rows2].tolist(),
                                                       t2.kind[rows2].tolist(), kth2[min(p2, len(kth2) - 1)].tolist()))}
            want = NodeKind.RECV if t.kind[row] == NodeKind.SEND else NodeKind.SEND
            b = look.get((cls[0], int(t.comm_tag[row]), int(want), k0[a]))
            if b is None or int(t2.comm_bytes[rows2[b]]) != int(t.comm_bytes[row]):
                return None  # unmatched (the full simulation reports the deadlock) or different sizes
            pc[a], pb[a] = c2, b
            pairing[(c, row)] = (c2, int(rows2[b]))
        partner.append((pc, pb))
    # every member's node pairs with the same partner row, in the partner class
    for c, cls in enumerate(classes):
        if info[c] is None:
            continue
        rows, ui, S, kth, t = info[c]
        pc, pb = partner[c]
        members = np.asarray(cls, dtype=np.int64)
        per_row = kth.shape[0] > 1
        for c2 in np.unique(pc).tolist():
            rows2, ui2, S2, kth2, _ = info[c2]
            cols = np.nonzero(pc == c2)[0]
            if not per_row and kth2.shape[0] == 1:  # peers per (slot, partner slot): a few columns
                _, first = np.unique(ui[cols] * S2.shape[1] + ui2[pb[cols]], return_index=True)
                cols = cols[first]
            Y = S[:, ui[cols]]
            if np.any(cls_of[Y] != c2):
                return None
            Y = pos_of[Y]
            B = np.broadcast_to(pb[cols][None, :], Y.shape)
            if np.any(S2[Y, ui2[B]] != members[:, None]):
                return None
            if (per_row or kth2.shape[0] > 1) and np.any(
                    np.broadcast_to(kth2, (S2.shape[0], kth2.shape[1]))[Y, B]
                    != np.broadcast_to(kth, (len(cls), kth.shape[1]))[:, cols]):
                return None
    # every member's transfer on a slot costs what the representative's does, on the same dimension
    # (a transfer's time is latency + bytes / bandwidth: equal at 0 and at 1 MiB means equal at any size)
    ids: dict = {}
    for c, cls in enumerate(classes):
        if info[c] is None:
            continue
        rows, ui, S, kth, t = info[c]
        send = t.kind[rows] == NodeKind.SEND
        members = np.asarray(cls, dtype=np.int64)
        for u, d in {(int(u), bool(d)) for u, d in zip(ui.tolist(), send.tolist())}:
            src, dst = (members, S[:, u]) if d else (S[:, u], members)
            cost = _cost_ids(network, src, dst, ids)
            if np.any(cost != cost[0]):
                return None
    return pairing


def _cost_ids(network: Network, src: np.ndarray, dst: np.ndarray, ids: dict) -> np.ndarray:
    """An id per ``src[i] -> dst[i]`` transfer: equal ids, equal (port dimension, latency, bandwidth).

    Without per-NIC bandwidths a transfer's cost and port depend only on how far apart the two ranks are
    along each network dimension, so one transfer per distinct distance vector is priced."""
    cs, cd = network.coords(src), network.coords(dst)
    dim = _port_dims(cs, cd)
    if network.nics:
        first, inv = np.arange(src.size), np.arange(src.size)
    else:
        _, first, inv = np.unique(np.abs(cs - cd), axis=0, return_index=True, return_inverse=True)
        inv = inv.reshape(-1)
    out = np.empty(first.size, dtype=np.int64)
    for k, i in enumerate(first.tolist()):
        a, b = int(src[i]), int(dst[i])
        key = (int(dim[i]), network.p2p_time_us(a, b, 0), network.p2p_time_us(a, b, 1 << 20))
        out[k] = ids.setdefault(key, len(ids))
    return out[inv]


def _slot_peers(trace: Trace, cls: list[int], slots: np.ndarray, world: int) -> np.ndarray | None:
    """The peer rank of each member (rows) for each peer slot (columns), or None if one is out of range."""
    S = np.empty((len(cls), slots.size), dtype=np.int64)
    for i, x in enumerate(cls):
        pr = trace.ranks[x].peer_ranks
        if pr is None:
            S[i] = slots
        elif slots[0] < 0 or slots[-1] >= len(pr):
            return None
        else:
            S[i] = pr[slots]
    return None if np.any(S < 0) or np.any(S >= world) else S


def _refine(trace: Trace, classes: list[list[int]], network: Network) -> list[list[int]]:
    """Split classes until the members of each send to and receive from ranks of the same classes at the same
    cost per peer slot (e.g. a ring whose hops leave a node at some positions only: one class per position)."""
    world = trace.world_size
    ids: dict = {}
    while True:
        label = np.empty(world, dtype=np.int64)
        for c, cls in enumerate(classes):
            label[cls] = c
        out = []
        for cls in classes:
            t = trace.ranks[cls[0]].table
            rows = np.nonzero((t.kind == NodeKind.SEND) | (t.kind == NodeKind.RECV))[0]
            if len(cls) == 1 or not rows.size:
                out.append(cls)
                continue
            used, ui = np.unique(t.comm_peer[rows].astype(np.int64), return_inverse=True)
            S = _slot_peers(trace, cls, used, world)
            if S is None:
                return classes  # the pairing check refuses it
            members = np.asarray(cls, dtype=np.int64)
            cols = []
            for u, d in sorted({(int(u), bool(d)) for u, d in zip(ui.reshape(-1).tolist(),
                                                                 (t.kind[rows] == NodeKind.SEND).tolist())}):
                src, dst = (members, S[:, u]) if d else (S[:, u], members)
                cols += [_cost_ids(network, src, dst, ids), label[S[:, u]]]
            _, first, inv = np.unique(np.stack(cols, axis=1), axis=0, return_index=True, return_inverse=True)
            inv = inv.reshape(-1)
            for k in np.argsort(first).tolist():
                out.append(members[inv == k].tolist())
        if len(out) == len(classes):
            return sorted(classes, key=lambda c: c[0])
        classes = out


def _symmetric_classes(trace: Trace, groups: _Groups) -> tuple[list[list[int]], dict] | None:
    """Classes of ranks that follow identical timelines and their send/recv pairing
    (:func:`_p2p_pairing`), or None (module docstring)."""
    by_table: dict[int, list[int]] = {}
    for r, p in enumerate(trace.ranks):
        by_table.setdefault(id(p.table), []).append(r)
    world = trace.world_size
    classes = _refine(trace, list(by_table.values()), groups.network)
    label = np.empty(world, dtype=np.int64)
    for c, cls in enumerate(classes):
        label[cls] = c
    is_rep = np.zeros(world, dtype=bool)
    is_rep[[cls[0] for cls in classes]] = True
    resolved: dict[tuple[int, int], np.ndarray] = {}  # (table, slot) -> group of every rank of the table

    def resolve(t_id: int, slot: int) -> np.ndarray | None:
        g = resolved.get((t_id, slot))
        if g is None:
            members = by_table[t_id]
            g = np.full(world, -2, dtype=np.int64)
            ids = [trace.ranks[r].group_ids for r in members]
            if slot < 0:
                g[members] = 0
            elif all(x is not None for x in ids) and len({len(x) for x in ids}) == 1:
                if slot >= len(ids[0]):
                    return None
                g[members] = np.stack(ids)[:, slot]
            else:
                for r, x in zip(members, ids):
                    if x is not None and slot >= len(x):
                        return None
                    g[r] = slot if x is None else int(x[slot])
            resolved[(t_id, slot)] = g
        return g

    coll_slots: dict[int, list[int]] = {}  # table -> its collectives' symbolic slots

    def slots_of(t) -> list[int]:
        if id(t) not in coll_slots:
            coll_slots[id(t)] = np.unique(t.comm_group[t.kind == NodeKind.COLL]).tolist()
        return coll_slots[id(t)]

    def calls(r: int, gid: int) -> bool:
        """Whether rank ``r``'s table has a collective slot that ``r`` resolves to group ``gid``."""
        t = trace.ranks[r].table
        for slot in slots_of(t):
            g = resolve(id(t), slot)
            if g is not None and int(g[r]) == gid:
                return True
        return False

    for c, cls in enumerate(classes):
        t = trace.ranks[cls[0]].table
        if not slots_of(t):
            continue
        cls_arr = np.asarray(cls, dtype=np.int64)
        cols = []
        for slot in slots_of(t):
            g = resolve(id(t), slot)
            if g is None:
                return None
            gs = g[cls_arr]
            cols.append(gs)
            sig = None
            for gid in np.unique(gs).tolist():
                mem = np.asarray(groups.members(gid), dtype=np.int64)
                # every member of this table resolves the slot to this group (members of other tables, e.g. the
                # other pipeline stages in gradient clipping's all-reduce over pp, are checked with their own
                # table); the group spans the same classes and costs the same as every other group of the slot
                own = g[mem] != -2
                if not np.all(g[mem[own]] == gid):
                    return None
                if not own.all():  # a group over several tables: as many members of each class it spans, and
                    # each member of another table calls it too (else: a straggler's table, a missing call)
                    _, counts = np.unique(label[mem], return_counts=True)
                    if len(set(counts.tolist())) != 1 or not all(calls(int(r), gid) for r in mem[~own]):
                        return None
                comp = np.unique(label[mem])
                s = (len(mem), tuple((id(lk), n) for lk, n in groups.levels(gid)), tuple(comp.tolist()))
                if sig is None:
                    sig = s
                elif s != sig:
                    return None
                # the representative's group holds the representative of every class in it: in the reduced
                # simulation they meet there
                if gid == int(g[cls[0]]) and int(is_rep[mem].sum()) != comp.size:
                    return None
        # two slots naming one group for one member name one group for all (the k-th call on a group is
        # the same row for every member)
        for i in range(len(cols)):
            for j in range(i + 1, len(cols)):
                eq = cols[i] == cols[j]
                if eq.any() and not eq.all():
                    return None
    pairing = _p2p_pairing(trace, classes, groups.network)
    return None if pairing is None else (classes, pairing)


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
    port_slowed_us: list[float] | None = None  # per simulated program: transfers' delay from sharing ports


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

    found = _symmetric_classes(trace, groups) if symmetric else None
    is_sym = found is not None
    classes, pairing = found if found is not None else ([[r] for r in range(world)], None)
    rep_of = np.empty(world, dtype=np.int64)  # the simulated rank standing for each rank
    for cls in classes:
        rep_of[cls] = cls[0]
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
    # instance -> (the ports its bytes cross, their serialization us): a send/recv's sender egress and
    # receiver ingress, a collective's members' egress and ingress on its outermost level
    inst_port: dict[int, tuple] = {}
    _resolve_collectives(trace, sim_ranks, plans, groups, alg, is_sym, sync_arr, inst_expected, inst_dur, inst_desc,
                         inst_port)
    keyed: dict[tuple, int] = {}
    port_dims: dict[tuple, int] = {}
    eager: set[int] = set()  # p2p instances on channels (decomposed collectives): eager sends
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
            if pairing is None:
                key = (src, dst, tag, kth)
            else:  # one instance per pair of representative rows: the send's (program, row)
                key = (s, row) if k == NodeKind.SEND else pairing[(s, row)]
            idx = keyed.get(key)
            if idx is None:
                idx = keyed[key] = len(inst_expected)
                if plan.stream_names[plan.stream[row]].startswith(("send:", "recv:")):  # on a channel
                    eager.add(idx)
                inst_expected.append(2)
                d = net.p2p_time_us(src, dst, nb)
                inst_dur.append(d)
                inst_desc.append(("p", nb, src, dst, tag, kth))
                port = _port(net, src, dst, port_dims)
                # ports of the representatives: in a reduced simulation the representative's egress
                # carries its class's sends and its ingress the recvs (module docstring)
                inst_port[idx] = ((("out", int(rep_of[src]), port), ("in", int(rep_of[dst]), port)),
                                  d - net.p2p_time_us(src, dst, 0))
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
    ports = _Ports()
    port_slowed = [0.0] * S  # per simulated program: how much longer its transfers took sharing ports
    seq = 0
    push = heapq.heappush
    # SM sharing (Device.compute_rate): SMs communication kernels hold per simulated rank, from issue to
    # finish; each running compute node's [work left at full speed, since, speed, seq of its event]
    rate_of = device.compute_rate if device is not None and any(any(p.holds) for p in plans) else None
    held = [0] * S
    running: list[dict[int, list]] = [{} for _ in range(S)]
    live: list[dict[int, int]] = [{} for _ in range(S)]  # compute row -> seq of its current finish event

    def rerate(s: int, now: float) -> None:
        """The SMs communication holds on ``s`` changed: its running compute nodes change speed."""
        nonlocal seq
        r = rate_of(held[s])
        for row, st in running[s].items():
            if st[2] != r:
                st[0] = max(0.0, st[0] - (now - st[1]) * st[2])
                st[1], st[2] = now, r
                live[s][row] = seq
                push(heap, (now + st[0] / r, seq, s, row))
                seq += 1

    def on_finish(now: float, ev: int, s: int, row: int) -> bool:
        """False for a finish event a speed change made stale."""
        st = running[s].get(row)
        if st is not None:
            if live[s][row] != ev:
                return False
            del running[s][row]
            durs[s][row] = now - start[s][row]
        elif row in live[s]:
            return False  # the node finished at a later estimate already
        elif plans[s].holds[row]:
            held[s] -= plans[s].holds[row]
            rerate(s, now)
        return True

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
            d = durs[s][row]
            if rate_of is not None and plans[s].shares_sms[row]:
                r = rate_of(held[s])
                running[s][row] = [d, now, r, seq]
                live[s][row] = seq
                d /= r
            push(heap, (now + d, seq, s, row))
            seq += 1
            return
        if rate_of is not None and plans[s].holds[row]:  # its kernel holds SMs from launch, waiting included
            held[s] += plans[s].holds[row]
            rerate(s, now)
        arrived = inst_arrived[inst]
        arrived.append((s, row))
        if inst in eager:
            issue_eager(s, row, inst, now)
            return
        if len(arrived) == inst_expected[inst]:
            d = inst_dur[inst]
            port = inst_port.get(inst)
            if port is not None and port[1] > 0:  # the bytes share the ports they cross with other transfers
                for s2, r2 in arrived:
                    start[s2][r2] = now
                for t_end, fid in ports.start(now, port[0], port[1], d - port[1], arrived):
                    push(heap, (t_end, seq, -1, fid))
                    ports.event[fid] = seq
                    seq += 1
                return
            end = now + d
            for s2, r2 in arrived:
                start[s2][r2] = now
                durs[s2][r2] = d
                push(heap, (end, seq, s2, r2))
                seq += 1

    delivered: dict[int, float] = {}  # eager instance -> when its data reaches the receiver
    flow_inst: dict[int, int] = {}    # eager flow -> its instance

    def issue_eager(s: int, row: int, inst: int, now: float) -> None:
        """A send on a channel goes out when issued (the receiver's slots are pre-posted); its recv
        completes when the data is there."""
        nonlocal seq
        start[s][row] = now
        if plans[s].table.kind[row] == NodeKind.SEND:
            crossed, ser = inst_port[inst]
            lat = inst_dur[inst] - ser
            if ser <= 0:
                delivered[inst] = now + lat
                done_eager(inst, now, now + lat)
                return
            flow_inst[ports.next] = inst  # the new flow; the others returned are re-timed flows sharing its ports
            for t_end, fid in ports.start(now, crossed, ser, lat, [(s, row)]):
                push(heap, (t_end, seq, -1, fid))
                ports.event[fid] = seq
                seq += 1
            return
        t = delivered.get(inst)
        if t is not None:
            t = max(t, now)
            durs[s][row] = t - now
            push(heap, (t, seq, s, row))
            seq += 1

    def done_eager(inst: int, sent: float, t: float) -> None:
        """The send finishes when its last byte left (``sent``), the recv when the data is there (``t``)."""
        nonlocal seq
        began = min(start[s2][r2] for s2, r2 in inst_arrived[inst]
                    if plans[s2].table.kind[r2] == NodeKind.SEND)  # when the bytes started to move
        for s2, r2 in inst_arrived[inst]:  # the send, and the recv if it is waiting already
            end = sent
            if plans[s2].table.kind[r2] != NodeKind.SEND:  # a posted recv is in flight once the bytes move
                end = t
                start[s2][r2] = max(start[s2][r2], began)
            durs[s2][r2] = end - start[s2][r2]
            push(heap, (end, seq, s2, r2))
            seq += 1

    for s in range(S):
        for k in range(len(plans[s].stream_rows)):
            try_issue(s, k, 0.0)

    def flow_done(now: float, fid: int, ev: int) -> None:
        """A transfer's last byte left: both nodes finish after the latency; the ports' other flows speed up."""
        nonlocal seq
        if ports.event.get(fid) != ev:
            return  # a stale estimate: the flow's rate changed since
        lat, members, resched, slowed = ports.finish(now, fid)
        if slowed > 1e-9:
            for s2 in {s2 for s2, _ in members}:
                port_slowed[s2] += slowed
        inst = flow_inst.pop(fid, None)
        if inst is not None:
            delivered[inst] = now + lat
            done_eager(inst, now, now + lat)
        else:
            for s2, r2 in members:
                durs[s2][r2] = now + lat - start[s2][r2]
                push(heap, (now + lat, seq, s2, r2))
                seq += 1
        for t_end, f2 in resched:
            push(heap, (t_end, seq, -1, f2))
            ports.event[f2] = seq
            seq += 1

    events = _loop(heap, plans, ptr, busy, pending, finish, try_issue, sum(len(p.table) for p in plans), flow_done,
                   on_finish if rate_of is not None else None)

    for s in range(S):
        if ptr[s] != [len(x) for x in plans[s].stream_rows]:
            _raise_deadlock(sim_ranks, plans, ptr, sync, inst_expected, inst_desc, inst_arrived, issue, groups, is_sym)

    return RawSim(trace, sim_ranks, classes, plans,
                  [_arr(x) for x in issue], [_arr(x) for x in start],
                  [_arr(x) for x in finish], [_arr(x) for x in durs],
                  events, time.perf_counter() - t0, is_sym, port_slowed)


class _Ports:
    """Senders' and receivers' network ports, shared max-min fairly by the transfers crossing them.

    A transfer needs its sender's egress and its receiver's ingress port on
    the network dimension it crosses; each port moves one transfer at the
    link's full bandwidth, several at shares that are max-min fair
    (progressive filling), recomputed whenever a transfer starts or ends.
    ``ser`` is the transfer's time alone on the ports; its last byte leaves
    when that much work is done, and it completes ``lat`` later. Rates only
    change within the connected set of transfers sharing ports (a ring's
    transfers share none), so each update stays local.
    """

    def __init__(self) -> None:
        self.flows: dict[int, list] = {}   # fid -> [ports, remaining work, rate, last update, lat, members]
        self.on: dict[tuple, set[int]] = {}  # port -> fids crossing it
        self.event: dict[int, int] = {}    # fid -> seq of its current finish estimate
        self.next = 0

    def start(self, now: float, crossed: tuple, ser: float, lat: float, members) -> list[tuple[float, int]]:
        fid = self.next
        self.next += 1
        self.flows[fid] = [crossed, ser, 0.0, now, lat, list(members), now + ser]
        alone = True
        for p in crossed:
            on = self.on.setdefault(p, set())
            alone = alone and not on
            on.add(fid)
        if alone:  # nothing else crosses its ports: full speed, no other flow changes
            self.flows[fid][2] = 1.0
            return [(now + ser, fid)]
        return self._rebalance(now, set(crossed))

    def finish(self, now: float, fid: int):
        f = self.flows.pop(fid)
        del self.event[fid]
        shared = False
        for p in f[0]:
            on = self.on[p]
            on.discard(fid)
            shared = shared or bool(on)
        # latency, members, re-timed flows, and how much later than alone on its ports its last byte left
        return f[4], f[5], (self._rebalance(now, set(f[0])) if shared else []), now - f[6]

    def _rebalance(self, now: float, seeds: set) -> list[tuple[float, int]]:
        # the connected set of flows reachable through shared ports
        ports, fids, todo = set(), set(), list(seeds)
        while todo:
            p = todo.pop()
            if p in ports:
                continue
            ports.add(p)
            for f in self.on.get(p, ()):
                if f not in fids:
                    fids.add(f)
                    todo.extend(self.flows[f][0])
        for f in fids:  # work done at the old rates
            fl = self.flows[f]
            fl[1] = max(0.0, fl[1] - fl[2] * (now - fl[3]))
            fl[3] = now
        # progressive filling: the port with the smallest fair share fixes its flows' rate first
        cap = {p: 1.0 for p in ports}
        left = {p: {f for f in self.on.get(p, ()) if f in fids} for p in ports}
        free = set(fids)
        while free:
            p = min((q for q in left if left[q]), key=lambda q: (cap[q] / len(left[q]), q))
            share = cap[p] / len(left[p])
            for f in sorted(left[p]):
                self.flows[f][2] = share
                free.discard(f)
                for q in self.flows[f][0]:
                    cap[q] -= share
                    left[q].discard(f)
        out = []
        for f in sorted(fids):
            fl = self.flows[f]
            out.append((now + fl[1] / fl[2], f))
        return out


def _port_dims(cs: np.ndarray, cd: np.ndarray) -> np.ndarray:
    """Per transfer (rows of source / destination coordinates, innermost first), the network dimension whose
    port it occupies: the outermost one the two ranks differ in (-1: the same rank)."""
    diff = cs != cd
    return np.where(diff.any(axis=1), diff.shape[1] - 1 - np.argmax(diff[:, ::-1], axis=1), -1)


def _port(net: Network, src: int, dst: int, cache: dict[tuple, int]) -> int:
    """The network dimension whose port a ``src`` -> ``dst`` transfer occupies (``_port_dims``), cached."""
    key = (src, dst)
    dim = cache.get(key)
    if dim is None:
        c = net.coords([src, dst])
        dim = cache[key] = int(_port_dims(c[:1], c[1:])[0])
    return dim


def _arr(x: list) -> np.ndarray:
    return np.fromiter(x, dtype=np.float64, count=len(x))


_PROGRESS_MIN_EVENTS = 500_000
_PROGRESS_EVERY = 1 << 16


def _loop(heap, plans, ptr, busy, pending, finish, try_issue, total: int = 0, flow_done=None, on_finish=None) -> int:
    """Pop completion events in time order until none is left; returns the event count.

    ``on_finish(now, event, rank, row)``, if given, sees every node's finish event first and drops it by
    returning False (a stale estimate). Simulations of at least 500,000 node events show a progress bar
    (:mod:`flint.progress`)."""
    from flint.progress import enabled

    bar = None
    if total >= _PROGRESS_MIN_EVENTS and enabled():
        from tqdm import tqdm

        bar = tqdm(total=total, desc="simulating", unit="node", file=sys.stderr, leave=False, dynamic_ncols=True)
    pop = heapq.heappop
    events = 0
    while heap:
        now, ev, s, row = pop(heap)
        if s < 0:
            flow_done(now, row, ev)
            continue
        if on_finish is not None and not on_finish(now, ev, s, row):
            continue
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
