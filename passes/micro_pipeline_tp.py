"""`micro-pipeline-tp`: async tensor parallelism, as PyTorch's inductor pass of that name runs it.

PyTorch 2.13's ``torch/_inductor/fx_passes/micro_pipeline_tp.py`` matches

- an all-gather whose result (directly, or reassembled by ``split`` + ``cat`` along a non-zero
  gather dim: sequence parallelism) is the left operand of one or more matmuls, and rewrites it to
  ``symm_mem.fused_all_gather_matmul``;
- a reduce-scatter whose input is a matmul's result (directly, or through ``view`` and the
  ``split`` + ``cat`` that moves a non-zero scatter dim to the front), the matmul having no other
  user, and rewrites it to ``symm_mem.fused_matmul_reduce_scatter``.

``torch/distributed/_symmetric_memory/__init__.py`` runs those ops as n - 1 steps on the group of n
ranks (``_pipelined_all_gather_and_consume``, ``_pipelined_produce_and_all2all``): the all-gather's
matmuls run on the local shard first, then at step s = 1 .. n-1 the shard of rank ``rank + s`` is
copied over (a peer-to-peer copy on a second stream) and multiplied while the next one arrives; the
matmul-reduce-scatter computes at step s the rows destined to rank ``rank + s``, which that rank
pulls while the next rows compute, then the local rows, then one reduction (``sum`` over the n
stacked partials). This pass writes exactly that schedule in Flint's IR, one `dist.steps` per
match (compact whatever n), so the smaller GEMMs are priced by the shape-aware GEMM model and the
simulator overlaps each transfer with the previous chunk's GEMM.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

from xdsl.context import Context
from xdsl.dialects.builtin import (
    ArrayAttr,
    DenseArrayBase,
    FlatSymbolRefAttr,
    IntegerAttr,
    ModuleOp,
    NoneType,
    StringAttr,
    TensorType,
    UnitAttr,
    i64,
)
from xdsl.ir import Block, Operation, Region, SSAValue
from xdsl.passes import ModulePass
from xdsl.rewriter import InsertPoint, Rewriter

from flint.errors import FlintError
from flint.ir import dist
from flint.ir.aten import AtenOp
from flint.limits import MAX_SMS
# A buffer placement or a view is no kernel (the peer-to-peer copy writes the shard in place, as symm_mem
# does): annotated free as decompose-collectives annotates its placements.
from flint.passes.decompose_collectives import _FREE
from flint.passes.scheduling import functions

MATMULS = ("aten.mm.default", "aten.addmm.default")
RESHAPES = ("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default")
FUSED_ATTR = "flint.micro_pipeline_tp"  # on each emitted `dist.steps`: "all_gather_matmul" / "matmul_reduce_scatter"


@dataclass
class Stats:
    """What one run matched: per kind, how many collectives became micro-pipelined and how many were left."""

    all_gather_matmul: int = 0
    matmul_reduce_scatter: int = 0
    all_gathers_left: int = 0
    reduce_scatters_left: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def skip(self, why: str) -> None:
        self.reasons[why] = self.reasons.get(why, 0) + 1


def _ints(v) -> ArrayAttr:
    return ArrayAttr([IntegerAttr(int(x), i64) for x in v])


def _shape(v: SSAValue) -> list[int]:
    t = v.type
    assert isinstance(t, TensorType)
    return list(t.get_shape())


def _ttype(shape, like: SSAValue) -> TensorType:
    return TensorType(like.type.element_type, list(shape))


def _is(op: Operation | None, targets) -> bool:
    return isinstance(op, AtenOp) and op.overload in targets


def _only_user(v: SSAValue) -> Operation | None:
    users = {u.operation for u in v.uses}
    return next(iter(users)) if len(users) == 1 else None


def _wait_of(op: dist.CollectiveOp) -> tuple[SSAValue, dist.WaitOp | None] | None:
    """The value a collective yields (its one wait's result when asynchronous), or None."""
    if not op.is_async:
        return op.result, None
    waits = [u.operation for u in op.result.uses]
    if len(waits) != 1 or not isinstance(waits[0], dist.WaitOp) or waits[0].parent is not op.parent:
        return None
    return waits[0].result, waits[0]


def _ancestors(v: SSAValue, block: Block) -> set[SSAValue]:
    seen, todo = set(), [v]
    while todo:
        x = todo.pop()
        if x in seen:
            continue
        seen.add(x)
        owner = x.owner
        if isinstance(owner, Operation) and owner.parent is block:
            todo.extend(owner.operands)
    return seen


class _Emit:
    """Inserts ops at a point; marks views / placements free."""

    def __init__(self, point: InsertPoint, phase: str | None, module: str | None):
        self.point, self.phase, self.module = point, phase, module
        self.ops: list[Operation] = []

    def put(self, op: Operation) -> Operation:
        Rewriter.insert_op(op, self.point)
        return op

    def aten(self, target: str, inputs, shape, like: SSAValue, *, free: bool = False, args=None) -> SSAValue:
        op = AtenOp(target, inputs, [_ttype(shape, like)], args=args, phase=self.phase, module=self.module)
        if free:
            op.attributes.update(_FREE)
        return self.put(op).results[0]

    def view(self, x: SSAValue, shape) -> SSAValue:
        if _shape(x) == list(shape):
            return x
        return self.aten("aten.view.default", [x], shape, x, free=True, args={"size": _ints(shape)})

    def empty(self, shape, like: SSAValue) -> SSAValue:
        return self.aten("aten.empty.memory_format", [], shape, like, free=True, args={"size": _ints(shape)})

    def place(self, buf: SSAValue, x: SSAValue, start: int, end: int, shift: tuple[int, int] | None = None,
              free: bool = True) -> SSAValue:
        """``slice_scatter`` of ``x`` into the 1-D ``buf`` at ``[start, end)`` (at step i: shifted, see dist)."""
        op = AtenOp("aten.slice_scatter.default", [buf, x], [buf.type], phase=self.phase, module=self.module,
                    args={"dim": IntegerAttr(0, i64), "start": IntegerAttr(start, i64), "end": IntegerAttr(end, i64)})
        if free:
            op.attributes.update(_FREE)
        op.attributes[dist.IN_PLACE_ATTR] = UnitAttr()
        if shift is not None:
            op.attributes[dist.STEP_SHIFT_ATTR] = DenseArrayBase.from_list(i64, list(shift))
        return self.put(op).results[0]

    def take(self, buf: SSAValue, start: int, end: int, shift: tuple[int, int] | None = None) -> SSAValue:
        op = AtenOp("aten.slice.Tensor", [buf], [_ttype([end - start], buf)], phase=self.phase, module=self.module,
                    args={"dim": IntegerAttr(0, i64), "start": IntegerAttr(start, i64), "end": IntegerAttr(end, i64)})
        op.attributes.update(_FREE)
        if shift is not None:
            op.attributes[dist.STEP_SHIFT_ATTR] = DenseArrayBase.from_list(i64, list(shift))
        return self.put(op).results[0]

    def matmul(self, mm: AtenOp, a: SSAValue) -> SSAValue:
        """``mm``'s GEMM (``mm`` or ``addmm`` with its bias) on the rows ``a``."""
        b = mm.inputs[-1]
        rows, cols = _shape(a)[0], _shape(b)[1]
        ins = [mm.inputs[0], a, b] if mm.overload == "aten.addmm.default" else [a, b]
        op = AtenOp(mm.overload, ins, [_ttype([rows, cols], mm.outputs[0])],
                    args=dict(mm.args.data) if mm.args is not None else None, phase=_attrs(mm)[0],
                    module=_attrs(mm)[1])
        op.location = mm.location
        return self.put(op).results[0]


def _p2p(grid: str, axis: int, offset: int, tag: int, stream: str, x: SSAValue | None, shape=None, like=None):
    props = {"grid": FlatSymbolRefAttr(grid), "grid_axes": dist.axes_attr([axis]), "offset": IntegerAttr(offset, i64),
             "tag": IntegerAttr(tag, i64), "offset_step": IntegerAttr(1 if offset > 0 else -1, i64),
             "tag_step": IntegerAttr(1, i64)}
    if x is not None:
        op = dist.SendOp.build(operands=[x], result_types=[[dist.FutureType(NoneType())]], properties=props)
    else:
        op = dist.RecvOp.build(result_types=[_ttype(shape, like)], properties=props)
    op.attributes[dist.STREAM_ATTR] = StringAttr(stream)
    return op


def _attrs(op: Operation) -> tuple[str | None, str | None]:
    p, m = op.properties.get("phase"), op.properties.get("module")
    return (p.data if isinstance(p, StringAttr) else None, m.data if isinstance(m, StringAttr) else None)


@dataclass(frozen=True)
class MicroPipelineTPPass(ModulePass):
    """Pipeline tensor-parallel all-gathers and reduce-scatters with the GEMMs they feed or are fed by (async TP).

    Follows PyTorch's inductor pass ``micro_pipeline_tp`` and the symmetric-memory ops it emits
    (module docstring). Matches, in every function's body:

    - **all-gather -> matmul(s)**: a ``dist.all_gather`` (one wait) whose result, directly (gather
      dim 0) or reassembled by ``aten.split.Tensor`` + ``aten.cat.default`` along a non-last dim
      (sequence parallelism), is, directly or through a ``view``, the left operand of at least one
      ``aten.mm`` / ``aten.addmm`` whose right operand does not depend on it. Gathers along the last
      dim are left alone. Rewritten to: the matmuls on the local shard, then a ``dist.steps`` of
      n - 1 steps that receive the shard of the rank at offset ``s`` (step s = 1 .. n-1) and
      multiply it while the next one arrives; the gathered tensor itself is still assembled in
      place for its other users (``return_A``), plus the copy of the local shard into it.
    - **matmul -> reduce-scatter**: a ``dist.reduce_scatter`` (sum or average, one wait) of an
      ``aten.mm`` / ``aten.addmm`` result that has no other user, directly (scatter dim 0) or
      through a ``view`` and the ``split`` + ``cat`` that brings a non-zero scatter dim to the
      front. Rewritten to a ``dist.steps`` of n - 1 steps, each computing the rows for the rank at
      offset ``s`` and sending them while the next rows compute, the local rows last, and one
      ``aten.sum`` (``aten.mean``) over the n stacked partials.

    The chunk GEMMs are real ``aten.mm`` / ``aten.addmm`` ops of 1/n the rows, priced by the
    shape-aware GEMM model; buffer placements and views are free (``flops = bytes = 0``), as the
    peer-to-peer copies write in place. Transfers are ``dist.send`` / ``dist.recv`` on the
    communication stream ``stream``; the GEMMs stay on the compute stream, so the simulator overlaps
    transfer s + 1 with GEMM s. FLOPs and the bytes each rank moves ((n-1)/n of the gathered or
    reduced tensor) are those of the matched ops. As in torch, a row split assumes the operand
    laid out with the gathered/scattered dim first (inductor restrides its producer: no copy priced).
    Not modelled: torch alternates each step between two streams, which can also overlap two chunk
    GEMMs (here they run one after the other on the compute stream), the symmetric-memory barriers
    around each copy, and the all-gather's initial copy of the shard into the symmetric buffer.
    Run it after ``fuse-pointwise``: that pass re-prices every op it sees, the free placements too.

    Options: ``all-gather`` / ``reduce-scatter`` (bools, default true): which pattern to rewrite
    (at least one); ``stream`` (default ``symm_mem``): the stream name of the transfers; ``sms``
    (default 0): SMs each reduce-scatter step's send holds while in flight, slowing the rank's compute
    meanwhile in the simulator. 0 is torch's symmetric memory (copy engines); Transformer Engine's
    userbuffers overlap (Megatron's ``--tp-comm-overlap``) runs its pipelined and bulk reduce-scatters
    as kernels on ``num_sm`` = 16 SMs by default (``initialize_ub``), its ring-exchange all-gathers on
    the copy engines: ``sms=16``. Unmatched collectives are left untouched; the pass prints to stderr
    how many of each kind it matched and why the others were left.
    """

    name = "micro-pipeline-tp"

    all_gather: bool = True
    reduce_scatter: bool = True
    stream: str = "symm_mem"
    sms: int = 0

    def __post_init__(self) -> None:
        for opt in ("all_gather", "reduce_scatter"):
            if not isinstance(getattr(self, opt), bool):
                raise FlintError(f"{self.name}: option {opt.replace('_', '-')} must be true or false, "
                                 f"got {getattr(self, opt)!r}")
        if not (self.all_gather or self.reduce_scatter):
            raise FlintError(f"{self.name}: options all-gather=false and reduce-scatter=false leave nothing to "
                             "rewrite; enable at least one")
        s = self.stream
        if not isinstance(s, str) or not s or not s.replace("_", "").replace("-", "").isalnum():
            raise FlintError(f"{self.name}: option stream=\"{s}\" is not a stream name (letters, digits, '_' and '-')")
        if isinstance(self.sms, bool) or not isinstance(self.sms, int) or not 0 <= self.sms <= MAX_SMS:
            raise FlintError(f"{self.name}: option sms={self.sms} must be an SM count, 0 <= sms <= {MAX_SMS}")

    @classmethod
    def from_spec(cls, spec):
        """xDSL's option parsing, with errors that name the option and what it takes."""
        wants = {"all_gather": (bool, "true or false"), "reduce_scatter": (bool, "true or false"),
                 "stream": (str, "a stream name"), "sms": (int, f"an SM count, 0 <= sms <= {MAX_SMS}")}
        for key, value in spec.normalize_parameter_names().parameters.items():
            if key not in wants:
                raise FlintError(f"{cls.name}: unknown option '{key.replace('_', '-')}'; options: "
                                 "all-gather=<bool>, reduce-scatter=<bool>, stream=<name>, sms=<int>")
            kind, what = wants[key]
            if len(value) != 1 or not isinstance(value[0], kind) or (kind is not bool and isinstance(value[0], bool)):
                shown = ",".join(str(v).lower() if isinstance(v, bool) else str(v) for v in value) or "(nothing)"
                raise FlintError(f"{cls.name}: option {key.replace('_', '-')}={shown} must be {what}")
        return super().from_spec(spec)

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        st = rewrite(op, self)
        left = ", ".join(f"{k}: {v}" for k, v in sorted(st.reasons.items()))
        print(f"{self.name}: {st.all_gather_matmul} all-gather -> matmul and {st.matmul_reduce_scatter} matmul -> "
              f"reduce-scatter pipelined; left {st.all_gathers_left} all-gathers and {st.reduce_scatters_left} "
              f"reduce-scatters unchanged{' (' + left + ')' if left else ''}", file=sys.stderr)


def rewrite(module: ModuleOp, opts: MicroPipelineTPPass) -> Stats:
    """Apply the pass; return what it matched."""
    st = Stats()
    tag = 1 + max((max(o.tag_at(0), o.tag_at(dist.steps_of(o) - 1)) for o in module.walk()
                   if isinstance(o, dist.PointToPointOp)), default=-1)
    for fn in functions(module):
        block = fn.body.block
        for coll in [o for o in block.ops if isinstance(o, dist.AllGatherOp | dist.ReduceScatterOp)]:
            n = coll.group_size()
            if n == 1:
                continue
            if len(coll.axes()) != 1:  # peer offsets run along one grid axis
                st.skip("collective over more than one grid axis")
                if isinstance(coll, dist.AllGatherOp):
                    st.all_gathers_left += 1
                else:
                    st.reduce_scatters_left += 1
                continue
            if isinstance(coll, dist.AllGatherOp):
                m = _match_ag(coll, block, st) if opts.all_gather else st.skip("all-gather=false")
                if m is None:
                    st.all_gathers_left += 1
                    continue
                _rewrite_ag(coll, *m, tag, opts.stream)
                st.all_gather_matmul += 1
            else:
                m = _match_rs(coll, st) if opts.reduce_scatter else st.skip("reduce-scatter=false")
                if m is None:
                    st.reduce_scatters_left += 1
                    continue
                _rewrite_rs(coll, *m, tag, opts.stream, opts.sms)
                st.matmul_reduce_scatter += 1
            tag += n
    return st


# -- all-gather -> matmul ---------------------------------------------------------------------------


def _match_ag(ag: dist.AllGatherOp, block: Block, st: Stats):
    got = _wait_of(ag)
    if got is None:
        return st.skip("all-gather without one wait in its block")
    value, wait = got
    n = ag.group_size()
    shard = _shape(ag.input)
    gdim = ag.gather_dim.value.data
    res, erase = value, []
    if gdim == 0:  # funcol.all_gather_single along dim 0, or the split + cat of a non-zero gather dim
        split = _only_user(value)
        if _is(split, ("aten.split.Tensor",)) and len(split.outputs) == n and _shape(value)[0] % n == 0:
            args = split.args.data if split.args is not None else {}
            d = args.get("dim")
            cat = _only_user(split.outputs[0])
            if (d is None or d.value.data == 0) and _is(cat, ("aten.cat.default",)) \
                    and list(cat.inputs) == list(split.outputs) and all(_only_user(o) is cat for o in split.outputs):
                cd = cat.args.data.get("dim") if cat.args is not None else None
                gdim = cd.value.data if cd is not None else 0
                res, erase = cat.outputs[0], [cat, split]
    if gdim == len(shard) - 1 or gdim < 0:
        return st.skip("all-gather along the last dim")
    K = shard[-1]
    total = math.prod(_shape(res))
    # The gathered value and its views (AOTAutograd folds a batch-1 split + cat into a view; a trimming
    # slice over the whole range, as torch's matcher allows, is one too).
    tree, todo = [res], [res]
    while todo:
        v = todo.pop(0)
        for u in sorted({u.operation for u in v.uses if _is_view(u.operation)}, key=_pos):
            if u.outputs[0] not in tree:
                tree.append(u.outputs[0])
                todo.append(u.outputs[0])
    matmuls = []
    for v in tree:
        for mm in sorted({u.operation for u in v.uses if _is(u.operation, MATMULS)}, key=_pos):
            if mm.inputs[-2] is not v or _shape(v) != [total // K, K] or mm in matmuls:
                continue
            if any(res in _ancestors(w, block) for w in mm.inputs if w is not v):
                continue
            matmuls.append(mm)
    if not matmuls:
        return st.skip("all-gather feeding no matmul")
    order = {o: i for i, o in enumerate(block.ops)}
    matmuls.sort(key=lambda o: order[o])
    outs = {mm.outputs[0] for mm in matmuls}
    if any(outs & _ancestors(v, block) for mm in matmuls for v in mm.inputs if v is not mm.inputs[-2]):
        return st.skip("matmul operand computed from another matmul of the same all-gather")
    return value, wait, res, erase, matmuls, tree


def _is_view(op: Operation) -> bool:
    """A reshape, or a slice that keeps the whole tensor (torch's trim after a gather: ``[0, size)``)."""
    if _is(op, RESHAPES):
        return True
    if not _is(op, ("aten.slice.Tensor",)) or op.args is None:
        return False
    a = op.args.data
    return _shape(op.inputs[0]) == _shape(op.outputs[0]) and a.get("start") is not None \
        and a["start"].value.data == 0 and (a.get("step") is None or a["step"].value.data == 1)


def _pos(op: Operation) -> tuple:
    """Program order of ``op`` in its block (for deterministic iteration over users)."""
    block = op.parent
    return (0 if block is None else block.get_operation_index(op),)


def _rewrite_ag(ag: dist.AllGatherOp, value: SSAValue, wait, res: SSAValue, erase: list[Operation],
                matmuls: list[AtenOp], tree: list[SSAValue], tag: int, stream: str) -> None:
    n = ag.group_size()
    grid, axis = ag.grid.root_reference.data, ag.axes()
    x = ag.input
    K = _shape(x)[-1]
    m = math.prod(_shape(x)) // K
    phase, module = _attrs(matmuls[0])
    # All new ops go where the first matmul was; the other matmuls' weights and biases computed after it
    # move up before it, as torch raises them above the fused op.
    block = matmuls[0].parent
    order = {o: i for i, o in enumerate(block.ops)}
    raise_ = set()
    for mm in matmuls[1:]:
        for v in mm.inputs:
            if v is not mm.inputs[-2]:
                raise_ |= {a.owner for a in _ancestors(v, block) if isinstance(a.owner, Operation)
                           and a.owner.parent is block and order[a.owner] > order[matmuls[0]]}
    for o in sorted(raise_, key=lambda o: order[o]):
        o.detach()
        Rewriter.insert_op(o, InsertPoint.before(matmuls[0]))
    e = _Emit(InsertPoint.before(matmuls[0]), phase, module)
    xs = e.view(x, [m, K])
    outs = []
    for mm in matmuls:  # the local shard's GEMMs first (torch: shard_consumer(shard, rank))
        N = _shape(mm.outputs[0])[1]
        buf = e.empty([n * m * N], mm.outputs[0])
        outs.append(e.place(buf, e.view(e.matmul(mm, xs), [m * N]), 0, m * N))
    others = [u.operation for v in tree for u in v.uses
              if u.operation not in matmuls and not (_is_view(u.operation) and u.operation.outputs[0] in tree)]
    a_buf = None
    if others:  # return_A: the gathered tensor is still needed; the local shard is copied in (a kernel)
        a_buf = e.place(e.empty([n * m * K], x), e.view(xs, [m * K]), 0, m * K, free=False)
    inits = outs + ([a_buf] if a_buf is not None else [])
    body = Block(arg_types=[v.type for v in inits])
    b = _Emit(InsertPoint.at_end(body), phase, module)
    axis0 = axis[0]
    b.put(_p2p(grid, axis0, -1, tag, stream, xs))  # rank + s pulls my shard: I send to rank - s
    recv = b.put(_p2p(grid, axis0, 1, tag, stream, None, [m, K], x)).results[0]
    carried = []
    for mm, arg in zip(matmuls, body.args):
        N = _shape(mm.outputs[0])[1]
        carried.append(b.place(arg, b.view(b.matmul(mm, recv), [m * N]), m * N, 2 * m * N, (m * N, n * m * N)))
    if a_buf is not None:
        carried.append(b.place(body.args[-1], b.view(recv, [m * K]), m * K, 2 * m * K, (m * K, n * m * K)))
    b.put(dist.YieldOp.build(operands=[carried]))
    steps = dist.StepsOp(n - 1, inits, Region(body))
    steps.attributes[FUSED_ATTR] = StringAttr("all_gather_matmul")
    steps.location = ag.location
    e.put(steps)
    e.put(dist.WaitOp(steps.token))
    for mm, out in zip(matmuls, steps.outs):
        mm.outputs[0].replace_all_uses_with(e.view(out, _shape(mm.outputs[0])))
    if a_buf is not None:
        whole = e.view(steps.outs[-1], _shape(res))
        res.replace_all_uses_with(whole)
        _sink_users(whole)
    for mm in matmuls:
        Rewriter.erase_op(mm)
    for v in reversed(tree[1:]):  # views of the gathered value left without users
        if not v.uses:
            Rewriter.erase_op(v.owner)
    for o in erase:
        Rewriter.erase_op(o)
    if wait is not None:
        Rewriter.erase_op(wait)
    Rewriter.erase_op(ag)


def _sink_users(v: SSAValue) -> None:
    """Move the users of ``v`` that its block runs before ``v``'s definition to just after it (transitively)."""
    block = v.owner.parent
    order = {o: i for i, o in enumerate(block.ops)}
    todo, after = [v], v.owner
    while todo:
        x = todo.pop(0)
        early = sorted({u.operation for u in x.uses if u.operation.parent is block
                        and order[u.operation] < order[x.owner]}, key=lambda o: order[o])
        for u in early:
            u.detach()
            Rewriter.insert_op(u, InsertPoint.after(after))
            after = u
            order = {o: i for i, o in enumerate(block.ops)}
            todo.extend(u.results)


# -- matmul -> reduce-scatter -----------------------------------------------------------------------


def _match_rs(rs: dist.ReduceScatterOp, st: Stats):
    got = _wait_of(rs)
    if got is None:
        return st.skip("reduce-scatter without one wait in its block")
    if rs.reduction.data.value not in ("sum", "average"):  # torch: reduce_op must be sum or avg
        return st.skip(f"reduce-scatter reducing by {rs.reduction.data.value}")
    n = rs.group_size()
    if rs.scatter_dim.value.data != 0:
        return st.skip("reduce-scatter along a non-zero dim")
    y, erase = rs.input, []
    cat = y.owner
    if _is(cat, ("aten.cat.default",)) and _only_user(y) is rs:
        cd = cat.args.data.get("dim") if cat.args is not None else None
        split = cat.inputs[0].owner
        if (cd is None or cd.value.data == 0) and _is(split, ("aten.split.Tensor",)) \
                and list(cat.inputs) == list(split.outputs) and len(split.outputs) == n \
                and all(_only_user(o) is cat for o in split.outputs):
            y, erase = split.inputs[0], [cat, split]
    if _only_user(y) is not (erase[-1] if erase else rs):
        return st.skip("matmul result with other users")
    mm = y.owner
    if _is(mm, RESHAPES):
        erase.append(mm)
        mm = mm.inputs[0].owner
        if not _is(mm, MATMULS) or _only_user(mm.outputs[0]) is not erase[-1]:
            return st.skip("reduce-scatter of no matmul")
    if not _is(mm, MATMULS):
        return st.skip("reduce-scatter of no matmul")
    M = _shape(mm.outputs[0])[0]
    if M % n:
        return st.skip("matmul rows not divisible by the group")
    return got[0], got[1], mm, erase


def _rewrite_rs(rs: dist.ReduceScatterOp, value: SSAValue, wait, mm: AtenOp, erase: list[Operation], tag: int,
                stream: str, sms: int = 0) -> None:
    n = rs.group_size()
    grid, axis = rs.grid.root_reference.data, rs.axes()
    a = mm.inputs[-2]
    M, K = _shape(a)
    N = _shape(mm.outputs[0])[1]
    m = M // n
    phase, module = _attrs(mm)
    anchor = wait if wait is not None else rs
    e = _Emit(InsertPoint.before(anchor), phase, module)
    a_flat = e.view(a, [M * K])
    buf = e.empty([n * m * N], mm.outputs[0])
    body = Block(arg_types=[buf.type])
    b = _Emit(InsertPoint.at_end(body), phase, module)
    rows = b.view(b.take(a_flat, m * K, 2 * m * K, (m * K, M * K)), [m, K])  # the rows for rank + s
    part = b.matmul(mm, rows)
    send = b.put(_p2p(grid, axis[0], 1, tag, stream, part))  # rank + s pulls them
    if sms:  # its kernel holds SMs while in flight (Transformer Engine's userbuffers reduce-scatter)
        send.attributes[dist.SMS_ATTR] = IntegerAttr(sms, i64)
    got = b.put(_p2p(grid, axis[0], -1, tag, stream, None, [m, N], mm.outputs[0])).results[0]  # from rank - s
    placed = b.place(body.args[0], b.view(got, [m * N]), m * N, 2 * m * N, (m * N, n * m * N))
    b.put(dist.YieldOp.build(operands=[[placed]]))
    steps = dist.StepsOp(n - 1, [buf], Region(body))
    steps.attributes[FUSED_ATTR] = StringAttr("matmul_reduce_scatter")
    steps.location = rs.location
    e.put(steps)
    local = e.matmul(mm, e.view(e.take(a_flat, 0, m * K), [m, K]))  # the local rows last
    stacked = e.place(steps.outs[0], e.view(local, [m * N]), 0, m * N)
    e.put(dist.WaitOp(steps.token))
    target = "aten.sum.dim_IntList" if rs.reduction.data.value == "sum" else "aten.mean.dim"
    red = e.aten(target, [e.view(stacked, [n, m, N])], [m, N], mm.outputs[0], args={"dim": _ints([0])})
    value.replace_all_uses_with(e.view(red, _shape(value)))
    if wait is not None:
        Rewriter.erase_op(wait)
    Rewriter.erase_op(rs)
    for o in erase:
        Rewriter.erase_op(o)
    Rewriter.erase_op(mm)
