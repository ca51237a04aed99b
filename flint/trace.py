"""The in-memory per-rank node graph shared by the Chakra writer, the reader
and the simulator.

This is the compact form a training step takes *after* the IR: the `chakra`
dialect (or a trace directory read from disk) becomes a :class:`Trace`, the
writer serializes it, the simulator runs it. Nothing here is an xDSL op, so a
16,384-rank trace of a 405B model stays a few arrays.

Structure
---------
- A :class:`NodeTable` is one rank *role*'s graph in columnar numpy arrays,
  nodes in a topological order (every dependency points to an earlier row).
  Layers and microbatches are already unrolled here.
- A :class:`RankProgram` binds a table to one rank. Tables made from the SPMD
  IR are *symbolic*: ``comm_group`` holds a slot index into the rank's
  ``group_ids`` and ``comm_peer`` a slot index into its ``peer_ranks``, so all
  ranks of a role share one table and differ only in two tiny arrays. Tables
  read from disk are *concrete*: ``group_ids``/``peer_ranks`` are ``None``
  and the columns hold the group id and peer rank themselves.
- A :class:`Trace` is ``world_size`` rank programs plus the communicator
  groups (id -> member ranks; ids from 1, as in Chakra's comm-group JSON).

Columns and units
-----------------
``kind``         Chakra ``NodeType`` value (:class:`NodeKind`).
``duration_us``  float64, NaN when the node carries no duration.
``flops``        int64, the node's ``num_ops``; -1 when absent.
``tensor_bytes`` int64, the node's ``tensor_size`` (bytes a compute node moves); -1 when absent.
``comm_type``    int8, Chakra ``CollectiveCommType`` value; -1 unless a collective.
``comm_bytes``   int64, ``comm_size``: bytes of each rank's *input* buffer.
``comm_group``   int32, group id (concrete) or group slot (symbolic); 0 / -1
                 means "all ranks" (Chakra's empty ``pg_name``).
``comm_peer``    int32, send destination / recv source; -1 otherwise.
``comm_tag``     int32, send/recv tag; -1 otherwise.
``data_deps``    CSR (``data_dep_ptr`` [n+1], ``data_dep_idx``) of *row
                 positions* this node waits for; ``ctrl_deps`` the same.
``node_ids``     int64, the Chakra node id written to / read from the file.
``comm_stream``  int16 or ``None``: the named communication stream of a collective
                 (or channel of a send / recv), an index into ``stream_names``; -1
                 (or no column) is the default collective (send, recv) stream. Set by the ``assign-streams`` pass through the
                 IR; the simulator runs one in-order queue per stream. Chakra files carry the name
                 as Flint's ``comm_stream`` string attribute.
``comm_sms``     int16 or ``None``: SMs a send's communication kernel holds from
                 issue to finish (the simulator slows the rank's compute
                 meanwhile); 0 (or no column): none. In Chakra files: Flint's
                 ``comm_sms`` int32 attribute.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Sequence

import numpy as np


class NodeKind(IntEnum):
    """Chakra ``NodeType`` values Flint uses (numbers from et_def.proto)."""

    METADATA = 1
    MEM_LOAD = 2
    MEM_STORE = 3
    COMP = 4
    SEND = 5
    RECV = 6
    COLL = 7


class CollKind(IntEnum):
    """Chakra ``CollectiveCommType`` values (numbers from et_def.proto)."""

    ALL_REDUCE = 0
    REDUCE = 1
    ALL_GATHER = 2
    GATHER = 3
    SCATTER = 4
    BROADCAST = 5
    ALL_TO_ALL = 6
    REDUCE_SCATTER = 7
    REDUCE_SCATTER_BLOCK = 8
    BARRIER = 9


def _csr(deps: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    ptr = np.zeros(len(deps) + 1, dtype=np.int64)
    ptr[1:] = np.cumsum([len(d) for d in deps])
    idx = np.fromiter((i for d in deps for i in d), dtype=np.int64, count=int(ptr[-1]))
    return ptr, idx


@dataclass(eq=False)
class NodeTable:
    """One rank role's node graph, columnar; see the module docstring."""

    names: list[str]
    kind: np.ndarray
    duration_us: np.ndarray
    flops: np.ndarray
    tensor_bytes: np.ndarray
    comm_type: np.ndarray
    comm_bytes: np.ndarray
    comm_group: np.ndarray
    comm_peer: np.ndarray
    comm_tag: np.ndarray
    data_dep_ptr: np.ndarray
    data_dep_idx: np.ndarray
    ctrl_dep_ptr: np.ndarray
    ctrl_dep_idx: np.ndarray
    node_ids: np.ndarray
    comm_stream: np.ndarray | None = None
    stream_names: tuple[str, ...] = ()
    comm_sms: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.names)

    def data_deps(self, i: int) -> np.ndarray:
        return self.data_dep_idx[self.data_dep_ptr[i] : self.data_dep_ptr[i + 1]]

    def ctrl_deps(self, i: int) -> np.ndarray:
        return self.ctrl_dep_idx[self.ctrl_dep_ptr[i] : self.ctrl_dep_ptr[i + 1]]


