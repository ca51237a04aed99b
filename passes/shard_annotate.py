"""`shard-annotate`: place `shard` dialect sharding annotations on a single-device step from a plan."""

from __future__ import annotations

from dataclasses import dataclass, replace

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ArrayAttr, DenseArrayBase, DictionaryAttr, ModuleOp, StringAttr, TensorType, i16, i64
from xdsl.dialects.shard import GridOp, ShardAxesArrayAttr, ShardingOp, ShardingType, ShardOp
from xdsl.dialects.builtin import FlatSymbolRefAttr, UnitAttr
from xdsl.ir import Block, BlockArgument, SSAValue
from xdsl.passes import ModulePass
from xdsl.rewriter import InsertPoint, Rewriter

from flint.chakra.from_ir import AXIS_NAMES_ATTR
from flint.errors import FlintError
from flint.ir import dist
from flint.ir.aten import CLIP_FUNCTION, AtenOp, get_schedule, optimizer_form_of
from flint.passes.lower_to_chakra import ROLE_ATTR, frozen_args
from flint.plan import PROGRAM_FIELDS, Plan, PlanError, attach, plan_of
from flint.sharding.rules import (
    Rules,
    activation_sharding,
    batch_sharding,
    fsdp_axes,
    param_compute_sharding,
    param_storage_sharding,
    rules_for,
    zero_storage_sharding,
)
from flint.sharding.engine import shape_of
from flint.sharding.spec import Sharding

PARAM_ATTR = "flint.param"
PARTIAL_ATTR = "flint.partial"
GRID = "mesh"
# Plan fields shard-expand implements; others are refused before any work.
EXPAND_FIELDS = ("dp_replicate", "dp_shard", "tp", "sp", "tp_style", "ep", "capacity_factor")
EXPAND_FIELDS += ("cp",)  # context parallelism (flint/sharding/cp.py)
EXPAND_FIELDS += ("zero",)  # ZeRO-1/2/3 of the FSDP axes (flint.sharding.rules.zero_storage_sharding)
EXPAND_FIELDS += ("etp",)  # expert tensor parallelism (flint/sharding/moe.py)
# The single-device program's own fields (check_model refuses a plan that changes one). fp32 master parameters:
# sharded as the Adam state. The optimizer's form: multi-tensor ops expanded index by index. Gradient-norm
# clipping: each part's norms kept local, @grad_clip's total made global over the axes the gradients are split
# on. Activation checkpointing: the recompute expanded with the rest of the backward (selective-op refused).
EXPAND_FIELDS += PROGRAM_FIELDS


def sharding_op(s: Sharding, axis_index: dict[str, int], grid: str = GRID) -> ShardingOp:
    """A ``shard.sharding`` op for ``s`` (partial axes in the ``flint.partial`` attribute)."""
    from flint.ir.dist import axes_attr

    split = ShardAxesArrayAttr(ArrayAttr([axes_attr([axis_index[a] for a in d]) for d in s.dims]))
    op = ShardingOp.build(properties={"grid": FlatSymbolRefAttr(grid), "split_axes": split},
                           result_types=[ShardingType()],
                           operands=[[], []])
    if s.partial:
        op.attributes[PARTIAL_ATTR] = ArrayAttr([StringAttr(a) for a in s.partial])
    return op


def read_sharding(op: ShardingOp, axis_names: list[str]) -> Sharding:
    dims = tuple(tuple(axis_names[i] for i in sub.get_values()) for sub in op.split_axes.axes.data)
    partial = op.attributes.get(PARTIAL_ATTR)
    return Sharding(dims, tuple(a.data for a in partial.data) if isinstance(partial, ArrayAttr) else ())


def plan_from_options(p: "ShardAnnotatePass") -> Plan:
    if p.plan:
        return Plan.load(p.plan)
    fields = {"dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard, "tp": p.tp, "sp": p.sp, "tp_style": p.tp_style,
              "ep": p.ep, "capacity_factor": p.capacity_factor}
    fields["cp"] = p.cp
    fields["zero"] = p.zero
    fields["etp"] = p.etp
    return Plan.from_dict(fields)


def _role(fn: func.FuncOp, i: int) -> tuple[str, str | None]:
    attrs = fn.arg_attrs.data[i].data if fn.arg_attrs is not None else {}
    role = attrs.get(ROLE_ATTR)
    param = attrs.get(PARAM_ATTR)
    return (role.data if role else "unknown"), (param.data if param else None)


