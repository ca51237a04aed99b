"""`lower-to-chakra`: turn the per-rank `aten` + `dist` program into a `chakra.graph`."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import FlatSymbolRefAttr, FloatAttr, IntegerAttr, ModuleOp, StringAttr, TensorType, f64, i64
from xdsl.ir import Block, BlockArgument, OpResult, Operation, Region, SSAValue
from xdsl.passes import ModulePass
from xdsl.utils.exceptions import VerifyException

from flint.cost import Device, load_device, tensor_bytes
from flint.cost.opclass import VIEW, classify_target, split_target
from flint.ir import chakra, dist
from flint.ir.aten import AtenOp, get_schedule_entries, stage_roles
from flint.errors import FlintError
from flint.grad_wait import GRAD_WAIT
from flint.passes.annotate_cost import aten_op_cost
from flint.sim.breakdown import add_class_times
from flint.passes.scheduling import data_parallel_axes

# Function-argument roles (arg attribute `flint.role`) whose values exist
# before the step starts, so nodes reading them need not wait for the
# previous part of the step.
RESIDENT_ROLES = frozenset({"parameter", "buffer", "input", "exp_avg", "exp_avg_sq", "step"})
ROLE_ATTR = "flint.role"
# a parameter argument that gets no gradient (``requires_grad=False``: a frozen weight, a router's correction
# bias): AOTAutograd returns no result for it, so backward results skip it when paired with the forward's arguments
FROZEN_ATTR = "flint.frozen"


def frozen_args(fn: func.FuncOp) -> frozenset[int]:
    """Indices of ``fn``'s arguments marked :data:`FROZEN_ATTR`."""
    attrs = fn.arg_attrs.data if fn.arg_attrs is not None else ()
    return frozenset(i for i, a in enumerate(attrs) if FROZEN_ATTR in a.data)


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
ACTIVE_ATTRS = ("flint.active", "flint.active_axis", dist.WHERE_ATTR)


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
    comm: dict[str, SSAValue]  # last collective node per stream name ("": the default collective stream)
    boundary: SSAValue | None  # last compute node of the previous part
    blocking: list[SSAValue] = field(default_factory=list)  # comm the next compute waits for
    group: dict[tuple, SSAValue] = field(default_factory=dict)  # last collective per communicator (grid, axes)

    def carried(self) -> list[tuple[tuple, SSAValue]]:
        """The chain ends a repeat carries, in a fixed order."""
        out: list[tuple[tuple, SSAValue]] = []
        if self.compute is not None:
            out.append((("c",), self.compute))
        out += [(("s", k), self.comm[k]) for k in sorted(self.comm)]
        out += [(("g",) + k, self.group[k]) for k in sorted(self.group, key=str)]
        return out

    def set(self, key: tuple, value: SSAValue) -> None:
        if key[0] == "c":
            self.compute = value
        elif key[0] == "s":
            self.comm[key[1]] = value
        else:
            self.group[key[1:]] = value


# What a function body lowering emits for ops marked `flint.prefetch` (see flint.ir.dist):
ALL, PROLOGUE, STEADY, TAIL = "all", "prologue", "steady", "tail"


def _group_key(op: dist.DistCommOp) -> tuple:
    return (op.grid.root_reference.data, op.axes())


def _chain_keys(fn: func.FuncOp, cache: dict | None = None) -> tuple[set[str], set[tuple]]:
    """Streams and communicators the collectives of ``fn`` use (``cache``: per lowering, by function)."""
    if cache is not None:
        key = ("chain_keys", id(fn))
        if key not in cache:
            cache[key] = (fn, _chain_keys(fn))  # fn held: its id stays its own while the cache lives
        return cache[key][1]
    streams, groups = set(), set()
    for op in fn.body.block.ops:
        if isinstance(op, dist.CollectiveOp | dist.BarrierOp) and op.group_size() > 1:
            streams.add("" if isinstance(op, dist.BarrierOp) else dist.stream_of(op))
            groups.add(_group_key(op))
    return streams, groups


def prefetch_depth(fn: func.FuncOp, count: int, cache: dict | None = None) -> int:
    """Iterations ahead the prefetched ops of ``fn`` run when it repeats ``count`` times (0: none).

    ``cache``: per lowering, by function (a pipeline's schedules name the same functions many times)."""
    return 0 if count < 2 else min(prefetch_mark(fn, cache), count)


def prefetch_mark(fn: func.FuncOp, cache: dict | None = None) -> int:
    """The largest ``flint.prefetch`` of ``fn``'s ops (0: nothing prefetched)."""
    key = ("prefetch", id(fn))
    if cache is not None and key in cache:
        return cache[key][1]
    k = max((dist.prefetch_of(op) for op in fn.body.block.ops), default=0)
    if cache is not None:
        cache[key] = (fn, k)
    return k


