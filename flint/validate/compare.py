"""Compare Flint's captured step with a real run of the same model, plan and world size.

Flint side: :func:`flint.capture.capture_step` with ``repeat=False`` (the whole
layer stack captured, nothing multiplied; with activation checkpointing one
block per graph, counted ``repeat`` times, see :func:`flint_counts`), counted by its
:class:`~flint.capture.StepSummary` classes and, per operator name, with the
same :func:`~flint.capture.opclass.classify_aten`. Flint's program is SPMD:
every rank of a recipe does the same per-rank work, so each real rank is
compared with the one per-rank Flint count.

Executed side: :func:`flint.validate.executed.count_host_trace` per rank.

A row of the comparison is (rank, class): the two counts, their ratio
Flint / executed, and for collectives the input bytes and their ratio.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from flint.capture import opclass
from flint.validate.classify import COMPARED_CLASSES, COMPARED_COLLECTIVES, MULTI_TENSOR, validated_class
from flint.validate.executed import RankCounts

SEQ_LEN = 64
GLOBAL_BATCH = 4


@dataclass(frozen=True)
class Case:
    """One validated configuration: model preset, recipe, world size (TP degree derived)."""

    model: str
    plan: str
    world_size: int
    batch: tuple[int, int] = (GLOBAL_BATCH, SEQ_LEN)
    ac: str = "none"  # activation checkpointing mode (selective-layer: every second block)
    loss_parallel: bool = False  # the plan's loss_parallel (torch's loss_parallel; needs TP)
    max_norm: float = 0.0  # the plan's gradient-norm clipping (torchtitan's clip_grad_norm_ in the real run)
    optimizer_impl: str = "for-loop"  # the plan's AdamW form (AdamW(foreach=True) / AdamW(fused=True) in the real run)

    @property
    def tp(self) -> int:
        """TP degree: the whole world for ``tp``/``tp+sp``; 2 for 2-D recipes; 1 otherwise."""
        parts = set(self.plan.split("+"))
        if "tp" not in parts:
            return 1
        return 2 if parts & {"dp", "fsdp"} else self.world_size

    def mesh(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        from flint.plan import from_recipe

        mesh = from_recipe(self.plan, self.world_size, self.tp).mesh()
        return mesh.shape, mesh.axis_names

    def label(self) -> str:
        return (f"{self.model} {self.plan} w{self.world_size}" + (f" ac={self.ac}" if self.ac != "none" else "")
                + (" loss_parallel" if self.loss_parallel else "")
                + (f" clip={self.max_norm:g}" if self.max_norm else "")
                + (f" {self.optimizer_impl}" if self.optimizer_impl != "for-loop" else ""))


@dataclass
class FlintCounts:
    """Per-rank counts of Flint's captured step (same keys as :class:`RankCounts`)."""

    classes: Counter
    collectives: Counter  # (kind, phase) -> count
    collective_bytes: Counter  # (kind, phase) -> input bytes
    ops: Counter = field(default_factory=Counter)  # (class, phase, "ns::op") -> count
    # (phase, "ns::op") -> elements of the first tensor list of the multi-tensor ops
    multi_tensor_elements: Counter = field(default_factory=Counter)


