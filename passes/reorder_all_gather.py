"""`reorder-all-gather`: issue FSDP parameter all-gathers K blocks ahead of their use (or delay them)."""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import IntegerAttr, ModuleOp, StringAttr, i64
from xdsl.ir import Operation
from xdsl.passes import ModulePass

from flint.errors import FlintError, remark
from flint.ir import dist
from flint.ir.aten import AtenOp, get_schedule
from flint.passes.scheduling import (arg_roles, first_user, functions, is_view, make_async, move_before,
                                    move_to_top)


def parameter_gather_slice(op: dist.AllGatherOp, fn: func.FuncOp) -> list[Operation] | None:
    """The ops computing ``op``'s input from parameter arguments only (the FSDP copy-in), or None.

    An all-gather is an FSDP parameter gather when its input is computed by
    `aten` ops (views, the flat-buffer ``cat``) from arguments whose
    ``flint.role`` is ``parameter``, and nothing else uses those ops'
    results: then the gather and its copy-in can run at any earlier point.
    """
    roles = arg_roles(fn)
    block = fn.body.block
    found: set[Operation] = set()
    todo = [op.input]
    while todo:
        v = todo.pop()
        owner = v.owner
        if owner is block:  # a block argument
            if roles.get(v) != "parameter":
                return None
            continue
        if not isinstance(owner, AtenOp):
            return None
        if owner not in found:
            found.add(owner)
            todo.extend(owner.operands)
    for o in found:
        for r in o.results:
            if any(u.operation not in found and u.operation is not op for u in r.uses):
                return None
    return [o for o in block.ops if o in found]


def fsdp_gathers(module: ModuleOp) -> list[tuple[func.FuncOp, dist.AllGatherOp, list[Operation]]]:
    """Every FSDP parameter all-gather of the module with its copy-in slice, in program order."""
    out = []
    for fn in functions(module):
        for op in list(fn.body.block.ops):
            if isinstance(op, dist.AllGatherOp):
                sl = parameter_gather_slice(op, fn)
                if sl is not None:
                    out.append((fn, op, sl))
    return out


