"""Context parallelism: fused attention over a sequence split along the ``cp`` mesh axis.

What PyTorch 2.13 runs (``torch.distributed.tensor.experimental._context_parallel._attention``,
``_templated_ring_attention`` and ``_templated_ring_attention_backward`` with the default
``_cp_options``: ``rotate_method = ALL_GATHER``, ``enable_load_balance = True``,
``convert_to_f32 = True``), and what this module emits for one attention op whose
query sequence dim is split over ``cp`` (``S`` tokens, ``cp`` ranks, local length
``L = S / cp``, ``n`` = elements of the local K):

Sharding of the sequence: the head-tail load balancer (``_HeadTailLoadBalancer``)
gives rank ``r`` the chunks ``r`` and ``2cp - 1 - r`` of ``2cp`` equal chunks, so
every rank does the same causal work. The SPMD program holds the local length
``L``; which chunks a rank holds does not change any shape.

Forward (``cp`` attention calls per rank):
  - ``cat(k.flatten(), v.flatten())`` and ONE ``dist.all_gather`` of it over ``cp``
    (``_AllGatherRotater``: ``2n`` elements in, ``2n * cp`` out, K/V dtype);
  - step 0: attention of the local ``q`` with the local ``k, v``, ``is_causal=True``;
  - steps ``i = 1 .. cp-1``: the K/V of rank ``r - i`` sliced from the gathered
    buffer, attention without mask on half of the work: ranks with ``i <= r`` use the
    first half of that K/V (``q`` [L] x ``k`` [L/2]), ranks with ``i > r`` the second
    half of their ``q`` (``q`` [L/2] x ``k`` [L]). Both are ``L * L/2`` query-key pairs;
    the SPMD program shows the first form for every step (a rank running the second
    form merges into half of its output and re-concatenates it: the same FLOPs,
    slightly different bytes);
  - the ``_SDPAMerger`` update in float32 after every step:
    ``out = out - sigmoid(lse_i - lse) * (out - out_i)``,
    ``lse = lse - logsigmoid(lse - lse_i)``.

Backward (``cp`` attention-backward calls per rank):
  - the K/V all-gathered again (the forward's gathered buffer is not saved);
  - float32 accumulators ``zeros_like(q/k/v)``;
  - step ``i``: the attention backward on the same pieces as forward step ``i``;
    the running K/V gradient (float32, ``2n`` elements) is passed around the ring
    with ``_AllToAllRotater`` (``permute_tensor``: every rank sends to ``r + 1`` and
    receives from ``r - 1``), emitted as ``dist.send`` offset +1 / ``dist.recv``
    offset -1 along ``cp``: ``cp`` hops per attention backward, so each K/V gradient
    arrives back at its owner after a full turn;
  - the received partial K/V gradient gets this step's contribution added
    (``_partial_update``: to its first half when ``i <= r``).

Work: with the causal mask, the query-key pairs a rank computes are
``L(L/2 + 1/2)`` (step 0, causal on ``L``) plus ``(cp-1) L^2/2``, and ``cp`` times
that is exactly ``S(S+1)/2``, the single device's causal pairs. PyTorch's FLOP
formula (the one Flint counts with) ignores the mask, so the per-rank attention
FLOPs x ``cp`` are ``(cp+1) / (2 cp)`` of the single device's *counted* attention
FLOPs, while the causal work (what the cost model times: the causal fraction of
a masked call) is conserved exactly. Non-causal attention (no load balancing, as
PyTorch requires) runs every step on the full local ``q`` and full received K/V.

Not emitted: the ring loop's ``cat`` of K/V for steps whose result the all-gather
rotater ignores (dead code under ``torch.compile``), and the ``.to(float32)`` of
values already float32 (no op in PyTorch either).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from xdsl.dialects.builtin import ArrayAttr, BoolAttr, FlatSymbolRefAttr, IntegerAttr, NoneType, StringAttr, TensorType, \
    f32, i64
from xdsl.ir import Attribute, SSAValue

from flint.ir import dist
from flint.ir.aten import AtenOp
from flint.sharding.spec import Sharding

if TYPE_CHECKING:
    from flint.sharding.engine import FunctionExpander

# attention ops whose operands CP knows: forward (q, k, v, ...), backward (dout, q, k, v, out, lse, ...)
CP_FORWARD = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention")
CP_BACKWARD = ("_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_flash_attention_backward")
SEQ_DIM = 2  # [batch, heads, seq, head_dim], as PyTorch's ring attention hard-codes


def _shape(v: SSAValue) -> list[int]:
    return list(v.type.get_shape())


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def query_split(ex: "FunctionExpander", op: AtenOp) -> bool:
    """Whether the attention op's query arrives with its sequence split over a ``cp`` axis."""
    name = op.overload.split(".")[1]
    if name in CP_FORWARD:
        q = op.inputs[0]
    elif name in CP_BACKWARD:
        q = op.inputs[1]
    else:
        q = next((v for v in op.inputs if isinstance(v.type, TensorType) and len(_shape(v)) == 4), None)
    if q is None or q not in ex.env or len(_shape(q)) != 4:
        return False
    return any(a in ex.cp_axes for a in ex.sharding(q).dims[SEQ_DIM])


