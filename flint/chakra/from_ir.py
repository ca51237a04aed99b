"""SPMD expansion: a `chakra.graph` (IR) to a :class:`flint.trace.Trace`.

This is where the compact IR meets the concrete cluster. ``chakra.repeat``
bodies are unrolled into one :class:`NodeTable` for the rank role; the table
stays *symbolic*: a collective's ``comm_group`` is a slot per distinct set of
grid axes, a send/recv's ``comm_peer`` a slot per distinct (axis, offset).
Every rank shares that table and gets two small arrays binding the slots to
its communicator-group ids and peer ranks, computed with the one rank <->
coordinate mapping in :mod:`flint.mesh`. Group ids are numbered from 1 by
:func:`flint.mesh.assign_group_ids`.
"""

from __future__ import annotations

import numpy as np
from xdsl.dialects.builtin import ArrayAttr, ModuleOp, StringAttr
from xdsl.dialects.shard import GridOp
from xdsl.ir import SSAValue

from flint.errors import FlintError
from flint.ir import chakra
from flint.mesh import Mesh, assign_group_ids
from flint.trace import CollKind, NodeKind, NodeTable, NodeTableBuilder, RankProgram, Trace, _csr

AXIS_NAMES_ATTR = "flint.axis_names"


def mesh_of(module: ModuleOp, grid_name: str | None = None) -> Mesh:
    """The :class:`Mesh` of the module's ``shard.grid`` (axis names from ``flint.axis_names``)."""
    grids = [op for op in module.ops if isinstance(op, GridOp)]
    if grid_name is not None:
        grids = [g for g in grids if g.sym_name.data == grid_name]
    if len(grids) != 1:
        names = ", ".join("@" + g.sym_name.data for g in grids) or "none"
        raise FlintError(f"expected exactly one shard.grid{'' if grid_name is None else ' @' + grid_name}, found {names}")
    grid = grids[0]
    names_attr = grid.attributes.get(AXIS_NAMES_ATTR)
    names = tuple(a.data for a in names_attr.data) if isinstance(names_attr, ArrayAttr) else ()
    return Mesh(tuple(grid.shape.get_values()), names)


def _graph(module: ModuleOp, name: str) -> chakra.GraphOp:
    for op in module.ops:
        if isinstance(op, chakra.GraphOp) and op.sym_name.data == name:
            return op
    raise FlintError(f"module has no chakra.graph @{name}; run -p lower-to-chakra first")


