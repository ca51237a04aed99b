"""`lower-to-chakra`: turn the per-rank `aten` + `dist` program into a `chakra.graph`."""

from __future__ import annotations

from dataclasses import dataclass, field

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import FlatSymbolRefAttr, FloatAttr, IntegerAttr, ModuleOp, StringAttr, TensorType, f64, i64
from xdsl.ir import Block, BlockArgument, Operation, Region, SSAValue
from xdsl.passes import ModulePass
from xdsl.utils.exceptions import VerifyException

from flint.cost import Device, load_device, tensor_bytes
from flint.ir import chakra, dist
from flint.ir.aten import AtenOp, get_schedule_entries, stage_roles
from flint.passes.annotate_cost import aten_op_cost

# Function-argument roles (arg attribute `flint.role`) whose values exist
# before the step starts, so nodes reading them need not wait for the
# previous part of the step.
RESIDENT_ROLES = frozenset({"parameter", "buffer", "input", "exp_avg", "exp_avg_sq", "step"})
ROLE_ATTR = "flint.role"

# dist collective -> (Chakra kind, how to count comm_size). Kinds ASTRA-sim
# does not implement are lowered to one it does with the same data volume:
# a broadcast (scatter + all-gather, van de Geijn) moves 2(n-1)/n of the
# buffer, exactly a ring all-reduce of it; a barrier is an all-reduce of one
# 4-byte element, as PyTorch's NCCL barrier does.
_COLL_KIND = {
    dist.AllReduceOp: chakra.CollKind.ALL_REDUCE,
    dist.AllGatherOp: chakra.CollKind.ALL_GATHER,
    dist.ReduceScatterOp: chakra.CollKind.REDUCE_SCATTER,
    dist.AllToAllOp: chakra.CollKind.ALL_TO_ALL,
    dist.BroadcastOp: chakra.CollKind.ALL_REDUCE,
}
BARRIER_BYTES = 4
# An aten op that runs on some coordinates only (decompose-collectives' tree steps); kept on its node
# for the SPMD expansion, and never merged with other compute.
ACTIVE_ATTRS = ("flint.active", "flint.active_axis")


class LoweringError(VerifyException):
    """A `lower-to-chakra` failure; ``op`` is the offending operation."""

    def __init__(self, op: Operation, message: str):
        super().__init__(message)
        self.op = op


def _bytes_of(value: SSAValue) -> int:
    t = value.type
    if isinstance(t, dist.FutureType):
        t = t.value_type
    assert isinstance(t, TensorType)
    return tensor_bytes(t.get_shape(), str(t.element_type))


@dataclass
class _Streams:
    """Program order per stream while lowering one function body."""

    compute: SSAValue | None
    comm: SSAValue | None
    boundary: SSAValue | None  # last compute node of the previous part
    blocking: list[SSAValue] = field(default_factory=list)  # sync comm the next compute waits for