class _Builder:
    """Emits aten ops carrying the original op's phase, module and location."""

    def __init__(self, ex: "FunctionExpander", op: AtenOp):
        self.ex, self.op = ex, op

    def aten(self, target: str, inputs: Sequence[SSAValue], out_types: Sequence[TensorType],
             args: dict | None = None) -> list[SSAValue]:
        attrs: dict[str, Attribute] = {}
        for k, v in (args or {}).items():
            if isinstance(v, Attribute):
                attrs[k] = v
            elif isinstance(v, bool):
                attrs[k] = BoolAttr.from_bool(v)
            elif isinstance(v, (list, tuple)):
                attrs[k] = ArrayAttr([IntegerAttr(x, i64) for x in v])
            elif isinstance(v, str):
                attrs[k] = StringAttr(v)
            else:
                attrs[k] = IntegerAttr(v, i64)
        o = self.op
        new = AtenOp(target, list(inputs), list(out_types), args=attrs or None,
                     phase=o.phase.data if o.phase else None, module=o.module.data if o.module else None)
        new.location = o.location
        self.ex.emit(new)
        return list(new.outputs)

    def one(self, target: str, inputs: Sequence[SSAValue], out_type: TensorType, **args) -> SSAValue:
        return self.aten(target, inputs, [out_type], args)[0]

    def view(self, v: SSAValue, shape: Sequence[int]) -> SSAValue:
        return self.one("aten.view.default", [v], TensorType(v.type.element_type, list(shape)), size=list(shape))

    def slice(self, v: SSAValue, dim: int, start: int, end: int) -> SSAValue:
        shp = _shape(v)
        shp[dim] = end - start
        return self.one("aten.slice.Tensor", [v], TensorType(v.type.element_type, shp), dim=dim, start=start, end=end)

    def cat(self, vs: Sequence[SSAValue], dim: int) -> SSAValue:
        shp = _shape(vs[0])
        shp[dim] = sum(_shape(v)[dim] for v in vs)
        return self.one("aten.cat.default", vs, TensorType(vs[0].type.element_type, shp), dim=dim)

    def binary(self, target: str, a: SSAValue, b: SSAValue) -> SSAValue:
        sa, sb = _shape(a), _shape(b)
        out = [max(x, y) for x, y in zip(sa, sb)] if len(sa) == len(sb) else (sa if len(sa) > len(sb) else sb)
        return self.one(target, [a, b], TensorType(a.type.element_type, out))

    def to(self, v: SSAValue, dtype: Attribute) -> SSAValue:
        if v.type.element_type == dtype:
            return v  # .to() of the same dtype returns the tensor itself: no op
        name = {"f32": "torch.float32", "bf16": "torch.bfloat16", "f16": "torch.float16"}.get(str(dtype), str(dtype))
        return self.one("aten._to_copy.default", [v], TensorType(dtype, _shape(v)), dtype=name)

    def flat_kv(self, k: SSAValue, v: SSAValue) -> SSAValue:
        return self.cat([self.view(k, [_numel(_shape(k))]), self.view(v, [_numel(_shape(v))])], 0)

    def kv_of(self, buf: SSAValue, k_shape: Sequence[int], v_shape: Sequence[int]) -> tuple[SSAValue, SSAValue]:
        nk, nv = _numel(k_shape), _numel(v_shape)
        return (self.view(self.slice(buf, 0, 0, nk), k_shape), self.view(self.slice(buf, 0, nk, nk + nv), v_shape))


def _gather_kv(b: _Builder, kv: SSAValue) -> SSAValue:
    ex = b.ex
    n = _shape(kv)[0]
    t = TensorType(kv.type.element_type, [n * ex._n(ex.cp_axes)])
    return ex._coll(dist.AllGatherOp(kv, ex.grid, ex._ids(ex.cp_axes), dist.FutureType(t), gather_dim=0))


