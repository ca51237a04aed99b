"""Split a captured backward function into its input-gradient (I) and weight-gradient (W) parts.

The zero-bubble schedules of ``torch.distributed.pipelining``
(``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``) run a stage's
backward in two actions: ``I`` (``BACKWARD_INPUT``) computes the gradient of
the stage input only, so it can be sent to the previous stage at once, and
``W`` (``BACKWARD_WEIGHT``) computes the parameter gradients later, in what
would otherwise be a bubble. torch does it on the autograd graph
(``torch/distributed/pipelining/_backward.py``): ``stage_backward_input``
runs ``autograd.grad`` towards the stage inputs only and keeps, at every
autograd node where a parameter's branch meets the input's closure, the
gradient flowing into it; ``stage_backward_weight`` later runs
``autograd.grad`` from those saved gradients to the parameters. An autograd
node computes only the outputs its caller needs, so at the level of ATen ops
the input part is exactly the backward slice of the input gradient, and the
weight part everything else (``mm`` for ``dW`` after the ``mm`` for ``dX``),
reading the intermediate gradients the input part left behind.

:func:`split_backward` does the same on a captured ``_bwd`` function:

- ``<stem>_bwd_input`` has the backward's arguments unchanged (AOTAutograd's
  ``saved + tangents``) and holds the ops the input gradients need (with any
  collective they need, e.g. a tensor-parallel all-reduce, or an FSDP
  re-gather of a weight). It returns the input gradients, then every value the
  weight part needs that is not resident state (intermediate gradients, saved
  activations and tangents it reads), in first-use order.
- ``<stem>_bwd_weight`` takes those values (``flint.role = "saved"``) then the
  resident arguments it reads (parameters, buffers: their roles kept), holds
  every other op in the original order (parameter-gradient ops, their
  reduce-scatters / all-reduces, ops nothing reads) and returns the parameter
  gradients.

Every op of the backward lands in exactly one part, so FLOPs, bytes and
collectives of I + W equal the backward's. Both functions carry
``flint.backward_part`` (``"input"`` / ``"weight"``) and ``flint.backward_of``
(the function they came from). Caveat against torch: an ATen op that returns
the input and the weight gradient together (``native_layer_norm_backward``
with ``output_mask`` all true) stays whole in the input part; torch's ``W``
reruns such an autograd node for the weight outputs (masked), which moves some
of its cost from I to W. Llama's RMSNorm decomposes into elementwise ops and
has no such op.
"""

from __future__ import annotations

from xdsl.dialects import func
from xdsl.dialects.builtin import ArrayAttr, DictionaryAttr, StringAttr
from xdsl.ir import Operation, SSAValue
from xdsl.utils.exceptions import VerifyException

from flint.passes.lower_to_chakra import RESIDENT_ROLES, ROLE_ATTR, frozen_args

PART_ATTR = "flint.backward_part"
OF_ATTR = "flint.backward_of"
INPUT, WEIGHT = "input", "weight"


def _roles(fn: func.FuncOp) -> list[str | None]:
    attrs = fn.arg_attrs.data if fn.arg_attrs is not None else ()
    out = []
    for i in range(len(fn.body.block.args)):
        role = attrs[i].data.get(ROLE_ATTR) if i < len(attrs) else None
        out.append(role.data if isinstance(role, StringAttr) else None)
    return out


def input_grad_results(fwd: func.FuncOp, bwd: func.FuncOp) -> list[int]:
    """Indices of ``bwd``'s results that are gradients of ``fwd``'s ``activation`` arguments.

    AOTAutograd returns one gradient per forward input that needs one, in the
    forward's argument order (the importer drops the ``None`` ones): results are
    aligned with the forward's parameter / activation arguments by type. If that
    alignment fails, results whose type is an activation argument's type.
    """
    roles = _roles(fwd)
    results = list(bwd.function_type.outputs.data)
    out, k = [], 0
    frozen = frozen_args(fwd)
    for i, (arg, role) in enumerate(zip(fwd.body.block.args, roles)):
        if k < len(results) and role in ("parameter", "activation", None, "unknown") and i not in frozen \
                and results[k] == arg.type:
            if role == "activation":
                out.append(k)
            k += 1
    if k == len(results):
        return out
    act = {a.type for a, r in zip(fwd.body.block.args, roles) if r == "activation"}
    return [i for i, t in enumerate(results) if t in act]