def flint_counts(case: Case) -> FlintCounts:
    """Capture ``case`` with Flint (fake process group, meta tensors) and count it."""
    from flint.capture import capture_step, pytorch_warnings
    from flint.models import factory

    from flint.models.hf import hf_factory, is_hf

    if is_hf(case.model):  # a Hugging Face model: its own inputs and loss (flint.capture.generic)
        batch = {"input_ids": case.batch, "labels": case.batch}
        model_factory = hf_factory(case.model)
    else:
        batch = {"tokens": case.batch, "labels": case.batch}
        model_factory = factory(case.model)
    with pytorch_warnings():  # as flint capture: PyTorch's notes on the capture shown only if it fails
        if case.ac == "none" and not case.loss_parallel and not case.max_norm and case.optimizer_impl == "for-loop":
            step = capture_step(model_factory, batch, world_size=case.world_size, plan=case.plan, tp=case.tp,
                                repeat=False)
        else:
            from flint.validate.worker import case_plan

            # one graph per block, as Flint estimates it: in one graph of the whole stack AOTAutograd's
            # partitioner recomputes a checkpointed block's output (the next block's input), which eager
            # checkpoint_wrapper saves (one more GEMM per block boundary than the real run)
            plan = case_plan(case.plan, case.world_size, case.tp, case.ac, case.loss_parallel, case.max_norm,
                             case.optimizer_impl)
            step = capture_step(model_factory, batch, plan=plan, repeat=True)
    summary = step.summary()
    colls, coll_bytes = Counter(), Counter()
    for (kind, _axes, phase), n in summary.collectives.items():
        colls[(kind, phase)] += n
        coll_bytes[(kind, phase)] += summary.collective_bytes[(kind, _axes, phase)]
    ops, elements = Counter(), Counter()
    for g, repeat in step.graphs():
        for node in g.nodes():
            cls = validated_class(node.target)
            ns, name = opclass._op_name(node.target)
            op = f"{ns}::{name}" if ns else name
            ops[(cls, g.phase, op)] += repeat
            if cls == MULTI_TENSOR and isinstance(node.args[0], (list, tuple)):
                elements[(g.phase, op)] += repeat * sum(a.meta["val"].numel() for a in node.args[0])
    classes = Counter(summary.op_classes)
    classes[MULTI_TENSOR] = sum(n for (cls, _phase, _op), n in ops.items() if cls == MULTI_TENSOR)
    return FlintCounts(classes, colls, coll_bytes, ops, elements)


@dataclass(frozen=True)
class Row:
    """One (rank, class) line of the comparison."""

    rank: int
    cls: str
    flint: int
    executed: int
    flint_bytes: int | None = None  # collectives only
    executed_bytes: int | None = None

    @property
    def ratio(self) -> float:
        """Flint / executed count (1 when both are 0, inf when only Flint has some)."""
        return _ratio(self.flint, self.executed)

    @property
    def bytes_ratio(self) -> float | None:
        if self.flint_bytes is None:
            return None
        return _ratio(self.flint_bytes, self.executed_bytes or 0)


def _ratio(a: int, b: int) -> float:
    if b == 0:
        return 1.0 if a == 0 else math.inf
    return a / b


def _total(counter: Counter, kind: str) -> int:
    return sum(n for (k, _phase), n in counter.items() if k == kind)


def compare(flint: FlintCounts, ranks: list[RankCounts]) -> list[Row]:
    """Rows for every executed rank and compared class."""
    rows = []
    for rc in ranks:
        for cls in COMPARED_CLASSES:
            if cls in COMPARED_COLLECTIVES:
                rows.append(Row(rc.rank, cls, _total(flint.collectives, cls), _total(rc.collectives, cls),
                                _total(flint.collective_bytes, cls), _total(rc.collective_bytes, cls)))
            else:
                rows.append(Row(rc.rank, cls, flint.classes.get(cls, 0), rc.classes.get(cls, 0)))
    return rows


def op_deltas(flint: FlintCounts, rc: RankCounts, cls: str) -> list[tuple[str, str, int, int]]:
    """(phase, op, flint count, executed count) where the two differ, for one class of one rank.

    In-place and out-of-place forms count as one operator (:func:`flint.validate.expected.base_op`).
    """
    from flint.validate.expected import base_op

    def merged(ops: Counter) -> Counter:
        out = Counter()
        for (c, phase, name), n in ops.items():
            if c == cls:
                out[(phase, base_op(name))] += n
        return out

    a, b = merged(flint.ops), merged(rc.ops)
    return [(phase, name, a[(phase, name)], b[(phase, name)])
            for phase, name in sorted(set(a) | set(b)) if a[(phase, name)] != b[(phase, name)]]
