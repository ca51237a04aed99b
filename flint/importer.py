"""FX -> IR: import a captured training step into Flint's dialects.

Every ``call_function`` of a captured FX graph becomes one op:

- an ATen call (``torch.ops.aten.*`` and other operator namespaces) becomes an
  ``aten.op`` with the overload name, tensor operands (tensor lists
  flattened; a multi-tensor op, ``_foreach_*`` or ``_fused_adamw_``, keeps
  its lists' lengths in ``args`` ``list_sizes``), full result types (none for
  an in-place multi-tensor op, which returns nothing), non-tensor arguments as
  ``args`` keyed by their schema name, the phase, the module path, and the
  user's source line as the op's location;
- a functional collective (``torch.ops._c10d_functional.*``) becomes the
  asynchronous `dist` collective whose grid axes are recovered from its
  process-group name and the mesh; ``wait_tensor`` becomes ``dist.wait``;
- ``operator.getitem`` selects a result and makes no op.

Each captured graph becomes a ``func.func @<part>_<phase>`` whose arguments
carry ``flint.role`` (and ``flint.param`` for parameters); the module gets
the grid (``shard.grid @mesh`` with ``flint.axis_names``), the plan it was
captured under (``flint.plan``, see :func:`flint.plan.attach`), the partitioner
if not the default (``flint.partitioner = "eager"``, :mod:`flint.capture.partition`) and the schedule
(``flint.schedule``): all forward parts in order, then the backward parts in
reverse, then the optimizer parts, each repeated as captured. With gradient-norm
clipping (plan field ``max_norm``) each part's ``<part>_norm`` (its gradients'
norms) runs before the optimizer parts, in forward order, and ``@grad_clip``
(the norm's all-reduces and the scaling coefficient) between them.
"""

from __future__ import annotations

import operator
import os
import re
from typing import Any, Iterable

import torch
from xdsl.dialects import func
from xdsl.dialects.builtin import (
    ArrayAttr,
    ComplexType,
    DenseArrayBase,
    DictionaryAttr,
    FileLineColLoc,
    FloatAttr,
    Float8E4M3FNType,
    Float8E4M3FNUZType,
    Float8E5M2FNUZType,
    Float8E5M2Type,
    IntAttr,
    IntegerAttr,
    IntegerType,
    ModuleOp,
    NameLoc,
    Signedness,
    StringAttr,
    TensorType,
    UnitAttr,
    UnknownLoc,
    f16,
    f32,
    f64,
    bf16,
    i1,
    i64,
)
from xdsl.dialects.shard import GridOp
from xdsl.ir import Attribute, Block, Operation, Region, SSAValue

from flint.capture.step import CapturedGraph, CapturedStep
from flint.chakra.from_ir import AXIS_NAMES_ATTR
from flint.errors import FlintError
from flint.ir import dist
from flint.cost.flops import LIST_SIZES, is_multi_tensor
from flint.ir.aten import CLIP_FUNCTION, AtenOp, set_schedule
from flint.plan import attach
from flint.passes.lower_to_chakra import FROZEN_ATTR, ROLE_ATTR

GRID = "mesh"
PARAM_ATTR = "flint.param"
PARTITIONER_ATTR = "flint.partitioner"

_DTYPES: dict[torch.dtype, Attribute] = {
    torch.float32: f32, torch.float16: f16, torch.bfloat16: bf16, torch.float64: f64,
    torch.int64: i64, torch.int32: IntegerType(32), torch.int16: IntegerType(16), torch.int8: IntegerType(8),
    torch.uint8: IntegerType(8, Signedness.UNSIGNED), torch.bool: i1,
    # float8 (torchao's Float8Linear): MLIR's builtin f8 types, so fp8 GEMMs price at the fp8 peak
    torch.float8_e4m3fn: Float8E4M3FNType(), torch.float8_e5m2: Float8E5M2Type(),
    torch.float8_e4m3fnuz: Float8E4M3FNUZType(), torch.float8_e5m2fnuz: Float8E5M2FNUZType(),
    # complex (Llama 4's rotary embedding: torch.polar, view_as_complex): MLIR's complex<f32> / complex<f64>
    torch.complex64: ComplexType(f32), torch.complex128: ComplexType(f64),
}

_REDUCTIONS = {"sum": "sum", "avg": "average", "max": "max", "min": "min", "product": "product"}


class ImportError_(FlintError):
    """The importer met something it cannot represent; the message names it."""


def tensor_type(t: torch.Tensor, where: str) -> TensorType:
    if t.dtype not in _DTYPES:
        raise ImportError_(f"{where}: tensor dtype {t.dtype} has no IR element type")
    return TensorType(_DTYPES[t.dtype], [int(s) for s in t.shape])


