"""Per-rank work of a step's IR (captured or expanded), the same way for both:
FLOPs (the one count, :func:`flint.cost.op_cost`), and collectives by (kind,
mesh axes, phase) with their counts and input bytes, repeated functions counted
as the schedule repeats them. The agreement test and ``flint expand``'s summary
use it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, TensorType

from flint.chakra.from_ir import AXIS_NAMES_ATTR
from flint.cost.dtypes import tensor_bytes
from flint.ir import dist
from flint.ir.aten import AtenOp, get_schedule


@dataclass
class ProgramSummary:
    flops: int
    collectives: Counter  # (kind, axes names, phase) -> count; kind "send" counts point-to-point sends
    collective_bytes: Counter  # (kind, axes names, phase) -> input bytes
    sends: int
    recvs: int


def _bytes(t: TensorType) -> int:
    return tensor_bytes(list(t.get_shape()), str(t.element_type))


def summarize_program(module: ModuleOp) -> ProgramSummary:
    from flint.passes.annotate_cost import aten_op_work
    from xdsl.dialects.shard import GridOp

    grid = next(o for o in module.ops if isinstance(o, GridOp))
    names = [a.data for a in grid.attributes[AXIS_NAMES_ATTR].data] if AXIS_NAMES_ATTR in grid.attributes else \
        [str(i) for i in range(len(grid.shape.get_values()))]
    funcs = {f.sym_name.data: f for f in module.ops if isinstance(f, func.FuncOp)}
    flops = sends = recvs = 0
    colls, nbytes = Counter(), Counter()
    for name, count in get_schedule(module):
        phase = name.rpartition("_")[2]
        phase = "optim" if phase in ("norm", "clip") else phase  # clipping's functions run in the optimizer phase
        for op in funcs[name].walk():
            if isinstance(op, AtenOp):
                flops += aten_op_work(op).flops * count
            elif isinstance(op, dist.CollectiveOp):
                kind = op.name.split(".")[1]
                key = (kind, tuple(names[a] for a in op.axes()), phase)
                colls[key] += count
                nbytes[key] += _bytes(op.input.type) * count
            elif isinstance(op, dist.SendOp):
                sends += count
                # point-to-point traffic (context parallelism's ring) per axis, as kind "send"
                key = ("send", tuple(names[a] for a in op.axes()), phase)
                colls[key] += count
                nbytes[key] += _bytes(op.input.type) * count
            elif isinstance(op, dist.RecvOp):
                recvs += count
    return ProgramSummary(flops, colls, nbytes, sends, recvs)
