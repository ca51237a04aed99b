"""Read any Chakra ET trace directory back into a :class:`flint.trace.Trace`.

Accepted inputs:

- Flint's own output (``writer.py``): a write -> read -> write round trip
  gives byte-identical files.
- ``chakra_converter PyTorch`` output of real runs: METADATA_NODEs, compute
  nodes that are really collectives (named after c10d / gloo operators),
  ``is_cpu_op`` true, inputs/outputs, send/recv without ``comm_src`` /
  ``comm_dst`` / ``comm_tag``, possibly no ``GlobalMetadata`` record.
- symbolic_tensor_graph-style traces: empty metadata version, compute nodes
  without ``duration_micros``, ``is_cpu_op`` as int32.
- Any integer attribute type (int32/int64/uint*/sint*/fixed*/bool) for the
  attributes Flint understands.

The result has *concrete* tables (group ids and peer ranks in the columns).
Flint's own ``comm_stream`` (string) and ``comm_sms`` (int, sends) attributes
fill the ``comm_stream`` / ``stream_names`` and ``comm_sms`` columns (stream
names in order of first use), so a trace read back simulates as written.
Ranks whose files are byte-identical share one table object. Each table is a
:class:`ReadNodeTable`: besides the columns it keeps what a rewrite needs
verbatim (unknown attributes and node fields, ``is_cpu_op`` true) and the
dependencies that name a node absent from the file (``dangling``), which
:func:`flint.chakra.check_trace` reports. Proto3 cannot tell an absent
``duration_micros`` from 0, so both read as NaN ("no duration").

Rows keep file order when it is topological (every file Flint writes);
otherwise they are put in a stable topological order, with nodes on cycles
last in file order.

Errors are :class:`TraceError`, naming the file, the node id and the problem.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from flint.chakra import wire
from flint.chakra.groups import load_comm_groups
from flint.chakra.wire import TraceError, WireError
from flint.limits import MAX_SMS
from flint.trace import CollKind, NodeKind, NodeTable, RankProgram, Trace, _csr

_RANK_FILE = re.compile(r"^(?P<prefix>.+)\.(?P<rank>\d+)\.et$")

# Attributes Flint turns into columns (whatever their integer type).
_CANONICAL = frozenset({"num_ops", "tensor_size", "comm_type", "comm_size", "comm_src", "comm_dst", "comm_tag", "pg_name", "is_cpu_op",
                        "comm_stream", "comm_sms"})
# Flint's own attributes (writer.py): the named stream a node is queued on, the SMs a send's kernel holds.
_STRING_ATTRS = frozenset({"pg_name", "comm_stream"})


@dataclass(eq=False)
class ReadNodeTable(NodeTable):
    """A concrete :class:`NodeTable` read from one ET file, plus what the columns cannot hold."""

    #: row -> raw protobuf bytes of unknown node fields and attributes, re-emitted verbatim.
    extra_bytes: dict[int, bytes] = field(default_factory=dict)
    #: rows whose ``is_cpu_op`` was true (kept in ``extra_bytes``).
    cpu_op_rows: frozenset[int] = frozenset()
    #: (node id, missing dependency id) for dependencies on nodes not in the file.
    dangling: list[tuple[int, int]] = field(default_factory=list)
    #: the file this table came from (first one, when ranks share it).
    source: str = ""
    #: the GlobalMetadata version, ``None`` when the file has no metadata record.
    metadata_version: str | None = None


@dataclass(frozen=True)
class _Row:
    node_id: int
    name: str
    kind: int
    duration_us: float
    flops: int
    tensor_bytes: int
    comm_type: int
    comm_bytes: int
    group: int
    peer: int
    tag: int
    ctrl: tuple[int, ...]
    data: tuple[int, ...]
    extra: bytes
    cpu_op: bool
    stream: str = ""
    sms: int = 0


def _packed_or_single(buf, wt: int, value) -> list[int]:
    if wt == 0:
        return [value]
    out = []
    pos, end = value
    while pos < end:
        v, pos = wire.read_varint(buf, pos, end)
        out.append(v)
    return out


def _parse_attr(buf, begin: int, end: int) -> tuple[str, object, bool]:
    """-> (name, value, is_list)."""
    name = ""
    value = None
    is_list = False
    for f, wt, v, _, _ in wire.iter_fields(buf, begin, end):
        if f == 1:
            if wt != 2:
                raise WireError("attribute name is not a string")
            name = bytes(buf[v[0] : v[1]]).decode("utf-8", errors="replace")
        elif f == 2:
            continue
        elif f % 2 == 0:
            is_list = True
        else:
            value = wire.decode_attr_value(buf, f, wt, v)
    return name, value, is_list


def _int_attr(name: str, value, is_list: bool) -> int:
    if is_list:
        raise WireError(f"attribute '{name}' is a list, expected a number")
    if isinstance(value, bool) or isinstance(value, int):
        return int(value)
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise WireError(f"attribute '{name}' has value {value!r}, expected an integer")


def _parse_node(buf) -> _Row:
    end = len(buf)
    node_id = 0
    name = ""
    kind = 0
    ctrl: list[int] = []
    data: list[int] = []
    duration = math.nan
    attrs: dict[str, int | str] = {}
    cpu_op = False
    extra: list[bytes] = []
    for f, wt, v, start, stop in wire.iter_fields(buf, 0, end):
        if f == 1 and wt == 0:
            node_id = v
        elif f == 2 and wt == 2:
            name = bytes(buf[v[0] : v[1]]).decode("utf-8", errors="replace")
        elif f == 3 and wt == 0:
            kind = v
        elif f == 4 and wt in (0, 2):
            ctrl.extend(_packed_or_single(buf, wt, v))
        elif f == 5 and wt in (0, 2):
            data.extend(_packed_or_single(buf, wt, v))
        elif f == 7 and wt == 0:
            duration = float(v) if v else math.nan
        elif f == 10 and wt == 2:
            aname, aval, is_list = _parse_attr(buf, v[0], v[1])
            if aname == "is_cpu_op":
                if _int_attr(aname, aval, is_list):
                    cpu_op = True
                    extra.append(bytes(buf[start:stop]))
            elif aname in _CANONICAL and aname not in attrs:
                if aname in _STRING_ATTRS:
                    if is_list:
                        raise WireError(f"attribute '{aname}' is a list, expected a string")
                    attrs[aname] = "" if aval is None else str(aval)
                else:
                    attrs[aname] = _int_attr(aname, aval, is_list)
            elif aname not in _CANONICAL:
                extra.append(bytes(buf[start:stop]))
        else:
            extra.append(bytes(buf[start:stop]))
    _check_record(node_id, kind, attrs)
    group = 0
    pg = attrs.get("pg_name", "")
    if pg != "":
        try:
            group = int(pg)
        except ValueError:
            raise WireError(f"pg_name '{pg}' is not a comm-group id (Chakra group ids are integers)") from None
        if not 1 <= group <= _INT32_MAX:
            raise WireError(f"pg_name '{pg}' is not a valid comm-group id (ids are 1..{_INT32_MAX})")
    peer = -1
    if kind == NodeKind.SEND:
        peer = attrs.get("comm_dst", -1)
    elif kind == NodeKind.RECV:
        peer = attrs.get("comm_src", -1)
    comm_type = attrs.get("comm_type", -1) if kind == NodeKind.COLL else -1
    return _Row(
        node_id=node_id, name=name, kind=kind, duration_us=duration,
        flops=attrs.get("num_ops", -1), tensor_bytes=attrs.get("tensor_size", -1),
        comm_type=comm_type, comm_bytes=attrs.get("comm_size", -1),
        group=group if kind == NodeKind.COLL else 0, peer=peer,
        tag=attrs.get("comm_tag", -1) if kind in (NodeKind.SEND, NodeKind.RECV) else -1,
        ctrl=tuple(ctrl), data=tuple(data), extra=b"".join(extra), cpu_op=cpu_op,
        stream=str(attrs.get("comm_stream", "")), sms=attrs.get("comm_sms", 0),
    )


_INT64_MAX = (1 << 63) - 1
_INT32_MAX = (1 << 31) - 1
_NODE_TYPES = "1 METADATA_NODE, 2 MEM_LOAD_NODE, 3 MEM_STORE_NODE, 4 COMP_NODE, 5 COMM_SEND_NODE, 6 COMM_RECV_NODE, 7 COMM_COLL_NODE"


def _check_record(node_id: int, kind: int, attrs: Mapping[str, int | str]) -> None:
    """A node record's values are what Chakra's schema and consumers allow (et_def.proto, ASTRA-sim)."""
    if node_id > _INT64_MAX:
        raise WireError(f"node id {node_id} exceeds int64")
    if not int(NodeKind.METADATA) <= kind <= int(NodeKind.COLL):
        raise WireError(f"node type {kind} is not a Chakra NodeType ({_NODE_TYPES})")
    for name in ("num_ops", "tensor_size", "comm_size"):
        v = attrs.get(name)
        if v is not None and not 0 <= v <= _INT64_MAX:
            raise WireError(f"attribute '{name}' is {v}; it must be a non-negative int64")
    for name in ("comm_tag", "comm_src", "comm_dst"):
        v = attrs.get(name)
        if v is not None and not 0 <= v <= _INT32_MAX:
            raise WireError(f"attribute '{name}' is {v}; it must be a non-negative int32 (0..{_INT32_MAX})")
    v = attrs.get("comm_sms")
    if v is not None and not 0 <= v <= MAX_SMS:
        raise WireError(f"attribute 'comm_sms' is {v}; it must be 0..{MAX_SMS} (SMs a send's kernel holds)")
    if v is not None and kind != NodeKind.SEND:
        raise WireError(f"attribute 'comm_sms' on a node of type {kind}; only a send (COMM_SEND_NODE) carries it")
    if attrs.get("comm_stream") == "":
        raise WireError("attribute 'comm_stream' is empty; it names the stream the node is queued on")
    ct = attrs.get("comm_type")
    if ct is None and kind == NodeKind.COLL:
        raise WireError("COMM_COLL_NODE without a comm_type attribute (which collective it is)")
    if ct is not None and kind == NodeKind.COLL and not int(CollKind.ALL_REDUCE) <= ct <= int(CollKind.BARRIER):
        raise WireError(f"attribute 'comm_type' is {ct}, not a Chakra CollectiveCommType "
                        f"(0 ALL_REDUCE .. 9 BARRIER)")


def _is_metadata(buf) -> bool:
    """A GlobalMetadata record has only fields 1 (version) and 2 (attr), both length-delimited."""
    try:
        return all(f in (1, 2) and wt == 2 for f, wt, *_ in wire.iter_fields(buf, 0, len(buf)))
    except WireError:
        return False


class _Column:
    """An append-only numpy column (capacity doubling) for the row store."""

    def __init__(self, dtype) -> None:
        self.a = np.empty(1024, dtype=dtype)
        self.n = 0

    def append(self, v) -> None:
        if self.n == len(self.a):
            self.a = np.concatenate([self.a, np.empty_like(self.a)])
        self.a[self.n] = v
        self.n += 1


_COLS = (("kind", np.int8), ("duration_us", np.float64), ("flops", np.int64), ("tensor_bytes", np.int64),
         ("comm_type", np.int8), ("comm_bytes", np.int64), ("group", np.int32), ("peer", np.int32), ("tag", np.int32),
         ("node_id", np.int64), ("name_id", np.int64), ("struct_id", np.int64), ("has_extra", np.bool_),
         ("stream_id", np.int32), ("sms", np.int16))


class _FileReader:
    """Reads rank files through a store of distinct node records.

    Ranks of one role repeat the same records, so every distinct record is
    parsed once; a rank's table is then numpy fancy-indexing into the store's
    columns, and its dependency structure (which depends only on the node ids
    and deps, not on pg_name or peers) is computed once per distinct shape.
    """

    def __init__(self) -> None:
        self.index: dict[bytes, int] = {}  # raw record -> row id in the store
        self.rows: list[_Row] = []
        self.cols = {name: _Column(dt) for name, dt in _COLS}
        self.names: list[str] = []
        self.name_ids: dict[str, int] = {}
        self.struct_ids: dict[tuple, int] = {}
        self.structs: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
        self.shape_cache: dict[bytes, tuple] = {}
        self.names_cache: dict[bytes, list[str]] = {}
        self.stream_ids: dict[str, int] = {}  # comm_stream name -> id in the store ("" none: -1)
        self.table_cache: dict[bytes, ReadNodeTable] = {}  # file digest -> table

    def _add(self, row: _Row) -> int:
        rid = len(self.rows)
        self.rows.append(row)
        nid = self.name_ids.get(row.name)
        if nid is None:
            nid = self.name_ids[row.name] = len(self.names)
            self.names.append(row.name)
        skey = (row.node_id, row.ctrl, row.data)
        sid = self.struct_ids.get(skey)
        if sid is None:
            sid = self.struct_ids[skey] = len(self.structs)
            self.structs.append(skey)
        c = self.cols
        for name, v in (("kind", row.kind), ("duration_us", row.duration_us), ("flops", row.flops), ("tensor_bytes", row.tensor_bytes),
                        ("comm_type", row.comm_type), ("comm_bytes", row.comm_bytes), ("group", row.group), ("peer", row.peer),
                        ("tag", row.tag), ("node_id", row.node_id), ("name_id", nid), ("struct_id", sid),
                        ("has_extra", bool(row.extra) or row.cpu_op),
                        ("stream_id", self.stream_ids.setdefault(row.stream, len(self.stream_ids)) if row.stream else -1),
                        ("sms", row.sms)):
            c[name].append(v)
        return rid

    def read(self, path: Path) -> ReadNodeTable:
        try:
            data = path.read_bytes()
        except OSError as e:
            raise TraceError(f"{path}: cannot read ({e.strerror})") from None
        if data[:2] == b"\x1f\x8b":
            raise TraceError(f"{path}: file is gzip-compressed; ASTRA-sim cannot read that either, decompress it first")
        digest = hashlib.blake2b(data, digest_size=20).digest()
        cached = self.table_cache.get(digest)
        if cached is not None:
            return cached
        # The metadata record (if any) first, then one fused loop over the
        # node records: decode the length (inline for the 1-byte case), look
        # the raw bytes up in the store, parse only records never seen before.
        version: str | None = None
        end = len(data)
        pos = 0
        if end:
            n, body = self._length(data, 0, end, path, 0)
            if _is_metadata(memoryview(data)[body : body + n]):
                version = ""
                for f, wt, v, _, _ in wire.iter_fields(memoryview(data), body, body + n):
                    if f == 1:
                        version = bytes(data[v[0] : v[1]]).decode("utf-8", errors="replace")
                pos = body + n
        index = self.index
        get = index.get
        ids = []
        append = ids.append
        while pos < end:
            n = data[pos]
            if n < 0x80 and n:
                body = pos + 1
            else:
                n, body = self._length(data, pos, end, path, len(ids))
            raw = data[body : body + n]
            if len(raw) != n:
                raise TraceError(f"{path}: truncated file: record {len(ids)} at byte {pos} declares {n} bytes but only {end - body} remain")
            rid = get(raw)
            if rid is None:
                try:
                    row = _parse_node(raw)
                except WireError as err:
                    nid = _best_effort_id(raw)
                    where = f"node {nid}" if nid is not None else f"node record {len(ids)}"
                    raise TraceError(f"{path}: {where} (byte {body}): corrupt node: {err}") from None
                rid = index[raw] = self._add(row)
            append(rid)
            pos = body + n
        table = self._table(np.asarray(ids, dtype=np.int64), path)
        table.metadata_version = version
        self.table_cache[digest] = table
        return table

    @staticmethod
    def _length(data: bytes, pos: int, end: int, path: Path, record: int) -> tuple[int, int]:
        try:
            n, body = wire.read_varint(data, pos, end)
        except WireError:
            raise TraceError(f"{path}: truncated file: record {record} at byte {pos} has a cut-off length prefix") from None
        if n == 0 and pos:
            raise TraceError(f"{path}: zero-length record {record} at byte {pos} (Chakra's decoder stops reading there)")
        if body + n > end:
            raise TraceError(f"{path}: truncated file: record {record} at byte {pos} declares {n} bytes but only {end - body} remain")
        return n, body

    def _table(self, idx: np.ndarray, path: Path) -> ReadNodeTable:
        c = {name: col.a[: col.n] for name, col in self.cols.items()}
        sids = c["struct_id"][idx]
        key = sids.tobytes()
        shape = self.shape_cache.get(key)
        if shape is None:
            shape = self.shape_cache[key] = _shape([self.structs[s] for s in sids.tolist()], path)
        order, dptr, didx, cptr, cidx, dangling = shape
        if order is not None:
            idx = idx[order]
        name_ids = c["name_id"][idx]
        nkey = name_ids.tobytes()
        names = self.names_cache.get(nkey)
        if names is None:
            names = self.names_cache[nkey] = [self.names[i] for i in name_ids.tolist()]
        extra_rows = np.flatnonzero(c["has_extra"][idx]).tolist()
        rows = self.rows
        idx_l = idx.tolist()
        extra = {i: rows[idx_l[i]].extra for i in extra_rows if rows[idx_l[i]].extra}
        cpu = frozenset(i for i in extra_rows if rows[idx_l[i]].cpu_op)
        streams: dict = {}
        sid = c["stream_id"][idx]
        if (sid >= 0).any():  # the table's stream names in order of first use; its column indexes them
            by_id = {v: k for k, v in self.stream_ids.items()}
            first = np.unique(sid[sid >= 0], return_index=True)
            order = first[0][np.argsort(first[1])]
            lut = np.full(len(self.stream_ids), -1, np.int16)
            lut[order] = np.arange(len(order), dtype=np.int16)
            streams = {"comm_stream": np.where(sid >= 0, lut[np.maximum(sid, 0)], -1).astype(np.int16),
                       "stream_names": tuple(by_id[int(i)] for i in order)}
        sms = c["sms"][idx]
        if sms.any():
            streams["comm_sms"] = sms.copy()
        return ReadNodeTable(
            names=names,
            kind=c["kind"][idx], duration_us=c["duration_us"][idx], flops=c["flops"][idx], tensor_bytes=c["tensor_bytes"][idx],
            comm_type=c["comm_type"][idx], comm_bytes=c["comm_bytes"][idx], comm_group=c["group"][idx], comm_peer=c["peer"][idx],
            comm_tag=c["tag"][idx], data_dep_ptr=dptr, data_dep_idx=didx, ctrl_dep_ptr=cptr, ctrl_dep_idx=cidx,
            node_ids=c["node_id"][idx], extra_bytes=extra, cpu_op_rows=cpu, dangling=list(dangling), source=str(path),
            **streams,
        )


def _best_effort_id(raw: bytes) -> int | None:
    try:
        for f, wt, v, _, _ in wire.iter_fields(raw, 0, len(raw)):
            if f == 1 and wt == 0:
                return v
            break
    except WireError:
        pass
    return None


def _shape(structs: list[tuple[int, tuple[int, ...], tuple[int, ...]]], path: Path):
    """Dependency structure of a rank from its (node id, ctrl ids, data ids) sequence.

    Returns ``(order or None, data_ptr, data_idx, ctrl_ptr, ctrl_idx, dangling)``
    where ``order`` is the topological permutation of the file rows when the
    file is not already in topological order.
    """
    n = len(structs)
    pos_of: dict[int, int] = {}
    for i, (nid, _, _) in enumerate(structs):
        if nid in pos_of:
            raise TraceError(f"{path}: node {nid} appears more than once (rows {pos_of[nid]} and {i})")
        pos_of[nid] = i
    dangling: list[tuple[int, int]] = []
    data_pos: list[list[int]] = []
    ctrl_pos: list[list[int]] = []
    ordered = True
    for i, (nid, ctrl, data) in enumerate(structs):
        for deps, out in ((data, data_pos), (ctrl, ctrl_pos)):
            ps = []
            for d in deps:
                p = pos_of.get(d)
                if p is None:
                    dangling.append((nid, d))
                    continue
                if p >= i:
                    ordered = False
                ps.append(p)
            out.append(ps)
    order = None
    if not ordered:
        order = _stable_topo_order(n, data_pos, ctrl_pos)
        inv = [0] * n
        for new, old in enumerate(order):
            inv[old] = new
        data_pos = [[inv[p] for p in data_pos[o]] for o in order]
        ctrl_pos = [[inv[p] for p in ctrl_pos[o]] for o in order]
        order = np.asarray(order, dtype=np.int64)
    dptr, didx = _csr(data_pos)
    cptr, cidx = _csr(ctrl_pos)
    return order, dptr, didx, cptr, cidx, tuple(dangling)


def _stable_topo_order(n: int, data_pos: list[list[int]], ctrl_pos: list[list[int]]) -> list[int]:
    """Kahn's algorithm preferring the earliest file position; nodes on cycles go last."""
    indeg = [0] * n
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(n):
        for p in set(data_pos[i]) | set(ctrl_pos[i]):
            indeg[i] += 1
            children[p].append(i)
    heap = [i for i in range(n) if indeg[i] == 0]
    heapq.heapify(heap)
    out = []
    while heap:
        i = heapq.heappop(heap)
        out.append(i)
        for c in children[i]:
            indeg[c] -= 1
            if indeg[c] == 0:
                heapq.heappush(heap, c)
    if len(out) < n:
        seen = set(out)
        out.extend(i for i in range(n) if i not in seen)
    return out


