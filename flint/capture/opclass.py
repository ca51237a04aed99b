"""Operator classes: the one set of rules saying what kind of work an FX node does.

:func:`classify_aten` maps an FX ``call_function`` target (an ATen or
functional-collective ``OpOverload``) to a class name. The capture summary,
the importer and validation against real traces all use this function, so
"how many GEMMs / all-gathers" means the same everywhere.
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Any

import torch

from flint.opclasses import (  # noqa: F401  (re-exported: the classes this module assigns)
    ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, ATTENTION, BROADCAST, COLLECTIVES, ELEMENTWISE, GEMM, MEMORY, OTHER, RECV,
    REDUCE_SCATTER, REDUCTION, SEND, VIEW, WAIT,
)

_COLLECTIVE_OPS = {
    "all_gather_into_tensor": ALL_GATHER,
    "all_gather_into_tensor_coalesced": ALL_GATHER,
    "all_gather_into_tensor_out": ALL_GATHER,
    "reduce_scatter_tensor": REDUCE_SCATTER,
    "reduce_scatter_tensor_coalesced": REDUCE_SCATTER,
    "all_reduce": ALL_REDUCE,
    "all_reduce_": ALL_REDUCE,
    "all_reduce_coalesced": ALL_REDUCE,
    "all_to_all_single": ALL_TO_ALL,
    "broadcast": BROADCAST,
    "broadcast_": BROADCAST,
    "isend": SEND,
    "irecv": RECV,
    "wait_tensor": WAIT,
}
_GEMM_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addbmm", "_scaled_mm",
             "convolution", "convolution_backward", "_grouped_mm", "dot", "mv", "addmv"}
_ATTENTION_PREFIXES = ("_scaled_dot_product", "_flash_attention", "_efficient_attention",
                       "scaled_dot_product_attention", "_cudnn_attention")
_VIEW_OPS = {"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "squeeze",
             "unsqueeze", "slice", "select", "split", "split_with_sizes", "detach", "alias",
             "as_strided", "unflatten", "flatten", "unbind", "chunk", "narrow", "view_as",
             "_reshape_alias", "lift_fresh", "lift_fresh_copy"}
_MEMORY_OPS = {"clone", "cat", "stack", "copy", "copy_", "_to_copy", "index", "index_select",
               "gather", "scatter", "scatter_add", "index_add", "index_put", "embedding",
               "embedding_dense_backward", "slice_backward", "select_backward", "new_zeros",
               "new_empty", "new_ones", "zeros", "ones", "zeros_like", "ones_like", "empty_like",
               "full", "full_like", "empty", "empty_strided", "arange", "constant_pad_nd",
               "repeat_interleave", "repeat", "split_with_sizes_copy", "contiguous", "fill",
               "fill_", "zero_", "_unsafe_index", "_unsafe_index_put", "index_put_",
               "scalar_tensor", "sort", "argsort", "topk"}
_REDUCTION_OPS = {"sum", "mean", "amax", "amin", "max", "min", "_softmax", "_log_softmax",
                  "_softmax_backward_data", "_log_softmax_backward_data", "nll_loss_forward",
                  "nll_loss_backward", "native_layer_norm", "native_layer_norm_backward",
                  "var_mean", "var", "std", "norm", "linalg_vector_norm", "prod", "argmax",
                  "argmin", "logsumexp", "_safe_softmax", "_fused_rms_norm", "_fused_rms_norm_backward", "cumsum"}


def _op_name(target: Any) -> tuple[str, str]:
    """(namespace, operator name without overload) of an OpOverload / OpOverloadPacket."""
    schema_name = getattr(getattr(target, "_schema", None), "name", None)
    if schema_name is None:
        return "", getattr(target, "__name__", str(target))
    ns, _, name = schema_name.partition("::")
    return ns, name


def classify_aten(target: Any) -> str:
    """The class of an FX call_function target.

    Rules, in order: functional collectives by operator name (``all_gather``,
    ``reduce_scatter``, ``all_reduce``, ``all_to_all``, ``broadcast``,
    ``send``, ``recv``, ``wait``); matrix products (``gemm``); fused
    scaled-dot-product attention forward and backward (``attention``); views
    and aliases (``view``, no data moved); copies, gathers, scatters, factory
    ops and sorting (``memory``); reductions incl. softmax, norms and losses
    (``reduction``); ops tagged pointwise (``elementwise``); anything else,
    including ``operator.getitem``, is ``other``.
    """
    if target is operator.getitem:
        return OTHER
    ns, name = _op_name(target)
    if ns in ("_c10d_functional", "c10d_functional", "_dtensor"):
        return _COLLECTIVE_OPS.get(name, OTHER)
    if ns not in ("aten", "prims"):
        return OTHER
    base = name.rstrip("_") if name not in _MEMORY_OPS else name
    if name in _GEMM_OPS:
        return GEMM
    if name.startswith(_ATTENTION_PREFIXES):
        return ATTENTION
    if name in _VIEW_OPS or getattr(target, "is_view", False):
        return VIEW
    if name in _MEMORY_OPS or base in _MEMORY_OPS:
        return MEMORY
    tags = getattr(target, "tags", ())
    if name in _REDUCTION_OPS or base in _REDUCTION_OPS or torch.Tag.reduction in tags:
        return REDUCTION
    if torch.Tag.pointwise in tags:
        return ELEMENTWISE
    packet = getattr(target, "overloadpacket", None)
    if packet is not None and torch.Tag.pointwise in getattr(getattr(packet, "default", None), "tags", ()):
        return ELEMENTWISE
    return OTHER


def _val(arg: Any) -> Any:
    if isinstance(arg, torch.fx.Node):
        return arg.meta.get("val")
    if isinstance(arg, (list, tuple)):
        return type(arg)(_val(a) for a in arg)
    return arg


def node_flops(node: torch.fx.Node) -> int:
    """FLOPs of one FX node: the one FLOP count, :func:`flint.cost.op_flops`, on its shapes."""
    from flint.cost.flops import op_flops

    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return 0
    in_shapes: list[Any] = []
    named: dict[str, Any] = {}
    bound = list(zip(target._schema.arguments, node.args)) + [
        (a, node.kwargs[a.name]) for a in target._schema.arguments if a.name in node.kwargs]
    for sarg, arg in bound:
        val = _val(arg)
        if isinstance(val, torch.Tensor):
            in_shapes.append(tuple(val.shape))
        elif isinstance(val, (list, tuple)) and val and all(isinstance(v, torch.Tensor) for v in val):
            in_shapes.append([tuple(v.shape) for v in val])
        else:
            named[sarg.name] = val
    out = node.meta.get("val")
    # keep the positions of skipped (None) outputs: convolution_backward's (None, grad_weight, grad_bias)
    outs = [out] if isinstance(out, torch.Tensor) else [v if isinstance(v, torch.Tensor) else None
                                                         for v in (out or ())]
    return op_flops(f"{target.namespace}.{target._opname}.{target._overloadname}", in_shapes,
                    [None if v is None else tuple(v.shape) for v in outs], named)


def tensor_bytes(val: Any) -> int:
    """Bytes of a tensor (or the sum over a list of tensors)."""
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(tensor_bytes(v) for v in val)
    return 0


def collective_group(node: torch.fx.Node) -> str | None:
    """The ``group_name`` argument of a functional-collective node."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    for i, arg in enumerate(schema.arguments):
        if arg.name == "group_name":
            return node.kwargs.get("group_name", node.args[i] if i < len(node.args) else None)
    return None


def count_classes(gm: torch.fx.GraphModule) -> Counter:
    """Number of call_function nodes of ``gm`` per class."""
    return Counter(classify_aten(n.target) for n in gm.graph.nodes if n.op == "call_function")
