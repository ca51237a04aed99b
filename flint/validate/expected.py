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


@dataclass(frozen=True)
class Expected:
    """An explained op-level difference: ``cls`` / ``phase`` (None: any) / ``op`` (regex on the base name)."""

    key: str
    cls: str
    op: str
    phase: str | None
    reason: str

    def matches(self, cls: str, phase: str, op: str) -> bool:
        return cls == self.cls and (self.phase is None or phase == self.phase) and re.fullmatch(self.op, op) is not None


SDPA_MATH = ("Flint captures on meta tensors, where scaled_dot_product_attention has no fused kernel and "
             "PyTorch takes its math path (bmm, scale mul, causal-mask where/add, _safe_softmax and their "
             "backward); the CPU run executes the fused kernel _scaled_dot_product_flash_attention_for_cpu "
             "(+ _backward). The fix belongs in flint/capture (keep SDPA fused on meta).")

EXPECTED: tuple[Expected, ...] = (
    Expected("sdpa-math", "gemm", r"aten::bmm", None, SDPA_MATH),
    Expected("sdpa-math", "attention", r"aten::_scaled_dot_product_flash_attention_for_cpu(_backward)?", None,
             SDPA_MATH),
    Expected("sdpa-math", "reduction", r"aten::(_safe_softmax|_softmax_backward_data)", None, SDPA_MATH),
    Expected("sdpa-math", "elementwise", r"aten::where", "fwd", SDPA_MATH),
    Expected("optimizer", "elementwise", r"aten::\w+", "optim",
             "Flint traces AdamW in its capturable form (tensor step: bias corrections as tensor ops pow, rsub, "
             "sqrt, reciprocal, neg, mul per parameter group); eager torch.optim.AdamW(foreach=False) on CPU "
             "computes them as Python floats from step.item(), and adds the step counter per parameter."),
    Expected("mean-decomposed", "reduction", r"aten::(mean|sum)", "fwd",
             "eager CPU aten::mean runs aten::sum + aten::div_ inside it; the innermost reduction counted is "
             "sum (Flint's graph keeps mean)."),
    Expected("mean-decomposed", "elementwise", r"aten::div", "fwd",
             "the division inside eager CPU aten::mean (see the reduction row)."),
    Expected("functionalized", "elementwise", r"aten::(add|mul|div)", "bwd",
             "autograd's eager backward works in place and calls different formulas (gradient accumulation "
             "add_, MeanBackward's div_, expand-based sum backward); AOTAutograd's joint graph is "
             "functionalized and decomposed (mean/pow/rsqrt backward become explicit mul/div/add chains)."),
    Expected("recompute", "elementwise", r"aten::(silu|mul|add|neg|rsqrt|pow)", None,
             "AOTAutograd's min-cut partitioner recomputes cheap pointwise forward ops in the backward graph "
             "instead of saving them (silu, norms, rotary products); eager saves them."),
    Expected("fwd-decomposition", "elementwise", r"aten::(mul|add|sub|neg|pow|rsqrt)", "fwd",
             "decompositions differ: Flint's graph is AOTAutograd's (e.g. the SDPA math path's scale mul and "
             "mask add, rotary on split halves), eager runs composite kernels."),
    Expected("dtensor", "elementwise", r"aten::\w+", None,
             "DTensor (tensor parallel) dispatches on local shards; the eager run may record extra pointwise "
             "ops of redistribution and loss parallel reductions."),
)


def base_op(name: str) -> str:
    """``aten::add_`` -> ``aten::add`` (in-place and out-of-place counted as one operator)."""
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def explain(cls: str, phase: str, op: str) -> Expected | None:
    """The first rule explaining an op-level difference, or ``None``."""
    return next((e for e in EXPECTED if e.matches(cls, phase, base_op(op))), None)
