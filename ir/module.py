"""Module-level rules the op verifiers cannot see, checked before any work.

:func:`verify_module` runs after parsing (``load_ir``, ``flint-opt``) and
after every ``flint-opt`` pass. It checks what spans ops, against the
machine's limits (:mod:`flint.limits`):

- every ``shard.grid`` has 1..MAX_GRID_AXES axes of size >= 1 and at most
  MAX_WORLD_SIZE ranks;
- ``flint.schedule`` is well formed (:func:`flint.ir.aten.get_schedule`);
- the nodes one rank would run once repeats are unrolled (``flint.schedule``
  counts times the ops of each function; nested ``chakra.repeat`` counts
  multiplied) fit this machine (:func:`flint.limits.max_nodes_per_rank`).

Errors are ``VerifyException`` whose ``op`` attribute is the op to blame,
so drivers print its file:line:col.
"""

from __future__ import annotations

from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.dialects.shard import GridOp
from xdsl.ir import Operation
from xdsl.utils.exceptions import VerifyException

from flint.limits import MAX_GRID_AXES, MAX_WORLD_SIZE, fmt, max_nodes_per_rank


def _fail(op: Operation, msg: str) -> VerifyException:
    e = VerifyException(msg)
    e.op = op  # type: ignore[attr-defined]
    return e


def verify_grid(grid: GridOp) -> int:
    """Check one grid; returns its number of ranks."""
    shape = list(grid.shape.get_values())
    name = f"'shard.grid' op @{grid.sym_name.data}"
    if not shape:
        raise _fail(grid, f"{name} has no axes")
    if len(shape) > MAX_GRID_AXES:
        raise _fail(grid, f"{name} has {len(shape)} axes; the limit is {MAX_GRID_AXES}")
    world = 1
    for i, n in enumerate(shape):
        if n < 1:
            raise _fail(grid, f"{name} axis {i} has size {n}; every axis needs at least one rank (no dynamic sizes)")
        world *= n
    if world > MAX_WORLD_SIZE:
        raise _fail(grid, f"{name} shape {'x'.join(map(str, shape))} has {fmt(world)} ranks; the limit is "
                          f"{fmt(MAX_WORLD_SIZE)} ranks")
    return world


def _chakra_nodes(block, limit: int, scale: int, where: Operation) -> int:
    """Unrolled node count of a chakra block (nested repeats multiplied)."""
    total = 0
    for op in block.ops:
        if op.name == "chakra.repeat":
            count = op.count.value.data
            total += _chakra_nodes(op.body.block, limit, scale * count, op)
        elif op.name != "chakra.yield":
            total += scale
        if total > limit:
            raise _fail(op if op.name == "chakra.repeat" else where,
                        f"'{op.name}' op: unrolled, one rank would run more than {fmt(limit)} nodes, what this "
                        f"machine's memory holds (limit = physical memory / 256 B per node); reduce repeat counts")
    return total


def verify_module(module: ModuleOp) -> None:
    """Run the module-level rules (module docstring); raises ``VerifyException``."""
    from flint.ir.aten import SCHEDULE_ATTR, STAGE_SCHEDULES_ATTR, get_schedule, stage_roles

    limit = max_nodes_per_rank()
    for op in module.ops:
        if isinstance(op, GridOp):
            verify_grid(op)
        elif op.name == "chakra.graph":
            _chakra_nodes(op.body.block, limit, 1, op)
    funcs = {op.sym_name.data: op for op in module.ops if isinstance(op, func.FuncOp)}
    try:
        schedules = [get_schedule(module, role) for role in range(stage_roles(module))]
    except VerifyException as e:
        raise _fail(module, str(e)) from None
    if SCHEDULE_ATTR in module.attributes or STAGE_SCHEDULES_ATTR in module.attributes:
        for schedule in schedules:
            total = 0
            for name, count in schedule:
                total += count * sum(1 for _ in funcs[name].walk())
                if total > limit:
                    raise _fail(module, f"module attribute {SCHEDULE_ATTR}: unrolled, one rank would run more "
                                        f"than {fmt(limit)} ops (@{name} x {fmt(count)}), what this machine's "
                                        "memory holds (limit = physical memory / 256 B per node)")
