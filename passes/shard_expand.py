"""`shard-expand`: an annotated single-device step -> the per-rank SPMD step with `dist` collectives."""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ArrayAttr, FloatAttr, IntegerAttr, ModuleOp, StringAttr, TensorType, f64, i64
from xdsl.dialects.shard import GridOp, ShardingOp, ShardOp
from xdsl.ir import Block, BlockArgument, Operation, Region, SSAValue
from xdsl.passes import ModulePass

from flint.chakra.from_ir import AXIS_NAMES_ATTR
from flint.cost.flops import is_multi_tensor
from flint.errors import FlintError
from flint.ir import dist
from flint.ir.aten import CLIP_FUNCTION, AtenOp, get_schedule, op_tensor_lists
from flint.passes.shard_annotate import PARAM_ATTR, _role, dp_units, read_sharding
from flint.plan import Plan, plan_of
from flint.sharding.engine import ExpandError, FunctionExpander, demand_pass, shape_of
from flint.sharding.moe import (assignments_of, gather_experts, grouped_experts_of, make_expander, n_experts_of,
                                reduce_expert_grads)
from flint.sharding.rules import Rules, fsdp_axes, rules_for
from flint.sharding.spec import Sharding

EXPANDED_ATTR = "flint.expanded"


@dataclass(frozen=True)
class ShardExpandPass(ModulePass):
    """Expand an annotated single-device step into the per-rank SPMD program.

    Reads the ``shard.shard`` annotations ``shard-annotate`` placed and the
    plan in ``flint.plan``; propagates shardings through every function in
    schedule order with the rules in ``flint/sharding/rules.toml`` (see
    :mod:`flint.sharding.engine`); rebuilds each op with its per-rank shape
    and emits `dist` collectives where a value's sharding changes. Data
    parallelism follows FSDP2 / DDP per function (one unit: embedding, ONE
    block, head): FSDP gathers the unit's flat parameter shards with one
    ``dist.all_gather`` at the top of its forward and again of its backward
    (but the last part, the head, whose gathered parameters are kept from
    forward to backward as torchtitan's ``reshard_after_forward=False`` on
    ``[norm, output]``), and reduce-scatters the flat gradients once; DDP all-reduces them once
    (average); HSDP reduce-scatters, then all-reduces the shard over
    ``dp_replicate``. Values saved for backward keep the layout the forward
    produced (``tp_style = "dtensor"``: the gathered input a matmul consumed;
    ``"megatron"``: the sequence shard, gathered again in backward). With
    ``tp_style = "dtensor"`` sequence-parallel norm gradients leave backward
    partial over ``tp`` and the optimizer all-reduces them, as DTensor does
    under TP alone; with data parallelism they are all-reduced over ``tp`` in
    backward, before the data-parallel collective, as FSDP2 and
    ``replicate`` redistribute them to the weight's placement.
    Attention over a sequence split on ``cp`` becomes PyTorch's ring attention
    (:mod:`flint.sharding.cp`: K/V all-gather, load-balanced causal steps,
    the K/V gradient sent round the ring). ZeRO-2 skips the backward
    re-gather; ZeRO-1 all-reduces gradients and all-gathers the shards the
    optimizer updated.

    Afterwards: no ``shard`` annotation is left, every tensor has its
    per-rank shape, the function structure and ``flint.schedule`` are
    unchanged, and the module verifies. An op with no rule fails naming it
    and its source location. Options: ``rules`` (a rules TOML).

    Mixture of experts (:mod:`flint.sharding.moe`): each rank routes its own
    tokens; with ``ep > 1`` expert weights are split over the ``ep`` axes and
    tokens move to their experts and back with ``dist.all_to_all`` (forward
    after a token-count exchange, and backward), buffers sized by the plan's
    ``capacity_factor``; expert weights are their own FSDP unit over
    ``dp_shard_mod_ep``.
    """

    name = "shard-expand"

    rules: str = ""

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        plan = plan_of(op)
        if plan is None or not any(isinstance(o, ShardOp) for o in op.walk()):
            raise FlintError("shard-expand: the module has no sharding annotations; run shard-annotate first")
        expand(op, plan, rules_for(op, self.rules or None))


