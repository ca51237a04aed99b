"""`sink-waits`: move each `dist.wait` as late as its first real use allows."""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation
from xdsl.passes import ModulePass

from flint.ir import dist
from flint.passes.scheduling import functions, is_view, move_before


def _view_closure(wait: dist.WaitOp) -> list[Operation]:
    """Views reachable from the wait's result through views only (they move with it)."""
    found: list[Operation] = []
    seen: set[Operation] = set()
    todo = [wait.result]
    while todo:
        v = todo.pop()
        for u in v.uses:
            o = u.operation
            if o not in seen and is_view(o):
                seen.add(o)
                found.append(o)
                todo.extend(o.results)
    return found


@dataclass(frozen=True)
class SinkWaitsPass(ModulePass):
    """Move each `dist.wait` down to just before the first op that needs its value.

    A wait is where the compute stream stops for a collective
    (``lower-to-chakra`` makes the next compute node wait for it), so a wait
    placed right after its start hides nothing. This pass moves every wait,
    together with the pure views of its result (they cost nothing and merely
    rename it), down to just before the first other op that uses the value;
    a wait whose value only leaves the function (e.g. a gradient
    reduce-scatter handed to the optimizer) moves to the end of the body, and
    the next part waits for it. Nothing else moves. Afterwards: the same ops,
    every wait after its start and before every use of its value.
    """

    name = "sink-waits"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        for fn in functions(op):
            block = fn.body.block
            for wait in [o for o in block.ops if isinstance(o, dist.WaitOp)]:
                if wait.result is None:
                    continue
                closure = _view_closure(wait)
                moving = {wait, *closure}
                users = {u.operation for o in moving for r in o.results for u in r.uses} - moving
                anchor = next((o for o in block.ops if o in users), None)
                if anchor is None or isinstance(anchor, func.ReturnOp):
                    anchor = block.last_op
                ordered = [o for o in block.ops if o in moving]
                # only ever later: stop at the first user, never above the wait's own position
                move_before(ordered, anchor)
