"""Capture one training step (forward, loss, backward, optimizer) as FX graphs.

Parameters and inputs live on the meta device, so nothing the size of the
model is ever allocated; the process group is PyTorch's fake backend, so any
world size runs in this one process as rank 0. ``torch.compile`` with
AOTAutograd (min-cut partitioner, which honours selective-checkpoint
recompute tags; ``partitioner="eager"`` saves what eager autograd saves,
:mod:`flint.capture.partition`) yields the forward and backward graphs with functional
collectives; the AdamW update over the local parameter shards is traced with
``make_fx``.

A :class:`~flint.models.StagedLM` under a plan is captured part by part:
``embed``, ONE block of ``layers`` (repeated ``len(layers)`` times) and
``head``; any other module, or any model under the user's own
parallelisation function, goes through :mod:`flint.capture.generic` (its
repeated blocks found, parts ``model`` and ``block``).
"""

from __future__ import annotations

import contextlib
import math
import re
import traceback
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Collection, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch.distributed.tensor import DTensor
from torch.fx.experimental.proxy_tensor import make_fx
from torch.optim.adamw import adamw

from flint.capture import opclass
from flint.capture.byom import _STDLIB, eager_mask_decisions
from flint.capture.composite import composite_autograd, no_rng_state_on_meta
from flint.capture.errors import CaptureError
from flint.capture.float8 import apply_float8
from flint.capture.partition import PARTITIONERS, partition_fn
from flint.capture.fake_dist import device_mesh, fake_world, group_axes
from flint.capture.recipes import (CAPTURE_FIELDS, POST_FORWARD_ORDER, RECIPES, REDUCE_DTYPE, ParamGroup, ParamInfo,
                                   ac_layers, apply, backward_gathered, check_ac, loss_context, pattern_stages,
                                   pre_backward_unshard)
from flint.mesh import Mesh
from flint.models.base import is_staged
from flint.plan import Plan, PlanError, from_recipe


@dataclass
class Role:
    """What one graph placeholder is.

    ``kind`` is one of ``parameter`` (a local parameter shard), ``buffer``,
    ``input`` (batch data), ``activation`` (the hidden state entering the
    part), ``saved`` (a forward value saved for backward), ``tangent`` (the
    gradient of a forward output), ``gradient`` (of a parameter, optimizer
    input), ``master`` (the optimizer's fp32 copy of a parameter: plan field
    ``master_dtype``), ``exp_avg`` / ``exp_avg_sq`` (AdamW state) or ``step``.
    A ``frozen`` parameter (``requires_grad=False``) has no gradient: its backward returns none, the optimizer
    does not step it, data parallelism does not reduce it (FSDP2 still gathers it with its group).
    """

    kind: str
    local_shape: tuple[int, ...]
    dtype: torch.dtype
    param: str | None = None
    global_shape: tuple[int, ...] | None = None
    sharding: dict[str, int] = field(default_factory=dict)
    frozen: bool = False  # a parameter with requires_grad=False: no gradient, no optimizer state


@dataclass
class CapturedGraph:
    """One FX graph of a part: phase ``fwd``, ``bwd`` or ``optim``. Its function is ``<part>_<kind>``, where
    ``kind`` is the phase unless set (``norm``: the gradient-norm step of clipping, phase ``optim``)."""

    phase: str
    gm: torch.fx.GraphModule
    roles: dict[str, Role]  # placeholder node name -> role
    kind: str = ""

    def function(self, part: str) -> str:
        return f"{part}_{self.kind or self.phase}"

    def nodes(self) -> Iterator[torch.fx.Node]:
        return (n for n in self.gm.graph.nodes if n.op == "call_function")


@dataclass
class CapturedPart:
    """A distinct part of the step and how many times it runs per step.

    For the repeated block, parameter names are those of block 0
    (``layers.0.…``); block ``i`` has the same shapes under ``layers.i.…``.
    Under selective-layer activation checkpointing the checkpointed blocks
    are a second part, ``block_ac``, named after the first of them. ``norm``
    (plan field ``max_norm``): the part's share of the gradient-norm
    computation of clipping, run after every backward and before the
    step-wide ``CapturedStep.clip``.
    """

    name: str
    repeat: int
    fwd: CapturedGraph
    bwd: CapturedGraph | None
    optim: CapturedGraph | None
    params: list[ParamInfo]
    norm: CapturedGraph | None = None

    def graphs(self) -> list[CapturedGraph]:
        return [g for g in (self.fwd, self.bwd, self.norm, self.optim) if g is not None]


@dataclass
class CapturedStep:
    """One captured training step.

    ``group_axes`` maps every process-group name seen in the graphs'
    functional collectives to the mesh axis indices the group spans.
    """

    parts: list[CapturedPart]
    mesh: Mesh
    plan_name: str  # the recipe name, the plan's description, or the parallelisation function's name
    group_axes: dict[str, tuple[int, ...]]
    param_dtype: torch.dtype
    batch_local_shapes: dict[str, tuple[int, ...]]
    global_params: dict[str, tuple[int, ...]]
    plan: Plan | None = None  # None for a user parallelisation function
    partitioner: str = "min-cut"  # flint.capture.partition.PARTITIONERS
    # for the planned path (a capture without tp): the [[tp]] patterns of the model's own declared TP plan
    # (a Hugging Face model no preset names), or why shard-expand cannot reproduce that plan
    tp_rules: tuple[tuple[str, int], ...] | None = None
    tp_refused: str = ""
    notes: tuple[str, ...] = ()  # how the capture departed from its usual structure, and why (shown to the user)
    # gradient-norm clipping's step-wide part (plan field max_norm): the total norm's all-reduces and the
    # scaling coefficient, between the parts' norm graphs and their optimizer graphs; function @grad_clip
    clip: CapturedGraph | None = None
    # the stack whose layers the plan's preset wraps each as an FSDP / DDP unit (a model file's; the planned
    # path's units, :func:`flint.passes.shard_annotate.dp_units`)
    layers: str | None = None

    def part(self, name: str) -> CapturedPart:
        return next(p for p in self.parts if p.name == name)

    def graphs(self) -> list[tuple[CapturedGraph, int]]:
        """Every graph of the step with how many times it runs: the parts' (``repeat`` times each), then
        ``clip`` (once)."""
        out = [(g, part.repeat) for part in self.parts for g in part.graphs()]
        return out + ([(self.clip, 1)] if self.clip is not None else [])

    def summary(self) -> "StepSummary":
        return summarize(self)


@dataclass
class StepSummary:
    """Per-rank, per-step totals (repeated parts counted ``repeat`` times)."""

    op_classes: Counter  # class -> count
    flops: int
    collectives: Counter  # (kind, axes, phase) -> count
    collective_bytes: Counter  # (kind, axes, phase) -> input bytes
    graph_ops: int  # call_function nodes actually captured (not multiplied by repeat)


