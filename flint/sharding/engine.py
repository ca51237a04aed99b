"""The sharding engine: propagate shardings through one function and rebuild it per rank.

:class:`FunctionExpander` walks a single-device ``func.func`` in order. Each
``aten.op`` is handled by the rule its kind names (``rules.toml``): the rule
says which sharding every operand must have and which sharding every result
gets. Where an operand's current sharding differs from the required one,
:meth:`FunctionExpander.reshard` emits the `dist` collectives MLIR's resharding
table names:

====================================  =====================================
from -> to                            emitted
====================================  =====================================
partial over A -> dim d split on A    ``dist.reduce_scatter`` (scatter_dim d)
partial over A -> not partial         ``dist.all_reduce``
dim d split on A -> not split         ``dist.all_gather`` (gather_dim d)
dim d split on A -> dim e split on A  ``dist.all_to_all`` (split e, concat d)
not split -> split                    a local slice (no communication)
====================================  =====================================

Results are rebuilt with their per-rank (local) shapes; shape arguments
(``size``, ``input_sizes``, ``num_weights``) follow. Collectives are emitted
in the asynchronous form with a ``dist.wait`` right after, as captured
programs have them. An op whose kind has no rule fails naming the op and its
source location.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from xdsl.dialects.builtin import ArrayAttr, IntegerAttr, IntegerType, StringAttr, TensorType, i64
from xdsl.ir import Attribute, Operation, SSAValue

from flint.cost.flops import is_multi_tensor
from flint.errors import FlintError
from flint.ir import dist
from flint.ir.aten import AtenOp, op_tensor_lists
from flint.sharding.rules import Rules
from flint.sharding.spec import Sharding


# norms a part's gradient-norm function takes of local shards (FunctionExpander.rule_local_norm)
LOCAL_NORMS = frozenset({"linalg_vector_norm", "_foreach_norm"})
# fills whose values do not depend on their position: split locally without a slice
FILL_OPS = frozenset({"new_zeros", "new_empty", "new_ones", "new_full", "zeros", "ones", "empty", "full"})

class ExpandError(FlintError):
    """The program cannot be expanded; the message names the op and its location."""


def where(op: Operation) -> str:
    loc = getattr(op, "location", None)
    text = ""
    if loc is not None and hasattr(loc, "filename"):
        text = f" at {loc.filename.data}:{loc.line.data}:{loc.column.data}"
    module = op.module.data if isinstance(op, AtenOp) and op.module is not None else None
    return text + (f" (module '{module}')" if module else "")


def shape_of(v: SSAValue) -> list[int]:
    t = v.type
    assert isinstance(t, TensorType)
    return list(t.get_shape())


def int_list(attr: Attribute | None) -> list[int] | None:
    if isinstance(attr, ArrayAttr):
        out = []
        for a in attr.data:
            if not isinstance(a, IntegerAttr):
                return None
            out.append(a.value.data)
        return out
    if isinstance(attr, IntegerAttr):
        return [attr.value.data]
    return None


def _batch_lead(batch: tuple[str, ...], v: SSAValue) -> Sharding:
    """``v``'s dim 0 split over ``batch``, its other dims whole (whole if it is a scalar)."""
    rank = len(shape_of(v))
    return Sharding((batch,) + ((),) * (rank - 1)) if rank else Sharding.replicated(0)


def _arg(op: AtenOp, name: str) -> Attribute | None:
    return op.args.data.get(name) if op.args is not None else None


def _returned_as_is(v: SSAValue) -> bool:
    """Whether ``v`` reaches only the function's return, through views and casts: a dtype cast of a gradient on
    its way out (a norm's ``1 + weight`` computed in float32, its gradient cast back), which carries a pending
    TP sum to where DTensor reduces it, the parameter's own gradient in its own dtype."""
    for use in v.uses:
        op = use.operation
        if isinstance(op, AtenOp) and op.overload.split(".")[1] in ("_to_copy", "view", "_unsafe_view", "reshape") \
                or op.name == "shard.shard":  # the annotation of the gradient returned
            if not _returned_as_is(op.results[0]):
                return False
        elif op.name != "func.return":
            return False
    return bool(v.uses)