def _args(op: AtenOp, causal: bool) -> dict:
    args = dict(op.args.data) if op.args is not None else {}
    args["is_causal"] = BoolAttr.from_bool(causal)
    return args


def _is_causal(op: AtenOp) -> bool:
    a = op.args.data.get("is_causal") if op.args is not None else None
    return isinstance(a, IntegerAttr) and bool(a.value.data)


def _local(ex: "FunctionExpander", op: AtenOp, idx: Sequence[int], why: str) -> tuple[list[SSAValue], Sharding]:
    """Operands ``idx`` of ``op`` laid out as [batch (dp), heads (tp), seq (cp), -] (rank 3: no last dim)."""
    ref = op.inputs[idx[1] if len(idx) > 1 and len(_shape(op.inputs[idx[0]])) != 4 else idx[0]]
    s = ex.sharding(ref)
    bsz = s.dims[0]
    heads = tuple(x for x in s.dims[1] if x not in bsz)
    seq = tuple(ex.cp_axes)
    out = []
    for i in idx:
        v = op.inputs[i]
        r = len(_shape(v))
        want = Sharding((bsz, heads, seq) + ((),) * (r - 3)) if r >= 3 else Sharding.replicated(r)
        nv = ex.value(v, want, why)
        if nv is not ex.env[v][0]:
            ex.gemm_variant.setdefault(v, nv)
        out.append(nv)
    return out, Sharding((bsz, heads, seq, ()))


def _sdpa_types(op: AtenOp, q_shape: Sequence[int], v_last: int, local_rest: list[TensorType]) -> list[TensorType]:
    out_t, lse_t = op.outputs[0].type, op.outputs[1].type
    return [TensorType(out_t.element_type, list(q_shape[:3]) + [v_last]),
            TensorType(lse_t.element_type, list(q_shape[:3]))] + local_rest


def _rest_types(ex: "FunctionExpander", op: AtenOp, s: Sharding, first: int) -> list[TensorType]:
    """Local types of outputs past ``first`` (rank >= 3: split like the attention, else kept)."""
    out = []
    for r in op.outputs[first:]:
        shp = _shape(r)
        if len(shp) >= 3:
            rs = Sharding(s.dims[:3] + ((),) * (len(shp) - 3))
            out.append(TensorType(r.type.element_type, rs.local_shape(shp, ex.sizes)))
        else:
            out.append(r.type)
    return out


