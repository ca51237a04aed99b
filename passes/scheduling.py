"""Helpers the scheduling passes share (not a pass): moving ops inside one block.

Scheduling passes (`reorder-all-gather`, `sink-waits`, `hoist-starts`,
`assign-streams`) only reorder ops within a function body, split a
synchronous collective into its start and wait, or set the scheduling
attributes of :mod:`flint.ir.dist` (``stream``, ``flint.prefetch``). They
never change what is computed or what is communicated.
"""

from __future__ import annotations

from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, StringAttr
from xdsl.ir import Block, Operation, SSAValue
from xdsl.rewriter import InsertPoint, Rewriter

from flint.ir import dist
from flint.ir.aten import AtenOp

ROLE_ATTR = "flint.role"


def functions(module: ModuleOp) -> list[func.FuncOp]:
    return [op for op in module.ops if isinstance(op, func.FuncOp)]


def data_parallel_axes(module: ModuleOp) -> frozenset[int]:
    """Grid axes of ``module``'s data parallelism: the plan's ``dp`` axes, else the axes named
    ``dp_shard`` / ``dp_replicate`` (a module without a plan)."""
    from flint.chakra.from_ir import mesh_of
    from flint.plan import plan_of

    plan = plan_of(module)
    dp = set(plan.axes("dp")) if plan is not None else {"dp_shard", "dp_replicate"}
    return frozenset(i for i, n in enumerate(mesh_of(module).axis_names) if n in dp)


def arg_roles(fn: func.FuncOp) -> dict[SSAValue, str]:
    attrs = fn.arg_attrs.data if fn.arg_attrs is not None else ()
    out = {}
    for arg, a in zip(fn.body.block.args, attrs):
        role = a.data.get(ROLE_ATTR)
        if isinstance(role, StringAttr):
            out[arg] = role.data
    return out


def is_view(op: Operation) -> bool:
    """A pure view (no kernel; the result aliases the input): free to move later."""
    if not isinstance(op, AtenOp):
        return False
    from flint.cost.opclass import VIEW, classify_target, split_target

    name = split_target(op.overload)[1]
    return not name.endswith("_") and classify_target(op.overload) == VIEW


def make_async(op: dist.CollectiveOp) -> tuple[dist.CollectiveOp, dist.WaitOp]:
    """Split a synchronous collective into an async start and a ``dist.wait`` at its place."""
    if op.is_async:
        uses = [u.operation for u in op.result.uses]
        return op, next((u for u in uses if isinstance(u, dist.WaitOp)), None)
    out_t = op.result.type
    start = type(op).create(operands=[op.input], result_types=[dist.FutureType(out_t)],
                            properties=dict(op.properties), attributes=dict(op.attributes))
    start.location = op.location
    Rewriter.insert_op(start, InsertPoint.before(op))
    wait = dist.WaitOp(start.result)
    wait.location = op.location
    Rewriter.insert_op(wait, InsertPoint.before(op))
    op.result.replace_all_uses_with(wait.result)
    Rewriter.erase_op(op)
    return start, wait


def move_before(ops: list[Operation], anchor: Operation) -> None:
    """Move ``ops`` (in this order) to just before ``anchor`` in the same block."""
    for op in ops:
        if op is anchor:
            continue
        op.detach()
        Rewriter.insert_op(op, InsertPoint.before(anchor))


def move_to_top(ops: list[Operation], block: Block, after: Operation | None) -> Operation | None:
    """Move ``ops`` (in order) to the top of ``block``, after ``after`` (None: the very top)."""
    for op in ops:
        op.detach()
        if after is None:
            first = block.first_op
            if first is None:
                block.add_op(op)
            else:
                Rewriter.insert_op(op, InsertPoint.before(first))
        else:
            Rewriter.insert_op(op, InsertPoint.after(after))
        after = op
    return after


def first_user(values: list[SSAValue], block: Block, exclude: set[Operation]) -> Operation | None:
    """The earliest op of ``block`` (not in ``exclude``) using any of ``values``; None: none does."""
    users = {u.operation for v in values for u in v.uses} - exclude
    for op in block.ops:
        if op in users:
            return op
    return None
