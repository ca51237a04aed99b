"""The captured way into pipeline parallelism: the user's own ``torch.distributed.pipelining`` stages.

A training script with pipeline parallelism builds, on every rank, the
``PipelineStage``\\ s that rank runs and a schedule over them
(``Schedule1F1B(stage, n_microbatches, loss_fn)``, torchtitan's
``pipeline_llama``). Flint runs that same function, ``fn(model, mesh)``
returning the schedule, once per pipeline rank: each call in its own fake
world as the rank at that ``pp`` coordinate (every other coordinate 0), so
the function sees the mesh, ``pp`` rank and process group that rank sees.

What Flint reads from torch's objects, and what it does with them:

- every ``PipelineStage``'s ``stage_index``, ``num_stages``, ``submod`` and
  the static ``input_args`` / ``output_args`` metadata (required: see
  :data:`WHY_STATIC`);
- the schedule's class (one of :data:`flint.pipeline.SCHEDULES`), its
  ``n_microbatches`` and ``loss_fn``, and how many stages each rank holds.

Each stage's ``submod`` is captured the way :mod:`flint.capture.generic`
captures a model: its stack of identical blocks is found, block 0 is captured
once (``block``, on the arguments the stage passes it) and repeated, and the
rest of the first stage (``first_stage``: the stage with its blocks replaced
by pass-throughs) and of the last stage (``last_stage``: the same, followed by
the schedule's ``loss_fn`` on the microbatch target) are parts of their own.
``pipeline-split`` then schedules them with the user's schedule class,
microbatch count and layers per stage, exactly as on the planned path
(torch's action order from :mod:`flint.pipeline`). Process-group names
captured in a later rank's world are renamed to rank 0's name of the same
mesh axes.

``fully_shard`` / ``replicate`` calls inside the function are intercepted
as :mod:`flint.capture.generic` does (:func:`flint.capture.byom.intercept`)
and become parameter groups of the stage holding their modules.

Not supported (refused, named): stages without static shapes, a stage in the
middle holding parameters outside its blocks, stages built by ``pipeline()``
(``_PipelineStage``: torch.export of the whole model).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from flint.capture.errors import CaptureError

#: Why the stages must carry static shapes (also the refusal message).
WHY_STATIC = (
    "give every PipelineStage static input_args and output_args (meta tensors of one microbatch): "
    "without them torch infers the shapes at the first schedule.step() by running the stages and "
    "exchanging metadata over the pipeline's process group (stage.py _forward_metadata_inference / "
    "_recv_meta), and the fake process group Flint captures with carries no data")


def _schedule_name(sched: Any, source: str | None) -> str:
    from torch.distributed.pipelining import schedules as S

    from flint.pipeline.schedules import SCHEDULES

    for name, cls_name in SCHEDULES.items():
        if type(sched) is S.get_schedule_class(cls_name):
            return name
    known = ", ".join(f"Schedule{c}" for c in SCHEDULES.values())
    raise CaptureError("parallelize", f"with pp > 1 the function must return the torch.distributed.pipelining "
                       f"schedule it builds (one of {known}); got {type(sched).__name__}", source)


def _stages(sched: Any, source: str | None) -> list[Any]:
    from torch.distributed.pipelining.stage import PipelineStage

    stages = list(getattr(sched, "_stages", None) or [getattr(sched, "_stage", None)])
    for st in stages:
        if not isinstance(st, PipelineStage):
            raise CaptureError("parallelize", f"the schedule holds a {type(st).__name__}; Flint reads "
                               "PipelineStage(submodule, stage_index, num_stages, device, input_args=..., "
                               "output_args=...) (stages split by pipeline() / torch.export are not supported)",
                               source)
        meta = st._user_meta
        if meta.inputs is None or meta.outputs is None:
            raise CaptureError("parallelize", f"stage {st.stage_index}: {WHY_STATIC}", source)
    return stages


def _meta_tensor(m: Any) -> torch.Tensor:
    return torch.empty_strided(tuple(m.shape), tuple(m.stride), dtype=m.dtype, device="meta")


def _shapes(metas: Sequence[Any]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(int(d) for d in m.shape), m.dtype) for m in metas]


class _LossStage(nn.Module):
    """The last stage's module followed by the schedule's loss on the microbatch target."""

    def __init__(self, stage: nn.Module, loss_fn: Callable) -> None:
        super().__init__()
        self.stage = stage
        self.loss_fn = loss_fn

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        *inputs, target = args
        return self.loss_fn(self.stage(*inputs), target)


class _Stage:
    """What Flint keeps of one PipelineStage."""

    def __init__(self, st: Any) -> None:
        from flint.capture.byom import find_blocks

        self.index, self.num = int(st.stage_index), int(st.num_stages)
        self.submod = st.submod
        self.inputs = _shapes(st._user_meta.inputs)
        self.outputs = _shapes(st._user_meta.outputs)
        self.input_metas = st._user_meta.inputs
        found = find_blocks(self.submod, at_least=1)
        self.blocks = found[1] if found else None
        in_blocks = {id(p) for p in self.blocks.parameters()} if self.blocks is not None else set()
        self.rest = [n for n, p in self.submod.named_parameters() if id(p) not in in_blocks]


def capture_pipeline(model_factory: Callable[[], nn.Module], build: Callable, plan, mesh, batch_shapes:
                     Mapping[str, Sequence[int]], *, torch_dtype: torch.dtype | None, optimizer: str | None,
                     capture_part: Callable, plan_name: str):
    """One step of the user's pipeline (``build(model, mesh) -> schedule``), per stage role.

    ``batch_shapes``: the global batch (the first entry feeds the first
    stage, the last one is the loss target), split over the data-parallel
    axes and the schedule's microbatches; the first stage's ``input_args``
    must have the resulting microbatch shape.
    """
    from flint.capture.byom import call_user, intercept, where_defined
    from flint.capture.fake_dist import device_mesh, fake_world, group_axes
    from flint.capture.generic import (_TENSOR, _apply_groups, _BlockCall, _check_gradients, _differs,
                                       _infos_after_tp, _layer_kind, _record_block_inputs,
                                       _second_input_with_gradient, _Skip)
    from flint.capture.step import CapturedStep
    from flint.pipeline.schedules import stage_ranks

    source = where_defined(build)
    P = plan.pp
    pp_axis = mesh.axis_index("pp")
    data_axes = [a for a in mesh.axis_names if a in ("dp_replicate", "dp_shard")]
    dp = mesh.group_size(data_axes) if data_axes else 1
    names = list(batch_shapes)
    if len(names) < 2:
        raise CaptureError("inputs", "a pipeline needs the first stage's input and the loss target "
                           f"(got {names}); give both (--inputs, or a zoo model's tokens and labels)")
    parts: dict[str, Any] = {}
    axes0: dict[str, tuple[int, ...]] | None = None
    layers: dict[int, int] = {}
    owner_of: dict[int, int] = {}
    info: dict[str, Any] = {}
    global_params: dict[str, tuple[int, ...]] = {}
    param_dtype = None
    local: dict[str, tuple[int, ...]] = {}

    for r in range(P):
        coords = [0] * mesh.ndim
        coords[pp_axis] = r
        with fake_world(mesh.world_size, rank=mesh.rank(coords)):
            dm = device_mesh(mesh.shape, mesh.axis_names)
            torch._dynamo.reset()
            with torch.device("meta"):
                model = call_user(model_factory, (), "model", "the model factory")
            if torch_dtype is not None:
                model.to(torch_dtype)
            if r == 0:
                param_dtype = next(model.parameters()).dtype
                global_params = {n: tuple(p.shape) for n, p in model.named_parameters()}
            buffers = {id(b): n for n, b in model.named_buffers()}
            with intercept(getattr(build, "__globals__", None)) as rec:
                sched = call_user(build, (model, dm), "parallelize", "the pipeline function")
            name = _schedule_name(sched, source)
            stages = [_Stage(st) for st in _stages(sched, source)]
            V = len(stages)
            M = int(sched._n_microbatches)
            loss_fn = getattr(sched, "_loss_fn", None)
            if r == 0:
                info.update(schedule=name, microbatches=M, virtual=V, loss_fn=loss_fn)
                for i, n in enumerate(names):
                    shape = tuple(int(d) for d in batch_shapes[n])
                    if not shape or shape[0] % (dp * M):
                        raise CaptureError(f"batch_shapes['{n}'][0]", f"global batch {shape[0] if shape else None} "
                                           f"is not divisible by data-parallel degree {dp} x {M} microbatches")
                    local[n] = (shape[0] // (dp * M), *shape[1:])
            elif (name, M, V) != (info["schedule"], info["microbatches"], info["virtual"]):
                raise CaptureError("parallelize", f"pipeline rank {r} runs {name} with {M} microbatches and {V} "
                                   f"stage(s), rank 0 {info['schedule']} with {info['microbatches']} and "
                                   f"{info['virtual']}: every rank must build the same schedule", source)
            for st in stages:
                if st.num != P * V:
                    raise CaptureError("parallelize", f"stage {st.index} says num_stages = {st.num}, but {P} "
                                       f"pipeline ranks x {V} stage(s) each = {P * V}", source)
                owner_of[st.index] = r
                # one block body stands for every block of every stage: what the function made of each block
                # (checkpoint wrappers, sharding, data-parallel groups) must be the same
                for key, block in (st.blocks._modules.items() if st.blocks is not None else ()):
                    kind = _layer_kind(block, rec.groups)
                    ref = info.setdefault("block_kind", (kind, f"stage {st.index}'s block {key}"))
                    if kind != ref[0]:
                        raise CaptureError("parallelize", f"stage {st.index}'s block {key} and {ref[1]} differ in "
                                           f"{_differs([kind, ref[0]])}: Flint's pipeline capture repeats one block "
                                           "body over every stage, so the pipeline function must treat every "
                                           "block alike (capture without pipeline parallelism takes a repeating "
                                           "pattern of blocks)", source)
            infos = _infos_after_tp(model, {})
            placed: set[int] = set()
            for st in stages:  # fully_shard / replicate calls on a stage's modules: its parameter groups
                mods = {id(m) for m in st.submod.modules()}
                calls = [c for c in rec.groups if all(id(m) in mods for m in c.modules)]
                if calls:
                    st.submod = _apply_groups(st.submod, calls, infos)
                placed.update(id(c) for c in calls)
            for c in rec.groups:
                if id(c) not in placed:
                    raise CaptureError("parallelize", f"{'fully_shard' if c.mode == 'fsdp' else 'replicate'} on "
                                       "modules that are not all in one of this rank's stages", c.source)
            kw = dict(infos=infos, buffers=buffers, optimizer=optimizer)
            captured: list[Any] = []
            for st in stages:
                first, last = st.index == 0, st.index == st.num - 1
                if st.blocks is None:
                    raise CaptureError("parallelize", f"stage {st.index} ({type(st.submod).__name__}) has no stack "
                                       "of identical blocks (a ModuleList / Sequential / ModuleDict); Flint "
                                       "splits pipelines by block", where_defined(st.submod))
                layers[st.index] = len(st.blocks)
                if st.rest and not (first or last):
                    raise CaptureError("parallelize", f"stage {st.index} holds parameters outside its blocks "
                                       f"({', '.join(st.rest[:4])}); only the first and the last stage may",
                                       where_defined(st.submod))
                if first:
                    want = [(local[names[0]], None)]
                    got = st.inputs
                    if len(got) != 1 or got[0][0] != want[0][0]:
                        raise CaptureError("parallelize", f"stage 0 input_args {[s for s, _ in got]}: expected one "
                                           f"microbatch of '{names[0]}', {list(want[0][0])} (global batch / "
                                           f"data-parallel {dp} / {M} microbatches)", source)
                # a later stage's inputs need a gradient, as the previous stage's outputs do in the step
                args = tuple(_meta_tensor(m).requires_grad_(not first and m.dtype.is_floating_point)
                             for m in st.input_metas)
                block0 = next(iter(st.blocks.children()))
                recorded = _record_block_inputs(st.submod, args, [block0])
                ((b_args, b_kwargs, b_out),) = recorded
                if (first or last) and (why := _second_input_with_gradient([block0], recorded)):
                    raise CaptureError("parallelize", f"stage {st.index}'s blocks cannot be passed through in its "
                                       f"capture: {why}. Flint's pipeline capture needs blocks whose only input "
                                       "with a gradient is the hidden state (compute the other one inside the "
                                       "block, or capture without pipeline parallelism, which takes such a stack "
                                       "whole)", where_defined(block0))
                if "block" not in parts:
                    leaves, spec = tree_flatten((tuple(b_args), dict(b_kwargs)))
                    tensors = [t.detach() for t in leaves if isinstance(t, torch.Tensor)]
                    consts = [_TENSOR if isinstance(t, torch.Tensor) else t for t in leaves]
                    tensors[0].requires_grad_()
                    kinds = ("activation",) + ("input",) * (len(tensors) - 1)
                    call = _BlockCall([block0], [spec], [consts])
                    parts["block"], out = capture_part("block", call, tuple(tensors), kinds, 1, **kw)
                    _check_gradients(call, infos, "block")
                    captured.append(parts["block"])
                    boundary = tuple(int(d) for d in tensors[0].shape)
                    info["boundary"] = (boundary, tensors[0].dtype)
                if not (first or last):
                    continue
                out_leaves, out_spec = tree_flatten(b_out)
                pos = next(i for i, t in enumerate(out_leaves) if isinstance(t, torch.Tensor))
                saved = list(st.blocks._modules.items())
                for key, _ in saved:
                    st.blocks._modules[key] = _Skip(out_spec, len(out_leaves), pos, st.blocks._modules[key])
                try:
                    if first:
                        part, out = capture_part("first_stage", st.submod, args, ("input",) * len(args), 1, **kw)
                        _check_gradients(st.submod, infos, "first_stage")
                        parts["first_stage"] = part
                        captured.append(part)
                    if last:
                        if loss_fn is None:
                            raise CaptureError("parallelize", "the schedule has no loss_fn: a training step needs "
                                               "one (Schedule1F1B(stage, n_microbatches, loss_fn=...))", source)
                        target = torch.zeros(local[names[-1]], dtype=torch.int64, device="meta")
                        h = tuple(a.detach().requires_grad_(a.is_floating_point()) for a in args)
                        kinds = ("activation",) * len(h) + ("input",)
                        loss_stage = _LossStage(st.submod, loss_fn)
                        part, _ = capture_part("last_stage", loss_stage, (*h, target), kinds, 1, **kw)
                        _check_gradients(loss_stage, infos, "last_stage")
                        parts["last_stage"] = part
                        captured.append(part)
                finally:
                    for key, mod in saved:
                        st.blocks._modules[key] = mod
            for st in stages:  # the stage-boundary tensors: what pipeline-split sends and receives
                for what, shapes in (("input_args", st.inputs if st.index else []),
                                     ("output_args", st.outputs if st.index < st.num - 1 else [])):
                    if shapes and (len(shapes) != 1 or shapes[0] != info.get("boundary", shapes[0])):
                        raise CaptureError("parallelize", f"stage {st.index} {what} {[list(s) for s, _ in shapes]}"
                                           f" ({', '.join(str(d) for _, d in shapes)}): the blocks exchange one "
                                           f"{list(info['boundary'][0])} {info['boundary'][1]} tensor per "
                                           "microbatch", source)
            axes = group_axes(dm)
            if axes0 is None:
                axes0 = axes
            else:
                _rename_groups(captured, axes, {v: k for k, v in axes0.items()})
        torch._dynamo.reset()

    n_stages = P * info["virtual"]
    want_owner = stage_ranks(info["schedule"], P, info["virtual"])
    for s in range(n_stages):
        if s not in owner_of:
            raise CaptureError("parallelize", f"no pipeline rank built stage {s} of {n_stages}", source)
        if owner_of[s] != want_owner[s]:
            raise CaptureError("parallelize", f"stage {s} is built on pipeline rank {owner_of[s]}, but "
                               f"{info['schedule']} runs it on rank {want_owner[s]}", source)
    for p in ("first_stage", "last_stage"):
        if p not in parts:
            raise CaptureError("parallelize", f"no {p.replace('_', ' ')} was captured", source)
    order = [layers[s] for s in range(n_stages)]
    parts["block"].repeat = sum(order)
    pp_plan = plan.replace(pp_schedule=info["schedule"], microbatches=info["microbatches"],
                           pp_virtual_stages=info["virtual"], pp_layers=tuple(order))
    held = [parts["first_stage"], parts["block"], parts["last_stage"]]
    clip = None
    if plan.max_norm:  # gradient-norm clipping's step-wide part, with rank 0's names for the process groups
        from flint.capture.step import _capture_clip

        with fake_world(mesh.world_size, rank=0):
            clip = _capture_clip(held, device_mesh(mesh.shape, mesh.axis_names), mesh, plan.max_norm, True)
        torch._dynamo.reset()
    return CapturedStep(held, mesh, plan_name, axes0 or {}, param_dtype,
                        {names[0]: local[names[0]], names[-1]: local[names[-1]]}, global_params, pp_plan, clip=clip)


def _rename_groups(parts: list[Any], axes: dict[str, tuple[int, ...]], canonical: dict[tuple[int, ...], str]) -> None:
    """Name every collective's process group as rank 0's world names the group over the same mesh axes."""
    from flint.capture import opclass

    for part in parts:
        for g in part.graphs():
            for node in g.nodes():
                name = opclass.collective_group(node)
                if name is None:
                    continue
                new = canonical.get(axes.get(name, ()))
                if new is None:
                    raise CaptureError("plan", f"collective {node.target} in part '{part.name}' uses process "
                                       f"group '{name}', which spans no mesh axis set rank 0 holds")
                if new != name:
                    schema = node.target._schema
                    i = next(i for i, a in enumerate(schema.arguments) if a.name == "group_name")
                    if "group_name" in node.kwargs:
                        node.update_kwarg("group_name", new)
                    else:
                        node.update_arg(i, new)
            g.gm.recompile()
