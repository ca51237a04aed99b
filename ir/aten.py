"""The `aten` dialect: compute ops exactly as PyTorch's compiler captured them.

One op, ``aten.op``, stands for one ATen call of the captured FX graph:

    %2 = aten.op "aten.mm.default"(%0, %1) phase = fwd module = "layers.0.attn.wq"
           : (tensor<8x16xbf16>, tensor<16x32xbf16>) -> tensor<8x32xbf16>

- ``target``: the ATen overload, as ``torch.ops`` spells it
  (``<namespace>.<op>.<overload>``), e.g. ``aten.mm.default``.
- operands: the tensor arguments, in call order (tensor lists flattened);
  results: the tensor results with full types (shape and dtype).
- ``args``: the non-tensor arguments (ints, floats, bools, int lists,
  dtypes as strings), keyed by their ATen schema name.
- ``phase``: ``fwd``, ``bwd`` or ``optim``, when known.
- ``module``: the ``nn.Module`` path the call came from (``layers.0.attn``).
- the op's location: the user's source line (``loc("model.py":42:0)``).

The op has no side effects on its operands: captured graphs are functional.
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

from xdsl.dialects.builtin import DictionaryAttr, StringAttr, TensorType
from xdsl.ir import Attribute, Dialect, SSAValue
from xdsl.irdl import (
    IRDLOperation,
    irdl_op_definition,
    opt_prop_def,
    prop_def,
    var_operand_def,
    var_result_def,
)
from xdsl.utils.exceptions import VerifyException

PHASES = ("fwd", "bwd", "optim")
_TARGET = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*$")


@irdl_op_definition
class AtenOp(IRDLOperation):
    """One ATen call of a captured program (see the module docstring)."""

    name = "aten.op"

    target = prop_def(StringAttr)
    args = opt_prop_def(DictionaryAttr)
    phase = opt_prop_def(StringAttr)
    module = opt_prop_def(StringAttr)

    inputs = var_operand_def(TensorType)
    outputs = var_result_def(TensorType)

    assembly_format = (
        "$target `(` $inputs `)` (`phase` `=` $phase^)? (`module` `=` $module^)? (`args` `=` $args^)? "
        "attr-dict `:` functional-type($inputs, $outputs)"
    )

    def __init__(
        self,
        target: str,
        inputs: Sequence[SSAValue],
        result_types: Sequence[Attribute],
        *,
        args: Mapping[str, Attribute] | None = None,
        phase: str | None = None,
        module: str | None = None,
    ):
        props: dict[str, Attribute] = {"target": StringAttr(target)}
        if args:
            props["args"] = DictionaryAttr(dict(args))
        if phase is not None:
            props["phase"] = StringAttr(phase)
        if module is not None:
            props["module"] = StringAttr(module)
        super().__init__(operands=[list(inputs)], result_types=[list(result_types)], properties=props)

    @property
    def overload(self) -> str:
        return self.target.data

    def verify_(self) -> None:
        if not _TARGET.match(self.target.data):
            raise VerifyException(
                f"'aten.op' op target \"{self.target.data}\" is not an overload name of the form "
                "namespace.op.overload (e.g. \"aten.mm.default\")"
            )
        if self.phase is not None and self.phase.data not in PHASES:
            raise VerifyException(
                f"'aten.op' op phase \"{self.phase.data}\" is not one of {', '.join(PHASES)}"
            )
        from flint.ir.dist import verify_static_tensor

        for i, v in enumerate(self.inputs):
            verify_static_tensor(self, v.type, f"operand {i}")
        for i, v in enumerate(self.outputs):
            verify_static_tensor(self, v.type, f"result {i}")
        check = _SHAPE_RULES.get(self.target.data)
        if check is not None:
            check(self)


def _shapes(op: AtenOp) -> tuple[list[list[int]], list[list[int]]]:
    return ([list(v.type.get_shape()) for v in op.inputs], [list(v.type.get_shape()) for v in op.outputs])


def _matmul_rule(batched: bool, bias: bool):
    """Shape rule of mm / bmm / addmm / baddbmm: [.., m, k] x [.., k, n] -> [.., m, n]."""
    rank = 3 if batched else 2
    first = 1 if bias else 0

    def check(op: AtenOp) -> None:
        ins, outs = _shapes(op)
        name = op.target.data
        if len(ins) < first + 2 or len(outs) != 1:
            raise VerifyException(f"'aten.op' op {name} takes {first + 2} tensor operands and gives 1 result, "
                                  f"got {len(ins)} and {len(outs)}")
        a, b, out = ins[first], ins[first + 1], outs[0]
        if len(a) != rank or len(b) != rank or len(out) != rank:
            raise VerifyException(f"'aten.op' op {name} needs rank-{rank} operands and result, got {a}, {b} -> {out}")
        if a[-1] != b[-2]:
            raise VerifyException(f"'aten.op' op {name} inner dimensions differ: {a} x {b} ({a[-1]} != {b[-2]})")
        want = ([a[0]] if batched else []) + [a[-2], b[-1]]
        if batched and a[0] != b[0]:
            raise VerifyException(f"'aten.op' op {name} batch dimensions differ: {a} x {b}")
        if out != want:
            raise VerifyException(f"'aten.op' op {name} result shape {out} does not match {want} for {a} x {b}")

    return check


_SHAPE_RULES = {
    "aten.mm.default": _matmul_rule(False, False),
    "aten.addmm.default": _matmul_rule(False, True),
    "aten.bmm.default": _matmul_rule(True, False),
    "aten.baddbmm.default": _matmul_rule(True, True),
}


Aten = Dialect("aten", [AtenOp], [])


# -- the step's structure -------------------------------------------------------
# A captured training step is a module of `func.func`s, one per distinct part
# (embedding forward, ONE transformer block forward, ..., optimizer). The
# module attribute `flint.schedule` says in which order they run and how many
# times each repeats, so a 126-layer model stays one block body:
#
#   builtin.module attributes {flint.schedule = [["pre_fwd", 1], ["block_fwd", 126], ...]}
#
# Without the attribute, every `func.func` runs once, in module order.
#
# Function arguments carry their role as the arg attribute `flint.role`
# (the capture's Role.kind: parameter, buffer, input, activation, saved,
# tangent, gradient, master, exp_avg, exp_avg_sq, step, grad_norm, clip_coef); a parameter with
# requires_grad=False is also marked `flint.frozen` (no gradient: passes.lower_to_chakra.frozen_args).
# lower-to-chakra treats parameter / buffer / input / optimizer-state arguments as ready when the
# step starts and every other argument as produced by the previous part.

SCHEDULE_ATTR = "flint.schedule"
# Gradient-norm clipping (plan field max_norm): after the backward, every part's `<part>_norm` (its gradients'
# norms, folded into the running total: argument role grad_norm) and then this function (the total's all-reduces
# and the scaling coefficient, which each `<part>_optim` takes as its clip_coef argument).
CLIP_FUNCTION = "grad_clip"
# After `pipeline-split`: one schedule per pipeline rank (the distinct rank roles along
# the pipeline axis), entries ``[function, count]`` or ``[function, count, {tag, nosync}]``
# (``tag``: added to the function's send/recv tags; ``nosync``: data-parallel axes whose
# gradient reduce-scatters / all-reduces this run skips, gradient accumulation), and
# the pipeline's description (axis, ranks, stages, schedule, microbatches, ...).
STAGE_SCHEDULES_ATTR = "flint.stage_schedules"
PIPELINE_ATTR = "flint.pipeline"


def op_tensor_lists(op: "AtenOp") -> list:
    """The tensor lists of multi-tensor ``op`` (:func:`flint.cost.flops.tensor_lists`: each list's schema name,
    first operand, length and whether the op writes it), from its ``list_sizes`` argument."""
    from xdsl.dialects.builtin import ArrayAttr, IntegerAttr

    from flint.cost.flops import LIST_SIZES, tensor_lists

    attr = op.args.data.get(LIST_SIZES) if op.args is not None else None
    sizes = [a.value.data for a in attr.data if isinstance(a, IntegerAttr)] if isinstance(attr, ArrayAttr) else None
    return tensor_lists(op.overload, {LIST_SIZES: sizes})


def optimizer_form_of(module) -> str | None:
    """The form of torch's AdamW (plan field ``optimizer_impl``) the program's optimizer-phase ops run
    (:func:`flint.cost.flops.optimizer_form`); None without an optimizer."""
    from flint.cost.flops import optimizer_form

    return optimizer_form(op.overload.split(".")[1] for op in module.walk()
                          if isinstance(op, AtenOp) and op.phase is not None and op.phase.data == "optim")


def set_schedule(module, parts: Sequence[tuple[str, int]]) -> None:
    """Record the run order ``[(function name, repeat count), ...]`` on ``module``."""
    from xdsl.dialects.builtin import ArrayAttr, IntegerAttr, i64

    module.attributes[SCHEDULE_ATTR] = ArrayAttr(
        [ArrayAttr([StringAttr(name), IntegerAttr(int(count), i64)]) for name, count in parts]
    )


def get_schedule(module, role: int = 0) -> list[tuple[str, int]]:
    """The run order of ``module``'s functions (see :func:`set_schedule`).

    A pipelined module (``flint.stage_schedules``) has one per pipeline rank:
    ``role`` picks it (default the first).
    """
    return [(name, count) for name, count, _ in get_schedule_entries(module, role)]


def stage_roles(module) -> int:
    """How many distinct schedules (pipeline ranks) the module has: 1 unless pipelined."""
    attr = module.attributes.get(STAGE_SCHEDULES_ATTR)
    return 1 if attr is None else len(attr.data)


def get_schedule_entries(module, role: int = 0) -> list[tuple[str, int, dict]]:
    """:func:`get_schedule` with each entry's options (``tag``: int, ``nosync``: tuple of axis names whose
    gradient reduce-scatters / all-reduces the entry skips, ``nogather``: whose all-gathers it skips,
    ``wait``: tuple of tags: the asynchronous recvs posted by earlier entries with those tags that this
    entry's first compute waits for).

    Raises ``VerifyException`` when the attribute is malformed: not a list of
    ``["function", count]`` (or ``["function", count, {options}]``) entries,
    empty, naming a function the module lacks, or a count outside
    1..:data:`flint.limits.MAX_REPEAT`.
    """
    from xdsl.dialects import func
    from xdsl.dialects.builtin import ArrayAttr, DictionaryAttr, IntegerAttr
    from xdsl.utils.exceptions import VerifyException

    from flint.limits import MAX_REPEAT, fmt

    funcs = [op.sym_name.data for op in module.ops if isinstance(op, func.FuncOp)]
    attr = module.attributes.get(SCHEDULE_ATTR)
    staged = module.attributes.get(STAGE_SCHEDULES_ATTR)
    if staged is not None:
        if not isinstance(staged, ArrayAttr) or not staged.data:
            raise VerifyException(f"module attribute {STAGE_SCHEDULES_ATTR} must be a non-empty list of schedules")
        if not 0 <= role < len(staged.data):
            raise VerifyException(f"module attribute {STAGE_SCHEDULES_ATTR} has {len(staged.data)} roles, not {role + 1}")
        attr = staged.data[role]
    if attr is None:
        return [(name, 1, {}) for name in funcs]
    if not isinstance(attr, ArrayAttr):
        raise VerifyException(f"module attribute {SCHEDULE_ATTR} must be a list of [\"function\", count] pairs, got {attr}")
    if not attr.data:
        raise VerifyException(f"module attribute {SCHEDULE_ATTR} is empty: the step would run no function "
                              "(drop the attribute to run every function once, in module order)")
    parts = []
    for entry in attr.data:
        ok = (isinstance(entry, ArrayAttr) and len(entry.data) in (2, 3) and isinstance(entry.data[0], StringAttr)
              and isinstance(entry.data[1], IntegerAttr)
              and (len(entry.data) == 2 or isinstance(entry.data[2], DictionaryAttr)))
        if not ok:
            raise VerifyException(f"module attribute {SCHEDULE_ATTR} entry {entry} is not [\"function\", count]")
        name, count = entry.data[0].data, entry.data[1].value.data
        if name not in funcs:
            raise VerifyException(f"module attribute {SCHEDULE_ATTR} names function @{name}, which the module lacks")
        if count < 1:
            raise VerifyException(f"module attribute {SCHEDULE_ATTR} repeats @{name} {count} times; need at least 1")
        if count > MAX_REPEAT:
            raise VerifyException(f"module attribute {SCHEDULE_ATTR} repeats @{name} {fmt(count)} times; "
                                  f"the limit is {fmt(MAX_REPEAT)}")
        options = {}
        if len(entry.data) == 3:
            for key, value in entry.data[2].data.items():
                if key in ("tag", "post") and isinstance(value, IntegerAttr):
                    options[key] = value.value.data
                elif key in ("nosync", "nogather") and isinstance(value, ArrayAttr) and \
                        all(isinstance(a, StringAttr) for a in value.data):
                    options[key] = tuple(a.data for a in value.data)
                elif key == "wait" and isinstance(value, ArrayAttr) and all(isinstance(a, IntegerAttr) for a in value.data):
                    options[key] = tuple(a.value.data for a in value.data)
                else:
                    raise VerifyException(f"module attribute {SCHEDULE_ATTR} entry for @{name}: option {key} = {value} "
                                          "is not tag (integer), nosync or nogather (list of axis names), wait (list of tags) "
                                          "or post (integer: 1 issues a recv after the compute before it)")
        parts.append((name, count, options))
    return parts
    return parts