def expand(module: ModuleOp, plan: Plan, rules: Rules) -> None:
    grid = next(o for o in module.ops if isinstance(o, GridOp))
    names = [a.data for a in grid.attributes[AXIS_NAMES_ATTR].data]
    sizes = dict(zip(names, grid.shape.get_values()))
    funcs = {f.sym_name.data: f for f in module.ops if isinstance(f, func.FuncOp)}
    order = [n for n, _ in get_schedule(module)]
    order = [n for n in order if n.endswith("_fwd")] + [n for n in order if n.endswith("_bwd")] + \
        [n for n in order if not n.endswith(("_fwd", "_bwd"))]
    order += [n for n in funcs if n not in order]
    state = _State(plan, rules, names, sizes)
    state.n_experts, state.assignments = n_experts_of(module, rules), assignments_of(module, rules)
    state.grouped = grouped_experts_of(module, rules)
    state.unit_of = dp_units(module)
    for name in order:
        fn = funcs[name]
        try:
            new = state.expand_function(fn)
        except ExpandError as e:
            if f"@{name}" in str(e):
                raise
            raise ExpandError(f"{e} (in @{name})") from None  # an op without a source line (the optimizer's)
        fn.detach_region(fn.body)
        fn.add_region(new[0])
        fn.function_type = func.FunctionType.from_lists(new[1], new[2])
    module.attributes[EXPANDED_ATTR] = IntegerAttr(1, i64)


