"""Whole-trace checks: what would make a consumer abort or deadlock.

:func:`check_trace` returns a list of :class:`Problem` (rank, node id,
message), sorted by rank then node. It checks:

- empty ranks (ASTRA-sim needs a node per file);
- dangling dependencies (a dependency on a node not in the rank's file);
- dependency cycles;
- collectives ASTRA-sim aborts on (REDUCE, GATHER, SCATTER, BARRIER,
  REDUCE_SCATTER_BLOCK);
- collective groups: the id exists in ``comm_groups`` and the rank is a member;
- cross-rank collective order: every member of a group issues that group's
  collectives in the same order with the same ``comm_type`` and
  ``comm_size`` (an empty ``pg_name`` is the group of all ranks);
- send/recv matching: every send a -> b with tag t and size s has exactly one
  recv on b from a with tag t and size s (as multisets), and every send/recv
  names a peer inside the world.

It scales with the sharing in a symbolic trace: per-table facts are computed
once per table, and a rank's collective sequence for a group is computed once
per (table, set of group slots bound to that group); ranks only contribute a
few dictionary lookups. 1,024 ranks of a 5,000-node role check in well under
a second.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from flint.trace import CollKind, NodeKind, NodeTable, RankProgram, Trace

_UNSUPPORTED = [int(CollKind.REDUCE), int(CollKind.GATHER), int(CollKind.SCATTER), int(CollKind.BARRIER), int(CollKind.REDUCE_SCATTER_BLOCK)]


@dataclass(frozen=True, order=True)
class Problem:
    """One problem found in a trace; ``rank``/``node_id`` are ``None`` when not about one."""

    rank: int | None
    node_id: int | None
    message: str

    def __str__(self) -> str:
        where = []
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        if self.node_id is not None:
            where.append(f"node {self.node_id}")
        return f"{', '.join(where)}: {self.message}" if where else self.message

    def to_json(self) -> dict:
        return {"rank": self.rank, "node_id": self.node_id, "message": self.message}


def _owners(ptr: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(len(ptr) - 1, dtype=np.int64), np.diff(ptr))


def cycle_rows(table: NodeTable) -> np.ndarray:
    """Rows that can never run because they are on (or behind) a dependency cycle.

    Rows of tables in topological order (every table built with
    :class:`flint.trace.NodeTableBuilder`) are checked in one vectorized pass.
    """
    n = len(table)
    parts_src, parts_dst = [], []
    for ptr, idx in ((table.data_dep_ptr, table.data_dep_idx), (table.ctrl_dep_ptr, table.ctrl_dep_idx)):
        own = _owners(ptr)
        ok = (idx >= 0) & (idx < n)
        parts_src.append(idx[ok])
        parts_dst.append(own[ok])
    src = np.concatenate(parts_src)
    dst = np.concatenate(parts_dst)
    if not (src >= dst).any():
        return np.zeros(0, dtype=np.int64)
    # Kahn's algorithm on the edge list.
    order = np.argsort(src, kind="stable")
    src, dst = src[order], dst[order]
    start = np.searchsorted(src, np.arange(n + 1))
    indeg = np.bincount(dst, minlength=n)
    stack = list(np.flatnonzero(indeg == 0))
    indeg = indeg.tolist()
    dst_l = dst.tolist()
    start_l = start.tolist()
    done = 0
    while stack:
        i = stack.pop()
        done += 1
        for j in range(start_l[i], start_l[i + 1]):
            c = dst_l[j]
            indeg[c] -= 1
            if indeg[c] == 0:
                stack.append(c)
    if done == n:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(np.asarray(indeg) > 0)


class _TableFacts:
    """Everything about one table that does not depend on the rank's bindings."""

    def __init__(self, table: NodeTable, symbolic: bool) -> None:
        self.table = table
        self.symbolic = symbolic
        n = len(table)
        ids = table.node_ids
        self.problems: list[tuple[int | None, str]] = []  # (node id, message), reported for every rank using the table
        if n == 0:
            self.problems.append((None, "rank has no nodes (ASTRA-sim needs at least one node per rank file)"))
        for label, ptr, idx in (("data", table.data_dep_ptr, table.data_dep_idx), ("ctrl", table.ctrl_dep_ptr, table.ctrl_dep_idx)):
            bad = np.flatnonzero((idx < 0) | (idx >= n))
            for pos in bad[:10]:
                r = int(np.searchsorted(ptr, pos, side="right") - 1)
                self.problems.append((int(ids[r]), f"{label} dependency on row {int(idx[pos])}, which is not a node of this rank"))
        for nid, dep in getattr(table, "dangling", ()) or ():
            self.problems.append((int(nid), f"depends on node {dep}, which is not in the rank's file"))
        cyc = cycle_rows(table) if n else np.zeros(0, dtype=np.int64)
        if len(cyc):
            self.problems.append((int(ids[cyc[0]]), f"dependency cycle: {len(cyc)} node(s) can never run (e.g. '{table.names[int(cyc[0])]}')"))
        kind = table.kind
        coll = np.flatnonzero(kind == NodeKind.COLL)
        ct = table.comm_type[coll]
        for r in coll[np.isin(ct, _UNSUPPORTED)][:10]:
            self.problems.append((int(ids[r]), f"{CollKind(int(table.comm_type[r])).name} collective: ASTRA-sim aborts on it (lower it to supported collectives or send/recv)"))
        self.coll_rows = coll
        self.coll_group = table.comm_group[coll].astype(np.int64)
        if not symbolic:
            self.coll_group = np.where(self.coll_group < 0, 0, self.coll_group)
        self.coll_type = table.comm_type[coll].astype(np.int64)
        self.coll_bytes = table.comm_bytes[coll]
        self.coll_ids = ids[coll]
        self.group_keys = np.unique(self.coll_group)  # slots (symbolic, -1 = all) or ids (concrete, 0 = all)
        self.send_rows = np.flatnonzero(kind == NodeKind.SEND)
        self.recv_rows = np.flatnonzero(kind == NodeKind.RECV)
        self.seq_cache: dict[tuple[int, ...], int] = {}


