"""`hoist-starts`: issue asynchronous collectives as early as their inputs allow, bounded in flight."""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass

from flint.errors import FlintError
from flint.ir import dist
from flint.passes.scheduling import functions, move_before


@dataclass(frozen=True)
class HoistStartsPass(ModulePass):
    """Move every asynchronous collective start up to just after its input is computed.

    Starts are taken in program order and keep it (each communicator sees
    the same sequence); each moves up to right after the op producing its
    input (to the top of the function for an argument) or the previous start,
    but only as far as no point between its new and its old place has
    ``max-in-flight`` other collectives started and not yet waited, and never
    above a ``dist.barrier`` (a control dependency). Waits, synchronous collectives and starts marked
    ``flint.prefetch`` do not move. Afterwards: the same ops, every start
    after its input and before its wait, at most ``max-in-flight`` started
    collectives outstanding wherever a start was moved.

    Options: ``max-in-flight`` (>= 1, default 2).
    """

    name = "hoist-starts"

    max_in_flight: int = 2

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise FlintError(f"{self.name}: option max-in-flight={self.max_in_flight} must be >= 1")

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        for fn in functions(op):
            block = fn.body.block
            starts = [o for o in block.ops if isinstance(o, dist.CollectiveOp) and o.is_async
                      and dist.prefetch_of(o) == 0]
            prev = None
            for start in starts:
                ops = list(block.ops)
                pos = {o: i for i, o in enumerate(ops)}
                here = pos[start]
                producer = start.input.owner
                earliest = pos[producer] + 1 if producer in pos else 0
                if prev is not None:  # starts keep their order: every communicator sees the same sequence
                    earliest = max(earliest, pos[prev] + 1)
                prev = start
                # a barrier is a control dependency: no collective crosses it
                earliest = max([earliest] + [i + 1 for i in range(here) if isinstance(ops[i], dist.BarrierOp)])
                # others in flight just before position q: started above q, waited at or below q
                waits = {}
                for o in ops:
                    if isinstance(o, dist.CollectiveOp) and o.is_async and o is not start:
                        w = [u.operation for u in o.result.uses]
                        waits[o] = max((pos[x] for x in w if x in pos), default=len(ops))
                target = here
                for q in range(here, earliest - 1, -1):  # the start stays outstanding from q down to here
                    if sum(1 for o, w in waits.items() if pos[o] < q <= w) >= self.max_in_flight:
                        break
                    target = q
                if target < here:
                    move_before([start], ops[target])
