"""Mixture-of-experts rules for the sharding engine: routing, dispatch, expert matmuls, combine,
and expert parallelism along the plan's ``ep`` axes.

The single-device MoE step (``flint/models/moe.py``) routes with a gate
linear, softmax and ``topk``; dispatches with ``sort`` / ``index`` into an
``[experts, rows, hidden]`` buffer; runs the experts as ``bmm`` with stacked
weights; and combines with ``index_add`` (backward: ``index_select`` /
``index_put``). Under data parallelism every rank routes its own tokens:

- ``token_local`` ops (``rules.toml``) keep dim 0 split over the token axes:
  sorting, gathering and scattering use local indices into the rank's tokens.
- The dispatch view ``[tokens*top_k, hidden] -> [experts, rows, hidden]``
  puts the token split on ``rows`` (each rank holds 1/dp of every expert's
  rows); the combine view goes back.

With expert parallelism (``ep > 1``, torchtitan's ``ExpertParallel``) expert
weights are split on dim 0 over the ``ep`` axes (and stored split further
over ``expert_fsdp``, FSDP over ``dp_shard_mod_ep``, torchtitan's
``dp_mod_ep`` mesh). An expert ``bmm`` wants its token operand as
``[experts over ep, rows over the other token axes, hidden]``: going there
from the token layout is the dispatch ``dist.all_to_all`` (split experts,
concatenate rows) over all ``ep`` axes at once, and back is the combine;
backward runs the same two in reverse order. The forward of each MoE layer
first exchanges the token counts per expert (``aten.histc`` of the selected
experts, then an ``all_to_all`` of ``n_experts`` int64), as torchtitan's
``_token_dispatch`` does before its ``all_to_all_single``. Routing is
balanced (as the model captures it), so every (expert, source rank) pair
carries ``tokens * top_k / n_experts`` rows; ``Plan.capacity_factor``
sizes the dispatch buffers: each rank pads its rows per expert to
``ceil(capacity_factor * rows)`` before the all_to_all and the receiver
drops the padding before the experts (and the reverse for the combine), so
the bytes per peer are the plan's capacity while the expert FLOPs stay those
of the routed tokens. Expert gradients are reduced over the data-parallel
axes outside ``ep``: one flat reduce-scatter over ``expert_fsdp`` per unit
(a separate FSDP unit, as torchtitan shards experts with their own
``fully_shard``), then an all-reduce over ``dp_replicate``.

Under tensor parallelism (torchtitan's ``apply_moe_ep_tp``, before its ETP
deprecation) the MoE input is gathered over ``tp`` (with sequence
parallelism), the router runs replicated on every token, and the tp partial
sums the experts produce pass unreduced through the combine to one
reduction at the MoE output (and one of its input gradient in backward):

- ``ep = 1``: the experts are tensor-parallel (``TensorParallel``: ``w1``,
  ``w3`` column-, ``w2`` row-parallel over the expert hidden dim, ``tp_dim``
  in ``[[experts]]``).
- ``etp = tp`` (``ExpertTensorParallel``): split over ``ep`` and over
  ``tp``; every tp rank dispatches the same tokens and the combine
  all_to_all carries the tp partial sums.
- ``etp = 1``: ``ep`` borrows the tp ranks; each tp rank routes its 1/tp
  slice of the tokens (torchtitan's dispatcher with ``sp_size = tp``) and
  scatters the result into zeros, which is the tp partial sum.

Hugging Face's grouped-GEMM experts (``_grouped_mm`` over the rank's tokens sorted by expert, offsets the
cumsum of their ``histc`` counts) under ``ep`` run as transformers' ``AllToAllEP`` (``DistributedConfig(ep_size=...)``,
the training path of its ``ep_dispatch_experts`` style): the rank's sorted token rows go to their experts' ranks
with one ``all_to_all`` over the ``ep`` axes before the first expert GEMM, and the expert output comes back with a
second one before the routing weights multiply it; backward runs the reverse pair. Between the two, values are in
the *expert layout*: the same local shape (routing is balanced, so every rank receives as many rows as it sends),
rows of this rank's experts from every rank of the ep group; a hint (``EXPERT_ROWS``, the rows dim) marks them, and
the forward hands it to the backward with the values it saves. An op that mixes them with token-laid values (the
routing-weight product, the un-sort) gets them combined first; a grouped GEMM gets its token rows dispatched. The
token counts per expert are exchanged first (``all_to_all`` of ``n_experts`` counts; transformers then reads the
split sizes back to the host, which is not in the trace), and each rank's GEMM offsets are the cumsum of its local
experts' received counts. The expert weights are split over ``ep`` and are their own FSDP unit over
``expert_fsdp``, as transformers' ``apply_fully_sharded_data_parallelism`` shards them on its ``efsdp`` mesh.

Not built: ``ep`` together with ``cp``, and ``etp > 1`` where FSDP shards
the experts on dim 1; :func:`check_plan` refuses them by name. Hugging Face's grouped-GEMM experts under ``ep``:
not with ``tp`` (refused for their MoE layers on both paths), not with a ``capacity_factor`` (transformers'
all-to-all is dropless), not with expert biases (gpt-oss: refused by name); and the receiving rank's own pass of
transformers' experts forward over the rows it received (their expert ids built from the counts, a second sort and
gather by expert, the unit routing weights, the un-sort and sum over one slot) is not in the program: the experts'
GEMMs run on the received rows as they arrive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from xdsl.dialects import func
from xdsl.dialects.builtin import ArrayAttr, IntegerAttr, ModuleOp, StringAttr, TensorType, i64
from xdsl.ir import SSAValue

from flint.ir import dist
from flint.ir.aten import AtenOp
from flint.plan import Plan, PlanError
from flint.sharding.engine import FILL_OPS, ExpandError, FunctionExpander, Rule, _arg, _norm, shape_of, where
from flint.sharding.rules import Rules, load_rules
from flint.sharding.spec import Sharding


# ----------------------------------------------------------------- parameters


def _expert_tp(plan: Plan, tp_dim: int | None, rank: int) -> dict:
    """The tensor-parallel split of an expert weight: ``tp_dim`` over ``tp`` when the experts are
    tensor-parallel (``ep = 1`` under ``tp``: torchtitan's ``TensorParallel``; ``etp = tp``: its
    ``ExpertTensorParallel``), none when ``ep`` borrows the tp ranks (``etp = 1``)."""
    if tp_dim is None or plan.tp == 1 or tp_dim >= rank or (plan.ep > 1 and plan.etp == 1):
        return {}
    return {tp_dim: plan.axes("tp")}


def expert_compute_sharding(plan: Plan, rank: int, tp_dim: int | None = None) -> Sharding:
    """An expert weight in compute: dim 0 (the experts) split over the ``ep`` axes, and ``tp_dim``
    over ``tp`` with expert tensor parallelism."""
    return Sharding.split(rank, {**({0: plan.axes("ep")} if plan.ep > 1 else {}), **_expert_tp(plan, tp_dim, rank)})


def _efsdp_size(plan: Plan) -> int:
    mesh = plan.mesh()
    return math.prod(mesh.shape[mesh.axis_index(a)] for a in plan.axes("expert_fsdp"))


def expert_fsdp_dim(plan: Plan, n_experts: int | None) -> int:
    """The dim FSDP shards an expert weight on: 0, or 1 when ``expert_fsdp x ep`` exceeds the experts
    (torchtitan's ``apply_fsdp``: ``Shard(1)`` if ``dp_mod_ep.size() * ep > num_experts``)."""
    return 1 if n_experts is not None and _efsdp_size(plan) * plan.ep > n_experts else 0


def expert_storage_sharding(plan: Plan, rank: int, shape=None, tp_dim: int | None = None) -> Sharding:
    """An expert weight, its gradient and optimizer state: dim 0 over ``expert_fsdp`` then ``ep``, or
    dim 0 over ``ep`` and dim 1 over ``expert_fsdp`` (see :func:`expert_fsdp_dim`); with expert tensor
    parallelism ``tp_dim`` over ``tp`` as in compute."""
    efsdp, ep = tuple(plan.axes("expert_fsdp")), tuple(plan.axes("ep"))
    tp = _expert_tp(plan, tp_dim, rank)
    if efsdp and rank >= 2 and expert_fsdp_dim(plan, shape[0] if shape else None) == 1:
        return Sharding.split(rank, {0: ep, 1: efsdp, **tp})
    return Sharding.split(rank, {0: efsdp + ep, **tp})


def n_experts_of(module: ModuleOp, rules: Rules) -> int | None:
    """The number of experts (dim 0 of the stacked expert weights), None for a dense model."""
    from flint.passes.shard_annotate import _role

    for fn in module.ops:
        if not isinstance(fn, func.FuncOp):
            continue
        for i, a in enumerate(fn.body.block.args):
            role, param = _role(fn, i)
            if role == "parameter" and rules.is_expert(param) and isinstance(a.type, TensorType) \
                    and len(a.type.get_shape()) == 3:
                return a.type.get_shape()[0]
    return None


def assignments_of(module: ModuleOp, rules: Rules) -> int | None:
    """tokens * top_k of the routed step: the length of the routing sort's input (None without one)."""
    for fn in module.ops:
        if isinstance(fn, func.FuncOp):
            for op in fn.walk():
                if isinstance(op, AtenOp) and rules.op_kind(op.overload) == "token_local" and \
                        op.overload.split(".")[1] == "sort" and len(shape_of(op.inputs[0])) == 1:
                    return shape_of(op.inputs[0])[0]
    return None


def grouped_experts_of(module: ModuleOp, rules: Rules) -> tuple[int, int | None] | None:
    """(experts, routed tokens) of Hugging Face's grouped-GEMM MoE layers: dim 0 of a ``_grouped_mm``'s expert
    weights and of the router's ``topk`` output (None where the router selects otherwise: PhiMoE's sparsemixer
    takes two ``max``); None without such layers."""
    experts = tokens = None
    for fn in module.ops:
        if not isinstance(fn, func.FuncOp):
            continue
        for op in fn.walk():
            if not isinstance(op, AtenOp):
                continue
            kind, shapes = rules.op_kind(op.overload), [shape_of(v) for v in op.inputs[:2]]
            if kind == "grouped_mm" and len(shapes) == 2 and len(shapes[1]) == 3 and len(shapes[0]) == 2:
                experts = shapes[1][0]
            elif op.overload.split(".")[1] == "topk" and op.outputs and len(shape_of(op.outputs[0])) == 2:
                tokens = shape_of(op.outputs[0])[0]
    return (experts, tokens) if experts is not None else None


def expert_tp_sizes(module: ModuleOp, rules: Rules) -> list[tuple[str, int, int]]:
    """(parameter, tp_dim, its size) of every expert weight whose ``[[experts]]`` entry names a ``tp_dim``."""
    from flint.passes.shard_annotate import _role

    out = []
    for fn in module.ops:
        if not isinstance(fn, func.FuncOp):
            continue
        for i, a in enumerate(fn.body.block.args):
            role, param = _role(fn, i)
            if role == "parameter" and rules.is_expert(param) and isinstance(a.type, TensorType):
                d = rules.expert_tp_dim(param)
                if d is not None and d < len(a.type.get_shape()):
                    out.append((param, d, a.type.get_shape()[d]))
    return out


def check_plan(plan: Plan, n_experts: int | None, module: ModuleOp | None = None) -> None:
    """What expansion does not build for MoE, and the expert shapes against ``tp`` / ``etp``, refused by
    the plan field before any work."""
    src = plan.source
    if n_experts is not None and module is not None and plan.tp > 1 and (plan.ep == 1 or plan.etp == plan.tp):
        field_ = "etp" if plan.ep > 1 else "tp"
        for param, d, size in expert_tp_sizes(module, load_rules()):
            if size % plan.tp:
                raise PlanError(field_, f"{plan.tp} does not divide dim {d} (the expert hidden size {size}) of "
                                f"'{param}', which tensor-parallel experts split", src)
    if plan.etp > 1 and n_experts is not None and expert_fsdp_dim(plan, n_experts) == 1:
        raise PlanError("etp", f"expert tensor parallelism with more expert shards than experts "
                        f"(dp_shard_mod_ep x ep = {_efsdp_size(plan) * plan.ep} > {n_experts}, where FSDP "
                        "shards experts on dim 1) is not built in shard-expand", src)
    if plan.ep > 1 and plan.cp > 1:
        raise PlanError("ep", "expert parallelism borrowing context-parallel ranks (ep with cp > 1) is not built "
                        "in shard-expand", src)
    grouped = grouped_experts_of(module, load_rules()) if module is not None and plan.ep > 1 else None
    if grouped is not None:
        if plan.capacity_factor != 1.0:
            raise PlanError("capacity_factor", f"{plan.capacity_factor:g}: Hugging Face's grouped-GEMM experts run "
                            "expert parallelism as transformers' AllToAllEP, which is dropless (every routed token "
                            "reaches its expert); capacity buffers apply to Flint's MoE layers", src)
        pairs = assignments_of(module, load_rules())
        rows = pairs // plan.dp if pairs is not None and pairs % plan.dp == 0 else None
        if rows is not None and rows % plan.ep:
            raise PlanError("ep", f"{plan.ep} does not divide a rank's {rows} routed token-expert pairs "
                            f"({pairs} over dp = {plan.dp}), which balanced routing sends in equal parts to the "
                            "ep ranks", src)


# ----------------------------------------------------------------- the expander


# Marks (in FunctionExpander.hints, which the forward hands to the backward for saved values) a value laid
# out per expert: [experts over ep, rows, ...] (an expert bmm's result and what is computed from it).
EXPERT_LAYOUT = "flint.moe.expert_layout"

# Marks (in FunctionExpander.hints) a value of Hugging Face's grouped-GEMM experts laid out per expert under ep
# (dispatched rows of this rank's experts); the value is the dim holding the rows.
EXPERT_ROWS = "flint.moe.expert_rows"

# scatters that build a tensor from its zero fill (linear in the values scattered)
_SCATTERS = ("index_add", "index_put", "scatter")


def _by_sizes(hint: dict | None) -> dict:
    """An engine hint (axis -> (merged dims' sizes, position)) grouped by the merged dims' sizes."""
    out: dict = {}
    for axis, entry in (hint or {}).items():
        if isinstance(entry, tuple):
            out.setdefault(entry[0], {})[axis] = entry
    return out


def _is_bmm(op) -> bool:
    return isinstance(op, AtenOp) and op.overload.split(".")[1] in ("bmm", "baddbmm")


@dataclass
class MoEExpander(FunctionExpander):
    """:class:`FunctionExpander` with the MoE rules (see the module docstring)."""

    n_experts: int | None = None
    assignments: int | None = None  # tokens * top_k (global)
    ep_axes: tuple = ()  # mesh axes of the ep group (empty: no expert parallelism)
    token_axes: tuple = ()  # the axes splitting the tokens: data-parallel (the batch) then cp (the sequence)
    capacity_factor: float = 1.0
    phase: str | None = None
    expert_ids: SSAValue | None = None  # new value: the flattened selected experts (sort's input)
    counts_sent: bool = False
    tp_axes: tuple = ()  # the plan's tp axes (MoE under tensor parallelism)
    # tp axes that ep borrows (etp = 1): every tp rank dispatches its 1/tp slice of the (gathered) tokens,
    # as torchtitan's token dispatcher with sp_size = tp
    slice_axes: tuple = ()
    # old values holding the MoE's tp partial sums (a row-parallel expert output, a scatter of a tp token slice,
    # and what the routing computes from them): linear ops inside the MoE pass them on unreduced, so the tp
    # reduction happens once at the MoE boundary (torchtitan: the MoE output Partial -> sp_layout; in backward
    # the router's and experts' input gradients stay Partial up to the MoE input)
    tainted: set = field(default_factory=set)
    grouped: tuple | None = None  # Hugging Face's grouped-GEMM experts: (experts, routed tokens), grouped_experts_of
    # where the axes of a merged [batch * seq] dim came from (engine hints), by its dims' global sizes: the MoE
    # output takes its input's token split back when the routing's gathers and sums lost the record
    token_hints: dict = field(default_factory=dict)
    _cur: AtenOp | None = None  # the op being expanded (Hugging Face's experts under ep: see value)
    _cur_rows: int | None = None  # its results' rows dim if it runs in the expert layout

    def _mark(self, old: SSAValue, key: str) -> None:
        new = self.env[old][0]
        self.hints[new] = {**(self.hints.get(new) or {}), key: True}

    def _moe_partial(self, v: SSAValue) -> bool:
        if v in self.tainted:
            return True
        if v not in self.env or not set(self.sharding(v).partial) & set(self.tp_axes):
            return False
        # saved by the forward: the only values saved with tp partial sums are the MoE's (the dense path
        # saves reduced values, see FunctionExpander.saved_value)
        return not isinstance(v.owner, AtenOp)

    def expand_op(self, op: AtenOp) -> None:
        self.phase = op.phase.data if op.phase is not None else None
        # the tp token slice is torchtitan's t[offset:offset + local], a view, not DTensor's cloned shard
        self.view_slices = bool(self.slice_axes) and self.rules.op_kind(op.overload) == "token_local"
        grouped_ep = self._grouped_ep()
        if grouped_ep:
            self._cur, self._cur_rows = op, self._expert_rows_of(op)
        try:
            super().expand_op(op)
        finally:
            self.view_slices = False
            self._cur = None
        if grouped_ep:
            for r in op.outputs:
                if r in self.env and isinstance(r.type, TensorType):
                    self._set_rows(self.env[r][0], self._cur_rows)
        name = op.overload.split(".")[1]
        if self.rules.op_kind(op.overload) == "reshape" and op.outputs[0] in self.env:
            for sizes, axes in _by_sizes(self.hints.get(self.env[op.outputs[0]][0])).items():
                self.token_hints.setdefault(sizes, axes)
        if self.rules.op_kind(op.overload) == "token_local" and name == "sort":
            self.expert_ids = self.env[op.outputs[0]][0].owner.operands[0]  # this rank's (sliced) selections
        ep = set(self.ep_axes)
        if ep and _is_bmm(op) and set(self.sharding(op.outputs[0]).dims[0]) == ep:
            self._mark(op.outputs[0], EXPERT_LAYOUT)
        tp = set(self.tp_axes)
        if tp and self.n_experts is not None and not self._moe_exit(op) and (
                self._expert_bmm(op) or self.rules.op_kind(op.overload) == "token_local"
                or any(self._moe_partial(v) for v in op.inputs)):
            for r in op.outputs:
                if isinstance(r.type, TensorType) and set(self.sharding(r).partial) & tp:
                    self.tainted.add(r)

    def _expert_bmm(self, op) -> bool:
        return _is_bmm(op) and shape_of(op.outputs[0])[0] == self.n_experts

    def carries_partial(self, op: AtenOp, kind: str) -> bool:
        """Inside the MoE, tp partial sums pass through every op whose rule is linear in them (views, the
        routing-score product, sums, scatters, the router's backward): one reduction at the boundary."""
        return super().carries_partial(op, kind) or any(self._moe_partial(v) for v in op.inputs)

    # ------------------------------------- Hugging Face's grouped-GEMM experts under ep (module docstring)

    def _grouped_ep(self) -> bool:
        return bool(self.ep_axes) and self.grouped is not None

    def _rows(self, new: SSAValue) -> int | None:
        """The dim of ``new`` holding expert-layout rows (dispatched to this rank's experts); None: token layout."""
        h = self.hints.get(new)
        return h.get(EXPERT_ROWS) if h else None

    def _set_rows(self, new: SSAValue, d: int | None, like: SSAValue | None = None) -> None:
        """Mark ``new``'s rows dim ``d`` (None: token layout), its other hints those of ``like`` (default: its own)."""
        base = self.hints.get(new if like is None else like)
        if like is None and (base or {}).get(EXPERT_ROWS) == d:
            return
        h = {k: v for k, v in (base or {}).items() if k != EXPERT_ROWS}
        if d is not None:
            h[EXPERT_ROWS] = d
        if h:
            self.hints[new] = h
        else:
            self.hints.pop(new, None)

    def _expert_rows_of(self, op: AtenOp) -> int | None:
        """The rows dim of ``op``'s results if it runs in the expert layout: a grouped GEMM of token rows by
        expert weights, or an op on expert-layout values that keeps their rows (elementwise with operands that
        broadcast along the rows, a split / cat along another dim, a 2-D transpose, a fill of their shape, a reduction
        or view keeping dim 0); None otherwise (its expert-layout operands are combined first)."""
        kind = self.rules.op_kind(op.overload)
        if kind == "grouped_mm":
            return 0 if len(op.inputs) > 1 and len(shape_of(op.inputs[1])) == 3 else None
        tensors = [v for v in op.inputs if isinstance(v.type, TensorType) and v in self.env]
        rows = [(v, self._rows(self.env[v][0])) for v in tensors]
        dims = {d for _, d in rows if d is not None}
        if len(dims) != 1:
            return None
        d = dims.pop()
        lead = shape_of(next(v for v, r in rows if r is not None))
        out = shape_of(op.outputs[0]) if op.outputs and isinstance(op.outputs[0].type, TensorType) else None
        if out is None:
            return None
        if kind == "transpose" and len(lead) == 2 and len(out) == 2:
            return 1 - d
        if kind == "like":
            return d if out == lead else None  # a fill shaped otherwise (new_zeros of the token rows) is not
        if kind == "pointwise":
            at = d + len(out) - len(lead)  # the rows dim of the (broadcast) result
            for v, r in rows:
                shp = shape_of(v)
                k = at - (len(out) - len(shp))
                if r is None and 0 <= k < len(shp) and shp[k] != 1:
                    return None  # a token-laid operand along the rows
                if r is not None and r != k:
                    return None
            return at
        if any(r is None for _, r in rows):
            return None
        dim = _arg(op, "dim")
        if kind == "dim_local" and isinstance(dim, IntegerAttr) and _norm(dim.value.data, len(lead)) != d:
            return d
        if kind in ("reshape", "reduce") and d == 0 and out and out[0] == lead[0] and not (
                kind == "reduce" and (dim is None or (isinstance(dim, ArrayAttr) and any(
                    _norm(x.value.data, len(lead)) == 0 for x in dim.data)))):
            return 0
        return None

    def value(self, old: SSAValue, want: Sharding, why: str, hint: dict | None = None) -> SSAValue:
        """Under ep, Hugging Face's grouped GEMMs take their token rows dispatched to the experts' ranks and
        their offsets from the exchanged counts; an op outside the expert layout takes its operands combined."""
        op = self._cur
        if op is None:
            return super().value(old, want, why, hint)
        grouped = self.rules.op_kind(op.overload) == "grouped_mm"
        if grouped and len(op.inputs) > 2 and old is op.inputs[2]:
            return self._local_offsets(old)
        if grouped and len(op.inputs) > 2 and old is op.inputs[0]:
            self._local_offsets(op.inputs[2])  # the counts go first, as the split sizes of the token exchange
        new = super().value(old, want, why, hint)
        d = self._rows(new)
        if grouped:
            if len(shape_of(op.inputs[1])) == 3:
                need = 0 if old is op.inputs[0] else None  # tokens x expert weights
            else:
                need = 1 if old is op.inputs[0] else 0  # the weight gradient: [k, rows] x [rows, n]
            return self._ep_exchange(new, need, "dispatch") if need is not None and d is None else new
        if d is not None and self._cur_rows is None:
            return self._ep_exchange(new, d, "combine")
        return new

    def _ep_exchange(self, new: SSAValue, d: int, kind: str) -> SSAValue:
        """transformers' AllToAllEP exchange of ``new``'s rows (dim ``d``) over the ep axes: ``dispatch`` to the
        experts' ranks, ``combine`` back; equal parts both ways (balanced routing). A transposed token value is
        dispatched as the value it transposes (one exchange serves the GEMM and the weight gradient)."""
        key = (f"ep-{kind}", new)
        if key in self.cache:
            return self.cache[key]
        src = new.owner
        if kind == "dispatch" and d == 1 and isinstance(src, AtenOp) and len(src.inputs) == 1 and \
                self.rules.op_kind(src.overload) == "transpose" and len(shape_of(src.inputs[0])) == 2 and \
                self._rows(src.inputs[0]) is None:
            out = self._aten("aten.t.default", [self._ep_exchange(src.inputs[0], 0, kind)], new.type)
        else:
            out = self._coll(dist.AllToAllOp(new, self.grid, self._ids(self.ep_axes), dist.FutureType(new.type),
                                             split_dim=d, concat_dim=d))
        self._set_rows(out, d if kind == "dispatch" else None, like=new)
        self.cache[key] = out
        return out

    def _local_offsets(self, old: SSAValue) -> SSAValue:
        """A grouped GEMM's offsets under ep: the cumsum of this rank's experts' token counts received from
        every rank of the ep group (after the counts' all_to_all); saved for backward as they are."""
        new, s = self.env[old]
        ep = tuple(self.ep_axes)
        if s.dims and s.dims[0] == ep:
            return new  # the forward's, saved
        key = ("ep-offs", new)
        if key in self.cache:
            return self.cache[key]
        counts = self._exchange_counts()
        e, n = counts.type.get_shape()[0], self._n(ep)
        et = counts.type.element_type
        per_rank = self._aten("aten.view.default", [counts], TensorType(et, [n, e // n]), size=[n, e // n])
        local = self._aten("aten.sum.dim_IntList", [per_rank], TensorType(et, [e // n]), dim=[0])
        offs = self._aten("aten.cumsum.default", [local], TensorType(old.type.element_type, [e // n]), dim=0,
                          dtype="torch.int32")
        self.cache[key] = offs
        return offs

    # ------------------------------------------------------- linear MoE ops

    def rule_pointwise(self, op: AtenOp) -> Rule:
        """``mul`` is linear in either operand: a partial second operand (the saved expert output in the
        routing score's gradient) stays partial when the first is not."""
        ins = list(op.inputs)
        if op.overload.split(".")[1] in ("mul", "mul_") and len(ins) == 2 and \
                all(isinstance(v.type, TensorType) for v in ins):
            p0, p1 = self.sharding(ins[0]).partial, self.sharding(ins[1]).partial
            if p1 and not p0 and self._moe_partial(ins[1]):
                dims, _ = self._merge(op, shape_of(op.outputs[0]), ins)
                return Rule([self._align(ins[0], dims), self._align(ins[1], dims, p1)],
                            [self._align(op.outputs[0], dims, p1)])
        return super().rule_pointwise(op)

    def rule_like(self, op: AtenOp) -> Rule:
        """The zero fill a scatter builds the whole token range in is not split over the tp slice."""
        rule = super().rule_like(op)
        if self.slice_axes and any(isinstance(u.operation, AtenOp) and u.index == 0 and
                                   u.operation.overload.split(".")[1] in _SCATTERS for u in op.outputs[0].uses):
            drop = set(self.slice_axes)
            rule.results = [Sharding(tuple(tuple(a for a in ax if a not in drop) for ax in r.dims), r.partial)
                            for r in rule.results]
        return rule

    def _from_fill(self, v: SSAValue) -> bool:
        o = v.owner
        return isinstance(o, AtenOp) and o.overload.split(".")[1] in FILL_OPS | {"zeros_like"}

    def rule_dim_local(self, op: AtenOp) -> Rule:
        """The router's backward is linear in the gradient: ``scatter`` of it into a zero fill (topk's
        backward) and ``_softmax_backward_data`` keep its tp partial sums."""
        name = op.overload.split(".")[1]
        ins = list(op.inputs)
        if self.tp_axes and ins:
            grad = ins[-1] if name == "scatter" else ins[0]
            p = self.sharding(grad).partial
            if p and self._moe_partial(grad) and (
                    (name == "scatter" and self._from_fill(ins[0])) or name == "_softmax_backward_data"):
                base = super().rule_dim_local(op)
                keep = [Sharding(s.dims, p) if v is grad or (name == "scatter" and v is ins[0]) else s
                        for v, s in zip(ins, base.operands)]
                return Rule(keep, [Sharding(s.dims, p) for s in base.results])
        return super().rule_dim_local(op)

    # --------------------------------------------------------------- token-local

    def _order(self, axes) -> tuple:
        axes = list(dict.fromkeys(axes))
        known = [a for a in self.token_axes if a in axes]
        return tuple(known + [a for a in axes if a not in known])

    def rule_token_local(self, op: AtenOp) -> Rule:
        name = op.overload.split(".")[1]
        ins = [v for v in op.inputs if isinstance(v.type, TensorType)]
        d_attr = _arg(op, "dim")
        rank0 = len(shape_of(ins[0]))
        d = _norm(d_attr.value.data, rank0) if isinstance(d_attr, IntegerAttr) else (rank0 - 1 if name == "sort" else 0)
        if d != 0:
            return self.rule_dim_local(op)
        axes: tuple = ()
        for v in ins:
            s = self.sharding(v)
            if s.dims and s.dims[0]:
                axes = s.dims[0]
                break
        # the data-parallel token split, plus the tp slice when ep borrows tp (etp = 1); a sequence-parallel
        # tp split of the tokens is gathered (torchtitan's MoE input Shard(1) -> Replicate)
        axes = self._order(tuple(a for a in axes if a in self.token_axes) + tuple(self.slice_axes))

        def lay(v, drop=(), partial=()) -> Sharding:
            r = len(shape_of(v))
            return Sharding((tuple(a for a in axes if a not in drop),) + ((),) * (r - 1), partial) if r \
                else Sharding(())
        table = self._expert_table(op)
        if table and name in ("index", "index_select"):
            # a row per routed token from a per-expert table (gpt-oss's expert biases): the table whole
            return Rule([Sharding.replicated(len(shape_of(op.inputs[0])))] + [lay(v) for v in op.inputs[1:]],
                        [lay(r) for r in op.outputs])
        if table:
            # its gradient: every rank adds its own tokens' rows into the whole table, a pending sum over them
            partial = tuple(axes)
            return Rule([Sharding.replicated(len(shape_of(op.inputs[0])))] + [lay(v) for v in op.inputs[1:]],
                        [Sharding.replicated(len(shape_of(r))).with_partial(partial) for r in op.outputs], partial)
        if name in _SCATTERS and self.tp_axes and self._from_fill(op.inputs[0]):
            # a scatter into a zero fill: each rank scatters its tokens into the whole (data-parallel)
            # token range, zeros elsewhere: a partial sum over the tp slice (torchtitan's combine
            # scatter_add into zeros_like(x) with offset indices) carrying the values' tp partial sums
            vals = op.inputs[-1]
            carried = tuple(a for a in self.sharding(vals).partial if a in self.tp_axes) \
                if self._moe_partial(vals) else ()
            created = tuple(self.slice_axes)
            partial = tuple(dict.fromkeys(carried + created))
            operands = [lay(op.inputs[0], drop=self.slice_axes, partial=carried)] + \
                [lay(v, partial=carried if v is vals else ()) for v in op.inputs[1:]]
            return Rule(operands, [lay(r, drop=self.slice_axes, partial=partial) for r in op.outputs], created)
        if name in ("index", "index_select") and self.tp_axes and self._moe_partial(op.inputs[0]):
            p = self.sharding(op.inputs[0]).partial  # a gather is linear in what it gathers
            return Rule([lay(op.inputs[0], partial=p)] + [lay(v) for v in op.inputs[1:]],
                        [lay(r, partial=p) for r in op.outputs])
        return Rule([lay(v) for v in op.inputs], [lay(r) for r in op.outputs])

    def _expert_table(self, op: AtenOp) -> bool:
        """Whether a token-local gather / scatter indexes a per-expert table on dim 0 (Hugging Face's grouped
        experts' biases, indexed by the routed expert ids), not the tokens: a table with a row per expert, where
        the experts are counted neither as tokens nor as token-expert pairs (else refused as ambiguous)."""
        if self.grouped is None or not op.inputs or not shape_of(op.inputs[0]):
            return False
        experts, tokens = self.grouped
        rows = shape_of(op.inputs[0])[0]
        if rows != experts:
            return False
        if self.ep_axes:
            raise ExpandError(f"'{op.overload}'{where(op)}: a per-expert table indexed by the routed expert ids "
                              "(gpt-oss's expert biases) under ep is not built: its rows would follow the experts "
                              "to their ranks (expand a plan without ep)")
        if experts in (tokens, self.assignments):
            raise ExpandError(f"'{op.overload}'{where(op)}: dim 0 of size {experts} is both the experts and the "
                              f"tokens ({tokens}) or token-expert pairs ({self.assignments}): ambiguous; capture "
                              "the plan instead, or expand a step of another batch size")
        return True

    def _token_split(self, op: AtenOp, v: SSAValue, d: int) -> tuple:
        """The token split of ``v`` (on dim ``d``: over the data-parallel and cp axes); refused where anything
        else splits it or a pending sum rides on it (tensor or expert parallelism of Hugging Face's grouped-GEMM
        experts)."""
        s = self.sharding(v)
        if s.partial or any(a not in self.token_axes for ax in s.dims for a in ax) or \
                any(ax for i, ax in enumerate(s.dims) if i != d):
            raise ExpandError(f"'{op.overload}'{where(op)}: Hugging Face's grouped-GEMM experts expand under data "
                              "and context parallelism only (their tokens split over "
                              f"{list(self.token_axes) or 'dp'}); this "
                              f"operand is laid out {s}: tensor or expert parallelism of these experts is not "
                              "built (capture a data-parallel plan, or use a model with Flint's MoE layers)")
        return s.dims[d] if s.dims else ()

    def rule_token_count(self, op: AtenOp) -> Rule:
        """``histc`` of the selected experts: each rank counts the selections of its own tokens, which its
        grouped GEMMs take as offsets; the counts are the rank's own (no pending sum, no collective)."""
        v = op.inputs[0]
        axes = self._token_split(op, v, 0)
        return Rule([Sharding((axes,) + ((),) * (len(shape_of(v)) - 1))],
                    [Sharding.replicated(len(shape_of(r))) for r in op.outputs])

    def rule_grouped_mm(self, op: AtenOp) -> Rule:
        """``_grouped_mm`` over the rank's tokens (sorted by expert; ``offs`` its own counts' cumsum):
        ``[tokens, k] x [experts, k, n] -> [tokens, n]`` keeps the token split with the weights whole; the weight
        gradient ``[k, tokens] x [tokens, n] -> [experts, k, n]`` contracts over the tokens: a pending sum over
        the token axes, reduced with the other gradients."""
        a, b = op.inputs[0], op.inputs[1]
        ra, rb = len(shape_of(a)), len(shape_of(b))
        if self._grouped_ep():
            # under ep (transformers' AllToAllEP): this rank's experts on the rows dispatched to them (see value),
            # the offsets its own; the weight gradient is theirs, a pending sum over the token axes outside ep
            ep = tuple(self.ep_axes)
            offs = [Sharding.split(len(shape_of(v)), {0: ep}) for v in op.inputs[2:]]
            if ra == 2 and rb == 3:
                axes = self._token_split(op, a, 0)
                return Rule([Sharding((axes, ())), Sharding.split(3, {0: ep})] + offs, [Sharding((axes, ()))])
            if ra == 2 and rb == 2:
                axes = self._token_split(op, a, 1) or self._token_split(op, b, 0)
                rest = tuple(x for x in axes if x not in ep)
                return Rule([Sharding(((), axes)), Sharding((axes, ()))] + offs, [Sharding((ep, (), ()), rest)],
                            rest)
        rest = [Sharding.replicated(len(shape_of(v))) for v in op.inputs[2:]]
        for v in op.inputs[2:]:
            self._token_split(op, v, 0)
        if ra == 2 and rb == 3:
            axes = self._token_split(op, a, 0)
            self._token_split(op, b, 0)  # whole for the GEMM: an FSDP shard (dim 0) is gathered
            return Rule([Sharding((axes, ())), Sharding.replicated(3)] + rest, [Sharding((axes, ()))])
        if ra == 2 and rb == 2:
            axes = self._token_split(op, a, 1) or self._token_split(op, b, 0)
            return Rule([Sharding(((), axes)), Sharding((axes, ()))] + rest,
                        [Sharding(((), (), ()), tuple(axes))], tuple(axes))
        raise ExpandError(f"'{op.overload}'{where(op)}: a grouped GEMM of {ra}-D by {rb}-D operands has no sharding "
                          "rule (built: tokens x expert weights, and the weight gradient)")

    # ----------------------------------------------------------- dispatch views

    def _expert_view(self, op: AtenOp) -> str | None:
        """'dispatch' ([tokens*top_k, h] -> [experts, rows, h] feeding a bmm), 'combine' (back, from a bmm
        or a sum of bmms), or None."""
        if self.n_experts is None or self.assignments is None:
            return None
        a, b = shape_of(op.inputs[0]), shape_of(op.outputs[0])
        if len(a) == 2 and len(b) == 3 and b[0] == self.n_experts and a[0] == self.assignments and \
                b[0] * b[1] == a[0] and a[1] == b[2]:
            if any(_is_bmm(u.operation) for u in op.outputs[0].uses):
                return "dispatch"
        if len(a) == 3 and len(b) == 2 and a[0] == self.n_experts and b[0] == self.assignments and \
                a[0] * a[1] == b[0] and a[2] == b[1]:
            v = op.inputs[0]
            src = v.owner
            if _is_bmm(src) or (isinstance(src, AtenOp) and any(_is_bmm(x.owner) for x in src.inputs)):
                return "combine"
            if not isinstance(src, AtenOp) and (self.hints.get(self.env[v][0]) or {}).get(EXPERT_LAYOUT):
                return "combine"  # an expert output saved by the forward
        return None

    def rule_reshape(self, op: AtenOp) -> Rule:
        kind = self._expert_view(op)
        if kind is None:
            rule = super().rule_reshape(op)
            v = op.inputs[0]
            b = shape_of(op.outputs[0])
            known = self.token_hints.get(tuple(b[:2])) if self.env[v][0] not in self.hints else None
            if known and self._moe_exit(op):  # the [tokens, hidden] -> [batch, seq, hidden] view: as they came in
                need, out, self._next_hint = self.reshape_sharding(self.sharding(v), shape_of(v), b, known)
                rule = Rule([need], [out])
            tp = set(self.tp_axes)
            if tp and self._moe_entry(op) and set(rule.operands[0].dims[1]) & tp:
                # the MoE input under sequence parallelism: all-gathered over tp first (torchtitan's
                # PrepareModuleInputOutput Shard(1) -> Replicate; in backward the output gradient's)
                s = rule.operands[0]
                need = Sharding((s.dims[0], tuple(a for a in s.dims[1] if a not in tp)) + s.dims[2:], s.partial)
                out = self.reshape_sharding(need, shape_of(op.inputs[0]), shape_of(op.outputs[0]))[1]
                self._next_hint = None
                return Rule([need], [out])
            return rule
        s = self.sharding(op.inputs[0])
        if kind == "dispatch":
            tokens = self._order(s.dims[0])
            return Rule([Sharding((tokens, ()), s.partial)], [Sharding(((), tokens, ()), s.partial)])
        tokens = self._order(tuple(s.dims[0]) + tuple(s.dims[1]))
        return Rule([Sharding(((), tokens, ()), s.partial)], [Sharding((tokens, ()), s.partial)])

    def _from_upstream(self, old: SSAValue, want: Sharding, depth: int, hint: dict | None = None) -> SSAValue | None:
        """The MoE input is gathered once at its entry view; its token slices come from that (local)."""
        op = old.owner
        if self.tp_axes and isinstance(op, AtenOp) and self.rules.op_kind(op.overload) == "reshape" and \
                self._moe_entry(op):
            return None
        return super()._from_upstream(old, want, depth, hint)

    def _moe_exit(self, op: AtenOp) -> bool:
        """A ``[tokens, hidden] -> [batch, seq, hidden]`` view: the MoE output (or input gradient) leaving it."""
        if self.rules.op_kind(op.overload) != "reshape" or not op.outputs:
            return False
        a, b = shape_of(op.inputs[0]), shape_of(op.outputs[0])
        return len(a) == 2 and len(b) == 3 and b[0] * b[1] == a[0] and a[1] == b[2]

    def _moe_entry(self, op: AtenOp) -> bool:
        """A ``[batch, seq, hidden] -> [tokens, hidden]`` view whose tokens the routing sorts or gathers."""
        a, b = shape_of(op.inputs[0]), shape_of(op.outputs[0])
        if len(a) != 3 or len(b) != 2 or a[0] * a[1] != b[0] or a[2] != b[1]:
            return False
        return any(isinstance(u.operation, AtenOp) and self.rules.op_kind(u.operation.overload) == "token_local"
                   for u in op.outputs[0].uses)

    def rule_transpose(self, op: AtenOp) -> Rule:
        """A transpose of dispatched rows that the experts consumed uses the expert layout (the forward
        saves the routed input the expert gemm saw, as torchtitan's grouped mm does)."""
        v = op.inputs[0]
        s = self.sharding(v)
        ep = set(self.ep_axes)
        if ep and s.rank == 3 and not s.partial and not set(s.dims[0]) & ep and ep <= set(s.dims[1]):
            want = Sharding((tuple(self.ep_axes), tuple(a for a in s.dims[1] if a not in ep), s.dims[2]))
            if (self.env[v][0], want) in self.cache:
                self.env[v] = (self.cache[(self.env[v][0], want)], want)
        return super().rule_transpose(op)

    def saved_value(self, old: SSAValue) -> tuple[SSAValue, Sharding]:
        """An expert output the forward combined is saved combined (torchtitan's autograd saves the
        routed output after the combine all_to_all for the score product's backward)."""
        if self._grouped_ep():
            new, s = self.env[old]
            if ("ep-offs", new) in self.cache:
                return self.cache[("ep-offs", new)], Sharding.split(s.rank, {0: tuple(self.ep_axes)})
            # a value the forward dispatched or combined is saved as the experts' GEMMs / the routing product
            # used it (transformers' autograd saves the exchanged tensors)
            for kind in ("dispatch", "combine"):
                if (f"ep-{kind}", new) in self.cache and not s.partial:
                    return self.cache[(f"ep-{kind}", new)], s
        new, s = super().saved_value(old)
        ep = set(self.ep_axes)
        if ep and s.rank == 3 and set(s.dims[0]) == ep:
            for (v, want), out in self.cache.items():
                if v is new and want.rank == 3 and want.partial == s.partial and not set(want.dims[0]) & ep:
                    return out, want
        return new, s

    # ------------------------------------------------------------- expert bmm

    def rule_matmul(self, op: AtenOp) -> Rule:
        ep = set(self.ep_axes)
        if not ep or op.overload.split(".")[1] != "bmm" or \
                not any(set(self.sharding(v).dims[0]) & ep for v in op.inputs):
            return super().rule_matmul(op)
        a, b = op.inputs
        sa, sb = self.sharding(a), self.sharding(b)

        def off(axes):
            return tuple(x for x in axes if x not in ep)
        m, ka, kb, n = off(sa.dims[1]), off(sa.dims[2]), off(sb.dims[1]), off(sb.dims[2])
        m = tuple(x for x in m if x not in n)
        k = tuple(x for x in dict.fromkeys(ka + kb) if x not in m + n)
        lead = (tuple(self.ep_axes),)
        pa, pb = sa.partial, sb.partial
        if pa and pb:
            pb = ()
        partial = tuple(dict.fromkeys(pa + pb + k))
        return Rule([Sharding(lead + (m, k), pa), Sharding(lead + (k, n), pb)],
                    [Sharding(lead + (m, n), partial)], k)

    # ------------------------------------------------------- dispatch / combine

    def reshard(self, v: SSAValue, gshape: Sequence[int], src: Sharding, dst: Sharding, why: str) -> SSAValue:
        kind = self._ep_move(src, dst) if self.ep_axes and len(gshape) == 3 else None
        if kind is None:
            return super().reshard(v, gshape, src, dst, why)
        key = (v, dst)
        if key in self.cache:
            return self.cache[key]
        out = self._dispatch(v, gshape, dst) if kind == "dispatch" else self._combine(v, gshape, dst)
        self.cache[key] = out
        return out

    def _ep_move(self, src: Sharding, dst: Sharding) -> str | None:
        ep = set(self.ep_axes)
        # tp partial sums (etp = tp: a row-parallel expert output and its input gradient) travel as they are
        if src.partial != dst.partial or set(src.partial) & ep or src.dims[2] or dst.dims[2]:
            return None
        if not set(src.dims[0]) & ep and set(dst.dims[0]) == ep and \
                set(src.dims[0]) | set(src.dims[1]) == ep | set(dst.dims[1]) and not set(dst.dims[1]) & ep:
            return "dispatch"
        if set(src.dims[0]) == ep and not set(dst.dims[0]) & ep and \
                set(dst.dims[0]) | set(dst.dims[1]) == ep | set(src.dims[1]) and not set(src.dims[1]) & ep:
            return "combine"
        return None

    def _aten(self, target: str, inputs, out_t: TensorType, **args) -> SSAValue:
        attrs = {k: ArrayAttr([IntegerAttr(x, i64) for x in v]) if isinstance(v, (list, tuple)) else
                 StringAttr(v) if isinstance(v, str) else IntegerAttr(v, i64) for k, v in args.items()}
        op = AtenOp(target, list(inputs), [out_t], args=attrs, phase=self.phase)
        self.emit(op)
        return op.outputs[0]

    def _resize_rows(self, v: SSAValue, rows: int) -> SSAValue:
        """``v`` ([e, r, h]) with ``rows`` rows on dim 1: padded with zeros (capacity) or sliced back."""
        e, r, h = v.type.get_shape()
        if rows == r:
            return v
        t = TensorType(v.type.element_type, [e, rows, h])
        if rows > r:
            return self._aten("aten.constant_pad_nd.default", [v], t, pad=[0, 0, 0, rows - r])
        return self._aten("aten.slice.Tensor", [v], t, dim=1, start=0, end=rows)

    def _exchange_counts(self) -> SSAValue:
        """torchtitan's (and transformers' AllToAllEP's) first all_to_all: the number of tokens for each expert
        (forward only); returns the counts received."""
        if self.expert_ids is None:
            raise ExpandError("shard-expand: expert-parallel dispatch without a routing sort before it "
                              "(the token counts per expert come from the selected experts)")
        e = self.n_experts
        counts = self._aten("aten.histc.default", [self.expert_ids], TensorType(self.expert_ids.type.element_type, [e]),
                            bins=e, min=0, max=e)
        received = self._coll(dist.AllToAllOp(counts, self.grid, self._ids(self.ep_axes),
                                              dist.FutureType(counts.type), split_dim=0, concat_dim=0))
        self.counts_sent = True
        return received

    def _dispatch(self, v: SSAValue, gshape: Sequence[int], dst: Sharding) -> SSAValue:
        """[experts, rows/dp, h] -> [experts/ep, rows/(dp/ep), h]: pad to capacity, all_to_all, drop padding."""
        if self.phase == "fwd" and not self.counts_sent:
            self._exchange_counts()
        e, r, h = v.type.get_shape()
        cap = math.ceil(self.capacity_factor * r)
        n = self._n(self.ep_axes)
        buf = self._resize_rows(v, cap)
        t = TensorType(v.type.element_type, [e // n, cap * n, h])
        out = self._coll(dist.AllToAllOp(buf, self.grid, self._ids(self.ep_axes), dist.FutureType(t),
                                         split_dim=0, concat_dim=1))
        return self._resize_rows(out, dst.local_shape(gshape, self.sizes)[1])

    def _combine(self, v: SSAValue, gshape: Sequence[int], dst: Sharding) -> SSAValue:
        """[experts/ep, rows*ep/dp, h] -> [experts, rows/dp, h]: pad to capacity, all_to_all, drop padding."""
        e, r, h = v.type.get_shape()
        n = self._n(self.ep_axes)
        local = dst.local_shape(gshape, self.sizes)
        cap = math.ceil(self.capacity_factor * local[1])
        buf = self._resize_rows(v, cap * n)
        t = TensorType(v.type.element_type, [e * n, cap, h])
        out = self._coll(dist.AllToAllOp(buf, self.grid, self._ids(self.ep_axes), dist.FutureType(t),
                                         split_dim=1, concat_dim=0))
        return self._resize_rows(out, local[1])


def make_expander(plan: Plan, rules: Rules, n_experts: int | None, assignments: int | None,
                  grouped: tuple | None = None, **kwargs) -> MoEExpander:
    """The engine for one function of a plan (MoE rules active when the model has experts)."""
    tp = tuple(plan.axes("tp")) if n_experts is not None else ()
    return MoEExpander(rules=rules, n_experts=n_experts, assignments=assignments, ep_axes=tuple(plan.axes("ep")) if plan.ep > 1 else (),
                       # the tokens: split over the batch (dp) and the sequence (cp): each rank routes its own
                       token_axes=tuple(plan.axes("dp")) + tuple(plan.axes("cp")),
                       capacity_factor=plan.capacity_factor, tp_axes=tp,
                       slice_axes=tp if plan.ep > 1 and plan.etp == 1 else (), grouped=grouped, **kwargs)


# ------------------------------------------------- expert units (gather / reduce)


def _swap_fsdp(state, axes: tuple, replicate: tuple | None = None):
    """Run a data-parallel unit helper of :class:`~flint.passes.shard_expand._State` over the expert axes."""
    class _Ctx:
        def __enter__(self):
            self.saved = (state.fsdp, state.replicate)
            state.fsdp = axes
            if replicate is not None:
                state.replicate = replicate

        def __exit__(self, *exc):
            state.fsdp, state.replicate = self.saved
    return _Ctx()


def gather_experts(state, ex, old, gather: list, new_args, storage, phase: str, fn) -> list:
    """FSDP-gather the unit's expert weights over ``expert_fsdp`` (their own all_gather, as torchtitan's
    separate ``fully_shard`` of the experts); returns the other parameters to gather."""
    from flint.passes.shard_annotate import _role

    plan = state.plan
    if plan.ep == 1:
        return gather
    experts = [g for g in gather if state.rules.is_expert(_role(fn, g[1])[1])]
    if not experts:
        return gather
    axes = tuple(plan.axes("expert_fsdp"))
    if axes and all(storage[i].dims[1] for _, i, _ in experts):
        _gather_dim1(ex, experts, new_args, axes)
    elif axes:
        with _swap_fsdp(state, axes):
            state._unit_gather(ex, old, experts, new_args, storage, phase)
    else:
        for val, i, s in experts:
            ex.bind(val, new_args[i], s)
    return [g for g in gather if g not in experts]


def reduce_expert_grads(state, ex, grads: list, results: list, shardings: list) -> list:
    """Reduce the unit's expert gradients over the data-parallel axes outside ``ep`` (reduce-scatter over
    ``expert_fsdp``, all-reduce over ``dp_replicate``); returns the other gradients."""
    plan = state.plan
    if plan.ep == 1:
        return grads
    experts = [g for g in grads if state.rules.is_expert(g[3])]
    if not experts:
        return grads
    axes = tuple(plan.axes("expert_fsdp"))
    if axes and all(g[2].dims[1] for g in experts):
        _reduce_dim1(state, ex, experts, results, shardings, axes)
    else:
        with _swap_fsdp(state, axes):
            state._unit_reduce(ex, experts, results, shardings)
    return [g for g in grads if g not in experts]


def _aten(ex, target: str, inputs, out_t: TensorType, **args) -> SSAValue:
    attrs = {k: ArrayAttr([IntegerAttr(x, i64) for x in v]) if isinstance(v, (list, tuple)) else IntegerAttr(v, i64)
             for k, v in args.items()}
    op = AtenOp(target, list(inputs), [out_t], args=attrs)
    ex.emit(op)
    return op.outputs[0]


def _numel(shape) -> int:
    return math.prod(shape)


def _gather_dim1(ex, experts: list, new_args, axes: tuple) -> None:
    """FSDP2's unshard of dim-1 shards: one all_gather of the flat shards, then each weight's
    ``[n, e, d/n, h]`` chunks moved back into place (``[e, d, h]``)."""
    n = ex._n(axes)
    et = new_args[experts[0][1]].type.element_type
    flats, metas = [], []
    for val, i, s in experts:
        shp = list(new_args[i].type.get_shape())
        flats.append(_aten(ex, "aten.view.default", [new_args[i]], TensorType(et, [_numel(shp)]), size=[_numel(shp)]))
        metas.append((val, s, shp))
    total = sum(_numel(m[2]) for m in metas)
    flat = flats[0] if len(flats) == 1 else _aten(ex, "aten.cat.default", flats, TensorType(et, [total]), dim=0)
    full = ex._coll(dist.AllGatherOp(flat, ex.grid, ex._ids(axes), dist.FutureType(TensorType(et, [n * total])),
                                     gather_dim=0))
    full = _aten(ex, "aten.view.default", [full], TensorType(et, [n, total]), size=[n, total])
    off = 0
    for val, s, shp in metas:
        numel = _numel(shp)
        piece = _aten(ex, "aten.slice.Tensor", [full], TensorType(et, [n, numel]), dim=1, start=off, end=off + numel)
        off += numel
        v = _aten(ex, "aten.view.default", [piece], TensorType(et, [n] + shp), size=[n] + shp)
        v = _aten(ex, "aten.permute.default", [v], TensorType(et, [shp[0], n] + shp[1:]),
                  dims=[1, 0] + list(range(2, len(shp) + 1)))
        rows = [shp[0], n * shp[1]] + shp[2:]
        v = _aten(ex, "aten.reshape.default", [v], TensorType(et, rows), size=rows)
        local = s.local_shape(shape_of(val), ex.sizes)
        if rows[1] != local[1]:
            v = _aten(ex, "aten.slice.Tensor", [v], TensorType(et, local), dim=1, start=0, end=local[1])
        ex.bind(val, v, s)


def _reduce_dim1(state, ex, experts: list, results: list, shardings: list, axes: tuple) -> None:
    """Reduce dim-1-sharded expert gradients: each padded to a multiple of ``n`` rows on dim 1, its
    ``n`` chunks moved to the front, one flat reduce_scatter over ``axes``, then HSDP's all_reduce."""
    n = ex._n(axes)
    replicate = tuple(state.replicate)
    pieces, metas = [], []
    et = None
    for i, src, target, param in experts:
        dp = set(axes) | set(replicate)
        inter = Sharding((target.dims[0], ()) + target.dims[2:], tuple(a for a in ex.sharding(src).partial if a in dp))
        v = ex.value(src, inter, f"gradient of '{param}'")
        et = v.type.element_type
        shp = list(v.type.get_shape())
        d1 = -(-shp[1] // n) * n
        if d1 != shp[1]:
            pad = [0, 0] * (len(shp) - 2) + [0, d1 - shp[1]]
            v = _aten(ex, "aten.constant_pad_nd.default", [v], TensorType(et, [shp[0], d1] + shp[2:]), pad=pad)
        split = [shp[0], n, d1 // n] + shp[2:]
        v = _aten(ex, "aten.view.default", [v], TensorType(et, split), size=split)
        v = _aten(ex, "aten.permute.default", [v], TensorType(et, [n, shp[0], d1 // n] + shp[2:]),
                  dims=[1, 0] + list(range(2, len(split))))
        numel = _numel([shp[0], d1 // n] + shp[2:])
        pieces.append(_aten(ex, "aten.reshape.default", [v], TensorType(et, [n, numel]), size=[n, numel]))
        metas.append((i, target, param, numel, [shp[0], d1 // n] + shp[2:]))
    total = sum(m[3] for m in metas)
    flat = pieces[0] if len(pieces) == 1 else _aten(ex, "aten.cat.default", pieces, TensorType(et, [n, total]), dim=1)
    flat = _aten(ex, "aten.view.default", [flat], TensorType(et, [n * total]), size=[n * total])
    flat = ex._coll(dist.ReduceScatterOp(flat, ex.grid, ex._ids(axes), dist.FutureType(TensorType(et, [total])),
                                         reduction="sum", scatter_dim=0))
    if replicate:
        flat = ex._coll(dist.AllReduceOp(flat, ex.grid, ex._ids(replicate), dist.FutureType(flat.type),
                                         reduction="average"))
    off = 0
    for i, target, param, numel, local in metas:
        piece = _aten(ex, "aten.slice.Tensor", [flat], TensorType(et, [numel]), dim=0, start=off, end=off + numel)
        off += numel
        results[i] = _aten(ex, "aten.view.default", [piece], TensorType(et, local), size=local)
        shardings[i] = target
        state.grad_sharding[param] = target