class _FunctionLowering:
    """Lowers one `func.func` body into chakra nodes appended to ``block``."""

    def __init__(self, fn: func.FuncOp, block: Block, device: Device, streams: _Streams, merge: bool = False,
                 tag_offset: int = 0, nosync_axes: frozenset[int] = frozenset(), costs: dict | None = None):
        self.fn, self.block, self.device, self.s, self.merge = fn, block, device, streams, merge
        # From the schedule entry (pipeline-split): added to send/recv tags; data-parallel
        # axes whose gradient reduce-scatters / all-reduces this run skips (accumulation).
        self.tag_offset, self.nosync_axes = tag_offset, nosync_axes
        # op -> (flops, bytes, duration): a function run from many schedule entries is costed once.
        self.costs = costs if costs is not None else {}
        self.producer: dict[SSAValue, tuple[SSAValue, ...]] = {}
        self.comm_nodes: set[SSAValue] = set()
        # Sends and recvs are ordered among themselves, not with each other or with
        # collectives: "send to +1; recv from -1" on every rank must not deadlock.
        self.last_p2p: dict[type, SSAValue] = {}
        # The compute node later ops may merge into, and the comm nodes it waits for.
        self.run: tuple[chakra.CompOp, set[SSAValue], int] | None = None
        resident = set()
        arg_attrs = fn.arg_attrs.data if fn.arg_attrs is not None else ()
        for arg, attrs in zip(fn.body.block.args, arg_attrs):
            role = attrs.data.get(ROLE_ATTR)
            if isinstance(role, StringAttr) and role.data in RESIDENT_ROLES:
                resident.add(arg)
        for arg in fn.body.block.args:
            # Values from outside: resident ones are ready, the rest come from the previous part.
            boundary = () if arg in resident or streams.boundary is None else (streams.boundary,)
            self.producer[arg] = boundary

    def deps_of(self, values) -> list[SSAValue]:
        seen: dict[SSAValue, None] = {}
        for v in values:
            for node in self.producer.get(v, ()):
                seen[node] = None
        return list(seen)

    def _add(self, node: chakra.NodeOp) -> SSAValue:
        self.block.add_op(node)
        return node.node

    def _order(self, data: list[SSAValue], prev: SSAValue | None, extra: list[SSAValue] = ()) -> list[SSAValue]:
        ctrl = [] if prev is None or prev in data else [prev]
        ctrl += [e for e in extra if e not in data and e not in ctrl]
        return ctrl

    def lower(self) -> None:
        for op in self.fn.body.block.ops:
            self.lower_op(op)

    def lower_op(self, op: Operation) -> None:
        if isinstance(op, func.ReturnOp):
            return
        if isinstance(op, AtenOp):
            return self.lower_aten(op)
        if isinstance(op, dist.CollectiveOp):
            return self.lower_collective(op)
        if isinstance(op, dist.BarrierOp):
            return self.lower_barrier(op)
        if isinstance(op, dist.SendOp | dist.RecvOp):
            return self.lower_p2p(op)
        if isinstance(op, dist.WaitOp):
            deps = tuple(self.producer.get(op.future, ()))
            if op.result is not None:
                self.producer[op.result] = deps
            # As wait_tensor on a device: the compute stream waits here, users or not.
            self.s.blocking += [d for d in deps if d in self.comm_nodes and d not in self.s.blocking]
            return
        raise LoweringError(op, f"'{op.name}' op cannot be lowered to Chakra (lower-to-chakra knows aten and dist ops)")

    def lower_aten(self, op: AtenOp) -> None:
        cost = self.costs.get(op)
        if cost is None:
            cost = self.costs[op] = aten_op_cost(op, self.device)
        flops, nbytes, duration = cost
        data = self.deps_of(op.inputs)
        if flops == 0 and nbytes == 0:  # a view: no kernel, results alias the inputs
            for r in op.outputs:
                self.producer[r] = tuple(data)
            return
        comm_deps = {d for d in data if d in self.comm_nodes}
        masked = {k: v for k, v in op.attributes.items() if k in ACTIVE_ATTRS}
        if self.merge and self.run is not None and not self.s.blocking and comm_deps <= self.run[1] and not masked:
            self._merge(op, flops, nbytes, duration)
            node = self.s.compute
        else:
            ctrl = self._order(data, self.s.compute, self.s.blocking)
            comp = chakra.CompOp(op.overload, flops=flops, bytes=nbytes, duration_us=round(duration, 6),
                                 data_deps=data, ctrl_deps=ctrl)
            comp.attributes.update(masked)
            node = self._add(comp)
            self.s.compute, self.s.blocking = node, []
            self.run = None if masked else (comp, comm_deps, 1)
        for r in op.outputs:
            self.producer[r] = (node,)

    def _merge(self, op: AtenOp, flops: int, nbytes: int, duration: float) -> None:
        """Fold ``op`` into the current compute node: the stream runs them back to back anyway."""
        comp, comm_deps, n = self.run
        first = comp.node_name.data.split(" +")[0]
        comp.properties["node_name"] = StringAttr(f"{first} +{n}")
        comp.properties["flops"] = IntegerAttr(comp.flops.value.data + flops, i64)
        comp.properties["bytes"] = IntegerAttr(comp.bytes.value.data + nbytes, i64)
        comp.properties["duration_us"] = FloatAttr(round(comp.duration_us.value.data + duration, 6), f64)
        self.run = (comp, comm_deps, n + 1)

    def _comm_node(self, node: chakra.NodeOp, result: SSAValue | None, is_async: bool, p2p: bool = False) -> None:
        node = self._add(node)
        self.comm_nodes.add(node)
        self.run = None  # a later compute node must not run before this comm node is issued
        if not p2p:
            self.s.comm = node
        if result is not None:
            self.producer[result] = (node,)
        if not is_async:
            self.s.blocking.append(node)  # a synchronous op blocks the compute stream too

    def _spmd(self, op: dist.DistCommOp) -> dict:
        return {"grid": FlatSymbolRefAttr(op.grid.root_reference), "grid_axes": op.grid_axes}

    def lower_collective(self, op: dist.CollectiveOp) -> None:
        data = self.deps_of([op.input])
        skip = (self.nosync_axes and isinstance(op, dist.ReduceScatterOp | dist.AllReduceOp)
                and set(op.axes()) <= self.nosync_axes)
        if op.group_size() == 1 or skip:  # nothing moves (or: gradient accumulation without sync)
            self.producer[op.result] = tuple(data)
            return
        kind = _COLL_KIND[type(op)]
        node = chakra.CollOp.build(
            operands=[data, self._order(data, self.s.comm)],
            result_types=[chakra.NODE],
            properties={"kind": chakra.CollKindAttr(kind), "node_name": StringAttr(op.name),
                        "bytes": IntegerAttr(_bytes_of(op.input), i64), **self._spmd(op)},
        )
        self._comm_node(node, op.result, op.is_async)

    def lower_barrier(self, op: dist.BarrierOp) -> None:
        if op.group_size() == 1:
            if op.token is not None:
                self.producer[op.token] = ()
            return
        ctrl = self._order([], self.s.comm, [self.s.compute] if self.s.compute is not None else [])
        node = chakra.CollOp.build(
            operands=[[], ctrl], result_types=[chakra.NODE],
            properties={"kind": chakra.CollKindAttr(chakra.CollKind.ALL_REDUCE), "node_name": StringAttr(op.name),
                        "bytes": IntegerAttr(BARRIER_BYTES, i64), **self._spmd(op)},
        )
        self._comm_node(node, op.token, op.token is not None)

    def lower_p2p(self, op: dist.SendOp | dist.RecvOp) -> None:
        is_send = isinstance(op, dist.SendOp)
        data = self.deps_of([op.input]) if is_send else []
        cls = chakra.SendOp if is_send else chakra.RecvOp
        nbytes = _bytes_of(op.input if is_send else op.result)
        node = cls.build(
            operands=[data, self._order(data, self.last_p2p.get(cls))], result_types=[chakra.NODE],
            properties={"node_name": StringAttr(op.name), "bytes": IntegerAttr(nbytes, i64),
                        "tag": IntegerAttr(op.tag.value.data + self.tag_offset, op.tag.type) if self.tag_offset
                        else op.tag, "offset": op.offset, **self._spmd(op),
                        **({"peers": op.peers} if op.peers is not None else {})},
        )
        result = op.token if is_send else op.result
        self._comm_node(node, result, isinstance(result.type, dist.FutureType) if result is not None else False,
                        p2p=True)
        self.last_p2p[cls] = node.node