class NodeTableBuilder:
    """Appends nodes one by one and freezes them into a :class:`NodeTable`.

    ``add_*`` return the new node's row position, which later nodes name in
    their ``data_deps`` / ``ctrl_deps``. Node ids default to the row position.
    """

    def __init__(self) -> None:
        self._rows: list[tuple] = []
        self._data: list[Sequence[int]] = []
        self._ctrl: list[Sequence[int]] = []
        self._stream: dict[int, int] = {}  # row -> stream index
        self._stream_names: dict[str, int] = {}
        self._sms: dict[int, int] = {}  # send row -> SMs its kernel holds

    def __len__(self) -> int:
        return len(self._rows)

    def _add(self, row: tuple, data_deps: Sequence[int], ctrl_deps: Sequence[int], node_id: int | None) -> int:
        pos = len(self._rows)
        for d in (*data_deps, *ctrl_deps):
            if not 0 <= d < pos:
                raise ValueError(f"node {pos} ('{row[0]}') depends on row {d}, which is not an earlier node")
        self._rows.append(row + (pos if node_id is None else node_id,))
        self._data.append(tuple(data_deps))
        self._ctrl.append(tuple(ctrl_deps))
        return pos

    def add_comp(self, name: str, *, duration_us: float = float("nan"), flops: int = -1, tensor_bytes: int = -1,
                 data_deps: Sequence[int] = (), ctrl_deps: Sequence[int] = (), node_id: int | None = None,
                 stream: str = "") -> int:
        if stream:
            self._stream[len(self._rows)] = self._stream_names.setdefault(stream, len(self._stream_names))
        return self._add((name, NodeKind.COMP, duration_us, flops, tensor_bytes, -1, -1, -1, -1, -1), data_deps, ctrl_deps, node_id)

    def add_coll(self, name: str, comm_type: CollKind | int, comm_bytes: int, group: int, *,
                 duration_us: float = float("nan"), data_deps: Sequence[int] = (), ctrl_deps: Sequence[int] = (),
                 node_id: int | None = None, stream: str = "") -> int:
        if stream:
            self._stream[len(self._rows)] = self._stream_names.setdefault(stream, len(self._stream_names))
        return self._add((name, NodeKind.COLL, duration_us, -1, -1, int(comm_type), comm_bytes, group, -1, -1), data_deps, ctrl_deps, node_id)

    def add_send(self, name: str, comm_bytes: int, peer: int, tag: int, *, duration_us: float = float("nan"),
                 data_deps: Sequence[int] = (), ctrl_deps: Sequence[int] = (), node_id: int | None = None,
                 stream: str = "", sms: int = 0) -> int:
        if stream:
            self._stream[len(self._rows)] = self._stream_names.setdefault(stream, len(self._stream_names))
        if sms:
            self._sms[len(self._rows)] = sms
        return self._add((name, NodeKind.SEND, duration_us, -1, -1, -1, comm_bytes, -1, peer, tag), data_deps, ctrl_deps, node_id)

    def add_recv(self, name: str, comm_bytes: int, peer: int, tag: int, *, duration_us: float = float("nan"),
                 data_deps: Sequence[int] = (), ctrl_deps: Sequence[int] = (), node_id: int | None = None,
                 stream: str = "") -> int:
        if stream:
            self._stream[len(self._rows)] = self._stream_names.setdefault(stream, len(self._stream_names))
        return self._add((name, NodeKind.RECV, duration_us, -1, -1, -1, comm_bytes, -1, peer, tag), data_deps, ctrl_deps, node_id)

    def build(self) -> NodeTable:
        cols = list(zip(*self._rows)) if self._rows else [()] * 11
        dptr, didx = _csr(self._data)
        cptr, cidx = _csr(self._ctrl)
        return NodeTable(
            names=list(cols[0]),
            kind=np.asarray(cols[1], dtype=np.int8),
            duration_us=np.asarray(cols[2], dtype=np.float64),
            flops=np.asarray(cols[3], dtype=np.int64),
            tensor_bytes=np.asarray(cols[4], dtype=np.int64),
            comm_type=np.asarray(cols[5], dtype=np.int8),
            comm_bytes=np.asarray(cols[6], dtype=np.int64),
            comm_group=np.asarray(cols[7], dtype=np.int32),
            comm_peer=np.asarray(cols[8], dtype=np.int32),
            comm_tag=np.asarray(cols[9], dtype=np.int32),
            data_dep_ptr=dptr, data_dep_idx=didx, ctrl_dep_ptr=cptr, ctrl_dep_idx=cidx,
            node_ids=np.asarray(cols[10], dtype=np.int64),
            **self._streams(),
            **self._sms_col(),
        )

    def _sms_col(self) -> dict:
        if not self._sms:
            return {}
        col = np.zeros(len(self._rows), dtype=np.int16)
        for row, k in self._sms.items():
            col[row] = k
        return {"comm_sms": col}

    def _streams(self) -> dict:
        if not self._stream:
            return {}
        col = np.full(len(self._rows), -1, dtype=np.int16)
        for row, k in self._stream.items():
            col[row] = k
        return {"comm_stream": col, "stream_names": tuple(self._stream_names)}