def kept_gather_ops(fn: func.FuncOp, axes: frozenset[int], cache: dict | None = None) -> frozenset[Operation]:
    """What a run of ``fn`` whose parameters are still gathered skips (a schedule entry's ``nogather``):
    every FSDP parameter all-gather over grid axes within ``axes``, with its copy-in (the ops computing its
    input from parameters only) and its wait and copy-out (views and ``split_with_sizes_copy`` of the
    gathered buffer), as FSDP2's ``unshard`` of an already unsharded group does nothing."""
    if not axes:
        return frozenset()
    key = ("kept", id(fn), axes)
    if cache is not None and key in cache:
        return cache[key][1]
    from flint.passes.reorder_all_gather import parameter_gather_slice

    out: set[Operation] = set()
    for op in fn.body.block.ops:
        if not isinstance(op, dist.AllGatherOp) or op.group_size() == 1 or not set(op.axes()) <= axes:
            continue
        copy_in = parameter_gather_slice(op, fn)
        if copy_in is None:
            continue
        out.update(copy_in)
        out.add(op)
        todo = [op.result]
        while todo:
            for use in todo.pop().uses:
                u = use.operation
                if u not in out and (isinstance(u, dist.WaitOp) or isinstance(u, AtenOp) and (
                        classify_target(u.overload) == VIEW
                        or split_target(u.overload)[1] == "split_with_sizes_copy")):
                    out.add(u)
                    todo.extend(u.results)
    kept = frozenset(out)
    if cache is not None:
        cache[key] = (fn, kept)
    return kept


def _has_phase(fn: func.FuncOp, phase: str, cache: dict) -> bool:
    """Whether ``fn`` has an `aten` op of ``phase`` (``cache``: per lowering, by function)."""
    key = ("phase", id(fn), phase)
    if key not in cache:
        cache[key] = (fn, any(isinstance(o, AtenOp) and o.phase is not None and o.phase.data == phase
                              for o in fn.body.block.ops))
    return cache[key][1]


def gather_chain(funcs: dict[str, func.FuncOp], entries: list[tuple[str, int, dict]],
                 cache: dict | None = None) -> dict[int, list[int]]:
    """A pipelined schedule's gather chain: for each forward run that gathers (an entry run once, without
    ``nogather``, whose function has ops marked ``flint.prefetch = K``), the K such runs after it, whose
    gathers it issues before its own ops. Megatron-LM's parameter gathers are numbered across model
    chunks and each module's forward pre-hook waits for its gather and dispatches the next. A backward's
    gathers (ZeRO-3) are not in the chain: FSDP2 issues them in the pre-backward hook, once the gradient
    has arrived. The lowering and the memory model (:mod:`flint.sim.lifetimes`) both read it."""
    cache = {} if cache is None else cache
    chain = [e for e, (name, count, o) in enumerate(entries)
             if count == 1 and not o.get("nogather") and prefetch_mark(funcs[name], cache)
             and not _has_phase(funcs[name], "bwd", cache)]
    return {e: chain[i + 1:i + 1 + prefetch_mark(funcs[entries[e][0]], cache)] for i, e in enumerate(chain)}


def _is_grad_sync(node: SSAValue, dp_axes: frozenset[int]) -> bool:
    """A gradient reduction's node: a reduce-scatter or all-reduce over data-parallel axes only (a repeat's
    result: the node its body yields there)."""
    op = node.owner
    while isinstance(op, chakra.RepeatOp) and isinstance(node, OpResult):
        node = op.body.block.last_op.operands[node.index]
        op = node.owner
    return (isinstance(op, chakra.CollOp) and op.kind.data in (chakra.CollKind.REDUCE_SCATTER, chakra.CollKind.ALL_REDUCE)
            and bool(op.axes()) and set(op.axes()) <= dp_axes)


def prefetched_ops(fn: func.FuncOp) -> list[Operation]:
    return [op for op in fn.body.block.ops if dist.prefetch_of(op) > 0]


