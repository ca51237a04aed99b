"""`bucket-collectives`: fuse consecutive compatible collectives into one over a packed buffer."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import IntegerAttr, ModuleOp, TensorType, i64
from xdsl.ir import Block, Operation, OpResult, SSAValue
from xdsl.passes import ModulePass
from xdsl.rewriter import InsertPoint, Rewriter

from flint.errors import FlintError
from flint.ir import dist
from flint.schedule.packing import Builder, like_op, pack, packable, packed_result_type, unpack

BUCKET_ATTR = "bucketed"  # on a fused collective: how many collectives it replaced


def positive_bytes(pass_name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise FlintError(f"{pass_name}: option bytes must be a positive number of bytes, got {value!r}")


def _tensor_bytes(t: TensorType) -> int:
    from flint.cost import tensor_bytes

    return tensor_bytes(t.get_shape(), str(t.element_type))


@dataclass
class _Member:
    """One collective of a block and where its input, completion and first use are."""

    op: dist.CollectiveOp
    wait: dist.WaitOp | None
    value: SSAValue  # the tensor its users read: the wait's result, or the synchronous result
    start: int
    input_ready: int  # position of the op producing the input (-1: a block argument)
    done: int  # position of the wait (of the op itself if synchronous)
    first_use: int  # position of the first op reading ``value`` (len(block) if none)
    bytes: int = 0


def compat_key(op: dist.CollectiveOp) -> tuple:
    """Collectives fuse only with the same kind, group, dtype and reduction."""
    t = op.input.type
    assert isinstance(t, TensorType)
    red = str(op.reduction.data.value) if isinstance(op, dist.AllReduceOp | dist.ReduceScatterOp) else "-"
    return (op.name, op.grid.string_value(), op.axes(), str(t.element_type), red)


def block_members(block: Block) -> tuple[dict[Operation, int], list[Operation]]:
    ops = list(block.ops)
    return {o: i for i, o in enumerate(ops)}, ops


def block_end(ops: list[Operation]) -> int:
    """Where a value nobody reads is still due: the block's terminator (or its end)."""
    return len(ops) - 1 if ops and isinstance(ops[-1], func.ReturnOp) else len(ops)


def member(op: dist.CollectiveOp, pos: dict[Operation, int], end: int) -> _Member:
    wait = None
    value: SSAValue = op.result
    if op.is_async:
        waits = [u.operation for u in op.result.uses if isinstance(u.operation, dist.WaitOp)]
        wait = waits[0]
        value = wait.result
    src = op.input
    ready = pos.get(src.op, -1) if isinstance(src, OpResult) else -1
    uses = [pos[u.operation] for u in value.uses if u.operation in pos]
    done = pos[wait] if wait is not None else pos[op]
    return _Member(op, wait, value, pos[op], ready, done, min(uses, default=end), _tensor_bytes(op.input.type))


def feasible(run: list[_Member]) -> bool:
    """Every input is ready before any result is read (so none depends on another member's result)."""
    values = {x.value for x in run}
    if any(x.op.input in values for x in run):
        return False
    return max(x.input_ready for x in run) < min(x.first_use for x in run)