@dataclass(frozen=True)
class ReorderAllGatherPass(ModulePass):
    """Issue each FSDP parameter all-gather K blocks ahead of its first use, or delay it.

    An FSDP parameter all-gather is one whose input is computed from
    ``parameter`` arguments only (the copy-in; see
    :func:`parameter_gather_slice`). For each, in forward and in backward:

    - ``prefetch=K`` (K >= 1): the gather and its copy-in move to the top of
      their function and, in a repeated function (the block, N times in the
      schedule), are marked ``flint.prefetch = K``: iteration ``i`` issues
      block ``i + K``'s gather, iterations ``0..K-1`` are issued at the start of
      the preceding part (e.g. during the embedding's forward, during the
      head's backward), the last K iterations issue nothing. The wait stays
      before the first use. The IR keeps one body; ``lower-to-chakra`` and the
      memory model (:mod:`flint.sim.lifetimes`) honour the attribute, so the
      gathered parameters live from K blocks before their use: peak memory
      rises by one block's gathered parameters per extra block of prefetch.
      In a repeated block of several FSDP groups (layers), K counts groups
      instead, as FSDP2 prefetches one module ahead
      (:meth:`_prefetch_groups`).
      In a function that runs once, the gather moves to the top (K has no
      earlier iteration to reach). Under a pipeline (``flint.pipeline``: each
      function runs once per schedule entry) every gather is marked:
      ``lower-to-chakra`` chains a rank's forward runs that gather, each
      issuing the gathers of the K such runs after it (Megatron-LM's gather
      handles, numbered across model chunks).
    - ``prefetch=0``: the gather and its copy-in move to the top of their
      function (issued when the block starts, as FSDP2 does without prefetch).
    - ``prefetch=0 delay=true``: the memory-saving variant: each gather moves
      right before its first use, its wait right after it. A collective
      waits for the compute before it in program order (``lower-to-chakra``'s
      issue point), so this is the synchronization dependency: block ``i``'s
      gather starts only once block ``i - 1``'s compute is done, and at most
      one gathered parameter set is live.

    A synchronous gather is split into its start and wait first. With no FSDP
    gather in the module the pass says so (a remark on stderr) and changes
    nothing. Afterwards: the same ops and collectives, moved within their
    function; every start has its wait; data dependencies hold.

    Options: ``prefetch`` (>= 0, default 1), ``delay`` (default false; only
    with ``prefetch=0``).
    """

    name = "reorder-all-gather"

    prefetch: int = 1
    delay: bool = False

    def __post_init__(self) -> None:
        if self.prefetch < 0:
            raise FlintError(f"{self.name}: option prefetch={self.prefetch} must be >= 0 (blocks ahead of use)")
        if self.delay and self.prefetch != 0:
            raise FlintError(f"{self.name}: option delay=true needs prefetch=0 (got prefetch={self.prefetch}): "
                             "a delayed gather is issued right before its use")

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        gathers = fsdp_gathers(op)
        if not gathers:
            remark(f"{self.name}: no FSDP parameter all-gather (a dist.all_gather of 'parameter' arguments) "
                   "in the module; nothing reordered")
            return
        counts: dict[str, int] = {}
        for name, c in get_schedule(op):
            counts[name] = max(counts.get(name, 0), c)
        # a pipeline's gathering runs form one chain across functions and entries (lower-to-chakra)
        chained = "flint.pipeline" in op.attributes
        by_fn: dict[func.FuncOp, list[tuple[dist.AllGatherOp, list[Operation]]]] = {}
        for fn, gather, sl in gathers:
            by_fn.setdefault(fn, []).append((gather, sl))
        for fn, items in by_fn.items():
            repeated = counts.get(fn.sym_name.data, 1) > 1
            if self.prefetch and repeated and not chained and len(items) > 1:
                self._prefetch_groups(fn, items)
                continue
            top = None
            for gather, sl in items:
                start, wait = make_async(gather)
                block = fn.body.block
                if self.delay:
                    use = first_user([wait.result], block, set()) if wait.result is not None else None
                    anchor = use if use is not None else block.last_op
                    move_before([*sl, start, wait], anchor)
                    continue
                top = move_to_top([*sl, start], block, top)
                if self.prefetch and (chained or repeated):
                    _mark([*sl, start], self.prefetch)

    def _prefetch_groups(self, fn: func.FuncOp, items: list[tuple[dist.AllGatherOp, list[Operation]]]) -> None:
        """``prefetch`` FSDP groups ahead in a repeated function holding several (a block of layers).

        The groups are taken in the order the body first uses them; with G of
        them, group j's gather is issued when group j - K starts (counted
        across iterations: ceil((K - j) / G) iterations ahead for j < K). One
        in the same iteration moves right before that group's first use
        (its wait after it); one issued ahead stays at the top, marked
        ``flint.prefetch``, with ``flint.prefetch_at`` naming its issue point
        unless that is the top. When K > G is not a multiple of G, the groups
        cannot all be the same whole number of iterations ahead (one
        ``flint.prefetch`` per function): every gather goes ceil(K / G)
        iterations ahead from the top.
        """
        block = fn.body.block
        pairs = [(*make_async(gather), sl) for gather, sl in items]
        # where each group starts: its first use beyond the copy-out (FSDP2 waits and copies out in the module's
        # pre-forward / pre-backward hook), which a captured backward may hold at its top, ahead of the layer
        outs = [[wait, *_copy_out(wait)] for _, wait, _ in pairs]
        uses = []
        for out in outs:
            chain = set(out)
            use = first_user([r for o in out for r in o.results], block, chain)
            move_before([o for o in block.ops if o in chain], use if use is not None else block.last_op)
            uses.append(use)
        pos = {o: i for i, o in enumerate(block.ops)}
        order = sorted(range(len(pairs)), key=lambda i: pos[uses[i]] if uses[i] is not None else len(pos))
        n, k = len(pairs), self.prefetch
        top = None
        if k > n and k % n:
            for start, _, sl in (pairs[i] for i in order):
                top = move_to_top([*sl, start], block, top)
                _mark([*sl, start], -(-k // n))
            return
        for j, i in enumerate(order):
            start, wait, sl = pairs[i]
            p = (j - k) % n  # the group whose start issues this gather
            anchor = uses[order[p]]
            ahead = -(-(k - j) // n) if j < k else 0
            if ahead == 0:
                move_before([*sl, start], anchor if anchor is not None else block.last_op)
                ops = list(block.ops)
                if ops.index(wait) < ops.index(start):  # its wait and copy-out after it (the same first use)
                    move_before([o for o in ops if o in outs[i]], uses[i] if uses[i] is not None else block.last_op)
                continue
            top = move_to_top([*sl, start], block, top)
            _mark([*sl, start], ahead)
            if p != 0 and anchor is not None:
                label = anchor.attributes.get(dist.PREFETCH_POINT_ATTR)
                if not isinstance(label, StringAttr):
                    label = StringAttr(f"group{j}")
                    anchor.attributes[dist.PREFETCH_POINT_ATTR] = label
                for o in (*sl, start):
                    o.attributes[dist.PREFETCH_AT_ATTR] = label


#: FSDP's copy-out of a gathered buffer into the parameters, besides views (flint.passes.scheduling.is_view)
_COPY_OUT = frozenset({"aten.split_with_sizes_copy.default", "aten.split_with_sizes.default"})


def _copy_out(wait: dist.WaitOp) -> list[Operation]:
    """The ops that only reshape or split the gathered buffer (views, ``split_with_sizes_copy``), reading
    nothing else."""
    found: set[Operation] = set()
    todo = [wait.result]
    while todo:
        for u in todo.pop().uses:
            o = u.operation
            if (o not in found and (is_view(o) or (isinstance(o, AtenOp) and o.overload in _COPY_OUT))
                    and all(v is wait.result or v.owner in found for v in o.operands)):
                found.add(o)
                todo.extend(o.results)
    return list(found)


def _mark(ops: list[Operation], ahead: int) -> None:
    for o in ops:
        o.attributes[dist.PREFETCH_ATTR] = IntegerAttr(ahead, i64)
