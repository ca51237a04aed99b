"""`verify-p2p`: prove, for the grid's concrete world size, that sends and recvs match and cannot deadlock."""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import numpy as np
from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, TensorType
from xdsl.dialects.shard import GridOp
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass
from xdsl.utils.exceptions import VerifyException

from flint.cost import tensor_bytes
from flint.ir import dist
from flint.ir.aten import STAGE_SCHEDULES_ATTR, AtenOp, get_schedule, get_schedule_entries, stage_roles
from flint.mesh import Mesh


class P2PError(VerifyException):
    """A `verify-p2p` failure naming two ops: ``op`` (reported first) and ``other``."""

    def __init__(self, op: Operation, other: Operation | None, message: str):
        super().__init__(message)
        self.op, self.other = op, other


def _bytes(op: dist.SendOp | dist.RecvOp) -> int:
    t = op.input.type if isinstance(op, dist.SendOp) else op.result.type
    if isinstance(t, dist.FutureType):
        t = t.value_type
    assert isinstance(t, TensorType)
    return tensor_bytes(t.get_shape(), str(t.element_type))


def _peer_offset(op: dist.PointToPointOp, coord: int, step: int = 0) -> int:
    table = op.peer_offsets()
    return table[coord] if table is not None else op.offset_at(step)


def _p2p_sources(fn: func.FuncOp) -> tuple[list[tuple[Operation, int]], dict[tuple, set[tuple]]]:
    """The function's sends and recvs in program order as ``(op, step)`` (a `dist.steps` body once per
    step), and for each send the recvs its operand depends on (through any ops).

    A buffer a `dist.steps` carries counts as depending on every recv that wrote any part of it: more
    wait-for edges than the exact slices give, which can only report a cycle that is not there, never
    hide one.
    """
    deps: dict[SSAValue, frozenset] = {}
    out: dict[tuple, set[tuple]] = {}
    order: list[tuple[Operation, int]] = []

    def visit(op: Operation, step: int) -> None:
        ins: frozenset = frozenset()
        for v in op.operands:
            ins |= deps.get(v, frozenset())
        if isinstance(op, dist.SendOp):
            out[(op, step)] = set(ins)
            order.append((op, step))
        if isinstance(op, dist.RecvOp):
            ins = ins | {(op, step)}
            order.append((op, step))
        for r in op.results:
            deps[r] = ins
        if isinstance(op, dist.WaitOp) and op.result is not None:
            deps[op.result] = deps.get(op.future, frozenset())

    for op in fn.body.block.ops:
        if not isinstance(op, dist.StepsOp):
            visit(op, 0)
            continue
        carried = [deps.get(v, frozenset()) for v in op.inits]
        block = op.body.block
        for i in range(op.count.value.data):
            for arg, d in zip(block.args, carried):
                deps[arg] = d
            for o in block.ops:
                if isinstance(o, dist.YieldOp):
                    carried = [deps.get(v, frozenset()) for v in o.values]
                    break
                visit(o, i)
        for r, d in zip(op.outs, carried):
            deps[r] = d
    return order, out


