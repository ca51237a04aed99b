"""What an executed operator is: names in a real PyTorch execution trace -> Flint's op classes.

There is ONE classifier, :func:`flint.capture.opclass.classify_aten`. This
module only maps the names a real trace records to the ATen / functional
collective targets that function takes, then calls it. The rules:

1. ``c10d::*`` process-group operators (what eager ``torch.distributed`` and
   FSDP2 call; on CPU/gloo they are ordinary host ops, not device kernels) map
   by name to the functional collective of the same semantics
   (:data:`C10D_TO_FUNCTIONAL`), e.g. ``c10d::_allgather_base_`` ->
   ``_c10d_functional.all_gather_into_tensor``. ``c10d::barrier`` and
   ``c10d::monitored_barrier`` are synchronization, not data movement: no class.
2. Any other ``ns::op`` name resolves to the overload ``torch.ops.ns.op.<overload>``
   named by the node's ``op_schema`` (``aten::add.Tensor(...)``); without one,
   to ``default`` or else the first overload.
   ``_c10d_functional::*`` (DTensor redistribution) resolves the same way.
3. Names without a resolvable operator (autograd nodes ``MmBackward0``,
   ``autograd::engine::evaluate_function: ...``, profiler labels ``FSDP::...``,
   ``Optimizer.step#AdamW.step``, gloo's own ``gloo:*`` records) have no class.
   ``gloo:*`` records are the backend's implementation of the c10d operator
   that encloses them (gloo runs ``reduce_scatter`` as an all-reduce, for
   instance), so counting them would count every collective twice.

One class is the validation's own: torch's multi-tensor ops (``_foreach_*``,
``_fused_adamw_``: the plan's ``optimizer_impl``), ``other`` to
``classify_aten`` (the cost model prices them apart), are compared as
``multi-tensor`` (:func:`validated_class`) on both sides.

Counting rule (:func:`innermost_of_class`): eager PyTorch nests operators
(``aten::linear`` calls ``aten::matmul`` calls ``aten::mm``; a DTensor op
records the op on the DTensor and again on its local tensors). A node counts
for its class only if no node below it has the same class, so each chain of
same-class calls counts once, at the op that does the work.

Collective bytes (:func:`collective_input_bytes`): the bytes of each rank's
*input* buffer (Chakra's ``comm_size``, what
:class:`flint.capture.StepSummary` counts): the schema argument named
``input_tensor`` / ``input`` / ``inputs`` / ``input_tensors`` / ``tensors`` /
``self``, first found in that order, summed over a tensor list.
"""

from __future__ import annotations

import ast
import math
import operator
from functools import lru_cache
from typing import Any, Sequence

import torch

from flint.capture import opclass

#: torch's multi-tensor ops, a class of the validation's own (see the module docstring)
MULTI_TENSOR = "multi-tensor"
#: The classes the validation compares, in report order.
COMPARED_CLASSES = (opclass.GEMM, opclass.ATTENTION, opclass.ELEMENTWISE, opclass.REDUCTION, MULTI_TENSOR,
                    opclass.ALL_REDUCE, opclass.ALL_GATHER, opclass.REDUCE_SCATTER, opclass.ALL_TO_ALL)
COMPARED_COLLECTIVES = (opclass.ALL_REDUCE, opclass.ALL_GATHER, opclass.REDUCE_SCATTER, opclass.ALL_TO_ALL)

#: c10d process-group operator -> functional collective operator of the same semantics.
C10D_TO_FUNCTIONAL = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce_coalesced",
    "_allgather_base_": "all_gather_into_tensor",
    "allgather_": "all_gather_into_tensor",
    "allgather_into_tensor_coalesced_": "all_gather_into_tensor_coalesced",
    "_reduce_scatter_base_": "reduce_scatter_tensor",
    "reduce_scatter_": "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter_tensor_coalesced",
    "alltoall_base_": "all_to_all_single",
    "alltoall_": "all_to_all_single",
    "broadcast_": "broadcast",
    "send": "isend",
    "recv_": "irecv",
}