def find_rank_files(dir_or_prefix: str | Path) -> tuple[Path, str, list[Path]]:
    """Resolve a trace directory, a ``DIR/PREFIX`` or one rank file to ``(dir, prefix, files)``.

    Raises :class:`TraceError` when no rank file exists, the directory holds
    several prefixes, or a rank file between 0 and the highest is missing.
    """
    p = Path(dir_or_prefix)
    if p.is_dir():
        directory = p
        prefixes = sorted({m["prefix"] for m in map(_RANK_FILE.match, os.listdir(p)) if m})
        if not prefixes:
            raise TraceError(f"{p}: no Chakra rank files (<prefix>.<rank>.et) in this directory")
        if len(prefixes) > 1:
            raise TraceError(f"{p}: several traces in this directory ({', '.join(prefixes)}); pass {p}/<prefix> to choose one")
        prefix = prefixes[0]
    else:
        m = _RANK_FILE.match(p.name)
        if m and p.is_file():
            directory, prefix = p.parent, m["prefix"]
        else:
            directory, prefix = p.parent, p.name
        if not directory.is_dir():
            raise TraceError(f"{p}: no such trace directory or prefix ({directory} does not exist)")
    ranks = set()
    for name in os.listdir(directory):
        m = _RANK_FILE.match(name)
        if m and m["prefix"] == prefix:
            ranks.add(int(m["rank"]))
    if not ranks:
        raise TraceError(f"{directory / prefix}: no such trace: neither a directory nor a prefix with rank files {prefix}.<rank>.et")
    world = max(ranks) + 1
    for r in range(world):
        if r not in ranks:
            raise TraceError(f"{directory / f'{prefix}.{r}.et'}: missing rank file (found ranks up to {world - 1})")
    return directory, prefix, [directory / f"{prefix}.{r}.et" for r in range(world)]


