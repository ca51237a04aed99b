"""Where a step's compute time goes: its priced kernels by op class.

Input is a step lowered with ``lower-to-chakra{merge-compute=false}``: one ``chakra.comp`` per kernel
(ATen op or fused kernel), so each node's class is its op's (:func:`flint.cost.opclass.classify_target`),
a node marked by ``fuse-pointwise`` (``fusion_group``) is a fused pointwise kernel, and a node on a
communication stream is a decomposed collective's reduction. Every node counts as often as it runs per
rank (the product of the ``chakra.repeat`` counts around it). A pipelined step has one graph per pipeline
rank; the breakdown is the one with the most compute.

The times are the kernels as priced, the sum the compute stream would take alone: the simulator's compute
time adds what SM sharing slows them by while collectives run. A decomposed collective's reductions that
only some ranks run (a tree's, a hierarchical broadcast's: ``flint.active`` / ``flint.where``) are counted
as if every rank ran them, so that class is an upper bound for those algorithms.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from xdsl.dialects.builtin import ModuleOp

from flint.cost.opclass import classify_target
from flint.errors import FlintError
from flint.ir import chakra, dist
from flint.passes.fuse_pointwise import GROUP_ATTR

FUSED = "fused pointwise"
COLL_REDUCTION = "collective reductions"
#: report order (classes absent from a step are left out)
ORDER = ("gemm", "attention", FUSED, "elementwise", "reduction", "memory", "other", COLL_REDUCTION)


@dataclass(frozen=True)
class ComputeBreakdown:
    """Per class: kernel time (us), FLOPs, bytes moved and kernel launches per step, on ``graph`` (see the
    module docstring)."""

    graph: str
    time_us: dict[str, float]
    flops: dict[str, int]
    bytes: dict[str, int]
    kernels: dict[str, int]

    @property
    def total_us(self) -> float:
        return sum(self.time_us.values())

    def to_json(self) -> dict:
        return {"graph": self.graph, "total_us": self.total_us,
                "classes": {c: {"time_us": self.time_us[c], "flops": self.flops[c], "bytes": self.bytes[c],
                                "kernels": self.kernels[c]} for c in self.time_us}}


def _class_of(op: chakra.CompOp) -> str:
    if dist.STREAM_ATTR in op.attributes:
        return COLL_REDUCTION
    if GROUP_ATTR in op.attributes:
        return FUSED
    try:
        cls = classify_target(op.node_name.data)
    except (FlintError, ValueError, KeyError):
        return "other"
    return cls if cls in ORDER else "other"


def _graph_breakdown(graph: chakra.GraphOp) -> ComputeBreakdown:
    time, flops, nbytes, kernels = Counter(), Counter(), Counter(), Counter()

    def walk(block, times: int) -> None:
        for op in block.ops:
            if isinstance(op, chakra.RepeatOp):
                for region in op.regions:
                    for b in region.blocks:
                        walk(b, times * op.count.value.data)
            elif isinstance(op, chakra.CompOp):
                cls = _class_of(op)
                time[cls] += (op.duration_us.value.data if op.duration_us is not None else 0.0) * times
                flops[cls] += (op.flops.value.data if op.flops is not None else 0) * times
                nbytes[cls] += (op.bytes.value.data if op.bytes is not None else 0) * times
                kernels[cls] += times

    for region in graph.regions:
        for b in region.blocks:
            walk(b, 1)
    classes = [c for c in ORDER if kernels[c]]
    return ComputeBreakdown(graph.sym_name.data, {c: time[c] for c in classes}, {c: flops[c] for c in classes},
                            {c: nbytes[c] for c in classes}, {c: kernels[c] for c in classes})


def compute_breakdown(lowered: ModuleOp) -> ComputeBreakdown | None:
    """The breakdown of the graph with the most compute (``None``: the module has no ``chakra.graph``)."""
    graphs = [_graph_breakdown(op) for op in lowered.ops if isinstance(op, chakra.GraphOp)]
    return max(graphs, key=lambda g: g.total_us) if graphs else None