class _Checker:
    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.world = trace.world_size
        self.members = {int(g): tuple(int(r) for r in m) for g, m in trace.comm_groups.items()}
        self.member_sets = {g: frozenset(m) for g, m in self.members.items()}
        self.facts: dict[tuple[int, bool], _TableFacts] = {}
        self.sig_intern: dict[bytes, int] = {}
        self.sig_data: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.problems: list[Problem] = []

    def facts_for(self, prog: RankProgram) -> _TableFacts:
        symbolic = prog.group_ids is not None or prog.peer_ranks is not None
        k = (id(prog.table), symbolic)
        f = self.facts.get(k)
        if f is None:
            f = self.facts[k] = _TableFacts(prog.table, symbolic)
        return f

    def _signature(self, facts: _TableFacts, keys: tuple[int, ...]) -> int:
        got = facts.seq_cache.get(keys)
        if got is not None:
            return got
        mask = np.isin(facts.coll_group, keys) if len(keys) > 1 else facts.coll_group == keys[0]
        ct, cb, ids = facts.coll_type[mask], facts.coll_bytes[mask], facts.coll_ids[mask]
        blob = ct.tobytes() + b"|" + cb.tobytes()
        sig = self.sig_intern.get(blob)
        if sig is None:
            sig = self.sig_intern[blob] = len(self.sig_data)
            self.sig_data.append((ct, cb, ids))
        facts.seq_cache[keys] = sig
        return sig

    def rank_groups(self, rank: int, prog: RankProgram, facts: _TableFacts) -> dict[int, int]:
        """group id (0 = all ranks) -> signature of this rank's collectives on it."""
        by_gid: dict[int, list[int]] = {}
        if facts.symbolic:
            gids = prog.group_ids
            for slot in facts.group_keys.tolist():
                if slot < 0:
                    gid = 0
                elif gids is None or slot >= len(gids):
                    self.problems.append(Problem(rank, self._first_id(facts, slot), f"uses group slot {slot} but the rank binds only {0 if gids is None else len(gids)} group ids"))
                    continue
                else:
                    gid = max(int(gids[slot]), 0)
                by_gid.setdefault(gid, []).append(slot)
        else:
            for g in facts.group_keys.tolist():
                by_gid.setdefault(g, []).append(g)
        out = {}
        for gid, keys in by_gid.items():
            if gid != 0:
                m = self.member_sets.get(gid)
                if m is None:
                    self.problems.append(Problem(rank, self._first_id(facts, keys[0]), f"uses comm group {gid}, which is not in comm_groups"))
                    continue
                if rank not in m:
                    self.problems.append(Problem(rank, self._first_id(facts, keys[0]), f"issues a collective of comm group {gid}, but rank {rank} is not a member"))
                    continue
            out[gid] = self._signature(facts, tuple(sorted(keys)))
        return out

    @staticmethod
    def _first_id(facts: _TableFacts, key: int) -> int | None:
        hit = np.flatnonzero(facts.coll_group == key)
        return int(facts.coll_ids[hit[0]]) if len(hit) else None

    def check_order(self, sigs: list[dict[int, int]]) -> None:
        used: set[int] = set()
        for d in sigs:
            used.update(d)
        empty = self._empty_sig()
        for gid in sorted(used):
            members = tuple(range(self.world)) if gid == 0 else self.members.get(gid, ())
            if not members:
                continue
            got = [(m, sigs[m].get(gid, empty)) for m in members]
            counts = Counter(s for _, s in got)
            if len(counts) == 1:
                continue
            ref_sig = counts.most_common(1)[0][0]
            ref_rank = next(m for m, s in got if s == ref_sig)
            for m, s in got:
                if s != ref_sig:
                    self.problems.append(self._order_problem(gid, m, s, ref_rank, ref_sig))

    def _empty_sig(self) -> int:
        z = np.zeros(0, dtype=np.int64)
        blob = z.tobytes() + b"|" + z.tobytes()
        sig = self.sig_intern.get(blob)
        if sig is None:
            sig = self.sig_intern[blob] = len(self.sig_data)
            self.sig_data.append((z, z, z))
        return sig

    def _order_problem(self, gid: int, rank: int, sig: int, ref_rank: int, ref_sig: int) -> Problem:
        ct, cb, ids = self.sig_data[sig]
        rct, rcb, _ = self.sig_data[ref_sig]
        group = "all ranks" if gid == 0 else f"comm group {gid}"
        k = min(len(ct), len(rct))
        diff = np.flatnonzero((ct[:k] != rct[:k]) | (cb[:k] != rcb[:k]))
        if len(diff):
            i = int(diff[0])
            return Problem(rank, int(ids[i]), (
                f"collective #{i} of {group} is {_cname(ct[i])} of {int(cb[i])} bytes here but "
                f"{_cname(rct[i])} of {int(rcb[i])} bytes on rank {ref_rank}: members must issue a group's collectives in the same order"))
        if len(ct) < len(rct):
            return Problem(rank, int(ids[-1]) if len(ids) else None, (
                f"issues {len(ct)} collective(s) of {group} but rank {ref_rank} issues {len(rct)}: the run would deadlock"))
        return Problem(rank, int(ids[k]), f"issues {len(ct)} collective(s) of {group} but rank {ref_rank} issues {len(rct)}: the run would deadlock")

    def check_p2p(self, progs: Iterable[tuple[int, RankProgram, _TableFacts]]) -> None:
        cols: list[list[np.ndarray]] = [[], [], [], [], [], [], []]  # src, dst, tag, size, sign, rank, node id
        for rank, prog, facts in progs:
            t = prog.table
            for rows, sign in ((facts.send_rows, 1), (facts.recv_rows, -1)):
                if not len(rows):
                    continue
                slot = t.comm_peer[rows]
                if prog.peer_ranks is not None:
                    pr = prog.peer_ranks
                    okslot = (slot >= 0) & (slot < len(pr))
                    peer = np.where(okslot, pr[np.clip(slot, 0, max(len(pr) - 1, 0))] if len(pr) else -1, -1).astype(np.int64)
                else:
                    peer = slot.astype(np.int64)
                bad = (peer < 0) | (peer >= self.world)
                for r, p in zip(rows[bad][:10].tolist(), peer[bad][:10].tolist()):
                    what = ("send has no destination (comm_dst)" if sign > 0 else "recv has no source (comm_src)") if p < 0 else f"peer rank {p} is outside world size {self.world}"
                    self.problems.append(Problem(rank, int(t.node_ids[r]), what))
                rows, peer = rows[~bad], peer[~bad]
                me = np.full(len(rows), rank, dtype=np.int64)
                cols[0].append(me if sign > 0 else peer)
                cols[1].append(peer if sign > 0 else me)
                cols[2].append(t.comm_tag[rows].astype(np.int64))
                cols[3].append(t.comm_bytes[rows].astype(np.int64))
                cols[4].append(np.full(len(rows), sign, dtype=np.int64))
                cols[5].append(me)
                cols[6].append(t.node_ids[rows].astype(np.int64))
        if not cols[0]:
            return
        src, dst, tag, size, sign, rk, nid = (np.concatenate(c) for c in cols)
        keys = np.stack([src, dst, tag, size], axis=1)
        uniq, inv = np.unique(keys, axis=0, return_inverse=True)
        inv = inv.reshape(-1)
        net = np.bincount(inv, weights=sign, minlength=len(uniq)).astype(np.int64)
        for u in np.flatnonzero(net != 0)[:1000]:
            s, d, tg, sz = (int(x) for x in uniq[u])
            want = 1 if net[u] > 0 else -1
            hit = np.flatnonzero((inv == u) & (sign == want))
            i = int(hit[-1])
            n_send = int(((inv == u) & (sign > 0)).sum())
            n_recv = int(((inv == u) & (sign < 0)).sum())
            self.problems.append(Problem(int(rk[i]), int(nid[i]), (
                f"unmatched {'send' if want > 0 else 'recv'} {s} -> {d} tag {tg} size {sz}: "
                f"{n_send} send(s) but {n_recv} matching recv(s) (same src, dst, tag and size)")))

    def run(self) -> list[Problem]:
        sigs: list[dict[int, int]] = []
        p2p = []
        for rank, prog in enumerate(self.trace.ranks):
            facts = self.facts_for(prog)
            for nid, msg in facts.problems:
                self.problems.append(Problem(rank, nid, msg))
            sigs.append(self.rank_groups(rank, prog, facts))
            if len(facts.send_rows) or len(facts.recv_rows):
                p2p.append((rank, prog, facts))
        self.check_order(sigs)
        self.check_p2p(p2p)
        return sorted(self.problems, key=lambda p: (p.rank if p.rank is not None else -1, p.node_id if p.node_id is not None else -1, p.message))


def _cname(v) -> str:
    v = int(v)
    return CollKind(v).name if 0 <= v <= int(CollKind.BARRIER) else f"comm_type {v}"


def check_trace(trace: Trace) -> list[Problem]:
    """All problems that would make a consumer abort or deadlock on ``trace``; empty when it is sound."""
    return _Checker(trace).run()


def require_sound(trace: Trace, where: str, hint: str) -> None:
    """Raise :class:`~flint.errors.FlintError` naming the first problems when :func:`check_trace` finds any.

    Simulating or writing such a trace would abort or deadlock a consumer.
    """
    from flint.errors import FlintError

    problems = check_trace(trace)
    if problems:
        shown = "; ".join(str(p) for p in problems[:3])
        raise FlintError(f"{where}: {len(problems)} problem(s) that would make a simulator abort or deadlock: "
                         f"{shown}{' ...' if len(problems) > 3 else ''} ({hint})")
