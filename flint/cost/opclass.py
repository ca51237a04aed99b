"""Op classes for the cost model: which device efficiency applies to an op.

Flint has one op classifier, :func:`flint.capture.opclass.classify_aten`
(it takes an ``OpOverload``). This module only adapts it to the ATen overload
*names* the IR carries (``"aten.mm.default"``) and lists the class names a
device's efficiency tables may use:

``gemm``         matrix products and convolutions (compute bound)
``attention``    fused attention kernels, fwd and bwd (compute bound)
``elementwise``  pointwise ops
``reduction``    sums, norms (layer / RMS), softmax, losses
``memory``       copies, gathers / scatters, embedding, factory ops
``view``         metadata-only: no kernel, zero cost
``other``        anything else (``_foreach`` / fused optimizer ops, unknown ops)

``flint.capture`` is imported lazily: importing it pulls the compiler stack.
"""

from __future__ import annotations

from functools import lru_cache

from flint.opclasses import ATTENTION, COST_CLASSES, ELEMENTWISE, GEMM, MEMORY, OTHER, REDUCTION, VIEW  # noqa: F401


def split_target(target: str) -> tuple[str, str, str]:
    """``"aten.mm.default"`` / ``"aten::mm"`` / ``"mm"`` -> ``("aten", "mm", "default")``."""
    parts = target.replace("::", ".").split(".")
    if len(parts) == 1:
        return "aten", parts[0], "default"
    return parts[0], parts[1], parts[2] if len(parts) > 2 else "default"


@lru_cache(maxsize=None)
def resolve_overload(target: str):
    """The ``torch.ops`` ``OpOverload`` named by ``target``, or ``None`` if there is none."""
    import torch

    ns, name, overload = split_target(target)
    packet = getattr(getattr(torch.ops, ns, None), name, None)
    if packet is None:
        return None
    try:
        return getattr(packet, overload)
    except (AttributeError, RuntimeError):
        return None


@lru_cache(maxsize=None)
def classify_target(target: str) -> str:
    """The op class (one of :data:`COST_CLASSES`) of an ATen overload name."""
    from flint.capture.opclass import classify_aten

    op = resolve_overload(target)
    if op is None:
        return OTHER
    cls = classify_aten(op)
    return cls if cls in COST_CLASSES else OTHER