@dataclass(frozen=True)
class BucketCollectivesPass(ModulePass):
    """Fuse consecutive compatible collectives into one over a packed buffer, as DDP buckets and FSDP groups do.

    Within each block, collectives are taken in program order; a run of
    them with the same kind, grid axes, dtype and reduction, with no other
    communication op (another kind, a barrier, a send/recv) in between,
    becomes one bucket while its members' input bytes stay within
    ``bytes`` (a single larger collective stays alone, as in DDP). A member
    joins only if every member's input is ready before any member's result
    is read, so the fused collective can be issued once the last input is
    ready (DDP issues a bucket when its last gradient is ready) and waited
    for before the first result is needed.

    Each bucket becomes: `aten` ops packing the inputs (flatten and
    concatenate; :mod:`flint.schedule.packing` gives each kind's layout,
    FSDP2's and DDP's), one asynchronous collective (attribute
    ``bucketed = <members>``) issued at the later of the first member's start
    and the last input, its ``dist.wait`` at the first of the members' waits
    or uses after it, and `aten` ops unpacking the result (split, views)
    replacing each member's result. all_reduce, all_gather (gather_dim 0)
    and reduce_scatter (scatter_dim 0) are bucketed; others are left alone.

    Guarantees (checked by :func:`flint.schedule.check_schedule_invariants`
    with ``same_bytes_per_group``): same values, same FLOPs, same total bytes
    per (kind, group, dtype, reduction), every start waited once.

    Options: ``bytes`` (> 0, default 26214400: DDP's ``bucket_cap_mb=25``).
    With nothing to bucket, the pass says so on stderr and changes nothing.
    """

    name = "bucket-collectives"

    bytes: int = 26214400

    def __post_init__(self) -> None:
        positive_bytes(self.name, self.bytes)

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        fused = 0
        skipped: dict[str, int] = {}
        for fn in [f for f in op.walk() if isinstance(f, func.FuncOp)]:
            for block in [b for r in fn.regions for b in r.blocks]:
                # Fusing moves ops, so positions are recomputed after each bucket; the
                # greedy runs are the same (a fused bucket does not fit its neighbours).
                found = self.buckets(block, skipped)
                while found:
                    fuse(found[0])
                    fused += 1
                    found = self.buckets(block, {})
        if fused == 0:
            why = "; ".join(f"{n} x {r}" for r, n in sorted(skipped.items()))
            print(f"{self.name}: note: nothing to bucket: no two consecutive compatible collectives fit in "
                  f"{self.bytes} bytes{' (' + why + ')' if why else ''}; the module is unchanged", file=sys.stderr)

    def buckets(self, block: Block, skipped: dict[str, int]) -> list[list[_Member]]:
        pos, ops = block_members(block)
        out: list[list[_Member]] = []
        run: list[_Member] = []

        def flush() -> None:
            if len(run) > 1:
                out.append(list(run))
            run.clear()

        for o in ops:
            if isinstance(o, dist.WaitOp) or not isinstance(o, dist.DistCommOp):
                continue
            if not isinstance(o, dist.CollectiveOp):
                flush()
                continue
            reason = packable(o)
            if reason is not None:
                skipped[reason] = skipped.get(reason, 0) + 1
                flush()
                continue
            m = member(o, pos, block_end(ops))
            if run and (compat_key(o) != compat_key(run[0].op) or sum(x.bytes for x in run) + m.bytes > self.bytes
                        or not feasible(run + [m])):
                flush()
            run.append(m)
        flush()
        return out


def fuse(bucket: list[_Member]) -> None:
    """Replace the members of one bucket by one packed collective (see the pass docstring)."""
    first = bucket[0].op
    block = first.parent_block()
    assert block is not None
    pos, ops = block_members(block)
    start_at = max(bucket[0].start, max(m.input_ready for m in bucket) + 1)
    # the wait goes before the first member wait or use at or after the start
    candidates = [m.done for m in bucket if m.done >= start_at] + [m.first_use for m in bucket]
    wait_at = min(c for c in candidates if c >= start_at)
    start_anchor, wait_anchor = ops[start_at], (ops[wait_at] if wait_at < len(ops) else None)
    n = first.group_size()
    kind = type(first)

    b = Builder(InsertPoint.before(start_anchor))
    packed = pack(b, kind, [m.op.input for m in bucket], n)
    out_t = packed_result_type(kind, packed.type, n)
    start = like_op(first, packed, out_t, is_async=True)
    start.location = first.location
    start.attributes[BUCKET_ATTR] = IntegerAttr(len(bucket), i64)
    Rewriter.insert_op(start, InsertPoint.before(start_anchor))
    wait = dist.WaitOp(start.result)
    point = InsertPoint.before(wait_anchor) if wait_anchor is not None else InsertPoint.at_end(block)
    Rewriter.insert_op(wait, point)
    outs = unpack(Builder(point), kind, wait.result, [m.value.type for m in bucket], n)
    for m, new in zip(bucket, outs):
        m.value.replace_all_uses_with(new)
        if m.wait is not None:
            Rewriter.erase_op(m.wait)
        Rewriter.erase_op(m.op)
