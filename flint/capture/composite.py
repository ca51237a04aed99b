"""Keep PyTorch's composite autograd on meta tensors while capturing.

Why the model's own ``F.cross_entropy`` lost its backward (torch 2.13): at
import, ``torch._meta_registrations.activate_meta`` registers every
decomposition of ``torch._decomp``'s tables as a *Python* ``Meta`` kernel
(``OpOverload.py_impl(DispatchKey.Meta)``), including about a hundred ops that
are ``CompositeImplicitAutograd`` (``aten.nll_loss``, ``dropout``, ``var``,
``std``, ``relu6``, ``prelu``, ``where``, ...). AOTAutograd traces with the
Python dispatcher enabled, and its key resolution
(``torch._ops.resolve_key``) uses the composite kernel for an autograd key
only when the backend has no kernel of its own; that Python Meta kernel
counts as one. So on meta tensors ``AutogradMeta`` resolves to nothing, the
op runs through the autograd fallback (the "an autograd kernel was not
registered" warning) and the joint graph has no gradient for anything
upstream of it: the backward graph returns all ``None``. On CPU tensors the
Meta kernel is never consulted, so a real run is correct.

:func:`composite_autograd` removes those Python Meta kernels for the
duration of a capture (the C++ dispatcher's behaviour: the composite
decomposes into base ops, which have meta kernels and derivatives) and
restores them afterwards.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import cache
from typing import Iterator

import torch
from torch._C import DispatchKey


@cache
def shadowed_composites() -> tuple[torch._ops.OpOverload, ...]:
    """OpOverloads whose Python Meta kernel hides their CompositeImplicitAutograd kernel."""
    import torch._decomp as decomp

    ops: set = set()
    for table in decomp.global_decomposition_table.values():
        ops.update(table)
    out = [op for op in ops if isinstance(op, torch._ops.OpOverload) and DispatchKey.Meta in op.py_kernels
           and torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")]
    return tuple(sorted(out, key=str))


@contextmanager
def composite_autograd() -> Iterator[None]:
    """Within the block, composite ops differentiate on meta tensors as on a device."""
    saved = []
    for op in shadowed_composites():
        fn = op.py_kernels.pop(DispatchKey.Meta, None)
        if fn is not None:
            saved.append((op, fn))
            op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, fn in saved:
            op.py_kernels[DispatchKey.Meta] = fn
            op._dispatch_cache.clear()


@contextmanager
def no_rng_state_on_meta() -> Iterator[None]:
    """Recompute seeded ops (flash attention) under activation checkpointing without saving RNG state.

    AOTAutograd's partitioner wraps every recomputed op tagged
    ``nondeterministic_seeded`` (``_scaled_dot_product_flash_attention*`` are,
    for their dropout) in ``run_and_save_rng_state`` / ``run_with_rng_state``
    so the recomputation replays the same random numbers
    (``torch._functorch.partitioners.functionalize_rng_ops``). Those
    higher-order ops have no meta-device implementation ("Backend not
    supported for meta"), and saving a generator state costs nothing a
    trace records, so capture skips the wrapping: the recomputed op itself
    stays in the backward graph.
    """
    from torch._functorch import partitioners

    original = partitioners.has_recomputable_rng_ops
    partitioners.has_recomputable_rng_ops = lambda fx_g: False
    try:
        yield
    finally:
        partitioners.has_recomputable_rng_ops = original
