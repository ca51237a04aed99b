"""Which forward values the captured backward reads: AOTAutograd's two partitioners.

``flint capture --partitioner`` / ``capture_step(partitioner=...)``:

- ``min-cut`` (default): ``torch._functorch.partitioners.min_cut_rematerialization_partition``,
  what ``torch.compile`` (inductor) runs. It saves a minimal set of forward values and
  recomputes cheap pointwise ops in the backward (e.g. RMSNorm's ``x * rsqrt``, SiLU's
  output): the activation memory of a compiled run.
- ``eager``: ``torch._functorch.partitioners.default_partition``, which saves every forward
  value the backward reads and recomputes nothing outside activation checkpointing: the
  tensors eager autograd saves (each op's derivative formula in the joint graph is the one
  eager autograd runs; ``tests/test_partition.py`` checks the saved bytes against eager
  autograd's ``saved_tensors_hooks``). Use it to model an eager (not compiled) run, or to
  compare with PyTorch's memory trackers, which run eagerly (``flint validate --memory``).

Two adjustments make ``default_partition`` behave as eager FSDP2 does, both about the
parameter all-gathers that capture writes as a recomputed checkpoint region
(:class:`flint.capture.recipes.ParamGroup`):

- A view of a recomputed value (the linear layer's ``t(weight)`` of a gathered weight) is
  recomputed too. ``default_partition`` would save it, keeping every block's gathered
  parameters alive from forward to backward. Eager autograd does save that view, but FSDP2
  frees its storage at the reshard after forward and re-gathers it before the backward
  (``FSDPParam.free_unsharded_param`` / ``alloc_all_gather_outputs``), which is what the
  recomputed region is.
- Collectives whose result nothing reads stay in the graphs. ``default_partition`` ends with
  a dead-code pass that drops them (``is_impure_node=is_not_collective``); that would drop
  the embedding's explicit pre-backward re-gather (:class:`flint.capture.recipes._BackwardUnshard`),
  which FSDP2 issues in a real run. ``min_cut_rematerialization_partition`` keeps it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch._functorch import partitioners
from torch.utils.checkpoint import CheckpointPolicy

#: ``--partitioner`` values -> what they model
PARTITIONERS = {
    "min-cut": "torch.compile's min-cut partitioner (recomputes cheap ops in backward)",
    "eager": "AOTAutograd's default partitioner (saves what eager autograd saves)",
}


def _recompute_views_of_recomputed(joint: torch.fx.GraphModule) -> int:
    """Tag every view of a recomputed value as recomputed (module docstring); returns how many."""
    tagged = 0
    for node in joint.graph.nodes:  # topological: a chain of views is tagged link by link
        if (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view
                and node.args and isinstance(node.args[0], torch.fx.Node)
                and partitioners.must_recompute(node.args[0]) and not partitioners.must_recompute(node)):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            if "ac_graph_id" in node.args[0].meta:
                node.meta["ac_graph_id"] = node.args[0].meta["ac_graph_id"]
            tagged += 1
    return tagged


def eager_partition(joint_module: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any):
    """``default_partition`` with FSDP2's eager parameter lifetimes (module docstring)."""
    if partitioners.has_recomputable_ops(joint_module) and \
            partitioners._is_functional_graph(joint_module.graph)[0] is not None:
        # default_partition would warn and fall back to the min-cut partitioner
        raise RuntimeError("--partitioner eager: the joint graph mutates a tensor inside a recomputed "
                           "(checkpointed) region, which AOTAutograd's default partitioner cannot split; "
                           "use --partitioner min-cut")
    _recompute_views_of_recomputed(joint_module)
    original = partitioners.is_not_collective
    partitioners.is_not_collective = lambda node: True  # its final DCE keeps unread collectives
    try:
        return partitioners.default_partition(joint_module, joint_inputs, **kwargs)
    finally:
        partitioners.is_not_collective = original


def partition_fn(name: str) -> Callable[..., Any]:
    """The AOTAutograd ``partition_fn`` of ``--partitioner`` value ``name`` (checked by the caller)."""
    return eager_partition if name == "eager" else partitioners.min_cut_rematerialization_partition
