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
from flint.trace import CollKind, NodeTableBuilder, RankProgram, Trace

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
    def __init__(self) -> None:
        self.b = NodeTableBuilder()
        self.group_slots: dict[tuple[int, ...], int] = {}
        self.peer_slots: dict[tuple[int, int], int] = {}

    def rows(self, values, env: dict[SSAValue, int]) -> list[int]:
        return [env[v] for v in values]

    def block(self, ops, env: dict[SSAValue, int]) -> list[int] | None:
        for op in ops:
            if isinstance(op, chakra.YieldOp):
                return self.rows(op.values, env)
            if isinstance(op, chakra.RepeatOp):
                carried = self.rows(op.inits, env)
                for _ in range(op.count.value.data):
                    inner = dict(env)
                    inner.update(zip(op.body.block.args, carried))
                    carried = self.block(op.body.block.ops, inner)
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
                                      data_deps=data, ctrl_deps=ctrl)
            elif isinstance(op, chakra.CollOp):
                if op.grid is None:
                    raise FlintError(f"chakra.coll '{name}' is concrete (group = ...); only SPMD graphs expand")
                slot = self.group_slots.setdefault(op.axes(), len(self.group_slots))
                row = self.b.add_coll(name, CollKind[op.kind.data.name], op.bytes.value.data, slot,
                                      duration_us=dur, data_deps=data, ctrl_deps=ctrl)
            elif isinstance(op, chakra.SendOp | chakra.RecvOp):
                if op.grid is None:
                    raise FlintError(f"{op.name} '{name}' is concrete (peer = ...); only SPMD graphs expand")
                slot = self.peer_slots.setdefault((op.axes()[0], op.offset.value.data), len(self.peer_slots))
                add = self.b.add_send if isinstance(op, chakra.SendOp) else self.b.add_recv
                row = add(name, op.bytes.value.data, slot, op.tag.value.data, duration_us=dur,
                          data_deps=data, ctrl_deps=ctrl)
            else:
                raise FlintError(f"unexpected op '{op.name}' in a chakra.graph")
            env[op.node] = row
        return None


def trace_from_ir(module: ModuleOp, graph: str = "step") -> Trace:
    """Expand ``chakra.graph @graph`` of ``module`` into a per-rank :class:`Trace`."""
    mesh = mesh_of(module)
    u = _Unroller()
    u.block(_graph(module, graph).body.block.ops, {})
    if len(u.b) == 0:
        raise FlintError(f"chakra.graph @{graph} has no nodes: every rank file would be empty")
    table = u.b.build()
    axes_sets = list(u.group_slots)
    groups, lookup = assign_group_ids(mesh, axes_sets)
    world = mesh.world_size
    # [world, slots] binding arrays, built column by column with numpy.
    gid = np.stack([lookup[tuple(sorted(a))] for a in axes_sets], axis=1) if axes_sets else np.zeros((world, 0), np.int64)
    peers = (np.stack([mesh.peers(a, k) for a, k in u.peer_slots], axis=1)
             if u.peer_slots else np.zeros((world, 0), np.int64))
    ranks = [RankProgram(table, gid[r], peers[r]) for r in range(world)]
    return Trace(world, ranks, groups)