class _FunctionLowering:
    """Lowers one `func.func` body into chakra nodes appended to ``block``.

    ``mode`` says what to do with ops marked ``flint.prefetch``: ``all``
    lowers them in place like any op; ``prologue`` lowers only them;
    ``steady`` lowers them too, but their collectives' results are the nodes
    issued ``K`` iterations ago (``slots``), and the nodes issued now are
    collected in ``issued``; ``tail`` skips them (nothing left to prefetch).
    """

    def __init__(self, fn: func.FuncOp, block: Block, device: Device, streams: _Streams, merge: bool = False,
                 mode: str = ALL, slots: list[SSAValue] | None = None, tag_offset: int = 0,
                 nosync_axes: frozenset[int] = frozenset(), costs: dict | None = None,
                 nogather_axes: frozenset[int] = frozenset(), post: bool = False, class_times: bool = False):
        self.fn, self.block, self.device, self.s, self.merge = fn, block, device, streams, merge
        self.class_times = class_times  # record per op class what each compute node holds (class-times)
        self.mode = mode
        # From the schedule entry (pipeline-split): added to send/recv tags; data-parallel
        # axes whose gradient reduce-scatters / all-reduces this run skips (accumulation).
        self.tag_offset, self.nosync_axes = tag_offset, nosync_axes
        # ... and whose parameter all-gathers it skips, with their copy-in and copy-out (parameters kept
        # gathered from the step's first microbatch)
        self.nogather_axes = nogather_axes
        self.kept = kept_gather_ops(fn, nogather_axes, costs)
        # From the schedule entry's ``post`` (pipeline-split, p2p = blocking): recvs are issued after the
        # compute before them (torch issues a recv's kernel behind the compute queued before it).
        self.post = post
        # op -> (flops, bytes, duration): a function run from many schedule entries is costed once.
        self.costs = costs if costs is not None else {}
        self.issued: list[SSAValue] = []
        self.issued_ops: list[Operation] = []  # the op each issued node lowers
        self.producer: dict[SSAValue, tuple[SSAValue, ...]] = {}
        # A buffer written piecewise (`aten.slice_scatter` of a decomposed collective): its producers per
        # element range [lo, hi), so a slice depends on what wrote that range only, as the unrolled steps do.
        # (starts, ends, producers) of consecutive ranges, sorted
        self.pieces: dict[SSAValue, tuple[list[int], list[int], list[tuple[SSAValue, ...]]]] = {}
        self.step = 0  # the step of the `dist.steps` being expanded (0 outside one)
        self.comm_nodes: set[SSAValue] = set()
        # Sends and recvs are ordered among themselves, not with each other or with
        # collectives: "send to +1; recv from -1" on every rank must not deadlock.
        self.last_p2p: dict[tuple[type, str], SSAValue] = {}  # last send / recv node per (kind, stream)
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
        self.prefetched = set(prefetched_ops(fn)) if mode != ALL else set()
        if mode in (STEADY, TAIL):
            starts = [op for op in fn.body.block.ops if op in self.prefetched and isinstance(op, dist.CollectiveOp)]
            for op, node in zip(starts, slots or ()):
                self.comm_nodes.add(node)
                self.producer[op.result] = (node,)

    def deps_of(self, values) -> list[SSAValue]:
        seen: dict[SSAValue, None] = {}
        for v in values:
            pieces = self.pieces.get(v)
            for nodes in (pieces[2] if pieces is not None else [self.producer.get(v, ())]):
                for node in nodes:
                    seen[node] = None
        return list(seen)

    def _bind(self, dst: SSAValue, src: SSAValue) -> None:
        """``dst`` holds what ``src`` holds (a `dist.steps` carried value)."""
        if src in self.pieces:
            self.pieces[dst] = self.pieces[src]
        else:
            self.pieces.pop(dst, None)
            self.producer[dst] = tuple(self.producer.get(src, ()))

    def _piecewise_view(self, op: AtenOp) -> bool:
        """Track a dim-0 slice / slice_scatter of a 1-D buffer range by range; False if ``op`` is not one."""
        target = op.overload
        if target not in ("aten.slice.Tensor", "aten.slice_scatter.default") or op.args is None:
            return False
        args = op.args.data
        if args.get("dim") is None or args["dim"].value.data != 0 or len(op.outputs) != 1:
            return False
        buf = op.inputs[0]
        if not isinstance(buf.type, TensorType) or len(buf.type.get_shape()) != 1:
            return False
        lo, hi = dist.step_slice(op, args["start"].value.data, args["end"].value.data, self.step)
        pieces = self.pieces.get(buf)
        if target == "aten.slice.Tensor":
            if pieces is None:
                return False
            starts, ends, nodes = pieces
            seen: dict[SSAValue, None] = {}
            for k in range(bisect_right(ends, lo), bisect_left(starts, hi)):
                seen.update(dict.fromkeys(nodes[k]))
            self.producer[op.outputs[0]] = tuple(seen)
            return True
        if pieces is None:
            pieces = ([0], [buf.type.get_shape()[0]], [tuple(self.deps_of([buf]))])
        starts, ends, nodes = pieces
        src = tuple(self.deps_of([op.inputs[1]]))
        i, j = bisect_right(ends, lo), bisect_left(starts, hi)  # pieces i..j-1 overlap [lo, hi)
        s_mid, e_mid, n_mid = [lo], [hi], [src]
        if i < j and starts[i] < lo:
            s_mid.insert(0, starts[i]), e_mid.insert(0, lo), n_mid.insert(0, nodes[i])
        if i < j and ends[j - 1] > hi:
            s_mid.append(hi), e_mid.append(ends[j - 1]), n_mid.append(nodes[j - 1])
        self.pieces[op.outputs[0]] = (starts[:i] + s_mid + starts[j:], ends[:i] + e_mid + ends[j:],
                                      nodes[:i] + n_mid + nodes[j:])
        return True

    def lower_steps(self, op: dist.StepsOp) -> None:
        """Expand a `dist.steps` step by step (Chakra nodes are concrete)."""
        block = op.body.block
        carried = list(op.inits)
        sends: list[SSAValue] = []
        for i in range(op.count.value.data):
            self.step = i
            for arg, v in zip(block.args, carried):
                self._bind(arg, v)
            for o in block.ops:
                if isinstance(o, dist.YieldOp):
                    carried = list(o.values)
                    break
                self.lower_op(o)
                if isinstance(o, dist.SendOp) and o.token is not None:
                    sends += self.producer.get(o.token, ())
        self.step = 0
        for out, v in zip(op.outs, carried):
            self._bind(out, v)
        self.producer[op.token] = tuple(sends)

    def _add(self, node: chakra.NodeOp) -> SSAValue:
        self.block.add_op(node)
        return node.node

    def _order(self, data: list[SSAValue], prev: SSAValue | None, extra: list[SSAValue] = ()) -> list[SSAValue]:
        ctrl = [] if prev is None or prev in data else [prev]
        ctrl += [e for e in extra if e not in data and e not in ctrl]
        return ctrl

    def lower(self) -> None:
        block = self.fn.body.block
        # in a steady iteration, a prefetched op with an issue point (flint.prefetch_at) is issued right before
        # it: a block's next first group is gathered when its last group starts
        points = dist.prefetch_points(block) if self.mode == STEADY else {}
        deferred: dict[Operation, list[Operation]] = {}
        seen: set[Operation] = set()
        for op in block.ops:
            seen.add(op)
            for early in deferred.pop(op, ()):
                self.lower_op(early)
            if op in self.prefetched:
                if op in points and points[op] not in seen:
                    deferred.setdefault(points[op], []).append(op)
                elif self.mode in (PROLOGUE, STEADY):
                    self.lower_op(op)
            elif self.mode != PROLOGUE:
                self.lower_op(op)
        if self.issued:  # in the order of their ops in the body, as the slots that carry them are
            pos = {o: i for i, o in enumerate(block.ops)}
            order = sorted(range(len(self.issued)), key=lambda i: pos[self.issued_ops[i]])
            self.issued = [self.issued[i] for i in order]

    def lower_op(self, op: Operation) -> None:
        if isinstance(op, func.ReturnOp):
            return
        if op in self.kept:  # the parameters are still gathered: nothing to gather, copy in or copy out
            for r in op.results:
                self.producer[r] = ()
            return
        if isinstance(op, AtenOp):
            return self.lower_aten(op)
        if isinstance(op, dist.CollectiveOp):
            return self.lower_collective(op)
        if isinstance(op, dist.BarrierOp):
            return self.lower_barrier(op)
        if isinstance(op, dist.SendOp | dist.RecvOp):
            return self.lower_p2p(op)
        if isinstance(op, dist.StepsOp):
            return self.lower_steps(op)
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
        if flops == 0 and nbytes == 0 and self._piecewise_view(op):  # a slice of a buffer written piecewise
            return
        data = self.deps_of(op.inputs)
        if flops == 0 and nbytes == 0:  # a view: no kernel, results alias the inputs
            for r in op.outputs:
                self.producer[r] = tuple(data)
            return
        comm_deps = {d for d in data if d in self.comm_nodes}
        masked = {k: v for k, v in op.attributes.items() if k in ACTIVE_ATTRS}
        side = dist.stream_of(op)
        if side:  # a decomposed collective's reduction: in its channel's order, not the compute stream's
            comp = chakra.CompOp(op.overload, flops=flops, bytes=nbytes, duration_us=round(duration, 6),
                                 data_deps=data, ctrl_deps=self._order(data, self.last_p2p.get((AtenOp, side))))
            comp.attributes.update(masked)
            comp.attributes[dist.STREAM_ATTR] = StringAttr(side)
            if self.class_times:
                add_class_times(comp, op, duration, flops, nbytes, side)
            node = self.last_p2p[(AtenOp, side)] = self._add(comp)
            for r in op.outputs:
                self.producer[r] = (node,)
            return
        if self.merge and self.run is not None and not self.s.blocking and comm_deps <= self.run[1] and not masked:
            self._merge(op, flops, nbytes, duration)
            node = self.s.compute
        else:
            ctrl = self._order(data, self.s.compute, self.s.blocking)
            comp = chakra.CompOp(op.overload, flops=flops, bytes=nbytes, duration_us=round(duration, 6),
                                 data_deps=data, ctrl_deps=ctrl)
            comp.attributes.update(masked)
            if self.class_times:
                add_class_times(comp, op, duration, flops, nbytes)
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
        if self.class_times:
            add_class_times(comp, op, duration, flops, nbytes)
        self.run = (comp, comm_deps, n + 1)

    def _comm_node(self, node: chakra.NodeOp, result: SSAValue | None, is_async: bool, p2p: bool = False) -> None:
        node = self._add(node)
        self.comm_nodes.add(node)
        self.run = None  # a later compute node must not run before this comm node is issued
        if result is not None and result.owner in self.prefetched and self.mode in (PROLOGUE, STEADY):
            self.issued.append(node)  # for a later iteration: its wait names the slot instead
            self.issued_ops.append(result.owner)
            return
        if result is not None:
            self.producer[result] = (node,)
        if not is_async:
            self.s.blocking.append(node)  # a synchronous op blocks the compute stream too

    def _spmd(self, op: dist.DistCommOp) -> dict:
        return {"grid": FlatSymbolRefAttr(op.grid.root_reference), "grid_axes": op.grid_axes}

    def _coll_ctrl(self, op: dist.DistCommOp, data: list[SSAValue], stream: str) -> list[SSAValue]:
        """Ctrl deps of a collective: its stream's order, its communicator's order, and its issue point."""
        extra = [v for v in (self.s.group.get(_group_key(op)), self.s.compute) if v is not None]
        return self._order(data, self.s.comm.get(stream), extra)

    def _chain(self, op: dist.DistCommOp, stream: str, node: chakra.NodeOp) -> None:
        self.s.comm[stream] = node.node
        self.s.group[_group_key(op)] = node.node

    def lower_collective(self, op: dist.CollectiveOp) -> None:
        data = self.deps_of([op.input])
        skip = (self.nosync_axes and isinstance(op, dist.ReduceScatterOp | dist.AllReduceOp)
                and set(op.axes()) <= self.nosync_axes)
        if op.group_size() == 1 or skip:  # nothing moves (or: gradient accumulation without sync)
            self.producer[op.result] = tuple(data)
            return
        kind = _COLL_KIND[type(op)]
        stream = dist.stream_of(op)
        props = {"kind": chakra.CollKindAttr(kind), "node_name": StringAttr(op.name),
                 "bytes": IntegerAttr(_bytes_of(op.input), i64), **self._spmd(op)}
        if stream:
            props["stream"] = StringAttr(stream)
        node = chakra.CollOp.build(operands=[data, self._coll_ctrl(op, data, stream)], result_types=[chakra.NODE],
                                   properties=props)
        self._comm_node(node, op.result, op.is_async)
        self._chain(op, stream, node)

    def lower_barrier(self, op: dist.BarrierOp) -> None:
        if op.group_size() == 1:
            if op.token is not None:
                self.producer[op.token] = ()
            return
        node = chakra.CollOp.build(
            operands=[[], self._coll_ctrl(op, [], "")], result_types=[chakra.NODE],
            properties={"kind": chakra.CollKindAttr(chakra.CollKind.ALL_REDUCE), "node_name": StringAttr(op.name),
                        "bytes": IntegerAttr(BARRIER_BYTES, i64), **self._spmd(op)},
        )
        self._comm_node(node, op.token, op.token is not None)
        self._chain(op, "", node)

    def lower_p2p(self, op: dist.SendOp | dist.RecvOp) -> None:
        is_send = isinstance(op, dist.SendOp)
        data = self.deps_of([op.input]) if is_send else []
        cls = chakra.SendOp if is_send else chakra.RecvOp
        nbytes = _bytes_of(op.input if is_send else op.result)
        stream = dist.stream_of(op)
        sms = dist.sms_of(op) if is_send else 0
        after = [self.s.compute] if self.post and not is_send and self.s.compute is not None else []
        node = cls.build(
            operands=[data, self._order(data, self.last_p2p.get((cls, stream)), after)], result_types=[chakra.NODE],
            properties={"node_name": StringAttr(op.name), "bytes": IntegerAttr(nbytes, i64),
                        "tag": IntegerAttr(op.tag_at(self.step) + self.tag_offset, op.tag.type),
                        "offset": IntegerAttr(op.offset_at(self.step), op.offset.type), **self._spmd(op),
                        **({"peers": op.peers} if op.peers is not None else {}),
                        **({"stream": StringAttr(stream)} if stream else {}),
                        **({"sms": IntegerAttr(sms, i64)} if sms else {})},
        )
        if dist.WHERE_ATTR in op.attributes:
            node.attributes[dist.WHERE_ATTR] = op.attributes[dist.WHERE_ATTR]
        result = op.token if is_send else op.result
        # a recv on a channel is part of a decomposed asynchronous collective: what needs its data waits
        # through data deps, the compute stream does not
        self._comm_node(node, result, bool(stream) or (isinstance(result.type, dist.FutureType)
                                                        if result is not None else False), p2p=True)
        self.last_p2p[(cls, stream)] = node.node