#: Conventional comm-group file names beside the rank files, in the order they are looked for:
#: Flint's, symbolic_tensor_graph's ``workload.json`` and its README's ``comm_group.json``.
COMM_GROUP_NAMES = ("{prefix}.comm_groups.json", "workload.json", "comm_group.json")
#: ``--help`` text of every command's ``--comm-groups`` option.
COMM_GROUPS_HELP = ("comm-group JSON of a trace (default: the first of <prefix>.comm_groups.json, workload.json, "
                    "comm_group.json beside the rank files)")


def find_comm_groups(directory: str | Path, prefix: str) -> Path | None:
    """The trace's comm-group file: the first of :data:`COMM_GROUP_NAMES` in ``directory``, or ``None``."""
    for pattern in COMM_GROUP_NAMES:
        p = Path(directory) / pattern.format(prefix=prefix)
        if p.is_file():
            return p
    return None


def read_trace(dir_or_prefix: str | Path, *, comm_groups: Mapping[int, Sequence[int]] | str | Path | None = None) -> Trace:
    """Read ``<prefix>.<rank>.et`` for ranks 0..N-1 (and the comm-group file) into a :class:`Trace`.

    ``comm_groups`` overrides the comm-group file found beside the rank files
    (:func:`find_comm_groups`): a mapping id -> ranks or a path to such a JSON
    file. Every group id a node uses must be covered, or a
    :class:`TraceError` names the file, node and group.
    """
    directory, prefix, files = find_rank_files(dir_or_prefix)
    groups_source = None
    if comm_groups is None:
        gpath = find_comm_groups(directory, prefix)
        groups = load_comm_groups(gpath) if gpath is not None else {}
        groups_source = str(gpath) if gpath is not None else None
    elif isinstance(comm_groups, (str, Path)):
        groups = load_comm_groups(comm_groups)
        groups_source = str(comm_groups)
    else:
        groups = {int(k): tuple(int(r) for r in v) for k, v in comm_groups.items()}
        groups_source = "the comm_groups argument"
    _check_group_ranks(groups, len(files), groups_source, directory, prefix)
    reader = _FileReader()
    ranks: list[RankProgram] = []
    return _read_all(reader, files, groups, groups_source, prefix, ranks)


