"""Known, explained differences between Flint's captured step and the executed one.

Each rule names an op-level difference (class, phase, operator) the
comparison may show and why it is there. The report lists every op-level
difference of every non-exact class with the first rule that explains it;
one no rule explains is shown as "unexplained", never dropped.
In-place and out-of-place forms of an operator (``aten::add_`` / ``aten::add``)
are compared as one (:func:`base_op`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from flint.validate.classify import MULTI_TENSOR


@dataclass(frozen=True)
class Expected:
    """An explained op-level difference.

    ``cls`` and ``phase`` (None: any) must equal the difference's; ``op`` is a
    regex on the base operator name; ``plans`` (None: any) a regex on the recipe;
    ``models`` (None: any) a regex on the model preset; a ``loss_parallel`` rule
    explains only cases that run the plan's ``loss_parallel``, a ``clip`` rule only cases that clip the
    gradients' norm (the plan's ``max_norm``), an ``ac`` rule only cases with activation checkpointing. A rule
    with ``most`` explains a difference only where the executed side runs 1 to ``most`` more of the operator
    than Flint (a fixed number of ops per step, not one per layer); without counts it is not checked.
    """

    key: str
    cls: str
    op: str
    phase: str | None
    reason: str
    plans: str | None = None
    models: str | None = None
    loss_parallel: bool = False
    clip: bool = False
    ac: bool = False
    most: int | None = None

    def matches(self, cls: str, phase: str, op: str, plan: str = "", model: str = "",
                loss_parallel: bool = False, clip: bool = False, ac: bool = False, more: int | None = None) -> bool:
        return (cls == self.cls and (self.phase is None or phase == self.phase)
                and (self.most is None or more is None or 0 < more <= self.most)
                and (loss_parallel or not self.loss_parallel) and (clip or not self.clip) and (ac or not self.ac)
                and re.fullmatch(self.op, op) is not None
                and (self.plans is None or re.fullmatch(self.plans, plan) is not None)
                and (self.models is None or re.fullmatch(self.models, model) is not None))


_DATA_PARALLEL = r"(dp|fsdp)(\+.*)?"
_FSDP = r"fsdp(\+.*)?"
_HF = r"hf-.*"  # Hugging Face models (flint.models.hf)
_LOSS_PARALLEL = (
    "torch's loss_parallel runs DTensor's own handlers for log_softmax, nll_loss and their joint backward "
    "(torch/distributed/tensor/parallel/loss.py): per-token max and sum-of-exponentials over the vocabulary "
    "shards, masks for targets outside the local shard (lt, ge, bitwise_or) and for ignore_index (ne), and in "
    "backward _log_softmax_backward_data and nll_loss_backward on the shard. Eager runs those ops as the "
    "handlers call them; Flint's capture traces the same handlers through AOTAutograd, whose joint graph is "
    "decomposed (the backward as exp / sub / where chains) and partitioned (masks recomputed or saved). "
    "The three loss all-reduces and every GEMM match on both sides. ")
_HF_PACKED_CHECK = (
    "Hugging Face's mask creation asks find_packed_sequence_indices whether the position ids pack several "
    "sequences per row: eager computes their diff (sub), ne and cumsum and checks the last column (eq, all), finds "
    "one sequence a row and calls SDPA with is_causal=True, no mask and the K/V heads as they are (enable_gqa). "
    "torch.compile cannot read the values; where the model builds its position ids (arange, no such input), "
    "Flint's capture is given eager's answer (flint.capture.byom.eager_mask_decisions) and calls the same SDPA, "
    "without these few ops on [batch, seq] integers (which a traced run computes to build an explicit mask): "
    "once per forward, two sub and one each of ne, cumsum, eq and all; a larger difference is not this. ")

EXPECTED: tuple[Expected, ...] = (
    Expected("optimizer", "elementwise", r"aten::\w+", "optim",
             "Flint traces AdamW in its capturable form (tensor step: bias corrections as tensor ops pow, rsub, "
             "sqrt, reciprocal, neg, mul per parameter group); eager torch.optim.AdamW(foreach=False) on CPU "
             "computes them as Python floats from step.item() and adds to each parameter's step counter. With "
             "AdamW(foreach=True), ATen on CPU runs each _foreach_ op as a loop of per-tensor ops (its slow path; "
             "a GPU runs multi_tensor_apply kernels, which Flint prices), recorded inside the _foreach_ op; "
             "fused AdamW's step-count _foreach_add_ too."),
    Expected("mean-decomposed", "reduction", r"aten::(mean|sum)", "fwd",
             "eager CPU aten::mean runs aten::sum + aten::div_ inside it; the innermost reduction counted is "
             "sum (Flint's graph keeps mean)."),
    Expected("recomputed-mean", "reduction", r"aten::(mean|sum)", "bwd",
             "the forward that activation checkpointing recomputes in backward has its means, which eager CPU "
             "runs as aten::sum + aten::div_ (see mean-decomposed).", ac=True),
    Expected("mean-decomposed", "elementwise", r"aten::div", "fwd",
             "the division inside eager CPU aten::mean (see the reduction row)."),
    Expected("grad-divide", "elementwise", r"aten::div", "bwd",
             "gloo has no AVG reduction: FSDP2's fully_shard and replicate divide each parameter group's "
             "gradient by the data-parallel size (div_, one per group) around the reduce-scatter / all-reduce; "
             "Flint's recipes use the collective's avg, which carries the division.", _DATA_PARALLEL),
    Expected("fsdp-grad-assembly", "elementwise", r"aten::add", "bwd",
             "Flint's FSDP recipe (SimpleFSDP-style autograd all-gather) copies each parameter out of the "
             "gathered flat buffer with split_with_sizes_copy (FSDP2's copy-out op); its backward assembles "
             "the group's flat gradient with one cat, where FSDP2 uses fsdp::chunk_cat (memory ops both); "
             "gradient accumulation of parameters used twice differs in add count.", _FSDP),
    Expected("backward-formulas", "elementwise", r"aten::(add|mul|div|silu|neg|sub|pow|rsqrt)", "bwd",
             "eager autograd runs each op's backward formula (in place where it can: gradient accumulation "
             "add_); AOTAutograd's joint graph is functionalized and decomposed (norm and mean backward as "
             "explicit mul/div/add chains), and its min-cut partitioner "
             "recomputes cheap forward ops such as silu in the backward instead of saving them."),
    Expected("hf-packed-check", "elementwise", r"aten::sub", "fwd", _HF_PACKED_CHECK, models=_HF, most=2),
    Expected("hf-packed-check", "elementwise", r"aten::(ne|eq)", "fwd", _HF_PACKED_CHECK, models=_HF, most=1),
    Expected("hf-packed-check", "reduction", r"aten::(cumsum|all)", "fwd", _HF_PACKED_CHECK, models=_HF, most=1),
    Expected("loss-parallel-handlers", "elementwise", r"aten::(add|sub|exp|where|ne|ge|lt|bitwise_or)", None,
             _LOSS_PARALLEL, loss_parallel=True),
    Expected("loss-parallel-handlers", "reduction", r"aten::(_log_softmax_backward_data|nll_loss_backward)", "bwd",
             _LOSS_PARALLEL, loss_parallel=True),
    Expected("grad-clip-norms", "reduction", r"aten::linalg_vector_norm", "optim",
             "torch's clip_grad_norm_ takes one vector_norm per gradient, stacks them and takes one more norm of "
             "the stack; Flint folds them part by part (flint.capture.step._capture_norm): one more norm per part "
             "run (embedding, each block, head) instead of one in all. The elementwise ops of clipping (pow, add, "
             "reciprocal, clamp, one mul_ per gradient) fall under the optimizer's rule.", clip=True),
    Expected("fsdp-foreach-copy-out", MULTI_TENSOR, r"aten::_foreach_copy", None,
             "FSDP2's all-gather copy-out (foreach_all_gather_copy_out) writes a group's parameters out of the "
             "gathered flat buffer with one torch._foreach_copy_; Flint's FSDP recipe (SimpleFSDP-style autograd "
             "all-gather) copies them out with split_with_sizes_copy, a memory op (not compared).", _DATA_PARALLEL),
    Expected("per-part-optimizer", MULTI_TENSOR, r"aten::(_foreach_\w+|_fused_adamw)", "optim",
             "Flint runs one AdamW per captured part (embedding, each block, head), each issuing its own "
             "multi-tensor op of every kind over that part's parameters; torch's AdamW issues one per (device, "
             "dtype) group over all of them: the same elements, more launches in Flint. Eager AdamW(foreach=True) "
             "also increments its per-parameter step counts with a _foreach_add_ of its own; they are host "
             "tensors (no device kernel on a GPU), and Flint's capture leaves the increment out."),
    Expected("hf-recomputed-rope", "elementwise", r"aten::(cos|sin)", "bwd",
             "Hugging Face's rotary embedding computes cos and sin of the positions in forward; AOTAutograd's "
             "min-cut partitioner recomputes them in the backward (cheap, no gradient) instead of saving them.",
             models=_HF),
)


def base_op(name: str) -> str:
    """``aten::add_`` -> ``aten::add`` (in-place and out-of-place counted as one operator)."""
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def explain(cls: str, phase: str, op: str, plan: str = "", model: str = "",
            loss_parallel: bool = False, clip: bool = False, ac: bool = False,
            more: int | None = None) -> Expected | None:
    """The first rule explaining an op-level difference of ``model`` under recipe ``plan`` (with the plan's
    ``loss_parallel`` or not, clipping the gradients' norm or not, checkpointing activations or not; ``more``:
    how many more of the operator the executed step runs than Flint's), or ``None``."""
    return next((e for e in EXPECTED
                 if e.matches(cls, phase, base_op(op), plan, model, loss_parallel, clip, ac, more)), None)


@dataclass(frozen=True)
class CollectiveNote:
    """An explained difference in a collective class (these must otherwise match exactly)."""

    key: str
    kind: str
    phase: str
    plans: str
    reason: str

    def matches(self, kind: str, phase: str, plan: str) -> bool:
        return kind == self.kind and phase == self.phase and re.fullmatch(self.plans, plan) is not None


COLLECTIVE_NOTES: tuple[CollectiveNote, ...] = (
    CollectiveNote(
        "dtensor-partial-grad", "all_reduce", "optim", r"(.*\+)?tp\+sp",
        "With sequence parallelism the norm weights' gradients stay DTensor Partial after backward. Eager "
        "torch.optim.AdamW (single-tensor, as on CPU) redistributes a Partial operand every time an op reads "
        "it and does not cache the result: lerp_(grad) all-reduces it once and addcmul_(grad, grad) twice, "
        "3 all-reduces per such gradient (found in the execution trace: each c10d::allreduce_ sits under "
        "_c10d_functional::all_reduce < aten::lerp_ / aten::addcmul_ < Optimizer.step). Flint's capture "
        "all-reduces each Partial gradient once, which is what an implementation that reduces before the "
        "update (or caches the redistribution) does; it under-counts eager PyTorch 3x here."),
)


def explain_collective(kind: str, phase: str, plan: str) -> CollectiveNote | None:
    """The note explaining a collective difference, or ``None`` (unexplained)."""
    return next((n for n in COLLECTIVE_NOTES if n.matches(kind, phase, plan)), None)


#: The one explained difference in collective bytes at equal counts: clipping's norm all-reduces.
CLIP_NORM_BYTES = CollectiveNote(
    "grad-clip-norm-vector", "all_reduce", "optim", r".*",
    "torch's clip_grad_norm_ on DTensor gradients all-reduces the stacked vector of every gradient's norm "
    "(DTensor redistributes the partial stack before its norm: 4 bytes per gradient tensor, per sharded mesh "
    "axis); Flint folds the norms part by part and all-reduces their norm, one fp32 value (4 bytes). The same "
    "collectives, over the same axes, in the same order; both transfers are latency-bound.")


def explain_collective_bytes(kind: str, phase: str, clip: bool) -> CollectiveNote | None:
    """The note explaining a difference in a collective's bytes where the counts agree, or ``None``."""
    n = CLIP_NORM_BYTES
    return n if clip and kind == n.kind and phase == n.phase else None