def _copy_ops(ops, block: Block, mapper: dict, tag_shift: int = 0) -> None:
    """Append copies of ``ops`` (without regions; operands defined before use) to ``block`` in one pass, each
    created with its operands mapped through ``mapper``, which gains the results (xDSL's ``clone`` creates
    every op, then sets its operands again). ``tag_shift`` moves the tags of Chakra sends and recvs."""
    get = mapper.get
    for o in ops:
        props = o.properties.copy()
        if tag_shift and isinstance(o, chakra.SendOp | chakra.RecvOp):
            props["tag"] = IntegerAttr(o.tag.value.data + tag_shift, o.tag.type)
        new = o.create(operands=[get(v, v) for v in o.operands], result_types=o.result_types,
                       properties=props, attributes=o.attributes.copy())
        mapper.update(zip(o.results, new.results))
        block.add_op(new)


def _clone_body(region: Region) -> Region:
    """``region.clone()`` for a repeat body of node ops, in one pass (:func:`_copy_ops`)."""
    old = region.block
    if any(o.regions for o in old.ops):
        return region.clone()
    body = Block(arg_types=old.arg_types)
    _copy_ops(old.ops, body, dict(zip(old.args, body.args)))
    return Region(body)


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

    ``grad-wait`` says where the compute stream waits for a gradient
    reduction that a part leaves unwaited at its end (a data-parallel
    reduce-scatter or all-reduce, over the plan's data-parallel axes only,
    whose value only leaves the function for the optimizer):
    ``part`` (default) at the next part's first compute node, as the wait's
    place in the program says; ``optimizer`` at the optimizer's first compute node
    (the first part with ``optim`` ops), as Megatron-LM's ``finish_grad_sync``
    waits for every bucket's reduction before the optimizer step and FSDP2's
    final post-backward callback waits for the last reduce-scatter. Either
    way the reductions keep their stream's and communicator's order. (How
    often gradients are reduced is the plan's ``grad_sync``, a capture and
    ``pipeline-split`` choice; this option only places the wait.)

    The `func.func`s are replaced by the graph; the grid stays. Options:
    ``device`` (preset name or TOML path, default ``h100-sxm``),
    ``merge-compute`` (default true), ``grad-wait`` (``part`` or ``optimizer``), ``class-times``
    (default false: when true, every compute node also carries ``flint.class_times``, its kernels' time,
    FLOPs, bytes and count per op class, for ``flint estimate``'s breakdown: :mod:`flint.sim.breakdown`).
    """

    name = "lower-to-chakra"

    device: str = "h100-sxm"
    merge_compute: bool = True
    grad_wait: str = "part"
    class_times: bool = False

    def __post_init__(self) -> None:
        if self.grad_wait not in GRAD_WAIT:
            raise FlintError(f"{self.name}: option grad-wait=\"{self.grad_wait}\" is not one of "
                             f"{', '.join(GRAD_WAIT)}")

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        device = load_device(self.device)
        dp_axes = data_parallel_axes(op) if self.grad_wait == "optimizer" else frozenset()
        funcs = {f.sym_name.data: f for f in op.ops if isinstance(f, func.FuncOp)}
        if not funcs:
            raise VerifyException("lower-to-chakra: the module has no func.func to lower")
        roles = stage_roles(op)
        pipelined = "flint.pipeline" in op.attributes
        axis_index = {}
        if roles > 1 or "flint.stage_schedules" in op.attributes:
            from flint.chakra.from_ir import mesh_of

            axis_index = {n: i for i, n in enumerate(mesh_of(op).axis_names)}
        costs: dict = {}
        # A function repeated from many schedule entries (a pipeline's microbatches) lowers to the
        # same body each time: build it once, clone it after.
        bodies: dict | None = {} if pipelined else None
        flats: dict = {}  # a pipeline's flat runs already lowered, to clone (_flat)
        graphs = [self._lower_schedule(funcs, get_schedule_entries(op, role), device, axis_index, costs, bodies,
                                       pipelined, flats, dp_axes) for role in range(roles)]
        for f in funcs.values():
            op.body.block.erase_op(f)
        op.attributes.pop("flint.schedule", None)
        op.attributes.pop("flint.stage_schedules", None)
        for role, graph_block in enumerate(graphs):
            # A pipelined step: one graph per pipeline rank (its role), named step_pp<rank>.
            name = "step" if not pipelined else f"step_pp{role}"
            op.body.block.add_op(chakra.GraphOp.create(properties={"sym_name": StringAttr(name)},
                                                       regions=[Region(graph_block)]))

    def _lower_schedule(self, funcs: dict[str, func.FuncOp], entries: list[tuple[str, int, dict]], device: Device,
                        axis_index: dict[str, int], costs: dict, bodies: dict | None, pipelined: bool,
                        flats: dict | None = None, dp_axes: frozenset[int] = frozenset()) -> Block:
        """One rank role's schedule (``[(function, count, options)]``) as one graph body; ``dp_axes``:
        ``grad-wait=optimizer``'s data-parallel axes (empty: ``part``)."""
        graph_block = Block()
        s = _Streams(compute=None, comm={}, boundary=None)
        merge = self.merge_compute
        # an entry that skips its parameter gathers (nogather) has nothing to prefetch
        depth = [0 if o.get("nogather") else prefetch_depth(funcs[name], count, costs) for name, count, o in entries]
        # ahead[e]: the entries whose prefetched ops entry e issues before its own ops
        ahead: dict[int, list[int]] = {e: [e + 1] for e in range(len(entries) - 1)
                                       if depth[e + 1] and entries[e][1] == 1}
        if pipelined:  # each function runs once per entry: the forward gathering runs are one chain
            for e, later in gather_chain(funcs, entries, costs).items():
                depth[e] = 1  # its own gathers: one prefetched set, issued by an earlier run (or itself)
                ahead[e] = later
        slots: dict[int, list[list[SSAValue]]] = {}

        def extra_of(e: int) -> dict:
            options = entries[e][2]
            return {"tag_offset": options.get("tag", 0), "costs": costs, "class_times": self.class_times,
                    "nosync_axes": frozenset(axis_index[a] for a in options.get("nosync", ()) if a in axis_index),
                    "nogather_axes": frozenset(axis_index[a] for a in options.get("nogather", ()) if a in axis_index),
                    **({"post": True} if options.get("post") else {})}

        def prologue(e: int) -> None:
            # Iterations 0..K-1 of entry e issue their prefetched ops here, in order.
            fn = funcs[entries[e][0]]
            sets = []
            for _ in range(depth[e]):
                low = _FunctionLowering(fn, graph_block, device, s, merge, PROLOGUE, **extra_of(e))
                low.lower()
                sets.append(low.issued)
            slots[e] = sets

        posted: dict[int, SSAValue] = {}  # tag -> an asynchronous recv's node not waited for yet
        deferred: list[SSAValue] = []  # grad-wait=optimizer: gradient reductions the optimizer waits for
        for e, (name, count, options) in enumerate(entries):
            fn = funcs[name]
            if dp_axes:  # what the previous part left unwaited: its gradient reductions wait for the optimizer
                deferred += [v for v in s.blocking if _is_grad_sync(v, dp_axes)]
                s.blocking = [v for v in s.blocking if not _is_grad_sync(v, dp_axes)]
                if deferred and _has_phase(fn, "optim", costs):
                    s.blocking += deferred
                    deferred = []
            extra = extra_of(e)
            for t in options.get("wait", ()):  # the entry's first compute waits for these recvs
                if t not in posted:
                    raise VerifyException(f"lower-to-chakra: @{name} waits for the recv with tag {t}, which no "
                                          "earlier schedule entry posts asynchronously")
                s.blocking.append(posted.pop(t))
            if depth[e] and e not in slots:  # nothing issued it earlier: its own gathers first
                prologue(e)
            for later in ahead.get(e, ()):  # "K blocks ahead" reaches into the preceding part
                if later not in slots:
                    prologue(later)
            if depth[e]:
                k = depth[e]
                carried = slots[e]
                if count > k:
                    carried = self._repeat(fn, count - k, graph_block, device, s, merge, STEADY, carried,
                                           pipelined=pipelined, **extra)
                self._repeat(fn, k, graph_block, device, s, merge, TAIL, carried, pipelined=pipelined, **extra)
                continue
            if s.compute is None and not s.comm or pipelined and count == 1:
                # Nothing to carry yet (or a pipeline's single run): one iteration flat, the rest as a repeat.
                recv = self._flat(fn, graph_block, device, s, merge, extra, "tag" in options,
                                  flats if pipelined else None)
                if recv is not None:
                    posted[options["tag"]] = recv
                s.boundary = s.compute
                count -= 1
                if count == 0:
                    continue
            self._repeat(fn, count, graph_block, device, s, merge, pipelined=pipelined, bodies=bodies, **extra)
        return graph_block

    # Clone a pipelined schedule's flat runs of a function from its first run with the same inputs (``_flat``);
    # False: lower every run (the reference the clones are tested against).
    reuse_flat_runs = True

    def _flat(self, fn: func.FuncOp, block: Block, device: Device, s: _Streams, merge: bool, extra: dict,
              tagged: bool, cache: dict | None) -> SSAValue | None:
        """Lower one run of ``fn`` flat into ``block``; returns its asynchronous recv's node (``tagged``), if any.

        A pipeline's schedule runs one function from hundreds of entries (one per microbatch and
        virtual stage). What a run emits is a function of the function, the entry's options and the
        nodes it starts from (the streams' chain ends, the boundary, the nodes it is blocked on): the
        lowering reads nothing else, and decides only by which of those nodes are the same. So with
        ``cache``, a run whose starting nodes have the same pattern of equalities as an earlier run's
        clones the earlier run's nodes with the starting nodes substituted (and its sends' and recvs' tags
        moved by the difference of the entries' tag offsets), instead of lowering the function's ops again:
        the same nodes, dependencies and end state, op for op.
        """
        names = (tuple(sorted(s.comm)), tuple(sorted(s.group, key=str)))
        ext = [s.compute, *(s.comm[k] for k in names[0]), *(s.group[k] for k in names[1]), s.boundary, *s.blocking]
        first: dict[SSAValue, int] = {}
        pattern = tuple(-1 if v is None else first.setdefault(v, i) for i, v in enumerate(ext))
        # the entry's tag offset only adds to the tags of the run's sends and recvs
        offset = extra.get("tag_offset", 0)
        key = (fn.sym_name.data, extra.get("nosync_axes", frozenset()), extra.get("nogather_axes", frozenset()),
               extra.get("post", False), merge, tagged, names, len(s.blocking), pattern)
        hit = cache.get(key) if cache is not None and self.reuse_flat_runs else None
        if hit is not None:
            t_ext, ops, end, t_offset = hit
            mapper = {a: b for a, b in zip(t_ext, ext) if a is not None}
            _copy_ops(ops, block, mapper, offset - t_offset)
            compute, comm, group, blocking, recv = end
            s.compute = None if compute is None else mapper.get(compute, compute)
            s.comm = {k: mapper.get(v, v) for k, v in comm.items()}
            s.group = {k: mapper.get(v, v) for k, v in group.items()}
            s.blocking = [mapper.get(v, v) for v in blocking]
            return None if recv is None else mapper.get(recv, recv)
        last = block.last_op
        low = _FunctionLowering(fn, block, device, s, merge, **extra)
        low.lower()
        recv = None
        if tagged:
            for r in fn.body.block.ops:
                if isinstance(r, dist.RecvOp) and r.is_async:
                    recv = low.producer[r.result][0]
        if cache is not None:
            ops = []
            o = block.first_op if last is None else last.next_op
            while o is not None:
                ops.append(o)
                o = o.next_op
            # only the starting nodes come from outside the run (else: no template, lower every time)
            inside = {r for o in ops for r in o.results} | {v for v in ext if v is not None}
            if all(v in inside for o in ops for v in o.operands) and all(
                    isinstance(o, chakra.NodeOp) and len(o.results) == 1 and not o.regions for o in ops):
                cache[key] = (ext, ops, (s.compute, dict(s.comm), dict(s.group), list(s.blocking), recv), offset)
        return recv

    @staticmethod
    def _repeat(fn: func.FuncOp, count: int, outer: Block, device: Device, s: _Streams, merge: bool,
                mode: str = ALL, slots: list[list[SSAValue]] | None = None, pipelined: bool = False,
                bodies: dict | None = None, **extra) -> list[list[SSAValue]]:
        """Lower ``fn`` as ``chakra.repeat count``; returns the prefetch slots it carries out.

        The repeat carries the end of every chain (compute, each stream, each
        communicator) and, with prefetch depth K, K sets of prefetched nodes:
        an iteration consumes the oldest set and appends what it issues (a
        ``tail`` iteration issues nothing and repeats its newest set). What
        the compute stream is blocked on before the repeat (a synchronous recv
        in a pipeline, a wait left at the end of the previous part) gates its
        first compute node: it is carried in and passed through unchanged. ``bodies`` caches
        lowered bodies by everything that shapes them (a pipeline runs one
        function from many schedule entries).
        """
        streams, groups = _chain_keys(fn, extra.get("costs"))
        for k in streams:  # a chain first used inside the body starts at the issue point
            if k not in s.comm and s.compute is not None:
                s.comm[k] = s.compute
        for g in groups:
            if g not in s.group and s.compute is not None:
                s.group[g] = s.compute
        chains = s.carried()
        slots = slots or []
        flat = [v for sl in slots for v in sl]
        pending = list(s.blocking)
        width = len(slots[0]) if slots else 0
        operands = [v for _, v in chains] + flat + pending
        key = (fn.sym_name.data, extra.get("tag_offset", 0), extra.get("nosync_axes", frozenset()),
               extra.get("nogather_axes", frozenset()), tuple(k for k, _ in chains), len(pending), mode, width,
               len(slots))
        if bodies is not None and key in bodies:
            cached, ends_blocked = bodies[key]
            region = _clone_body(cached) if LowerToChakraPass.reuse_flat_runs else cached.clone()
        else:
            body = Block(arg_types=[chakra.NODE] * len(operands))
            args = list(body.args)
            inner = _Streams(compute=None, comm={}, boundary=None)
            for (k, _), a in zip(chains, args):
                inner.set(k, a)
            inner.boundary = inner.compute
            slot_args = [args[len(chains) + i * width: len(chains) + (i + 1) * width] for i in range(len(slots))]
            passthrough = args[len(chains) + len(flat):]
            inner.blocking = list(passthrough)
            low = _FunctionLowering(fn, body, device, inner, merge, mode, slot_args[0] if slot_args else None, **extra)
            low.lower()
            yielded = []
            for k, _ in chains:
                yielded.append(inner.compute if k[0] == "c" else inner.comm[k[1]] if k[0] == "s" else inner.group[k[1:]])
            if slot_args:
                newest = low.issued if mode == STEADY else slot_args[-1]
                if len(newest) != width:
                    raise LoweringError(fn, f"lower-to-chakra: @{fn.sym_name.data} issues {len(newest)} prefetched "
                                            f"collectives per iteration but carries {width}")
                for sl in slot_args[1:] + [newest]:
                    yielded += sl
            yielded += passthrough
            body.add_op(chakra.YieldOp.build(operands=[yielded]))
            region = Region(body)
            ends_blocked = bool(inner.blocking) and inner.blocking != passthrough
            if bodies is not None:
                bodies[key] = (region.clone(), ends_blocked)
        rep = chakra.RepeatOp(count, operands, region)
        outer.add_op(rep)
        outs = list(rep.outs)
        for (k, _), v in zip(chains, outs):
            s.set(k, v)
        s.boundary = s.compute
        # A wait left at the end of the body (e.g. a sunk reduce-scatter wait) is waited for by
        # the next part's first compute node: the last node of every stream the body used.
        s.blocking = [s.comm[k] for k in sorted(streams)] if ends_blocked else []
        rest = outs[len(chains):len(chains) + len(flat)]
        return [rest[i * width:(i + 1) * width] for i in range(len(slots))]