def _check_group_ranks(groups: Mapping[int, Sequence[int]], world: int, source: str | None, directory: Path,
                       prefix: str) -> None:
    """Every member of every comm group is a rank with a file; no group lists a rank twice."""
    for gid, members in groups.items():
        if not members:
            raise TraceError(f"{source}: comm group {gid} has no members")
        if len(members) > world:
            raise TraceError(f"{source}: comm group {gid} lists {len(members):,} members, more than the "
                             f"{world} rank files of {directory / prefix}")
        hi = max(members)
        if hi >= world:
            raise TraceError(f"{source}: comm group {gid} names rank {hi}, but the trace has rank files for ranks "
                             f"0..{world - 1} only (is {directory / f'{prefix}.{hi}.et'} missing?)")
        if len(set(members)) != len(members):
            raise TraceError(f"{source}: comm group {gid} lists a rank twice")


def _read_all(reader, files, groups, groups_source, prefix, ranks) -> Trace:
    checked: set[int] = set()
    for path in files:
        table = reader.read(path)
        if id(table) not in checked:
            checked.add(id(table))
            used = np.unique(table.comm_group[(table.kind == NodeKind.COLL) & (table.comm_group > 0)])
            for gid in used:
                if int(gid) not in groups:
                    row = int(np.flatnonzero((table.kind == NodeKind.COLL) & (table.comm_group == gid))[0])
                    where = (f"{groups_source} does not define it" if groups_source else
                             f"no comm-group file was found beside the rank files ({', '.join(n.format(prefix=prefix) for n in COMM_GROUP_NAMES)}); pass one with --comm-groups")
                    raise TraceError(f"{path}: node {int(table.node_ids[row])} ('{table.names[row]}') uses comm group {int(gid)}, but {where}")
        ranks.append(RankProgram(table))
    return Trace(world_size=len(files), ranks=ranks, comm_groups=groups)
