"""The one invariant checker for scheduling passes.

A scheduling pass (reorder, sink, hoist, bucket, split, re-stream) may move,
regroup or re-stream communication; it must not change what is computed or
how much moves. :func:`check_schedule_invariants` compares a module before
and after such a pass and raises :class:`ScheduleInvariantError` naming the
first op that broke an invariant (its location, function and position) and
the dependency or count it broke. Every scheduling pass's tests call it.

What it checks, on ``after`` (and against ``before``):

1. The module verifies and ``verify-dist`` passes (every asynchronous start
   is completed by exactly one ``dist.wait``, no future is used before its
   wait, send/recv match SPMD-wise).
2. SSA order: every operand of every op is defined earlier in its block (or
   is an argument of an enclosing block); in particular each ``dist.wait``
   comes after its start, in the same block, and every use of a waited
   value comes after the wait.
3. Data dependencies are the ones ``before`` had. Each value gets a
   structural number from the op that makes it (name and properties, not
   attributes or locations, which passes may annotate) and its operands'
   numbers; a ``dist.wait`` is transparent (the asynchronous and the
   synchronous form of a collective number the same), so moving a start or
   a wait keeps every number and rewiring an operand changes one. Functions
   are matched by name; a function whose argument types changed, or that
   exists on one side only (a pass-made prologue), is checked by 1, 2, 4, 5.
   With ``same_bytes_per_group`` (bucketing, splitting) collectives and the
   data-movement ops a pass inserts around them (``cat``, ``split``,
   views: ops of ``after`` that ``before`` lacks) are looked through: each
   operand of each original compute op must still depend on every original
   op and argument it depended on before.
4. Control dependencies: sends and recvs on one channel (grid, axis, peer
   offset, tag) keep their order (matching is by order), and no
   communication op crosses a ``dist.barrier``: every collective and
   point-to-point op keeps the number of barriers before it in its
   function (its *epoch*, part of the multiset key below).
5. Communication is conserved, each op weighted by how often its function
   runs (the module's ``flint.schedule``): the multiset of collectives keyed
   by (epoch, kind, grid, grid axes, input bytes, dtype, reduction) is
   unchanged; with ``same_bytes_per_group=True`` the total input bytes per
   (epoch, kind, grid, grid axes, dtype, reduction) is. Sends, recvs and
   barriers are compared exactly in both modes.
6. FLOPs are unchanged (the one count, :func:`flint.cost.op_flops`), each op
   weighted by its function's repeat count.

The modules are not modified. ``before`` must be a separate copy
(``module.clone()``) of the input the pass ran on.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from io import StringIO
from typing import Iterable

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, TensorType, UnknownLoc
from xdsl.ir import Block, BlockArgument, Operation, OpResult, SSAValue
from xdsl.printer import Printer
from xdsl.utils.exceptions import VerifyException

from flint.cost import tensor_bytes
from flint.errors import FlintError
from flint.ir import dist
from flint.ir.aten import AtenOp, get_schedule

__all__ = ["ScheduleInvariantError", "check_schedule_invariants", "describe_op"]


class ScheduleInvariantError(FlintError):
    """A scheduling pass broke an invariant; ``op`` is the offending op of ``after`` (or ``before``)."""

    def __init__(self, message: str, op: Operation | None = None):
        super().__init__(message)
        self.op = op


# -- naming ops ----------------------------------------------------------------


def _function_of(op: Operation) -> func.FuncOp | None:
    p = op.parent_op()
    while p is not None and not isinstance(p, func.FuncOp):
        p = p.parent_op()
    return p


def _location(op: Operation) -> str:
    loc = op.location
    if loc is None or isinstance(loc, UnknownLoc):
        return ""
    out = StringIO()
    Printer(stream=out).print_attribute(loc)
    text = out.getvalue()
    return f" at {text}" if text.startswith("loc") else f" at loc({text})"


def _short(op: Operation) -> str:
    out = StringIO()
    Printer(stream=out).print_op(op)
    text = out.getvalue().strip().splitlines()[0] if out.getvalue().strip() else op.name
    return text if len(text) <= 140 else text[:137] + "..."


def describe_op(op: Operation) -> str:
    """``'aten.op' "aten.mm.default" (module layers.0) at loc(...) in @f (op #3: %y = ...)``."""
    what = f"'{op.name}'"
    if isinstance(op, AtenOp):
        what += f' "{op.overload}"'
        if op.module is not None:
            what += f" (module {op.module.data})"
    fn = _function_of(op)
    where = ""
    if fn is not None and op.parent_block() is not None:
        idx = list(op.parent_block().ops).index(op)
        where = f" in @{fn.sym_name.data} (op #{idx}: {_short(op)})"
    return f"{what}{_location(op)}{where}"


def _describe_value(v: SSAValue) -> str:
    if isinstance(v, BlockArgument):
        fn = _function_of(v.block.parent_op()) if v.block.parent_op() is not None else None
        if isinstance(v.block.parent_op(), func.FuncOp):
            fn = v.block.parent_op()
        name = f"@{fn.sym_name.data}" if fn is not None else "its block"
        return f"argument #{v.index} of {name}"
    assert isinstance(v, OpResult)
    return f"result #{v.index} of {describe_op(v.op)}"


# -- what a module contains ------------------------------------------------------


def _functions(module: ModuleOp) -> dict[str, func.FuncOp]:
    return {f.sym_name.data: f for f in module.ops if isinstance(f, func.FuncOp)}


def _weights(module: ModuleOp) -> dict[str, int]:
    """How many times each function runs per step (its ``flint.schedule`` counts; 0 if unscheduled)."""
    try:
        schedule = get_schedule(module)
    except VerifyException as e:
        raise ScheduleInvariantError(f"cannot read the module's schedule: {e}") from None
    w: dict[str, int] = defaultdict(int)
    for name, count in schedule:
        w[name] += count
    return w


def _payload(t) -> TensorType | None:
    if isinstance(t, dist.FutureType):
        t = t.value_type
    return t if isinstance(t, TensorType) else None


def _bytes_dtype(t) -> tuple[int, str]:
    t = _payload(t)
    if t is None:
        return 0, "none"
    return tensor_bytes(t.get_shape(), str(t.element_type)), str(t.element_type)


def _reduction(op: Operation) -> str:
    r = getattr(op, "reduction", None)
    return str(r.data.value) if r is not None else "-"


def _epochs(block: Block) -> dict[Operation, int]:
    """For each op of ``block``: how many ``dist.barrier`` ops precede it."""
    out, n = {}, 0
    for op in block.ops:
        out[op] = n
        if isinstance(op, dist.BarrierOp):
            n += 1
    return out


def _comm_keys(op: Operation, epoch: int, bucketed: bool) -> tuple[tuple, int] | None:
    """(multiset key, weight unit) for a communication op, or None if ``op`` is not one."""
    if isinstance(op, dist.CollectiveOp):
        nbytes, dtype = _bytes_dtype(op.input.type)
        base = (epoch, op.name, op.grid.string_value(), op.axes())
        if bucketed:
            return base + (dtype, _reduction(op)), nbytes
        return base + (nbytes, dtype, _reduction(op)), 1
    if isinstance(op, dist.BarrierOp):
        return (epoch, op.name, op.grid.string_value(), op.axes()), 1
    if isinstance(op, dist.SendOp | dist.RecvOp):
        v = op.input if isinstance(op, dist.SendOp) else op.result
        nbytes, dtype = _bytes_dtype(v.type)
        return (epoch, op.name, op.grid.string_value(), op.axes(), nbytes, dtype,
                op.offset.value.data, op.tag.value.data), 1
    return None


def _comm_census(module: ModuleOp, bucketed: bool) -> tuple[Counter, dict[tuple, Operation]]:
    weights = _weights(module)
    census: Counter = Counter()
    example: dict[tuple, Operation] = {}
    for name, fn in _functions(module).items():
        w = weights.get(name, 0)
        for block in _blocks(fn):
            ep = _epochs(block)
            for op in block.ops:
                k = _comm_keys(op, ep[op], bucketed)
                if k is None:
                    continue
                key, amount = k
                if w:
                    census[key] += amount * w
                example.setdefault(key, op)
    return census, example


def _blocks(fn: func.FuncOp) -> Iterable[Block]:
    for op in fn.walk():
        for region in op.regions:
            yield from region.blocks


def _flops(module: ModuleOp) -> tuple[int, dict[str, int]]:
    from flint.passes.annotate_cost import aten_op_work

    weights = _weights(module)
    total, per_fn = 0, {}
    for name, fn in _functions(module).items():
        s = 0
        for op in fn.walk():
            if isinstance(op, AtenOp):
                try:
                    s += aten_op_work(op).flops
                except Exception as e:  # torch's formulas assert on inconsistent shapes
                    raise ScheduleInvariantError(f"cannot count the FLOPs of {describe_op(op)}: {e}", op) from None
        per_fn[name] = s
        total += s * weights.get(name, 0)
    return total, per_fn


# -- checks ------------------------------------------------------------------------


def _check_verifies(after: ModuleOp) -> None:
    from flint.passes.verify_dist import VerifyDistPass

    try:
        after.verify()
    except VerifyException as e:
        from flint.ir.parse import failing_op

        bad = failing_op(after, e)
        where = f" ({describe_op(bad)})" if bad is not None else ""
        raise ScheduleInvariantError(f"the module no longer verifies{where}: {e}", bad) from None
    try:
        VerifyDistPass().apply(Context(), after)
    except VerifyException as e:
        bad = getattr(e, "op", None)
        where = f"{describe_op(bad)}: " if bad is not None else ""
        raise ScheduleInvariantError(f"verify-dist fails after the pass: {where}{e}", bad) from None


def _check_ssa_order(after: ModuleOp) -> None:
    """Every operand is defined before its use: same block earlier, or an enclosing block."""
    for fn in _functions(after).values():
        _check_block_order(fn.body.block, set(fn.body.block.args))


def _check_block_order(block: Block, visible: set[SSAValue]) -> None:
    defined = set(visible) | set(block.args)
    for op in block.ops:
        for i, v in enumerate(op.operands):
            if v in defined:
                continue
            if isinstance(v, OpResult) and v.op.parent_block() is block:
                if isinstance(op, dist.WaitOp):
                    msg = (f"{describe_op(op)} waits before its start: the future it completes is made by "
                           f"{describe_op(v.op)}, which now comes after it")
                else:
                    prod = v.op
                    if isinstance(prod, dist.WaitOp):
                        msg = (f"{describe_op(op)} uses operand #{i} before the 'dist.wait' that completes it: "
                               f"{describe_op(prod)} now comes after its use")
                    else:
                        msg = (f"{describe_op(op)} uses operand #{i} before it is computed: its producer "
                               f"{describe_op(prod)} now comes after it")
                raise ScheduleInvariantError(msg, op)
            raise ScheduleInvariantError(
                f"{describe_op(op)} uses operand #{i} ({_describe_value(v)}), which is not defined in its "
                "block or an enclosing one", op)
        for region in op.regions:
            for inner in region.blocks:
                _check_block_order(inner, defined)
        defined.update(op.results)


def _check_waits(after: ModuleOp) -> None:
    """Each asynchronous start: exactly one wait, in the same block, after the start."""
    for op in after.walk():
        fut = None
        if isinstance(op, dist.CollectiveOp | dist.RecvOp) and op.is_async:
            fut = op.result
        elif isinstance(op, dist.SendOp | dist.BarrierOp) and op.token is not None:
            fut = op.token
        if fut is None:
            continue
        waits = [u.operation for u in fut.uses if isinstance(u.operation, dist.WaitOp)]
        if len(waits) != 1:
            raise ScheduleInvariantError(
                f"{describe_op(op)} starts asynchronously and must be completed by exactly one 'dist.wait'; "
                f"it has {len(waits)}", op)
        w = waits[0]
        if w.parent_block() is not op.parent_block():
            raise ScheduleInvariantError(
                f"{describe_op(w)} completes {describe_op(op)} from another block; a start and its wait "
                "must stay in one block", w)


class _Numbering:
    """Structural value numbers (see the module docstring, check 3)."""

    def __init__(self) -> None:
        self.ids: dict[tuple, int] = {}

    def intern(self, key: tuple) -> int:
        n = self.ids.get(key)
        if n is None:
            n = self.ids[key] = len(self.ids)
        return n

    @staticmethod
    def op_key(op: Operation) -> tuple:
        props = {k: str(v) for k, v in op.properties.items()}
        if isinstance(op, dist.CollectiveOp):
            props["reduction"] = _reduction(op)  # a default property may or may not be spelled out
        return (op.name, tuple(sorted(props.items())))

    def of(self, num: dict[SSAValue, int], op: Operation) -> int:
        """The number of ``op``'s first result (of the op itself if it has none)."""
        if op.results:
            return num[op.results[0]]
        return self.intern(("noresult",) + self.op_key(op) + (tuple(num.get(v, -1) for v in op.operands),))

    def number_function(self, fn: func.FuncOp) -> dict[SSAValue, int]:
        num: dict[SSAValue, int] = {}
        for i, a in enumerate(fn.body.block.args):
            num[a] = self.intern(("arg", i))
        for op in fn.walk():
            if op is fn:
                continue
            if isinstance(op, dist.WaitOp):
                if op.result is not None:
                    num[op.result] = num.get(op.future, self.intern(("?", id(op.future))))
                continue
            if op.regions:
                for region in op.regions:
                    for b in region.blocks:
                        for j, a in enumerate(b.args):
                            num[a] = self.intern(("blockarg", self.op_key(op), j))
            key = self.op_key(op) + (tuple(num.get(v, self.intern(("?", id(v)))) for v in op.operands),)
            for r in op.results:
                num[r] = self.intern(key + (r.index,))
        return num


def _signature(fn: func.FuncOp) -> tuple:
    return tuple(str(a.type) for a in fn.body.block.args)


def _data_ops(fn: func.FuncOp) -> list[Operation]:
    """Ops whose values matter for dependencies: everything except waits and the function itself."""
    return [op for op in fn.walk() if op is not fn and not isinstance(op, dist.WaitOp)]


def _identity(op: Operation) -> tuple:
    """An op's identity independent of its operands and position: name, properties, location."""
    return _Numbering.op_key(op) + (_location(op),)


def _occurrence_keys(ops: Iterable[Operation]) -> dict[Operation, tuple]:
    seen: Counter = Counter()
    out = {}
    for op in ops:
        k = _identity(op)
        out[op] = k + (seen[k],)
        seen[k] += 1
    return out


def _check_dataflow_exact(before: ModuleOp, after: ModuleOp) -> None:
    bf, af = _functions(before), _functions(after)
    for name in af:
        if name not in bf or _signature(bf[name]) != _signature(af[name]):
            continue
        numbering = _Numbering()
        nb = numbering.number_function(bf[name])
        na = numbering.number_function(af[name])
        b_ops, a_ops = _data_ops(bf[name]), _data_ops(af[name])
        have = Counter(numbering.of(nb, op) for op in b_ops)
        b_by_key = _occurrence_keys(b_ops)
        b_lookup = {k: op for op, k in b_by_key.items()}
        a_keys = _occurrence_keys(a_ops)
        for op in a_ops:
            n = numbering.of(na, op)
            if have[n] > 0:
                have[n] -= 1
                continue
            raise ScheduleInvariantError(_rewired_message(op, b_lookup.get(a_keys[op]), nb, na), op)
        missing = [op for op in b_ops if have[numbering.of(nb, op)] > 0]
        if missing:
            raise ScheduleInvariantError(
                f"{describe_op(missing[0])} of the input is gone from @{name} after the pass "
                "(a scheduling pass must keep every op)", missing[0])


def _rewired_message(op: Operation, old: Operation | None, nb: dict, na: dict) -> str:
    if old is None:
        return (f"{describe_op(op)} computes a value the input did not (no op with its name, properties and "
                "operands existed before the pass)")
    for i, (vo, vn) in enumerate(zip(old.operands, op.operands)):
        if nb.get(vo) != na.get(vn):
            return (f"{describe_op(op)} breaks a data dependency: operand #{i} came from "
                    f"{_describe_value(vo)} in the input and now comes from {_describe_value(vn)}")
    if len(old.operands) != len(op.operands):
        return f"{describe_op(op)} now has {len(op.operands)} operands; the input had {len(old.operands)}"
    return f"{describe_op(op)} depends on different values than in the input"


def _origins(fn: func.FuncOp, matched: set[Operation], keys: dict[Operation, tuple]) -> dict[SSAValue, frozenset]:
    """For each value: the matched ops and function arguments it depends on, looking through the rest."""
    org: dict[SSAValue, frozenset] = {}
    for i, a in enumerate(fn.body.block.args):
        org[a] = frozenset({("arg", i)})
    for op in fn.walk():
        if op is fn:
            continue
        for region in op.regions:
            for b in region.blocks:
                for a in b.args:
                    org[a] = frozenset()
        if op in matched:
            for r in op.results:
                org[r] = frozenset({keys[op] + (r.index,)})
        else:
            through = frozenset().union(*(org.get(v, frozenset()) for v in op.operands)) if op.operands else frozenset()
            for r in op.results:
                org[r] = through
    return org


def _check_dataflow_bucketed(before: ModuleOp, after: ModuleOp) -> None:
    bf, af = _functions(before), _functions(after)
    for name in af:
        if name not in bf or _signature(bf[name]) != _signature(af[name]):
            continue
        b_aten = [op for op in bf[name].walk() if isinstance(op, AtenOp)]
        a_aten = [op for op in af[name].walk() if isinstance(op, AtenOp)]
        bk, ak = _occurrence_keys(b_aten), _occurrence_keys(a_aten)
        common = set(bk.values()) & set(ak.values())
        b_matched = {op for op, k in bk.items() if k in common}
        a_matched = {op for op, k in ak.items() if k in common}
        ob = _origins(bf[name], b_matched, bk)
        oa = _origins(af[name], a_matched, ak)
        b_by_key = {k: op for op, k in bk.items()}
        for op in a_aten:
            if op not in a_matched:
                continue
            old = b_by_key[ak[op]]
            for i, (vo, vn) in enumerate(zip(old.operands, op.operands)):
                lost = ob.get(vo, frozenset()) - oa.get(vn, frozenset())
                if lost:
                    k = sorted(lost, key=str)[0]
                    src = (f"argument #{k[1]} of @{name}" if k[0] == "arg" else
                           describe_op(next(o for o, kk in bk.items() if kk == k[:-1])))
                    raise ScheduleInvariantError(
                        f"{describe_op(op)} breaks a data dependency: operand #{i} no longer depends on {src}, "
                        "which it did in the input", op)


def _check_p2p_order(before: ModuleOp, after: ModuleOp) -> None:
    def channels(module: ModuleOp) -> dict[tuple, list[tuple]]:
        out: dict[tuple, list[tuple]] = defaultdict(list)
        for name, fn in _functions(module).items():
            for op in fn.walk():
                if isinstance(op, dist.SendOp | dist.RecvOp):
                    ch = (name, op.name, op.grid.string_value(), op.axes(), op.offset.value.data, op.tag.value.data)
                    v = op.input if isinstance(op, dist.SendOp) else op.result
                    out[ch].append((_bytes_dtype(v.type), op))
        return out

    cb, ca = channels(before), channels(after)
    for ch, seq in ca.items():
        old = [s for s, _ in cb.get(ch, [])]
        new = [s for s, _ in seq]
        if old != new and sorted(old) == sorted(new):
            i = next(j for j, (x, y) in enumerate(zip(old, new)) if x != y)
            raise ScheduleInvariantError(
                f"{describe_op(seq[i][1])} breaks a control dependency: sends and recvs on one channel "
                f"({ch[1]} along axis {list(ch[3])} of @{ch[2]}, offset {ch[4]}, tag {ch[5]}) match by order, "
                f"and this one moved from position {old.index(new[i])} to {i}", seq[i][1])


def _fmt_key(key: tuple, bucketed: bool) -> str:
    epoch, kind, grid, axes = key[:4]
    rest = key[4:]
    text = f"'{kind}' on @{grid} grid_axes = {list(axes)}"
    if kind in ("dist.send", "dist.recv"):
        (nbytes, dtype, offset, tag) = rest
        text += f" of {nbytes} bytes ({dtype}), offset {offset}, tag {tag}"
    elif kind != "dist.barrier":
        red = f", reduction {rest[-1]}" if rest[-1] != "-" else ""
        if bucketed:
            text += f" ({rest[0]}{red})"
        else:
            text += f" of {rest[0]} bytes ({rest[1]}{red})"
    return text + (f" after {epoch} barrier(s)" if epoch else "")


def _check_comm(before: ModuleOp, after: ModuleOp, bucketed: bool) -> None:
    cb, eb = _comm_census(before, bucketed)
    ca, ea = _comm_census(after, bucketed)
    for key in sorted(set(cb) | set(ca), key=str):
        if cb[key] == ca[key]:
            continue
        b_coll = bucketed and key[1] in {c.name for c in dist.COLLECTIVE_OPS}
        unit = " bytes in all" if b_coll else " per step"
        op = ea.get(key) or eb.get(key)
        side = "after the pass" if key in ea else "in the input"
        raise ScheduleInvariantError(
            f"communication changed: {_fmt_key(key, bucketed)}: {cb[key]}{unit} before the pass, "
            f"{ca[key]}{unit} after (weighted by the schedule's repeat counts); e.g. {side}: {describe_op(op)}",
            op)


def _check_flops(before: ModuleOp, after: ModuleOp) -> None:
    fb, per_b = _flops(before)
    fa, per_a = _flops(after)
    if fa == fb:
        return
    culprit = None
    for name in sorted(set(per_a) | set(per_b)):
        if per_a.get(name, 0) != per_b.get(name, 0):
            culprit = name
            break
    op = None
    if culprit is not None and culprit in _functions(after) and culprit in _functions(before):
        from flint.passes.annotate_cost import aten_op_work

        b_ops = Counter(k[:-1] for op_, k in _occurrence_keys(
            o for o in _functions(before)[culprit].walk() if isinstance(o, AtenOp)).items())
        for o, k in _occurrence_keys(o for o in _functions(after)[culprit].walk() if isinstance(o, AtenOp)).items():
            if b_ops[k[:-1]] > 0:
                b_ops[k[:-1]] -= 1
            elif aten_op_work(o).flops:
                op = o
                break
    detail = f" (@{culprit}: {per_b.get(culprit, 0)} FLOPs per run before, {per_a.get(culprit, 0)} after)" if culprit else ""
    first = f"; e.g. {describe_op(op)} is new" if op is not None else ""
    raise ScheduleInvariantError(
        f"FLOPs changed: {fb} per step before the pass, {fa} after{detail}{first}", op)


def check_schedule_invariants(before: ModuleOp, after: ModuleOp, *, same_bytes_per_group: bool = False) -> None:
    """Raise :class:`ScheduleInvariantError` unless ``after`` is a valid rescheduling of ``before``.

    See the module docstring for the checks. ``same_bytes_per_group`` allows
    collectives to be fused or split (bucketing) as long as the total input
    bytes per (kind, grid, axes, dtype, reduction) stays the same.
    """
    _check_ssa_order(after)
    _check_waits(after)
    _check_verifies(after)
    _check_comm(before, after, same_bytes_per_group)
    _check_flops(before, after)
    _check_p2p_order(before, after)
    if same_bytes_per_group:
        _check_dataflow_bucketed(before, after)
    else:
        _check_dataflow_exact(before, after)