@dataclass(eq=False)
class RankProgram:
    """One rank's graph: a (possibly shared) table plus the rank's bindings.

    ``group_ids[slot]`` / ``peer_ranks[slot]`` resolve a symbolic table's
    ``comm_group`` / ``comm_peer`` slots; both ``None`` for a concrete table.
    """

    table: NodeTable
    group_ids: np.ndarray | None = None
    peer_ranks: np.ndarray | None = None

    def groups(self) -> np.ndarray:
        """Concrete group id per node (0 for "all ranks" / not a collective)."""
        g = self.table.comm_group
        if self.group_ids is None:
            return np.where(g < 0, 0, g)
        return np.where(g < 0, 0, self.group_ids[np.clip(g, 0, None)] if len(self.group_ids) else 0)

    def peers(self) -> np.ndarray:
        """Concrete peer rank per node (-1 when not a send/recv)."""
        p = self.table.comm_peer
        if self.peer_ranks is None:
            return p
        return np.where(p < 0, -1, self.peer_ranks[np.clip(p, 0, None)] if len(self.peer_ranks) else -1)


@dataclass(eq=False)
class Trace:
    """A whole training step: one :class:`RankProgram` per rank plus groups."""

    world_size: int
    ranks: list[RankProgram]
    comm_groups: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.ranks) != self.world_size:
            raise ValueError(f"trace has {len(self.ranks)} rank programs for world size {self.world_size}")

    def with_compute_scaled(self, factor: float, ranks: Sequence[int] | None = None) -> "Trace":
        """A copy whose compute nodes take ``factor`` times as long on ``ranks`` (default: every rank).
        A table several ranks share is scaled once and stays shared; the other tables are not copied.
        ``ValueError`` if a compute node to scale has no duration."""
        out = list(self.ranks)
        scaled: dict[int, NodeTable] = {}
        for r in range(self.world_size) if ranks is None else ranks:
            t = out[r].table
            if id(t) not in scaled:
                comp = t.kind == NodeKind.COMP
                if np.isnan(t.duration_us[comp]).any():
                    raise ValueError("scaling compute durations needs a duration on every compute node")
                scaled[id(t)] = replace(t, duration_us=np.where(comp, t.duration_us * factor, t.duration_us))
            out[r] = RankProgram(scaled[id(t)], out[r].group_ids, out[r].peer_ranks)
        return Trace(self.world_size, out, self.comm_groups)