def _input_slice(body_ops: list[Operation], roots: list[SSAValue]) -> set[Operation]:
    """The ops ``roots`` depend on (SSA use-def; a wait brings its collective)."""
    owned = set(body_ops)
    need: set[Operation] = set()
    stack = [v.owner for v in roots if isinstance(v.owner, Operation)]
    while stack:
        op = stack.pop()
        if op in need or op not in owned:
            continue
        need.add(op)
        stack += [v.owner for v in op.operands if isinstance(v.owner, Operation)]
    return need


def split_backward(bwd: func.FuncOp, input_results: list[int], name_input: str | None = None,
                   name_weight: str | None = None) -> tuple[func.FuncOp, func.FuncOp]:
    """``bwd`` as its input part and its weight part (module docstring); ``bwd`` is left unchanged."""
    name = bwd.sym_name.data
    block = bwd.body.block
    ret = block.last_op
    if not isinstance(ret, func.ReturnOp):
        raise VerifyException(f"@{name}: a backward function must end in func.return to be split")
    body_ops = [op for op in block.ops if op is not ret]
    results = list(ret.operands)
    for k in input_results:
        if not 0 <= k < len(results):
            raise VerifyException(f"@{name}: no result #{k} to split on")
    in_ops = _input_slice(body_ops, [results[k] for k in input_results])
    w_ops = [op for op in body_ops if op not in in_ops]
    roles = _roles(bwd)
    resident = {a for a, r in zip(block.args, roles) if r in RESIDENT_ROLES}
    w_results = [v for k, v in enumerate(results) if k not in input_results]

    # Values the weight part reads (or returns) that it does not compute, in first-use order.
    w_set = set(w_ops)
    crossing: dict[SSAValue, None] = {}
    for op in w_ops:
        for v in op.operands:
            if v.owner not in w_set:
                crossing[v] = None
    for v in w_results:
        if v.owner not in w_set:
            crossing[v] = None
    handed = [v for v in crossing if v not in resident]   # from the input part
    kept = [v for v in block.args if v in crossing and v in resident]  # resident: read directly

    # Input part: same arguments; the input-gradient ops; returns grads + hand-over values.
    fi, imap, iops = _clone(bwd, name_input or f"{name}_input")
    bi = fi.body.block
    bi.erase_op(bi.last_op)
    for i in reversed(range(len(body_ops))):
        if body_ops[i] not in in_ops:
            bi.erase_op(iops[i])
    bi.add_op(func.ReturnOp(*([imap[results[k]] for k in input_results] + [imap[v] for v in handed])))
    fi.update_function_type()
    fi.attributes[PART_ATTR] = StringAttr(INPUT)
    fi.attributes[OF_ATTR] = StringAttr(name)

    # Weight part: the hand-over values (role saved) + resident arguments it reads; the other ops.
    fw, wmap, wops = _clone(bwd, name_weight or f"{name}_weight")
    bw = fw.body.block
    n_orig = len(bw.args)
    new_args = []
    for i, v in enumerate(handed):
        arg = bw.insert_arg(v.type, i)
        arg.name_hint = v.name_hint
        wmap[v].replace_all_uses_with(arg)
        new_args.append(arg)
    bw.erase_op(bw.last_op)
    for i in reversed(range(len(body_ops))):
        if body_ops[i] in in_ops:
            bw.erase_op(wops[i])
    bw.add_op(func.ReturnOp(*[new_args[handed.index(v)] if v in handed else wmap[v] for v in w_results]))
    # Drop the original arguments the weight part no longer reads; keep the resident ones it reads.
    attrs = list(bwd.arg_attrs.data) if bwd.arg_attrs is not None else [DictionaryAttr({})] * n_orig
    keep_attrs = []
    for a, orig, at in zip(list(bw.args[len(handed):]), block.args, attrs):
        if orig in kept:
            keep_attrs.append(at)
        else:
            bw.erase_arg(a)
    fw.arg_attrs = ArrayAttr([DictionaryAttr({ROLE_ATTR: StringAttr("saved")}) for _ in handed] + keep_attrs)
    fw.update_function_type()
    fw.attributes[PART_ATTR] = StringAttr(WEIGHT)
    fw.attributes[OF_ATTR] = StringAttr(name)
    return fi, fw


def _clone(orig: func.FuncOp, name: str) -> tuple[func.FuncOp, dict[SSAValue, SSAValue], list[Operation]]:
    """A copy of ``orig`` named ``name``, the map of its values, and its ops (return excluded)."""
    clone = orig.clone()
    clone.sym_name = StringAttr(name)
    m: dict[SSAValue, SSAValue] = dict(zip(orig.body.block.args, clone.body.block.args))
    for a, b in zip(orig.body.block.ops, clone.body.block.ops):
        m.update(zip(a.results, b.results))
    return clone, m, list(clone.body.block.ops)[:-1]