def expand_forward(ex: "FunctionExpander", op: AtenOp) -> None:
    why = f"'{op.overload}' (context parallel)"
    (q, k, v), s = _local(ex, op, (0, 1, 2), why)
    others = [ex.value(x, ex.sharding(x), why) for x in op.inputs[3:]]
    b = _Builder(ex, op)
    cp = ex._n(ex.cp_axes)
    causal = _is_causal(op)
    L = _shape(q)[SEQ_DIM]
    rest_t = _rest_types(ex, op, s, 2)
    v_last = _shape(v)[-1]
    gathered = _gather_kv(b, b.flat_kv(k, v))
    res = b.aten(op.overload, [q, k, v] + others, _sdpa_types(op, _shape(q), v_last, rest_t), _args(op, causal))
    out_dtype = res[0].type.element_type
    out = b.to(res[0], f32)
    lse = b.one("aten.unsqueeze.default", [res[1]], TensorType(res[1].type.element_type, _shape(res[1]) + [1]), dim=-1)
    lse = b.to(lse, f32)
    nkv = _numel(_shape(k)) + _numel(_shape(v))
    for i in range(1, cp):
        chunk = b.slice(gathered, 0, i * nkv, (i + 1) * nkv)
        ki, vi = b.kv_of(chunk, _shape(k), _shape(v))
        if causal:  # load balanced: this rank's q against the first half of rank (r - i)'s K/V
            ki, vi = b.slice(ki, SEQ_DIM, 0, L // 2), b.slice(vi, SEQ_DIM, 0, L // 2)
        ri = b.aten(op.overload, [q, ki, vi] + others, _sdpa_types(op, _shape(q), v_last, rest_t), _args(op, False))
        oi = b.to(ri[0], f32)
        li = b.to(b.one("aten.unsqueeze.default", [ri[1]], TensorType(ri[1].type.element_type, _shape(ri[1]) + [1]),
                        dim=-1), f32)
        # _SDPAMerger._merge_one
        gate = b.one("aten.sigmoid.default", [b.binary("aten.sub.Tensor", li, lse)], lse.type)
        out = b.binary("aten.sub.Tensor", out, b.binary("aten.mul.Tensor", gate, b.binary("aten.sub.Tensor", out, oi)))
        d = b.binary("aten.sub.Tensor", lse, li)
        ls = b.aten("aten.log_sigmoid_forward.default", [d], [d.type, TensorType(f32, [0])])[0]
        lse = b.binary("aten.sub.Tensor", lse, ls)
    out = b.to(out, out_dtype)
    lse = b.one("aten.squeeze.dim", [lse], TensorType(lse.type.element_type, _shape(lse)[:-1]), dim=-1)
    lse = b.to(lse, op.outputs[1].type.element_type)
    ex.bind(op.outputs[0], out, s)
    ex.bind(op.outputs[1], lse, Sharding(s.dims[:3]))
    for r, nr in zip(op.outputs[2:], res[2:]):
        rank = len(_shape(r))
        ex.bind(r, nr, Sharding(s.dims[:3] + ((),) * (rank - 3)) if rank >= 3 else Sharding.replicated(rank))


def expand_backward(ex: "FunctionExpander", op: AtenOp) -> None:
    why = f"'{op.overload}' (context parallel)"
    (dout, q, k, v, out, lse), s = _local(ex, op, (0, 1, 2, 3, 4, 5), why)
    others = [ex.value(x, ex.sharding(x), why) for x in op.inputs[6:]]
    b = _Builder(ex, op)
    cp = ex._n(ex.cp_axes)
    axis = ex._ids(ex.cp_axes)
    causal = _is_causal(op)
    L = _shape(q)[SEQ_DIM]
    ks, vs = _shape(k), _shape(v)
    nkv = _numel(ks) + _numel(vs)
    gathered = _gather_kv(b, b.flat_kv(k, v))
    gq = b.one("aten.zeros_like.default", [q], TensorType(f32, _shape(q)), dtype="torch.float32")
    gk = b.one("aten.zeros_like.default", [k], TensorType(f32, ks), dtype="torch.float32")
    gv = b.one("aten.zeros_like.default", [v], TensorType(f32, vs), dtype="torch.float32")
    types = [TensorType(r.type.element_type, list(t)) for r, t in zip(op.outputs[:3], (_shape(q), ks, vs))]
    rest_t = _rest_types(ex, op, s, 3)
    pending = None  # (recv future, send token) of the K/V gradient on its way round the ring
    tag = ex.next_p2p_tag(cp)
    res = None
    for i in range(cp):
        if i == 0:
            ki, vi, c = k, v, causal
        else:
            ki, vi = b.kv_of(b.slice(gathered, 0, i * nkv, (i + 1) * nkv), ks, vs)
            if causal:
                ki, vi = b.slice(ki, SEQ_DIM, 0, L // 2), b.slice(vi, SEQ_DIM, 0, L // 2)
            c = False
        t_i = [types[0], TensorType(types[1].element_type, _shape(ki)), TensorType(types[2].element_type, _shape(vi))]
        res = b.aten(op.overload, [dout, q, ki, vi, out, lse] + others, t_i + rest_t, _args(op, c))
        dq_, dk_, dv_ = res[:3]
        if i == 0:
            gk = b.binary("aten.add_.Tensor", gk, dk_)
            gv = b.binary("aten.add_.Tensor", gv, dv_)
        else:
            buf = _wait(ex, pending)
            gk, gv = b.kv_of(buf, ks, vs)
            if causal:  # _partial_update(..., idx=0, add=True): this step touched the first half of the K/V
                h = L // 2
                gk = b.cat([b.binary("aten.add_.Tensor", b.slice(gk, SEQ_DIM, 0, h), dk_), b.slice(gk, SEQ_DIM, h, L)],
                           SEQ_DIM)
                gv = b.cat([b.binary("aten.add_.Tensor", b.slice(gv, SEQ_DIM, 0, h), dv_), b.slice(gv, SEQ_DIM, h, L)],
                           SEQ_DIM)
            else:
                gk = b.binary("aten.add_.Tensor", gk, dk_)
                gv = b.binary("aten.add_.Tensor", gv, dv_)
        pending = _ring_shift(ex, b.flat_kv(gk, gv), axis, tag + i)
        gq = b.binary("aten.add_.Tensor", gq, dq_)
    gq = b.to(gq, op.outputs[0].type.element_type)
    gk, gv = b.kv_of(_wait(ex, pending), ks, vs)
    gk, gv = b.to(gk, op.outputs[1].type.element_type), b.to(gv, op.outputs[2].type.element_type)
    for r, nr in zip(op.outputs[:3], (gq, gk, gv)):
        ex.bind(r, nr, s)
    for r, nr in zip(op.outputs[3:], res[3:]):
        ex.bind(r, nr, Sharding.replicated(len(_shape(r))))


def _ring_shift(ex: "FunctionExpander", buf: SSAValue, axis: list[int], tag: int):
    """``permute_tensor`` along the ring: send to ``r + 1``, receive from ``r - 1`` (both asynchronous)."""
    from flint.ir.dist import axes_attr

    def props(offset: int) -> dict:
        return {"grid": FlatSymbolRefAttr(ex.grid), "grid_axes": axes_attr(axis), "offset": IntegerAttr(offset, i64),
                "tag": IntegerAttr(tag, i64)}
    send = dist.SendOp.build(operands=[buf], result_types=[[dist.FutureType(NoneType())]], properties=props(1))
    ex.emit(send)
    recv = dist.RecvOp.build(result_types=[dist.FutureType(buf.type)], properties=props(-1))
    ex.emit(recv)
    return recv.result, send.token


def _wait(ex: "FunctionExpander", pending) -> SSAValue:
    fut, token = pending
    ex.emit(dist.WaitOp(token))
    w = dist.WaitOp(fut)
    ex.emit(w)
    return w.result


def expand_attention(ex: "FunctionExpander", op: AtenOp) -> bool:
    """Expand a fused attention op with its sequence split over ``cp`` (False: not split, use the plain rule)."""
    if not query_split(ex, op):
        return False
    name = op.overload.split(".")[1]
    from flint.sharding.engine import ExpandError, where

    if name in CP_FORWARD:
        expand_forward(ex, op)
    elif name in CP_BACKWARD:
        expand_backward(ex, op)
    else:
        raise ExpandError(f"context parallelism: '{op.overload}'{where(op)} has no ring-attention rule (PyTorch's "
                          f"context_parallel in Flint covers {', '.join(CP_FORWARD)} and their backward)")
    return True


def check_program(module, plan) -> None:
    """Refuse ``cp`` where PyTorch's ``context_parallel`` runs no ring attention: an attention call with an
    explicit mask (its SDPA overrides refuse one: "attn_bias is not supported yet"; Hugging Face models build one
    for a sliding window shorter than the sequence, padding, or a ``position_ids`` input whose packing the capture
    cannot read), or a program without a fused
    attention call (eager attention, ``bmm`` and ``softmax``, which the ring does not rewrite: each rank would
    attend to its own shard of the sequence only)."""
    from xdsl.dialects import func

    from flint.plan import PlanError
    from flint.sharding.engine import where

    if plan.cp <= 1:
        return
    fused = [op for f in module.ops if isinstance(f, func.FuncOp) and f.sym_name.data.endswith("_fwd")
             for op in f.walk() if isinstance(op, AtenOp) and op.overload.split(".")[1].startswith("_scaled_dot_prod")]
    for op in fused:
        if op.overload.split(".")[1] not in CP_FORWARD:
            continue  # refused by name when expanded (expand_attention)
        mask = next((v for v in op.inputs[3:] if isinstance(v.type, TensorType) and len(_shape(v)) >= 2), None)
        if mask is not None:
            raise PlanError("cp", f"'{op.overload}'{where(op)} takes an explicit attention mask ({mask.type}): "
                            "PyTorch's context_parallel runs attention without one only (is_causal, or no mask: "
                            "'attn_bias is not supported yet'). Hugging Face models build one for a sliding window "
                            "shorter than the sequence, padding (an attention_mask input) or a position_ids input "
                            "(packed sequences, which the capture cannot rule out); plan dp / fsdp / tp for this "
                            "program", plan.source)
    if not fused:
        raise PlanError("cp", "the program has no fused attention call (scaled_dot_product_attention, flash): "
                        "PyTorch's context_parallel rewrites those into ring attention, and eager attention "
                        "(bmm, softmax) would attend to each rank's own shard of the sequence only; plan dp / "
                        "fsdp / tp for this program", plan.source)


__all__ = ["check_program", "expand_attention", "query_split"]
