"""`split-collectives`: cut each large collective into pieces of at most ``bytes`` input bytes."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import IntegerAttr, ModuleOp, TensorType, i64
from xdsl.ir import SSAValue
from xdsl.passes import ModulePass
from xdsl.rewriter import InsertPoint, Rewriter

from flint.errors import FlintError
from flint.ir import dist
from flint.passes.bucket_collectives import positive_bytes
from flint.schedule.invariants import describe_op
from flint.schedule.packing import Builder, element_bytes, like_op, numel, packable, packed_result_type

SPLIT_ATTR = "split_of"  # on each piece: how many pieces the collective became


def piece_sizes(total: int, max_piece: int) -> list[int]:
    """``total`` elements in the fewest near-equal pieces of at most ``max_piece``."""
    k = -(-total // max_piece)
    base, rem = divmod(total, k)
    return [base + 1] * rem + [base] * (k - rem)


@dataclass(frozen=True)
class SplitCollectivesPass(ModulePass):
    """Cut each collective whose input exceeds ``bytes`` into pieces of at most ``bytes``, the inverse of bucketing.

    The input is split into the fewest near-equal pieces (whole elements;
    for a reduce-scatter every rank's slice is split alike, so piece ``i``
    of every rank's slice is reduced together), one collective per piece is
    issued where the original started (attribute ``split_of = <pieces>``),
    all are waited where the original was waited, and the pieces are
    concatenated back (views and copies as `aten` ops, layouts as in
    :mod:`flint.schedule.packing`). all_reduce, all_gather (gather_dim 0) and
    reduce_scatter (scatter_dim 0) are split; others are left alone.

    Guarantees (checked by :func:`flint.schedule.check_schedule_invariants`
    with ``same_bytes_per_group``): same values, same FLOPs, same total bytes
    per (kind, group, dtype, reduction), every start waited once.

    Options: ``bytes`` (> 0, default 26214400). A collective whose one element
    (one element per rank for a reduce-scatter) exceeds ``bytes`` is an
    error; with nothing larger than ``bytes`` the pass says so on stderr and
    changes nothing.
    """

    name = "split-collectives"

    bytes: int = 26214400

    def __post_init__(self) -> None:
        positive_bytes(self.name, self.bytes)

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        todo = []
        for o in op.walk():
            if isinstance(o, dist.CollectiveOp) and packable(o) is None:
                t = o.input.type
                assert isinstance(t, TensorType)
                n = o.group_size()
                row = n if isinstance(o, dist.ReduceScatterOp) else 1  # bytes of one element per piece
                total_bytes = numel(t) * element_bytes(t)
                if total_bytes <= self.bytes or n == 1:
                    continue
                max_piece = self.bytes // (element_bytes(t) * row)
                if max_piece == 0:
                    err = FlintError(f"{self.name}: bytes={self.bytes} is smaller than one element "
                                     f"({element_bytes(t) * row} bytes) of {describe_op(o)}")
                    err.op = o  # flint-opt reports its file:line:col
                    raise err
                todo.append((o, piece_sizes(numel(t) // row, max_piece)))
        if not todo:
            print(f"{self.name}: note: nothing to split: no all_reduce, all_gather or reduce_scatter has more than "
                  f"{self.bytes} input bytes; the module is unchanged", file=sys.stderr)
        for o, sizes in todo:
            split(o, sizes)


def split(op: dist.CollectiveOp, sizes: list[int]) -> None:
    """Replace ``op`` by one collective per piece of ``sizes`` elements (see the pass docstring)."""
    n = op.group_size()
    kind = type(op)
    x = op.input
    t = x.type
    assert isinstance(t, TensorType)
    if op.is_async:
        old_wait = next(u.operation for u in op.result.uses if isinstance(u.operation, dist.WaitOp))
        value: SSAValue = old_wait.result
        wait_point = InsertPoint.before(old_wait)
    else:
        old_wait, value = None, op.result
        wait_point = InsertPoint.after(op)
    out_t = value.type
    assert isinstance(out_t, TensorType)

    b = Builder(InsertPoint.before(op))
    if kind is dist.ReduceScatterOp:
        rows = b.view(x, [n, numel(t) // n])
        pieces = [b.view(p, [n * s]) for p, s in zip(b.split(rows, sizes, 1, copy=True), sizes)]
    else:
        pieces = b.split(b.view(x, [numel(t)]), sizes, 0, copy=False)
    starts = []
    for p in pieces:
        s = like_op(op, p, packed_result_type(kind, p.type, n), is_async=True)
        s.location = op.location
        s.attributes[SPLIT_ATTR] = IntegerAttr(len(sizes), i64)
        Rewriter.insert_op(s, InsertPoint.before(op))
        starts.append(s)
    waits = []
    for s in starts:
        w = dist.WaitOp(s.result)
        Rewriter.insert_op(w, wait_point)
        waits.append(w.result)
    after = Builder(wait_point)
    if kind is dist.AllGatherOp:
        whole = after.cat([after.view(w, [n, sz]) for w, sz in zip(waits, sizes)], 1)
    else:
        whole = after.cat(waits, 0)
    value.replace_all_uses_with(after.view(whole, out_t.get_shape()))
    if old_wait is not None:
        Rewriter.erase_op(old_wait)
    Rewriter.erase_op(op)
