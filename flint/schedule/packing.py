"""Packing several tensors into one communication buffer and back, as PyTorch does.

``bucket-collectives`` fuses collectives into one over a packed buffer and
``split-collectives`` cuts one into several over pieces; both build the
packing from `aten` ops, so FLOPs (zero) and bytes (the copies) stay honest
for the cost model and the checker. The layouts are the ones PyTorch uses:

- all-reduce (DDP's gradient bucket): each tensor flattened, concatenated;
  the reduced bucket is split back into views (DDP's ``gradient_as_bucket_view``).
- all-gather (FSDP2's ``foreach_all_gather``): each rank's shards flattened
  and concatenated (copy-in); the gathered ``[n * total]`` buffer is viewed
  ``[n, total]`` and split along dim 1 by copy (``split_with_sizes_copy``,
  FSDP2's copy-out), then each ``[n, numel_i]`` viewed back to the gathered
  parameter ``[n * s0, ...]``. Needs ``gather_dim = 0``.
- reduce-scatter (FSDP2's ``foreach_reduce``): each gradient ``[n * s0, ...]``
  viewed ``[n, numel_i / n]``, concatenated along dim 1 (``chunk_cat``) and
  flattened; the scattered ``[total]`` shard is split into views of each
  shard ``[s0, ...]``. Needs ``scatter_dim = 0``.
"""

from __future__ import annotations

import math
from typing import Sequence

from xdsl.dialects.builtin import ArrayAttr, IntegerAttr, TensorType, i64
from xdsl.ir import Operation, SSAValue
from xdsl.rewriter import InsertPoint, Rewriter

from flint.cost import dtype_bytes
from flint.ir import dist
from flint.ir.aten import AtenOp

#: Collective kinds the packing supports.
PACKABLE = (dist.AllReduceOp, dist.AllGatherOp, dist.ReduceScatterOp)


def packable(op: dist.CollectiveOp) -> str | None:
    """Why ``op`` cannot be packed (a reason), or None if it can."""
    if not isinstance(op, PACKABLE):
        return f"'{op.name}' is not packed (only all_reduce, all_gather and reduce_scatter are)"
    if isinstance(op, dist.AllGatherOp) and op.gather_dim.value.data != 0:
        return f"'{op.name}' gathers along dim {op.gather_dim.value.data} (packing needs gather_dim = 0, FSDP's Shard(0))"
    if isinstance(op, dist.ReduceScatterOp) and op.scatter_dim.value.data != 0:
        return f"'{op.name}' scatters along dim {op.scatter_dim.value.data} (packing needs scatter_dim = 0)"
    return None


def element_bytes(t: TensorType) -> int:
    return dtype_bytes(str(t.element_type))


def numel(t: TensorType) -> int:
    return math.prod(t.get_shape())


def tensor(shape: Sequence[int], like: TensorType) -> TensorType:
    return TensorType(like.element_type, list(shape))


def _ints(values: Sequence[int]) -> ArrayAttr:
    return ArrayAttr([IntegerAttr(int(v), i64) for v in values])


class Builder:
    """Inserts `aten` packing ops before a fixed op (through the rewriter)."""

    def __init__(self, point: InsertPoint):
        self.point = point

    def _insert(self, op: Operation) -> Operation:
        Rewriter.insert_op(op, self.point)
        return op

    def view(self, x: SSAValue, shape: Sequence[int]) -> SSAValue:
        t = x.type
        assert isinstance(t, TensorType)
        if list(t.get_shape()) == list(shape):
            return x
        return self._insert(AtenOp("aten.view.default", [x], [tensor(shape, t)], args={"size": _ints(shape)})).results[0]

    def cat(self, xs: Sequence[SSAValue], dim: int) -> SSAValue:
        t = xs[0].type
        assert isinstance(t, TensorType)
        shape = list(t.get_shape())
        shape[dim] = sum(x.type.get_shape()[dim] for x in xs)
        return self._insert(AtenOp("aten.cat.default", list(xs), [tensor(shape, t)],
                                   args={"dim": IntegerAttr(dim, i64)})).results[0]

    def split(self, x: SSAValue, sizes: Sequence[int], dim: int, copy: bool) -> list[SSAValue]:
        """``split_with_sizes`` (views) or ``split_with_sizes_copy`` (contiguous copies) along ``dim``."""
        t = x.type
        assert isinstance(t, TensorType)
        outs = []
        for s in sizes:
            shape = list(t.get_shape())
            shape[dim] = s
            outs.append(tensor(shape, t))
        target = "aten.split_with_sizes_copy.default" if copy else "aten.split_with_sizes.default"
        op = self._insert(AtenOp(target, [x], outs, args={"split_sizes": _ints(sizes), "dim": IntegerAttr(dim, i64)}))
        return list(op.results)


def pack(b: Builder, kind: type, inputs: Sequence[SSAValue], n: int) -> SSAValue:
    """One buffer holding ``inputs`` for a collective of ``kind`` over ``n`` ranks (module docstring)."""
    if kind is dist.ReduceScatterOp:
        rows = [b.view(x, [n, numel(x.type) // n]) for x in inputs]
        packed = b.cat(rows, 1) if len(rows) > 1 else rows[0]
        return b.view(packed, [numel(packed.type)])
    flat = [b.view(x, [numel(x.type)]) for x in inputs]
    return b.cat(flat, 0) if len(flat) > 1 else flat[0]


def unpack(b: Builder, kind: type, packed_out: SSAValue, like: Sequence[TensorType], n: int) -> list[SSAValue]:
    """Split a collective's packed output back into tensors of the types ``like`` (its members' outputs)."""
    if kind is dist.AllGatherOp:
        sizes = [numel(t) // n for t in like]
        rows = b.view(packed_out, [n, sum(sizes)])
        parts = b.split(rows, sizes, 1, copy=True) if len(sizes) > 1 else [rows]
        return [b.view(p, t.get_shape()) for p, t in zip(parts, like)]
    sizes = [numel(t) for t in like]
    parts = b.split(packed_out, sizes, 0, copy=False) if len(sizes) > 1 else [packed_out]
    return [b.view(p, t.get_shape()) for p, t in zip(parts, like)]


def packed_result_type(kind: type, packed_in: TensorType, n: int) -> TensorType:
    """The output of a collective of ``kind`` over ``n`` ranks on a 1-D packed input."""
    (m,) = packed_in.get_shape()
    if kind is dist.AllGatherOp:
        return tensor([m * n], packed_in)
    if kind is dist.ReduceScatterOp:
        return tensor([m // n], packed_in)
    return packed_in


def like_op(op: dist.CollectiveOp, x: SSAValue, out: TensorType, is_async: bool) -> dist.CollectiveOp:
    """A collective of ``op``'s kind, grid, axes and reduction on ``x`` with output ``out`` (dim 0)."""
    extra: dict = {}
    if isinstance(op, dist.AllGatherOp):
        extra["gather_dim"] = 0
    if isinstance(op, dist.ReduceScatterOp):
        extra["scatter_dim"] = 0
    reduction = str(op.reduction.data.value) if isinstance(op, dist.AllReduceOp | dist.ReduceScatterOp) else None
    new = type(op)(x, op.grid.string_value(), op.axes(), dist.FutureType(out) if is_async else out,
                   reduction=reduction, **extra)
    return new