def summarize(step: CapturedStep) -> StepSummary:
    """Count ops by class, FLOPs and collectives over the whole step."""
    classes, colls, coll_bytes = Counter(), Counter(), Counter()
    flops = graph_ops = 0
    for g, repeat in step.graphs():
        for node in g.nodes():
            graph_ops += 1
            cls = opclass.classify_aten(node.target)
            classes[cls] += repeat
            flops += opclass.node_flops(node) * repeat
            if cls in opclass.COLLECTIVES:
                axes = step.group_axes.get(opclass.collective_group(node), ())
                key = (cls, tuple(step.mesh.axis_names[a] for a in axes), g.phase)
                colls[key] += repeat
                coll_bytes[key] += opclass.tensor_bytes(node.args[0].meta.get("val")) * repeat
    return StepSummary(classes, flops, colls, coll_bytes, graph_ops)


# ----------------------------------------------------------------- internals


_FRAME = re.compile(r'File "([^"]+)", line (\d+)(?:, in (\S+))?')


def _user_source(exc: BaseException) -> str | None:
    """'file:line in fn' of the innermost user frame of a dynamo error."""
    frames = []
    real = getattr(exc, "real_stack", None)
    if real:
        frames = [(f.filename, f.lineno, f.name) for f in real]
    if not frames:
        frames = [(m.group(1), int(m.group(2)), m.group(3)) for m in _FRAME.finditer(str(exc))]
    if not frames:
        frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(exc.__traceback__)
                  if "/site-packages/" not in f.filename and "/flint/" not in f.filename]
    user = [f for f in frames
            if "/torch/" not in f[0] and "/flint/capture/" not in f[0] and not f[0].startswith(_STDLIB)]
    if not user:
        return None
    file, line, fn = user[-1]
    return f"{file}:{line}" + (f" in {fn}" if fn else "")


def _reason(exc: BaseException) -> str:
    """The real message: dynamo wraps the user's error (e.g. a dtype mismatch in a fake-tensor call)."""
    inner = exc
    seen = set()
    while (inner.__cause__ is not None or getattr(inner, "inner_exception", None) is not None) and id(inner) not in seen:
        seen.add(id(inner))
        inner = inner.__cause__ if inner.__cause__ is not None else inner.inner_exception
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    first = lines[0] if lines else type(exc).__name__
    explained = [ln.strip()[len("Explanation:"):].strip() for ln in lines if ln.strip().startswith("Explanation:")]
    if explained and "fake tensor" in first:
        return f"{first.rstrip(':')}: {explained[0]}"
    if inner is not exc:
        inner_lines = [ln for ln in str(inner).strip().splitlines() if ln.strip()]
        if inner_lines:
            return f"{first.rstrip(':')}: {type(inner).__name__}: {inner_lines[0]}"
    if first.endswith(":") and len(lines) > 1:
        return f"{first} {lines[1].strip()}"
    return first


@dataclass
class _Capture:
    fwd: torch.fx.GraphModule | None = None
    bwd: torch.fx.GraphModule | None = None
    inputs: list[tuple[str, Any]] = field(default_factory=list)  # dynamo placeholder (source, example)
    # the forward's placeholders whose new values its leading outputs are, in order (mutated buffers)
    mutated: list[str] = field(default_factory=list)


_EAGER_SDPA = torch.nn.functional.scaled_dot_product_attention


@torch._dynamo.assume_constant_result
def _sdp_choice(q: tuple, k: tuple, v: tuple, dtype: torch.dtype, mask: tuple | None, dropout_p: float,
                is_causal: bool, scale: float | None, enable_gqa: bool) -> int:
    """PyTorch's SDPA backend choice for these shapes (stand-in CPU tensors: one row, broadcast).

    Asked outside every active dispatch mode: SDPA inside a function dynamo keeps whole in its graph
    (``nn.MultiheadAttention``'s ``F.multi_head_attention_forward``) runs only when AOTAutograd traces
    it, under fake and functional tensor modes, whose ``_fused_sdp_choice`` always answers "math".
    """
    from torch.utils._python_dispatch import _disable_current_modes

    def stand_in(shape: tuple, dt: torch.dtype) -> torch.Tensor:
        return torch.empty(shape[-1], dtype=dt, device="cpu").expand(shape)

    with _disable_current_modes():
        try:
            return int(torch.ops.aten._fused_sdp_choice(
                stand_in(q, dtype), stand_in(k, dtype), stand_in(v, dtype),
                None if mask is None else stand_in(*mask), dropout_p, is_causal, scale=scale,
                enable_gqa=enable_gqa))
        except RuntimeError:
            return -1