_INPUT_ARGS = ("input_tensor", "input", "inputs", "input_tensors", "tensors", "self")

#: Bytes per element of the ET's tensor type strings ``Tensor(<c++ scalar type>)``.
_ELEMENT_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4,
                  "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1,
                  "c10::complex<float>": 8, "c10::complex<double>": 16,
                  "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1}


@lru_cache(maxsize=None)
def executed_target(name: str, op_schema: str = "") -> Any:
    """The ATen / functional-collective target an executed op name stands for, or ``None``."""
    ns, sep, op = name.partition("::")
    if not sep or not ns.isidentifier():
        return None
    if ns == "c10d":
        functional = C10D_TO_FUNCTIONAL.get(op)
        return getattr(torch.ops._c10d_functional, functional).default if functional else None
    overload = "default"
    if op_schema.startswith(name + "."):
        overload = op_schema[len(name) + 1:].split("(", 1)[0] or "default"
    try:
        packet = getattr(getattr(torch.ops, ns), op)
    except (AttributeError, RuntimeError):
        return None
    names = packet.overloads()
    if overload not in names:  # no (or an unknown) schema: any overload carries the op's tags
        if not names:
            return None
        overload = "default" if "default" in names else names[0]
    return getattr(packet, overload)


def validated_class(target: Any) -> str:
    """The class the validation counts an op target under: :func:`flint.capture.opclass.classify_aten`'s, or
    :data:`MULTI_TENSOR` for an ATen multi-tensor op."""
    from flint.cost.flops import is_multi_tensor

    cls = opclass.classify_aten(target)
    if cls == opclass.OTHER and target is not operator.getitem:
        ns, name = opclass._op_name(target)
        if ns == "aten" and is_multi_tensor(name):
            return MULTI_TENSOR
    return cls


def executed_class(name: str, op_schema: str = "") -> str:
    """The class of an executed op (:func:`validated_class` of its target)."""
    target = executed_target(name, op_schema)
    return validated_class(target) if target is not None else opclass.OTHER


def innermost_of_class(classes: Sequence[str], parents: Sequence[int]) -> list[bool]:
    """Which nodes count: a node counts unless a node below it (transitively) has its class.

    ``classes[i]`` is node i's class, ``parents[i]`` the index of its caller or -1.
    """
    below: list[set[str]] = [set() for _ in classes]
    for i, cls in enumerate(classes):
        if cls == opclass.OTHER:
            continue
        p = parents[i]
        while p >= 0 and cls not in below[p]:
            below[p].add(cls)
            p = parents[p]
    return [cls != opclass.OTHER and cls not in below[i] for i, cls in enumerate(classes)]


def _tensor_bytes(shape: Any, type_str: str) -> int:
    if type_str.startswith("GenericList[") and isinstance(shape, list):
        inner = type_str[len("GenericList["):-1].split(",")
        return sum(_tensor_bytes(s, inner[min(k, len(inner) - 1)]) for k, s in enumerate(shape))
    if not type_str.startswith("Tensor(") or not isinstance(shape, list):
        return 0
    scalar = type_str[len("Tensor("):-1]
    if scalar not in _ELEMENT_BYTES:
        raise ValueError(f"unknown tensor element type '{scalar}' in execution trace")
    if any(isinstance(s, list) for s in shape):
        return 0
    return math.prod(shape) * _ELEMENT_BYTES[scalar]


def collective_input_bytes(op_schema: str, shapes: Any, types: Any) -> int:
    """Bytes of a collective's input buffer from its schema and the ET's input shapes and types.

    ``shapes`` / ``types`` are the lists of an ET node's ``inputs`` (or their
    ``str()``, as ``chakra_converter`` stores them).
    """
    if isinstance(shapes, str):
        shapes = ast.literal_eval(shapes)
    if isinstance(types, str):
        types = ast.literal_eval(types)
    names = [a.name for a in torch._C.parse_schema(op_schema).arguments]
    for wanted in _INPUT_ARGS:
        if wanted in names:
            i = names.index(wanted)
            return _tensor_bytes(shapes[i], types[i]) if i < len(shapes) else 0
    return 0