def _user_line(node: torch.fx.Node) -> tuple[str, int] | None:
    """The innermost frame of ``stack_trace`` (the user's model code): not torch's, nor Flint's capture machinery
    (its stand-in for ``scaled_dot_product_attention``, which calls the fused kernel for the model's line)."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace)
    if not frames:
        return None
    torch_dir = torch.__file__.rsplit("/", 1)[0]
    capture_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "capture") + os.sep
    user = [f for f in frames if not f[0].startswith(torch_dir) and not f[0].startswith(capture_dir)]
    file, line = (user or frames)[-1]
    return file, int(line)


def _module_path(node: torch.fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    path = re.sub(r"^L\['self'\]\.?", "", path)
    # Dynamo spells a submodule ._modules['x'] or .__dict__['_modules']['x'] (torch 2.13)
    path = re.sub(r"\.?(?:__dict__\['_modules'\]|_modules)\['([^']+)'\]", r".\1", path)
    path = re.sub(r"(^|\.)module(?=\.|$)", "", path).strip(".")
    return path or None


def _where(node: torch.fx.Node) -> str:
    line = _user_line(node)
    return f"node '{node.name}' ({node.target})" + (f" from {line[0]}:{line[1]}" if line else "")


def _location(node: torch.fx.Node) -> Attribute:
    line = _user_line(node)
    return FileLineColLoc(StringAttr(line[0]), IntAttr(line[1]), IntAttr(0)) if line else UnknownLoc()


def _attr(value: Any, where: str) -> Attribute | None:
    """A non-tensor argument as an attribute (None for "absent")."""
    if value is None:
        return None
    if isinstance(value, bool):
        return IntegerAttr(int(value), i1)
    if isinstance(value, int):
        return IntegerAttr(value, i64)
    if isinstance(value, float):
        return FloatAttr(value, f64)
    if isinstance(value, str):
        return StringAttr(value)
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return StringAttr(str(value))
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        raise ImportError_(f"{where}: symbolic size {value} (capture with static shapes)")
    if isinstance(value, (list, tuple)):
        items = [_attr(v, where) for v in value]
        return ArrayAttr([i if i is not None else StringAttr("None") for i in items])
    raise ImportError_(f"{where}: argument {value!r} of type {type(value).__name__} has no IR form")


#: a constant tensor in a captured graph (see :meth:`_GraphImporter.constant`)
CONSTANT_ATTR = "flint.constant"
CONSTANT_LIMIT = 65536  # elements: constants from Python data are small; a large one is a model's tensor


class _GraphImporter:
    def __init__(self, step: CapturedStep, graph: CapturedGraph, fn_name: str):
        self.step, self.graph, self.fn_name = step, graph, fn_name
        self.values: dict[torch.fx.Node, Any] = {}  # node -> SSAValue | list[SSAValue] | python value
        self.ops: list[Operation] = []

    def _val(self, node: torch.fx.Node) -> Any:
        return node.meta.get("val")

    def operand(self, arg: Any, where: str) -> SSAValue:
        v = self.values.get(arg)
        if not isinstance(v, SSAValue):
            raise ImportError_(f"{where}: argument '{arg}' is not a tensor value")
        return v

    def build(self) -> func.FuncOp:
        gm = self.graph.gm
        arg_types, arg_attrs, placeholders = [], [], []
        for n in gm.graph.nodes:
            if n.op != "placeholder":
                continue
            val = self._val(n)
            if not isinstance(val, torch.Tensor):
                self.values[n] = val  # e.g. the process-group script object: not data
                continue
            role = self.graph.roles.get(n.name)
            attrs: dict[str, Attribute] = {ROLE_ATTR: StringAttr(role.kind if role else "unknown")}
            if role is not None and role.param:
                attrs[PARAM_ATTR] = StringAttr(role.param)
            if role is not None and role.frozen:
                attrs[FROZEN_ATTR] = UnitAttr()
            arg_types.append(tensor_type(val, f"{self.fn_name} placeholder '{n.name}'"))
            arg_attrs.append(DictionaryAttr(attrs))
            placeholders.append(n)
        block = Block(arg_types=arg_types)
        for n, a in zip(placeholders, block.args):
            a.name_hint = n.name
            self.values[n] = a
        results: list[SSAValue] = []
        for n in gm.graph.nodes:
            if n.op == "call_function":
                self.call(n)
            elif n.op == "output":
                results = [self.operand(a, f"{self.fn_name} output") for a in _flatten(n.args[0]) if a is not None
                           and isinstance(self.values.get(a), SSAValue)]
            elif n.op == "get_attr":
                self.constant(n)
            elif n.op != "placeholder":
                raise ImportError_(f"{self.fn_name}: FX node '{n.name}' of kind '{n.op}' is not supported")
        block.add_ops(self.ops)
        block.add_op(func.ReturnOp(*results))
        fn = func.FuncOp(self.fn_name, (arg_types, [r.type for r in results]), Region(block),
                         arg_attrs=ArrayAttr(arg_attrs))
        return fn

    def constant(self, n: torch.fx.Node) -> None:
        """A constant tensor the forward built from Python data (``torch.tensor([...])``, a list index): an
        ``aten.empty`` of its shape marked ``flint.constant`` (its values do not matter to the cost; in a real
        run it is a small host-to-device copy, priced as one memory op)."""
        val = self._val(n)
        where = f"{self.fn_name}: FX get_attr '{n.target}'"
        if not isinstance(val, torch.Tensor):
            raise ImportError_(f"{where} is not a tensor constant")
        if val.numel() > CONSTANT_LIMIT:
            raise ImportError_(f"{where}: a constant tensor of {val.numel():,} elements; Flint imports the small "
                               f"constants a forward builds from Python data (at most {CONSTANT_LIMIT:,} elements): "
                               "register a larger tensor as a buffer or pass it as an input")
        op = AtenOp("aten.empty.memory_format", [], [tensor_type(val, where)],
                    args={"size": ArrayAttr([IntegerAttr(int(d), i64) for d in val.shape])},
                    phase=self.graph.phase, module=_module_path(n))
        op.attributes[CONSTANT_ATTR] = StringAttr(str(n.target))
        op.location = _location(n)
        self.ops.append(op)
        self.values[n] = op.outputs[0]

    def call(self, n: torch.fx.Node) -> None:
        target = n.target
        where = f"{self.fn_name}: {_where(n)}"
        if target is operator.getitem:
            src, idx = n.args
            self.values[n] = self.values[src][idx]
            return
        if not isinstance(target, torch._ops.OpOverload):
            raise ImportError_(f"{where}: the importer does not know op '{target}' (not an ATen overload)")
        ns = target.namespace
        if ns == "_c10d_functional":
            return self.collective(n, target, where)
        self.aten(n, target, where)

    def aten(self, n: torch.fx.Node, target: torch._ops.OpOverload, where: str) -> None:
        schema = target._schema
        operands: list[SSAValue] = []
        args: dict[str, Attribute] = {}
        bound = list(zip(schema.arguments, n.args)) + [
            (next(a for a in schema.arguments if a.name == k), v) for k, v in n.kwargs.items()]
        lists: list[int] = []  # a multi-tensor op's tensor-list lengths, for its launches (flint.cost.flops)
        for sarg, value in bound:
            nodes = [v for v in _flatten(value) if isinstance(v, torch.fx.Node)]
            if isinstance(value, (list, tuple)) and is_multi_tensor(target._opname) and \
                    isinstance(sarg.type, torch.ListType) and isinstance(sarg.type.getElementType(), torch.TensorType):
                lists.append(len(nodes))
            if nodes and all(isinstance(self.values.get(v), SSAValue) for v in nodes):
                operands += [self.values[v] for v in nodes]
                continue
            value = torch.fx.node.map_arg(value, lambda a: self.values.get(a))
            attr = _attr(value, where)
            if attr is not None:
                args[sarg.name] = attr
        if lists:
            args[LIST_SIZES] = ArrayAttr([IntegerAttr(k, i64) for k in lists])
        val = self._val(n)
        outs = [v for v in _flatten(val)] if isinstance(val, (list, tuple)) else [val]
        # An op may skip some results (convolution_backward's grad_input when the input needs
        # no gradient: None); the op keeps only the tensor results, and getitem maps to them.
        # An in-place op over tensor lists (``_foreach_mul_``, ``_fused_adamw_``) returns nothing: it writes its
        # operands, and the op has no results.
        if not any(isinstance(t, torch.Tensor) for t in outs) and (val is not None or schema.returns):
            raise ImportError_(f"{where}: result {val!r} has no tensor")
        bad = [t for t in outs if t is not None and not isinstance(t, torch.Tensor)]
        if bad:
            raise ImportError_(f"{where}: result {bad[0]!r} is not a tensor")
        result_types = [tensor_type(t, where) for t in outs if t is not None]
        op = AtenOp(f"{target.namespace}.{target._opname}.{target._overloadname}", operands, result_types,
                    args=args, phase=self.graph.phase, module=_module_path(n))
        op.location = _location(n)
        self.ops.append(op)
        if val is None:
            self.values[n] = None
        elif isinstance(val, (list, tuple)):
            it = iter(op.outputs)
            self.values[n] = [next(it) if t is not None else None for t in outs]
        else:
            self.values[n] = op.outputs[0]

    def collective(self, n: torch.fx.Node, target: torch._ops.OpOverload, where: str) -> None:
        name = target._opname
        if name == "wait_tensor":
            fut = self.values.get(n.args[0])
            if not isinstance(fut, SSAValue) or not isinstance(fut.type, dist.FutureType):
                raise ImportError_(f"{where}: wait_tensor on a value no collective started")
            op = dist.WaitOp(fut)
        else:
            kwargs = dict(zip([a.name for a in target._schema.arguments], n.args))
            kwargs.update(n.kwargs)
            group = str(kwargs.get("group_name"))
            axes = self.step.group_axes.get(group)
            if axes is None:
                raise ImportError_(f"{where}: process group '{group}' is not a group of the mesh "
                                   f"(known: {sorted(self.step.group_axes)})")
            inp = self.operand(kwargs.get("input", n.args[0]), where)
            out_t = dist.FutureType(tensor_type(self._val(n), where))
            reduce_op = kwargs.get("reduce_op") or kwargs.get("reduceOp")
            red = _REDUCTIONS.get(str(reduce_op).lower()) if reduce_op is not None else None
            if reduce_op is not None and red is None:
                raise ImportError_(f"{where}: reduction '{reduce_op}' has no dist form")
            if name == "all_gather_into_tensor":
                op = dist.AllGatherOp(inp, GRID, axes, out_t, gather_dim=0)
            elif name == "reduce_scatter_tensor":
                op = dist.ReduceScatterOp(inp, GRID, axes, out_t, reduction=red, scatter_dim=0)
            elif name == "all_reduce":
                op = dist.AllReduceOp(inp, GRID, axes, out_t, reduction=red)
            elif name == "all_to_all_single":
                splits = [kwargs.get("output_split_sizes"), kwargs.get("input_split_sizes")]
                if any(s is not None and len(set(s)) > 1 for s in splits):
                    raise ImportError_(f"{where}: all_to_all_single with uneven splits {splits} has no dist form")
                op = dist.AllToAllOp(inp, GRID, axes, out_t, split_dim=0, concat_dim=0)
            elif name == "broadcast":
                op = dist.BroadcastOp(inp, GRID, axes, out_t, root=int(kwargs.get("src", 0)))
            else:
                raise ImportError_(f"{where}: the importer does not know functional collective '{name}'")
        op.location = _location(n)
        self.ops.append(op)
        self.values[n] = op.results[0] if op.results else None


def _flatten(x: Any) -> Iterable[Any]:
    if isinstance(x, (list, tuple)):
        for i in x:
            yield from _flatten(i)
    else:
        yield x


def schedule_of(step: CapturedStep) -> list[tuple[str, int]]:
    """Forward parts in order, backward parts reversed, then (with gradient-norm clipping) the parts' norms in
    order and ``grad_clip``, then optimizer parts."""
    order = [(f"{p.name}_fwd", p.repeat) for p in step.parts]
    order += [(f"{p.name}_bwd", p.repeat) for p in reversed(step.parts) if p.bwd is not None]
    order += [(f"{p.name}_norm", p.repeat) for p in step.parts if p.norm is not None]
    order += [(CLIP_FUNCTION, 1)] if step.clip is not None else []
    order += [(f"{p.name}_optim", p.repeat) for p in step.parts if p.optim is not None]
    return order


def import_step(step: CapturedStep) -> ModuleOp:
    """The IR module of a captured step (verified)."""
    grid = GridOp.create(properties={"sym_name": StringAttr(GRID),
                                     "shape": DenseArrayBase.from_list(i64, list(step.mesh.shape))},
                         attributes={AXIS_NAMES_ATTR: ArrayAttr([StringAttr(a) for a in step.mesh.axis_names])})
    funcs = [_GraphImporter(step, g, g.function(p.name)).build() for p in step.parts for g in p.graphs()]
    if step.clip is not None:
        funcs.append(_GraphImporter(step, step.clip, CLIP_FUNCTION).build())
    module = ModuleOp([grid, *funcs])
    set_schedule(module, schedule_of(step))
    if step.partitioner != "min-cut":  # what the backward saves (flint.capture.partition); min-cut: unmarked
        module.attributes[PARTITIONER_ATTR] = StringAttr(step.partitioner)
    if step.tp_rules is not None or step.tp_refused:
        from flint.sharding.rules import record_tp_rules

        record_tp_rules(module, step.tp_rules, step.tp_refused)
    if step.layers is not None:
        from flint.sharding.rules import LAYERS_ATTR

        module.attributes[LAYERS_ATTR] = StringAttr(step.layers)
    if step.plan is not None:
        attach(module, step.plan)
        from flint.pipeline import split_by_plan

        split_by_plan(module, step.plan)  # the captured microbatch, scheduled (flint/pipeline)
    module.verify()
    return module