def _norm(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _contiguous(shape: Sequence[int]) -> list[int]:
    """The strides of a contiguous tensor of ``shape``."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return out[::-1]


def reshape_groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of dims of shapes ``a`` and ``b`` with equal products (a view's dim mapping)."""
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        gi, gj = [], []
        pa = pb = 1
        if i < len(a):
            gi.append(i); pa *= a[i]; i += 1
        if j < len(b):
            gj.append(j); pb *= b[j]; j += 1
        while pa != pb:
            if pa < pb and i < len(a):
                gi.append(i); pa *= a[i]; i += 1
            elif j < len(b):
                gj.append(j); pb *= b[j]; j += 1
            else:
                break
        # trailing size-1 dims join the current group
        while i < len(a) and a[i] == 1 and (j >= len(b) or b[j] != 1):
            gi.append(i); i += 1
        while j < len(b) and b[j] == 1 and (i >= len(a) or a[i] != 1):
            gj.append(j); j += 1
        groups.append((gi, gj))
    return groups


@dataclass
class Rule:
    """What a rule decided for one op: operand shardings required, result shardings."""

    operands: list[Sharding]
    results: list[Sharding]
    created: tuple = ()  # partial axes the op itself creates (contraction / reduction over a split dim)


@dataclass
class FunctionExpander:
    """Expand one function's ops into ``emit`` (see the module docstring)."""

    rules: Rules
    sizes: dict[str, int]  # mesh axis name -> size
    axis_index: dict[str, int]
    grid: str
    emit: Callable[[Operation], None]
    tp_style: str = "dtensor"
    eager_axes: tuple = ()  # TP axes: partial sums over them are reduced at module boundaries
    sequence_parallel: bool = False
    demand: dict = field(default_factory=dict)  # old SSAValue -> {dim: axes}
    env: dict = field(default_factory=dict)  # old SSAValue -> (new SSAValue, Sharding)
    cache: dict = field(default_factory=dict)  # (new SSAValue, Sharding) -> new SSAValue
    gemm_variant: dict = field(default_factory=dict)  # old SSAValue -> new value a gemm consumed
    hints: dict = field(default_factory=dict)  # new SSAValue -> where the axes of a merged dim came from
    _next_hint: dict | None = None
    reduced: dict = field(default_factory=dict)  # old SSAValue -> (new value, sharding) once its partial was reduced
    cp_axes: tuple = ()  # context-parallel axes: attention over a sequence split on them is ring attention (cp.py)
    view_slices: bool = False  # local slices are views (no DTensor Replicate -> Shard clone), set per op by moe.py
    local_norms: bool = False  # a part's gradient-norm function (clipping): norms stay local (rule_local_norm)
    _p2p_tag: int = 0

    def next_p2p_tag(self, count: int) -> int:
        """The first of ``count`` fresh send/recv tags of this function."""
        tag = self._p2p_tag
        self._p2p_tag += count
        return tag

    # ----------------------------------------------------------- resharding

    def _ids(self, axes: Sequence[str]) -> list[int]:
        return sorted(self.axis_index[a] for a in axes)

    def _n(self, axes: Sequence[str]) -> int:
        n = 1
        for a in axes:
            n *= self.sizes[a]
        return n

    def _local_t(self, v: SSAValue, global_shape: Sequence[int], s: Sharding) -> TensorType:
        return TensorType(v.type.element_type, s.local_shape(global_shape, self.sizes))

    def _coll(self, op: dist.CollectiveOp) -> SSAValue:
        self.emit(op)
        w = dist.WaitOp(op.result)
        self.emit(w)
        return w.result

    def reshard(self, v: SSAValue, gshape: Sequence[int], src: Sharding, dst: Sharding, why: str) -> SSAValue:
        """``v`` (laid out as ``src``) laid out as ``dst``, emitting the collectives needed."""
        if src == dst:
            return v
        key = (v, dst)
        if key in self.cache:
            return self.cache[key]
        out = v
        cur = src
        extra = [a for a in src.partial if a not in dst.partial]
        if extra:
            rs: dict[int, list[str]] = {}
            ar: list[str] = []
            for a in extra:
                d = dst.dim_of(a)
                if d is not None and cur.dim_of(a) is None:
                    rs.setdefault(d, []).append(a)
                else:
                    ar.append(a)
            keep = tuple(a for a in cur.partial if a not in extra)
            if ar:
                cur = cur.with_partial(tuple(a for a in cur.partial if a not in ar))
                out = self._coll(dist.AllReduceOp(out, self.grid, self._ids(ar), dist.FutureType(out.type),
                                                  reduction="sum"))
            for d, axes in rs.items():
                if gshape[d] % self._n(cur.dims[d] + tuple(axes)):
                    raise ExpandError(f"{why}: dim {d} of size {gshape[d]} is not divisible over {axes}")
                nxt = cur.with_dim(d, cur.dims[d] + tuple(axes)).with_partial(
                    tuple(a for a in cur.partial if a not in axes))
                t = self._local_t(out, gshape, nxt)
                out = self._reduce_scatter(out, axes, t, d)
                cur = nxt
            cur = cur.with_partial(keep)
        for d in range(cur.rank):
            gone = [a for a in cur.dims[d] if a not in dst.dims[d]]
            if not gone:
                continue
            moves = [a for a in gone if dst.dim_of(a) is not None and cur.dim_of(a) == d
                     and a not in cur.dims[dst.dim_of(a)]]
            for a in moves:
                e = dst.dim_of(a)
                nxt = cur.with_dim(d, tuple(x for x in cur.dims[d] if x != a)).with_dim(e, cur.dims[e] + (a,))
                t = self._local_t(out, gshape, nxt)
                out = self._coll(dist.AllToAllOp(out, self.grid, self._ids([a]), dist.FutureType(t),
                                                 split_dim=e, concat_dim=d))
                cur = nxt
            rest = [a for a in gone if a not in moves]
            if rest:
                nxt = cur.with_dim(d, tuple(x for x in cur.dims[d] if x not in rest))
                t = self._local_t(out, gshape, nxt)
                if t.get_shape()[d] != out.type.get_shape()[d] * self._n(rest):
                    raise ExpandError(f"{why}: dim {d} of size {gshape[d]} is not divisible over {rest}")
                out = self._gather(out, rest, t, d)
                cur = nxt
        filled = self._local_fill(out, gshape, cur, dst)
        if filled is not None:  # a constant fill is created at its local shape, never sliced from a global one
            out, cur = filled, dst
        for d in range(cur.rank):
            new = [a for a in dst.dims[d] if a not in cur.dims[d]]
            if new:
                nxt = cur.with_dim(d, dst.dims[d])
                t = self._local_t(out, gshape, nxt)
                op = AtenOp("aten.slice.Tensor", [out], [t],
                            args={"dim": IntegerAttr(d, i64), "start": IntegerAttr(0, i64),
                                  "end": IntegerAttr(t.get_shape()[d], i64)})
                self.emit(op)
                out = op.outputs[0]
                if self.tp_style == "dtensor" and set(new) <= set(self.eager_axes) and not self.view_slices:
                    # DTensor's Replicate -> Shard(d) keeps a clone of its chunk (Shard._replicate_to_shard)
                    op = AtenOp("aten.clone.default", [out], [t])
                    self.emit(op)
                    out = op.outputs[0]
                cur = nxt
        self.cache[key] = out
        if out is not v and v in self.hints:
            self.hints.setdefault(out, self.hints[v])  # a merged dim keeps where its axes came from
        return out

    def _gather(self, v: SSAValue, axes: Sequence[str], t: TensorType, d: int) -> SSAValue:
        """All-gather ``v`` along dim ``d`` into ``t`` as PyTorch's functional collectives do it: NCCL gathers
        along dim 0, so a dim ``d`` > 0 with more than one row before it is the gathered chunks
        concatenated along ``d`` afterwards (``all_gather_single``'s ``_maybe_view_chunk_cat``: a copy)."""
        shp = list(v.type.get_shape())
        outer = 1
        for x in shp[:d]:
            outer *= x
        if d == 0 or outer == 1:
            return self._coll(dist.AllGatherOp(v, self.grid, self._ids(axes), dist.FutureType(t), gather_dim=d))
        n = self._n(axes)
        flat = TensorType(t.element_type, [n * shp[0]] + shp[1:])
        full = self._coll(dist.AllGatherOp(v, self.grid, self._ids(axes), dist.FutureType(flat), gather_dim=0))
        split = AtenOp("aten.split.Tensor", [full], [v.type] * n,
                       args={"split_size": IntegerAttr(shp[0], i64), "dim": IntegerAttr(0, i64)})
        self.emit(split)
        cat = AtenOp("aten.cat.default", list(split.outputs), [t], args={"dim": IntegerAttr(d, i64)})
        self.emit(cat)
        return cat.outputs[0]

    def _reduce_scatter(self, v: SSAValue, axes: Sequence[str], t: TensorType, d: int) -> SSAValue:
        """Reduce-scatter ``v`` along dim ``d`` into ``t`` as PyTorch's functional collectives do it:
        ``reduce_scatter_single`` scatters along dim 0, so a dim ``d`` > 0 is first chunked along ``d``
        and concatenated along 0 (``_chunk_or_narrow_cat``: a copy). DTensor's sequence-parallel
        reduce-scatter (Partial -> Shard(1) of ``[batch, seq, hidden]``) always scatters dim 1, so a
        reduce-scatter over the tensor-parallel axes copies even where this program has merged batch
        and sequence into dim 0."""
        sequence = self.tp_style == "dtensor" and self.sequence_parallel and set(axes) <= set(self.eager_axes)
        if d != 0 or sequence:
            n = self._n(axes)
            shp = list(v.type.get_shape())
            chunk = list(shp)
            chunk[d] //= n
            split = AtenOp("aten.split.Tensor", [v], [TensorType(v.type.element_type, chunk)] * n,
                           args={"split_size": IntegerAttr(chunk[d], i64), "dim": IntegerAttr(d, i64)})
            self.emit(split)
            stacked = [chunk[0] * n] + chunk[1:]
            cat = AtenOp("aten.cat.default", list(split.outputs), [TensorType(v.type.element_type, stacked)],
                         args={"dim": IntegerAttr(0, i64)})
            self.emit(cat)
            v, d = cat.outputs[0], 0
            t = TensorType(t.element_type, chunk)
        return self._coll(dist.ReduceScatterOp(v, self.grid, self._ids(axes), dist.FutureType(t),
                                               reduction="sum", scatter_dim=d))

    def _local_fill(self, v: SSAValue, gshape: Sequence[int], cur: Sharding, dst: Sharding) -> SSAValue | None:
        """A fill (``new_zeros(size)``, ``zeros``, ...) that only needs splitting, re-created at ``dst``'s local
        shape: the cross-entropy backward's ``new_zeros([tokens, vocab])`` must not stay global."""
        op = v.owner
        if not (isinstance(op, AtenOp) and op.overload.split(".")[1] in FILL_OPS and not cur.partial
                and not dst.partial and cur == Sharding.replicated(cur.rank) and op.args is not None
                and int_list(op.args.data.get("size")) is not None):
            return None
        t = self._local_t(v, gshape, dst)
        args = dict(op.args.data)
        args["size"] = ArrayAttr([IntegerAttr(x, i64) for x in t.get_shape()])
        return self._emit_like(op, op.overload, op.inputs, t, **args)

    # ---------------------------------------------------------------- values

    def bind(self, old: SSAValue, new: SSAValue, s: Sharding) -> None:
        self.env[old] = (new, s)

    def value(self, old: SSAValue, want: Sharding, why: str, hint: dict | None = None) -> SSAValue:
        """``old`` resharded to ``want``; ``hint`` says where a merged dim's axes come from in the operand that
        set ``want`` (the logits whose ``[batch * seq]`` rows a loss's targets must match)."""
        new, s = self.env[old]
        if s.partial and not want.partial and old in self.reduced:
            new, s = self.reduced[old]  # reduce a partial value once; later users start from that
        out = None
        if s != want and (new, want) not in self.cache:
            out = self._from_upstream(old, want, 4, hint)
            if out is not None:
                self.cache[(new, want)] = out
        if out is None:
            out = self.reshard(new, shape_of(old), s, want, why)
        if s.partial and not want.partial and old not in self.reduced:
            self.reduced[old] = (out, want)
        return out

    def _view_input_sharding(self, op: AtenOp, want: Sharding, hint: dict | None = None) -> Sharding | None:
        """The sharding of a view / transpose's input that yields ``want`` (None if there is none); a merged dim's
        axes go back where the view's own record puts them, else where ``hint`` (``want``'s) does."""
        kind = self.rules.op_kind(op.overload)
        a, b = shape_of(op.inputs[0]), shape_of(op.outputs[0])
        if kind == "transpose":
            rank = len(a)
            name = op.overload.split(".")[1]
            perm = list(range(rank))
            if name == "t" and rank == 2:
                perm = [1, 0]
            elif name == "transpose":
                d0 = _norm(_arg(op, "dim0").value.data, rank)
                d1 = _norm(_arg(op, "dim1").value.data, rank)
                perm[d0], perm[d1] = perm[d1], perm[d0]
            else:
                return None
            dims = [()] * rank
            for d, p in enumerate(perm):
                dims[p] = want.dims[d]
            return Sharding(tuple(dims), want.partial)
        if kind == "reshape":
            merged = self.env.get(op.outputs[0])
            own = self.hints.get(merged[0]) if merged else None
            need, back, _ = self.reshape_sharding(want, b, a, {**(hint or {}), **(own or {})})
            if need != want:
                return None
            _, again, _ = self.reshape_sharding(back, a, b)
            return back if again == want else None
        return None

    @staticmethod
    def _upcast(op: AtenOp) -> bool:
        """``op`` only widens its input's dtype (``logits.float()`` after the output projection)."""
        from flint.cost import dtype_bytes

        if op.overload != "aten._to_copy.default" or not op.outputs:
            return False
        a, b = op.inputs[0].type, op.outputs[0].type
        if not (isinstance(a, TensorType) and isinstance(b, TensorType)) or a.get_shape() != b.get_shape():
            return False
        try:
            return dtype_bytes(str(a.element_type)) < dtype_bytes(str(b.element_type))
        except (KeyError, ValueError):
            return False

    def _from_upstream(self, old: SSAValue, want: Sharding, depth: int, hint: dict | None = None) -> SSAValue | None:
        """Reuse a collective already done on the input of the view / transpose producing ``old``:
        re-apply the view to that input's resharded value (DTensor redistributes once, at the
        module boundary, and every user of the value sees it). A gather of an up-cast value
        (``_to_copy`` to a wider dtype) gathers the narrow input and casts after: the module
        (DTensor's ColwiseParallel output, say) gathers its output before the loss widens it."""
        op = old.owner
        if depth == 0 or not isinstance(op, AtenOp) or len(op.inputs) != 1 or op.inputs[0] not in self.env:
            return None
        if self._upcast(op):
            in_want = want if not want.partial and not self.env[old][1].partial else None
        elif self.rules.op_kind(op.overload) not in ("reshape", "transpose"):
            return None
        else:
            in_want = self._view_input_sharding(op, want, hint)
        if in_want is None:
            return None
        inp = op.inputs[0]
        inew, ins = self.env[inp]
        if ins == in_want:
            return None
        src = self.cache.get((inew, in_want)) or self._from_upstream(inp, in_want, depth - 1, hint)
        if src is None:
            src = self.reshard(inew, shape_of(inp), ins, in_want, f"'{op.overload}'{where(op)}")
            if src is inew:
                return None
        t = TensorType(old.type.element_type, want.local_shape(shape_of(old), self.sizes))
        new = AtenOp(op.overload, [src], [t], args=self._local_args(op, [t]),
                     phase=op.phase.data if op.phase else None, module=op.module.data if op.module else None)
        new.location = op.location
        self.emit(new)
        if self.rules.op_kind(op.overload) == "reshape":
            hint = self.reshape_sharding(in_want, shape_of(inp), shape_of(old), self.hints.get(src))[2]
        else:
            hint = self.hints.get(src)
        if hint:
            self.hints[new.outputs[0]] = hint
        return new.outputs[0]

    def saved_value(self, old: SSAValue) -> tuple[SSAValue, Sharding]:
        """A forward value as backward receives it: a partial value that the forward reduced (itself or a
        view of it) is saved reduced, as the captured program saves the reduced value."""
        new, s = self.env[old]
        if not (s.partial and set(s.partial) & set(self.eager_axes)):
            return new, s
        chain, cur = [old], old
        while cur not in self.reduced:
            nxt = [u.operation for u in cur.uses if isinstance(u.operation, AtenOp)
                   and self.rules.op_kind(u.operation.overload) == "reshape"]
            if not nxt:
                return new, s
            cur = nxt[0].outputs[0]
            chain.append(cur)
        val, sh = self.reduced[cur]
        for prev in reversed(chain[:-1]):
            need, back, hint = self.reshape_sharding(sh, shape_of(cur), shape_of(prev), self.hints.get(val))
            val = self.reshard(val, shape_of(cur), sh, need, "saved value")
            t = TensorType(val.type.element_type, back.local_shape(shape_of(prev), self.sizes))
            op = AtenOp("aten.view.default", [val], [t],
                        args={"size": ArrayAttr([IntegerAttr(x, i64) for x in t.get_shape()])})
            self.emit(op)
            val, sh, cur = op.outputs[0], back, prev
            if hint:
                self.hints[val] = hint
        return val, sh

    def sharding(self, old: SSAValue) -> Sharding:
        return self.env[old][1]

    # ------------------------------------------------------------------ ops

    def expand_op(self, op: AtenOp) -> None:
        kind = self.rules.op_kind(op.overload)
        if kind == "attention" and self.cp_axes:
            from flint.sharding.cp import expand_attention

            if expand_attention(self, op):
                return
        handler = getattr(self, f"rule_{kind}", None) if kind else None
        if self.local_norms and op.overload.split(".")[1] in LOCAL_NORMS:
            handler = self.rule_local_norm
        if handler is None and op.overload.split(".")[1] == "_scaled_mm":
            raise ExpandError(f"'{op.overload}'{where(op)}: a float8 program (plan field 'fp8') is not expanded "
                              "by shard-expand yet (torchao's per-rank amax scaling has no global-program rule); "
                              "capture it under the plan instead: flint capture --plan ... --fp8")
        if handler is None and is_multi_tensor(op.overload.split(".")[1]):
            raise ExpandError(f"no sharding rule for multi-tensor op '{op.overload}'{where(op)}: kind "
                              f"multi_tensor in {self.rules.source} is for ops elementwise on each tensor (a "
                              "per-tensor norm of a sharded tensor is a partial value no rule reduces)")
        if handler is None:
            raise ExpandError(f"no sharding rule for '{op.overload}'{where(op)}; add it to a kind in "
                              f"{self.rules.source}")
        rule: Rule = handler(op)
        carries = self.carries_partial(op, kind)
        if self.eager_axes and not carries:
            # TP partial sums are reduced at the module boundary: views carry them (and, Megatron-style,
            # the sum of the column-parallel input gradients); any other consumer reduces them first
            inherited = {a for v in op.inputs for a in self.sharding(v).partial}

            def strip(s: Sharding, drop: set) -> Sharding:
                return s.with_partial(tuple(a for a in s.partial if a not in drop))
            eager = set(self.eager_axes)
            # partials the op creates (a contraction or reduction over a split dim) stay; inherited ones go
            drop = eager & (inherited - set(rule.created))
            rule = Rule([strip(s, eager) for s in rule.operands], [strip(s, drop) for s in rule.results])
        why = f"'{op.overload}'{where(op)}"
        operands = []
        for i, (v, s) in enumerate(zip(op.inputs, rule.operands)):
            nv = self.value(v, s, why, next((self.hints[o] for o in operands if o in self.hints), None))
            if kind in ("matmul", "attention") and nv is not self.env[v][0]:
                self.gemm_variant.setdefault(v, nv)
            operands.append(nv)
        if self._reshape_copy_is_view(op, rule.results[0] if rule.results else None):
            self.bind(op.outputs[0], operands[0], rule.results[0])  # the rank's reshape is a view: no copy
            return
        results = [TensorType(r.type.element_type, s.local_shape(shape_of(r), self.sizes))
                   for r, s in zip(op.outputs, rule.results)]
        args = self._local_args(op, results)
        masked = op.overload == "aten.embedding.default" and self.tp_style == "dtensor" and bool(
            set(rule.results[0].partial) & set(self.eager_axes))
        if masked:
            operands[1], mask = self._mask_vocab(op, operands[1])
        new = AtenOp(op.overload, operands, results, args=args,
                     phase=op.phase.data if op.phase else None, module=op.module.data if op.module else None)
        new.location = op.location
        for k, a in op.attributes.items():
            new.attributes[k] = a
        self.emit(new)
        outs = list(new.outputs)
        if masked:
            outs[0] = self._mask_rows(op, outs[0], mask)
        for r, nr, s in zip(op.outputs, outs, rule.results):
            self.bind(r, nr, s)
        hint = self._next_hint if kind == "reshape" else None
        self._next_hint = None
        if hint is None and kind in ("pointwise", "matmul", "dim_local", "like", "transpose") and operands:
            first = operands[1] if op.overload.split(".")[1] in ("addmm",) else operands[0]
            hint = self.hints.get(first)
            if hint is None and kind in ("pointwise", "dim_local"):  # e.g. a gradient taken from a saved output
                hint = next((self.hints[v] for v in operands if v in self.hints), None)
        if hint:
            for nr in new.outputs:
                self.hints[nr] = hint

    def _reshape_copy_is_view(self, op: AtenOp, out: Sharding | None) -> bool:
        """``op`` is the copy of a reshape that the whole tensor needs and the rank's shard does not.

        ``torch.reshape`` copies (``clone(memory_format=contiguous_format)`` + ``_unsafe_view`` in a captured
        graph) only where a view cannot give the new shape. On the rank's shard, a reshape whose every merged
        run of dims has at most one dim of size > 1, whatever their strides, is a view, and PyTorch runs no
        copy there: Hugging Face's ``repeat_kv`` under TP with one key/value head per rank (its expand and
        reshape) feeding SDPA, and the per-head gradients' transposes back to ``[batch, seq, hidden]``. An
        expanded (stride-0) view read by anything but a fused attention keeps its copy: eager attention's
        ``matmul`` reshapes it for ``bmm`` next, where torch copies it instead (the same bytes)."""
        if (out is None or op.overload != "aten.clone.default" or op.args is None
                or "memory_format" not in op.args.data or len(op.outputs) != 1):
            return False
        res = op.outputs[0]
        users = [u.operation for u in res.uses]
        if not users or any(not isinstance(u, AtenOp) or u.overload != "aten._unsafe_view.default" for u in users):
            return False
        src = op.inputs[0].owner
        if isinstance(src, AtenOp) and src.overload.split(".")[1] == "expand" and any(
                isinstance(w.operation, AtenOp) and self.rules.op_kind(w.operation.overload) != "attention"
                for u in users for w in u.outputs[0].uses):
            return False  # a stride-0 view that a later reshape (eager attention's bmm) would copy after all
        mine = out.local_shape(shape_of(res), self.sizes)
        if mine == shape_of(res):
            return False  # unsplit: the same copy as the whole tensor's
        for u in users:
            _, after, _ = self.reshape_sharding(out, shape_of(res), shape_of(u.outputs[0]))
            theirs = after.local_shape(shape_of(u.outputs[0]), self.sizes)
            for gi, gj in reshape_groups(mine, theirs):
                if sum(mine[i] > 1 for i in gi) > 1:
                    return False
        return True

    def carries_partial(self, op: AtenOp, kind: str) -> bool:
        """Whether ``op`` passes TP partial sums on unreduced (its rule decides which): views and
        transposes, and (Megatron-style or with sequence parallelism) the sum of the column-parallel input
        gradients; any other op reduces them first (the module boundary)."""
        return kind in ("reshape", "transpose") or (
            (self.tp_style == "megatron" or self.sequence_parallel) and kind == "pointwise" and len(op.inputs) >= 2
            and op.overload.split(".")[1] in ("add", "add_", "sub", "sub_")) or (
            op.overload.split(".")[1] == "_to_copy" and _returned_as_is(op.outputs[0]))

    def _emit_like(self, op: AtenOp, target: str, inputs, t: TensorType, **args) -> SSAValue:
        """Emit ``target`` on ``inputs`` with result type ``t``, carrying ``op``'s phase, module and location."""
        new = AtenOp(target, list(inputs), [t], args=args or None, phase=op.phase.data if op.phase else None,
                     module=op.module.data if op.module else None)
        new.location = op.location
        self.emit(new)
        return new.outputs[0]

    def _mask_vocab(self, op: AtenOp, idx: SSAValue) -> tuple[SSAValue, SSAValue]:
        """DTensor's vocabulary-parallel embedding input (MaskPartial._partition_value): ids outside this
        rank's rows masked, the rest shifted to local rows and the masked ones set to 0."""
        rows = op.inputs[0].type.get_shape()[0]
        local = self.env[op.inputs[0]][0].type.get_shape()[0]
        it = idx.type
        bt = TensorType(IntegerType(1), it.get_shape())
        lo = self._emit_like(op, "aten.lt.Scalar", [idx], bt, other=IntegerAttr(0, i64))
        hi = self._emit_like(op, "aten.ge.Scalar", [idx], bt, other=IntegerAttr(min(local, rows), i64))
        mask = self._emit_like(op, "aten.bitwise_or.Tensor", [lo, hi], bt)
        shifted = self._emit_like(op, "aten.sub.Tensor", [self._emit_like(op, "aten.clone.default", [idx], it)], it,
                                  other=IntegerAttr(0, i64))
        zero = self._emit_like(op, "aten.scalar_tensor.default", [], TensorType(it.element_type, []),
                               s=IntegerAttr(0, i64))
        return self._emit_like(op, "aten.index_put.default", [shifted, mask, zero], it), mask

    def _mask_rows(self, op: AtenOp, out: SSAValue, mask: SSAValue) -> SSAValue:
        """The embedding rows of masked ids zeroed (MaskPartial._mask_tensor) before the partial sum."""
        zero = self._emit_like(op, "aten.scalar_tensor.default", [], TensorType(out.type.element_type, []),
                               s=IntegerAttr(0, i64))
        return self._emit_like(op, "aten.index_put.default", [out, mask, zero], out.type)

    def _local_args(self, op: AtenOp, results: list[TensorType]) -> dict | None:
        if op.args is None:
            return None
        args = dict(op.args.data)
        out = list(results[0].get_shape()) if results else None
        gout = shape_of(op.outputs[0]) if op.outputs else None
        for key in ("size", "shape", "input_sizes"):
            vals = int_list(args.get(key))
            if vals is not None and out is not None and len(vals) == len(out) and isinstance(args[key], ArrayAttr):
                args[key] = ArrayAttr([IntegerAttr(-1 if v == -1 else o, i64) for v, o in zip(vals, out)])
        if "num_weights" in args and out is not None:
            args["num_weights"] = IntegerAttr(out[0], i64)
        stride = int_list(args.get("stride"))
        if stride is not None and out is not None and gout is not None and stride == _contiguous(gout):
            args["stride"] = ArrayAttr([IntegerAttr(v, i64) for v in _contiguous(out)])  # new_empty_strided's
        return args

    # ----------------------------------------------------------------- rules

    def _partial_ok(self, target: str, n_tensors: int) -> str:
        lin = self.rules.linearity(target)
        name = target.split(".")[1]
        if lin == "all" and name in ("add", "add_", "sub", "sub_") and n_tensors < 2:
            return "none"  # adding a scalar to a partial value is not linear
        return lin

    def _merge(self, op: AtenOp, out_shape: Sequence[int], operands: Sequence[SSAValue],
               dim_free: Sequence[int] = ()) -> tuple[list[tuple[str, ...]], set[str]]:
        """Split axes for each out dim from right-aligned operands of equal size (first wins)."""
        R = len(out_shape)
        dims: list[tuple[str, ...]] = [()] * R
        used: set[str] = set()
        for v in operands:
            s = self.sharding(v)
            if s.partial and v in self.reduced:
                s = self.reduced[v][1]
            shp = shape_of(v)
            off = R - len(shp)
            for i, axes in enumerate(s.dims):
                d = i + off
                if d < 0 or d >= R or not axes or d in dim_free or shp[i] != out_shape[d]:
                    continue
                if dims[d]:
                    # a finer split of the same dim wins ((cp, tp) over cp: sequence parallelism inside CP)
                    more = set(axes) - set(dims[d])
                    if set(dims[d]) < set(axes) and not used & more:
                        dims[d] = axes
                        used |= more
                    continue
                if used & set(axes):
                    continue
                dims[d] = axes
                used |= set(axes)
        return dims, used

    def _scatter_pending(self, ins: Sequence[SSAValue], out_shape: Sequence[int], dims: list[tuple[str, ...]],
                         used: set[str]) -> None:
        """Split ``dims`` where an operand's TP pending sum, reduced here (the module boundary), is wanted split
        downstream (``demand``: the sequence-parallel activation gradient a function returns): a reduce-scatter
        to that split, where DTensor's backward of the forward's all-gather reduce-scatters, not an all-reduce
        to Replicate that later consumers slice. Whichever consumer of the sum comes first decides, so this
        keeps the choice from depending on the backward graph's op order."""
        R = len(out_shape)
        for v in ins:
            s = self.sharding(v)
            pending = set(s.partial) & set(self.eager_axes)
            if not pending or v in self.reduced:
                continue
            shp = shape_of(v)
            off = R - len(shp)
            for i, axes in sorted(self.demand.get(v, {}).items()):
                d = i + off
                if (0 <= d < R and not dims[d] and axes and set(axes) <= pending and not used & set(axes)
                        and shp[i] == out_shape[d] and not s.dims[i] and shp[i] % self._n(axes) == 0):
                    dims[d] = tuple(axes)
                    used |= set(axes)

    def _align(self, v: SSAValue, dims: Sequence[tuple[str, ...]], partial: Sequence[str] = (),
               out_shape: Sequence[int] | None = None) -> Sharding:
        """``v``'s layout under the result dims ``dims`` (broadcast from the right). A size-1 dim broadcast
        against a larger one stays whole; one the result has at size 1 too (``out_shape``) keeps its split: a
        parameter with one row, FSDP-sharded with padding (Qwen2-MoE's shared-expert gate), in its optimizer."""
        shp = shape_of(v)
        off = len(dims) - len(shp)
        out = []
        for i, s in enumerate(shp):
            d = i + off
            axes = dims[d] if 0 <= d < len(dims) else ()
            kept = s != 1 or (out_shape is not None and 0 <= d < len(out_shape) and out_shape[d] == 1)
            out.append(axes if kept else ())
        return Sharding(tuple(out), tuple(partial))

    def rule_pointwise(self, op: AtenOp) -> Rule:
        ins = list(op.inputs)
        out_shape = shape_of(op.outputs[0]) if op.outputs else shape_of(ins[0])
        dims, used = self._merge(op, out_shape, ins)
        if self.eager_axes and not self.carries_partial(op, "pointwise"):
            self._scatter_pending(ins, out_shape, dims, used)
        lin = self._partial_ok(op.overload, len(ins))
        partial = _passing_partial(lin, [self.sharding(v).partial for v in ins])
        req = []
        for i, v in enumerate(ins):
            p = partial if (lin == "all" or i == 0) else ()
            req.append(self._align(v, dims, p, out_shape))
        res = [self._align(r, dims, partial, out_shape) for r in op.outputs]
        return Rule(req, res)

    def rule_reduce(self, op: AtenOp) -> Rule:
        v = op.inputs[0]
        s = self.sharding(v)
        rank = len(shape_of(v))
        dl = int_list(_arg(op, "dim"))
        red = set(range(rank)) if dl is None or dl == [] else {_norm(d, rank) for d in dl}
        keep = _arg(op, "keepdim")
        keepdim = bool(keep.value.data) if isinstance(keep, IntegerAttr) else False
        name = op.overload.split(".")[1]
        linear = name in ("sum", "mean")
        in_partial = s.partial if linear else ()
        new_partial = tuple(a for d in sorted(red) for a in s.dims[d])
        if not linear and new_partial:
            # max/min/var over a split dim: gather it first
            s = Sharding(tuple(() if d in red else ax for d, ax in enumerate(s.dims)))
            new_partial = ()
        s = self._reduce_split_shard(op, v, s, red, keepdim)
        req = Sharding(s.dims, in_partial)
        out_dims = [() if d in red else ax for d, ax in enumerate(s.dims)]
        if not keepdim:
            out_dims = [ax for d, ax in enumerate(out_dims) if d not in red]
        res = [Sharding(tuple(out_dims[:len(shape_of(r))]) if len(out_dims) >= len(shape_of(r)) else
                        Sharding.replicated(len(shape_of(r))).dims, tuple(in_partial) + new_partial)
               for r in op.outputs]
        return Rule([req], res, new_partial)

    def _reduce_split_shard(self, op: AtenOp, v: SSAValue, s: Sharding, red: set[int], keepdim: bool) -> Sharding:
        """Reduce the shard of a replicated ``v`` where the result is wanted split on a kept dim (``demand``: a
        column-parallel layer's bias gradient) and the split input already exists (``cache``: the layer's weight
        gradients split the output gradient first). The rank sums its columns of that split, as the layer's local
        backward does, rather than summing every column and slicing the result (a second slice and clone)."""
        want = self.demand.get(op.outputs[0]) if op.outputs and not s.partial else None
        if not want:
            return s
        shp = shape_of(v)
        kept = [d for d in range(len(shp)) if keepdim or d not in red]
        new = self.env[v][0]
        for od, axes in sorted(want.items()):
            d = kept[od] if 0 <= od < len(kept) else None
            if d is None or d in red or s.dims[d] or not axes or any(a in ax for ax in s.dims for a in axes):
                continue
            split = s.with_dim(d, tuple(axes))
            if shp[d] % self._n(axes) == 0 and (new, split) in self.cache:
                s = split
        return s

    def rule_matmul(self, op: AtenOp) -> Rule:
        name = op.overload.split(".")[1]
        ins = list(op.inputs)
        bias = None
        if name in ("addmm", "baddbmm"):
            bias, ins = ins[0], ins[1:]
        a, b = ins
        sa, sb = self.sharding(a), self.sharding(b)
        batched = len(shape_of(a)) == 3
        ab = sa.dims[0] if batched else ()
        am, ak = sa.dims[-2], sa.dims[-1]
        bk, bn = sb.dims[-2], sb.dims[-1]
        n_ax = bn
        m_ax = tuple(x for x in am if x not in n_ax)
        bt = tuple(x for x in (ab or (sb.dims[0] if batched else ())) if x not in n_ax + m_ax)
        used = set(n_ax) | set(m_ax) | set(bt)
        k_ax = tuple(x for x in dict.fromkeys(ak + bk) if x not in used)
        pa, pb = sa.partial, sb.partial
        if pa and pb:
            pb = ()
        res_shape = shape_of(op.outputs[0])
        want = self.demand.get(op.outputs[0], {})
        partial = tuple(dict.fromkeys(pa + pb + k_ax))
        taken = used | set(k_ax) | set(partial)
        for d, axes in want.items():
            free = tuple(x for x in axes if x not in taken)
            if not free:
                continue
            if d == len(res_shape) - 2 and not m_ax:
                m_ax = free
                taken |= set(free)
            elif d == len(res_shape) - 1 and not n_ax:
                n_ax = free
                taken |= set(free)
        lead = (bt,) if batched else ()
        ra = Sharding(lead + (m_ax, k_ax), pa)
        rb = Sharding(lead + (k_ax, n_ax), pb)
        out = Sharding(lead + (m_ax, n_ax), partial)
        req = [ra, rb]
        if bias is not None:
            req = [self._align(bias, out.dims, partial)] + req
        return Rule(req, [out], k_ax)

    def rule_reshape(self, op: AtenOp) -> Rule:
        v = op.inputs[0]
        need, out, hint = self.reshape_sharding(self.sharding(v), shape_of(v), shape_of(op.outputs[0]),
                                                self.hints.get(self.env[v][0]))
        self._next_hint = hint
        return Rule([need], [out])

    def reshape_sharding(self, s: Sharding, a: Sequence[int], b: Sequence[int],
                         hint: dict | None = None) -> tuple[Sharding, Sharding, dict]:
        """(input sharding needed, output sharding, output hint) of viewing shape ``a`` as ``b``.

        A split dim merged with outer dims (``[B, S/tp] -> [B*S/tp]``) records where its axes came
        from in the hint (axis -> (group sizes, position)), so that splitting it again
        (``[B*S/tp] -> [B, S/tp]``) puts them back on the same dim."""
        out: list[tuple[str, ...]] = [()] * len(b)
        need = list(s.dims)
        hint = hint or {}
        out_hint: dict = {}
        for gi, gj in reshape_groups(a, b):
            axes = tuple(x for i in gi for x in s.dims[i])
            if not axes:
                continue
            sizes = tuple(b[j] for j in gj)
            if len(gj) > 1 and all(x in hint and hint[x][0] == sizes for x in axes):
                # split back where a merge came from
                for x in axes:
                    out[gj[hint[x][1]]] += (x,)
                continue
            known = [x for x in axes if x in hint and hint[x][0] == sizes]
            if len(gj) > 1 and known:
                # some axes have a known origin: the others split the same dim, inside them (a sequence split
                # over cp, then over tp with sequence parallelism)
                inner = gj[hint[known[-1]][1]]
                extra = self._n([x for x in axes if x not in known])
                if b[inner] % (self._n([x for x in known if gj[hint[x][1]] == inner]) * extra) == 0:
                    for x in axes:
                        out[gj[hint[x][1]] if x in known else inner] += (x,)
                    continue
            n = self._n(axes)
            target = next((j for j in gj if b[j] > 1 and b[j] % n == 0), None)
            if target is None:
                for i in gi:
                    need[i] = ()
                continue
            out[target] = axes
            if len(gi) > 1 and len(gj) == 1:
                for k, i in enumerate(gi):
                    for x in s.dims[i]:
                        out_hint[x] = (tuple(a[i2] for i2 in gi), k)
            elif len(gi) == 1 and len(gj) == 1:
                for x in axes:
                    if x in hint:
                        out_hint[x] = hint[x]
        return Sharding(tuple(need), s.partial), Sharding(tuple(out), s.partial), out_hint

    def rule_expand(self, op: AtenOp) -> Rule:
        v = op.inputs[0]
        s = self.sharding(v)
        a, b = shape_of(v), shape_of(op.outputs[0])
        off = len(b) - len(a)
        out = [()] * len(b)
        need = list(s.dims)
        for i, axes in enumerate(s.dims):
            if a[i] == b[i + off]:
                out[i + off] = axes
            else:
                need[i] = ()
        return Rule([Sharding(tuple(need), s.partial)], [Sharding(tuple(out), s.partial)])

    def rule_transpose(self, op: AtenOp) -> Rule:
        v = op.inputs[0]
        s = self.sharding(v)
        rank = s.rank
        name = op.overload.split(".")[1]
        perm = list(range(rank))
        if name == "t" and rank == 2:
            perm = [1, 0]
        elif name == "transpose":
            d0 = _norm(_arg(op, "dim0").value.data, rank)
            d1 = _norm(_arg(op, "dim1").value.data, rank)
            perm[d0], perm[d1] = perm[d1], perm[d0]
        elif name == "permute":
            perm = [_norm(d, rank) for d in int_list(_arg(op, "dims"))]
        return Rule([s], [Sharding(tuple(s.dims[p] for p in perm), s.partial)])

    def rule_dim_local(self, op: AtenOp) -> Rule:
        name = op.overload.split(".")[1]
        ins = list(op.inputs)
        d_attr = _arg(op, "dim")
        in_rank = len(shape_of(ins[0]))
        out_rank = len(shape_of(op.outputs[0])) if op.outputs else in_rank
        d = _norm(d_attr.value.data, max(in_rank, out_rank)) if isinstance(d_attr, IntegerAttr) else in_rank - 1
        linear = name in ("select", "slice", "cat", "select_backward", "slice_backward", "split",
                          "split_with_sizes", "narrow")
        if name == "select":
            s = self.sharding(ins[0])
            dims = [() if i == d else ax for i, ax in enumerate(s.dims)]
            p = s.partial if linear else ()
            return Rule([Sharding(tuple(dims), p)], [Sharding(tuple(dims[:d] + dims[d + 1:]), p)])
        if name == "select_scatter":  # src is self without dim d
            s = self.sharding(ins[0])
            dims = [() if i == d else ax for i, ax in enumerate(s.dims)]
            return Rule([Sharding(tuple(dims)), Sharding(tuple(dims[:d] + dims[d + 1:]))], [Sharding(tuple(dims))])
        if name == "select_backward":
            s = self.sharding(ins[0])
            dims = list(s.dims)
            return Rule([s], [Sharding(tuple(dims[:d] + [()] + dims[d:]), s.partial)])
        ref = op.outputs[0]
        dims, _ = self._merge(op, shape_of(ref), ins, dim_free=(_norm(d, len(shape_of(ref))),))
        partials = [self.sharding(v).partial for v in ins]
        partial = partials[0] if linear and all(set(p) == set(partials[0]) for p in partials) else ()
        req = [self._align(v, dims, partial) if len(shape_of(v)) == len(dims) else
               Sharding.replicated(len(shape_of(v))) for v in ins]
        res = [self._align(r, dims, partial) if len(shape_of(r)) == len(dims) else
               Sharding.replicated(len(shape_of(r))) for r in op.outputs]
        return Rule(req, res)

    def rule_multi_tensor(self, op: AtenOp) -> Rule:
        """A multi-tensor op (``_foreach_*``, a fused optimizer): one elementwise op per index of its tensor
        lists. The tensors at one index (a parameter, its gradient, its Adam state, its step count) take the
        sharding they agree on, as ``pointwise`` merges its operands; the index's result of an out-of-place op
        follows it. Single tensors (a scale) stay whole. A pending sum passes where the op is linear, as
        ``pointwise`` decides by the rules' ``[linear]`` entry of the op it applies (``_foreach_mul_`` scales a
        sequence-parallel norm weight's partial gradient, as the captured step does before reducing it);
        otherwise it is reduced first. A list the op writes in place must already be laid out so (a resharded
        copy would take the write)."""
        ins, outs = list(op.inputs), list(op.outputs)
        lists = [lst for lst in op_tensor_lists(op) if lst.size]
        n = lists[0].size if lists else 0
        if any(lst.size != n for lst in lists) or outs and len(outs) != n:
            raise ExpandError(f"'{op.overload}'{where(op)}: tensor lists of lengths "
                              f"{[lst.size for lst in lists]} and {len(outs)} results: expected one length")
        in_lists = {lst.start + j for lst in lists for j in range(n)}
        singles = [self.sharding(v).partial for i, v in enumerate(ins) if i not in in_lists]
        lin = self._partial_ok("aten." + op.overload.split(".")[1].removeprefix("_foreach_"),
                               len(lists) + len(singles))
        req = [Sharding.replicated(len(shape_of(v))) for v in ins]
        res = []
        for j in range(n):
            members = [ins[lst.start + j] for lst in lists]
            shp = shape_of(members[0])
            dims, _ = self._merge(op, shp, members)
            partial = _passing_partial(lin, [self.sharding(v).partial for v in members] + singles)
            for k, lst in enumerate(lists):
                v = ins[lst.start + j]
                req[lst.start + j] = self._align(v, dims, partial if lin == "all" or k == 0 else (), shp)
                if lst.written and self.sharding(v) != req[lst.start + j]:
                    raise ExpandError(f"'{op.overload}'{where(op)}: writes tensor {j} of list '{lst.name}' in "
                                      f"place, laid out as {self.sharding(v)}, where the other tensors of index {j} "
                                      f"need {req[lst.start + j]}")
            if outs:
                res.append(self._align(outs[j], dims, partial, shp))
        return Rule(req, res)

    def rule_local_norm(self, op: AtenOp) -> Rule:
        """A norm in a part's gradient-norm function (clipping): the norm of each rank's local shard, as torch's
        ``clip_grad_norm_`` computes it on DTensors (a p-norm partial, DTensor's ``_NormPartial``, which no layout
        here expresses). The operands keep their layouts; the results are this rank's values, which
        ``@grad_clip`` makes global with an all-reduce over each axis the gradients are split on (shard-expand
        inserts them there)."""
        return Rule([self.sharding(v).without_partial() for v in op.inputs],
                    [Sharding.replicated(len(shape_of(r))) for r in op.outputs])

    def rule_stack(self, op: AtenOp) -> Rule:
        ins = list(op.inputs)
        out_rank = len(shape_of(op.outputs[0]))
        d = _norm(_arg(op, "dim").value.data if _arg(op, "dim") is not None else 0, out_rank)
        s = self.sharding(ins[0])
        p = s.partial if all(set(self.sharding(v).partial) == set(s.partial) for v in ins) else ()
        req = Sharding(s.dims, p)
        dims = list(s.dims)
        return Rule([req] * len(ins), [Sharding(tuple(dims[:d] + [()] + dims[d:]), p)])

    def rule_like(self, op: AtenOp) -> Rule:
        v = op.inputs[0]
        s = self.sharding(v)
        a, b = shape_of(v), shape_of(op.outputs[0])
        dims = [s.dims[i] if i < len(a) and a[i] == b[i] else () for i in range(len(b))]
        return Rule([s], [Sharding(tuple(dims))])

    def rule_factory(self, op: AtenOp) -> Rule:
        return Rule([self.sharding(v) for v in op.inputs], [Sharding.replicated(len(shape_of(r))) for r in op.outputs])

    def rule_attention(self, op: AtenOp) -> Rule:
        ins = list(op.inputs)
        q = next(v for v in ins if len(shape_of(v)) == 4)
        s = self.sharding(q)
        bsz, heads = s.dims[0], tuple(x for x in s.dims[1] if x not in s.dims[0])
        req = []
        for v in ins:
            r = len(shape_of(v))
            # a dim of size 1 (an attention mask broadcast over the heads) stays whole: nothing to slice
            req.append(self._align(v, (bsz, heads) + ((),) * (r - 2)) if r >= 2 else Sharding.replicated(r))
        res = []
        for r in op.outputs:
            k = len(shape_of(r))
            res.append(Sharding((bsz, heads) + ((),) * (k - 2)) if k >= 2 else Sharding.replicated(k))
        return Rule(req, res)

    def rule_embedding(self, op: AtenOp) -> Rule:
        w, idx = op.inputs[0], op.inputs[1]
        sw, si = self.sharding(w), self.sharding(idx)
        vocab, feat = sw.dims[0], sw.dims[1]
        lead = tuple(tuple(x for x in ax if x not in vocab + feat) for ax in si.dims)
        out = Sharding(lead + (feat,), vocab)
        return Rule([Sharding((vocab, feat)), Sharding(lead)], [out])

    def rule_embedding_backward(self, op: AtenOp) -> Rule:
        g, idx = op.inputs[0], op.inputs[1]
        sg = self.sharding(g)
        lead = sg.dims[:-1]
        feat = sg.dims[-1]
        partial = tuple(dict.fromkeys(sg.partial + tuple(x for ax in lead for x in ax)))
        rows = tuple(x for x in self.demand.get(op.outputs[0], {}).get(0, ()) if x not in sg.partial + feat)
        # rows split over an axis that also splits the batch: gather the gradient on that axis first
        lead = tuple(tuple(x for x in ax if x not in rows) for ax in lead)
        if self.tp_style == "dtensor":
            # DTensor's vocabulary-parallel embedding (MaskPartial) has a replicated gradient: the dense
            # backward covers the whole vocabulary, then each rank keeps its rows (Replicate -> Shard(0))
            rows = tuple(x for x in rows if x not in self.eager_axes)
        partial = tuple(dict.fromkeys(sg.partial + tuple(x for ax in lead for x in ax)))
        return Rule([Sharding(lead + (feat,), sg.partial), Sharding(lead)], [Sharding((rows, feat), partial)])

    def rule_convolution(self, op: AtenOp) -> Rule:
        """``convolution`` and its backward over the batch (dim 0 of input and output: DP / FSDP split it), the
        channels and spatial dims whole, the weight and bias whole (FSDP gathers them); the weight and bias
        gradients contract over the batch: pending sums over its axes, reduced with the other gradients. A
        split of any other dim (a sequence split over ``cp``, a channel split) is gathered first."""
        name = op.overload.split(".")[1]
        x = op.inputs[0]
        batch = self.sharding(x).dims[0]
        lead = lambda v: _batch_lead(batch, v)  # noqa: E731
        if name == "convolution":
            return Rule([lead(x)] + [Sharding.replicated(len(shape_of(v))) for v in op.inputs[1:]],
                        [lead(op.outputs[0])])
        grad, inp, weight = op.inputs[0], op.inputs[1], op.inputs[2]
        # the results output_mask asks for, in order: grad_input (absent where the input needs none), grad_weight,
        # grad_bias
        wanted = [bool(m) for m in int_list(_arg(op, "output_mask")) or [1, 1, 1]]
        kinds = [k for k, m in zip(("input", "weight", "bias"), wanted) if m]
        if len(kinds) != len(op.outputs):
            raise ExpandError(f"'{op.overload}'{where(op)}: {len(op.outputs)} results for output_mask {wanted}")
        return Rule([lead(grad), lead(inp), Sharding.replicated(len(shape_of(weight)))],
                    [lead(r) if k == "input" else Sharding.replicated(len(shape_of(r))).with_partial(batch)
                     for k, r in zip(kinds, op.outputs)], batch)

    def rule_per_sample(self, op: AtenOp) -> Rule:
        """Pooling and resampling (and their backward): per sample and channel over the spatial dims, so dim 0 of
        every tensor keeps the first operand's batch split and the other dims are whole (a channel or spatial
        split is gathered first)."""
        batch = self.sharding(op.inputs[0]).dims[0] if shape_of(op.inputs[0]) else ()
        return Rule([_batch_lead(batch, v) for v in op.inputs], [_batch_lead(batch, r) for r in op.outputs])

    def rule_batch_norm(self, op: AtenOp) -> Rule:
        """Batch norm (forward in training or eval, and its backward) over the batch: dim 0 of the activations
        keeps its split, their other dims are whole (a channel or spatial split is gathered first); the
        per-channel tensors (weight, bias, running and saved statistics) are whole. Each rank normalizes by its
        own batch's statistics and updates its own running statistics, as DDP and FSDP run ``BatchNorm``
        (``SyncBatchNorm`` would reduce them; no collective here), so those results are each rank's values,
        not pending sums. The weight and bias gradients sum over the batch: pending sums over its axes,
        reduced with the other gradients."""
        backward = op.overload.split(".")[1] == "native_batch_norm_backward"
        ins = list(op.inputs)
        x = ins[1] if backward else ins[0]
        batch = self.sharding(x).dims[0]

        def shard(v) -> Sharding:  # the activations split over the batch, the per-channel tensors whole
            return _batch_lead(batch, v) if len(shape_of(v)) > 1 else Sharding.replicated(len(shape_of(v)))

        res = [shard(r) if len(shape_of(r)) > 1 or not backward else shard(r).with_partial(batch)
               for r in op.outputs]
        return Rule([shard(v) for v in ins], res, batch if backward else ())

    def rule_layer_norm(self, op: AtenOp) -> Rule:
        name = op.overload.split(".")[1]
        norm = len(int_list(_arg(op, "normalized_shape")) or [1])
        ins = list(op.inputs)
        x = ins[0] if name == "native_layer_norm" else ins[1]
        rank = len(shape_of(x))
        dims, _ = self._merge(op, shape_of(x), [v for v in ins if len(shape_of(v)) == rank],
                              dim_free=tuple(range(rank - norm, rank)))
        lead_axes = tuple(a for ax in dims[:rank - norm] for a in ax)
        req = [self._align(v, dims) if len(shape_of(v)) == rank else Sharding.replicated(len(shape_of(v)))
               for v in ins]
        res = []
        for r in op.outputs:
            k = len(shape_of(r))
            if k == rank:
                res.append(self._align(r, dims))
            else:  # weight / bias gradients: summed over the leading dims
                res.append(Sharding(((),) * k, lead_axes))
        return Rule(req, res, lead_axes)

    def rule_pad(self, op: AtenOp) -> Rule:
        """``constant_pad_nd``: a padded dim (``pad`` lists (before, after) pairs from the last dim
        backwards) must be whole; the others keep their split. Linear in its input only when padding
        with zero."""
        v = op.inputs[0]
        s = self.sharding(v)
        pad = int_list(_arg(op, "pad")) or []
        padded = {s.rank - 1 - i // 2 for i, x in enumerate(pad) if x}
        dims = tuple(() if d in padded else ax for d, ax in enumerate(s.dims))
        value = getattr(getattr(_arg(op, "value"), "value", None), "data", 0)
        partial = s.partial if value == 0 else ()
        return Rule([Sharding(dims, partial)], [Sharding(dims, partial)])

    def rule_nll_loss(self, op: AtenOp) -> Rule:
        """``nll_loss_forward`` / ``nll_loss_backward`` on log-probabilities ``[N, C]`` (or ``[C]``) and
        targets ``[N]``: the class dim must be whole (no vocabulary-parallel loss here: the plan's
        ``loss_parallel`` is torch's, on the captured path); a batch split carries over to ``N``. With
        ``reduction`` mean or sum the loss and its total weight become partial sums over the batch
        axes, and the backward takes them (and the loss's gradient) as they are: each rank's local
        loss, as DDP and FSDP run it (no collective; the gradients are averaged by data parallelism)."""
        backward = op.overload.split(".")[1] == "nll_loss_backward"
        ins = list(op.inputs)
        x, t = (ins[1], ins[2]) if backward else (ins[0], ins[1])
        sx, st = self.sharding(x), self.sharding(t)
        batched = sx.rank == 2
        batch = (sx.dims[0] or (st.dims[0] if st.rank else ())) if batched else ()
        x_s = Sharding((batch, ()) if batched else ((),))
        t_s = Sharding((batch,) if st.rank else ())
        red = getattr(getattr(_arg(op, "reduction"), "value", None), "data", 1)
        if backward:
            go, rest = ins[0], ins[3:]
            go_s = Sharding((batch,)) if red == 0 and self.sharding(go).rank else self.sharding(go)
            # weight (if given) replicated; total_weight (last) as the forward left it
            extra = [Sharding.replicated(len(shape_of(v))) for v in rest[:-1]] + [self.sharding(rest[-1])]
            return Rule([go_s, x_s, t_s] + extra, [x_s])
        weight = [Sharding.replicated(len(shape_of(v))) for v in ins[2:]]
        loss = Sharding((batch,)) if red == 0 and batched else Sharding((), batch)
        return Rule([x_s, t_s] + weight, [loss, Sharding((), batch)], batch if red else ())


def _passing_partial(lin: str, partials: Sequence[tuple[str, ...]]) -> tuple[str, ...]:
    """The pending-sum axes an elementwise op passes on unreduced, from its operands' (the first operand first)
    and its linearity (``_partial_ok``): all of them alike where it is linear in every operand, the first one's
    where it is linear in that one alone and no other is partial; else none (reduced first)."""
    if lin == "all" and partials and all(set(p) == set(partials[0]) for p in partials):
        return partials[0]
    if lin == "first" and partials and partials[0] and not any(partials[1:]):
        return partials[0]
    return ()


# --------------------------------------------------------------- demand pass


def demand_pass(ops: Sequence[Operation], rules: Rules, seeds: dict) -> dict:
    """Propagate wanted dim splits backward from ``seeds`` (old value -> {dim: axes})
    through views, transposes, matmuls and elementwise ops, so that a gemm producing a split
    result computes only its shard (a gradient the annotation wants split, say)."""
    demand = dict(seeds)
    for op in reversed(list(ops)):
        if not isinstance(op, AtenOp) or not op.outputs:
            continue
        want = demand.get(op.outputs[0])
        if not want:
            continue
        kind = rules.op_kind(op.overload)
        v = op.inputs[0] if op.inputs else None
        if v is None or not isinstance(v.type, TensorType):
            continue
        name = op.overload.split(".")[1]
        if kind == "transpose":
            rank = len(shape_of(v))
            perm = list(range(rank))
            if name == "t" and rank == 2:
                perm = [1, 0]
            elif name == "transpose":
                d0 = _norm(_arg(op, "dim0").value.data, rank)
                d1 = _norm(_arg(op, "dim1").value.data, rank)
                perm[d0], perm[d1] = perm[d1], perm[d0]
            elif name == "permute":
                perm = [_norm(d, rank) for d in int_list(_arg(op, "dims"))]
            demand.setdefault(v, {perm[d]: ax for d, ax in want.items()})
        elif kind == "reshape":
            a, b = shape_of(v), shape_of(op.outputs[0])
            got = {}
            for gi, gj in reshape_groups(a, b):
                for d, ax in want.items():
                    if d in gj and gi:
                        got[next((i for i in gi if a[i] > 1), gi[0])] = ax
            if got:
                demand.setdefault(v, got)
        elif kind == "matmul" and name in ("mm",):
            a, b = op.inputs[0], op.inputs[1]
            if 0 in want:
                demand.setdefault(a, {0: want[0]})
            if 1 in want:
                demand.setdefault(b, {1: want[1]})
        elif kind == "pointwise":
            # elementwise: an operand of the result's shape is wanted split the same way (a tied weight's
            # gradient is the sum of the head's and the embedding's: each computes only its shard)
            out = shape_of(op.outputs[0])
            for x in op.inputs:
                if isinstance(x.type, TensorType) and shape_of(x) == out:
                    demand.setdefault(x, dict(want))
    return demand
