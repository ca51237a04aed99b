"""`annotate-cost`: write each compute op's FLOPs, bytes and roofline duration onto it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from xdsl.context import Context
from xdsl.dialects.builtin import (
    ArrayAttr,
    DictionaryAttr,
    FloatAttr,
    IntegerAttr,
    IntegerType,
    ModuleOp,
    StringAttr,
    TensorType,
    f64,
    i64,
)
from xdsl.passes import ModulePass

from flint.cost import Device, OpCost, load_device, op_cost
from flint.cost.flops import INPLACE_SCATTERS, inplace_scatter_bytes
from flint.cost.opclass import GEMM, classify_target
from flint.errors import FlintError
from flint.ir.aten import AtenOp

FLOPS_ATTR, BYTES_ATTR, DURATION_ATTR = "flops", "bytes", "duration_us"
ATTENTION_KERNEL_ATTR = "flint.attention_kernel"  # "cudnn" on fused attention ops (attention-kernel pass)


def _py(attr: Any) -> Any:
    """An `args` attribute value as a plain Python value."""
    if isinstance(attr, IntegerAttr) and isinstance(attr.type, IntegerType) and attr.type.width.data == 1:
        return bool(attr.value.data)
    if isinstance(attr, (IntegerAttr, FloatAttr)):
        return attr.value.data
    if isinstance(attr, StringAttr):
        return attr.data
    if isinstance(attr, ArrayAttr):
        return [_py(a) for a in attr.data]
    return attr


def _types(values) -> tuple[list[tuple[int, ...]], list[str]]:
    shapes, dtypes = [], []
    for v in values:
        t = v.type
        assert isinstance(t, TensorType)
        shapes.append(tuple(t.get_shape()))
        dtypes.append(str(t.element_type))
    return shapes, dtypes


def aten_op_work(op: AtenOp) -> OpCost:
    """Op class, FLOPs and bytes of one `aten.op` (device-independent)."""
    in_shapes, in_dtypes = _types(op.inputs)
    out_shapes, out_dtypes = _types(op.outputs)
    args = {k: _py(v) for k, v in op.args.data.items()} if op.args is not None else None
    return op_cost(op.overload, in_shapes, in_dtypes, out_shapes, out_dtypes, args)


def aten_op_cost(op: AtenOp, device: Device) -> tuple[int, int, float]:
    """``(flops, bytes, duration_us)`` of one `aten.op` on ``device``.

    Uses the annotations ``annotate-cost`` left if present, otherwise the one
    FLOP / byte count (:func:`flint.cost.op_cost`) and the device roofline.
    """
    if all(k in op.attributes for k in (FLOPS_ATTR, BYTES_ATTR, DURATION_ATTR)):
        return (op.attributes[FLOPS_ATTR].value.data, op.attributes[BYTES_ATTR].value.data,
                op.attributes[DURATION_ATTR].value.data)
    cost = aten_op_work(op)
    kernel = op.attributes.get(ATTENTION_KERNEL_ATTR)
    if isinstance(kernel, StringAttr):  # set by attention-kernel
        cost = replace(cost, attention_kernel=kernel.data)
    if op.overload in INPLACE_SCATTERS and _runs_in_place(op):
        in_shapes, in_dtypes = _types(op.inputs)
        cost = replace(cost, bytes=inplace_scatter_bytes(in_shapes, in_dtypes))
    return cost.flops, cost.bytes, device.op_time_us(cost, compute_dtype(op, device))


def _runs_in_place(op: AtenOp) -> bool:
    """Whether a functional scatter's ``self`` is an op's fresh result read by nothing else (returned
    values count as read): PyTorch then updates it in place (:data:`flint.cost.flops.INPLACE_SCATTERS`)."""
    target = op.inputs[0]
    return isinstance(target.owner, AtenOp) and len(list(target.uses)) == 1


def compute_dtype(op: AtenOp, device: Device) -> str:
    """The dtype whose peak an op runs at: fp8 for a product of fp8 operands (``_scaled_mm``), else its
    result's (inputs' for ops without results); bf16 when the device has no unit for it.

    A GEMM of fp8 operands on a device without fp8 tensor cores (A100) is an error: PyTorch's
    ``_scaled_mm`` refuses to run there, so no estimate exists for it."""
    ins = [str(v.type.element_type) for v in op.inputs if isinstance(v.type, TensorType)]
    if ins and ins[0].startswith("f8"):
        if device.has_peak(ins[0]):
            return ins[0]
        if classify_target(op.overload) == GEMM:
            where = f" in module '{op.module.data}'" if op.module is not None else ""
            raise FlintError(f"'{op.overload}'{where} multiplies {ins[0]} operands (a float8 GEMM, plan field "
                             f"'fp8'), but device '{device.name}' has no fp8 tensor cores (no peak_tflops_fp8): "
                             "torch._scaled_mm does not run there; pick a device with fp8 (h100-sxm, h200, b200, "
                             "mi300x) or capture with fp8 = \"none\"")
    values = list(op.outputs) or list(op.inputs)
    dtype = str(values[0].type.element_type) if values else "bf16"
    return dtype if dtype in ("bf16", "f16", "f32", "f64", "tf32") else "bf16"


@dataclass(frozen=True)
class AnnotateCostPass(ModulePass):
    """Annotate every `aten.op` with its FLOPs, bytes and roofline duration on a device.

    Adds the attributes ``flops`` (i64, model FLOPs from PyTorch's formulas),
    ``bytes`` (i64, bytes read plus written) and ``duration_us`` (f64: the
    device's kernel time, :meth:`flint.cost.Device.op_time_us`: GEMMs by
    their shape (tile and wave quantization, small-K cost), fused attention by
    its measured efficiency, everything else max(FLOPs / (peak x efficiency),
    bytes / (HBM bandwidth x efficiency)), never below the kernel floor).
    View ops get zero. Existing annotations are recomputed.

    Options: ``device`` (a preset name such as ``h100-sxm``, or a TOML path).
    The IR is otherwise unchanged.
    """

    name = "annotate-cost"

    device: str = "h100-sxm"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        device = load_device(self.device)
        for inner in op.walk():
            if isinstance(inner, AtenOp):
                for k in (FLOPS_ATTR, BYTES_ATTR, DURATION_ATTR):
                    inner.attributes.pop(k, None)
                flops, nbytes, duration = aten_op_cost(inner, device)
                inner.attributes[FLOPS_ATTR] = IntegerAttr(flops, i64)
                inner.attributes[BYTES_ATTR] = IntegerAttr(nbytes, i64)
                inner.attributes[DURATION_ATTR] = FloatAttr(round(duration, 6), f64)