class _Unroller:
    """Walks a graph and appends its nodes; see :func:`_replicate` for repeats."""

    def __init__(self, fast: bool = True) -> None:
        self.fast = fast
        self.b = NodeTableBuilder()
        self.group_slots: dict[tuple[int, ...], int] = {}
        self.peer_slots: dict[tuple[int, int, tuple[int, ...] | None], int] = {}
        # Rows that run on some coordinates only: row -> slots in ``mask_slots`` (axis, mask), all of which
        # must be 1 at the rank's coordinates (compute: ``flint.active``; any node: ``flint.where``).
        self.row_mask: dict[int, list[int]] = {}
        self.mask_slots: dict[tuple[int, tuple[int, ...] | int], int] = {}
        # Top-level repeats emitted up to their steady iteration m, to be replicated with numpy:
        # (first row of iteration 0, rows per iteration, count, m).
        self.loops: list[tuple[int, int, int, int]] = []

    def _mask(self, row: int, axis: int, mask: tuple[int, ...] | int) -> None:
        """``mask``: a 0/1 per coordinate of ``axis`` (``flint.active``), or the one coordinate that runs
        (``flint.where``)."""
        self.row_mask.setdefault(row, []).append(self.mask_slots.setdefault((axis, mask), len(self.mask_slots)))

    def rows(self, values, env: dict[SSAValue, int]) -> list[int]:
        return [env[v] for v in values]

    def block(self, ops, env: dict[SSAValue, int], top: bool = True) -> list[int] | None:
        for op in ops:
            if isinstance(op, chakra.YieldOp):
                return self.rows(op.values, env)
            if isinstance(op, chakra.RepeatOp):
                count = op.count.value.data
                nested = any(isinstance(o, chakra.RepeatOp) for o in op.body.walk())
                fast = self.fast and top and not nested
                start = len(self.b)
                carried = self.rows(op.inits, env)
                m = None  # the iteration whose successors are all shifted copies of it
                for it in range(count):
                    before = len(self.b)
                    inner = dict(env)
                    inner.update(zip(op.body.block.args, carried))
                    nxt = self.block(op.body.block.ops, inner, top=False)
                    L = len(self.b) - before
                    if fast and L and it + 2 < count and _shifted(carried, nxt, start, L):
                        m, carried = it, nxt
                        break
                    carried = nxt
                if m is not None:
                    self.loops.append((start, (len(self.b) - start) // (m + 1), count, m))
                env.update(zip(op.outs, carried))
                continue
            data = self.rows(op.data_deps, env)
            ctrl = self.rows(op.ctrl_deps, env)
            name = op.node_name.data
            dur = op.duration_us.value.data if op.duration_us is not None else float("nan")
            if isinstance(op, chakra.CompOp):
                row = self.b.add_comp(name, duration_us=dur,
                                      flops=op.flops.value.data if op.flops is not None else -1,
                                      tensor_bytes=op.bytes.value.data if op.bytes is not None else -1,
                                      data_deps=data, ctrl_deps=ctrl,
                                      stream=op.attributes["stream"].data if "stream" in op.attributes else "")
                mask = op.attributes.get("flint.active")
                if mask is not None:
                    self._mask(row, op.attributes["flint.active_axis"].value.data, tuple(mask.get_values()))
            elif isinstance(op, chakra.CollOp):
                if op.grid is None:
                    raise FlintError(f"chakra.coll '{name}' is concrete (group = ...); only SPMD graphs expand")
                slot = self.group_slots.setdefault(op.axes(), len(self.group_slots))
                row = self.b.add_coll(name, CollKind[op.kind.data.name], op.bytes.value.data, slot,
                                      duration_us=dur, data_deps=data, ctrl_deps=ctrl,
                                      stream=op.stream.data if op.stream is not None else "")
            elif isinstance(op, chakra.SendOp | chakra.RecvOp):
                if op.grid is None:
                    raise FlintError(f"{op.name} '{name}' is concrete (peer = ...); only SPMD graphs expand")
                table = tuple(op.peers.get_values()) if op.peers is not None else None
                slot = self.peer_slots.setdefault((op.axes()[0], op.offset.value.data, table), len(self.peer_slots))
                add = self.b.add_send if isinstance(op, chakra.SendOp) else self.b.add_recv
                sms = {"sms": op.sms.value.data} if isinstance(op, chakra.SendOp) and op.sms is not None else {}
                row = add(name, op.bytes.value.data, slot, op.tag.value.data, duration_us=dur,
                          data_deps=data, ctrl_deps=ctrl, stream=op.stream.data if op.stream is not None else "",
                          **sms)
            else:
                raise FlintError(f"unexpected op '{op.name}' in a chakra.graph")
            where = op.attributes.get("flint.where")
            if where is not None:
                axis, coord = where.get_values()
                self._mask(row, int(axis), int(coord))
            env[op.node] = row
        return None


def _shifted(prev: list[int], nxt: list[int], start: int, L: int) -> bool:
    """Is ``nxt`` (the nodes an iteration hands on) ``prev`` one iteration later?

    Then every later iteration is a copy of the one that just ran, shifted by
    ``L`` rows: nodes inside the loop move on by one iteration, nodes from
    before it stay.
    """
    return all((p < start and n == p) or (p >= start and n == p + L) for p, n in zip(prev, nxt))


def _replicate(t: NodeTable, loops: list[tuple[int, int, int, int]]) -> tuple[NodeTable, np.ndarray]:
    """Expand top-level repeats that the unroller emitted up to a steady iteration.

    For a loop ``(s0, L, count, m)`` the table holds iterations ``0..m`` at
    rows ``[s0, s0 + (m+1)L)``; iteration ``m`` is the template: iteration
    ``m + k`` is a copy of it shifted by ``kL`` rows. A dependency at or after
    ``s0`` (this loop's nodes) shifts with the copy, one before it (an outer
    node) does not. Rows after the loop name the loop's results as rows of
    iterations ``<= m`` (what iteration ``m`` handed on); they are redirected
    to the same rows ``count - 1 - m`` iterations later.
    """
    if not loops:
        return t, np.arange(len(t))
    n = len(t)
    src_parts, k_parts = [], []
    prev = 0
    for s0, L, count, m in loops:
        t0 = s0 + m * L
        e1 = t0 + L
        src_parts.append(np.arange(prev, e1))
        k_parts.append(np.zeros(e1 - prev, np.int64))
        body = np.arange(t0, e1)
        src_parts.append(np.tile(body, count - 1 - m))
        k_parts.append(np.repeat(np.arange(1, count - m), L))
        prev = e1
    src_parts.append(np.arange(prev, n))
    k_parts.append(np.zeros(n - prev, np.int64))
    src, kk = np.concatenate(src_parts), np.concatenate(k_parts)
    new_pos = np.empty(n, np.int64)
    new_pos[src[kk == 0]] = np.nonzero(kk == 0)[0]

    def deps(ptr: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        counts = ptr[src + 1] - ptr[src]
        out_ptr = np.zeros(len(src) + 1, np.int64)
        out_ptr[1:] = np.cumsum(counts)
        total = int(out_ptr[-1])
        gather = np.repeat(ptr[src], counts) + (np.arange(total) - np.repeat(out_ptr[:-1], counts))
        dep = idx[gather]
        row, k = np.repeat(src, counts), np.repeat(kk, counts)
        out = new_pos[dep]
        for s0, L, count, m in loops:
            t0 = s0 + m * L
            e1 = t0 + L
            in_copy = (k >= 1) & (row >= t0) & (row < e1) & (dep >= s0)
            out[in_copy] += k[in_copy] * L
            after = (row >= e1) & (dep >= s0) & (dep < e1)
            out[after] += (count - 1 - m) * L
        return out_ptr, out

    dptr, didx = deps(t.data_dep_ptr, t.data_dep_idx)
    cptr, cidx = deps(t.ctrl_dep_ptr, t.ctrl_dep_idx)
    names = t.names
    optional = {} if t.comm_stream is None else {"comm_stream": t.comm_stream[src], "stream_names": t.stream_names}
    if t.comm_sms is not None:
        optional["comm_sms"] = t.comm_sms[src]
    return NodeTable(
        names=[names[i] for i in src.tolist()], kind=t.kind[src], duration_us=t.duration_us[src], flops=t.flops[src],
        tensor_bytes=t.tensor_bytes[src], comm_type=t.comm_type[src], comm_bytes=t.comm_bytes[src],
        comm_group=t.comm_group[src], comm_peer=t.comm_peer[src], comm_tag=t.comm_tag[src],
        data_dep_ptr=dptr, data_dep_idx=didx, ctrl_dep_ptr=cptr, ctrl_dep_idx=cidx,
        node_ids=np.arange(len(src), dtype=np.int64), **optional,
    ), src


def _drop_rows(t: NodeTable, drop: np.ndarray) -> NodeTable:
    """``t`` without the rows in ``drop`` (ops a rank skips; a skipped op's result is its first operand).

    A node that consumed a dropped row's data consumes what that row consumed instead (data deps); a
    node ordered after a dropped row (ctrl deps: stream order) is ordered after that row's own
    ctrl predecessors, so stream order is kept without inheriting the skipped op's data waits (a tree
    root's skipped send-to-parent must not make its next send wait for the whole reduction).
    """
    keep = np.nonzero(~drop)[0]
    new_pos = np.full(len(t), -1, np.int64)
    new_pos[keep] = np.arange(keep.size)
    via_data: dict[int, tuple[int, ...]] = {}
    via_ctrl: dict[int, tuple[int, ...]] = {}

    def resolve(deps, table) -> list[int]:
        out: dict[int, None] = {}
        for d in deps:
            for e in (table[d] if drop[d] else (d,)):
                out[e] = None
        return list(out)

    for i in np.nonzero(drop)[0].tolist():
        data = resolve(t.data_deps(i).tolist(), via_data)
        via_data[i] = tuple(data)
        via_ctrl[i] = tuple(resolve(t.ctrl_deps(i).tolist(), via_ctrl))
    data, ctrl = [], []
    for i in keep.tolist():
        dd = [int(new_pos[d]) for d in resolve(t.data_deps(i).tolist(), via_data)]
        cc = [int(new_pos[d]) for d in resolve(t.ctrl_deps(i).tolist(), via_ctrl)]
        data.append(dd)
        ctrl.append([c for c in dict.fromkeys(cc) if c not in dd])
    dptr, didx = _csr(data)
    cptr, cidx = _csr(ctrl)
    return NodeTable(
        names=[t.names[i] for i in keep.tolist()], kind=t.kind[keep], duration_us=t.duration_us[keep],
        flops=t.flops[keep], tensor_bytes=t.tensor_bytes[keep], comm_type=t.comm_type[keep],
        comm_bytes=t.comm_bytes[keep], comm_group=t.comm_group[keep], comm_peer=t.comm_peer[keep],
        comm_tag=t.comm_tag[keep], data_dep_ptr=dptr, data_dep_idx=didx, ctrl_dep_ptr=cptr, ctrl_dep_idx=cidx,
        node_ids=np.arange(keep.size, dtype=np.int64),
        **({} if t.comm_stream is None else {"comm_stream": t.comm_stream[keep], "stream_names": t.stream_names}),
        **({} if t.comm_sms is None else {"comm_sms": t.comm_sms[keep]}),
    )


def _table_peers(mesh: Mesh, axis: int, table: tuple[int, ...]) -> np.ndarray:
    """Per rank, the peer a per-coordinate offset table names along ``axis`` (-1: the rank skips)."""
    coord = np.indices(mesh.shape)[axis].reshape(-1)
    offs = np.asarray(table, np.int64)[coord]
    out = np.full(mesh.world_size, -1, np.int64)
    for k in np.unique(offs[offs % mesh.shape[axis] != 0]).tolist():
        sel = offs == k
        out[sel] = mesh.peers(axis, k)[sel]
    return out


def _role_table(module: ModuleOp, graph: str, fast_repeat: bool):
    u = _Unroller(fast_repeat)
    u.block(_graph(module, graph).body.block.ops, {})
    if len(u.b) == 0:
        raise FlintError(f"chakra.graph @{graph} has no nodes: every rank file would be empty")
    table, src = _replicate(u.b.build(), u.loops)
    return table, src, u


def pipeline_roles(module: ModuleOp, mesh: Mesh) -> tuple[list[str], np.ndarray] | None:
    """A pipelined module's graphs (``step_pp<r>``) and every rank's index into them (its ``pp`` coordinate)."""
    from flint.ir.aten import PIPELINE_ATTR

    info = module.attributes.get(PIPELINE_ATTR)
    if info is None:
        return None
    axis = info.data["axis"].data
    n = info.data["ranks"].value.data
    if n == 1:
        return ["step_pp0"], np.zeros(mesh.world_size, np.int64)
    return [f"step_pp{r}" for r in range(n)], mesh.coordinate(axis)


def trace_from_ir(module: ModuleOp, graph: str = "step", *, fast_repeat: bool = True) -> Trace:
    """Expand ``chakra.graph @graph`` of ``module`` into a per-rank :class:`Trace`.

    A pipelined module (``flint.pipeline``) has one graph per pipeline rank,
    ``@step_pp<r>``: every rank gets the table of its coordinate along the
    pipeline axis (one table per role, shared by the role's ranks).
    ``fast_repeat=False`` unrolls every repeat node by node in Python (the
    reference the numpy replication is tested against).
    """
    mesh = mesh_of(module)
    roles = pipeline_roles(module, mesh) if graph == "step" else None
    names, role_of = roles if roles is not None else ([graph], np.zeros(mesh.world_size, np.int64))
    built = [_role_table(module, name, fast_repeat) for name in names]
    axes_sets: list[tuple[int, ...]] = []
    for _, _, u in built:
        axes_sets += [a for a in u.group_slots if a not in axes_sets]
    groups, lookup = assign_group_ids(mesh, axes_sets)
    world = mesh.world_size
    coords = np.indices(mesh.shape).reshape(mesh.ndim, -1)
    ranks: list[RankProgram | None] = [None] * world
    for role, (table, src, u) in enumerate(built):
        members = np.nonzero(role_of == role)[0].tolist()
        # [world, slots] binding arrays, built column by column with numpy.
        slots = list(u.group_slots)
        gid = (np.stack([lookup[tuple(sorted(a))] for a in slots], axis=1) if slots
               else np.zeros((world, 0), np.int64))
        peers = (np.stack([mesh.peers(a, k) if tb is None else _table_peers(mesh, a, tb) for a, k, tb in u.peer_slots],
                          axis=1) if u.peer_slots else np.zeros((world, 0), np.int64))
        if not u.row_mask and not any(tb is not None for _, _, tb in u.peer_slots):
            for r in members:
                ranks[r] = RankProgram(table, gid[r], peers[r])
            continue
        # Nodes that run on some coordinates only: one table per distinct set of skipped rows.
        masks = list(u.mask_slots)
        has = np.zeros((len(masks), len(u.b)), bool)
        for row, slots in u.row_mask.items():
            has[slots, row] = True
        has = has[:, src]
        p2p = (table.kind == NodeKind.SEND) | (table.kind == NodeKind.RECV)
        tables: dict[bytes, NodeTable] = {}
        for r in members:
            drop = np.zeros(len(table), bool)
            drop[p2p] = peers[r][table.comm_peer[p2p]] < 0
            for slot, (axis, mask) in enumerate(masks):
                c = coords[axis, r]
                runs = mask == c if isinstance(mask, int) else mask[c]
                if not runs:
                    drop |= has[slot]
            key = np.packbits(drop).tobytes()
            t = tables.get(key)
            if t is None:
                t = tables[key] = _drop_rows(table, drop) if drop.any() else table
            ranks[r] = RankProgram(t, gid[r], peers[r])
    return Trace(world, ranks, groups)