def set_grid(module: ModuleOp, plan: Plan) -> dict[str, int]:
    """Replace the module's grid by the plan's mesh; the axis name -> index map."""
    mesh = plan.mesh()
    grid = GridOp.create(properties={"sym_name": StringAttr(GRID), "shape": DenseArrayBase.from_list(i64, list(mesh.shape))},
                         attributes={AXIS_NAMES_ATTR: ArrayAttr([StringAttr(a) for a in mesh.axis_names])})
    old = next((op for op in module.ops if isinstance(op, GridOp)), None)
    if old is not None:
        Rewriter.replace_op(old, grid)
    else:
        module.body.block.insert_op_before(grid, module.body.block.first_op)
    return {a: i for i, a in enumerate(mesh.axis_names)}


def check_single_device(module: ModuleOp) -> None:
    old = next((op for op in module.ops if isinstance(op, GridOp)), None)
    if old is not None:
        shape = old.shape.get_values()
        n = 1
        for s in shape:
            n *= s
        if n != 1:
            raise FlintError(f"shard-annotate: the program was captured on {n} ranks (grid {list(shape)}); "
                             "shard expansion starts from a single-device capture (world size 1)")
    for op in module.walk():
        if isinstance(op, (dist.CollectiveOp, dist.PointToPointOp)):
            raise FlintError(f"shard-annotate: '{op.name}' in the input: the program already communicates; "
                             "expand a single-device capture (run canonicalize-dist on a world-size-1 capture)")
        if isinstance(op, ShardOp):
            raise FlintError("shard-annotate: the program is already annotated")


