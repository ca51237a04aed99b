"""`gather-at-start`: issue every parameter all-gather at the top of its function.

The unbounded-prefetch schedule some Chakra generators emit (every FSDP
gather free to start at t=0): the opposite extreme of a captured step,
which gathers each weight right before its use. Compare both, and FSDP2's
one-ahead prefetch, with `flint estimate --passes`.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import BlockArgument
from xdsl.passes import ModulePass
from xdsl.rewriter import InsertPoint, Rewriter

from flint.ir import dist


@dataclass(frozen=True)
class GatherAtStartPass(ModulePass):
    """Move every asynchronous all-gather of a function argument to the top of its function.

    Starts keep their relative order and their waits stay where they are, so
    each gather overlaps everything before its first use. Only gathers whose
    input is an argument of the function move (a parameter shard, resident
    before the step starts); anything else cannot start earlier than its
    producer. ``kind`` selects the collectives to move: ``all_gather``
    (default) or ``all`` (every asynchronous collective of an argument).
    """

    name = "gather-at-start"

    kind: str = "all_gather"

    def __post_init__(self) -> None:
        if self.kind not in ("all_gather", "all"):
            raise ValueError(f"{self.name}: option kind must be 'all_gather' or 'all', got '{self.kind}'")

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        for fn in op.ops:
            if not isinstance(fn, func.FuncOp):
                continue
            block = fn.body.block
            movable = [
                o for o in block.ops
                if isinstance(o, dist.CollectiveOp) and o.is_async
                and (self.kind == "all" or isinstance(o, dist.AllGatherOp))
                and isinstance(o.input, BlockArgument)
            ]
            first = block.first_op
            for start in movable:  # in program order, each before the first op that is not a moved start
                if start is first:
                    first = start.next_op
                    continue
                start.detach()
                Rewriter.insert_op(start, InsertPoint.before(first))
