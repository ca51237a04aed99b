"""The one FLOP and byte count of an ATen op, from shapes, dtypes and scalar args.

FLOPs come from PyTorch's own formula registry
(``torch.utils.flop_counter.flop_registry``), so Flint counts exactly what
``FlopCounterMode`` counts: a multiply-add is 2 FLOPs, only matrix-multiply
work is counted (mm, addmm, bmm, baddbmm, _scaled_mm, convolutions and every
fused attention kernel, forward and backward), pointwise / norm / softmax /
reduction ops count 0 (they are memory bound; their time comes from bytes).
Causal masking is *not* discounted, as in PyTorch; :func:`op_cost` reports the
fraction of that work a causal kernel really executes, for timing only.
A few composite or newer ops PyTorch's registry lacks (``linear``,
``matmul``, ``mv``, ``dot``, ``addmv``, ``_grouped_mm``) use the same
2·M·N·K convention here.

Bytes are the sum of the op's input and output tensor bytes (each tensor read
or written once); metadata-only ops (class ``view``) move 0 bytes.

Multi-tensor ops (torch's ``_foreach_*`` ops and fused optimizers, ``_fused_adamw_``) work on tensor
lists, in place or not: their bytes are every tensor read, plus every tensor of the lists they write
and their results; their kernels are the launches of ATen's ``multi_tensor_apply``
(:func:`multi_tensor_launches`), which :class:`OpCost` carries as each launch's share of the elements.

Arguments
---------
``target``      ATen overload name: ``"aten.mm.default"``, ``"aten::mm"`` or ``"mm"``.
``in_shapes``   shapes of the op's tensor arguments in schema order; ``None``
                for an absent optional tensor; a list of shapes for a
                ``Tensor[]`` argument.
``out_shapes``  shapes of the op's tensor results.
``args``        the non-tensor arguments: a sequence in schema order or a
                mapping name -> value; missing ones take the schema default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterable, Mapping, Sequence

import sys

# torch is imported on first use (the FLOP registry, op schemas): commands that
# only read traces or print help start without it.

from flint.cost.dtypes import dtype_bytes, tensor_bytes
from flint.cost.opclass import ATTENTION, GEMM, VIEW, classify_target, split_target
from flint.errors import FlintError

Shape = Sequence[int]

_ATTN_FWD = {"_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
             "scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_attention_math"}
_ATTN_BWD = {"_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_efficient_attention_backward",
             "_scaled_dot_product_cudnn_attention_backward", "_flash_attention_backward",
             "_efficient_attention_backward", "_scaled_dot_product_flash_attention_for_cpu_backward"}


def _fc():
    from torch.utils import flop_counter

    return flop_counter


def _is_torch_dtype(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.dtype)


@lru_cache(maxsize=None)
def _schema(ns: str, name: str, overload: str):
    import torch

    packet = getattr(getattr(torch.ops, ns), name, None)
    if packet is None:
        return None, None
    try:
        op = getattr(packet, overload)
    except AttributeError:
        return packet, None
    return packet, op._schema


def _is_tensor_type(t: Any) -> tuple[bool, bool]:
    """(is a tensor argument, is a tensor list) for a schema argument type."""
    import torch

    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    if isinstance(t, torch.TensorType):
        return True, False
    if isinstance(t, torch.ListType):
        e = t.getElementType()
        if isinstance(e, torch.OptionalType):
            e = e.getElementType()
        return (True, True) if isinstance(e, torch.TensorType) else (False, False)
    return False, False


def _shape(s: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in s)


def _registry_args(schema, in_shapes: Sequence[Any], args: Sequence[Any] | Mapping[str, Any] | None
                   ) -> tuple[list[Any], dict[str, Any]]:
    """Positional and keyword-only arguments in schema order, tensors replaced by their shapes."""
    shapes = list(in_shapes)
    scalars = list(args) if isinstance(args, Sequence) and not isinstance(args, str) else None
    named = args if isinstance(args, Mapping) else {}
    out: list[Any] = []
    kwargs: dict[str, Any] = {}
    for a in schema.arguments:
        if a.kwarg_only:
            if a.name in named:
                kwargs[a.name] = named[a.name]
            continue
        is_t, is_list = _is_tensor_type(a.type)
        if is_t:
            v = shapes.pop(0) if shapes else None
            out.append(None if v is None else ([_shape(x) for x in v] if is_list else _shape(v)))
        elif scalars:
            out.append(scalars.pop(0))
        elif a.name in named:
            out.append(named[a.name])
        else:
            out.append(a.default_value if a.has_default_value() else None)
    return out, kwargs


def _scalar(schema, args, name: str, default: Any) -> Any:
    if schema is None or args is None:
        return default
    if isinstance(args, Mapping):
        return args.get(name, default)
    scalars = [a for a in schema.arguments if not _is_tensor_type(a.type)[0]]
    for a, v in zip(scalars, args):
        if a.name == name:
            return v
    return default


def _attention_shapes(target: str, in_shapes: Sequence[Any], n: int) -> list[tuple[int, ...]]:
    got = [s for s in in_shapes[:n]]
    if len(got) < n or any(s is None for s in got):
        raise FlintError(f"{target}: expected the first {n} tensor shapes (q, k, v{', grad_out' if n == 4 else ''}), got {list(in_shapes)}")
    shapes = [_shape(s) for s in got]
    if any(len(s) != 4 for s in shapes):
        raise FlintError(f"{target}: only dense [batch, heads, seq, head_dim] attention is supported, got shapes {shapes}")
    return shapes


def op_flops(target: str, in_shapes: Sequence[Any], out_shapes: Sequence[Shape] = (),
             args: Sequence[Any] | Mapping[str, Any] | None = None) -> int:
    """FLOPs of one call of ATen op ``target`` (see the module docstring)."""
    ns, name, overload = split_target(target)
    if ns != "aten":
        return 0
    if name in _ATTN_FWD:
        q, k, v = _attention_shapes(target, in_shapes, 3)
        return int(_fc().sdpa_flop_count(q, k, v))
    if name in _ATTN_BWD:
        go, q, k, v = _attention_shapes(target, in_shapes, 4)
        return int(_fc().sdpa_backward_flop_count(go, q, k, v))
    outs = [None if s is None else _shape(s) for s in out_shapes]  # None: an output the op skipped
    packet, schema = _schema(ns, name, overload)
    if packet is not None and packet in _fc().flop_registry and schema is not None:
        full, kwargs = _registry_args(schema, in_shapes, args)
        mask = _scalar(schema, args, "output_mask", None)
        if isinstance(mask, (list, tuple)) and len(outs) == sum(map(bool, mask)) < len(mask):
            # the IR keeps only the results the op computed (convolution_backward of a layer whose input
            # needs no gradient): put them back at their positions, as torch's formula indexes them
            it = iter(outs)
            outs = [next(it) if m else None for m in mask]
        out_val = outs[0] if len(outs) == 1 else tuple(outs)
        return int(_fc().flop_registry[packet](*full, out_val=out_val, **kwargs))
    return _extra_flops(name, [None if s is None else _shape(s) for s in in_shapes if not isinstance(s, list)], outs)


def _extra_flops(name: str, ins: list, outs: list) -> int:
    """Matrix-multiply ops PyTorch's registry does not cover (2 FLOPs per multiply-add). ``None`` in ``outs``:
    an output the op skipped (``native_layer_norm_backward``'s input gradient of an input needing none)."""
    if name == "linear":  # input [..., K], weight [N, K]
        x, w = ins[0], ins[1]
        return 2 * math.prod(x[:-1]) * x[-1] * w[0]
    if name == "matmul":
        a = ins[0]
        return 2 * math.prod(outs[0]) * a[-1] if outs else 0
    if name in ("mv", "addmv"):
        m = ins[0] if name == "mv" else ins[1]
        return 2 * m[0] * m[1]
    if name == "dot":
        return 2 * ins[0][0]
    if name in ("_grouped_mm", "_scaled_grouped_mm"):
        a, b = ins[0], ins[1]
        if len(a) == 2 and len(b) == 2:  # [K, T] x [T, N] -> [G, K, N] (weight gradient)
            return 2 * a[0] * a[1] * b[1]
        return 2 * math.prod(outs[0]) * a[-1]
    return 0


def _flatten(shapes: Sequence[Any], dtypes: Sequence[Any] | Any) -> list[tuple[tuple[int, ...], Any]]:
    if dtypes is None or (isinstance(dtypes, str) or _is_torch_dtype(dtypes)):
        dtypes = [dtypes] * len(shapes)
    out = []
    for s, d in zip(shapes, dtypes):
        if s is None:
            continue
        if isinstance(s, list) and (not s or not isinstance(s[0], int)):
            ds = d if isinstance(d, (list, tuple)) else [d] * len(s)
            out.extend((_shape(x), dx) for x, dx in zip(s, ds))
        else:
            out.append((_shape(s), d))
    return out


def _first(dtypes: Sequence[Any] | Any) -> Any:
    """The first operand's dtype of a per-operand list, or the one dtype given for all."""
    return dtypes[0] if isinstance(dtypes, (list, tuple)) else dtypes


def op_bytes(in_shapes: Sequence[Any], in_dtypes: Sequence[Any] | Any,
             out_shapes: Sequence[Shape], out_dtypes: Sequence[Any] | Any) -> int:
    """Bytes an op moves: the sum of its input and output tensor bytes.

    ``in_dtypes`` / ``out_dtypes`` are one dtype per shape or a single dtype
    for all; ``None`` shapes (absent optional tensors) are skipped.
    """
    pairs = _flatten(in_shapes, in_dtypes) + _flatten(out_shapes, out_dtypes)
    if any(d is None for _, d in pairs):
        raise FlintError("op_bytes needs a dtype for every tensor")
    return sum(tensor_bytes(s, d) for s, d in pairs)


# Functional scatters whose ``self`` operand PyTorch updates in place when nothing else reads it: the
# captured (functionalized) graph has the out-of-place form, but eager autograd runs gather's backward as
# ``grad.new_zeros(self.sizes()).scatter_add_(dim, index, grad)`` (ATen TensorAdvancedIndexing.cpp,
# gather_backward)
# and inductor's reinplace pass turns such a scatter back into the in-place one.
INPLACE_SCATTERS = frozenset({"aten.scatter_add.default", "aten.scatter.src"})


def inplace_scatter_bytes(in_shapes: Sequence[Any], in_dtypes: Sequence[Any]) -> int:
    """Bytes of a scatter (tensor operands ``self, index, src``) run in place on ``self``: it reads the
    index and the source elements it uses and read-modify-writes the ``numel(index)`` elements of
    ``self`` they target, never the rest of ``self``."""
    (self_shape, index_shape, _src_shape), (self_dtype, index_dtype, src_dtype) = in_shapes[:3], in_dtypes[:3]
    touched = math.prod(int(d) for d in index_shape)
    return (tensor_bytes(index_shape, index_dtype) + touched * dtype_bytes(src_dtype)
            + 2 * touched * dtype_bytes(self_dtype))


# Gathers read only the elements they select from their source (the first tensor operand), one per
# output element, plus the whole index: an embedding lookup of 4,096 tokens reads 4,096 rows of its
# table, not the table (ATen's gather / index_select / indexing kernels load ``src[index]`` per output
# element; inductor generates the same indirect load).
GATHERS = frozenset({"aten.gather.default", "aten.index_select.default", "aten.embedding.default",
                     "aten.index.Tensor", "aten._unsafe_index.Tensor"})


def gathered_bytes(src_bytes: int, src_dtype: Any, out_numel: int) -> int:
    """Bytes a gather reads from a source of ``src_bytes``: one element per output element, at most
    the whole source."""
    return min(src_bytes, out_numel * dtype_bytes(src_dtype))


# Multi-tensor ops. The importer records each Tensor[] argument's length in the op's args under LIST_SIZES (the
# IR flattens the lists into its operands).
LIST_SIZES = "list_sizes"
_MULTI_TENSOR_PREFIXES = ("_foreach_", "_fused_adam")
# ATen's multi_tensor_apply (native/cuda/MultiTensorApply.cuh, the 32 KB kernel-argument configuration every
# CUDA >= 12.1 build on Volta or newer takes): each block handles one chunk of 65,536 elements of one tensor;
# a launch ends when its blocks (2,240) or its tensors (by the number of lists it touches, the "depth") are full.
MTA_CHUNK = 65536
MTA_MAX_BLOCKS = 2240
MTA_MAX_TENSORS = (770, 448, 336, 252, 210)
MTA_MAX_TENSORS_SCALARLIST = (672, 448, 336, 252, 210)  # ops taking a list of scalars keep them in the launch
# Tensor[] arguments a fused optimizer writes (its schema marks the gradients mutable too; the kernel stores
# them only to unscale them, with a grad_scale, which Flint's captures never pass)
_FUSED_WRITES = frozenset({"self", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"})


def is_multi_tensor(name: str) -> bool:
    """Whether ATen op ``name`` (``_foreach_mul_``, ``_fused_adamw_``) is a multi-tensor op."""
    return name.startswith(_MULTI_TENSOR_PREFIXES)


def multi_tensor_launches(numels: Sequence[int], depth: int, scalar_list: bool = False) -> list[int]:
    """The elements each kernel launch of ``multi_tensor_apply`` covers, over tensors of ``numels`` elements
    (the first list's) and ``depth`` lists (MultiTensorApply.cuh's loop: a launch when the blocks fill, or the
    tensors do at a tensor's last chunk; an empty tensor is skipped)."""
    max_tensors = (MTA_MAX_TENSORS_SCALARLIST if scalar_list else MTA_MAX_TENSORS)[min(max(depth, 1), 5) - 1]
    launches: list[int] = []
    blocks = tensors = elems = 0
    for numel in numels:
        if numel <= 0:
            continue
        tensors += 1
        chunks = -(-numel // MTA_CHUNK)
        done = 0
        while done < chunks:
            take = min(chunks - done, MTA_MAX_BLOCKS - blocks)
            last = done + take == chunks
            elems += min(numel, (done + take) * MTA_CHUNK) - done * MTA_CHUNK
            blocks += take
            done += take
            if blocks == MTA_MAX_BLOCKS or (tensors == max_tensors and last):
                launches.append(elems)
                blocks = elems = 0
                tensors = 0 if last else 1
    if blocks:
        launches.append(elems)
    return launches


def optimizer_form(names: Iterable[str]) -> str | None:
    """The form of torch's AdamW (plan field ``optimizer_impl``) a program's optimizer-phase ops run, from their
    ATen op names: ``fused`` (a ``_fused_adamw_``), ``foreach`` (multi-tensor ops), else ``for-loop``; None
    without optimizer ops."""
    names = list(names)
    if not names:
        return None
    if any(n.startswith("_fused_adam") for n in names):
        return "fused"
    return "foreach" if any(is_multi_tensor(n) for n in names) else "for-loop"


@dataclass(frozen=True)
class TensorList:
    """One ``Tensor[]`` argument of a multi-tensor op: its schema name, its first operand and length (the IR
    flattens lists into the operands, in schema order, single tensors after them), whether the op writes it."""

    name: str
    start: int
    size: int
    written: bool


def tensor_lists(target: str, args: Mapping[str, Any] | None) -> list[TensorList]:
    """The tensor lists of multi-tensor op ``target`` from ``args[LIST_SIZES]`` (the importer's record of their
    lengths). Written: by the schema's alias info, except a fused optimizer's gradients, which its schema marks
    mutable but its kernel only writes to unscale them (with a ``grad_scale``, which Flint's captures never
    pass)."""
    ns, name, overload = split_target(target)
    _, schema = _schema(ns, name, overload)
    sizes = list((args or {}).get(LIST_SIZES) or [])
    list_args = [a for a in schema.arguments if _is_tensor_type(a.type)[1]] if schema is not None else []
    if len(sizes) != len(list_args):
        raise FlintError(f"{target}: a multi-tensor op needs the lengths of its {len(list_args)} tensor lists "
                         f"(args '{LIST_SIZES}'), got {sizes}")
    fused = name.startswith("_fused_adam")
    out, pos = [], 0
    for a, k in zip(list_args, sizes):
        written = a.name in _FUSED_WRITES if fused else a.alias_info is not None and a.alias_info.is_write
        out.append(TensorList(a.name, pos, k, written))
        pos += k
    return out


def _multi_tensor_cost(target: str, in_shapes: Sequence[Any], in_dtypes: Sequence[Any] | Any,
                       out_shapes: Sequence[Shape], out_dtypes: Sequence[Any] | Any,
                       args: Mapping[str, Any] | None) -> "OpCost":
    """Bytes and launches of a multi-tensor op (module docstring): every tensor read, the lists it writes
    (:func:`tensor_lists`) and its results."""
    _, name, overload = split_target(target)
    pairs = _flatten(in_shapes, in_dtypes)
    outs = _flatten(out_shapes, out_dtypes)
    nbytes = sum(tensor_bytes(sh, d) for sh, d in pairs + outs)
    first: list[int] = []
    depth = 0
    for lst in tensor_lists(target, args):
        members = pairs[lst.start:lst.start + lst.size]
        if not lst.size:
            continue
        depth += 1
        if not first:
            first = [math.prod(sh) for sh, _ in members]
        if lst.written:
            nbytes += sum(tensor_bytes(sh, d) for sh, d in members)
    if outs and name != "_foreach_norm":
        depth += 1  # an out-of-place op writes a list of results
    launches = multi_tensor_launches(first, depth, overload.endswith("ScalarList")) or [0]
    if name == "_foreach_norm":  # its per-tensor partial sums are finished by one more kernel (lpnorm_cleanup)
        launches.append(0)
    total = sum(launches) or 1
    return OpCost(classify_target(target), 0, nbytes, kernel_shares=tuple(e / total for e in launches))


@dataclass(frozen=True)
class OpCost:
    """The cost inputs of one op call.

    ``flops``          model FLOPs (PyTorch's count).
    ``bytes``          bytes read + written.
    ``op_class``       which efficiency factor applies.
    ``work_fraction``  the fraction of ``flops`` the kernel executes (0.5-ish
                       for causal attention, else 1); use ``flops *
                       work_fraction`` for timing and ``flops`` for MFU.
    ``gemm_dims``      ``(batch, m, n, k)`` of a matrix product, for the GEMM
                       shape model (:mod:`flint.cost.compute`); None otherwise.
    ``attention_seq``  ``(key length, is backward)`` of a fused attention kernel.
    ``attention_kernel`` which fused attention kernel runs: ``flash`` (PyTorch's default
                       ``scaled_dot_product_attention`` backend) or ``cudnn``.
    ``attention_dropout`` whether that kernel applies dropout (``dropout_p > 0``).
    ``kernel_shares``  a multi-tensor op's launches (:func:`multi_tensor_launches`), each one's share of
                       its bytes; empty for an op of one kernel.
    """

    op_class: str
    flops: int
    bytes: int
    work_fraction: float = 1.0
    gemm_dims: tuple[int, int, int, int] | None = None  # (batch, m, n, k) of a matrix product
    attention_seq: tuple[int, bool] | None = None        # (key length, backward) of fused attention
    attention_kernel: str = "flash"                      # the attention-kernel pass's choice
    attention_dropout: bool = False                      # the fused attention kernel applies dropout
    # a multi-tensor op's kernel launches, each one's share of its elements (and bytes); () for one kernel
    kernel_shares: tuple[float, ...] = ()


def op_cost(target: str, in_shapes: Sequence[Any], in_dtypes: Sequence[Any] | Any, out_shapes: Sequence[Shape],
            out_dtypes: Sequence[Any] | Any, args: Sequence[Any] | Mapping[str, Any] | None = None) -> OpCost:
    """FLOPs, bytes and op class of one op call (``view`` ops cost nothing)."""
    cls = classify_target(target)
    if cls == VIEW:
        return OpCost(cls, 0, 0)
    if is_multi_tensor(split_target(target)[1]):
        return _multi_tensor_cost(target, in_shapes, in_dtypes, out_shapes, out_dtypes,
                                  args if isinstance(args, Mapping) else None)
    flops = op_flops(target, in_shapes, out_shapes, args)
    nbytes = op_bytes(in_shapes, in_dtypes, out_shapes, out_dtypes)
    if target in GATHERS and in_shapes and out_shapes:
        (src_shape, src_dtype), = _flatten(in_shapes[:1], _first(in_dtypes))
        src = tensor_bytes(src_shape, src_dtype)
        nbytes += gathered_bytes(src, src_dtype, math.prod(_shape(out_shapes[0]))) - src
    frac = 1.0
    dims = attn = None
    dropout = False
    if cls == GEMM:
        dims = gemm_dims(target, in_shapes, out_shapes)
    if cls == ATTENTION:
        ns, name, overload = split_target(target)
        _, schema = _schema(ns, name, overload)
        backward = name in _ATTN_BWD
        if name in _ATTN_FWD or backward:
            q = _shape(in_shapes[1] if backward else in_shapes[0])
            k = _shape(in_shapes[2] if backward else in_shapes[1])
            if len(q) == 4 and len(k) == 4:
                attn = (k[2], backward)
            p = _scalar(schema, args, "dropout_p", 0.0)
            dropout = isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0
        if _scalar(schema, args, "is_causal", False):
            q = _shape(in_shapes[1] if name in _ATTN_BWD else in_shapes[0])
            k = _shape(in_shapes[2] if name in _ATTN_BWD else in_shapes[1])
            s_q, s_k = q[2], k[2]
            # PyTorch's causal mask is top-left aligned: query row i sees min(i + 1, s_k) keys
            if s_q <= s_k:
                seen = s_q * (s_q + 1) // 2
            else:
                seen = s_k * (s_k + 1) // 2 + (s_q - s_k) * s_k
            frac = seen / (s_q * s_k)
    return OpCost(cls, flops, nbytes, frac, dims, attn, attention_dropout=dropout)


def gemm_dims(target: str, in_shapes: Sequence[Any], out_shapes: Sequence[Shape]) -> tuple[int, int, int, int] | None:
    """``(batch, m, n, k)`` of a matrix-product op from its operand shapes (None if not one Flint knows)."""
    _, name, _ = split_target(target)
    ins = [None if s is None else _shape(s) for s in in_shapes if not isinstance(s, list)]
    try:
        if name in ("mm", "_scaled_mm"):
            (m, k), (_, n) = ins[0], ins[1]
            return 1, m, n, k
        if name == "addmm":
            (m, k), (_, n) = ins[1], ins[2]
            return 1, m, n, k
        if name in ("bmm", "baddbmm"):
            a, b = (ins[0], ins[1]) if name == "bmm" else (ins[1], ins[2])
            return a[0], a[1], b[2], a[2]
        if name == "linear":
            x, w = ins[0], ins[1]
            return 1, math.prod(x[:-1]), w[0], x[-1]
        if name == "matmul" and out_shapes:
            a, out = ins[0], _shape(out_shapes[0])
            if len(out) >= 2:
                return math.prod(out[:-2]) or 1, out[-2], out[-1], a[-1]
        if name in ("_grouped_mm", "_scaled_grouped_mm"):
            a, b = ins[0], ins[1]
            if len(a) == 2 and len(b) == 3:  # [T, K] x [G, K, N]: G products of T/G rows on average
                return b[0], max(a[0] // b[0], 1), b[2], a[1]
            if len(a) == 2 and len(b) == 2:  # [K, T] x [T, N] -> [G, K, N]
                g = _shape(out_shapes[0])[0] if out_shapes else 1
                return g, a[0], b[1], max(a[1] // g, 1)
    except (IndexError, TypeError, ValueError):
        return None
    return None
