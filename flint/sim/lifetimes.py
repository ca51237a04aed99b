"""Per-rank tensor lifetimes of a training step's IR, for :func:`flint.sim.memory.peak_memory`.

Input is the step as the capture/importer writes it: `func.func`s of `aten`
and `dist` ops, the module's ``flint.schedule`` (which function runs when,
how many times) and each argument's ``flint.role``. The IR is SPMD, so the
result holds for every rank of the grid.

Schedule positions
------------------
Every op of a function (``func.return`` excluded) is one position; one
iteration of a function repeated ``N`` times occupies ``N`` consecutive runs
of its positions. A repeated function is analysed once; its allocations are
replicated with numpy per iteration (never as IR ops), so a 126-layer model
costs 126 rows per allocation, not 126 analyses.

What allocates, and for how long
--------------------------------
- *Resident state* (live the whole step): arguments with role
  ``parameter`` (category ``params``), ``master`` (fp32 master copies) /
  ``exp_avg`` / ``exp_avg_sq`` / ``step`` (``optimizer``), ``buffer`` and ``input`` (batch data)
  (``other``), times the function's repeat count (with several schedule
  entries, its largest: entries of one function are taken to be the same
  layers run again, e.g. microbatches). The forward, backward and optimizer functions
  of one part all name the same parameters, so functions are grouped (same
  name stem once ``fwd``/``bwd``/``optim``/``forward``/``backward`` is
  stripped; a forward and the backward it is paired with; an optimizer
  function whose parameter types equal exactly one forward's) and each role is
  counted once per group, as the largest of the group members' counts.
  Arguments without a role of the first scheduled function count as resident
  ``other`` (nothing produced them). A backward paired with a forward (below)
  takes its parameters from that forward and does not count them again; where
  they are larger (kept unsharded from forward to backward: ZeRO-2, and the
  head under ZeRO-3, as torchtitan's ``reshard_after_forward=False`` on
  ``[norm, output]``), the forward's unsharded parameters live to the end of its
  iteration, and from there the backward's whole parameters are allocated
  (``params``, beside the resident shards) to the last read of them in the
  backward iteration consuming it. FSDP2's post-backward reshards the group
  before its reduce-scatter copy-in; the captured program's saved weights die
  at that read.
- *Op results*: every `aten.op` result and every `dist` collective / recv
  result allocates its bytes at its op's position; category ``comm`` for
  `dist` results, ``activations`` for `aten` results (``other`` in the
  ``optim`` phase). A collective's result that is saved for backward (e.g.
  a tensor-parallel all-reduce output the norm backward reads) counts as
  ``activations``, one that is a gradient as ``grads``: ``comm`` is the
  transient communication buffers. Views (op class ``view``) and in-place
  ops (ATen names ending in ``_``) alias their first operand; ``dist.wait``
  aliases its future. A `dist.steps` (``micro-pipeline-tp``, ``decompose-collectives``)
  writes its carried buffers in place: its results alias its initial values (the
  per-step chunks in its body are not counted), and so does an ``aten.slice_scatter``
  marked ``flint.in_place`` (a placement into a buffer, no new tensor). A value is
  freed after the last op that uses it or any alias. After ``fuse-pointwise`` (which
  models ``torch.compile``), an op marked ``fusion_in_kernel`` allocates nothing: its
  value stays inside the fused kernel computing it (no reader outside that kernel, or
  inlined into each kernel reading it), as inductor never gives such a value a buffer.
- *Values leaving a function* (returned, or aliasing a returned value):
  - **saved for backward**: a backward function (one with ``tangent`` or
    ``saved`` arguments) is paired with the latest earlier forward whose
    trailing results have the types of the backward's leading non-tangent
    arguments, which is AOTAutograd's calling convention (forward returns
    ``outputs + saved``, backward takes ``saved + tangents``). Each backward
    iteration consumes the latest forward iteration (of its forward function,
    over all schedule entries) not consumed yet, so with ``N`` layers forward
    iteration ``i`` meets backward iteration ``N-1-i``; the saved value is
    freed after that iteration's last use of the argument. If no forward
    matches, the backward's ``saved`` arguments are matched alone against the
    trailing results; if that fails too, the saved
    values are only counted from the backward's start (an underestimate; the
    report's ``notes`` say so).
  - **zero-bubble halves** (``flint.backward_part``, from
    :mod:`flint.pipeline.backward_split`): the input part pairs with a
    forward as above and returns no gradient; what it returns after the input
    gradients (values the weight part reads, including saved arguments it
    passes through, whose memory it takes over) is "saved" for the weight
    part, which pairs with the input part of the same backward and returns
    only parameter gradients.
  - **accumulation without sync**: a schedule entry marked ``nosync``
    (``pipeline-split``'s gradient accumulation; FSDP2
    ``set_requires_gradient_sync(False)``, DDP ``no_sync``) skips its
    gradient reduce-scatters / all-reduces over those axes, so the gradients it
    returns and accumulates into are the unsharded ones (FSDP2 keeps them
    until the last microbatch's reduce-scatter; here they stay to the end of
    the step, an overestimate of the optimizer phase by the difference). With a
    ``reduce_dtype`` the cast of a skipped reduction's result back to the
    parameters' dtype is skipped too: FSDP2 accumulates the unsharded gradient
    in the reduce dtype (fp32 for Megatron-style runs).
  - **gradients**: backward results aligned with the paired forward's
    ``parameter`` arguments (AOTAutograd returns one gradient per forward
    input that requires one, in order; inputs whose type does not match the
    next result get none) are category ``grads`` and stay live to the end of
    the step (the optimizer reads them; they are released after it).
    Without a paired forward, results whose type is that of some
    ``gradient`` argument in the module count as gradients. When a backward
    function has several schedule entries (microbatches), its first entry's
    gradients are the buffers; later entries' gradients are added into them
    and freed at the end of their iteration.
  - **everything else** (the activation or activation-gradient handed on):
    freed after the next function iteration's last use of its non-resident
    arguments (``activation``, ``tangent``, unannotated), or at the end of
    the step after the last part.
  - A result aliasing a non-resident argument (e.g. a block saving its input
    for backward) takes that argument's memory over: the producer's output
    is released when the consumer starts and the consumer re-allocates the
    bytes at its first position, so nothing is counted twice.

- *Reduce-scatter inputs* (the flat gradient buffer FSDP2 reduces) are
  category ``comm``. FSDP2 keeps a group's reduce-scatter input
  (``comm_ctx.reduce_scatter_states``, at most one by default) until the next
  group's post-backward releases it just before forming its own (as
  ``FSDPMemTracker``'s ``Reduce Scatter`` category shows): here until the
  position before the next function iteration's first reduce-scatter input,
  so it overlaps that group's whole backward, including a gradient
  redistribution (tensor-parallel ``Replicate -> Shard`` copy) in its
  post-backward. The copy-in's last operand (the group's last gradient)
  lives through the reduce-scatter: ``foreach_reduce`` keeps it in a loop
  variable until it returns, past ``unsharded_grads.clear()`` and the
  reduce-scatter output's allocation (a 2 GB embedding gradient at
  Llama-3 8B's peak). When no reduce-scatter follows, it lives like a hand-off
  output (until the next iteration's last use of its non-resident
  arguments); in the step's last function, to the end of its iteration.

Schedule attributes
-------------------
Ops marked ``flint.prefetch = K`` (see :mod:`flint.ir.dist`; set by
``reorder-all-gather``) in a function repeated ``N`` times run ``K``
iterations early: iteration ``j``'s gathered parameters are allocated at the
prefetched start's position in iteration ``j - K`` (its issue point's, when
``flint.prefetch_at`` names one; for ``j < K``: at the start of the
preceding part, where ``lower-to-chakra`` puts the prologue)
and freed after their last use in iteration ``j``. Prefetching one block
further keeps one more block's gathered parameters live. Under a pipeline
(each function runs once per schedule entry) a rank's forward runs that
gather form one chain, as in ``lower-to-chakra``: a run's gathered
parameters are allocated at the start of the run K gathering runs before it.

Approximations (say them when you quote a number): no allocator caching or
fragmentation, no kernel workspaces, no memory for ``dist.send`` buffers
beyond the tensor sent; one rule for hand-offs (all of a producer's hand-off
outputs live until the consumer's last use of any of its activation
arguments); backward iterations consume forward iterations last-in
first-out, which is right for layers, not for pipeline schedules that
interleave microbatches (1F1B); one SPMD program, so one answer for every
rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, StringAttr, TensorType
from xdsl.ir import SSAValue

from flint.cost import tensor_bytes
from flint.cost.flops import is_multi_tensor
from flint.cost.opclass import VIEW, classify_target, split_target
from flint.errors import FlintError
from flint.ir import dist
from flint.ir.aten import AtenOp, get_schedule, get_schedule_entries
from flint.passes.fuse_pointwise import IN_KERNEL_ATTR
from flint.passes.lower_to_chakra import ROLE_ATTR, frozen_args
from flint.sim.memory import MemoryReport, peak_memory

RESIDENT_CATEGORY = {"parameter": "params", "master": "optimizer", "exp_avg": "optimizer", "exp_avg_sq": "optimizer",
                     "step": "optimizer", "buffer": "other", "input": "other"}
_HANDOFF_ROLES = (None, "activation", "tangent", "unknown")
_PHASE_WORDS = frozenset({"fwd", "bwd", "optim", "opt", "forward", "backward", "optimizer"})


def _value_bytes(v: SSAValue) -> int:
    t = v.type
    if isinstance(t, dist.FutureType):
        t = t.value_type
    if not isinstance(t, TensorType):
        return 0
    return tensor_bytes(t.get_shape(), str(t.element_type))


def _is_view(op: AtenOp) -> bool:
    name = split_target(op.overload)[1]
    if name.endswith("_") and not is_multi_tensor(name):
        return True  # in-place: the result is its first operand (an in-place multi-tensor op has no result)
    return classify_target(op.overload) == VIEW


def _is_copy_out(op: AtenOp, base: dict, p: "_Profile") -> bool:
    """FSDP2's copy-out: ``split_with_sizes_copy`` of an all-gather's output into the unsharded parameters."""
    if split_target(op.overload)[1] != "split_with_sizes_copy" or not op.inputs:
        return False
    kind, i = base.get(op.inputs[0], ("none", -1))
    return kind == "alloc" and p.category[i] == "comm" and not p.held[i]


def _is_cat(op: AtenOp) -> bool:
    return split_target(op.overload)[1] == "cat"


def _gathers_parameters(v: SSAValue, args: list, roles: list[str | None]) -> list[AtenOp] | None:
    """The ops computing ``v`` (an all-gather's input) if it is computed from ``parameter`` arguments
    only (FSDP's copy-in), else None.

    The first operand of ``new_empty`` only gives the buffer's dtype and device, and an empty view
    (``as_strided`` to no elements) carries no data: both tie FSDP2's backward re-gather to the incoming
    gradient (:class:`flint.capture.recipes._BackwardUnshard`), so they do not count.
    """
    index = {a: i for i, a in enumerate(args)}
    seen: set = set()
    ops: list[AtenOp] = []
    todo, found = [v], False
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in index:
            if roles[index[v]] != "parameter":
                return None
            found = True
            continue
        owner = v.owner
        if not isinstance(owner, AtenOp):
            return None
        if owner not in ops:
            ops.append(owner)
        operands = list(owner.operands)
        if split_target(owner.overload)[1] == "new_empty":
            operands = operands[1:]
        elif split_target(owner.overload)[1] == "as_strided" and 0 in owner.outputs[0].type.get_shape():
            operands = []
        todo.extend(operands)
    return ops if found else None


def _roles(fn: func.FuncOp) -> list[str | None]:
    attrs = fn.arg_attrs.data if fn.arg_attrs is not None else ()
    out: list[str | None] = []
    for i in range(len(fn.body.block.args)):
        role = attrs[i].data.get(ROLE_ATTR) if i < len(attrs) else None
        out.append(role.data if isinstance(role, StringAttr) else None)
    return out


def _backward_part(fn: func.FuncOp) -> str | None:
    """``input`` / ``weight`` for the halves of a backward split for zero-bubble pipelines, else None."""
    from flint.pipeline.backward_split import PART_ATTR

    part = fn.attributes.get(PART_ATTR)
    return part.data if isinstance(part, StringAttr) else None


def _stem(name: str) -> str:
    """``block_fwd`` / ``bwd.block`` -> ``block``: the name without its phase words."""
    words = [w for w in re.split(r"[_.-]", name) if w]
    return "_".join(w for w in words if w.lower() not in _PHASE_WORDS) or name


@dataclass
class _Profile:
    """One function analysed once: its allocations relative to its own positions."""

    fn: func.FuncOp
    roles: list[str | None]
    n_pos: int
    # allocations (parallel lists)
    nbytes: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    last: list[int] = field(default_factory=list)
    category: list[str] = field(default_factory=list)
    result_of: list[list[int]] = field(default_factory=list)  # the function results it leaves as (if any)
    held: list[bool] = field(default_factory=list)  # a reduce-scatter input, held like a hand-off (docstring)
    param_gathers: list[int] = field(default_factory=list)  # allocations of FSDP parameter all-gathers
    # the unsharded parameters those gathers make: copy-out results, or the gather output nothing copies out of
    unsharded: list[int] = field(default_factory=list)
    # arguments
    arg_last_use: list[int] = field(default_factory=list)
    arg_returned: list[bool] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.fn.sym_name.data

    @property
    def args(self):
        return self.fn.body.block.args

    @property
    def result_types(self):
        return list(self.fn.function_type.outputs.data)

    def handoff_last_use(self) -> int:
        """Last local position using a non-resident argument that is not taken over (-1: none)."""
        uses = [u for u, r, ret in zip(self.arg_last_use, self.roles, self.arg_returned)
                if r in _HANDOFF_ROLES and not ret]
        return max(uses, default=-1)


def _profile(fn: func.FuncOp, prefetch: int = 0, nosync: frozenset[int] = frozenset()) -> _Profile:
    """Analyse ``fn`` once; ops marked ``flint.prefetch`` run ``prefetch`` iterations earlier.

    ``nosync``: grid axes whose gradient reduce-scatters / all-reduces this run skips (a schedule
    entry's ``nosync``, gradient accumulation): their result is their input, the unsharded gradient.
    """
    roles = _roles(fn)
    ops = [op for op in fn.body.block.ops if not isinstance(op, func.ReturnOp)]
    p = _Profile(fn, roles, max(len(ops), 1))
    early = {op for op in ops if dist.prefetch_of(op) > 0} if prefetch else set()
    # issued where their issue point runs (flint.prefetch_at), as lower-to-chakra issues them
    issue_at: dict = {}
    if early:
        index = {op: i for i, op in enumerate(ops)}
        issue_at = {op: index[point] for op, point in dist.prefetch_points(fn.body.block).items()
                    if point in index and index[point] > index[op]}
    args = list(fn.body.block.args)
    p.arg_last_use = [-1] * len(args)
    p.arg_returned = [False] * len(args)
    base: dict[SSAValue, tuple[str, int]] = {a: ("arg", i) for i, a in enumerate(args)}

    def use(v: SSAValue, at: int) -> None:
        b = base.get(v)
        if b is None:
            return
        kind, i = b
        if kind == "arg":
            p.arg_last_use[i] = max(p.arg_last_use[i], at)
        else:
            p.last[i] = max(p.last[i], at)

    made_by: dict[int, SSAValue] = {}  # allocation -> the value that made it

    def alloc(v: SSAValue, at: int, category: str) -> None:
        made_by[len(p.nbytes)] = v
        base[v] = ("alloc", len(p.nbytes))
        p.nbytes.append(_value_bytes(v))
        p.pos.append(at)
        p.last.append(at)
        p.category.append(category)
        p.result_of.append([])
        p.held.append(False)

    copy_outs: list[tuple[int, list[int]]] = []  # FSDP copy-outs: (all-gather allocation, its outputs)
    skipped: set[SSAValue] = set()  # results of skipped (nosync) gradient reductions, and their dtype casts
    for at, op in enumerate(ops):
        if op in early:  # a local position in an earlier iteration (negative when K iterations back)
            at = issue_at.get(op, at) - prefetch * p.n_pos
        for v in op.operands:
            use(v, at)
        if isinstance(op, dist.StepsOp):
            for out, init in zip(op.outs, op.inits):
                base[out] = base.get(init, ("none", -1))
        elif isinstance(op, AtenOp):
            if (_is_view(op) or dist.IN_PLACE_ATTR in op.attributes) and op.inputs:
                for r in op.outputs:
                    base[r] = base.get(op.inputs[0], ("none", -1))
            elif op.inputs and op.inputs[0] in skipped and split_target(op.overload)[1] == "_to_copy":
                # reduce_dtype: the skipped reduction's cast back to the parameters' dtype. FSDP2 accumulates
                # the unsharded gradient in reduce_dtype (to_accumulated_grad_if_needed) and casts only after
                # the last microbatch's reduce-scatter: it stays the (e.g. fp32) unsharded gradient
                for r in op.outputs:
                    base[r] = base.get(op.inputs[0], ("none", -1))
                    skipped.add(r)
            else:
                cat = "other" if op.phase is not None and op.phase.data == "optim" else "activations"
                copy_out = _is_copy_out(op, base, p)
                if copy_out:
                    cat = "comm"
                    source = base[op.inputs[0]][1]
                    copy_outs.append((source, list(range(len(p.nbytes), len(p.nbytes) + len(op.outputs)))))
                for r in op.outputs:
                    alloc(r, at, cat)
                    if IN_KERNEL_ATTR in op.attributes:  # fused, kept in its kernel: never written
                        p.nbytes[-1] = 0
        elif isinstance(op, dist.WaitOp):
            if op.result is not None:
                base[op.result] = base.get(op.future, ("none", -1))
                if op.future in skipped:
                    skipped.add(op.result)
        elif (nosync and isinstance(op, dist.ReduceScatterOp | dist.AllReduceOp) and op.group_size() > 1
              and set(op.axes()) <= nosync):
            base[op.result] = base.get(op.input, ("none", -1))  # skipped: the gradient stays unsharded
            skipped.add(op.result)
        elif isinstance(op, dist.CollectiveOp | dist.RecvOp):
            if isinstance(op, dist.ReduceScatterOp):
                for v in op.operands:
                    kind, i = base.get(v, ("none", -1))
                    if kind == "alloc":
                        p.held[i] = True
                        p.category[i] = "comm"
                        # FSDP2's foreach_reduce keeps the group's last gradient (a loop variable of
                        # its copy-in preparation) until it returns, past the copy-in (chunk_cat)
                        # and the reduce-scatter output's allocation.
                        copy_in = made_by[i].owner
                        if isinstance(copy_in, AtenOp) and copy_in.operands and _is_cat(copy_in):
                            kind, g = base.get(copy_in.operands[-1], ("none", -1))
                            if kind == "alloc":
                                p.last[g] = max(p.last[g], at)
            copy_in = _gathers_parameters(op.input, args, roles) if isinstance(op, dist.AllGatherOp) else None
            alloc(op.result, at, "comm")
            if copy_in is not None:
                # FSDP2 copies the shards in straight into the all-gather output's own slice
                # (all_gather_copy_in: the input is a view of the output), so the copy-in ops
                # allocate nothing of their own and the output exists from the first of them.
                gathered = len(p.nbytes) - 1
                p.param_gathers.append(gathered)
                for o in copy_in:
                    for r in o.results:
                        kind, i = base.get(r, ("none", -1))
                        if kind == "alloc":
                            p.nbytes[i] = 0
                            p.pos[gathered] = min(p.pos[gathered], p.pos[i])
        # dist.send / dist.barrier tokens hold no memory
    for source, group in copy_outs:
        # FSDP2 copies out in the group's pre-forward / pre-backward hook (at the start of the
        # iteration, or where the all-gather is issued if later), which frees the all-gather buffer
        # then; it frees the unsharded parameters together at its reshard (after the last use of any).
        start = max(p.pos[source], 0)
        end = max(p.last[i] for i in group)
        for i in group:
            p.pos[i] = min(p.pos[i], start)
            p.last[i] = end
        p.last[source] = start
    # A parameter all-gather nothing copies out of (FSDP2's re-gather before a backward that does not read
    # the weights, e.g. the embedding's) holds the unsharded parameters: FSDP2 frees them at its reshard,
    # before it forms the reduce-scatter input, even when the wait was sunk past that.
    sources = {s for s, _ in copy_outs}
    p.unsharded = [i for _, group in copy_outs for i in group] + [g for g in p.param_gathers if g not in sources]
    held = [p.pos[i] for i in range(len(p.nbytes)) if p.held[i]]
    if held:
        for g in p.param_gathers:
            if g not in sources and p.last[g] >= min(held):
                p.last[g] = max(p.pos[g], min(held) - 1)
    term = fn.body.block.last_op
    returned = list(term.operands) if isinstance(term, func.ReturnOp) else []
    taken_over: dict[int, int] = {}  # argument index -> its allocation
    for k, v in enumerate(returned):
        kind, i = base.get(v, ("none", -1))
        if kind == "alloc":
            p.result_of[i].append(k)
        elif kind == "arg" and (roles[i] in _HANDOFF_ROLES or roles[i] == "saved" and _backward_part(fn) == "input"):
            if not p.arg_returned[i]:
                # The consumer takes the argument's memory over (module docstring).
                p.arg_returned[i] = True
                taken_over[i] = len(p.nbytes)
                p.nbytes.append(_value_bytes(args[i]))
                p.pos.append(0)
                p.last.append(max(p.arg_last_use[i], 0))
                p.category.append("activations")
                p.result_of.append([])
                p.held.append(False)
            p.result_of[taken_over[i]].append(k)
    return p


@dataclass
class _Pair:
    fwd: str                   # the forward function's name ("" when none matched)
    saved_results: list[int]   # forward result indices, in the order of ...
    saved_args: list[int]      # ... the backward argument indices they become
    grad_results: set[int]     # backward result indices that are parameter gradients


def _types(values) -> list:
    return [v.type for v in values]


def _pair_backward(b: _Profile, candidates: list[_Profile], grad_types: set) -> tuple[_Pair | None, str | None]:
    roles = b.roles
    if not any(r in ("saved", "tangent") for r in roles):
        return None, None
    # A backward split for zero-bubble pipelines (flint.pipeline.backward_split): its input part pairs
    # with forwards only and returns no parameter gradient; its weight part pairs with the input part
    # it came from (which returns the values it needs last) and returns only parameter gradients.
    part = _backward_part(b.fn)
    if part is not None:
        from flint.pipeline.backward_split import OF_ATTR

        of = b.fn.attributes[OF_ATTR]
        if part == "input":
            candidates = [f for f in candidates if _backward_part(f.fn) is None]
        else:
            candidates = [f for f in candidates if _backward_part(f.fn) == "input" and f.fn.attributes[OF_ATTR] == of]
        pair, note = _pair_backward_by_types(b, candidates, grad_types)
        if pair is not None:
            pair.grad_results = set(range(len(b.result_types))) if part == "weight" else set()
        return pair, note
    return _pair_backward_by_types(b, candidates, grad_types)


def _pair_backward_by_types(b: _Profile, candidates: list[_Profile], grad_types: set) -> tuple[_Pair | None, str | None]:
    roles = b.roles
    first_tangent = next((i for i, r in enumerate(roles) if r == "tangent"), len(roles))
    attempts = [list(range(first_tangent)), [i for i, r in enumerate(roles) if r == "saved"]]
    for saved_args in attempts:
        if not saved_args:
            continue
        want = [b.args[i].type for i in saved_args]
        ordered = sorted(reversed(candidates), key=lambda f: _stem(f.name) != _stem(b.name))  # same stem first
        for f in ordered:
            outs = f.result_types
            if len(outs) >= len(want) and outs[len(outs) - len(want):] == want:
                first = len(outs) - len(want)
                return _Pair(f.name, list(range(first, len(outs))), saved_args,
                             _align_grads(f, b.result_types)), None
    note = (f"@{b.name}: no forward function returns its saved values (types of its leading arguments); "
            "saved activations are counted from its start only (an underestimate)")
    grads = {k for k, t in enumerate(b.result_types) if t in grad_types}
    return _Pair("", [], [], grads), note


def _align_grads(f: _Profile, b_results: list) -> set[int]:
    """Backward results that are gradients of the forward's parameters (module docstring)."""
    grads: set[int] = set()
    k = 0
    frozen = frozen_args(f.fn)
    for i, (arg, role) in enumerate(zip(f.args, f.roles)):
        if k < len(b_results) and role in ("parameter", "activation", None, "unknown") and i not in frozen \
                and b_results[k] == arg.type:
            if role == "parameter":
                grads.add(k)
            k += 1
    if k < len(b_results):  # alignment failed: fall back to types
        ptypes = {a.type for a, r in zip(f.args, f.roles) if r == "parameter"}
        grads = {i for i, t in enumerate(b_results) if t in ptypes}
    return grads


@dataclass(frozen=True)
class StepMemory:
    """Peak memory of one rank over the step, plus where it happens."""

    report: MemoryReport
    peak_function: str
    peak_iteration: int
    peak_op_index: int
    positions: int
    notes: tuple[str, ...] = ()
    #: the op running at the peak: its name (the ATen overload for aten.op), module path and source line
    peak_op: str = ""
    peak_module: str = ""
    peak_source: str = ""

    @property
    def peak_bytes(self) -> int:
        return self.report.peak_bytes

    def summary(self) -> str:
        return (f"{self.report.summary()} (in @{self.peak_function} iteration {self.peak_iteration}, "
                f"op {self.peak_op_index})")


class _Groups:
    def __init__(self, names: Sequence[str]) -> None:
        self.parent = {n: n for n in names}

    def find(self, n: str) -> str:
        while self.parent[n] != n:
            self.parent[n] = self.parent[self.parent[n]]
            n = self.parent[n]
        return n

    def union(self, a: str, b: str) -> None:
        self.parent[self.find(a)] = self.find(b)


def step_memory(module: ModuleOp, capacity_bytes: int | None = None, role: int = 0) -> StepMemory:
    """Peak memory per rank of the step in ``module`` (module docstring for the rules).

    A pipelined module has one schedule per pipeline rank: ``role`` picks it
    (the answer holds for the ranks at that ``pp`` coordinate).
    """
    funcs = {f.sym_name.data: f for f in module.ops if isinstance(f, func.FuncOp)}
    if not funcs:
        raise FlintError("memory estimate needs the step's func.func functions (aten + dist IR); "
                         "an already lowered chakra.graph has no tensors left")
    try:
        schedule = get_schedule(module, role)
    except Exception as e:  # VerifyException from a malformed schedule attribute
        raise FlintError(str(e)) from None
    from flint.passes.lower_to_chakra import prefetch_depth

    counts: dict[str, int] = {}
    for name, c in schedule:
        counts[name] = max(counts.get(name, 0), c)
    profiles = {name: _profile(fn, prefetch_depth(fn, counts.get(name, 1))) for name, fn in funcs.items()}
    notes: list[str] = []
    # Gradient accumulation without sync (pipeline-split's nosync entries: FSDP2
    # set_requires_gradient_sync(False), DDP no_sync): those runs skip their gradient reduce-scatters /
    # all-reduces, so the gradients they return, and keep accumulating into, are the unsharded ones.
    nosync_profiles: dict[int, _Profile] = {}
    options = [o for _, _, o in get_schedule_entries(module, role)]
    if any(o.get("nosync") for o in options):
        from flint.chakra.from_ir import mesh_of

        index = {n: i for i, n in enumerate(mesh_of(module).axis_names)}
        for e, ((name, c), o) in enumerate(zip(schedule, options)):
            axes = frozenset(index[a] for a in o.get("nosync", ()) if a in index)
            if axes:
                nosync_profiles[e] = _profile(funcs[name], prefetch_depth(funcs[name], counts.get(name, 1)), axes)

    # Pair every backward entry with its forward function, then every backward iteration with
    # a forward iteration: the latest one not consumed yet (a stack of forward instances).
    grad_types = {a.type for p in profiles.values() for a, r in zip(p.args, p.roles) if r == "gradient"}
    pairs: dict[int, _Pair] = {}  # backward entry -> pair
    stacks: dict[str, list[tuple[int, int]]] = {}  # forward name -> unconsumed (entry, iteration)
    consumer: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # forward entry -> (backward entry, iteration) per iteration
    fwd_names: set[str] = set()
    for e, (name, c) in enumerate(schedule):
        earlier = [profiles[n] for n, _ in schedule[:e]]
        pair, note = _pair_backward(profiles[name], earlier, grad_types)
        if note and note not in notes:
            notes.append(note)
        if pair is not None:
            pairs[e] = pair
            fwd_names.add(pair.fwd)
    for e, (name, c) in enumerate(schedule):
        if name in fwd_names:
            consumer[e] = (np.full(c, -1, dtype=np.int64), np.full(c, -1, dtype=np.int64))
            stacks.setdefault(name, []).extend((e, j) for j in range(c))
        pair = pairs.get(e)
        if pair is not None and pair.fwd:
            stack = stacks.get(pair.fwd, [])
            for i in range(c):
                if not stack:
                    note = (f"@{name} runs more often than @{pair.fwd} before it; its extra iterations have no "
                            "saved values")
                    if note not in notes:
                        notes.append(note)
                    break
                fe, fj = stack.pop()
                consumer[fe][0][fj] = e
                consumer[fe][1][fj] = i

    # Resident state, counted once per group of functions.
    groups = _Groups(list(funcs))
    by_stem: dict[str, str] = {}
    for n in funcs:
        s = _stem(n)
        if s in by_stem:
            groups.union(n, by_stem[s])
        by_stem.setdefault(s, n)
    for be, pair in pairs.items():
        if pair.fwd:
            groups.union(schedule[be][0], pair.fwd)

    def param_types(p: _Profile) -> list:
        return sorted((str(a.type) for a, r in zip(p.args, p.roles) if r == "parameter"))

    def is_optim(p: _Profile) -> bool:
        return any(r in ("exp_avg", "exp_avg_sq") for r in p.roles)

    def is_bwd(p: _Profile) -> bool:
        return any(r in ("saved", "tangent") for r in p.roles)

    for n, p in profiles.items():
        if is_optim(p):
            match = [f for f, q in profiles.items() if f != n and not is_optim(q) and not is_bwd(q)
                     and param_types(q) == param_types(p) and counts.get(f) == counts.get(n)]
            if len(match) == 1:
                groups.union(n, match[0])

    def param_bytes(p: _Profile) -> int:
        return sum(_value_bytes(a) for a, r in zip(p.args, p.roles) if r == "parameter")

    # A paired backward's parameters beyond its forward's are kept unsharded from that forward (ZeRO-2,
    # FSDP's head under ZeRO-3): per forward iteration, the forward's unsharded parameters are held to its end,
    # where the kept ones are allocated, freed at its backward's last read of them.
    paired_fwd = {schedule[be][0]: pair.fwd for be, pair in pairs.items() if pair.fwd}
    # FSDP2 holds the unsharded parameters beside the sharded ones (which stay resident): the kept bytes are the
    # backward's whole parameters, not their excess over the shards
    kept_bytes = {b: whole if (whole := param_bytes(profiles[b])) > param_bytes(profiles[f]) else 0
                  for b, f in paired_fwd.items()}
    resident: dict[tuple[str, str], int] = {}
    for n, p in profiles.items():
        per_role: dict[str, int] = {}
        for a, r in zip(p.args, p.roles):
            if r in RESIDENT_CATEGORY and not (r == "parameter" and n in paired_fwd):
                per_role[r] = per_role.get(r, 0) + _value_bytes(a)
        for r, b in per_role.items():
            key = (groups.find(n), r)
            resident[key] = max(resident.get(key, 0), b * counts.get(n, 1))
    first = profiles[schedule[0][0]]
    unowned = sum(_value_bytes(a) for a, r in zip(first.args, first.roles) if r in (None, "unknown"))

    # Global layout: entry e starts at offset[e]; iteration j at offset[e] + j * n_pos.
    offsets = [0]
    for name, c in schedule:
        offsets.append(offsets[-1] + c * profiles[name].n_pos)
    total = offsets[-1]

    def handoff_free(e: int, j: np.ndarray) -> np.ndarray:
        """Free position of hand-off outputs of iterations ``j`` of entry ``e``."""
        name, c = schedule[e]
        p = profiles[name]
        nxt_start = offsets[e] + (j + 1) * p.n_pos
        out = nxt_start + p.handoff_last_use()  # next iteration of the same function
        last = j == c - 1
        if e + 1 < len(schedule):
            q = profiles[schedule[e + 1][0]]
            out = np.where(last, offsets[e + 1] + q.handoff_last_use(), out)
        else:
            out = np.where(last, -1, out)
        return out

    def first_held(e: int) -> int:
        """Local position of entry ``e``'s first reduce-scatter input (-1: none)."""
        q = nosync_profiles.get(e, profiles[schedule[e][0]])
        return min((q.pos[i] for i in range(len(q.nbytes)) if q.held[i]), default=-1)

    def next_reduce_scatter_input(e: int, j: np.ndarray) -> np.ndarray:
        """Position where the next group's reduce-scatter input is formed after iterations ``j`` of
        entry ``e`` (FSDP2's post-backward releases the previous group's there), -1 if none follows."""
        name, c = schedule[e]
        here = first_held(e)
        out = np.where(here >= 0, offsets[e] + (j + 1) * profiles[name].n_pos + here, -1)
        if e + 1 < len(schedule) and (nxt := first_held(e + 1)) >= 0:
            out = np.where(j == c - 1, offsets[e + 1] + nxt, out)
        else:
            out = np.where(j == c - 1, -1, out)
        return out

    accumulate_from: dict[str, int] = {}  # backward name -> its first schedule entry
    for e, (name, _) in enumerate(schedule):
        accumulate_from.setdefault(name, e)
    # A pipeline's forward gathering runs are one chain (lower-to-chakra's gather_chain): a run's gathers
    # are allocated at the start of the first run that issues them.
    chained_from: dict[int, int] = {}
    if "flint.pipeline" in module.attributes:
        from flint.passes.lower_to_chakra import gather_chain

        for e, later in gather_chain(funcs, get_schedule_entries(module, role)).items():
            for f in later:
                chained_from.setdefault(f, e)
    cols_bytes, cols_pos, cols_free, cols_cat = [], [], [], []
    for e, (name, c) in enumerate(schedule):
        p = nosync_profiles.get(e, profiles[name])
        if not p.nbytes:
            continue
        j = np.arange(c, dtype=np.int64)
        start = offsets[e] + j * p.n_pos                                 # [c]
        nb = np.asarray(p.nbytes, dtype=np.int64)
        lp = np.asarray(p.pos, dtype=np.int64)
        ll = np.asarray(p.last, dtype=np.int64)
        cat = np.asarray(p.category, dtype=object)
        # Prefetched iterations 0..K-1 are issued where lower-to-chakra puts its prologue: at the
        # start of the preceding part when it runs once, else where this entry starts.
        prologue = offsets[e - 1] if e > 0 and schedule[e - 1][1] == 1 else offsets[e]
        alloc = np.maximum(start[:, None] + lp[None, :], prologue)       # [c, a]
        if (p.param_gathers and c == 1 and e > 0 and is_bwd(p)
                and (k_prev := prefetch_depth(funcs[schedule[e - 1][0]], schedule[e - 1][1])) > 0):
            # FSDP2's backward prefetch: the pre-backward of the preceding part's last K iterations
            # (layers) already issues this part's all-gather (e.g. the embedding's after layer 0).
            c_prev = schedule[e - 1][1]
            issued = offsets[e - 1] + (c_prev - k_prev) * profiles[schedule[e - 1][0]].n_pos
            alloc[:, p.param_gathers] = issued
        if e in chained_from and p.param_gathers:
            alloc[:, p.param_gathers] = offsets[chained_from[e]]
        free = np.maximum(start[:, None] + ll[None, :], prologue)
        # outputs leaving the function
        own_pair = pairs.get(e)
        grads = own_pair.grad_results if own_pair else set()
        hand = handoff_free(e, j)                                        # [c]
        # per iteration: which backward entry / iteration consumes its saved values (-1: none)
        cons_e, cons_i = consumer.get(e, (np.full(c, -1, dtype=np.int64), np.full(c, -1, dtype=np.int64)))
        saved_until: dict[int, np.ndarray] = {}  # forward result index -> free position per iteration
        for be in np.unique(cons_e[cons_e >= 0]).tolist():
            bp = profiles[schedule[be][0]]
            rows = cons_e == be
            for k, arg in zip(pairs[be].saved_results, pairs[be].saved_args):
                until = saved_until.setdefault(k, hand.copy())
                until[rows] = offsets[be] + cons_i[rows] * bp.n_pos + max(bp.arg_last_use[arg], 0)
        for be in np.unique(cons_e[cons_e >= 0]).tolist():
            bname = schedule[be][0]
            if kept_bytes.get(bname):
                rows = np.nonzero(cons_e == be)[0]
                # the forward's unsharded parameters live to its end, where the kept ones take over
                end_fwd = start[rows] + p.n_pos - 1
                for u in p.unsharded:
                    free[rows, u] = np.where(free[rows, u] == -1, -1, np.maximum(free[rows, u], end_fwd - 1))
                cols_bytes.append(np.full(rows.size, kept_bytes[bname], dtype=np.int64))
                cols_pos.append(end_fwd)
                # freed after the backward's last read of them (FSDP2's post-backward reshards the group
                # before its reduce-scatter copy-in; the captured path's saved weights die at that read)
                bp = profiles[bname]
                end = max((bp.arg_last_use[a] for a, r in enumerate(bp.roles) if r == "parameter"), default=-1)
                if end < 0:  # no read: FSDP2's reshard before the reduce-scatter copy-in, else the iteration's end
                    end = held - 1 if (held := first_held(be)) > 0 else bp.n_pos - 1
                cols_free.append(offsets[be] + cons_i[rows] * bp.n_pos + end)
                cols_cat.append(np.full(rows.size, "params", dtype=object))
        if any(p.held):  # reduce-scatter inputs: until the next group's reduce-scatter input is formed
            held_until = np.where(hand == -1, start + p.n_pos - 1, hand)  # the step's last part: its own end
            nxt = next_reduce_scatter_input(e, j)
            held_until = np.where(nxt >= 0, nxt - 1, held_until)
        for a in np.nonzero(p.held)[0].tolist():
            free[:, a] = np.where(free[:, a] == -1, -1, np.maximum(free[:, a], held_until))
        for a, ks in enumerate(p.result_of):
            if not ks:
                continue
            if any(k in grads for k in ks):
                # The first backward entry of a function allocates the gradients; later entries
                # (microbatches) add into them: their results are freed at their iteration's end.
                free[:, a] = -1 if accumulate_from[name] == e else start + p.n_pos - 1
                cat[a] = "grads"
                continue
            for k in ks:  # a value returned several times lives until its latest consumer
                if k in saved_until:
                    cat[a] = "activations"  # saved for backward, whoever produced it
                    until = saved_until[k]
                else:
                    until = hand
                free[:, a] = np.where((free[:, a] == -1) | (until == -1), -1, np.maximum(free[:, a], until))
        free = np.where(free == -1, -1, np.maximum(free, alloc))
        cols_bytes.append(np.broadcast_to(nb, alloc.shape).ravel())
        cols_pos.append(alloc.ravel())
        cols_free.append(free.ravel())
        cols_cat.append(np.broadcast_to(cat, alloc.shape).ravel())
    for (g, role), b in sorted(resident.items()):
        cols_bytes.append(np.array([b]))
        cols_pos.append(np.array([0]))
        cols_free.append(np.array([-1]))
        cols_cat.append(np.array([RESIDENT_CATEGORY[role]], dtype=object))
    if unowned:
        cols_bytes.append(np.array([unowned]))
        cols_pos.append(np.array([0]))
        cols_free.append(np.array([-1]))
        cols_cat.append(np.array(["other"], dtype=object))
    nbytes = np.concatenate(cols_bytes) if cols_bytes else np.zeros(0, np.int64)
    pos = np.concatenate(cols_pos) if cols_pos else np.zeros(0, np.int64)
    free = np.concatenate(cols_free) if cols_free else np.zeros(0, np.int64)
    cats = np.concatenate(cols_cat).tolist() if cols_cat else []
    # Allocations live to the end of the step ("-1") also cover positions nobody allocates at.
    if nbytes.size and total > 0:
        nbytes = np.append(nbytes, 0)
        pos = np.append(pos, total - 1)
        free = np.append(free, total - 1)
        cats.append("other")
    report = peak_memory(nbytes, free, cats, pos, capacity_bytes)
    e = int(np.searchsorted(offsets, report.peak_position, side="right") - 1)
    e = min(max(e, 0), len(schedule) - 1)
    name = schedule[e][0]
    it, op_index = divmod(report.peak_position - offsets[e], profiles[name].n_pos)
    op_name, module_path, source = _describe_op(profiles[name].fn, int(op_index))
    return StepMemory(report, name, int(it), int(op_index), int(total), tuple(notes), op_name, module_path, source)


def _describe_op(fn: func.FuncOp, index: int) -> tuple[str, str, str]:
    """(op name, module path, ``file:line``) of the ``index``-th op of ``fn`` (positions skip the return)."""
    ops = [op for op in fn.body.block.ops if not isinstance(op, func.ReturnOp)]
    if not 0 <= index < len(ops):
        return "", "", ""
    op = ops[index]
    name = op.target.data if isinstance(op, AtenOp) else op.name
    module_path = op.module.data if isinstance(op, AtenOp) and op.module is not None else ""
    loc = getattr(op, "location", None)
    source = ""
    if loc is not None and hasattr(loc, "filename") and hasattr(loc, "line"):
        source = f"{loc.filename.data}:{loc.line.data}"
    return name, module_path, source
