"""`canonicalize-dist`: simplify `dist` communication that does no work."""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass
from xdsl.rewriter import InsertPoint
from xdsl.pattern_rewriter import (
    GreedyRewritePatternApplier,
    PatternRewriter,
    PatternRewriteWalker,
    RewritePattern,
    op_type_rewrite_pattern,
)

from flint.ir import dist


def _only_wait(future) -> dist.WaitOp | None:
    """The single ``dist.wait`` using ``future``, if that is its only use."""
    uses = list(future.uses)
    if len(uses) == 1 and isinstance(uses[0].operation, dist.WaitOp):
        return uses[0].operation
    return None


@dataclass
class DropSingleRankCollective(RewritePattern):
    """A collective over a one-rank group returns its input unchanged."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: dist.CollectiveOp, rewriter: PatternRewriter) -> None:
        if op.group_size() != 1:
            return
        if op.is_async:
            wait = _only_wait(op.result)
            if wait is None:
                return
            rewriter.replace(wait, [], [op.input])
            rewriter.erase(op)
        else:
            rewriter.replace(op, [], [op.input])


@dataclass
class DropSingleRankBarrier(RewritePattern):
    """A barrier over a one-rank group waits for nobody."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: dist.BarrierOp, rewriter: PatternRewriter) -> None:
        if op.group_size() != 1:
            return
        if op.token is not None:
            wait = _only_wait(op.token)
            if wait is None:
                return
            rewriter.erase(wait)
        rewriter.erase(op)


@dataclass
class FoldImmediateWait(RewritePattern):
    """``%f = <async collective>; %t = dist.wait %f`` with nothing in between
    becomes the synchronous collective: an async start that is waited for at
    once overlaps nothing."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: dist.WaitOp, rewriter: PatternRewriter) -> None:
        start = op.future.owner
        if not isinstance(start, dist.CollectiveOp) or start.next_op is not op:
            return
        if dist.prefetch_of(start):  # its wait is in a later iteration of the block
            return
        if _only_wait(start.result) is not op:
            return
        sync = type(start).create(
            operands=[start.input],
            result_types=[op.result.type],
            properties=dict(start.properties),
            attributes=dict(start.attributes),
        )
        sync.location = start.location
        rewriter.insert(sync, InsertPoint.before(start))
        rewriter.replace(op, [], [sync.result])
        rewriter.erase(start)


@dataclass(frozen=True)
class CanonicalizeDistPass(ModulePass):
    """Drop collectives over one-rank groups and fold waits that directly follow their start.

    Rewrites, each guarded by an option:
    - ``drop-single-rank`` (default true): a collective whose group along its
      grid axes has one rank is replaced by its input (with its ``dist.wait``);
      a barrier over one rank is erased.
    - ``fold-waits`` (default true): an asynchronous collective whose only use
      is a ``dist.wait`` placed immediately after it becomes the synchronous
      form (not a start marked ``flint.prefetch``: its wait is in a later
      iteration).

    Afterwards the module verifies, computes the same values, and issues the
    same communication except the removed no-ops.
    """

    name = "canonicalize-dist"

    drop_single_rank: bool = True
    fold_waits: bool = True

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        patterns: list[RewritePattern] = []
        if self.drop_single_rank:
            patterns += [DropSingleRankCollective(), DropSingleRankBarrier()]
        if self.fold_waits:
            patterns.append(FoldImmediateWait())
        if patterns:
            PatternRewriteWalker(GreedyRewritePatternApplier(patterns)).rewrite_module(op)