class _State:
    """Shardings carried between functions: saved values (forward -> backward) and gradients
    (backward -> optimizer)."""

    def __init__(self, plan: Plan, rules: Rules, names: list[str], sizes: dict[str, int]):
        self.plan, self.rules = plan, rules
        self.names, self.sizes = names, sizes
        self.axis_index = {a: i for i, a in enumerate(names)}
        self.fwd_results: dict[str, list[Sharding]] = {}
        self.grad_sharding: dict[str, Sharding] = {}
        self.fwd_hints: dict[str, list] = {}
        self.fsdp = fsdp_axes(plan)
        self.cp = tuple(plan.axes("cp"))
        self.replicate = tuple(plan.axes("dp_replicate")) if plan.dp_replicate > 1 else ()
        self.tp = tuple(plan.axes("tp"))
        self.n_experts: int | None = None  # MoE: experts per layer, tokens * top_k (flint.sharding.moe)
        self.assignments: int | None = None
        self.grouped: tuple | None = None  # Hugging Face's grouped-GEMM experts: (experts, routed tokens)
        self.unit_of: dict[str, str] = {}  # parameters outside their function's unit -> their own unit's key
        self.clip_axes: set[str] = set()  # axes the gradients of the parts' norm functions are split on

    # ------------------------------------------------------------------ one function

    def expand_function(self, fn: func.FuncOp) -> tuple[Region, list, list]:
        name = fn.sym_name.data
        part, _, phase = name.rpartition("_")
        old = fn.body.block
        ops = list(old.ops)
        sharding_ops = {o.result: read_sharding(o, self.names) for o in ops if isinstance(o, ShardingOp)}
        new_block = Block()
        # a part's gradient-norm function (clipping): its norms are of local shards, reduced by @grad_clip
        norms = name != CLIP_FUNCTION and any(_role(fn, i)[0] == "grad_norm" for i in range(len(old.args)))
        ex = make_expander(self.plan, self.rules, self.n_experts, self.assignments, self.grouped, sizes=self.sizes,
                           axis_index=self.axis_index,
                           grid="mesh", emit=new_block.add_op,
                           tp_style=self.plan.tp_style, eager_axes=self.tp, sequence_parallel=self.plan.sp,
                           cp_axes=self.cp, local_norms=norms)
        # argument shardings: annotations, else what the forward returned / backward produced
        storage: dict[int, Sharding] = {}
        compute: dict[SSAValue, tuple[int, Sharding]] = {}
        arg_of: dict[SSAValue, int] = {a: i for i, a in enumerate(old.args)}
        returns: dict[int, tuple[Sharding, str | None]] = {}
        ret = old.last_op
        for o in ops:
            if not isinstance(o, ShardOp):
                continue
            s = sharding_ops[o.sharding]
            if o.src in arg_of:
                storage[arg_of[o.src]] = s
            elif o.annotate_for_users is not None and isinstance(o.src.owner, ShardOp) and o.src.owner.src in arg_of:
                compute[o.result] = (arg_of[o.src.owner.src], s)
            else:
                for i, r in enumerate(ret.operands):
                    if r is o.result:
                        p = o.attributes.get(PARAM_ATTR)
                        returns[i] = (s, p.data if p else None)
        saved = self._saved_shardings(fn, phase, part, storage)
        saved_hints = self._saved_shardings(fn, phase, part, storage, self.fwd_hints)
        for i, a in enumerate(old.args):
            if i in storage:
                continue
            if i in saved:
                storage[i] = saved[i]
            elif isinstance(a.type, TensorType):
                raise ExpandError(f"shard-expand: argument {i} of @{name} (role '{_role(fn, i)[0]}') has no "
                                  "sharding: neither annotated nor produced by the forward")
        for i, a in enumerate(old.args):
            role, param = _role(fn, i)
            if role == "gradient" and param in self.grad_sharding:
                storage[i] = self.grad_sharding[param]
        if norms:
            self.clip_axes |= {a for i in storage if _role(fn, i)[0] == "gradient" for a in storage[i].axes()}
        new_args = []
        for i, a in enumerate(old.args):
            t = a.type
            if isinstance(t, TensorType):
                t = TensorType(t.element_type, storage[i].local_shape(t.get_shape(), self.sizes))
            new_args.append(new_block.insert_arg(t, i))
            new_args[-1].name_hint = a.name_hint
            if isinstance(a.type, TensorType):
                ex.bind(a, new_args[-1], storage[i])
                if i in saved_hints and saved_hints[i]:
                    ex.hints[new_args[-1]] = saved_hints[i]
        # annotations: storage values, then the FSDP unit gather, then other compute layouts
        gather = []
        for o in ops:
            if isinstance(o, ShardOp) and o.src in arg_of:
                ex.bind(o.result, new_args[arg_of[o.src]], storage[arg_of[o.src]])
        if name == CLIP_FUNCTION:
            self._global_norm(ex, fn, ops)
        for o in ops:
            if isinstance(o, ShardOp) and o.result in compute:
                i, s = compute[o.result]
                if self.fsdp and _role(fn, i)[0] == "parameter" and set(self.fsdp) & storage[i].axes():
                    gather.append((o.result, i, s))
                else:
                    ex.bind(o.result, ex.value(o.src, s, f"argument {i} of @{name}"), s)
        gather = gather_experts(self, ex, old, gather, new_args, storage, phase, fn)
        for unit in self._units(gather, lambda g: _role(fn, g[1])[1]):
            self._unit_gather(ex, old, unit, new_args, storage, phase)
        # demanded splits of returned gradients (gemms producing them compute only their shard)
        seeds = {}
        for i, (s, _) in returns.items():
            src = ret.operands[i].owner.src
            want = {d: tuple(a for a in ax if a not in self.fsdp) for d, ax in enumerate(s.dims)}
            want = {d: ax for d, ax in want.items() if ax}
            if want:
                seeds[src] = want
        ex.demand = demand_pass(ops, self.rules, seeds)
        for o in ops:
            if isinstance(o, (ShardingOp, ShardOp, func.ReturnOp)):
                continue
            if isinstance(o, AtenOp):
                ex.expand_op(o)
            else:
                raise ExpandError(f"shard-expand: '{o.name}' in @{name} has no sharding rule "
                                  "(expand a single-device program of aten ops)")
        if phase == "optim" and self.plan.zero == 1 and self.fsdp:
            self._zero1_sync(ex, fn, old, new_args)
        results, result_sh = self._returns(ex, fn, phase, part, ret, returns, storage, new_block)
        new_block.add_op(func.ReturnOp(*results))
        _erase_dead(new_block)
        if phase == "fwd":
            self.fwd_results[part] = result_sh
            self.fwd_hints[part] = [ex.hints.get(v) for v in results]
        return Region(new_block), [a.type for a in new_args], [r.type for r in results]

    def _saved_shardings(self, fn: func.FuncOp, phase: str, part: str, storage: dict, table=None) -> dict:
        table = self.fwd_results if table is None else table
        if phase != "bwd" or part not in table:
            return {}
        fwd = table[part]
        args = fn.body.block.args
        # AOTAutograd's backward takes the saved values, then the tangents (what follows them the planned path
        # added); its forward returns the mutated buffers' new values (BatchNorm's running statistics), its
        # outputs (one per tangent), then the saved values
        n_tangents = sum(1 for i in range(len(args)) if _role(fn, i)[0] == "tangent")
        saved_idx = list(range(next((i for i in range(len(args)) if _role(fn, i)[0] == "tangent"), len(args))))
        tail = fwd[max(len(fwd) - len(saved_idx), n_tangents):]
        return {i: tail[k] for k, i in enumerate(saved_idx) if k < len(tail)}

    # ------------------------------------------------------------ data parallel units

    def _aten(self, ex: FunctionExpander, target: str, inputs, out_t: TensorType, **args) -> SSAValue:
        attrs = {}
        for k, v in args.items():
            attrs[k] = ArrayAttr([IntegerAttr(x, i64) for x in v]) if isinstance(v, (list, tuple)) else IntegerAttr(v, i64)
        op = AtenOp(target, list(inputs), [out_t], args=attrs)
        ex.emit(op)
        return op.outputs[0]

    def _units(self, items: list, param_of) -> list[list]:
        """A function's data-parallel units, in forward order: its parameters but those of units of their own
        (:func:`dp_units`), then those units in the order the function takes them: the untied input embedding
        and layers of the blocks' stack run outside the blocks, as a training script wraps them (its own
        ``fully_shard`` / ``replicate``, before the blocks and the root's group)."""
        rest = [x for x in items if param_of(x) not in self.unit_of]
        own: dict[str, list] = {}
        for x in items:
            if param_of(x) in self.unit_of:
                own.setdefault(self.unit_of[param_of(x)], []).append(x)
        return ([rest] if rest else []) + list(own.values())

    def _unit_gather(self, ex, old: Block, gather, new_args, storage, phase: str) -> None:
        """One all-gather of the unit's flat parameter shards (FSDP2's unshard), then each full parameter."""
        n = ex._n(self.fsdp)
        flats, metas = [], []
        for val, i, s in gather:
            a = new_args[i]
            shp = list(a.type.get_shape())
            numel = 1
            for x in shp:
                numel *= x
            flats.append(self._aten(ex, "aten.view.default", [a], TensorType(a.type.element_type, [numel]),
                                    size=[numel]))
            metas.append((val, i, s, shp, numel))
        et = new_args[gather[0][1]].type.element_type
        total = sum(m[4] for m in metas)
        # FSDP2's copy-in (all_gather_copy_in): the shards copied into the flat all-gather input, one
        # parameter or many
        flat = self._aten(ex, "aten.cat.default", flats, TensorType(et, [total]), dim=0)
        full = ex._coll(dist.AllGatherOp(flat, ex.grid, ex._ids(self.fsdp), dist.FutureType(TensorType(et, [n * total])),
                                         gather_dim=0))
        full2 = self._aten(ex, "aten.view.default", [full], TensorType(et, [n, total]), size=[n, total])
        if any(m[0].uses for m in metas):
            # FSDP2's copy-out: torch.split_with_sizes_copy of the gathered buffer into the unsharded
            # parameters (a copy, not views; skipped where nothing reads them, as for an embedding's
            # pre-backward unshard)
            op = AtenOp("aten.split_with_sizes_copy.default", [full2], [TensorType(et, [n, m[4]]) for m in metas],
                        args={"split_sizes": ArrayAttr([IntegerAttr(m[4], i64) for m in metas]),
                              "dim": IntegerAttr(1, i64)})
            ex.emit(op)
            pieces = list(op.outputs)
        else:
            pieces, off = [], 0
            for m in metas:
                pieces.append(self._aten(ex, "aten.slice.Tensor", [full2], TensorType(et, [n, m[4]]), dim=1,
                                         start=off, end=off + m[4]))
                off += m[4]
        for (val, i, s, shp, numel), piece in zip(metas, pieces):
            rows = [n * shp[0]] + shp[1:]
            v = self._aten(ex, "aten.view.default", [piece], TensorType(et, rows), size=rows)
            local = s.local_shape(shape_of(old.args[i]), self.sizes)
            if rows[0] != local[0]:
                v = self._aten(ex, "aten.slice.Tensor", [v], TensorType(et, local), dim=0, start=0, end=local[0])
            ex.bind(val, v, s)

    def _global_norm(self, ex, fn: func.FuncOp, ops) -> None:
        """``@grad_clip``'s total norm made global: the parts' norms are of local shards (``rule_local_norm``), so
        over each axis the gradients are split on, in mesh order, then over ``pp``, the squared total is
        all-reduced and its square root taken (torchtitan's ``clip_grad_norm_``: DTensor's ``full_tensor`` of a
        p-norm partial, one mesh dim at a time, then the pipeline stages' norms joined)."""
        axes = sorted(self.clip_axes, key=self.axis_index.__getitem__)
        if self.sizes.get("pp", 1) > 1:
            axes.append("pp")
        if not axes:
            return
        arg = next(a for i, a in enumerate(fn.body.block.args) if _role(fn, i)[0] == "grad_norm")
        total, s = ex.env[arg]

        def power(v: SSAValue, exponent: float) -> SSAValue:
            op = AtenOp("aten.pow.Tensor_Scalar", [v], [v.type], args={"exponent": FloatAttr(exponent, f64)},
                        phase="optim")
            ex.emit(op)
            return op.outputs[0]

        for a in axes:
            sq = power(total, 2.0)
            total = power(ex._coll(dist.AllReduceOp(sq, ex.grid, ex._ids([a]), dist.FutureType(sq.type),
                                                    reduction="sum")), 0.5)
        ex.bind(arg, total, s)
        for o in ops:  # the annotations of the argument the clipping's ops read
            if isinstance(o, ShardOp) and o.src is arg:
                ex.bind(o.result, total, s)

    def _zero1_sync(self, ex, fn: func.FuncOp, old: Block, new_args) -> None:
        """ZeRO-1 after the optimizer step: the updated shards of the unit's parameters gathered back into
        every rank's whole parameters, with one all-gather of the flat shards (PyTorch's
        ZeroRedundancyOptimizer broadcasts each parameter from the rank owning it, parameters assigned to
        ranks greedily by size: the same bytes received per rank, (n-1)/n of the parameters, in one
        collective instead of one broadcast per parameter)."""
        metas = []
        for i, a in enumerate(old.args):
            if _role(fn, i)[0] != "parameter":
                continue
            v, updated = a, False
            while True:  # through the annotations, then the optimizer's in-place updates of the parameter
                nxt = next((u.operation.results[0] for u in v.uses if isinstance(u.operation, ShardOp)), None)
                # a multi-tensor op updates it in place with no result (the value stays this one)
                updated = updated or nxt is None and any(_writes_in_list(u.operation, u.index) for u in v.uses)
                if nxt is None:
                    nxt = next((u.operation.outputs[0] for u in v.uses if isinstance(u.operation, AtenOp)
                                and u.index == 0 and u.operation.overload.split(".")[1].endswith("_")
                                and u.operation.outputs), None)
                    updated = updated or nxt is not None
                if nxt is None:
                    break
                v = nxt
            if not updated or v not in ex.env:
                continue
            nv, s = ex.env[v]
            if not s.dims or not set(self.fsdp) & set(s.dims[0]):
                continue
            metas.append((i, nv))
        if not metas:
            return
        n = ex._n(self.fsdp)
        et = metas[0][1].type.element_type
        flats, sizes = [], []
        for i, nv in metas:
            numel = 1
            for x in nv.type.get_shape():
                numel *= x
            flats.append(self._aten(ex, "aten.view.default", [nv], TensorType(et, [numel]), size=[numel]))
            sizes.append(numel)
        total = sum(sizes)
        flat = flats[0] if len(flats) == 1 else self._aten(ex, "aten.cat.default", flats, TensorType(et, [total]), dim=0)
        full = ex._coll(dist.AllGatherOp(flat, ex.grid, ex._ids(self.fsdp), dist.FutureType(TensorType(et, [n * total])),
                                         gather_dim=0))
        full2 = self._aten(ex, "aten.view.default", [full], TensorType(et, [n, total]), size=[n, total])
        off = 0
        for (i, nv), numel in zip(metas, sizes):
            piece = self._aten(ex, "aten.slice.Tensor", [full2], TensorType(et, [n, numel]), dim=1, start=off,
                               end=off + numel)
            off += numel
            shp = list(nv.type.get_shape())
            rows = [n * shp[0]] + shp[1:]
            w = self._aten(ex, "aten.view.default", [piece], TensorType(et, rows), size=rows)
            local = list(new_args[i].type.get_shape())
            if rows[0] != local[0]:
                w = self._aten(ex, "aten.slice.Tensor", [w], TensorType(et, local), dim=0, start=0, end=local[0])
            self._aten(ex, "aten.copy_.default", [new_args[i], w], new_args[i].type)

    def _returns(self, ex, fn, phase, part, ret, returns, storage, block: Block):
        results, shardings = [], []
        grads = []
        for i, r in enumerate(ret.operands):
            if i in returns:
                s, param = returns[i]
                src = r.owner.src
                if param is not None:
                    grads.append((i, src, s, param))
                    results.append(None)
                    shardings.append(None)
                    continue
                results.append(ex.value(src, s, f"result {i} of @{fn.sym_name.data}"))
                shardings.append(s)
            else:
                new, s = ex.saved_value(r) if phase == "fwd" else ex.env[r]
                if self.plan.tp_style == "dtensor" and r in ex.gemm_variant and r.owner is not None \
                        and not isinstance(r.owner, Block):
                    nv = ex.gemm_variant[r]
                    # the value a gemm consumed, as AOTAutograd saves it
                    for (v0, s0), v1 in ex.cache.items():
                        if v1 is nv and v0 is new:
                            new, s = nv, s0
                            break
                results.append(new)
                shardings.append(s)
        grads = reduce_expert_grads(self, ex, grads, results, shardings)
        units = self._units(grads, lambda g: g[3])
        for unit in reversed(units):
            mark = block.last_op
            self._unit_reduce(ex, unit, results, shardings)
            if len(units) > 1:
                _issue_after_gradients(block, mark)
        return results, shardings

    def _unit_reduce(self, ex, grads, results, shardings) -> None:
        """Reduce the unit's gradients over the data-parallel axes with one collective (FSDP: one
        reduce-scatter of the flat padded gradients, then HSDP's all-reduce of the shard; DDP: one
        all-reduce), each gradient then in its storage layout."""
        fsdp, replicate = self.fsdp, self.replicate
        if self.plan.zero == 1:  # DDP all-reduces whole gradients over every data-parallel axis
            fsdp, replicate = (), tuple(a for a in self.names if a in set(self.fsdp) | set(self.replicate))
        dp = set(fsdp) | set(replicate)
        staged = []
        for i, src, target, param in grads:
            cur = ex.sharding(src)
            # A replicated weight's gradient partial over tp (a sequence-parallel norm's) stays partial for
            # the optimizer to reduce, as DTensor's does, unless data parallelism reduces it first: FSDP2 and
            # replicate() redistribute it to the weight's tp placement (an all-reduce of the whole gradient)
            # before their own collective in backward.
            keep_tp = tuple(a for a in cur.partial if a in self.tp) \
                if self.plan.tp_style == "dtensor" and not dp and not (target.axes() & set(self.tp)) else ()
            dims = list(target.dims)
            if fsdp and dims:
                dims[0] = tuple(a for a in dims[0] if a not in fsdp)
            inter = Sharding(tuple(dims), tuple(a for a in cur.partial if a in dp) + keep_tp)
            v = ex.value(src, inter, f"gradient of '{param}'")
            staged.append((i, v, inter, target, param))
        if not dp:  # no data-parallel partials: inter.partial is keep_tp
            for i, v, inter, target, param in staged:
                final = Sharding(target.dims, inter.partial)
                results[i] = v
                shardings[i] = final
                self.grad_sharding[param] = final
            return
        et = staged[0][1].type.element_type
        n = ex._n(fsdp) if fsdp else 1
        pieces, metas = [], []
        for i, v, inter, target, param in staged:  # nothing is kept partial over tp here (keep_tp above)
            shp = list(v.type.get_shape())
            if fsdp:
                rows = -(-shp[0] // n) * n
                if rows != shp[0]:
                    pad = [0, 0] * (len(shp) - 1) + [0, rows - shp[0]]
                    v = self._aten(ex, "aten.constant_pad_nd.default", [v], TensorType(et, [rows] + shp[1:]), pad=pad)
                numel = rows // n
                for x in shp[1:]:
                    numel *= x
                pieces.append(self._aten(ex, "aten.view.default", [v], TensorType(et, [n, numel]), size=[n, numel]))
            else:
                numel = 1
                for x in shp:
                    numel *= x
                pieces.append(self._aten(ex, "aten.view.default", [v], TensorType(et, [numel]), size=[numel]))
            metas.append((i, target, param, numel))
        total = sum(m[3] for m in metas)
        # FSDP2's reduce-scatter copy-in (chunk_cat) and DDP's bucket: a copy, one gradient or many
        if fsdp:
            flat = self._aten(ex, "aten.cat.default", pieces, TensorType(et, [n, total]), dim=1)
            flat = self._aten(ex, "aten.view.default", [flat], TensorType(et, [n * total]), size=[n * total])
            flat = ex._coll(dist.ReduceScatterOp(flat, ex.grid, ex._ids(fsdp), dist.FutureType(TensorType(et, [total])),
                                                 reduction="sum", scatter_dim=0))
        else:
            flat = self._aten(ex, "aten.cat.default", pieces, TensorType(et, [total]), dim=0)
        if replicate:
            flat = ex._coll(dist.AllReduceOp(flat, ex.grid, ex._ids(replicate), dist.FutureType(flat.type),
                                             reduction="average"))
        off = 0
        for i, target, param, numel in metas:
            local = target.local_shape(shape_of_storage(target, results, i, staged, self.sizes), self.sizes)
            piece = self._aten(ex, "aten.slice.Tensor", [flat], TensorType(et, [numel]), dim=0, start=off, end=off + numel)
            off += numel
            results[i] = self._aten(ex, "aten.view.default", [piece], TensorType(et, local), size=local)
            final = Sharding(target.dims)
            shardings[i] = final
            self.grad_sharding[param] = final


def _issue_after_gradients(block: Block, mark: Operation | None) -> None:
    """Move what a unit's reduction emitted after ``mark``, up to its first collective's start (the copy into
    the flat buffer and the start), to just after the last op computing one of its inputs: a function holding
    several units (a ResNet's stages, an embedding beside other layers) reduces each once its gradients are
    computed, not all after the function's last op. (FSDP2's post-backward runs a little later, once the
    unit's input gradient is computed too; a function's one unit is reduced at its end, where that is.)"""
    ops: list[Operation] = []
    o = mark.next_op if mark is not None else block.first_op
    while o is not None:
        ops.append(o)
        if isinstance(o, dist.CollectiveOp):
            break
        o = o.next_op
    if not ops or not isinstance(ops[-1], dist.CollectiveOp):
        return
    group = set(ops)
    producers = {v.owner for op in ops for v in op.operands if isinstance(v.owner, Operation) and v.owner not in group}
    before = list(block.ops)
    anchor = next((x for x in reversed(before[:before.index(ops[0])]) if x in producers), None)
    if anchor is None or anchor is ops[0].prev_op:
        return
    for op in ops:
        op.detach()
    for op in ops:
        block.insert_op_after(op, anchor)
        anchor = op


def _erase_dead(block: Block) -> None:
    """Erase the ops the expansion left without a user, last first (so the chains they end go too): a global
    fill every user of which took a local one, a shard's cast whose users took the gathered value cast after
    (the logits' ``.float()`` under a vocabulary split: about 0.8 GB of traffic a step at Llama 3's vocabulary
    under tp = 8 with 8,192 tokens per rank), views of values a user took resharded. In-place ops (a trailing
    ``_``) and ops without results stay."""
    for o in reversed(list(block.ops)):
        if (isinstance(o, AtenOp) and o.results and not o.overload.split(".")[1].endswith("_")
                and not any(r.uses for r in o.results)):
            block.erase_op(o)


def _writes_in_list(op, index: int) -> bool:
    """Whether ``op`` is a multi-tensor op writing its operand ``index`` (a tensor of a list it updates)."""
    if not isinstance(op, AtenOp) or not is_multi_tensor(op.overload.split(".")[1]):
        return False
    return any(lst.written and lst.start <= index < lst.start + lst.size
               for lst in op_tensor_lists(op))


def shape_of_storage(target: Sharding, results, i, staged, sizes) -> list[int]:
    """The global shape of gradient ``i`` (from its staged, non-FSDP-split value)."""
    for j, v, inter, t, param in staged:
        if j == i:
            local = list(v.type.get_shape())
            glob = []
            for d, (x, axes) in enumerate(zip(local, inter.dims)):
                k = 1
                for a in axes:
                    k *= sizes[a]
                glob.append(x * k)
            return glob
    raise AssertionError(i)