@dataclass(frozen=True)
class VerifyP2PPass(ModulePass):
    """Prove that every send has one matching recv and that the ranks cannot deadlock; change nothing.

    For the grid's concrete world size, every function of the step (one
    iteration of each, in schedule order: repeats replay the same exchange)
    is expanded to every rank, resolving each ``dist.send`` / ``dist.recv``
    to a concrete peer through :mod:`flint.mesh` (uniform ``offset`` or the
    per-coordinate ``peers`` table; a 0 entry skips the rank). Then:

    - matching: the k-th send from rank a to rank b with tag t pairs with the
      k-th recv on b from a with tag t, and both carry the same bytes; a send
      or recv without a partner, or a size mismatch, fails;
    - deadlock: a wait-for graph over every rank's sends and recvs (a
      matched pair is one node, since both complete together), with an edge
      for each rank's program order among its sends, among its recvs, per
      channel (``stream``; the queues `lower-to-chakra` gives them), and
      from a recv to a later send
      whose operand depends on it. Every op can complete iff this graph is
      acyclic (a topological order is an execution); a cycle is reported.

    A pipelined module (``flint.stage_schedules``, from ``pipeline-split``):
    each function holding its own sends and recvs is checked as above, once;
    the stage-boundary sends and recvs (the tagged schedule entries) are
    checked across ranks, each rank running its pipeline role's schedule,
    tags offset by the entry's ``tag``. The wait-for graph then also holds
    one node per compute entry, as ``lower-to-chakra`` orders them: each
    compute entry after the previous one, after the synchronous sends and
    recvs issued since it and after the recvs its ``wait`` names; a send
    after the compute before it (its data); a ``post`` recv too; sends and
    recvs in order per kind, stream and peer (the simulator's queues).

    Failures name both ops (the first offending pair), with their locations,
    and the ranks. An analysis: the module is left unchanged.
    """

    name = "verify-p2p"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        grids = [g for g in op.ops if isinstance(g, GridOp)]
        if not grids:
            return
        mesh = Mesh(tuple(grids[0].shape.get_values()))
        funcs = {f.sym_name.data: f for f in op.ops if isinstance(f, func.FuncOp)}
        order = [name for name, _ in get_schedule(op)] if funcs else []
        pipelined = STAGE_SCHEDULES_ATTR in op.attributes
        if pipelined:  # each function's own exchanges once; the tagged stage-boundary entries in _pipeline
            seen: dict[str, None] = {}
            for role in range(stage_roles(op)):
                for name, _, options in get_schedule_entries(op, role):
                    if "tag" not in options:
                        seen.setdefault(name, None)
            order = list(seen)
        world = mesh.world_size
        coords = np.indices(mesh.shape).reshape(mesh.ndim, -1)
        g = nx.DiGraph()
        ops: dict[tuple, Operation] = {}  # every node's op (matched pairs are contracted out of g)
        sends: dict[tuple, list] = {}
        recvs: dict[tuple, list] = {}
        for part, name in enumerate(order):
            fn = funcs[name]
            p2p, sources = _p2p_sources(fn)
            if not p2p:
                continue
            for r in range(world):
                last: dict[tuple[type, str], tuple] = {}
                inst: dict[tuple, tuple] = {}
                for o, step in p2p:
                    axis = o.axes()[0]
                    n = mesh.shape[axis]
                    c = int(coords[axis, r])
                    k = _peer_offset(o, c, step)
                    where = dist.where_of(o)
                    if k % n == 0 or (where is not None and int(coords[where[0], r]) != where[1]):
                        continue  # this rank skips the op
                    peer = mesh.peer(r, axis, k)
                    node = (part, r, len(inst))
                    inst[(o, step)] = node
                    g.add_node(node, op=o, rank=r)
                    ops[node] = o
                    key = (type(o), dist.stream_of(o))
                    prev = last.get(key)
                    if prev is not None:
                        g.add_edge(prev, node)
                    last[key] = node
                    if isinstance(o, dist.SendOp):
                        for src in sources.get((o, step), ()):
                            if src in inst:
                                g.add_edge(inst[src], node)
                        sends.setdefault((part, r, peer, o.tag_at(step)), []).append(node)
                    else:
                        recvs.setdefault((part, peer, r, o.tag_at(step)), []).append(node)
        self._match(g, sends, recvs, ops)
        self._deadlock(g)
        if pipelined:
            self._pipeline(op, mesh, funcs)

    def _pipeline(self, op: ModuleOp, mesh: Mesh, funcs: dict[str, func.FuncOp]) -> None:
        """The stage-boundary sends and recvs of a pipelined module, every rank running its role's schedule."""
        from flint.chakra.from_ir import mesh_of, pipeline_roles

        _, role_of = pipeline_roles(op, mesh_of(op))
        coords = np.indices(mesh.shape).reshape(mesh.ndim, -1)
        g = nx.DiGraph()
        ops: dict[tuple, Operation] = {}
        sends: dict[tuple, list] = {}
        recvs: dict[tuple, list] = {}
        p2p_of = {name: _p2p_sources(fn)[0] for name, fn in funcs.items()}
        for r in range(mesh.world_size):
            comp = None  # the last compute entry's node
            pending: list[tuple] = []  # synchronous sends / recvs since then: the next compute waits for them
            posted: dict[int, tuple] = {}  # tag -> an asynchronous recv not waited for yet
            last: dict[tuple, tuple] = {}  # (kind, stream, peer) -> the queue's last node
            for e, (name, _, options) in enumerate(get_schedule_entries(op, int(role_of[r]))):
                if "tag" not in options:
                    node = ("compute", r, e)
                    g.add_node(node, op=funcs[name], rank=r)
                    for prev in ([comp] if comp is not None else []) + pending + [posted.pop(t) for t in
                                                                                  options.get("wait", ()) if t in posted]:
                        g.add_edge(prev, node)
                    comp, pending = node, []
                    continue
                for i, (o, step) in enumerate(p2p_of[name]):
                    axis = o.axes()[0]
                    k = _peer_offset(o, int(coords[axis, r]), step)
                    where = dist.where_of(o)
                    if k % mesh.shape[axis] == 0 or (where is not None and int(coords[where[0], r]) != where[1]):
                        continue
                    peer = mesh.peer(r, axis, k)
                    node = (e, r, i)
                    g.add_node(node, op=o, rank=r)
                    ops[node] = o
                    key = (type(o), dist.stream_of(o), peer)
                    if key in last:
                        g.add_edge(last[key], node)
                    last[key] = node
                    tag = o.tag_at(step) + options["tag"]
                    send = isinstance(o, dist.SendOp)
                    if comp is not None and (send or options.get("post")):
                        g.add_edge(comp, node)
                    if send:
                        sends.setdefault(("pipeline", r, peer, tag), []).append(node)
                    else:
                        recvs.setdefault(("pipeline", peer, r, tag), []).append(node)
                    result = o.token if send else o.result
                    if result is not None and isinstance(result.type, dist.FutureType):
                        if not send:
                            posted[options["tag"]] = node
                    else:
                        pending.append(node)
        self._match(g, sends, recvs, ops)
        self._deadlock(g)

    @staticmethod
    def _match(g: nx.DiGraph, sends: dict, recvs: dict, ops: dict) -> None:
        for key in sorted(set(sends) | set(recvs)):
            part, a, b, tag = key
            ss, rr = sends.get(key, []), recvs.get(key, [])
            for s, r in zip(ss, rr):
                so, ro = g.nodes[s]["op"], g.nodes[r]["op"]
                if _bytes(so) != _bytes(ro):
                    raise P2PError(so, ro, f"'dist.send' op from rank {a} to rank {b} with tag {tag} sends "
                                           f"{_bytes(so)} bytes but the matching 'dist.recv' on rank {b} expects {_bytes(ro)}")
                # a matched pair completes together: one node of the wait-for graph
                nx.contracted_nodes(g, s, r, self_loops=False, copy=False)
            if len(ss) != len(rr):
                extra = ss[len(rr):] or rr[len(ss):]
                o = ops[extra[0]]
                near = _nearest(ops, sends if isinstance(o, dist.RecvOp) else recvs, a, b, tag, part)
                other = near[0] if near is not None else None
                what = (f"'dist.send' op on rank {a} to rank {b} with tag {tag} has no matching 'dist.recv' on rank {b}"
                        if isinstance(o, dist.SendOp) else
                        f"'dist.recv' op on rank {b} from rank {a} with tag {tag} has no matching 'dist.send' on rank {a}")
                if other is not None:
                    what += f"; the nearest candidate is '{other.name}' with tag {near[1]} (see note)"
                raise P2PError(o, other, what)

    @staticmethod
    def _deadlock(g: nx.DiGraph) -> None:
        try:
            cycle = nx.find_cycle(g)
        except nx.NetworkXNoCycle:
            return
        ops = [g.nodes[u] for u, _ in cycle]
        ops = [x for x in ops if isinstance(x["op"], dist.SendOp | dist.RecvOp)] or ops  # name sends / recvs
        a, b = ops[0], ops[1] if len(ops) > 1 else ops[0]
        ranks = sorted({x["rank"] for x in ops})
        raise P2PError(a["op"], b["op"], f"'{a['op'].name}' op on rank {a['rank']} can never complete: it waits, "
                                         f"through a cycle of {len(cycle)} sends/recvs over ranks {ranks[:16]}, on "
                                         f"'{b['op'].name}' on rank {b['rank']} (see note), which waits on it")


def _nearest(ops: dict, table: dict, a: int, b: int, tag: int, part: int) -> tuple[Operation, int] | None:
    """The partner-side op closest to an unmatched one: same ranks, the nearest tag."""
    for (p, x, y, t), nodes in sorted(table.items(), key=lambda kv: abs(kv[0][3] - tag)):
        if p == part and x == a and y == b and nodes:
            return ops[nodes[0]], t
    return None
