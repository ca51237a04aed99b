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
  recomputed too, and so are the gathered values where they enter another checkpointed region
  (``default_partition`` stashes values at the boundary of two regions,
  ``cleanup_recompute_tags``). ``default_partition`` would save them, keeping every block's
  gathered parameters alive from forward to backward. Eager autograd does save that view, but
  FSDP2 frees its storage at the reshard after forward and re-gathers it before the backward
  (``FSDPParam.free_unsharded_param`` / ``alloc_all_gather_outputs``), which is what the
  recomputed region is. A view of a graph input (``shard.detach()`` of a parameter) is
  recomputed from the input rather than saved: the same memory (a view owns none), and the
  backward sees the parameter, as the memory model needs to recognise FSDP's copy-in.
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


def _recompute_views(joint: torch.fx.GraphModule) -> int:
    """Tag every view of a recomputed value or of a graph input as recomputed (module docstring);
    returns how many."""
    tagged = 0
    for node in joint.graph.nodes:  # topological: a chain of views is tagged link by link
        if not (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
                and node.target.is_view and node.args and isinstance(node.args[0], torch.fx.Node)):
            continue
        base = node.args[0]
        primal = base.op == "placeholder" and not str(base.target).startswith("tangents")
        if (primal or partitioners.must_recompute(base)) and not partitioners.must_recompute(node):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            if "ac_graph_id" in base.meta:
                node.meta["ac_graph_id"] = base.meta["ac_graph_id"]
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
    _recompute_views(joint_module)
    original_dce, original_cleanup = partitioners.is_not_collective, partitioners.cleanup_recompute_tags

    def cleanup(joint: torch.fx.GraphModule, **kw: Any) -> torch.fx.GraphModule:
        # default_partition stashes a value at the boundary of two checkpointed regions; a value tagged
        # MUST_RECOMPUTE (FSDP's gathered parameters, entering a checkpointed block) stays recomputed
        must = [n for n in joint.graph.nodes if n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE
                and not n.meta.get("has_backward_hook", False)]
        out = original_cleanup(joint, **kw)
        for n in must:
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        return out

    partitioners.is_not_collective = lambda node: True  # its final DCE keeps unread collectives
    partitioners.cleanup_recompute_tags = cleanup
    try:
        return partitioners.default_partition(joint_module, joint_inputs, **kwargs)
    finally:
        partitioners.is_not_collective, partitioners.cleanup_recompute_tags = original_dce, original_cleanup


def partition_fn(name: str) -> Callable[..., Any]:
    """The AOTAutograd ``partition_fn`` of ``--partitioner`` value ``name`` (checked by the caller)."""
    return eager_partition if name == "eager" else partitioners.min_cut_rematerialization_partition
