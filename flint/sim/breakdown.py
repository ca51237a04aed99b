"""Where a step's compute time goes: its priced kernels by op class.

``lower-to-chakra{class-times=true}`` records on every compute node (a run of kernels the compute stream
runs back to back, merged into one node) what it holds per op class: ``flint.class_times`` maps a class to
``[time_us : f64, array<i64: flops, bytes, kernels>]`` (:func:`add_class_times`). A kernel's class is its op's
(:func:`flint.cost.opclass.classify_target`), except a fused kernel (``fuse-pointwise``'s members:
``fused pointwise``) and a decomposed collective's reduction on a communication stream
(``collective reductions``). :func:`compute_breakdown` sums them over a graph, every node as often as it
runs per rank (the product of the ``chakra.repeat`` counts around it). A pipelined step has one graph per
pipeline rank; the breakdown is the one with the most compute.

The times are the kernels as priced, the sum the compute stream would take alone: the simulator's compute
time adds what SM sharing slows them by while collectives run. A node that only some ranks run (a tree's or a
hierarchical broadcast's reductions: ``flint.active`` / ``flint.where``) counts with the share of the ranks
that run it, so the breakdown is the mean over the ranks of the graph (a kernel count may then be fractional).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from xdsl.dialects.builtin import ArrayAttr, DenseArrayBase, DictionaryAttr, FloatAttr, ModuleOp, f64, i64

from flint.cost.flops import is_multi_tensor
from flint.cost.opclass import classify_target, split_target
from flint.chakra.from_ir import mesh_of
from flint.errors import FlintError
from flint.ir import chakra
from flint.ir.dist import where_of
from flint.passes.annotate_cost import aten_op_work
from flint.passes.fuse_pointwise import GROUP_ATTR

FUSED = "fused pointwise"
COLL_REDUCTION = "collective reductions"
MULTI_TENSOR = "multi-tensor"  # torch's foreach ops and fused optimizers (plan field optimizer_impl)
#: report order (classes absent from a step are left out)
ORDER = ("gemm", "attention", FUSED, "elementwise", "reduction", "memory", MULTI_TENSOR, "other", COLL_REDUCTION)


@dataclass(frozen=True)
class ComputeBreakdown:
    """Per class: kernel time (us), FLOPs, bytes moved and kernel launches per step and rank, on ``graph`` (see
    the module docstring; counts are ints unless some ranks skip a node)."""

    graph: str
    time_us: dict[str, float]
    flops: dict[str, int | float]
    bytes: dict[str, int | float]
    kernels: dict[str, int | float]

    @property
    def total_us(self) -> float:
        return sum(self.time_us.values())

    def to_json(self) -> dict:
        return {"graph": self.graph, "total_us": self.total_us,
                "classes": {c: {"time_us": self.time_us[c], "flops": self.flops[c], "bytes": self.bytes[c],
                                "kernels": self.kernels[c]} for c in self.time_us}}


CLASS_TIMES_ATTR = "flint.class_times"


def _class_of(op, side: str = "") -> str:
    if side:
        return COLL_REDUCTION
    if GROUP_ATTR in op.attributes:
        return FUSED
    if is_multi_tensor(split_target(op.overload)[1]):
        return MULTI_TENSOR
    try:
        cls = classify_target(op.overload)
    except (FlintError, ValueError, KeyError):
        return "other"
    return cls if cls in ORDER else "other"


def add_class_times(node: chakra.CompOp, op, duration_us: float, flops: int, nbytes: int, side: str = "") -> None:
    """Add one kernel (ATen ``op``, priced ``duration_us`` / ``flops`` / ``nbytes``; ``side``: the
    communication stream of a decomposed collective's reduction) to ``node``'s ``flint.class_times``."""
    cls = _class_of(op, side)
    # a multi-tensor op's kernels are its launches (flint.cost.flops.multi_tensor_launches)
    launches = (len(aten_op_work(op).kernel_shares) or 1) if cls == MULTI_TENSOR else 1
    old = node.attributes.get(CLASS_TIMES_ATTR)
    per = dict(old.data) if isinstance(old, DictionaryAttr) else {}
    t, (f, b, k) = _unpack(per[cls]) if cls in per else (0.0, (0, 0, 0))
    # [time_us : f64, array<i64: flops, bytes, kernels>] (an f64 dense array would not parse back when
    # xDSL prints one of its values in hex)
    per[cls] = ArrayAttr([FloatAttr(round(t + duration_us, 6), f64),
                          DenseArrayBase.from_list(i64, [f + int(flops), b + int(nbytes), k + launches])])
    node.attributes[CLASS_TIMES_ATTR] = DictionaryAttr(per)


def _unpack(value) -> tuple[float, tuple[int, int, int]]:
    time, counts = value.data
    f, b, k = counts.get_values()
    return time.value.data, (int(f), int(b), int(k))


def _share(op: chakra.CompOp, shape: tuple[int, ...]) -> float:
    """The share of the mesh's ranks that run ``op``: 1 unless masked to some coordinates of some axes
    (``flint.active``: a 0/1 per coordinate; ``flint.where``: one coordinate)."""
    allowed: dict[int, set[int]] = {}
    active = op.attributes.get("flint.active")
    if active is not None:
        axis = op.attributes["flint.active_axis"].value.data
        allowed[axis] = {c for c, on in enumerate(active.get_values()) if on}
    where = where_of(op)
    if where is not None:
        axis, coord = where
        allowed[axis] = allowed.get(axis, set(range(shape[axis]))) & {coord}
    share = 1.0
    for axis, coords in allowed.items():
        share *= len(coords) / shape[axis]
    return share


def _graph_breakdown(graph: chakra.GraphOp, shape: tuple[int, ...]) -> ComputeBreakdown:
    time, flops, nbytes, kernels = Counter(), Counter(), Counter(), Counter()

    def walk(block, times: int) -> None:
        for op in block.ops:
            if isinstance(op, chakra.RepeatOp):
                for region in op.regions:
                    for b in region.blocks:
                        walk(b, times * op.count.value.data)
            elif isinstance(op, chakra.CompOp):
                per = op.attributes.get(CLASS_TIMES_ATTR)
                if not isinstance(per, DictionaryAttr):
                    raise FlintError(f"compute node '{op.node_name.data}' has no {CLASS_TIMES_ATTR}: lower the step "
                                     "with lower-to-chakra{class-times=true} for a breakdown by op class")
                runs = times * _share(op, shape)
                for cls, v in per.data.items():
                    t, (f, b, k) = _unpack(v)
                    time[cls] += t * runs
                    flops[cls] += f * runs
                    nbytes[cls] += b * runs
                    kernels[cls] += k * runs

    for region in graph.regions:
        for b in region.blocks:
            walk(b, 1)
    classes = [c for c in ORDER if kernels[c]]
    return ComputeBreakdown(graph.sym_name.data, {c: time[c] for c in classes}, {c: _count(flops[c]) for c in classes},
                            {c: _count(nbytes[c]) for c in classes}, {c: _count(kernels[c]) for c in classes})


def _count(x: float) -> int | float:
    """A whole count as an int (every count unless some ranks skip a node)."""
    return int(x) if float(x).is_integer() else round(float(x), 3)


def compute_breakdown(lowered: ModuleOp) -> ComputeBreakdown | None:
    """The breakdown of the graph with the most compute of a step lowered with ``class-times=true``
    (``None``: the module has no ``chakra.graph``)."""
    graphs = [op for op in lowered.ops if isinstance(op, chakra.GraphOp)]
    if not graphs:
        return None
    shape = mesh_of(lowered).shape
    graphs = [_graph_breakdown(op, shape) for op in graphs]
    return max(graphs, key=lambda g: g.total_us)
