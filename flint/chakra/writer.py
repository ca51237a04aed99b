"""Write a :class:`flint.trace.Trace` as per-rank Chakra ET files.

Output in ``out_dir``: ``<prefix>.<rank>.et`` for every rank (a
``GlobalMetadata`` record with version "0.0.4", then one length-delimited
``Node`` per table row, in table order) and ``<prefix>.comm_groups.json``.

Node encoding (see ``../shared/CHAKRA.md``), attributes in this order:

- COMP: ``duration_micros`` (rounded to whole microseconds; omitted when NaN
  or zero), ``num_ops`` int64, ``tensor_size`` uint64 (0 when the table has no
  value), ``is_cpu_op`` bool false.
- COLL: ``comm_type`` int64, ``comm_size`` int64 (bytes of each rank's input
  buffer), ``pg_name`` string = group id (omitted for "all ranks").
- SEND: ``comm_size`` int64, ``comm_tag`` int32, ``comm_dst`` int32.
- RECV: ``comm_size`` int64, ``comm_tag`` int32, ``comm_src`` int32.
- MEM_LOAD / MEM_STORE: ``tensor_size`` uint64 when known.
- Then, on any node on a named stream (``NodeTable.comm_stream``: a collective's communicator
  stream, a send/recv channel, a decomposed collective's reduction kernel), ``comm_stream``
  string = the stream's name; on a send whose kernel holds SMs (``NodeTable.comm_sms``),
  ``comm_sms`` int32. Both are Flint's own attributes: Flint's reader restores the columns from
  them (a trace read back simulates as the IR it came from), other consumers ignore them
  (ASTRA-sim reads attributes by name and runs one collective at a time per rank anyway).

The one rank-dependent attribute of a node (``pg_name``, ``comm_dst`` or
``comm_src``) is always last. That makes emission cheap: every node of a
table is serialized once; per rank, the file is the table's constant byte
segments interleaved with a few tiny per-binding tails, joined in C.

What consumers cannot run is rejected with a :class:`FlintError` naming the
rank and node: an empty rank, a dependency on a node not in the file,
duplicate node ids, collectives ASTRA-sim aborts on (REDUCE, GATHER, SCATTER,
BARRIER, REDUCE_SCATTER_BLOCK), a group id missing from ``comm_groups``, a
collective of a group the rank is not a member of, a send/recv without a peer
or with a peer outside the world, a dependency cycle.

Writing is atomic (:func:`flint.fileio.atomic_output_dir`): files go into a
hidden sibling directory that is renamed into place when complete. An
existing ``out_dir`` is swapped for the new one as a whole, so readers never
see a mix of old and new rank files and no stale file survives; it is
replaced without asking only when it holds nothing but a trace of the same
prefix (``force`` replaces any directory). On any failure, or a kill,
nothing is left behind.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path

import numpy as np

from flint.chakra import wire
from flint.chakra.check import cycle_rows
from flint.chakra.groups import format_comm_groups, validate_comm_groups
from flint.errors import FlintError
from flint.fileio import atomic_output_dir
from flint.progress import progress
from flint.trace import CollKind, NodeKind, NodeTable, RankProgram, Trace

#: Collectives ASTRA-sim aborts on; the lowering must turn them into supported kinds or send/recv.
UNSUPPORTED_COLLECTIVES = frozenset(
    {CollKind.REDUCE, CollKind.GATHER, CollKind.SCATTER, CollKind.BARRIER, CollKind.REDUCE_SCATTER_BLOCK}
)
_WRITABLE_KINDS = frozenset({NodeKind.METADATA, NodeKind.COMP, NodeKind.COLL, NodeKind.SEND, NodeKind.RECV, NodeKind.MEM_LOAD, NodeKind.MEM_STORE})

# Which per-rank value closes a variable node: the group id, or the peer as destination / source.
_PG, _DST, _SRC = 0, 1, 2
_TAIL_ATTR = {_PG: "pg_name", _DST: "comm_dst", _SRC: "comm_src"}


@dataclass(frozen=True)
class WriteStats:
    """What :func:`write_trace` wrote."""

    out_dir: Path
    prefix: str
    ranks: int
    files: int
    bytes_written: int
    nodes: int
    distinct_tables: int
    seconds: float


def comm_groups_path(out_dir: str | Path, prefix: str) -> Path:
    return Path(out_dir) / f"{prefix}.comm_groups.json"


def _node_label(table: NodeTable, row: int) -> str:
    return f"node {int(table.node_ids[row])} ('{table.names[row]}')"


def _tail(kind: int, value: int) -> bytes:
    if kind == _PG:
        return wire.attr_string("pg_name", str(value)) if value > 0 else b""
    return wire.attr_int32(_TAIL_ATTR[kind], value)


class _TablePlan:
    """One table serialized once: constant segments plus variable-node heads."""

    def __init__(self, table: NodeTable, symbolic: bool, first_rank: int) -> None:
        self.table = table
        self.symbolic = symbolic
        n = len(table)
        self.n = n
        self.empty = n == 0
        if self.empty:
            return
        self._validate(first_rank)

        kind = table.kind
        ids = table.node_ids
        extra = getattr(table, "extra_bytes", None) or {}
        cpu_rows = getattr(table, "cpu_op_rows", None) or ()
        group = table.comm_group
        peer = table.comm_peer
        # Variable rows and their key (tail kind, slot); for concrete tables nothing varies.
        var_rows: list[int] = []
        var_keys: list[tuple[int, int]] = []
        coll_rows = np.flatnonzero(kind == NodeKind.COLL)
        send_rows = np.flatnonzero(kind == NodeKind.SEND)
        recv_rows = np.flatnonzero(kind == NodeKind.RECV)
        for rows in (send_rows, recv_rows):
            bad = rows[peer[rows] < 0]
            if len(bad):
                what = "send without a destination (comm_dst)" if rows is send_rows else "recv without a source (comm_src)"
                raise FlintError(f"rank {first_rank}: {_node_label(table, int(bad[0]))} is a {what}")
        if symbolic:
            tail_of = {}
            for r in coll_rows[group[coll_rows] >= 0]:
                tail_of[int(r)] = (_PG, int(group[r]))
            for r in send_rows:
                tail_of[int(r)] = (_DST, int(peer[r]))
            for r in recv_rows:
                tail_of[int(r)] = (_SRC, int(peer[r]))
            var_rows = sorted(tail_of)
            var_keys = [tail_of[r] for r in var_rows]
            self.group_slots = np.unique(group[coll_rows][group[coll_rows] >= 0])
            self.peer_slots = np.unique(peer[np.concatenate([send_rows, recv_rows])])
        else:
            g = group[coll_rows]
            self.used_groups = [int(x) for x in np.unique(g[g > 0])]
            p = peer[np.concatenate([send_rows, recv_rows])]
            self.peer_range = (int(p.min()), int(p.max())) if len(p) else None
        var_set = set(var_rows)

        const_tail: dict[int, bytes] = {}
        if not symbolic:
            for r in coll_rows:
                if group[r] > 0:
                    const_tail[int(r)] = _tail(_PG, int(group[r]))
            for r in send_rows:
                const_tail[int(r)] = _tail(_DST, int(peer[r]))
            for r in recv_rows:
                const_tail[int(r)] = _tail(_SRC, int(peer[r]))

        # Serialize every row once.
        segments: list[bytes] = []
        heads: list[bytes] = []
        buf: list[bytes] = [wire.metadata_record()]
        dptr, didx, cptr, cidx = table.data_dep_ptr, table.data_dep_idx, table.ctrl_dep_ptr, table.ctrl_dep_idx
        ids_list = ids.tolist()
        didx_ids = ids[didx].tolist() if len(didx) else []
        cidx_ids = ids[cidx].tolist() if len(cidx) else []
        dptr_l, cptr_l = dptr.tolist(), cptr.tolist()
        kind_l = kind.tolist()
        dur = table.duration_us
        flops, tbytes = table.flops.tolist(), table.tensor_bytes.tolist()
        ctype, cbytes, tag = table.comm_type.tolist(), table.comm_bytes.tolist(), table.comm_tag.tolist()
        names = table.names
        stream = table.comm_stream.tolist() if table.comm_stream is not None and table.stream_names else None
        stream_attr = [wire.attr_string("comm_stream", name) for name in table.stream_names]
        sms = table.comm_sms.tolist() if table.comm_sms is not None else None
        for r in range(n):
            k = kind_l[r]
            parts = []
            nid = ids_list[r]
            if nid:
                parts.append(b"\x08" + wire.varint(nid))
            if names[r]:
                parts.append(wire.length_delimited(2, names[r].encode()))
            parts.append(b"\x18" + wire.varint(k))
            parts.append(wire.packed(4, cidx_ids[cptr_l[r] : cptr_l[r + 1]]))
            parts.append(wire.packed(5, didx_ids[dptr_l[r] : dptr_l[r + 1]]))
            d = dur[r]
            if not math.isnan(d):
                if d < 0:
                    raise FlintError(f"rank {first_rank}: {_node_label(table, r)} has negative duration {d} us")
                micros = int(round(d))
                if micros:
                    parts.append(b"\x38" + wire.varint(micros))
            if k == NodeKind.COMP:
                parts.append(wire.attr_int64("num_ops", max(flops[r], 0)))
                parts.append(wire.attr_uint64("tensor_size", max(tbytes[r], 0)))
                if r not in cpu_rows:  # a read trace's is_cpu_op=true travels in its extra bytes
                    parts.append(wire.attr_bool("is_cpu_op", False))
            elif k == NodeKind.COLL:
                if cbytes[r] < 0:
                    raise FlintError(f"rank {first_rank}: {_node_label(table, r)} has no comm_size")
                parts.append(wire.attr_int64("comm_type", ctype[r]))
                parts.append(wire.attr_int64("comm_size", cbytes[r]))
            elif k in (NodeKind.SEND, NodeKind.RECV):
                if cbytes[r] < 0:
                    raise FlintError(f"rank {first_rank}: {_node_label(table, r)} has no comm_size")
                parts.append(wire.attr_int64("comm_size", cbytes[r]))
                parts.append(wire.attr_int32("comm_tag", tag[r]))
            elif k != NodeKind.METADATA and tbytes[r] >= 0:
                parts.append(wire.attr_uint64("tensor_size", tbytes[r]))
            if stream is not None and stream[r] >= 0:
                parts.append(stream_attr[stream[r]])
            if sms is not None and sms[r] > 0:
                parts.append(wire.attr_int32("comm_sms", sms[r]))
            if r in extra:
                parts.append(extra[r])
            if r in var_set:
                segments.append(b"".join(buf))
                heads.append(b"".join(parts))
                buf = []
            else:
                if r in const_tail:
                    parts.append(const_tail[r])
                buf.append(wire.record(b"".join(parts)))
        segments.append(b"".join(buf))

        self.segments = segments  # len V + 1
        self.heads = heads  # len V
        self.var_keys_unique = sorted(set(var_keys))
        key_index = {kk: i for i, kk in enumerate(self.var_keys_unique)}
        idx = [key_index[kk] for kk in var_keys]
        self.n_var = len(var_rows)
        self.pick = itemgetter(*idx) if len(idx) > 1 else (lambda t, i=idx: [t[j] for j in i])
        self._evens: dict[tuple[int, ...], list[bytes]] = {}
        self._key_of_var = idx  # variable row j -> index of its key in var_keys_unique

    def _validate(self, rank: int) -> None:
        t = self.table
        n = len(t)
        kind = t.kind
        bad = ~np.isin(kind, list(_WRITABLE_KINDS))
        if bad.any():
            r = int(np.flatnonzero(bad)[0])
            raise FlintError(f"rank {rank}: {_node_label(t, r)} has node type {int(kind[r])}, which Flint does not write")
        ids = t.node_ids
        if (ids < 0).any():
            r = int(np.flatnonzero(ids < 0)[0])
            raise FlintError(f"rank {rank}: {_node_label(t, r)} has a negative node id")
        if len(np.unique(ids)) != n:
            u, c = np.unique(ids, return_counts=True)
            raise FlintError(f"rank {rank}: node id {int(u[c > 1][0])} appears more than once")
        for idx, ptr in ((t.data_dep_idx, t.data_dep_ptr), (t.ctrl_dep_idx, t.ctrl_dep_ptr)):
            out = (idx < 0) | (idx >= n)
            if out.any():
                pos = int(np.flatnonzero(out)[0])
                r = int(np.searchsorted(ptr, pos, side="right") - 1)
                raise FlintError(f"rank {rank}: {_node_label(t, r)} depends on row {int(idx[pos])}, which is not a node of this rank's file")
        dangling = getattr(t, "dangling", None)
        if dangling:
            nid, dep = dangling[0]
            raise FlintError(f"rank {rank}: node {nid} depends on node {dep}, which is not in the rank's file")
        coll = kind == NodeKind.COLL
        ct = t.comm_type
        bad = coll & (np.isin(ct, [int(c) for c in UNSUPPORTED_COLLECTIVES]) | (ct < 0) | (ct > int(CollKind.BARRIER)))
        if bad.any():
            r = int(np.flatnonzero(bad)[0])
            name = CollKind(int(ct[r])).name if 0 <= ct[r] <= int(CollKind.BARRIER) else str(int(ct[r]))
            raise FlintError(
                f"rank {rank}: {_node_label(t, r)} is a {name} collective, which ASTRA-sim cannot run; "
                "lower it to ALL_REDUCE / ALL_GATHER / REDUCE_SCATTER / ALL_TO_ALL or send/recv first"
            )
        cyc = cycle_rows(t)
        if len(cyc):
            raise FlintError(f"rank {rank}: {_node_label(t, int(cyc[0]))} is on a dependency cycle")

    def evens(self, tail_lens: tuple[int, ...]) -> list[bytes]:
        got = self._evens.get(tail_lens)
        if got is None:
            got = []
            for j, head in enumerate(self.heads):
                tl = tail_lens[self._key_of_var[j]]
                got.append(self.segments[j] + wire.varint(len(head) + tl) + head)
            got.append(self.segments[-1])
            self._evens[tail_lens] = got
        return got


class _Emitter:
    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.world = trace.world_size
        validate_comm_groups(trace.comm_groups, self.world)
        self.members = {gid: frozenset(int(r) for r in m) for gid, m in trace.comm_groups.items()}
        self.plans: dict[tuple[int, bool], _TablePlan] = {}
        self.tails: dict[tuple[int, int], bytes] = {}

    def plan(self, rank: int, prog: RankProgram) -> _TablePlan:
        symbolic = prog.group_ids is not None or prog.peer_ranks is not None
        k = (id(prog.table), symbolic)
        p = self.plans.get(k)
        if p is None:
            p = self.plans[k] = _TablePlan(prog.table, symbolic, rank)
        return p

    def _check_group(self, rank: int, plan: _TablePlan, gid: int, slot: int | None) -> None:
        if gid <= 0:
            return
        m = self.members.get(gid)
        where = f" (group slot {slot})" if slot is not None else ""
        if m is None:
            row = self._first_row(plan, slot, gid)
            raise FlintError(f"rank {rank}: {_node_label(plan.table, row)} uses comm group {gid}{where}, which is not in the trace's comm_groups")
        if rank not in m:
            row = self._first_row(plan, slot, gid)
            raise FlintError(f"rank {rank}: {_node_label(plan.table, row)} issues a collective of comm group {gid}{where}, but rank {rank} is not a member")

    @staticmethod
    def _first_row(plan: _TablePlan, slot: int | None, gid: int) -> int:
        t = plan.table
        col = slot if slot is not None else gid
        return int(np.flatnonzero((t.kind == NodeKind.COLL) & (t.comm_group == col))[0])

    def render(self, rank: int, prog: RankProgram) -> bytes:
        plan = self.plan(rank, prog)
        if plan.empty:
            raise FlintError(f"rank {rank} has no nodes: ASTRA-sim needs at least one node per rank file")
        if not plan.symbolic:
            for gid in plan.used_groups:
                self._check_group(rank, plan, gid, None)
            if plan.peer_range and (plan.peer_range[0] < 0 or plan.peer_range[1] >= self.world):
                raise FlintError(f"rank {rank}: a send/recv names peer rank outside world size {self.world}")
            return plan.segments[0]
        gids = prog.group_ids
        peers = prog.peer_ranks
        for s in plan.group_slots:
            s = int(s)
            if gids is None or s >= len(gids):
                raise FlintError(f"rank {rank}: its table uses group slot {s} but the rank binds only {0 if gids is None else len(gids)} group ids")
            self._check_group(rank, plan, int(gids[s]), s)
        for s in plan.peer_slots:
            s = int(s)
            if peers is None or s >= len(peers):
                raise FlintError(f"rank {rank}: its table uses peer slot {s} but the rank binds only {0 if peers is None else len(peers)} peers")
            if not 0 <= int(peers[s]) < self.world:
                raise FlintError(f"rank {rank}: peer slot {s} is bound to rank {int(peers[s])}, outside world size {self.world}")
        if plan.n_var == 0:
            return plan.segments[0]
        tails = []
        cache = self.tails
        for kind, slot in plan.var_keys_unique:
            v = int(gids[slot]) if kind == _PG else int(peers[slot])
            t = cache.get((kind, v))
            if t is None:
                t = cache[(kind, v)] = _tail(kind, v)
            tails.append(t)
        evens = plan.evens(tuple(len(t) for t in tails))
        parts: list = [None] * (2 * plan.n_var + 1)
        parts[0::2] = evens
        parts[1::2] = plan.pick(tails)
        return b"".join(parts)


def _write_file(path: str, data: bytes) -> None:
    """Write one output file (a seam tests use to inject failures)."""
    with open(path, "wb") as f:
        f.write(data)


_WRITER_THREADS = 3
_MAX_IN_FLIGHT = 12  # rendered files waiting for a writer thread (bounds memory)

_RANK_FILE = re.compile(r"^(?P<prefix>.+)\.(?P<rank>\d+)\.et$")


def _own_files(names: list[str], prefix: str) -> bool:
    """True when a directory holds only a trace of ``prefix`` (what replacing it would delete)."""
    for name in names:
        m = _RANK_FILE.match(name)
        if not (m and m["prefix"] == prefix) and name != f"{prefix}.comm_groups.json":
            return False
    return True


def write_trace(trace: Trace, out_dir: str | Path, prefix: str = "trace", *, force: bool = False) -> WriteStats:
    """Write ``trace`` as ``out_dir/<prefix>.<rank>.et`` plus ``<prefix>.comm_groups.json``.

    Raises :class:`FlintError` (naming the rank and node) for anything a
    consumer cannot run; see the module docstring. Output is byte-identical
    for equal input.
    """
    t0 = time.perf_counter()
    if not prefix or "/" in prefix or prefix.startswith("."):
        raise FlintError(f"trace prefix {prefix!r} must be a plain file-name stem")
    if trace.world_size < 1:
        raise FlintError("trace has no ranks")
    out_dir = Path(out_dir)
    emitter = _Emitter(trace)
    total = 0
    nodes = 0
    # Rendering holds the GIL; file creation and writes release it, so a few
    # writer threads overlap the file system with the next rank's rendering.
    with atomic_output_dir(out_dir, may_replace=lambda names: _own_files(names, prefix), force=force) as tmp:
        pool = ThreadPoolExecutor(max_workers=_WRITER_THREADS)
        pending: deque = deque()
        try:
            for rank, prog in enumerate(progress(trace.ranks, desc="writing rank files", unit="rank",
                                                 total=trace.world_size, min_total=64)):
                data = emitter.render(rank, prog)
                pending.append(pool.submit(_write_file, str(tmp / f"{prefix}.{rank}.et"), data))
                total += len(data)
                nodes += len(prog.table)
                while len(pending) > _MAX_IN_FLIGHT:
                    pending.popleft().result()
            groups_text = format_comm_groups(trace.comm_groups).encode()
            pending.append(pool.submit(_write_file, str(tmp / f"{prefix}.comm_groups.json"), groups_text))
            total += len(groups_text)
            while pending:
                pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()
            pool.shutdown(wait=True)
    return WriteStats(
        out_dir=out_dir, prefix=prefix, ranks=trace.world_size, files=trace.world_size + 1,
        bytes_written=total, nodes=nodes, distinct_tables=len(emitter.plans), seconds=time.perf_counter() - t0,
    )
