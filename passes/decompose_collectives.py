"""`decompose-collectives`: rewrite `dist` collectives into SPMD send/recv steps."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import (
    ArrayAttr,
    DenseArrayBase,
    FlatSymbolRefAttr,
    FloatAttr,
    IntegerAttr,
    ModuleOp,
    NoneType,
    StringAttr,
    TensorType,
    f64,
    i64,
)
from xdsl.ir import Block, Operation, Region, SSAValue
from xdsl.passes import ModulePass
from xdsl.rewriter import InsertPoint, Rewriter
from xdsl.utils.exceptions import VerifyException

from flint.collectives.schedule import ALGORITHMS, Schedule, UnsupportedAlgorithm, build, supported
from flint.errors import FlintError
from flint.ir import dist
from flint.ir.aten import AtenOp
from flint.ir.dist import axes_attr, grid_shape

KIND_OF = {
    dist.AllReduceOp: "all_reduce",
    dist.AllGatherOp: "all_gather",
    dist.ReduceScatterOp: "reduce_scatter",
    dist.AllToAllOp: "all_to_all",
    dist.BroadcastOp: "broadcast",
}
_FREE = {"flops": IntegerAttr(0, i64), "bytes": IntegerAttr(0, i64), "duration_us": FloatAttr(0.0, f64)}


class DecomposeError(VerifyException):
    """A `decompose-collectives` failure; ``op`` is the collective."""

    def __init__(self, op: Operation, message: str):
        super().__init__(message)
        self.op = op


def choose_algorithm(kind: str, sizes: tuple[int, ...], input_bytes: int, members: list[int], network, world: int,
                     ) -> tuple[str, dict[str, float]]:
    """The cheapest algorithm for one collective by the one cost formula (:func:`flint.cost.collective_time_us`).

    ``members`` are the group's ranks (for the network levels it spans). Returns the choice and the
    time of every algorithm that can run it.
    """
    from flint.cost import collective_time_us

    net = network.for_world(world)
    levels = net.group_levels(members)
    n = math.prod(sizes)
    times = {}
    for alg in ALGORITHMS:
        if supported(alg, kind, sizes) is not None:
            continue
        if alg == "hierarchical":  # ring on each level, inner first
            priced = "ring"
        else:
            priced = alg
        try:
            times[alg] = collective_time_us(kind, input_bytes, n, levels, priced)
        except FlintError:
            continue
    best = min(times, key=lambda a: (times[a], ALGORITHMS.index(a)))
    return best, times


class _Emitter:
    """Emits one collective's schedule before ``op`` and returns the value replacing its result."""

    def __init__(self, op: dist.CollectiveOp, sched: Schedule, tag_base: int, channels: int = 1,
                 asynchronous: bool = False, loops: bool = True):
        self.op, self.s, self.tag_base, self.channels = op, sched, tag_base, channels
        self.loops = loops
        self.shapes: dict = {}  # id(action) -> its slot runs (see _shape_of)
        self.asynchronous = asynchronous
        self.side: str | None = None  # the channel the current step's kernels run on (asynchronous only)
        self.tail = 0  # self.new[tail:] (the waits and the result) go where the collective's wait was
        self.lanes = 1 + max((a.lane for a in sched.actions), default=0)
        self.new: list[Operation] = []
        self.pending: list[SSAValue] = []
        in_t = op.input.type
        assert isinstance(in_t, TensorType)
        self.et = in_t.element_type
        numel_in = math.prod(in_t.get_shape())
        full = numel_in * (sched.n if sched.kind == "all_gather" else 1)
        self.unit = -(-full // sched.units)
        self.axes = op.axes()
        self.grid = op.grid.root_reference.data
        self.name = f"{sched.algorithm}/{sched.kind}"
        self.rep = tuple(0 for _ in sched.sizes)  # the representative coordinates (schedules are shift-invariant)
        flat = self.aten("aten.view.default", [op.input], numel_in, free=True, args={"size": [numel_in]})
        if sched.kind in ("all_reduce", "reduce_scatter", "broadcast"):
            keys = [(b, j) for b in range(sched.blocks) for j in range(sched.chunks)]
        elif sched.kind == "all_gather":
            keys = [(0, j) for j in range(sched.chunks)]
        else:
            keys = [(0, d, j) for d in range(sched.n) for j in range(sched.chunks)]
        self.prod: dict[tuple, tuple[SSAValue, int]] = {k: (flat, i) for i, k in enumerate(keys)}

    def ttype(self, units: int) -> TensorType:
        return TensorType(self.et, [units * self.unit])

    def aten(self, target: str, inputs, units: int | None, *, free: bool = False, args=None, mask=None,
             result_type=None, stream: str | None = None) -> SSAValue:
        rt = result_type if result_type is not None else TensorType(self.et, [units])
        a = None
        if args:
            a = {k: ArrayAttr([IntegerAttr(x, i64) for x in v]) if isinstance(v, list) else IntegerAttr(v, i64)
                 for k, v in args.items()}
        op = AtenOp(target, inputs, [rt], args=a, phase=self._phase())
        op.attributes["flint.collective"] = StringAttr(self.name)
        if free:
            op.attributes.update(_FREE)
        if stream:
            op.attributes[dist.STREAM_ATTR] = StringAttr(stream)
        if mask is not None:
            axis, offsets = mask
            op.attributes["flint.active"] = DenseArrayBase.from_list(i64, [1 if o else 0 for o in offsets])
            op.attributes["flint.active_axis"] = IntegerAttr(axis, i64)
        self.new.append(op)
        return op.outputs[0]

    def _phase(self) -> str | None:
        p = self.op.attributes.get("phase")
        return p.data if isinstance(p, StringAttr) else None

    def operand(self, keys: list[tuple], free: bool = True) -> SSAValue:
        """One tensor holding ``keys`` in order: a value, a free slice of one, or a free concatenation (the
        send and the reduction kernel read the blocks where they are; the add's bytes count the reads)."""
        runs: list[tuple[SSAValue, int, int]] = []
        for k in keys:
            v, i = self.prod[k]
            if runs and runs[-1][0] is v and runs[-1][2] == i:
                runs[-1] = (v, runs[-1][1], i + 1)
            else:
                runs.append((v, i, i + 1))
        pieces = []
        for v, lo, hi in runs:
            assert isinstance(v.type, TensorType)
            size = v.type.get_shape()[0]
            if lo == 0 and hi * self.unit == size:
                pieces.append(v)
            else:
                pieces.append(self.aten("aten.slice.Tensor", [v], (hi - lo) * self.unit, free=True,
                                        args={"dim": 0, "start": lo * self.unit, "end": hi * self.unit}))
        if len(pieces) == 1:
            return pieces[0]
        return self.aten("aten.cat.default", pieces, len(keys) * self.unit, free=free, stream=self.side)

    def channel(self, a) -> str:
        """The channel (named send / recv stream) of an action: ``ch<k>``, k = lane x channels + chunk mod channels.

        One lane and one channel: "" (the rank's one send and one recv queue)."""
        if self.lanes == 1 and self.channels == 1 and not self.asynchronous:
            return ""
        # the collective's own stream (assign-streams: FSDP's all-gather and reduce-scatter streams) keeps
        # its channels apart from other streams' channels
        prefix = dist.stream_of(self.op)
        return f"{prefix + '.' if prefix else ''}ch{a.lane * self.channels + a.chunk % self.channels}"

    def _props(self, a, uniform: int | None) -> dict:
        axis = self.axes[a.axis]
        props = {"grid": FlatSymbolRefAttr(self.grid), "grid_axes": axes_attr([axis]),
                 "offset": IntegerAttr(uniform if uniform is not None else 0, i64),
                 "tag": IntegerAttr(self.tag_base + a.tag, i64)}
        if uniform is None:
            props["peers"] = DenseArrayBase.from_list(i64, list(a.offsets))
        return props

    def _where(self, op: Operation, a) -> None:
        """Mark an op of an action that only one coordinate of another grid axis runs (``flint.where``)."""
        if a.where is not None:
            op.attributes[dist.WHERE_ATTR] = DenseArrayBase.from_list(i64, [self.axes[a.where[0]], a.where[1]])

    def emit_action(self, a) -> None:
        keys = a.keys(self.rep)
        axis = self.axes[a.axis]
        uniform = a.uniform
        props = self._props(a, uniform)
        mask = None if uniform is not None else (axis, a.offsets)
        channel = self.channel(a)
        self.side = channel if self.asynchronous else None
        if a.send:
            v = self.operand(keys)
            send = dist.SendOp.build(operands=[v], result_types=[[dist.FutureType(NoneType())]], properties=props)
            if channel:
                send.attributes[dist.STREAM_ATTR] = StringAttr(channel)
            self._where(send, a)
            self.new.append(send)
            self.pending.append(send.token)
            return
        r = dist.RecvOp.build(result_types=[self.ttype(a.nblocks)], properties=props).result
        if channel:
            r.owner.attributes[dist.STREAM_ATTR] = StringAttr(channel)
        self._where(r.owner, a)
        self.new.append(r.owner)
        # an asynchronous collective's reductions run in its channel (the communication kernel), not
        # in the compute stream's order
        side = self.side
        if a.reduce:
            out = self.aten("aten.add.Tensor", [self.operand(keys), r], a.nblocks * self.unit, mask=mask,
                            stream=side)
        elif mask is not None:  # where the recv is skipped the buffer keeps its value
            out = self.aten("aten.copy.default", [self.operand(keys), r], a.nblocks * self.unit, mask=mask,
                            stream=side)
            self._where(out.owner, a)
        else:
            out = r
        for i, k in enumerate(keys):
            self.prod[k] = (out, i)

    # -- steps loops ---------------------------------------------------------------------------------
    # A run of ``count`` consecutive periods of ``P`` actions each, where every period is the first one
    # with peer offsets, tags and buffer slices moved on by a fixed amount per period, is emitted as one
    # `dist.steps` whose body is the first period (ring: 2(n-1) steps -> 2 loops of one step each).

    def slot(self, key: tuple) -> int:
        """Position (in units) of a block key in the carried buffer: block-major, then chunk."""
        return key[0] * self.s.chunks + key[1]

    def _shape_of(self, a) -> tuple[tuple[int, int], ...]:
        """An action's keys as runs of consecutive slots, in key order: ((first slot, slots), ...)."""
        if id(a) in self.shapes:
            return self.shapes[id(a)]
        runs: list[list[int]] = []
        for k in a.keys(self.rep):
            sl = self.slot(k)
            if runs and runs[-1][0] + runs[-1][1] == sl:
                runs[-1][1] += 1
            else:
                runs.append([sl, 1])
        shape = self.shapes[id(a)] = tuple((x, y) for x, y in runs)
        return shape

    def _segments(self) -> list[int]:
        """Ranges a slice may cycle in as the step advances: the whole buffer, or one outer row of blocks
        (hierarchical: an inner-axis ring moves through the blocks of one row)."""
        M = self.s.blocks * self.s.chunks
        segs = [M]
        if len(self.s.sizes) == 2 and self.s.blocks == self.s.n:
            segs.insert(0, M // self.s.sizes[0])  # the narrower first: a shift that fits both wraps there
        return segs

    def _run_stride(self, s0: int, ln: int, s1: int) -> tuple[int, int, int] | None:
        """(shift, segment, base) taking a run at ``s0`` to ``s1`` in one step, within one segment."""
        for seg in self._segments():
            base = s0 // seg * seg
            if base <= s1 and s1 + ln <= base + seg and s0 + ln <= base + seg:
                d = (s1 - s0) % seg
                return (d - seg if d > seg // 2 else d), seg, base
        return None

    def _affine_run(self, acts, i: int, P: int) -> tuple[int, list] | None:
        """How many periods of ``P`` actions from ``i`` follow the first one affinely (and their strides).

        Strides per action: (offset step, tag step, [(shift, segment, base) per slot run]).
        """
        first = acts[i:i + P]
        base = [self._shape_of(a) for a in first]
        if any(not b for b in base):
            return None
        strides: list | None = None
        count = 1
        while i + (count + 1) * P <= len(acts):
            period = acts[i + count * P:i + (count + 1) * P]
            cur = []
            ok = True
            for t, u, runs in zip(first, period, base):
                sh = self._shape_of(u)
                if ((u.uniform is None) != (t.uniform is None) or (t.uniform is None and u.offsets != t.offsets)
                        or u.send != t.send or u.where != t.where or u.axis != t.axis or u.nblocks != t.nblocks
                        or u.reduce != t.reduce or u.lane != t.lane
                        or u.chunk % self.channels != t.chunk % self.channels
                        or [ln for _, ln in sh] != [ln for _, ln in runs]):
                    ok = False
                    break
                cur.append(((u.uniform - t.uniform) if t.uniform is not None else 0, u.tag - t.tag, sh))
            if not ok:
                break
            k = count
            if strides is None:
                strides = []
                for (do, dt, sh), runs in zip(cur, base):
                    rs = [self._run_stride(s0, ln, s1) for (s0, ln), (s1, _) in zip(runs, sh)]
                    if any(r is None for r in rs):
                        return None
                    strides.append((do, dt, rs))
            if any(do != k * sd[0] or dt != k * sd[1] or any(
                    s1 != b + (s0 - b + k * shift) % seg or s1 + ln > b + seg
                    for (s0, ln), (s1, _), (shift, seg, b) in zip(runs, sh, sd[2]))
                   for (do, dt, sh), sd, runs in zip(cur, strides, base)):
                break
            count += 1
        if count < 3 or strides is None:
            return None
        return count, strides

    def _find_run(self, acts, i: int) -> tuple[int, int, list] | None:
        if self.s.kind not in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):
            return None
        best = None
        for P in range(1, min(8 * self.s.chunks + 8, (len(acts) - i) // 3) + 1):
            run = self._affine_run(acts, i, P)
            if run is not None and (best is None or run[0] * P > best[0] * best[1]):
                best = (run[0], P, run[1])
        return best

    def _buffer(self) -> SSAValue:
        """The whole buffer (every slot) as one value, for a loop to carry."""
        s = self.s
        keys = [(b, j) for b in range(s.blocks) for j in range(s.chunks)]
        if all(k in self.prod for k in keys):
            return self.operand(keys, free=True)
        # all-gather: the output buffer with the local shard in place (the rest arrives)
        buf = self.aten("aten.new_empty.default", [self.prod[next(k for k in keys if k in self.prod)][0]],
                        len(keys) * self.unit, free=True, args={"size": [len(keys) * self.unit]})
        for idx, k in enumerate(keys):
            if k in self.prod:
                buf = self.aten("aten.slice_scatter.default", [buf, self.operand([k], free=True)], len(keys) * self.unit,
                                free=True, args={"dim": 0, "start": idx * self.unit, "end": (idx + 1) * self.unit})
        return buf

    def _slice(self, buf: SSAValue, s0: int, nb: int, stride: tuple[int, int, int],
               scatter: SSAValue | None = None) -> SSAValue:
        """A slice of the carried buffer (or, with ``scatter``, the buffer with it replaced) that moves by
        ``stride`` = (shift, segment, base) slots per step (``flint.step_shift``)."""
        M = self.s.blocks * self.s.chunks
        args = {"dim": 0, "start": s0 * self.unit, "end": (s0 + nb) * self.unit}
        if scatter is None:
            out = self.aten("aten.slice.Tensor", [buf], nb * self.unit, free=True, args=args)
        else:
            out = self.aten("aten.slice_scatter.default", [buf, scatter], M * self.unit, free=True, args=args)
        shift, seg, base = stride
        if shift:
            vals = [shift * self.unit, seg * self.unit] + ([base * self.unit] if base else [])
            out.owner.attributes[dist.STEP_SHIFT_ATTR] = DenseArrayBase.from_list(i64, vals)
        return out

    def _gather(self, cur: SSAValue, runs, strides) -> SSAValue:
        """The payload of an action in the loop body: its slot runs of the carried buffer, concatenated."""
        M = self.s.blocks * self.s.chunks
        if len(runs) == 1 and runs[0] == (0, M):
            return cur
        pieces = [self._slice(cur, s0, ln, st) for (s0, ln), st in zip(runs, strides)]
        if len(pieces) == 1:
            return pieces[0]
        return self.aten("aten.cat.default", pieces, sum(ln for _, ln in runs) * self.unit, free=True)

    def emit_run(self, acts, count: int, strides: list) -> None:
        s = self.s
        buf = self._buffer()
        outer = self.new
        self.new = []
        block = Block(arg_types=[buf.type])
        cur: SSAValue = block.args[0]
        M = s.blocks * s.chunks
        for a, (doff, dtag, rstrides) in zip(acts, strides):
            runs = self._shape_of(a)
            props = self._props(a, a.uniform)
            if doff:
                props["offset_step"] = IntegerAttr(doff, i64)
            if dtag:
                props["tag_step"] = IntegerAttr(dtag, i64)
            channel = self.channel(a)
            self.side = channel if self.asynchronous else None
            if a.send:
                op = dist.SendOp.build(operands=[self._gather(cur, runs, rstrides)],
                                       result_types=[[dist.FutureType(NoneType())]], properties=props)
            else:
                op = dist.RecvOp.build(result_types=[self.ttype(a.nblocks)], properties=props)
            if channel:
                op.attributes[dist.STREAM_ATTR] = StringAttr(channel)
            self._where(op, a)
            self.new.append(op)
            if a.send:
                continue
            out = op.result
            mask = None if a.uniform is not None else (self.axes[a.axis], a.offsets)
            if a.reduce or mask is not None:  # (where a masked recv is skipped the buffer keeps its value)
                old = self._gather(cur, runs, rstrides)
                out = self.aten("aten.add.Tensor" if a.reduce else "aten.copy.default", [old, out], a.nblocks * self.unit,
                                stream=self.side, mask=mask)
                self._where(out.owner, a)
            if len(runs) == 1 and runs[0] == (0, M):
                cur = out
                continue
            at = 0
            for (s0, ln), st in zip(runs, rstrides):
                piece = out if len(runs) == 1 else self.aten(
                    "aten.slice.Tensor", [out], ln * self.unit, free=True,
                    args={"dim": 0, "start": at * self.unit, "end": (at + ln) * self.unit})
                cur = self._slice(cur, s0, ln, st, scatter=piece)
                at += ln
        self.new.append(dist.YieldOp.build(operands=[[cur]]))
        block.add_ops(self.new)
        self.new = outer
        loop = dist.StepsOp(count, [buf], Region(block))
        loop.attributes["flint.collective"] = StringAttr(self.name)
        self.new.append(loop)
        self.pending.append(loop.token)
        out = loop.outs[0]
        for b in range(s.blocks):
            for j in range(s.chunks):
                self.prod[(b, j)] = (out, self.slot((b, j)))

    def emit(self) -> SSAValue:
        s = self.s
        acts = list(s.actions)
        i = 0
        while i < len(acts):
            run = self._find_run(acts, i) if self.loops else None
            if run is None:
                self.emit_action(acts[i])
                i += 1
                continue
            count, P, strides = run
            self.emit_run(acts[i:i + P], count, strides)
            i += count * P
        C = s.chunks
        if s.kind == "all_reduce":
            keys = [(b, j) for b in range(s.blocks) for j in range(C)]
        elif s.kind == "reduce_scatter":
            keys = [(s.group_rank(self.rep), j) for j in range(C)]
        elif s.kind == "all_gather":
            keys = [(b, j) for b in range(s.n) for j in range(C)]
        elif s.kind == "broadcast":
            keys = [(b, j) for b in range(s.blocks) for j in range(C)]
        else:
            keys = [(src, s.group_rank(self.rep), j) for src in range(s.n) for j in range(C)]
        # Sends run asynchronously (a rank's compute must not wait for its own sends to be received, or a
        # tree would run in lock step); the collective is complete when they are.
        self.tail = len(self.new)
        self.side = None
        for token in self.pending:
            self.new.append(dist.WaitOp(token))
        # The result buffer is written in place by the steps: assembling it is no kernel.
        whole = self.operand(keys, free=True)
        return self.aten("aten.view.default", [whole], None, free=True, result_type=self.op.output_type(),
                         args={"size": list(self.op.output_type().get_shape())})


@dataclass(frozen=True)
class DecomposeCollectivesPass(ModulePass):
    """Rewrite every `dist` collective into per-rank send/recv steps with the reduction kernels between them.

    Each ``dist.all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``
    and ``broadcast`` over more than one rank becomes the step schedule of
    ``algorithm`` (:mod:`flint.collectives.schedule`, the one definition the
    numeric interpreter and ``verify-p2p`` also use): ``dist.send`` /
    ``dist.recv`` along one grid axis, with a uniform ``offset`` or, where
    the peer depends on the coordinate (tree, broadcast), a per-coordinate
    ``peers`` table; an ``aten.add.Tensor`` after every reducing recv (its
    FLOPs and bytes count), masked with ``flint.active`` where only some
    coordinates receive. The buffer is cut into the schedule's blocks, each
    into ``chunks`` pieces sent one after the other so transfers and
    reductions pipeline. ``channels``: chunk ``j`` goes on channel ``j mod
    channels`` (a ``stream = "ch<k>"`` on the send / recv: one in-order send
    and one recv queue per channel in the simulator, the rank's ports shared
    between them), so several chunks are in flight and their latencies
    overlap, as NCCL's channels and pipeline slots do; the two trees of
    ``tree`` always run on channels of their own (tree h on ``ch<h x
    channels + k>``), as NCCL's double binary tree does. With one channel
    and one lane the steps stay on the rank's default send and recv queues. Tags are unique per step and pair across the module
    (they start above the largest tag already used). Views that cut and
    re-assemble the buffer are annotated free (``flops = 0``, ``bytes = 0``):
    the real kernels work in place. A buffer that does not divide into
    blocks x chunks is padded to the next multiple.

    ``algorithm``: ``ring``, ``tree``, ``direct``, ``halving-doubling``,
    ``hierarchical`` (two grid axes: the second the inner one) or ``auto``:
    per collective the cheapest by :func:`flint.cost.collective_time_us` on
    ``network`` (a preset or TOML path), printed to stderr. An algorithm that
    cannot run a collective (halving-doubling on a non-power of two, tree on
    an all-gather, a flat algorithm over two axes) is an error naming the
    group size and the algorithms that would work.

    Asynchronous collectives (one ``dist.wait`` in the same block) stay
    asynchronous: the sends and recvs start where the collective started,
    the waits on the sends and the assembled result sit where its wait was,
    and the steps run on channels (``ch<k>``) with their reduction kernels
    (``stream`` on the ``aten.add``), so the compute stream is not held by
    them (NCCL reduces inside its communication kernel). A synchronous
    collective's steps (and reductions) stay at its position.

    ``loops`` (default on): a run of steps that repeat with the peer
    offset, the tag and the buffer slice moved on by a fixed amount per step
    (ring's 2(n-1) steps, direct's n-1 sends, a ring broadcast's chunks) is
    one ``dist.steps`` op whose body is one step (``offset_step``,
    ``tag_step``, ``flint.step_shift``) and which carries the whole buffer,
    so the IR does not grow with the group size; lower-to-chakra and
    verify-p2p expand it per step. ``loops=false`` emits every step
    (the reference the loop form is tested against).

    Afterwards the module has no collectives over more than one rank; a
    collective's ``dist.wait`` is replaced by the waits on its sends.
    """

    name = "decompose-collectives"

    algorithm: str = "ring"
    chunks: int = 1
    channels: int = 1
    network: str = "dgx-h100"
    loops: bool = True

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        if self.algorithm not in ALGORITHMS + ("auto",):
            raise FlintError(f"decompose-collectives: unknown algorithm '{self.algorithm}' "
                             f"(valid: {', '.join(ALGORITHMS)}, auto)")
        if self.chunks < 1:
            raise FlintError(f"decompose-collectives: chunks must be >= 1, got {self.chunks}")
        if self.channels < 1:
            raise FlintError(f"decompose-collectives: channels must be >= 1, got {self.channels}")
        net = None
        if self.algorithm == "auto":
            from flint.cost import load_network

            net = load_network(self.network)
        tag_base = 1 + max((max(o.tag_at(0), o.tag_at(dist.steps_of(o) - 1)) for o in op.walk()
                            if isinstance(o, dist.PointToPointOp)), default=-1)
        printed: set = set()
        for fn in [f for f in op.walk() if isinstance(f, func.FuncOp)]:
            for coll in [o for o in fn.walk() if isinstance(o, dist.CollectiveOp)]:
                if coll.group_size() == 1:
                    continue
                tag_base = self._decompose(coll, tag_base, net, printed)

    def _decompose(self, coll: dist.CollectiveOp, tag_base: int, net, printed: set) -> int:
        kind = KIND_OF[type(coll)]
        if dist.PREFETCH_ATTR in coll.attributes:
            raise DecomposeError(coll, f"'{coll.name}' op is prefetched across iterations ({dist.PREFETCH_ATTR}, "
                                       "from reorder-all-gather{prefetch>0}): its send/recv steps cannot carry that "
                                       "yet; decompose with prefetch=0 (sink-waits and assign-streams keep the "
                                       "overlap within an iteration)")
        shape = grid_shape(coll, coll.grid)
        sizes = tuple(shape[a] for a in coll.axes())
        root = coll.root.value.data if isinstance(coll, dist.BroadcastOp) else 0
        alg = self.algorithm
        if alg == "auto":
            alg = self._auto(coll, kind, sizes, shape, net, printed)
        try:
            sched = build(kind, alg, sizes, self.chunks, root)
        except UnsupportedAlgorithm as e:
            raise DecomposeError(coll, f"'{coll.name}' op cannot be decomposed: {e}") from None
        waits = [u.operation for u in coll.result.uses] if coll.is_async else []
        assert all(isinstance(w, dist.WaitOp) for w in waits)
        same_block = all(w.parent_block() is coll.parent_block() for w in waits)
        em = _Emitter(coll, sched, tag_base, self.channels, asynchronous=len(waits) == 1 and same_block,
                      loops=self.loops)
        result = em.emit()
        if em.asynchronous:  # the steps start where the collective started; its wait stays where it was
            Rewriter.insert_op(em.new[:em.tail], InsertPoint.before(coll))
            Rewriter.insert_op(em.new[em.tail:], InsertPoint.before(waits[0]))
        else:
            Rewriter.insert_op(em.new, InsertPoint.before(coll))
        if coll.is_async:
            for wait in waits:
                wait.result.replace_all_uses_with(result)
                Rewriter.erase_op(wait)
        else:
            coll.result.replace_all_uses_with(result)
        Rewriter.erase_op(coll)
        return tag_base + 1 + max((a.tag for a in sched.actions), default=0)

    def _auto(self, coll, kind: str, sizes: tuple[int, ...], shape, net, printed: set) -> str:
        from flint.mesh import Mesh

        mesh = Mesh(tuple(shape))
        members = list(mesh.group(0, coll.axes()))
        t = coll.input.type
        assert isinstance(t, TensorType)
        from flint.cost import tensor_bytes

        nbytes = tensor_bytes(t.get_shape(), str(t.element_type))
        best, times = choose_algorithm(kind, sizes, nbytes, members, net, mesh.world_size)
        key = (kind, coll.axes(), nbytes)
        if key not in printed:
            printed.add(key)
            costs = ", ".join(f"{a} {times[a]:.1f}" for a in times)
            print(f"decompose-collectives: {kind} over grid axes {list(coll.axes())} ({math.prod(sizes)} ranks, "
                  f"{nbytes} B) on {net.name}: {costs} us -> {best}", file=sys.stderr)
        return best