@dataclass(frozen=True)
class LowerToChakraPass(ModulePass):
    """Lower the step's `aten` + `dist` functions to one `chakra.graph @step`.

    Follows the module's schedule (``flint.schedule``: which function runs
    when, and how often). Each `aten.op` becomes a ``chakra.comp`` with its
    FLOPs, bytes and roofline duration on ``device`` (view ops vanish);
    each collective a ``chakra.coll`` with Chakra's ``comm_size`` (the input
    buffer's bytes); sends and recvs ``chakra.send``/``chakra.recv``.
    Broadcasts become all-reduces of the buffer and barriers all-reduces of
    4 bytes (same data volume; ASTRA-sim runs neither). Collectives over a
    one-rank group vanish.

    Dependencies: data deps follow SSA use-def (through waits and views);
    ctrl deps keep program order on the compute stream, among collectives,
    among sends and among recvs (sends and recvs are not ordered against
    each other, so every rank may send before it receives), and make the
    next compute node wait for a synchronous communication op or at a
    ``dist.wait`` (a device stream waits there whether or not the next
    kernel uses the value). A function
    repeated N times becomes ``chakra.repeat N`` carrying the last compute
    and comm node; function arguments are ready at once if their
    ``flint.role`` is parameter, buffer, input (batch data) or optimizer
    state (exp_avg, exp_avg_sq, step), otherwise after the
    previous part's last compute node.

    ``merge-compute`` (default true) folds a compute op into the previous
    compute node when nothing can tell them apart in time: no communication
    was issued between them and the op waits for no communication node the
    first one did not already wait for. The merged node is named
    ``"<first op> +<n more>"`` and carries the summed FLOPs, bytes and duration.
    On one in-order compute stream this changes no start or finish time and
    cuts nodes per rank about tenfold (a captured step has hundreds of small
    elementwise ops per layer).

    The `func.func`s are replaced by the graph; the grid stays. Options:
    ``device`` (preset name or TOML path, default ``h100-sxm``),
    ``merge-compute`` (default true).
    """

    name = "lower-to-chakra"

    device: str = "h100-sxm"
    merge_compute: bool = True

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        device = load_device(self.device)
        funcs = {f.sym_name.data: f for f in op.ops if isinstance(f, func.FuncOp)}
        if not funcs:
            raise VerifyException("lower-to-chakra: the module has no func.func to lower")
        roles = stage_roles(op)
        pipelined = "flint.pipeline" in op.attributes
        axis_index = {}
        if roles > 1 or "flint.stage_schedules" in op.attributes:
            from flint.chakra.from_ir import mesh_of

            names = mesh_of(op).axis_names
            axis_index = {n: i for i, n in enumerate(names)}
        graphs = []
        costs: dict = {}
        bodies: dict | None = {} if pipelined else None
        for role in range(roles):
            graph_block = Block()
            s = _Streams(compute=None, comm=None, boundary=None)
            for name, count, options in get_schedule_entries(op, role):
                fn = funcs[name]
                extra = {"tag_offset": options.get("tag", 0), "costs": costs, "bodies": bodies,
                         "nosync_axes": frozenset(axis_index[a] for a in options.get("nosync", ()) if a in axis_index)}
                if s.compute is None and s.comm is None or pipelined and count == 1:
                    # Nothing to carry yet (or a pipeline's single run): one iteration flat, the rest as a repeat.
                    flat = {k: v for k, v in extra.items() if k != "bodies"}
                    _FunctionLowering(fn, graph_block, device, s, self.merge_compute, **flat).lower()
                    s.boundary = s.compute
                    count -= 1
                    if count == 0:
                        continue
                self._repeat(fn, count, graph_block, device, s, self.merge_compute, pipelined, **extra)
            graphs.append(graph_block)
        for f in funcs.values():
            op.body.block.erase_op(f)
        op.attributes.pop("flint.schedule", None)
        op.attributes.pop("flint.stage_schedules", None)
        for role, graph_block in enumerate(graphs):
            # A pipelined step: one graph per pipeline rank (its role), named step_pp<rank>.
            name = "step" if "flint.pipeline" not in op.attributes else f"step_pp{role}"
            op.body.block.add_op(chakra.GraphOp.create(properties={"sym_name": StringAttr(name)},
                                                       regions=[Region(graph_block)]))

    @staticmethod
    def _repeat(fn: func.FuncOp, count: int, outer: Block, device: Device, s: _Streams, merge: bool,
                pipelined: bool = False, **extra) -> None:
        carried = [v for v in (s.compute, s.comm) if v is not None]
        # In a pipeline, a synchronous recv before the repeat gates its first compute node:
        # carry it in (passed through unchanged).
        pending = list(s.blocking) if pipelined else []
        carried += pending
        # A function repeated from many schedule entries (a pipeline's microbatches) lowers to the
        # same body each time: build it once, clone it after.
        bodies = extra.pop("bodies", None)
        key = (fn.sym_name.data, extra.get("tag_offset", 0), extra.get("nosync_axes", frozenset()),
               s.compute is not None, s.comm is not None, len(pending))
        if bodies is not None and key in bodies:
            rep = chakra.RepeatOp(count, carried, bodies[key].clone())
            outer.add_op(rep)
            LowerToChakraPass._after_repeat(rep, s)
            return
        body = Block(arg_types=[chakra.NODE] * len(carried))
        args = iter(body.args)
        inner = _Streams(
            compute=next(args) if s.compute is not None else None,
            comm=next(args) if s.comm is not None else None,
            boundary=None,
        )
        inner.boundary = inner.compute
        passthrough = list(args)
        inner.blocking = list(passthrough)
        _FunctionLowering(fn, body, device, inner, merge, **extra).lower()
        yielded = [v for v, was in ((inner.compute, s.compute), (inner.comm, s.comm)) if was is not None]
        yielded += passthrough
        # A stream the body never touched passes its node through.
        body.add_op(chakra.YieldOp.build(operands=[yielded]))
        region = Region(body)
        if bodies is not None:
            bodies[key] = region.clone()
        rep = chakra.RepeatOp(count, carried, region)
        outer.add_op(rep)
        LowerToChakraPass._after_repeat(rep, s)

    @staticmethod
    def _after_repeat(rep: chakra.RepeatOp, s: _Streams) -> None:
        results = iter(rep.outs)
        s.compute = next(results) if s.compute is not None else None
        s.comm = next(results) if s.comm is not None else None
        # Streams first used inside the body are not carried out of it (no node outside names them).
        s.boundary = s.compute
        s.blocking = []