def _fused_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` as the kernel PyTorch runs on a real device.

    On meta tensors SDPA's dispatcher takes the math path (``bmm`` + softmax).
    PyTorch's own backend choice (``torch._fused_sdp_choice``, asked with
    stand-in CPU tensors of the same shapes, strides and dtypes) decides what
    a real run executes: flash attention
    (``_scaled_dot_product_flash_attention_for_cpu``, with its own backward;
    it takes GQA key/value heads, masks, dropout and a scale as they are; the
    CPU kernel refuses dropout, so dropout is asked as a GPU's flash kernel
    takes it) or, when PyTorch itself would, the math path. A mask that needs a gradient (a learned bias)
    takes the math path too: no flash kernel returns its gradient.
    """
    if query.dim() != 4 or not all(isinstance(t, torch.Tensor) and t.device.type == "meta"
                                   for t in (query, key, value)):
        return _EAGER_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                           scale=scale, enable_gqa=enable_gqa)

    if isinstance(attn_mask, torch.Tensor) and attn_mask.requires_grad:
        # a learned mask (T5's relative position bias): the flash kernels take no gradient for it (a GPU runs
        # the memory-efficient kernel, which does); the math path computes it, as PyTorch's CPU run would
        return _EAGER_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                           scale=scale, enable_gqa=enable_gqa)
    mask = None if attn_mask is None else (tuple(attn_mask.shape), attn_mask.dtype)
    choice = _sdp_choice(tuple(query.shape), tuple(key.shape), tuple(value.shape), query.dtype, mask,
                         float(dropout_p), bool(is_causal), scale, bool(enable_gqa))
    flash = getattr(torch.nn.attention.SDPBackend, "FLASH_ATTENTION").value
    if choice != flash and dropout_p > 0:
        # the CPU flash kernel refuses dropout; the GPU flash kernels a training run uses take it
        choice = _sdp_choice(tuple(query.shape), tuple(key.shape), tuple(value.shape), query.dtype, mask,
                             0.0, bool(is_causal), scale, bool(enable_gqa))
    if choice != flash:
        return _EAGER_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                           scale=scale, enable_gqa=enable_gqa)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


@contextlib.contextmanager
def _python_data_as_constants() -> Iterator[None]:
    """Let a tensor the forward builds from Python data (``torch.tensor([1.0, 2.0])``, the index tensor of
    ``x[..., [-2], :]``) into the graph as a constant. PyTorch makes such a tensor on the inputs' device, which
    on the meta device Flint captures on is a real meta tensor, not a fake one, and fake tensor mode refuses
    it ("Please convert all Tensors to FakeTensors first"); allowed, it becomes an FX ``get_attr`` constant
    (imported by :mod:`flint.importer` as ``flint.constant``). Dynamo sets the same thread-local override
    for the constants of the functions it runs as leaves."""
    from torch._subclasses.fake_tensor import fake_tensor_tls

    old = fake_tensor_tls.allow_non_fake_inputs_override
    fake_tensor_tls.allow_non_fake_inputs_override = True
    try:
        yield
    finally:
        fake_tensor_tls.allow_non_fake_inputs_override = old


def _results_of(gm: torch.fx.GraphModule) -> Callable:
    """A stand-in for running the captured backward ``gm``: empty meta tensors shaped, strided and typed as its
    traced results (the parameters' gradients). Nothing reads their values, and running the graph on meta tensors
    can fail where tracing succeeded: a meta kernel may lay a result out otherwise than the fake kernel did (a
    ConvNeXt stride-2 convolution's weight gradient, channels-last at run time, then viewed as contiguous)."""
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    metas = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in out]

    def results(*args: Any) -> list[torch.Tensor | None]:
        return [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
                if isinstance(v, torch.Tensor) else v for v in metas]
    return results


def _compile_part(module: nn.Module, args: Sequence[torch.Tensor], part: str,
                  partitioner: str = "min-cut") -> tuple[_Capture, torch.Tensor]:
    """Run ``module(*args)`` and its backward through torch.compile, keeping the graphs; ``partitioner``
    splits the joint graph (:mod:`flint.capture.partition`)."""
    cap = _Capture()

    def fw_compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable:
        if cap.fwd is not None:
            raise CaptureError(part, "the part compiled into more than one forward graph")
        cap.fwd = gm
        placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        context = torch._guards.TracingContext.try_get()
        meta = getattr(context, "fw_metadata", None)
        # AOTAutograd returns the new values of the inputs it mutates (BatchNorm's running statistics) first
        cap.mutated = [placeholders[i] for i in getattr(meta, "mutated_inp_runtime_indices", ())
                       if i < len(placeholders)]
        return make_boxed_func(gm.forward)

    def bw_compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable:
        cap.bwd = gm
        return make_boxed_func(_results_of(gm))

    aot = aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler,
                       partition_fn=partition_fn(partitioner))

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable:
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                ga = node.meta.get("grapharg")
                source = ga.source.name if ga is not None and ga.source is not None else node.name
                source = source() if callable(source) else source
                example = ga.example if ga is not None else None
                cap.inputs.append((source, example))
        return aot(gm, example_inputs)

    compiled = torch.compile(module, backend=backend, fullgraph=True, dynamic=False)
    try:
        torch.nn.functional.scaled_dot_product_attention = _fused_sdpa
        # allow_rnn: Dynamo traces nn.LSTM / GRU / RNN into their time steps (its default refuses them)
        with composite_autograd(), no_rng_state_on_meta(), torch._dynamo.config.patch(allow_rnn=True), \
                _python_data_as_constants():
            POST_FORWARD_ORDER.clear()
            out = compiled(*args)
            if not isinstance(out, torch.Tensor):
                raise CaptureError("model", f"part '{part}' returned {type(out).__name__}, not a tensor")
            if out.requires_grad:
                if out.ndim == 0:
                    out.backward()
                else:
                    out.backward(torch.empty_like(out))
    except CaptureError:
        raise
    except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as exc:
        raise CaptureError("model", f"graph break in part '{part}': {_reason(exc)}", _user_source(exc)) from exc
    except torch._dynamo.exc.TorchDynamoException as exc:
        raise CaptureError("model", f"cannot capture part '{part}': {_reason(exc)}", _user_source(exc)) from exc
    except (RuntimeError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise CaptureError("model", f"cannot capture part '{part}': {type(exc).__name__}: {_reason(exc)}",
                           _user_source(exc)) from exc
    finally:
        torch.nn.functional.scaled_dot_product_attention = _EAGER_SDPA
    return cap, out


def _shape(val: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in getattr(val, "shape", ()))


def _input_of(node: torch.fx.Node, inputs: list) -> tuple[str, Any]:
    """The Dynamo input a placeholder stands for when tensor subclasses flatten into several
    (a DTensor is its ``_local_tensor`` and its ``device_mesh``): AOTAutograd's descriptor
    (``node.meta["desc"]``) names the input index and the attribute chain. The local tensor of a
    subclass input is that input (a parameter's shard); anything else (a mesh) has no role."""
    desc, attrs = node.meta.get("desc"), []
    while desc is not None and hasattr(desc, "base") and hasattr(desc, "attr"):
        attrs.append(desc.attr)
        desc = desc.base
    idx = getattr(desc, "idx", None)
    if type(desc).__name__ != "PlainAOTInput" or not isinstance(idx, int) or not 0 <= idx < len(inputs) \
            or any(a != "_local_tensor" for a in attrs):
        return node.name, None
    return inputs[idx]


def _fwd_roles(cap: _Capture, infos: dict[int, ParamInfo], buffers: dict[int, str],
               input_kinds: Sequence[str]) -> dict[str, Role]:
    placeholders = [n for n in cap.fwd.graph.nodes if n.op == "placeholder"]
    roles: dict[str, Role] = {}
    user_inputs = iter(input_kinds)
    aligned = len(placeholders) == len(cap.inputs)
    for i, node in enumerate(placeholders):
        val = node.meta.get("val")
        shape, dtype = _shape(val), getattr(val, "dtype", None)
        source, example = cap.inputs[i] if aligned else _input_of(node, cap.inputs)
        if isinstance(example, DTensor):
            example_id = id(example)
        else:
            example_id = id(example) if example is not None else None
        if example_id in infos:
            info = infos[example_id]
            roles[node.name] = Role("parameter", shape, dtype, info.name, info.global_shape, dict(info.sharding),
                                    frozen=not example.requires_grad)
        elif example_id in buffers:
            roles[node.name] = Role("buffer", shape, dtype, buffers[example_id])
        elif (aligned or example is not None) and source.startswith("L[") and "self" not in source.split("]")[0]:
            roles[node.name] = Role(next(user_inputs, "input"), shape, dtype)
        else:
            roles[node.name] = Role("unknown", shape, dtype)
    return roles


def _bwd_roles(bwd: torch.fx.GraphModule, fwd_roles: dict[str, Role]) -> dict[str, Role]:
    roles = {}
    for node in bwd.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if node.name in fwd_roles:
            roles[node.name] = fwd_roles[node.name]
        elif node.name.startswith("tangents"):
            roles[node.name] = Role("tangent", _shape(val), getattr(val, "dtype", None))
        else:
            roles[node.name] = Role("saved", _shape(val), getattr(val, "dtype", None))
    return roles


# AdamW's hyperparameters in every captured form (torchtitan's defaults; they change no op's cost)
ADAMW_HYPER = dict(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, amsgrad=False, maximize=False)


def adamw_step(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
               exp_avg_sqs: list[torch.Tensor], step: torch.Tensor, lr: float = ADAMW_HYPER["lr"],
               beta1: float = ADAMW_HYPER["beta1"], beta2: float = ADAMW_HYPER["beta2"],
               eps: float = ADAMW_HYPER["eps"], weight_decay: float = ADAMW_HYPER["weight_decay"]) -> None:
    """torch.optim.AdamW's update (for-loop form, tensor step as with ``capturable=True``)."""
    step.add_(1)
    bias_correction1 = 1 - torch.pow(beta1, step)
    bias_correction2_sqrt = torch.sqrt(1 - torch.pow(beta2, step))
    step_size = lr / bias_correction1
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        p.addcdiv_(m, denom * (1 / step_size).neg())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _partial_grads(params: Sequence[torch.Tensor]) -> list[tuple[int, str, str]]:
    """Gradients DTensor leaves Partial where their parameter is not (e.g. sequence-parallel norm weights):
    (index, reduce op, group) of each. A DTensor op that needs the whole value (the optimizer's step, a norm)
    all-reduces them when it first touches them, without changing the gradient itself."""
    pending = []
    for i, p in enumerate(params):
        grad = p.grad
        if isinstance(grad, DTensor):
            for dim, pl in enumerate(grad.placements):
                if pl.is_partial() and not p.placements[dim].is_partial():
                    pending.append((i, pl.reduce_op, grad.device_mesh.get_group(dim).group_name))
    return pending


def _reduced(gs: list[torch.Tensor], pending: list[tuple[int, str, str]]) -> list[torch.Tensor]:
    gs = list(gs)
    for i, op, group in pending:
        gs[i] = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(gs[i], op, group))
    return gs


def _param_role(kind: str, t: torch.Tensor, param: torch.Tensor, infos: dict[int, ParamInfo]) -> Role:
    """The role of an optimizer-side value ``t`` of ``param`` (its gradient, master copy or Adam state)."""
    info = infos.get(id(param))
    return Role(kind, tuple(t.shape), t.dtype, info.name if info else None,
                info.global_shape if info else None, dict(info.sharding) if info else {})


def _capture_norm(held: Sequence[torch.Tensor], infos: dict[int, ParamInfo],
                  impl: str = "for-loop") -> CapturedGraph | None:
    """A part's share of ``torch.nn.utils.clip_grad_norm_``'s total norm: one ``vector_norm`` per local gradient
    (``foreach=False``; with ``impl`` ``foreach`` or ``fused``, torch's GPU default ``foreach=True``: one
    ``_foreach_norm`` over them all), then the norm of those norms and of the total so far (the ``grad_norm``
    the part before handed on). torch stacks every gradient's norm once and takes its norm; taken part by part
    it is the same value, with one small stack and norm per part run."""
    params = [p for p in held if p.requires_grad]
    if not params:
        return None
    grads = [torch.empty_like(_local(p).detach()) for p in params]
    pending = _partial_grads(params)
    total = torch.zeros((), dtype=grads[0].dtype, device=grads[0].device)

    def norm(total: torch.Tensor, *gs: torch.Tensor) -> torch.Tensor:
        reduced = _reduced(list(gs), pending)
        norms = list(torch._foreach_norm(reduced, 2.0)) if impl != "for-loop" else \
            [torch.linalg.vector_norm(g, 2.0) for g in reduced]
        return torch.linalg.vector_norm(torch.stack([total, *norms]), 2.0)

    gm = make_fx(norm)(total, *grads)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    roles = {placeholders[0].name: Role("grad_norm", (), total.dtype)}
    for node, g, p in zip(placeholders[1:], grads, params):
        roles[node.name] = _param_role("gradient", g, p, infos)
    return CapturedGraph("optim", gm, roles, kind="norm")


def _capture_clip(parts: Sequence[CapturedPart], dm: Any, mesh: Mesh, max_norm: float,
                  pp: bool) -> CapturedGraph | None:
    """Gradient-norm clipping's step-wide part: the local total norm made global and turned into the scaling
    coefficient ``min(1, max_norm / (norm + 1e-6))`` (``torch.nn.utils.clip_grad_norm_``). Over each mesh axis
    some gradient is sharded over, in mesh order, DTensor's ``full_tensor`` of the partial norm: square,
    all-reduce (sum), square root, one axis at a time; with pipeline stages, torchtitan's
    ``dist_utils.clip_grad_norm_`` does the same over ``pp``."""
    norms = [p.norm for p in parts if p.norm is not None]
    if not norms:
        return None
    axes: set[int] = set()
    for part in parts:
        for info in part.params:
            for name in info.sharding:
                if name not in mesh.axis_names:
                    raise CaptureError("max_norm", f"parameter {info.name} is sharded over '{name}', which is no "
                                       f"axis of the mesh ({', '.join(mesh.axis_names)}): Flint cannot tell "
                                       "which ranks its gradient norm is reduced over")
                axes.add(mesh.axis_index(name))
    groups = [dm.get_group(a).group_name for a in sorted(axes)]
    if pp:
        groups.append(dm.get_group(mesh.axis_index("pp")).group_name)
    dtype = next(r.dtype for r in norms[0].roles.values() if r.kind == "grad_norm")

    def clip(total: torch.Tensor) -> torch.Tensor:
        for group in groups:
            summed = torch.ops._c10d_functional.all_reduce(total.pow(2.0), "sum", group)
            total = torch.ops._c10d_functional.wait_tensor(summed).pow(0.5)
        return torch.clamp(max_norm / (total + 1e-6), max=1.0)

    gm = make_fx(clip)(torch.zeros((), dtype=dtype))
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    return CapturedGraph("optim", gm, {placeholder.name: Role("grad_norm", (), dtype)}, kind="clip")


def _capture_optimizer(held: Sequence[torch.Tensor], infos: dict[int, ParamInfo],
                       master: torch.dtype | None = None, clip: bool = False,
                       impl: str = "for-loop") -> CapturedGraph | None:
    """The AdamW step over a part's local parameters ``held``. With ``master`` (plan field ``master_dtype``), the
    optimizer steps master copies of the parameters in that dtype, with its state in it and the gradients cast
    to it, then copies the result into the parameters: Megatron-LM's ``Float16OptimizerWithFloat16Params``.
    With ``clip`` (plan field ``max_norm``) it first scales the gradients in place by the ``clip_coef`` the
    step-wide clipping computed (``clip_grads_with_norm_``).

    ``impl`` (plan field ``optimizer_impl``, torchtitan's ``optimizer.implementation``) is the form torch runs:
    ``for-loop`` (``foreach=False``: kernels per parameter; the scaling one ``mul_`` per gradient), ``foreach``
    (torch's own ``adamw(foreach=True)``, its GPU default: one multi-tensor op per step of the update over all
    the part's tensors, the step counts on the host as eager torch keeps them, so the bias corrections are
    Python numbers; the scaling one ``_foreach_mul_``) or ``fused`` (``adamw(fused=True)``: one
    ``_fused_adamw_``, the step counts on the device). With masters, ``foreach`` and ``fused`` copy them back
    with one ``_foreach_copy_``."""
    params = [p for p in held if p.requires_grad]
    if not params:
        return None
    local = [_local(p).detach() for p in params]
    grads = [torch.empty_like(t) for t in local]
    pending = _partial_grads(params)
    if master is not None and local[0].dtype == master:
        raise CaptureError("master_dtype", f"the parameters already are {str(master).removeprefix('torch.')}: "
                           "master copies are for a model in bf16 or fp16 (capture it with --dtype bfloat16)")
    masters = [torch.empty_like(t, dtype=master) for t in local] if master is not None else []
    stepped = masters or local
    m = [torch.empty_like(t) for t in stepped]
    v = [torch.empty_like(t) for t in stepped]
    n = len(local)
    if impl == "for-loop":
        steps = [torch.zeros((), device=local[0].device)]
    elif impl == "fused":  # torch keeps a fused optimizer's step counts on the device, one per parameter
        steps = [torch.zeros((), device=local[0].device) for _ in range(n)]
    else:  # foreach (capturable=False): on the host, closed over, so the trace holds no device op for them
        steps = []
        host_steps = [torch.zeros(()) for _ in range(n)]
    coef = [torch.ones((), dtype=local[0].dtype, device=local[0].device)] if clip else []
    kinds = ["parameter", "gradient"] + (["master"] if masters else []) + ["exp_avg", "exp_avg_sq"]

    def flat_step(*flat: torch.Tensor) -> None:
        if clip:
            *flat, scale = flat
            if impl == "for-loop":
                for g in flat[n:2 * n]:
                    g.mul_(scale)
            else:
                torch._foreach_mul_(list(flat[n:2 * n]), scale)
        ps, gs = list(flat[:n]), _reduced(list(flat[n:2 * n]), pending)
        state = [list(flat[k * n:(k + 1) * n]) for k in range(2, len(kinds))]
        stepped_now, grads_now = (state.pop(0), [g.to(master) for g in gs]) if masters else (ps, gs)
        if impl == "for-loop":
            adamw_step(stepped_now, grads_now, state[0], state[1], flat[len(kinds) * n])
        else:
            adamw(stepped_now, grads_now, state[0], state[1], [], list(flat[len(kinds) * n:]) or host_steps,
                  foreach=impl == "foreach", fused=impl == "fused", **ADAMW_HYPER)
        if masters:
            if impl == "for-loop":
                for p, w in zip(ps, stepped_now):
                    p.copy_(w)
            else:
                torch._foreach_copy_(ps, stepped_now)

    gm = make_fx(flat_step)(*local, *grads, *masters, *m, *v, *steps, *coef)
    if impl == "foreach":
        _drop_host_ops(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = [*local, *grads, *masters, *m, *v]
    roles: dict[str, Role] = {}
    for i, node in enumerate(placeholders):
        if i >= len(values):
            roles[node.name] = Role("step", (), steps[0].dtype) if i < len(values) + len(steps) else \
                Role("clip_coef", (), coef[0].dtype)
            continue
        roles[node.name] = _param_role(kinds[i // len(params)], values[i], params[i % len(params)], infos)
    return CapturedGraph("optim", gm, roles)


def _drop_host_ops(gm: torch.fx.GraphModule) -> None:
    """Remove what eager torch runs on the host, not the device: ops on constant tensors of the trace (a foreach
    AdamW's step counts, which torch keeps on the CPU and increments there)."""
    graph = gm.graph
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or node.users:
            continue
        inputs = node.all_input_nodes
        if inputs and all(_is_constant(a) for a in inputs):
            graph.erase_node(node)
    for node in reversed(list(graph.nodes)):
        if not node.users and (node.op == "get_attr" or (node.op == "call_function" and node.target is
                                                         torch.ops.aten.lift_fresh_copy.default)):
            graph.erase_node(node)
    graph.lint()
    gm.recompile()


def _is_constant(node: torch.fx.Node) -> bool:
    """A value of the trace computed from its constants alone (no placeholder upstream)."""
    if node.op == "get_attr":
        return True
    return node.op == "call_function" and all(_is_constant(a) for a in node.all_input_nodes)


def _capture_part(name: str, module: nn.Module, args: Sequence[torch.Tensor], input_kinds: Sequence[str],
                  repeat: int, infos: dict[int, ParamInfo], buffers: dict[int, str], optimizer: str | None,
                  partitioner: str = "min-cut", master: torch.dtype | None = None,
                  only: Callable[[torch.Tensor], bool] | None = None,
                  clip: bool = False, impl: str = "for-loop",
                  others_update: Collection[str] = ()) -> tuple[CapturedPart, torch.Tensor]:
    """``only``: the parameters of ``module`` the part holds (a pipeline stage's, when ``module`` runs the whole
    model but computes one stage); default all. ``others_update``: buffers another part updates (with ``only``:
    their updates here are that part's work, dropped with it). ``clip``: with gradient-norm clipping (the part's
    norm graph, and an optimizer that scales its gradients). ``impl``: the optimizer's form (plan field
    ``optimizer_impl``, :func:`_capture_optimizer`)."""
    mine = [p for p in module.parameters() if only is None or only(p)]
    groups = [g for g in module.modules() if isinstance(g, ParamGroup)
              and (only is None or any(only(p) for p in g.local.values()))]
    # the other stage's groups: no forced backward re-gather (set by that stage's capture)
    others = [(g, g.backward_unshard) for g in module.modules() if isinstance(g, ParamGroup) and g not in groups]
    try:
        for g, _ in others:
            g.backward_unshard = g.in_part = False
        cap, out = _compile_part(module, args, name, partitioner)
        missing = _missing_backward_unshards([g for g in groups if id(g) in backward_gathered()], cap.bwd)
        if missing:
            # FSDP2 re-gathers every resharded group before its backward; AOTAutograd dropped an unused one.
            for g in missing:
                g.backward_unshard = True
            torch._dynamo.reset()
            for p in module.parameters():
                p.grad = None
            cap, out = _compile_part(module, args, name, partitioner)
    finally:
        for g, flag in others:
            g.backward_unshard, g.in_part = flag, True
    fsdp_groups = {g.group_name for g in groups if g.mode == "fsdp"}
    if cap.bwd is not None and fsdp_groups:
        pre_backward_unshard(cap.bwd, fsdp_groups)  # FSDP2 gathers before the unit's backward ops
    fwd_roles = _fwd_roles(cap, infos, buffers, input_kinds)
    if only is not None:
        _drop_dead(cap, fwd_roles, others_update)
    fwd = CapturedGraph("fwd", cap.fwd, fwd_roles)
    bwd = CapturedGraph("bwd", cap.bwd, _bwd_roles(cap.bwd, fwd_roles)) if cap.bwd is not None else None
    optim = _capture_optimizer(mine, infos, master, clip, impl) if optimizer else None
    norm = _capture_norm(mine, infos, impl) if optimizer and clip else None
    params = [infos[id(p)] for p in mine if id(p) in infos]
    return CapturedPart(name, repeat, fwd, bwd, optim, params, norm), out


def _drop_dead(cap: _Capture, roles: dict[str, Role], others_update: Collection[str] = ()) -> None:
    """Remove from the forward what a part that runs the whole model but computes one stage of it leaves dead:
    the other stage's ops AOTAutograd keeps (a functional collective's wait counts as impure there: the other
    stage's FSDP gathers stay; the other stage's buffer updates, ``others_update``, returned as outputs) and the
    parameters only they read. (The backward is left as captured: a forced
    FSDP re-gather, ``ParamGroup.backward_unshard``, is dead code there on purpose.)"""
    def impure(node: torch.fx.Node) -> bool:
        if node.op != "call_function":
            return node.op in ("placeholder", "output")
        schema = getattr(node.target, "_schema", None)
        return schema is not None and schema.is_mutable and getattr(node.target, "namespace", "") != "_c10d_functional"

    graph = cap.fwd.graph
    out = next(n for n in graph.nodes if n.op == "output")
    theirs = {i for i, n in enumerate(cap.mutated) if n in roles and roles[n].param in others_update}
    if theirs:  # AOTAutograd returns the mutated inputs' new values first
        out.args = (type(out.args[0])(r for i, r in enumerate(out.args[0]) if i not in theirs),)
        cap.mutated = [n for i, n in enumerate(cap.mutated) if i not in theirs]
    if cap.bwd is not None and isinstance(out.args[0], (tuple, list)):
        # values saved for the backward that it does not read (the other stage's parameters): AOTAutograd's
        # forward returns its outputs then the saved values, which lead the backward's arguments, in order
        saved = [n for n in cap.bwd.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
        results = list(out.args[0])
        first = len(results) - len(saved)
        unread = {i for i, n in enumerate(saved) if not n.users}
        if first >= 0 and unread:
            for i in unread:
                cap.bwd.graph.erase_node(saved[i])
            out.args = (type(out.args[0])(r for j, r in enumerate(results) if j - first not in unread),)
            cap.bwd.recompile()
    graph.eliminate_dead_code(is_impure_node=impure)
    for node in [n for n in graph.nodes if n.op == "placeholder" and not n.users]:
        role = roles.get(node.name)
        if role is not None and role.kind in ("parameter", "buffer"):
            graph.erase_node(node)
            roles.pop(node.name)
    cap.fwd.recompile()


def _missing_backward_unshards(groups: Sequence[ParamGroup], bwd: torch.fx.GraphModule | None) -> list[ParamGroup]:
    """The FSDP groups among ``groups`` (those FSDP2 gathers in backward, :func:`backward_gathered`) resharded
    after forward whose all-gather (of their flat shards' size, on their process group) the backward lacks:
    AOTAutograd drops a re-gather nothing in the backward reads."""
    groups = [g for g in groups if g.mode == "fsdp" and g.reshard_after_forward]
    if bwd is None or not groups:
        return []
    names = {g.group_name for g in groups}
    gathered = [int(v.numel()) if (v := n.args[0].meta.get("val")) is not None else -1 for n in bwd.graph.nodes
                if n.op == "call_function" and opclass.classify_aten(n.target) == opclass.ALL_GATHER
                and opclass.collective_group(n) in names]
    missing = []
    for g in groups:
        numel = sum(p.numel() for p in g.local.values())
        if numel in gathered:
            gathered.remove(numel)
        else:
            missing.append(g)
    return missing


def _check_layers(layers: nn.ModuleList) -> None:
    ref = [(n, tuple(p.shape)) for n, p in layers[0].named_parameters()]
    for i, layer in enumerate(layers):
        got = [(n, tuple(p.shape)) for n, p in layer.named_parameters()]
        if got != ref or type(layer) is not type(layers[0]):
            raise CaptureError("layers", f"layer {i} differs from layer 0 in type or parameter shapes; "
                               "only a stack of identical blocks can be captured as one repeated body "
                               "(pass repeat=False to capture the stack whole)")


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def capture_step(
    model_factory: Callable[[], nn.Module],
    batch_shapes: Mapping[str, Sequence[int]],
    *,
    plan: Plan | str | Callable[[nn.Module, Any], nn.Module | None] = "dp",
    world_size: int | None = None,
    tp: int = 1,
    mesh_shape: Sequence[int] | None = None,
    mesh_axis_names: Sequence[str] | None = None,
    repeat: bool = True,
    optimizer: str | None = "adamw",
    dtype: str | torch.dtype | None = None,
    loss: str = "auto",
    default_batch: tuple[int, int] = (1, 2048),
    parallelize: Callable[[nn.Module, Any], nn.Module | None] | None = None,
    partitioner: str = "min-cut",
) -> CapturedStep:
    """Capture one training step of ``model_factory()`` as rank 0 of the plan's world.

    ``model_factory`` is called under ``torch.device("meta")``. ``batch_shapes``
    gives GLOBAL shapes, e.g. ``{"tokens": (B, S), "labels": (B, S)}``; dim 0 is
    split over the data-parallel axes (``dp_replicate`` x ``dp_shard``).

    ``plan`` is one of:
    - a :class:`flint.plan.Plan` (its mesh is ``plan.mesh()``; ``world_size``,
      if given, must agree);
    - a recipe name (``dp``, ``fsdp``, ``fsdp+tp``, ...; see
      :mod:`flint.capture.recipes`), with ``world_size`` and, for 2-D recipes,
      the TP degree ``tp`` (:func:`flint.plan.from_recipe`);
    - a function ``plan(model, device_mesh)`` that parallelises the model with
      PyTorch APIs (captured by :mod:`flint.capture.generic`, ``fully_shard``
      and ``replicate`` intercepted); its mesh is ``mesh_shape`` / ``mesh_axis_names``
      (default ``(world_size,)`` named ``dp_replicate``), and mesh axes named
      ``dp_replicate`` or ``dp_shard`` split the batch.
    ``repeat=True`` captures one block of a StagedLM and repeats it;
    ``repeat=False`` captures the whole stack as one part (for checks).
    ``optimizer`` is ``"adamw"`` or ``None``. ``dtype`` casts the model
    (default: as built, float32).

    A model that is not a StagedLM (a Hugging Face model, any ``nn.Module``)
    is captured by :mod:`flint.capture.generic`: ``batch_shapes`` values may
    be :class:`flint.capture.byom.InputSpec` (shape and dtype; a bare shape
    is int64 for names like ``input_ids`` / ``labels``, else the model's
    dtype); ``loss`` is ``auto`` (the model's own loss, or cross-entropy /
    MSE against an input ``forward`` does not take, or the output's sum) or
    one of :data:`flint.capture.byom.LOSSES`; ``batch_shapes=None`` takes a
    causal LM's default inputs (``input_ids`` and ``labels`` of
    ``default_batch`` = (global batch, sequence)); ``parallelize(model, mesh)``
    (instead of a plan, with the plan's mesh) applies the user's own
    ``fully_shard`` / ``replicate`` / ``parallelize_module`` calls
    (:func:`flint.capture.byom.intercept`).
    """
    from flint.capture.byom import LOSSES, InputSpec

    if loss not in LOSSES:
        raise CaptureError("loss", f"unknown loss '{loss}'; known: {', '.join(LOSSES)}")
    if partitioner not in PARTITIONERS:
        raise CaptureError("partitioner", f"unknown partitioner {partitioner!r}; known: "
                           + "; ".join(f"{k} ({v})" for k, v in PARTITIONERS.items()))
    capture_part = partial(_capture_part, partitioner=partitioner)
    if parallelize is not None:
        if callable(plan) and not isinstance(plan, Plan):
            raise CaptureError("parallelize", "give either a plan function or parallelize=, not both")
        if isinstance(plan, str) and world_size is None and mesh_shape is not None:
            pass
    specs = None
    if batch_shapes is not None:
        specs = {k: v if isinstance(v, InputSpec) else InputSpec(tuple(int(d) for d in v))
                 for k, v in batch_shapes.items()}
        batch_shapes = {k: v.shape for k, v in specs.items()}
    if world_size is not None and world_size < 1:
        raise CaptureError("world_size", f"must be a positive integer, got {world_size}")
    custom = callable(plan) and not isinstance(plan, Plan)
    if isinstance(plan, str):
        if world_size is None:
            raise CaptureError("world_size", f"recipe '{plan}' needs a world size")
        if plan not in RECIPES:
            raise CaptureError("plan", f"unknown recipe '{plan}'; known recipes: {', '.join(RECIPES)}")
        plan_name, plan = plan, from_recipe(plan, world_size, tp)
    elif isinstance(plan, Plan):
        plan_name = plan.describe()
        if world_size is not None and world_size != plan.world_size:
            raise CaptureError("world_size", f"{world_size} does not match the plan's {plan.world_size} ranks "
                               f"({plan_name})")
    elif not custom:
        raise CaptureError("plan", f"expected a Plan, a recipe name or a function, got {type(plan).__name__}")
    if custom:
        world = world_size or 1
        shape = tuple(mesh_shape) if mesh_shape is not None else (world,)
        names = tuple(mesh_axis_names) if mesh_axis_names is not None else \
            (("dp_replicate",) if len(shape) == 1 else ())
        mesh = Mesh(shape, names)
        if mesh.world_size != world:
            raise CaptureError("mesh_shape", f"mesh {list(mesh.shape)} has {mesh.world_size} ranks, "
                               f"but world_size is {world}")
        plan_name = getattr(plan, "__name__", "custom")
    else:
        if mesh_shape is not None or mesh_axis_names is not None:
            raise CaptureError("mesh_shape", "the mesh of a plan or recipe comes from the plan "
                               "(flint.plan.Plan.mesh); give mesh_shape only with a parallelisation function")
        mesh = plan.mesh()
    if not custom:  # the optimizer's master copies (Plan.master_dtype), gradient-norm clipping (Plan.max_norm)
        capture_part = partial(capture_part, master=REDUCE_DTYPE[plan.master_dtype], clip=plan.max_norm > 0,
                               impl=plan.optimizer_impl)
    if parallelize is not None and not custom and plan.pp > 1:
        # the user's own torch.distributed.pipelining stages and schedule (flint/capture/pipeline.py)
        from flint.capture.pipeline import capture_pipeline

        if optimizer not in (None, "adamw"):
            raise CaptureError("optimizer", f"unknown optimizer '{optimizer}'; supported: 'adamw' or None")
        if batch_shapes is None:
            raise CaptureError("inputs", "a pipeline needs the batch shapes (the first stage's input and the "
                               "loss target)")
        with eager_mask_decisions(batch_shapes):
            step = capture_pipeline(model_factory, parallelize, plan, mesh, batch_shapes,
                                    torch_dtype=_DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype,
                                    optimizer=optimizer, capture_part=capture_part,
                                    plan_name=getattr(parallelize, "__name__", plan_name))
        step.partitioner = partitioner
        return step
    if not custom and plan.pp > 1:  # before any work: the schedule must be one torch runs
        from flint.pipeline.schedules import check

        check(plan.pp_schedule, plan.pp, plan.microbatches, plan.pp_virtual_stages, plan.source)
    if optimizer not in (None, "adamw"):
        raise CaptureError("optimizer", f"unknown optimizer '{optimizer}'; supported: 'adamw' or None")
    torch_dtype = _DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if isinstance(dtype, str) and dtype not in _DTYPES:
        raise CaptureError("dtype", f"unknown dtype '{dtype}'; supported: {', '.join(_DTYPES)}")

    with fake_world(mesh.world_size):
        dm = device_mesh(mesh.shape, mesh.axis_names)
        torch._dynamo.reset()
        with torch.device("meta"):
            from flint.capture.byom import call_user, default_inputs, where_defined

            model = call_user(model_factory, (), "model", "the model factory")
        if not isinstance(model, nn.Module):
            raise CaptureError("model", f"the model factory returned {type(model).__name__}, not a torch.nn.Module",
                               where_defined(model_factory))
        unwrapped = ()
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            # torch.compile(model): the capture compiles the module itself (inductor would run on meta tensors)
            model = model._orig_mod
            unwrapped = (f"the model factory returned torch.compile({type(model).__name__}): captured is the module "
                         "itself, compiled by the capture (its graphs are what torch.compile runs, before inductor's "
                         "fusion: the fuse-pointwise pass prices that)",)
        if specs is None:
            specs = default_inputs(model, *default_batch)
            batch_shapes = {k: v.shape for k, v in specs.items()}
        if torch_dtype is not None:
            model.to(torch_dtype)
        param_dtype = next(model.parameters()).dtype
        global_params = {n: tuple(p.shape) for n, p in model.named_parameters()}
        buffers = {id(b): n for n, b in model.named_buffers()}
        staged = is_staged(model)
        if not custom:
            check_ac(plan, model, staged and parallelize is None)
            apply_float8(model, plan)  # torchao's Float8Linear, before parallelism (torchtitan's order)
        if not staged or custom or parallelize is not None:
            # any module, or the user's own parallelisation (fully_shard intercepted): the generic path
            from flint.capture.generic import capture_generic

            data_axes = [a for a in mesh.axis_names if a in ("dp_replicate", "dp_shard")]
            fn = plan if custom else parallelize
            if not custom and parallelize is None:
                plan.require(CAPTURE_FIELDS, "capture")
                if plan.loss_parallel:
                    raise PlanError("loss_parallel", "a model outside the zoo computes its own loss, which Flint "
                                    "captures as written; loss_parallel applies to zoo models (their "
                                    "CrossEntropyHead)", plan.source)
            tp_rules, tp_refused = None, ""
            if not custom and parallelize is None and plan.tp == 1:
                # from the model as built: Hugging Face matches its plan against the module names, which the
                # data-parallel groups and checkpoint wrappers below change
                from flint.capture.byom import planned_tp_rules

                tp_rules, tp_refused = planned_tp_rules(model)
            with eager_mask_decisions(specs):
                parts, local, notes, layers = capture_generic(
                    model, dm, mesh, specs, parallelize=fn, plan=None if custom else plan, loss=loss,
                    repeat=repeat, capture_part=capture_part, param_dtype=param_dtype, data_axes=data_axes,
                    local_batch=_local_batch, optimizer=optimizer, buffers=buffers)
            axes = group_axes(dm)
            _check_groups(parts, axes)
            torch._dynamo.reset()
            if parallelize is not None and not custom:
                plan_name = getattr(parallelize, "__name__", plan_name)
            clip = None if custom else _capture_clip(parts, dm, mesh, plan.max_norm, plan.pp > 1)
            return CapturedStep(parts, mesh, plan_name, axes, param_dtype, local, global_params,
                                None if custom or parallelize is not None else plan, partitioner, tp_rules, tp_refused,
                                unwrapped + tuple(notes), clip, layers)
        if repeat:
            _check_layers(model.layers)
        _check_batch(batch_shapes, ("tokens", "labels"))
        cfg = getattr(model, "config", None)
        plan.check_model(n_layers=getattr(cfg, "n_layers", None), n_experts=getattr(cfg, "n_experts", None))
        infos, model = apply(plan, model, dm)
        data_axes = [a for a in mesh.axis_names if a in ("dp_replicate", "dp_shard")]
        dp = mesh.group_size(data_axes) if data_axes else 1
        local = _local_batch(batch_shapes, dp)
        if not custom and plan.microbatches > 1:  # capture ONE microbatch; pipeline-split runs it M times
            plan.check_model(local_batch=next(iter(local.values()))[0])
            local = {k: (v[0] // plan.microbatches, *v[1:]) for k, v in local.items()}
        kw = dict(infos=infos, buffers=buffers, optimizer=optimizer)
        parts: list[CapturedPart] = []
        tokens = torch.zeros(local["tokens"], dtype=torch.long, device="meta")
        labels = torch.zeros(local["labels"], dtype=torch.long, device="meta")
        part, h = capture_part("embed", model.embed, (tokens,), ("input",), 1, **kw)
        parts.append(part)
        if repeat:
            # one body per block role: plain blocks and checkpointed blocks (selective-layer has
            # both; the role of the last block, whose backward comes first, is scheduled last)
            n_layers = len(model.layers)
            stage_layers = pattern_stages(plan, n_layers)
            if stage_layers is not None:
                # with pipeline stages: the pattern (ac_every - 1 plain blocks, then a checkpointed one) is the
                # repeated block, whole repeats per stage (check_ac), and pp_layers counts patterns
                every = plan.ac_every
                part, h = capture_part("block", _Stack(model.layers[:every]), (h.detach().requires_grad_(),),
                                       ("activation",), n_layers // every, **kw)
                parts.append(part)
                plan = plan.replace(pp_layers=tuple(n // every for n in stage_layers))
            else:
                checkpointed = ac_layers(plan, n_layers)
                plain = [i for i in range(n_layers) if i not in checkpointed]
                roles = [(name, idx[0], len(idx)) for name, idx in (("block", plain), ("block_ac", checkpointed))
                         if idx]
                if len(roles) == 1:
                    roles = [("block", roles[0][1], n_layers)]
                elif n_layers - 1 in plain:
                    roles.reverse()
                x = h.detach()
                for name, index, count in roles:
                    part, h = capture_part(name, model.layers[index], (x.requires_grad_(),), ("activation",), count,
                                           **kw)
                    parts.append(part)
                    x = x.detach()
        else:
            h = h.detach().requires_grad_()
            part, h = capture_part("layers", _Stack(model.layers), (h,), ("activation",), 1, **kw)
            parts.append(part)
        h = h.detach().requires_grad_()
        # torch's loss_parallel: the cross-entropy's forward and backward on vocabulary-sharded logits
        with loss_context(plan):
            part, _ = capture_part("head", model.head, (h, labels), ("activation", "input"), 1, **kw)
        parts.append(part)
        axes = group_axes(dm)
        _check_groups(parts, axes)
        clip = _capture_clip(parts, dm, mesh, plan.max_norm, plan.pp > 1)  # None unless the parts have norms
        torch._dynamo.reset()
    return CapturedStep(parts, mesh, plan_name, axes, param_dtype, local, global_params, plan, partitioner,
                        notes=unwrapped, clip=clip)


class _Stack(nn.Module):
    """The whole layer stack as one module (``repeat=False``)."""

    def __init__(self, layers: nn.ModuleList) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(h)
        return h


def _check_batch(batch_shapes: Mapping[str, Sequence[int]], needed: Sequence[str]) -> None:
    for key in needed:
        if key not in batch_shapes:
            raise CaptureError("batch_shapes", f"missing '{key}' (a StagedLM takes {list(needed)})")


def _local_batch(batch_shapes: Mapping[str, Sequence[int]], dp: int) -> dict[str, tuple[int, ...]]:
    local = {}
    for key, shape in batch_shapes.items():
        shape = tuple(int(s) for s in shape)
        if not shape or shape[0] % dp:
            raise CaptureError(f"batch_shapes['{key}'][0]",
                               f"global batch {shape[0] if shape else None} is not divisible by the "
                               f"data-parallel degree {dp}")
        local[key] = (shape[0] // dp, *shape[1:])
    return local


def _check_groups(parts: list[CapturedPart], axes: dict[str, tuple[int, ...]]) -> None:
    for part in parts:
        for g in part.graphs():
            for node in g.nodes():
                if opclass.classify_aten(node.target) in opclass.COLLECTIVES:
                    name = opclass.collective_group(node)
                    if name not in axes:
                        raise CaptureError("plan", f"collective {node.target} in part '{part.name}' uses "
                                           f"process group '{name}', which spans no mesh axis set Flint knows")
