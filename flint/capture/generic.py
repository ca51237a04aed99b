"""Capture any ``nn.Module`` (Hugging Face models, plain MLPs and CNNs) under a parallelize function.

The model is parallelized as a training script would (``parallelize(model,
mesh)``: :mod:`flint.capture.byom`), its layer stack and the run of a
repeating pattern of layers in it are found
(:func:`flint.capture.byom.find_layers`), and the step is captured as two
parts: ``block`` (the run's first period alone, one layer or several, each on
the inputs it receives in the model's own forward, repeated once per period of
the run) and ``model`` (the model's forward and loss with the run's layers
replaced by a pass-through, so it holds exactly the work outside them: the
embedding, the head, and layers outside the run, such as DeepSeek-V3's dense
first layers). The run is found on the model as built, and narrowed to what
the parallelize function made of its layers (:func:`_layer_kind`): a pattern
of layers checkpointed, sharded or grouped alike (selective-layer
checkpointing every 2nd layer: two layers, the second checkpointed), repeated,
and the layers after its last whole repeat run in the model part. A model
without a pattern that repeats at least twice is captured whole as one part
``model``, and so is one whose layers take a
second input that needs a gradient (an encoder's output into decoder layers)
or a hidden state that needs none (:func:`_why_capture_whole`), unless
only the run's first layers receive one that needs none (a frozen embedding
or frozen bottom layers): those run in the model part and the rest is the
run. After the backward, every trainable parameter must have a gradient.

Under a plan, the ``model`` part is two where it can be (:func:`_why_one_part`):
``first_stage`` (the forward up to the run, returning the hidden state it
sends) and ``last_stage`` (from the hidden state received to the loss), each
holding the parameters read on its side of the run (:func:`_stage_order`,
:func:`_capture_stages`): with pipeline stages (plan ``pp`` > 1) as torch's
pipelining places them; without, so the head's backward runs before the
blocks' as in the real step.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from flint.capture import opclass
from flint.capture.byom import (GroupCall, InputSpec, call_user, check_inputs, find_layers, forward_parameters,
                                input_dtype, intercept, loss_of, preset_parallelize, where_defined)
from flint.capture.errors import CaptureError
from flint.capture.recipes import ParamGroup, ParamInfo, wrapped_attr


class _Stop(Exception):
    pass


class CallModel(nn.Module):
    """``model(**forward_inputs)`` reduced to the scalar loss (:func:`flint.capture.byom.loss_of`)."""

    def __init__(self, model: nn.Module, names: Sequence[str], targets: Sequence[str], loss: str) -> None:
        super().__init__()
        self.model = model
        self.names = tuple(names)
        self.targets = tuple(targets)
        self.loss = loss

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        kw = dict(zip(self.names, args))
        targets = {k: kw.pop(k) for k in self.targets}
        return loss_of(self.model(**kw), targets, self.loss)


class _BlockCall(nn.Module):
    """A period of layers (one, or a repeating pattern such as Llama 4's four) called on the (flattened)
    arguments each received in the model's forward, each after the first on the previous one's hidden state in
    place of its first tensor argument. ``tensors``: the first layer's hidden state, then each layer's other
    tensors."""

    def __init__(self, layers: Sequence[nn.Module], specs: Sequence[Any], consts: Sequence[list[Any]]) -> None:
        super().__init__()
        # module paths: block.<...> for one layer (as ever), block.<i>.<...> for a period of several
        self.block = layers[0] if len(layers) == 1 else nn.ModuleList(layers)
        self.period = len(layers)
        self.specs = list(specs)
        self.consts = [list(c) for c in consts]  # per layer: non-tensor leaves, _TENSOR where a tensor goes

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        it = iter(tensors)
        hidden = None
        layers = [self.block] if self.period == 1 else list(self.block)
        for layer, spec, consts in zip(layers, self.specs, self.consts):
            leaves, first = [], True
            for c in consts:
                if c is _TENSOR and first and hidden is not None:
                    leaves.append(hidden)  # the previous layer's output, not a recorded input
                else:
                    leaves.append(next(it) if c is _TENSOR else c)
                first = first and c is not _TENSOR
            args, kwargs = tree_unflatten(leaves, spec)
            hidden = _first_tensor(layer(*args, **kwargs))
        return hidden


_TENSOR = object()


def _first_tensor(out: Any) -> torch.Tensor:
    leaves, _ = tree_flatten(out)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            return leaf
    raise CaptureError("model", f"a block returned no tensor ({type(out).__name__})")


class _Skip(nn.Module):
    """A block replaced by a pass-through: returns its hidden-state input in the block's output structure."""

    def __init__(self, out_spec: Any, n_leaves: int, first: int, block: nn.Module) -> None:
        super().__init__()
        self.out_spec, self.n_leaves, self.first = out_spec, n_leaves, first
        # the replaced block, unregistered (its parameters are the block part's): a container's forward may
        # read its blocks' attributes (nn.TransformerEncoder reads layers[0].self_attn.batch_first)
        object.__setattr__(self, "_replaced", block)

    def __getattr__(self, name: str) -> Any:
        return wrapped_attr(self, name, self.__dict__.get("_replaced"))

    def forward(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        leaves = [None] * self.n_leaves
        leaves[self.first] = hidden
        return tree_unflatten(leaves, self.out_spec)


class _Cut(_Skip):
    """The run's first layer in the capture of ``first_stage`` / ``last_stage`` (with or without pipeline
    stages): the first part ends at its hidden-state input (kept in ``holder.seen``), the last part starts with
    ``holder.feed`` in its place (the hidden state the last stage receives); the model's work on the other side
    of the cut is dead code in the part's graph (:func:`flint.capture.step._drop_dead`)."""

    def __init__(self, out_spec: Any, n_leaves: int, first: int, block: nn.Module, holder: Any) -> None:
        super().__init__(out_spec, n_leaves, first, block)
        object.__setattr__(self, "_holder", holder)

    def forward(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        holder = self.__dict__["_holder"]
        if holder.feed is not None:
            hidden = holder.feed
        else:
            holder.seen = hidden
        return super().forward(hidden, *args, **kwargs)


class _Holder:
    feed: torch.Tensor | None = None
    seen: torch.Tensor | None = None


class _FirstStage(nn.Module):
    """The work before the repeated run (the first pipeline stage's): the model's forward up to the run,
    returning the hidden state it hands on."""

    def __init__(self, call: nn.Module, holder: _Holder) -> None:
        super().__init__()
        self.call = call
        object.__setattr__(self, "_holder", holder)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        self.call(*args)  # feed is None outside _LastStage.forward: the cut keeps what it receives
        return self.__dict__["_holder"].seen


class _LastStage(nn.Module):
    """The work after the repeated run (the last pipeline stage's): from the hidden state it receives (in place
    of the run's output) through the head to the loss."""

    def __init__(self, call: nn.Module, holder: _Holder) -> None:
        super().__init__()
        self.call = call
        object.__setattr__(self, "_holder", holder)

    def forward(self, hidden: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        holder = self.__dict__["_holder"]
        holder.feed = hidden
        try:
            return self.call(*args)
        finally:
            holder.feed = None


def _stage_order(call: nn.Module, args: Sequence[torch.Tensor], blocks: nn.Module, keys: Sequence[str]):
    """Where each parameter is read in the model's forward, relative to the layers ``keys`` of the stack: one
    eager run on fake tensors, before the parallelize function. Returns (per parameter name, the call times of
    the modules holding it; per layer key, the (start, end) times of its call; per buffer name, as per
    parameter)."""
    names = {id(p): n for n, p in call.model.named_parameters()}
    buffer_names = {id(b): n for n, b in call.model.named_buffers()}
    used: dict[str, list[int]] = {}
    buffers: dict[str, list[int]] = {}
    spans: dict[str, list[int]] = {}
    clock = [0]

    def tick() -> int:
        clock[0] += 1
        return clock[0]

    def on_call(mod, a, kw):  # noqa: ANN001
        t = tick()
        for p in mod._parameters.values():
            if p is not None and id(p) in names:
                used.setdefault(names[id(p)], []).append(t)
        for b in mod._buffers.values():
            if b is not None and id(b) in buffer_names:
                buffers.setdefault(buffer_names[id(b)], []).append(t)

    handles = [m.register_forward_pre_hook(on_call, with_kwargs=True) for m in call.model.modules()
               if any(p is not None for p in (*m._parameters.values(), *m._buffers.values()))]

    def enter(key: str) -> Callable:
        def hook(mod, a) -> None:  # noqa: ANN001
            spans.setdefault(key, [tick(), 0])
        return hook

    def leave(key: str) -> Callable:
        def hook(mod, a, out) -> None:  # noqa: ANN001
            spans[key][1] = tick()
        return hook

    for key in keys:
        handles.append(blocks._modules[key].register_forward_pre_hook(enter(key)))
        handles.append(blocks._modules[key].register_forward_hook(leave(key)))
    _run_on_fake(call, args, handles, grad=False)
    return used, {k: tuple(v) for k, v in spans.items()}, buffers


def _stage_params(order, run: Sequence[str], source: Any, strict: bool = True) -> tuple[set[str], set[str]]:
    """(the first stage's, the last stage's) parameter names: those read before the run's first layer and after
    its last (:func:`_stage_order`). One read on both sides (tied input and output embeddings) is refused
    (``strict``: pipeline stages), else kept on the first side (:func:`_why_one_part` then keeps one part)."""
    used, spans, _ = order
    start, end = spans[run[0]][0], spans[run[-1]][1]
    first = {n for n, ts in used.items() if any(t < start for t in ts)}
    last = {n for n, ts in used.items() if any(t > end for t in ts)}
    if (both := sorted(first & last)) and strict:
        from flint.plan import PlanError

        raise PlanError("pp", f"parameter(s) {', '.join(both)} are read both before and after the repeated layers "
                        "(tied input and output embeddings): with pipeline parallelism the first and the last stage "
                        "would each hold them, which torch's pipelining does not share; untie them "
                        "(tie_word_embeddings = False) or capture without pp", source)
    return first, last


def _buffer_sides(order, run: Sequence[str]) -> tuple[set[str], set[str]]:
    """(the buffers only the work before the repeated run reads, those only the work after it reads): a stage's
    part runs the other's modules too, for nothing but their buffer updates (BatchNorm's running statistics),
    which are the other part's work (:func:`_stage_order`)."""
    _, spans, buffers = order
    start, end = spans[run[0]][0], spans[run[-1]][1]
    before = {n for n, ts in buffers.items() if any(t < start for t in ts)}
    after = {n for n, ts in buffers.items() if any(t > end for t in ts)}
    return before - after, after - before


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _infos_after_tp(model: nn.Module, before: dict[str, ParamInfo]) -> dict[int, ParamInfo]:
    infos = {}
    for name, p in model.named_parameters():
        name = name.replace("._checkpoint_wrapped_module", "")  # the AC wrapper is not part of the name
        local = _local(p)
        sharding = {}
        if isinstance(p, DTensor):
            names = p.device_mesh.mesh_dim_names or ()
            for dim, pl in enumerate(p.placements):
                if isinstance(pl, Shard):
                    sharding[names[dim] if dim < len(names) else str(dim)] = pl.dim
        old = before.get(name)
        infos[id(p)] = ParamInfo(name, tuple(p.shape) if old is None else old.global_shape, tuple(local.shape),
                                 p.dtype, sharding)
    return infos


def _apply_groups(root: nn.Module, calls: Sequence[GroupCall], infos: dict[int, ParamInfo]) -> nn.Module:
    """Turn recorded fully_shard / replicate calls into ParamGroups (bottom-up, as FSDP2 assigns parameters)."""
    taken: set[int] = set()
    for call in calls:
        mesh = call.mesh
        names = mesh.mesh_dim_names or ()
        if mesh.ndim == 2 and call.mode == "fsdp":
            dp_mesh, rep_mesh = mesh[names[1]], mesh[names[0]]
        elif mesh.ndim == 1:
            dp_mesh, rep_mesh = mesh, None
        else:
            raise CaptureError("parallelize", f"{'fully_shard' if call.mode == 'fsdp' else 'replicate'} on a "
                               f"{mesh.ndim}-D mesh {names}: expected 1-D (or 2-D for HSDP)", call.source)
        names_of = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
        for m in call.modules:
            if id(m) not in names_of:
                raise CaptureError("parallelize", f"{type(m).__name__} given to "
                                   f"{'fully_shard' if call.mode == 'fsdp' else 'replicate'} is not part of the model",
                                   call.source)
        only = None
        module = call.modules[0]
        if len(call.modules) > 1:
            # fully_shard([norm, output]): one group (one collective) of several modules' parameters,
            # held by their lowest common ancestor and gathered when it runs
            paths = [names_of[id(m)].split(".") if names_of[id(m)] else [] for m in call.modules]
            common = []
            for parts in zip(*paths):
                if len(set(parts)) != 1:
                    break
                common.append(parts[0])
            module = root.get_submodule(".".join(common)) if common else root
            only = {id(p) for m in call.modules for p in m.parameters()}
        is_root = module is root or names_of.get(id(module)) in ("", "module")
        params = [p for p in module.parameters() if id(p) not in taken and (only is None or id(p) in only)]
        if not params:
            continue  # FSDP2: a group with no parameters left moves nothing
        parents = {id(c): (p, n) for p in root.modules() for n, c in p.named_children()}
        while id(module) in parents and isinstance(parents[id(module)][0], ParamGroup):
            # the module already holds an earlier group (fully_shard([norm, output]) at the root): the new
            # group wraps that group, whose names are relative to the module it holds
            module = parents[id(module)][0]
        # FSDP2 never reshards the root group after forward (its parameters are used first in backward)
        reshard = call.reshard_after_forward and not (is_root and only is None)
        group = ParamGroup(module, dp_mesh, call.mode, "", infos, rep_mesh, exclude=taken,
                           reshard_after_forward=reshard, param_dtype=call.param_dtype, only=only,
                           reduce_dtype=call.reduce_dtype)
        taken.update(id(p) for p in group.local.values())
        if module is root:
            root = group
        else:
            parent, attr = parents[id(module)]
            parent._modules[attr] = group
    return root


def _run_on_fake(call: nn.Module, args: Sequence[torch.Tensor], handles: Sequence[Any], *, grad: bool,
                 why: str = "") -> None:
    """``call(*args)`` eagerly on fake tensors, as dynamo will see the model: code that branches on "am I
    traced?" (Hugging Face's is_tracing checks for FakeTensor) takes the traced branch, and nothing
    data-dependent runs. A hook may end the run early (:class:`_Stop`); ``handles`` (the hooks) are removed
    after. A failure is a :class:`CaptureError` naming the user's line, followed by ``why`` (a likely cause)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with mode, torch.set_grad_enabled(grad):
            call(*[mode.from_tensor(a) for a in args])
    except _Stop:
        pass
    except CaptureError:
        raise
    except Exception as e:  # noqa: BLE001
        from flint.capture.byom import _user_frame
        raise CaptureError("model", f"running the model on the inputs failed: {type(e).__name__}: "
                           f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}{why}",
                           _user_frame(e.__traceback__, "")) from None
    finally:
        for h in handles:
            h.remove()


def _record_block_inputs(call: nn.Module, args: Sequence[torch.Tensor], layers: Sequence[nn.Module],
                         why: str = ""):
    """Run the model eagerly (meta tensors) through the first period of repeated layers: per layer, its args,
    kwargs and output structure. ``why``: a likely cause to add to a failure (:func:`_run_on_fake`)."""
    seen: list[tuple[Any, Any, Any]] = []

    def hook(mod, a, kw):
        handles[len(seen)].remove()
        with torch.no_grad():
            out = mod(*a, **kw)
        seen.append((a, kw, out))
        if len(seen) == len(layers):
            raise _Stop
        return None

    handles = [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in layers]
    # with autograd, as in training: which of the layers' inputs need a gradient
    _run_on_fake(call, args, handles, grad=True, why=why)
    if len(seen) < len(layers):
        raise CaptureError("model", "the forward never called its repeated block "
                           f"({type(layers[len(seen)]).__name__})",
                           where_defined(call.model if hasattr(call, "model") else call))
    return [tuple(tree_map(_fresh, x) for x in rec) for rec in seen]


def _fresh(t: Any) -> Any:
    """A meta tensor (or DTensor) like ``t``, outside the recording's fake mode, needing a gradient if ``t`` did."""
    if isinstance(t, DTensor):
        local = t.to_local()
        fresh = torch.empty_strided(local.shape, local.stride(), dtype=local.dtype, device="meta")
        return DTensor.from_local(fresh.requires_grad_(t.requires_grad), t.device_mesh, t.placements,
                                  run_check=False, shape=t.shape, stride=t.stride())
    if isinstance(t, torch.Tensor):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta").requires_grad_(t.requires_grad)
    return t


def _why_capture_whole(layers: Sequence[nn.Module], recorded: Sequence[tuple[Any, Any, Any]]) -> str:
    """Why the run's layers cannot be passed through in the model part, from what they receive in the model's
    forward (``recorded``: :func:`_record_block_inputs`), or "". A second input that needs a gradient
    (:func:`_second_input_with_gradient`). A hidden state that needs none where it enters the run (a float input
    straight into the layers): the pass-through's output would need none either, so what reads it would skip
    its input gradient, which the layers' output needs in the real step."""
    if why := _second_input_with_gradient(layers, recorded):
        return why
    if _hidden_needs_no_gradient(layers, recorded):
        return (f"the hidden state {type(layers[0]).__name__} receives needs no gradient (nothing trainable "
                "computes it), so a pass-through's output would need none either")
    return ""


def _hidden_needs_no_gradient(layers: Sequence[nn.Module], recorded: Sequence[tuple[Any, Any, Any]]) -> bool:
    """Whether the hidden state (the first tensor) the first of ``layers`` receives needs no gradient, where the
    layers have trainable parameters: nothing trainable computes it (a float input straight into the layers, a
    frozen embedding, frozen layers before them)."""
    b_args, b_kwargs, _ = recorded[0]
    hidden = next(t for t in tree_flatten((tuple(b_args), dict(b_kwargs)))[0] if isinstance(t, torch.Tensor))
    return not hidden.requires_grad and any(p.requires_grad for layer in layers for p in layer.parameters())


def _second_input_with_gradient(layers: Sequence[nn.Module], recorded: Sequence[tuple[Any, Any, Any]]) -> str:
    """Why a pass-through of ``layers`` would lose part of the step, or "": a tensor they receive besides the
    hidden state (a layer's first tensor) needs a gradient, so the pass-through would leave it unread, and what
    computes it would drop out (masks, rotary tables and position biases of buffers need none)."""
    for layer, (b_args, b_kwargs, _) in zip(layers, recorded):
        inner = getattr(layer, "_checkpoint_wrapped_module", layer)
        try:
            names = list(inspect.signature(inner.forward).parameters)
        except (TypeError, ValueError):
            names = []
        seen_hidden = False
        for key, value in [(i, a) for i, a in enumerate(b_args)] + list(b_kwargs.items()):
            for t in tree_flatten(value)[0]:
                if not isinstance(t, torch.Tensor):
                    continue
                if seen_hidden and t.requires_grad:
                    name = key if isinstance(key, str) else names[key] if key < len(names) else f"argument {key}"
                    return (f"{type(inner).__name__}.forward's '{name}' needs a gradient, which a pass-through "
                            "would leave unread, so what computes it would drop out of the step")
                seen_hidden = True
    return ""


def _described(value: Any) -> str:
    """A checkpoint wrapper's argument, compared across layers: a function by its name (torchtitan builds one
    policy closure per layer), a ``functools.partial`` by its function and arguments."""
    if isinstance(value, functools.partial):
        return f"{_described(value.func)}({', '.join(_described(a) for a in value.args)})"
    if callable(value):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__name__)}"
    return repr(value)


def _layer_kind(layer: nn.Module, calls: Sequence[GroupCall]) -> tuple[tuple, tuple, tuple]:
    """What the parallelize function made of one layer, which :func:`flint.capture.byom.find_layers` (run
    before it) could not compare: (the modules with their checkpoint wrappers' arguments, the parameters' local
    shapes and placements, the data-parallel groups on the layer or inside it with their options)."""
    names = {id(m): n for n, m in layer.named_modules()}
    modules = tuple((n, type(m).__name__, tuple(sorted((k, _described(v)) for k, v in m.checkpoint_fn.keywords.items()))
                     if isinstance(getattr(m, "checkpoint_fn", None), functools.partial) else ())
                    for n, m in layer.named_modules())
    params = tuple((n, tuple(_local(p).shape), p.dtype, tuple(map(str, p.placements)) if isinstance(p, DTensor)
                    else ()) for n, p in layer.named_parameters())
    groups = tuple((tuple(names[id(m)] for m in c.modules), c.mode, c.reshard_after_forward, c.param_dtype,
                    c.reduce_dtype, getattr(c.mesh, "mesh_dim_names", None))
                   for c in calls if all(id(m) in names for m in c.modules))
    return modules, params, groups


_KIND_PARTS = ("activation checkpointing", "parameter sharding", "data-parallel groups or their options")


def _differs(kinds: Sequence[tuple]) -> str:
    """What differs among the layers of ``kinds`` (:func:`_layer_kind`), in words."""
    return " and ".join(what for i, what in enumerate(_KIND_PARTS) if len({k[i] for k in kinds}) > 1)


def _repeating(kinds: Sequence[tuple], period: int) -> tuple[int, int]:
    """(layers per repeat, repeats): of the patterns whose length is a multiple of ``period`` (the structure's),
    the one whose leading repeats over ``kinds`` cover the most layers, then the shortest; repeats 1 if none
    repeats twice."""
    best = (period, 1)
    for size in range(period, len(kinds) // 2 + 1, period):
        repeats = 1
        while (repeats + 1) * size <= len(kinds) and kinds[repeats * size:(repeats + 1) * size] == kinds[:size]:
            repeats += 1
        if repeats >= 2 and repeats * size > best[0] * best[1]:
            best = (size, repeats)
    return best


def _why_one_part(sides: tuple[set[str], set[str]], root: nn.Module, in_run: set[int], infos: dict[int, ParamInfo],
                  staged: bool) -> str:
    """Why the work outside the repeated run stays one part (without pipeline stages), or "": a parameter read
    on both sides (tied embeddings), or a data-parallel group holding parameters of both (a root ``fully_shard``
    over the embedding and the head: FSDP2 gathers it once, at the start of the forward, for both sides). With
    pipeline stages the preset groups each side apart; a group over both is refused."""
    if both := sorted(sides[0] & sides[1]):
        return f"{', '.join(both)} is read both before and after the repeated layers (tied embeddings)"
    for g in root.modules():
        if not isinstance(g, ParamGroup):
            continue
        names = [infos[id(p)].name for p in g.local.values() if id(p) in infos and id(p) not in in_run]
        after = [n for n in names if n in sides[1]]
        if after and len(after) < len(names):
            mode = "fully_shard" if g.mode == "fsdp" else "replicate"
            before = next(n for n in names if n not in after)
            why = f"one {mode} group holds parameters read before the repeated layers ({before}) and after them " \
                  f"({after[0]})"
            if staged:
                raise CaptureError("parallelize", f"{why}: with pipeline stages each stage's modules need a group "
                                   "of their own")
            return why
    return ""


def _capture_stages(call: nn.Module, holder: _Holder, args: Sequence[torch.Tensor], block_out: torch.Tensor,
                    sides: tuple[set[str], set[str]], buffers: tuple[set[str], set[str]], in_run: set[int],
                    infos: dict[int, ParamInfo], capture_part: Callable, kw: dict[str, Any]) -> list[Any]:
    """Parts ``first_stage`` (the model's forward up to the repeated run, returning the hidden state it sends)
    and ``last_stage`` (from the hidden state the run returns to the loss), each holding the parameters it reads
    (``sides``, :func:`_stage_params`; a parameter read on neither side, outside the run, stays with the first
    stage, whose capture then names it as lacking a gradient) and updating the buffers only its side reads
    (``buffers``, :func:`_buffer_sides`: each part runs the whole forward, the other side's work dead but for
    those updates, which it leaves out)."""
    name = lambda p: infos[id(p)].name if id(p) in infos else None  # noqa: E731
    last = lambda p: name(p) in sides[1]  # noqa: E731
    first = lambda p: id(p) not in in_run and not last(p)  # noqa: E731
    fpart, hidden = capture_part("first_stage", _FirstStage(call, holder), args, ("input",) * len(args), 1,
                                 only=first, others_update=buffers[1], **kw)
    _check_gradients(call, infos, "first_stage", first)
    if tuple(hidden.shape) != tuple(block_out.shape) or hidden.dtype != block_out.dtype:
        raise CaptureError("model", f"the repeated layers take a {list(hidden.shape)} {hidden.dtype} hidden state "
                           f"but return {list(block_out.shape)} {block_out.dtype}: pipeline stages exchange one "
                           "tensor of one shape")
    for p in call.parameters():
        p.grad = None
    h = _fresh(block_out.detach().requires_grad_())
    lpart, _ = capture_part("last_stage", _LastStage(call, holder), (h, *args),
                            ("activation",) + ("input",) * len(args), 1, only=last, others_update=buffers[0], **kw)
    _check_gradients(call, infos, "last_stage", last)
    return [fpart, lpart]


def _held(part: Any, path: str) -> str:
    """The modules whose parameters ``part`` holds, for a note: a layer of the stack at ``path`` as a whole."""
    def owner(name: str) -> str:
        if name.startswith(f"{path}."):
            return f"{path}.{name[len(path) + 1:].split('.')[0]}"
        return name.rpartition(".")[0] or name

    return ", ".join(dict.fromkeys(owner(q.name) for q in part.params)) or "nothing"


def _check_gradients(module: nn.Module, infos: dict[int, ParamInfo], part: str,
                     only: Callable[[torch.Tensor], bool] | None = None) -> None:
    lacking = [infos[id(p)].name if id(p) in infos else "?" for p in module.parameters()
               if p.requires_grad and p.grad is None and (only is None or only(p))]
    if lacking:
        shown = ", ".join(lacking[:8]) + (f" and {len(lacking) - 8} more" if len(lacking) > 8 else "")
        raise CaptureError("model", f"the captured backward of part '{part}' gives no gradient to "
                           f"{len(lacking)} parameter(s): {shown} (the loss does not depend on them, or an op "
                           "on the way has no derivative)")


def _resolve_hf_loss(model: nn.Module) -> None:
    """Hugging Face's ``loss_function`` property logs a warning (untraceable) when ``loss_type`` is unset.

    Resolve it once eagerly, as the first eager call would, and keep it where
    the property looks first (``_loss_function``); the traced loss is the same.
    """
    # training keeps no KV cache (as HF's Trainer and torchtitan do); an encoder-decoder's stacks hold their own
    # copies of the config (T5's decoder would build a cache from its copy)
    for m in model.modules():
        sub = getattr(m, "config", None)
        if getattr(sub, "use_cache", None):
            sub.use_cache = False
    prop = getattr(type(model), "loss_function", None)
    if isinstance(prop, property) and not hasattr(model, "_loss_function"):
        try:
            model._loss_function = model.loss_function
        except Exception:  # noqa: BLE001 - not an HF model after all
            pass


def _grad_forcing_hooks(model: nn.Module) -> list[tuple[str, nn.Module, Callable]]:
    """(module path, module, hook) of each forward hook calling ``requires_grad_()``, as transformers' and
    peft's ``enable_input_require_grads`` does on the input embedding's output (so that reentrant activation
    checkpointing sees an input needing a gradient with the embedding frozen)."""
    return [(name or type(model).__name__, m, fn) for name, m in model.named_modules()
            for fn in m._forward_hooks.values()
            if "requires_grad_" in getattr(getattr(fn, "__code__", None), "co_names", ())]


def _without_hooks(capture_part: Callable, hooks: Sequence[tuple[str, nn.Module, Callable]]) -> Callable:
    """``capture_part`` compiling without ``hooks``: torch.compile cannot return what depends on an intermediate
    made to need a gradient. The eager runs that find the layers keep them, so the hidden state they mark enters
    the repeated layers needing a gradient, as in the real step (the first layer computes its input gradient);
    the part before the layers, which the hook's output leaves, then needs none. A model captured as one part
    (the hidden state passed through inside it, or no repeated layers) would lose that gradient: refused."""
    def without(name: str, *args: Any, **kwargs: Any) -> Any:
        where = ", ".join(dict.fromkeys(f"{path} ({getattr(fn, '__qualname__', fn)})" for path, _, fn in hooks))
        if name == "model":
            raise CaptureError("model", f"forward hook(s) calling requires_grad_() on a module's output: {where} "
                               "(transformers' / peft's enable_input_require_grads); torch.compile cannot capture "
                               "them, and this model's work outside its repeated layers is captured as one part, "
                               "which would lose the gradient they create. Remove them: they are needed only with "
                               "reentrant activation checkpointing (gradient_checkpointing_enable("
                               "gradient_checkpointing_kwargs={'use_reentrant': False}) does without them)")
        saved = [(m, dict(m._forward_hooks)) for _, m, _ in hooks]
        try:
            for _, m, fn in hooks:
                for key in [k for k, h in m._forward_hooks.items() if h is fn]:
                    del m._forward_hooks[key]
            return capture_part(name, *args, **kwargs)
        finally:
            for m, before in saved:
                m._forward_hooks.clear()
                m._forward_hooks.update(before)
    return without


def capture_generic(model: nn.Module, dm, mesh, inputs: Mapping[str, InputSpec], **kw):
    """(parts, local batch shapes, notes, the path of the stack whose layers the preset wraps one by one or
    None) of ``model`` (see the module docstring). A failure while a
    floating-point input is given a dtype other than the model's says so (the likely cause: a float32
    input into a model cast to bfloat16 fails inside the first layer, far from its cause)."""
    try:
        with warnings.catch_warnings():
            # DTensor's dropout on the capture's CPU mesh (a sequence-parallel stream): the fake run's RNG, not
            # what the program computes
            warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
            return _capture_generic(model, dm, mesh, inputs, **kw)
    except CaptureError as e:
        name = lambda t: str(t).removeprefix("torch.")  # noqa: E731
        other = [(k, name(s.dtype)) for k, s in inputs.items()
                 if s.dtype is not None and s.dtype.is_floating_point and s.dtype != kw["param_dtype"]]
        if not other or e.field == "inputs":  # an error about the inputs' names: not a dtype's consequence
            raise
        raise CaptureError(e.field, f"{e.message}\n  (input {', '.join(f'{k!r} is {t}' for k, t in other)} while the "
                           f"model runs in {name(kw['param_dtype'])}: give its shape without a dtype to follow the "
                           f"model's, or set the model dtype (--dtype, workload.dtype) to {other[0][1]})",
                           e.source) from e


def _capture_generic(model: nn.Module, dm, mesh, inputs: Mapping[str, InputSpec], *, parallelize: Callable | None,
                     plan, loss: str, repeat: bool, capture_part: Callable, param_dtype: torch.dtype,
                     data_axes: Sequence[str], local_batch: Callable, optimizer: str | None,
                     buffers: dict[int, str]):
    _resolve_hf_loss(model)
    forcing = _grad_forcing_hooks(model)
    if forcing:
        capture_part = _without_hooks(capture_part, forcing)
    names, var_kw = forward_parameters(model)
    targets = [n for n in inputs if n not in names and not var_kw]
    check_inputs(model, list(inputs), targets if loss != "auto" or targets else ())
    stack = find_layers(model)  # the preset's parameter groups; its run of a repeating pattern is repeated
    run = stack.keys if stack is not None and repeat else ()
    blocks = stack.container if run else None
    before = {n: ParamInfo(n, tuple(p.shape), tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
    if parallelize is not None and plan is not None and plan.activation_checkpoint != "none":
        from flint.plan import PlanError

        raise PlanError("activation_checkpoint", f"'{plan.activation_checkpoint}' with your own parallelize "
                        "function: apply checkpoint_wrapper to the blocks in that function (after TP, before "
                        "fully_shard, as torchtitan does); Flint applies the plan's mode only with its presets",
                        plan.source)
    dp = mesh.group_size(data_axes) if data_axes else 1
    local = local_batch({k: v.shape for k, v in inputs.items()}, dp)
    if plan is not None and plan.microbatches > 1:  # ONE microbatch is captured; pipeline-split runs it M times
        plan.check_model(local_batch=next(iter(local.values()))[0])
        local = {k: (v[0] // plan.microbatches, *v[1:]) for k, v in local.items()}
    args = tuple(torch.zeros(local[k], dtype=input_dtype(k, spec, param_dtype), device="meta")
                 for k, spec in inputs.items())
    # the work outside the repeated layers, split where it runs: before them (the first pipeline stage) and after
    # them (the last), as torchtitan splits a model into stage parts; without pipeline stages too, where it can
    # be (:func:`_why_one_part`), so the head's backward comes before the blocks' as in the real step
    order = _stage_order(CallModel(model, list(inputs), targets, loss), args, blocks, run) \
        if run and plan is not None else None
    staged = order is not None and plan.pp > 1
    preset = parallelize is None and plan is not None
    if preset:
        # the preset applies the plan's activation checkpointing to the found blocks
        parallelize = preset_parallelize(plan, model, stack.path if stack else None,
                                         _stage_params(order, run, plan.source) if staged else None)
    calls: list[GroupCall] = []
    if parallelize is not None:
        globs = getattr(parallelize, "__globals__", None)
        with intercept(globs) as rec:
            result = call_user(parallelize, (model, dm), "parallelize", "the parallelize function")
        calls = rec.groups
        if isinstance(result, nn.Module):
            order = order if result is model else None  # another module: the parameters' names may differ
            model = result
    infos = _infos_after_tp(model, before)
    call = CallModel(model, list(inputs), targets, loss)
    notes: list[str] = []
    if forcing:
        notes.append(f"forward hook(s) calling requires_grad_() ({', '.join(dict.fromkeys(p for p, _, _ in forcing))}: "
                     "enable_input_require_grads) left out of the compiled parts: the hidden state they mark "
                     "enters the repeated layers needing a gradient, as in the real step")
    tail_note = ""  # layers after the pattern's last repeat: where they are captured, once that is known
    size = stack.period if run else 1
    if run:
        # the parallelize function may treat the run's layers differently (every second one checkpointed, the
        # last one not resharded): the repeated block is the pattern of what it made of them, and layers after
        # the pattern's last repeat are captured in the model part, where they run
        made = [_layer_kind(blocks._modules[k], calls) for k in run]
        size, repeats = _repeating(made, stack.period)
        if repeats < 2:
            notes.append(f"{stack.path} captured whole, not as a repeated layer: the parallelize function gives "
                         f"its layers {_differs(made)} that follow no repeating pattern")
            run, blocks = (), None
        else:
            if size > stack.period:
                notes.append(f"{stack.path}: the repeated block is {size} layers, as the parallelize function "
                             f"gives them {_differs(made[:size])} in a pattern of {size}")
            if size * repeats < len(run):
                tail = range(size * repeats, len(run))
                other = _differs([k for i in tail for k in (made[i % size], made[i])])
                why = (f"the parallelize function gives them other {other}" if other else
                       "they do not make a whole repeat of its pattern")
                tail_note = (f"{stack.path}: layer(s) {', '.join(run[i] for i in tail)} captured in <where>, "
                             f"after the repeated block ({repeats} x {size} layer(s)): {why}")
                run = run[:size * repeats]
    period = run[:size]  # the keys of the run's first repeat
    first = [blocks._modules[k] for k in period]  # as parallelize left them (AC-wrapped)
    applied = getattr(parallelize, "tp_applied", "")
    why = (f"; under tensor parallelism, after {applied}: the model's code may assume its projections whole (a "
           "view by its config's head count, say); pass --parallelize with a plan of your own") if applied else ""
    recorded = _record_block_inputs(call, args, first, why) if blocks is not None else None
    lead: list[str] = []
    while recorded is not None and not staged and len(run) >= 3 * size and _hidden_needs_no_gradient(first, recorded):
        # the run's first layers receive a hidden state that needs no gradient (a frozen embedding, frozen first
        # layers: LoRA, partial fine-tuning): they run in the model part, before the repeated block, whose first
        # layer then receives one that does (the real step computes no input gradient for them)
        run, lead = run[size:], lead + list(run[:size])
        period = run[:size]
        first = [blocks._modules[k] for k in period]
        recorded = _record_block_inputs(call, args, first, why)
    if lead:
        notes.append(f"{stack.path}: layer(s) {', '.join(lead)} captured in the model part, before "
                     "the repeated block: the hidden state they receive needs no gradient (nothing trainable "
                     "computes it: a frozen embedding or frozen layers)")
    if recorded is not None and (why := _why_capture_whole(first, recorded)):
        if staged:
            from flint.plan import PlanError

            hint = ("; capture it on one device (flint capture --world-size 1) and expand it with pp in the plan "
                    "(flint expand): there the layers whose input needs no gradient run before the repeated ones"
                    if _hidden_needs_no_gradient(first, recorded) else "")
            raise PlanError("pp", f"{stack.path} is captured whole, not as repeated layers that pipeline stages "
                            f"could hold: {why}{hint}", plan.source)
        notes.append(f"{stack.path} captured whole, not as one repeated layer: {why}")
        blocks = recorded = None
    root = _apply_groups(model, calls, infos)
    call.model = root
    kw = dict(infos=infos, buffers=buffers, optimizer=optimizer)
    parts = []
    if blocks is not None:
        tensors, specs, consts, out_specs = [], [], [], []
        for j, (b_args, b_kwargs, b_out) in enumerate(recorded):
            leaves, spec = tree_flatten((tuple(b_args), dict(b_kwargs)))
            mine = [t.detach() for t in leaves if isinstance(t, torch.Tensor)]
            if not mine or not mine[0].is_floating_point():
                raise CaptureError("model", f"block {type(first[j]).__name__} takes no floating-point hidden state "
                                   "as its first argument", where_defined(first[j]))
            tensors += mine if j == 0 else mine[1:]  # after the first layer, the hidden state is the previous output
            specs.append(spec)
            consts.append([_TENSOR if isinstance(t, torch.Tensor) else t for t in leaves])
            out_leaves, out_spec = tree_flatten(b_out)
            out_specs.append((out_spec, len(out_leaves), next(i for i, t in enumerate(out_leaves)
                                                             if isinstance(t, torch.Tensor))))
        tensors[0].requires_grad_()
        kinds = ("activation",) + ("input",) * (len(tensors) - 1)
        # the period's layers as their data-parallel groups, if any
        block_call = _BlockCall([blocks._modules[k] for k in period], specs, consts)
        part, block_out = capture_part("block", block_call, tuple(tensors), kinds, len(run) // size, **kw)
        _check_gradients(block_call, infos, "block")
        # the run's layers pass their hidden state through in the model part; the layers outside it run there
        saved = [(key, blocks._modules[key]) for key in run]
        in_run = {id(p) for _, m in saved for p in m.parameters()}
        sides = _stage_params(order, run, plan.source, strict=staged) if order else None
        why = _why_one_part(sides, root, in_run, infos, staged) if order else "no plan"
        holder = _Holder() if not why else None
        for i, (key, _) in enumerate(saved):
            extra = (holder,) if holder is not None and i == 0 else ()
            blocks._modules[key] = (_Cut if extra else _Skip)(*out_specs[i % size], blocks._modules[key], *extra)
        try:
            if holder is not None:
                try:
                    parts = _capture_stages(call, holder, args, block_out, sides, _buffer_sides(order, run), in_run,
                                            infos, capture_part, kw)
                except CaptureError as e:
                    if staged:
                        raise
                    holder = None  # without stages, the one model part as before
                    why = f"capturing it in two failed ({e.message})"
                    torch._dynamo.reset()
                    for p in call.parameters():
                        p.grad = None
                    blocks._modules[run[0]] = _Skip(*out_specs[0], saved[0][1])
            if holder is None:
                mpart, _ = capture_part("model", call, args, ("input",) * len(args), 1, **kw)
                _check_gradients(call, infos, "model")
                parts = [mpart, part]
                if why != "no plan":
                    notes.append(f"the work outside {stack.path} is one part, 'model', scheduled before the "
                                 f"repeated layers (its head and loss run after them in the real step): {why}")
            else:
                if staged:
                    held = [_held(s, stack.path) for s in parts]
                    notes.append(f"pipeline stages: the first runs the model up to {stack.path} and holds "
                                 f"{held[0]}; the last runs what follows the repeated layers and holds {held[1]}")
                parts.insert(1, part)
        finally:
            for key, mod in saved:
                blocks._modules[key] = mod
        if tail_note:
            where = "the 'last_stage' part" if holder is not None else "the model part"
            notes.append(tail_note.replace("<where>", where))
    else:
        mpart, _ = capture_part("model", call, args, ("input",) * len(args), 1, **kw)
        _check_gradients(call, infos, "model")
        parts = [mpart]
    # the stack whose layers the preset wraps one by one (the planned path's FSDP / DDP units, flint.layers)
    return parts, local, notes, stack.path if stack is not None and preset else None