def check_model(module: ModuleOp, plan: Plan, rules: Rules | None = None) -> None:
    """The plan against the shapes in the program (heads, KV heads, hidden, sequence, batch), and
    ``tp`` against the rules (default: the built-in ones): some parameter must be split."""
    heads = head_dim = hidden = seq = batch = None
    kv = attn_seq = None
    split_dims: list[tuple[str, int]] = []
    experts_named = False
    whole_blocks: set[str] = set()  # repeated parts (blocks) none of whose parameters tp splits
    rules = rules or rules_for(module)
    if plan.tp > 1 and rules.tp_refused:
        instead = ("capture the plan instead: flint capture --plan ... --tp ... (which runs the model's own plan; "
                   "flint explore takes that path by itself)") if rules.tp_capturable else "plan dp / fsdp for it"
        raise PlanError("tp", f"{rules.tp_refused}; {instead}", plan.source)
    repeated = {name for name, count in get_schedule(module) if count > 1 and name.endswith("_fwd")}
    for fn in module.ops:
        if not isinstance(fn, func.FuncOp):
            continue
        part = fn.sym_name.data[:-4] if fn.sym_name.data in repeated else None
        if part is not None and any(_role(fn, i)[0] == "parameter" for i in range(len(fn.body.block.args))):
            whole_blocks.add(part)
        for i, arg in enumerate(fn.body.block.args):
            role, param = _role(fn, i)
            shp = list(arg.type.get_shape()) if isinstance(arg.type, TensorType) else []
            if role == "activation" and shp:
                hidden = shp[-1]
            if role == "input" and len(shp) == 2:
                batch, seq = shp
            if role == "parameter" and param:
                experts_named = experts_named or rules.is_expert(param)
                d = rules.tp_dim(param)
                if d is not None and d < len(shp):
                    split_dims.append((param, shp[d]))
                if d is not None or rules.is_expert(param):
                    whole_blocks.discard(part)
        for op in fn.walk():
            if isinstance(op, AtenOp) and rules.op_kind(op.overload) == "attention" and heads is None:
                q = op.inputs[0].type.get_shape()
                if len(q) == 4:
                    heads, head_dim = q[1], q[3]
                    attn_seq = q[2]
    if seq is None and attn_seq is not None:  # a block without token inputs: the sequence its attention sees
        seq = attn_seq
    if head_dim:
        for param, rows in split_dims:
            if param.endswith(("attention.wk.weight", "self_attn.k_proj.weight")):
                kv = rows // head_dim
    from flint.sharding.cp import check_program as check_cp
    from flint.sharding.moe import check_plan, n_experts_of

    experts = n_experts_of(module, rules)
    plan.check_model(n_heads=heads, n_kv_heads=kv, hidden=hidden, seq_len=seq, n_experts=experts,
                     local_batch=batch // plan.dp if batch and batch % plan.dp == 0 else None)
    check_plan(plan, experts, module)
    check_cp(module, plan)
    if plan.master_dtype != "param" and not any(_role(fn, i)[0] == "master" for fn in module.ops
                                                if isinstance(fn, func.FuncOp)
                                                for i in range(len(fn.body.block.args))):
        raise PlanError("master_dtype", f"'{plan.master_dtype}' master parameters: the program's optimizer steps "
                        "the parameters themselves, and shard-expand cannot add masters; capture the "
                        f"single-device program with master_dtype = \"{plan.master_dtype}\" (a plan file with "
                        "it, --world-size 1)", plan.source)
    form = optimizer_form_of(module)
    if form is not None and plan.optimizer_impl not in (form, Plan().optimizer_impl):
        raise PlanError("optimizer_impl", f"'{plan.optimizer_impl}': the program's optimizer runs the {form} "
                        "form, and shard-expand expands the program's own ops; capture the single-device "
                        f"program with optimizer_impl = \"{plan.optimizer_impl}\" (a plan file with it, "
                        "--world-size 1)", plan.source)
    check_checkpointing(module, plan)
    clips = program_max_norm(module)
    if plan.max_norm and clips is None:
        raise PlanError("max_norm", f"{plan.max_norm:g}: the program does not clip its gradients, and shard-expand "
                        "cannot add clipping; capture the single-device program with max_norm = "
                        f"{plan.max_norm:g} (a plan file with it, --world-size 1)", plan.source)
    if plan.max_norm and clips and plan.max_norm != clips:
        raise PlanError("max_norm", f"{plan.max_norm:g}: the program clips at {clips:g}; capture the single-device "
                        f"program with max_norm = {plan.max_norm:g}", plan.source)
    if plan.zero != 3 and not fsdp_axes(plan):
        raise PlanError("zero", f"ZeRO-{plan.zero} shards over dp_shard (and cp); this plan has dp_shard = 1 and "
                        "cp = 1, so there is nothing to shard", plan.source)
    if batch is not None and batch % plan.dp:
        raise FlintError(f"plan: the batch of {batch} sequences is not divisible by the data-parallel degree "
                         f"dp_replicate*dp_shard = {plan.dp}")
    if plan.tp > 1 and (not split_dims and not experts_named or whole_blocks):
        what = f"no parameter of @{sorted(whole_blocks)[0]}_fwd" if whole_blocks else "no parameter of the program"
        raise PlanError("tp", f"{what} matches a [[tp]] pattern of {rules.source}, so tensor parallelism "
                        "would leave those weights whole on every TP rank; add your model's parameter names "
                        "there (a copy, passed with --rules / rules=...), or capture the plan instead: "
                        "flint capture --plan ... --tp ...", plan.source)
    if plan.tp > 1:
        for fn in module.ops:
            if isinstance(fn, func.FuncOp) and fn.sym_name.data.endswith("_fwd"):
                check_tp_pairs(fn, rules, plan)
    stages = sorted(n for n in ("first_stage", "last_stage") if f"{n}_fwd" in {f.sym_name.data for f in module.ops
                                                                             if isinstance(f, func.FuncOp)})
    if plan.sp and plan.tp > 1 and stages:
        raise PlanError("sp", f"sequence parallelism of a model file's step (@{'_fwd, @'.join(stages)}_fwd: its work "
                        "before and after the blocks, captured from the one model) is not checked against a "
                        "captured run in shard-expand; capture the plan instead: flint capture --plan tp+sp ...",
                        plan.source)
    if plan.sp and plan.tp > 1 and (around := _part_around_blocks(module)) is not None:
        raise PlanError("sp", f"sequence parallelism where @{around}_fwd runs around the blocks (passes them "
                        "through, as a Hugging Face model is captured: embedding, final norm and head in one "
                        "function) is not implemented by shard-expand: the program does not say where the "
                        "sequence is split at the blocks' boundary; capture the plan instead: flint capture "
                        "--plan tp+sp ...", plan.source)
    for param, size in split_dims:
        if plan.tp > 1 and size % plan.tp:
            raise FlintError(f"plan field 'tp': {plan.tp} does not divide dim of size {size} of parameter '{param}'")


def check_checkpointing(module: ModuleOp, plan: Plan) -> None:
    """The plan's activation checkpointing against the program's (its capture's ``flint.plan``): a plan that sets
    it must name the program's; then :func:`check_plan_checkpointing` of the mode that runs."""
    recorded = plan_of(module)
    mode, every = (recorded.activation_checkpoint, recorded.ac_every) if recorded is not None else ("none", 1)
    if plan.activation_checkpoint != "none" and (plan.activation_checkpoint, plan.ac_every) != (mode, every):
        what = f"'{mode}'" + (f" every {every}" if mode == "selective-layer" else "")
        raise PlanError("activation_checkpoint", f"'{plan.activation_checkpoint}': the program was captured with "
                        f"{what}; capture the single-device program with the plan's activation_checkpoint (and "
                        "ac_every), --world-size 1", plan.source)
    check_plan_checkpointing(replace(plan, activation_checkpoint=mode, ac_every=every))


def check_plan_checkpointing(plan: Plan) -> None:
    """The activation checkpointing the planned path does not expand, from the plan alone (flint explore asks
    before capturing). selective-op: its policy leaves every second ``mm`` to the partitioner
    (``PREFER_RECOMPUTE``), whose min-cut decides on the distributed program otherwise than on the single-device
    one (llama-tiny FSDP 4: one more ``mm`` output saved per block by the direct capture, 10% of the
    activations). selective-layer with pp: the single-device program has two block parts, and pipeline-split
    stages one repeated part."""
    if plan.pp > 1 and plan.activation_checkpoint == "selective-layer":
        raise PlanError("activation_checkpoint", "'selective-layer' with pp is not expanded: the single-device "
                        "program has two block parts (plain and checkpointed), and pipeline-split splits one "
                        "repeated part into stages; capture the plan instead (its pipeline repeats the whole "
                        "pattern of ac_every blocks)", plan.source)
    if plan.activation_checkpoint == "selective-op":
        raise PlanError("activation_checkpoint", "'selective-op' is not expanded by shard-expand: its policy leaves "
                        "every second mm to the partitioner, which decides on the distributed program otherwise "
                        "than on one device; capture the plan instead (flint capture --plan-file, or flint "
                        "explore's captured path, which it takes by itself)", plan.source)


def program_max_norm(module: ModuleOp) -> float | None:
    """The program's gradient-norm clipping threshold: None when it does not clip (no @grad_clip), else the
    threshold its capture recorded (``flint.plan``'s ``max_norm``; 0.0 where no plan records one)."""
    if not any(isinstance(f, func.FuncOp) and f.sym_name.data == CLIP_FUNCTION for f in module.ops):
        return None
    plan = plan_of(module)
    return plan.max_norm if plan is not None else 0.0


_WEIGHT_PATH = ("t", "transpose", "permute", "view", "_unsafe_view", "reshape", "_to_copy", "clone", "detach", "alias")


def _weight_uses(arg: SSAValue, dim: int | None):
    """(matmul op, operand index, the split dim's position there) of each matmul that reads parameter value
    ``arg`` (through transposes, views and casts); the position is None for a parameter tp leaves whole, or
    where the path loses it (a permute, a view that changes the shape)."""
    todo = [(arg, dim)]
    while todo:
        v, d = todo.pop()
        for use in v.uses:
            op = use.operation
            name = op.overload.split(".")[1] if isinstance(op, AtenOp) else ""
            if name in ("mm", "addmm", "bmm", "baddbmm"):
                yield op, use.index, d
            elif name in _WEIGHT_PATH and len(op.outputs) == 1:
                out = op.outputs[0]
                if name in ("t", "transpose") and len(shape_of(v)) == 2:
                    todo.append((out, None if d is None else 1 - d))
                else:
                    todo.append((out, d if shape_of(out) == shape_of(v) and name != "permute" else None))


def check_tp_pairs(fn: func.FuncOp, rules: Rules, plan: Plan) -> None:
    """Every column-parallel layer's output reaches a row-parallel layer before a layer tp leaves whole reads it.

    A PyTorch tensor-parallel plan pairs them (ColwiseParallel's output, split on its features, is what
    RowwiseParallel's input expects); a column-parallel layer whose output reaches a whole layer first is a
    rules file that names some of a block's projections and not the rest (XGLM under the Llama-family names:
    q/k/v_proj split, out_proj, fc1 and fc2 whole). Expanded anyway, the whole layer's input is gathered over
    tp (the heads, all-to-alls in backward) and every rank runs it whole: a plan no PyTorch run runs."""
    column: dict = {}  # matmul op -> column-parallel parameter
    whole: dict = {}  # matmul op -> parameter tp leaves whole (2-D: a Linear's weight)
    row: set = set()
    for i, arg in enumerate(fn.body.block.args):
        role, param = _role(fn, i)
        if role != "parameter" or not param or rules.is_expert(param) or len(shape_of(arg)) != 2:
            continue
        d = rules.tp_dim(param)
        for op, index, pos in _weight_uses(arg, d):
            name = op.overload.split(".")[1]
            right = index == (2 if name in ("addmm", "baddbmm") else 1)  # the [k, n] operand
            if d is None:
                whole.setdefault(op, param)
            elif right and pos == 1:
                column.setdefault(op, param)
            elif right and pos == 0:
                row.add(op)
    for start, param in column.items():
        seen, todo = {start}, [start]
        while todo:
            op = todo.pop()
            for r in op.results:
                for use in r.uses:
                    nxt = use.operation
                    if nxt in seen:
                        continue
                    seen.add(nxt)
                    if nxt in whole:
                        raise PlanError("tp", f"in @{fn.sym_name.data}, column-parallel '{param}' (split on its "
                                        f"outputs by a [[tp]] pattern of {rules.source}) feeds '{whole[nxt]}', which "
                                        "no pattern splits, without a row-parallel layer between: no PyTorch "
                                        "tensor-parallel plan runs that (ColwiseParallel's output is what "
                                        "RowwiseParallel reads); add the block's other projections to a copy of "
                                        "the rules (shard_dim 1 for a row-parallel Linear; --rules / rules=...), "
                                        "or capture the plan instead: flint capture --plan ... --tp ... "
                                        "--parallelize ...", plan.source)
                    if nxt not in row and nxt not in column:
                        todo.append(nxt)


def _part_around_blocks(module: ModuleOp) -> str | None:
    """The part run once that computes the loss before a later forward in the schedule (the blocks it
    passes through), or None: there, the activation handed to the blocks is not the part's first result."""
    funcs = {f.sym_name.data: f for f in module.ops if isinstance(f, func.FuncOp)}
    fwd = [n for n, _ in get_schedule(module) if n.endswith("_fwd") and n in funcs]
    for name in fwd[:-1]:
        results = funcs[name].function_type.outputs.data
        if results and isinstance(results[0], TensorType) and not results[0].get_shape():
            return name[:-4]
    return None


@dataclass(frozen=True)
class ShardAnnotatePass(ModulePass):
    """Annotate a single-device step with the shardings a parallelism plan gives it.

    For every function of the step it inserts, at the top, a ``shard.sharding``
    and a ``shard.shard`` per argument: parameters get their storage sharding
    (``tp`` split by the rules in ``flint/sharding/rules.toml``, then dim 0 over
    the FSDP axes) and, where computing needs another layout, a second
    ``shard.shard ... annotate_for_users`` with the compute sharding (the FSDP
    all-gather); batch inputs are split over the data-parallel axes; the
    activation between blocks also over ``tp`` on the sequence with ``sp``.
    Before ``func.return`` it annotates the activation output, its gradient
    and every parameter gradient (``flint.param`` on the ``shard.shard``).
    With FSDP, backward functions gain the parameters of their part as
    arguments (FSDP re-gathers a whole unit before its backward).

    The grid becomes the plan's mesh and the plan is recorded as ``flint.plan``.

    With ``cp`` the sequence dim of batch inputs and activations is split
    over ``cp`` too, and FSDP shards over ``dp_shard x cp``. ``zero`` picks
    how parameter state is stored (:func:`flint.sharding.rules.zero_storage_sharding`).

    Options: ``plan`` (a plan TOML file; wins over the inline fields),
    ``dp_replicate``, ``dp_shard``, ``tp``, ``sp``, ``tp_style``, ``ep``, ``capacity_factor``, ``cp``,
    ``zero``, ``etp``, ``rules`` (a rules TOML; default the built-in rules). Plan
    fields shard-expand does not implement (pp, ...) are refused before
    any change.
    """

    name = "shard-annotate"

    plan: str = ""
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    sp: bool = False
    tp_style: str = "dtensor"
    ep: int = 1
    capacity_factor: float = 1.0
    rules: str = ""
    cp: int = 1
    zero: int = 3
    etp: int = 1

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        plan = plan_from_options(self)
        plan.require(EXPAND_FIELDS, "shard-expand")
        rules = rules_for(op, self.rules or None)
        check_single_device(op)
        check_model(op, plan, rules)
        annotate(op, plan, rules)


def annotate(module: ModuleOp, plan: Plan, rules: Rules) -> None:
    axis_index = set_grid(module, plan)
    # a plan leaving the optimizer's form, the clipping threshold or activation checkpointing unset records the
    # program's (check_model refused others named)
    form, clips, recorded = optimizer_form_of(module), program_max_norm(module), plan_of(module)
    plan = replace(plan, optimizer_impl=form or plan.optimizer_impl, max_norm=plan.max_norm or clips or 0.0)
    if recorded is not None and plan.activation_checkpoint == "none":
        plan = replace(plan, activation_checkpoint=recorded.activation_checkpoint, ac_every=recorded.ac_every)
    attach(module, plan)
    funcs = {f.sym_name.data: f for f in module.ops if isinstance(f, func.FuncOp)}
    # the parameters of each part (from its forward function)
    part_params: dict[str, list[tuple[str, TensorType]]] = {}
    for name, fn in funcs.items():
        if name.endswith("_fwd"):
            part = name[:-4]
            part_params[part] = [(p, a.type) for i, a in enumerate(fn.body.block.args)
                                 for r, p in [_role(fn, i)] if r == "parameter" and p]
    units = dp_units(module) if fsdp_axes(plan) else {}
    kept = kept_through_backward(module, plan, part_params, units)
    for name, fn in funcs.items():
        part, _, phase = name.rpartition("_")
        if phase == "bwd" and fsdp_axes(plan) and part in part_params:
            have = {_role(fn, i)[1] for i in range(len(fn.body.block.args))}
            skip = _not_gathered_in_backward(funcs[part + "_fwd"], units)
            for p, t in part_params[part]:
                if p not in have and p not in kept and units.get(p) not in skip:
                    _add_param_arg(fn, p, t)
        _annotate_function(fn, phase, plan, rules, axis_index, part_params.get(part, []), kept)


def _not_gathered_in_backward(fwd: func.FuncOp, units: dict[str, str]) -> set[str]:
    """Units (:func:`dp_units` keys) of a part that takes no activation (the first part: its inputs are the
    step's) which FSDP2 does not gather again in backward. It gathers a unit before its backward where its
    output needs a gradient (the first unit, in forward order, with a trainable parameter and every one after
    it: a hook on the output, FSDPState._pre_backward) and, prefetching, the unit whose forward ran just
    before the first of those (FSDPParamGroup._backward_prefetch); not the frozen ones before (a frozen
    embedding and frozen bottom layers of partial fine-tuning: no gradient reaches them)."""
    args = fwd.body.block.args
    if any(_role(fwd, i)[0] == "activation" for i in range(len(args))):
        return set()
    frozen = frozen_args(fwd)
    order: list[str] = []
    trainable: set[str] = set()
    for i in range(len(args)):
        role, param = _role(fwd, i)
        if role == "parameter" and param in units:
            key = units[param]
            if key not in order:
                order.append(key)
            if i not in frozen:
                trainable.add(key)
    first = next((k for k, key in enumerate(order) if key in trainable), None)
    if first is None:
        return set()  # nothing trainable here: no backward gathers these (nor is there a backward)
    return set(order[:max(first - 1, 0)])


def kept_through_backward(module: ModuleOp, plan: Plan, part_params: dict, units: dict[str, str]) -> frozenset[str]:
    """Parameters FSDP keeps unsharded from forward to backward under ZeRO-3: those of the last part in
    forward order that runs once (the zoo's head: final norm and output; a Hugging Face model's part around
    its blocks), as torchtitan wraps ``[norm, output]`` with ``reshard_after_forward=False`` and FSDP2 never
    reshards its root group: the backward starts there, so gathering again would repeat the forward's
    gather. A token embedding or a layer that is its own unit (``units``, :func:`dp_units`) is still resharded."""
    if plan.zero != 3 or not fsdp_axes(plan):
        return frozenset()
    once = [n[:-4] for n, count in get_schedule(module) if n.endswith("_fwd") and count == 1]
    if not once or once[-1] not in part_params:
        return frozenset()  # repeated blocks: one unit per layer, each resharded (the last one too)
    return frozenset(p for p, _ in part_params[once[-1]] if p not in units)


def _add_param_arg(fn: func.FuncOp, param: str, t: TensorType) -> None:
    block = fn.body.block
    block.insert_arg(t, len(block.args))
    attrs = list(fn.arg_attrs.data) if fn.arg_attrs is not None else []
    attrs.append(DictionaryAttr({ROLE_ATTR: StringAttr("parameter"), PARAM_ATTR: StringAttr(param)}))
    fn.arg_attrs = ArrayAttr(attrs)
    fn.function_type = func.FunctionType.from_lists([a.type for a in block.args], fn.function_type.outputs.data)


def _annotate_function(fn: func.FuncOp, phase: str, plan: Plan, rules: Rules, axis_index: dict[str, int],
                       params: list[tuple[str, TensorType]], kept: frozenset[str] = frozenset()) -> None:
    block: Block = fn.body.block
    first = block.first_op
    for i, arg in enumerate(block.args):
        if not isinstance(arg.type, TensorType):
            continue
        role, param = _role(fn, i)
        rank = len(arg.type.get_shape())
        storage = compute = None
        if role == "parameter" and param or role in ("gradient", "master", "exp_avg", "exp_avg_sq") and param:
            storage = zero_storage_sharding(plan, rules, param, rank, role, phase, arg.type.get_shape())
            if role == "parameter" and phase == "bwd" and param in kept:  # the forward's gather kept, as ZeRO-2's
                storage = param_compute_sharding(plan, rules, param, rank)
            if role == "parameter" and phase != "optim":
                compute = param_compute_sharding(plan, rules, param, rank)
            elif role == "parameter" and plan.zero == 1:  # ZeRO-1: each rank steps its shard of the parameter
                compute = param_storage_sharding(plan, rules, param, rank, arg.type.get_shape())
        elif role == "input":
            # a dim of size 1 broadcasts (the rotary cos / sin a Hugging Face model passes every block)
            storage = batch_sharding(plan, rank)
            storage = Sharding(tuple(() if n == 1 else ax for n, ax in zip(arg.type.get_shape(), storage.dims)))
        elif role in ("activation", "tangent"):
            storage = activation_sharding(plan, rank) if rank >= 2 else Sharding.replicated(rank)
        elif role in ("buffer", "step", "grad_norm", "clip_coef"):
            storage = Sharding.replicated(rank)
        if storage is None:
            continue  # saved values: shard-expand takes them from the forward
        uses = [u for u in list(arg.uses) if not isinstance(u.operation, func.ReturnOp)]
        s_op = sharding_op(storage, axis_index)
        sh = ShardOp(arg, s_op.result, None)
        block.insert_ops_before([s_op, sh], first)
        last = sh.result
        if compute is not None and compute != storage:
            c_op = sharding_op(compute, axis_index)
            ch = ShardOp(sh.result, c_op.result, UnitAttr())
            block.insert_ops_before([c_op, ch], first)
            last = ch.result
        for u in uses:
            u.operation.operands[u.index] = last
    ret = block.last_op
    if not isinstance(ret, func.ReturnOp) or phase == "optim":
        return
    targets = _result_targets(fn, phase, plan, rules, params)
    new_operands = list(ret.operands)
    for i, (v, target) in enumerate(zip(ret.operands, targets)):
        if target is None:
            continue
        s, param = target
        s_op = sharding_op(s, axis_index)
        sh = ShardOp(v, s_op.result, None)
        if param:
            sh.attributes[PARAM_ATTR] = StringAttr(param)
        block.insert_ops_before([s_op, sh], ret)
        new_operands[i] = sh.result
    ret.operands = new_operands


def _result_targets(fn: func.FuncOp, phase: str, plan: Plan, rules: Rules,
                    params: list[tuple[str, TensorType]]) -> list:
    results = list(fn.body.block.last_op.operands)
    out: list = [None] * len(results)
    if phase == "fwd":
        if results and isinstance(results[0].type, TensorType) and len(results[0].type.get_shape()) >= 2:
            out[0] = (activation_sharding(plan, len(results[0].type.get_shape())), None)
        return out
    # backward: gradients of the forward's activation / parameter arguments, in order
    fwd = _forward_of(fn)
    if fwd is None:
        return out
    args = fwd.body.block.args
    frozen = frozen_args(fwd)
    wanted = [(r, p, a.type) for i, a in enumerate(args) for r, p in [_role(fwd, i)]
              if r in ("activation", "parameter") and i not in frozen]
    if len(wanted) != len(results):
        raise FlintError(f"shard-annotate: @{fn.sym_name.data} returns {len(results)} gradients but "
                         f"@{fwd.sym_name.data} has {len(wanted)} arguments that need one (activations and "
                         "parameters that are not frozen)")
    for i, ((role, param, t), v) in enumerate(zip(wanted, results)):
        if v.type != t:
            raise FlintError(f"shard-annotate: result {i} of @{fn.sym_name.data} ({v.type}) is not the "
                             f"gradient of argument {t} of @{fwd.sym_name.data}")
        rank = len(t.get_shape())
        if role == "activation":
            out[i] = (activation_sharding(plan, rank), None)
        else:
            out[i] = (zero_storage_sharding(plan, rules, param, rank, "gradient", phase, t.get_shape()), param)
    return out


def _forward_of(fn: func.FuncOp) -> func.FuncOp | None:
    name = fn.sym_name.data[:-4] + "_fwd"
    module = fn.parent_op()
    for op in module.ops if module is not None else ():
        if isinstance(op, func.FuncOp) and op.sym_name.data == name:
            return op
    return None


def embedding_units(module: ModuleOp) -> frozenset[str]:
    """Parameters an FSDP / DDP unit of their own, as the captured recipes wrap them: the untied
    input embedding (``get_input_embeddings``) of a forward function that also holds parameters other
    than embedding tables (a Hugging Face model's part around its blocks: norm, output projection):
    a table only ``aten.embedding`` reads, looking up the step's token input (not a learned position
    table, which looks up computed positions; not a table the output projection shares)."""
    own = set()
    for fn in module.ops:
        if not isinstance(fn, func.FuncOp) or not fn.sym_name.data.endswith("_fwd"):
            continue
        args = fn.body.block.args
        params = {i: p for i in range(len(args)) for r, p in [_role(fn, i)] if r == "parameter" and p}
        if len(params) < 2:
            continue
        tables, tokens = set(), set()
        for i, p in params.items():
            users, todo = [], [args[i]]
            while todo:  # through the annotations to the ops computing with the parameter
                for u in todo.pop().uses:
                    if isinstance(u.operation, ShardOp):
                        todo.append(u.operation.result)
                    else:
                        users.append((u.operation, u.index))
            if users and all(isinstance(o, AtenOp) and o.overload == "aten.embedding.default" and k == 0
                             for o, k in users):
                tables.add(p)
                if all(_is_step_input(fn, o.operands[1]) for o, _ in users):
                    tokens.add(p)
        if len(tables) < len(params):  # a part of embeddings only (the zoo's) is one unit as it is
            own |= tokens
    return frozenset(own)


def dp_units(module: ModuleOp) -> dict[str, str]:
    """Parameters outside the rest of their function's FSDP / DDP unit, each mapped to its own unit's key:
    the untied input embedding (:func:`embedding_units`, keyed by its name) and the parameters of layers of
    the repeated blocks' stack that run outside the blocks (a Hugging Face model's leading layers whose input
    needs no gradient, DeepSeek-V3's dense first layers, the layers after the pattern's last repeat), keyed by
    the layer (``model.layers.2``): a training script wraps each layer with ``fully_shard`` / ``replicate``.
    The stack is the path before the first all-digit component of a repeated forward's parameter names, and
    the one the capture records (``flint.layers``: the stack the captured path's preset wraps layer by layer,
    whose layers need not repeat, as a ResNet's stages)."""
    from flint.sharding.rules import LAYERS_ATTR

    units = {p: p for p in embedding_units(module)}
    funcs = {f.sym_name.data: f for f in module.ops if isinstance(f, func.FuncOp)}
    repeated = {n for n, count in get_schedule(module) if count > 1}
    recorded = module.attributes.get(LAYERS_ATTR)
    stacks = {recorded.data} if isinstance(recorded, StringAttr) else set()
    for name in repeated:
        fn = funcs.get(name)
        if fn is None or not name.endswith("_fwd"):
            continue
        for i in range(len(fn.body.block.args)):
            role, param = _role(fn, i)
            parts = param.split(".") if role == "parameter" and param else []
            j = next((k for k, c in enumerate(parts[:-1]) if c.isdigit()), None)
            if j is not None:
                stacks.add(".".join(parts[:j]))
    if not stacks:
        return units
    for name, fn in funcs.items():
        if name in repeated:
            continue
        for i in range(len(fn.body.block.args)):
            role, param = _role(fn, i)
            if role != "parameter" or not param or param in units:
                continue
            for stack in sorted(stacks):
                rest = param[len(stack) + 1:].split(".") if param.startswith(stack + ".") else []
                if len(rest) > 1 and rest[0].isdigit():
                    units[param] = f"{stack}.{rest[0]}"
    return units


def _is_step_input(fn: func.FuncOp, v: SSAValue) -> bool:
    """Whether ``v`` is a batch input of ``fn`` (role ``input``), through annotations and views."""
    while True:
        if isinstance(v, BlockArgument):
            return v.owner is fn.body.block and _role(fn, v.index)[0] == "input"
        o = v.owner
        if isinstance(o, ShardOp):
            v = o.src
        elif isinstance(o, AtenOp) and o.overload.split(".")[1] in ("view", "_unsafe_view", "reshape") and o.operands:
            v = o.operands[0]
        else:
            return False
