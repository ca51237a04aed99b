"""`pipeline-split`: pipeline stages, microbatches and a PyTorch schedule on a captured step."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ArrayAttr, DictionaryAttr, IntegerAttr, ModuleOp, StringAttr, TensorType, i64
from xdsl.passes import ModulePass
from xdsl.utils.exceptions import VerifyException

from flint.errors import FlintError
from flint.ir.aten import CLIP_FUNCTION, SCHEDULE_ATTR, STAGE_SCHEDULES_ATTR, PIPELINE_ATTR, get_schedule
from flint.passes.lower_to_chakra import ROLE_ATTR
from flint.pipeline.schedules import COMPUTE, check_p2p, rank_actions, sends_wait_at_step_end, stage_ranks
from flint.plan import PlanError

_PHASES = ("fwd", "bwd", "norm", "clip", "optim")

#: How pipeline-split counts layers, for its messages: a captured model's repeating pattern of several layers
#: (Llama 4's four) is one block, never split across stages.
WHOLE_BLOCKS = ("a stage holds whole repeated blocks: one layer each, or a repeating pattern of several layers "
                "captured as one (Llama 4's four), never split")


def _phase(name: str) -> str:
    if name == CLIP_FUNCTION:
        return "clip"
    for p in _PHASES:
        if name.endswith("_" + p):
            return p
    raise VerifyException(f"pipeline-split: schedule entry @{name} is not a _fwd, _bwd, _norm or _optim function "
                          f"(the captured step's part functions) or @{CLIP_FUNCTION}")


def even_split(n_layers: int, n_stages: int) -> list[int]:
    """Layers per stage: as even as possible, the first stages take the remainder."""
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if s < extra else 0) for s in range(n_stages)]


@lru_cache(maxsize=1 << 16)  # attributes are immutable: a schedule's repeated entries share one (xDSL's are slow to build)
def _entry(name: str, count: int, tag: int | None = None, nosync: tuple[str, ...] = (),
           wait: tuple[int, ...] = (), nogather: tuple[str, ...] = (), post: bool = False) -> ArrayAttr:
    extra = {}
    if tag is not None:
        extra["tag"] = IntegerAttr(tag, i64)
    if post:
        extra["post"] = IntegerAttr(1, i64)
    if nosync:
        extra["nosync"] = ArrayAttr([StringAttr(a) for a in nosync])
    if nogather:
        extra["nogather"] = ArrayAttr([StringAttr(a) for a in nogather])
    if wait:
        extra["wait"] = ArrayAttr([IntegerAttr(t, i64) for t in wait])
    items = [StringAttr(name), IntegerAttr(count, i64)]
    return ArrayAttr(items + ([DictionaryAttr(extra)] if extra else []))


@dataclass(frozen=True)
class PipelineSplitPass(ModulePass):
    """Split a captured step into pipeline stages run by a PyTorch schedule over microbatches.

    Input: the step as captured (one function per part and phase, e.g.
    ``embed_fwd``, ``block_fwd`` repeated L times, ``head_fwd``, the matching
    ``_bwd`` and ``_optim``; ``flint.schedule`` in that order), captured for
    ONE microbatch. The repeated block is the forward entry with the largest
    count; parts before it go to the first stage, parts after it to the last.

    Stages: ``stages * virtual`` pipeline stages over the ``stages`` ranks of
    grid axis ``axis``; ``layers`` lists the blocks per stage (e.g.
    ``layers=3,3,2,2``), else an even split (the first stages
    take the remainder). Stage ``s`` runs on pipeline rank
    :func:`flint.pipeline.stage_ranks` (round robin, or a V for
    ``zbv-zero-bubble``).

    Order: every pipeline rank's actions come from
    ``torch.distributed.pipelining``'s schedule class for ``schedule``
    (``gpipe``, ``1f1b``, ``interleaved-1f1b``, ``interleaved-zero-bubble``,
    ``zbv-zero-bubble``; see :mod:`flint.pipeline`),
    ``microbatches`` per step. A forward action runs its stage's part
    functions, a backward action their backward in reverse. The zero-bubble
    schedules' ``I`` / ``W`` actions run ``<part>_bwd_input`` /
    ``<part>_bwd_weight``, the backward split by
    :func:`flint.pipeline.backward_split.split_backward` (added to the module,
    one body each; an empty part gets no function), except on the first stage,
    where torch's ``I`` does nothing and its ``W`` runs the full backward.
    Multi-stage schedules (interleaved, zero bubble) run in torch's
    ``_PipelineScheduleRuntime``: sends are asynchronous (waited for after the
    last action), each recv is posted asynchronously at its ``RECV`` action
    and the consuming entry waits for it (option ``wait = [tag]``); GPipe and
    1F1B wait for each recv right before its use. ``SEND_F`` /
    ``RECV_F`` / ``SEND_B`` / ``RECV_B`` run new functions
    ``pp_{send,recv}_{fwd,bwd}_{offset}`` holding one ``dist.send`` /
    ``dist.recv`` of the stage-boundary tensor (the block's activation type)
    to or from the rank at that offset along ``axis``; each schedule entry
    gives the tag (unique per boundary, direction and microbatch). The
    optimizer functions run once per step for the layers the rank holds;
    with gradient-norm clipping, after the held parts' ``_norm`` functions
    and ``@grad_clip`` (its all-reduce over ``axis`` joins the stages' norms).

    Send/recv waiting (``p2p``, the plan's ``pp_p2p``;
    :func:`flint.pipeline.schedules.check_p2p`): ``schedule`` as above;
    ``overlap`` (Megatron's ``overlap_p2p_comm``) is the same on a multi-stage
    schedule and refused on GPipe / 1F1B; ``blocking`` keeps torch's order
    but makes every send and recv synchronous, and marks
    each recv entry ``post``: lowering issues the recv after the compute
    before it (where the rank reaches it), so the transfer cannot start
    earlier, and the next compute waits for it.

    Gradient accumulation: with ``grad-sync=step`` (PyTorch's
    ``no_sync`` / FSDP2 ``set_requires_gradient_sync(False)`` for all but the
    last microbatch) the backward entries of every microbatch but the last
    are marked ``nosync`` with the data-parallel axes: lowering drops their
    reduce-scatters and all-reduces over those axes; ``grad-sync=microbatch``
    reduces every microbatch. As torch's ``backward_counter``, a stage's
    gradients sync at its ``M``-th ``B`` / ``W``; ``I`` never syncs.

    Parameters kept unsharded between microbatches: with
    ``reshard-after-backward=false`` (torch's pipelining runs every non-last
    backward of an FSDP2 stage with ``set_reshard_after_backward(False)``;
    Flint sets it for ``zero = 2`` plans, FSDP2 ``reshard_after_forward=False``,
    whose gathered parameters then live for the whole step, as Megatron-LM's
    distributed optimizer's do) the forward entries of every stage's
    microbatches after its first are marked ``nogather`` with the
    data-parallel axes (without ``cp``): lowering drops their FSDP parameter
    all-gathers over those axes with copy-in and copy-out
    (``lower_to_chakra.kept_gather_ops``), so parameters are gathered once per step.

    Result: ``flint.stage_schedules`` (one schedule per pipeline rank, the
    ranks' distinct roles; entries ``[function, count, {tag, nosync, nogather, wait}]``) and
    ``flint.pipeline`` (axis, ranks, stages, schedule, microbatches, the
    stage-to-rank map and layers per stage); ``flint.schedule`` is removed.
    With ``stages=1`` the step is plain microbatching / gradient accumulation.
    The function bodies are untouched: one body per repeated block, one
    schedule per pipeline rank, nothing unrolled.
    """

    name = "pipeline-split"

    stages: int = 1
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual: int = 1
    layers: tuple[int, ...] = ()
    grad_sync: str = "step"
    reshard_after_backward: bool = True  # false: parameter all-gathers only in each stage's first forward
    axis: str = "pp"
    dp_axes: str = ""  # comma-separated data-parallel axes for grad-sync=step; default: the plan's
    p2p: str = "schedule"  # how sends / recvs wait: schedule (torch), overlap (Megatron's overlap_p2p_comm), blocking

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        from flint.chakra.from_ir import mesh_of
        from flint.plan import GRAD_SYNC, plan_of

        if STAGE_SCHEDULES_ATTR in op.attributes:
            raise VerifyException("pipeline-split: the module is already split (flint.stage_schedules is set)")
        P, V, M = self.stages, self.virtual, self.microbatches
        for field_name, value in (("stages", P), ("microbatches", M), ("virtual", V)):
            if value < 1:
                raise PlanError(field_name, f"must be at least 1, got {value}")
        if self.grad_sync not in GRAD_SYNC:
            raise PlanError("grad_sync", f"unknown value '{self.grad_sync}'; known: {', '.join(GRAD_SYNC)}")
        check_p2p(self.p2p, self.schedule)
        mesh = mesh_of(op)
        if P > 1:
            if self.axis not in mesh.axis_names:
                raise PlanError("pp", f"the grid has no axis '{self.axis}' (axes: {', '.join(mesh.axis_names)}); "
                                "capture with pp in the plan")
            if mesh.shape[mesh.axis_index(self.axis)] != P:
                raise PlanError("pp", f"stages={P} but grid axis '{self.axis}' has "
                                f"{mesh.shape[mesh.axis_index(self.axis)]} ranks")
        sched = get_schedule(op)
        parts = {p: [(n, c) for n, c in sched if _phase(n) == p] for p in _PHASES}
        fwd = parts["fwd"]
        if not fwd:
            raise VerifyException("pipeline-split: the schedule has no _fwd function")
        b = max(range(len(fwd)), key=lambda i: (fwd[i][1], -abs(i - len(fwd) // 2)))
        block, n_layers = fwd[b]
        stem = block[: -len("_fwd")]
        pre = [n[: -len("_fwd")] for n, _ in fwd[:b]]
        post = [n[: -len("_fwd")] for n, _ in fwd[b + 1:]]
        funcs = {f.sym_name.data: f for f in op.ops if isinstance(f, func.FuncOp)}
        n_stages = P * V
        if n_stages > 1 and "model" in pre + post:
            raise PlanError("pp", "@model_fwd holds a model's work both before and after its repeated blocks (a "
                            "model outside the zoo whose embedding, head and loss stayed one part: tied embeddings, "
                            "or one data-parallel group over both sides, as flint capture notes), which would all "
                            "run on one stage; capture it with pp in the plan (flint capture --plan-file), which "
                            "splits that part into first_stage and last_stage, or says why it cannot")
        if n_stages > n_layers:
            raise PlanError("pp", f"{n_stages} pipeline stages (stages * virtual) for {n_layers} repeated blocks "
                            f"(@{block} runs {n_layers} times); {WHOLE_BLOCKS}")
        if self.layers:
            layers = [int(x) for x in self.layers]
            if len(layers) != n_stages or any(n < 1 for n in layers) or sum(layers) != n_layers:
                raise PlanError("pp_layers", f"{layers}: need {n_stages} stages of at least one block summing to "
                                f"the model's {n_layers} repeated blocks (@{block} runs {n_layers} times); "
                                f"{WHOLE_BLOCKS}")
        else:
            layers = even_split(n_layers, n_stages)
        actions = rank_actions(self.schedule, P, M, V)
        owner = stage_ranks(self.schedule, P, V)
        dp_axes = tuple(a for a in self.dp_axes.split(",") if a)
        if not dp_axes:
            plan = plan_of(op)
            dp_axes = plan.axes("loss") if plan is not None else ()
        nosync = dp_axes if self.grad_sync == "step" else ()
        nogather = () if self.reshard_after_backward else tuple(a for a in dp_axes if a != "cp")

        # The stage-boundary tensor: the block's activation argument.
        act_type = self._boundary_type(funcs[block])
        axis_index = mesh.axis_index(self.axis) if P > 1 else 0
        grid = next(o for o in op.ops if o.name == "shard.grid").sym_name.data
        new_funcs: dict[str, func.FuncOp] = {}
        blocking = self.p2p == "blocking"
        async_send = sends_wait_at_step_end(self.schedule) and not blocking

        def p2p(kind: str, offset: int) -> str:
            name = f"pp_{kind.lower()}_{'m' if offset < 0 else 'p'}{abs(offset)}"
            if name not in new_funcs:
                new_funcs[name] = _p2p_func(name, kind, act_type, grid, axis_index, offset, async_send)
            return name

        def tag(boundary: int, backward: bool, mb: int) -> int:
            return (2 * boundary + int(backward)) * M + mb

        # Zero-bubble schedules run I (input gradient) and W (weight gradient) actions: every stage
        # but the first runs its backward functions split in two (flint.pipeline.backward_split).
        split: dict[str, tuple[str, str]] = {}  # "<part>_bwd" -> (input part, weight part); "" when empty
        if any(a.kind in ("I", "W") for acts in actions for a in acts):
            split = self._split_backward(op, funcs, [stem] + post, new_funcs)

        def bwd(s: int, part: str, ns: tuple[str, ...]) -> list[tuple]:
            """Stage ``s``'s backward entries: the full backward (part ""), or its I or W part."""
            names = ([f"{p}_bwd" for p in reversed(post)] if s == n_stages - 1 else []) + [f"{stem}_bwd"]
            names += [f"{p}_bwd" for p in reversed(pre)] if s == 0 else []
            out = []
            for n in names:
                if n not in funcs:  # a part no gradient reaches (a frozen embedding's) has no backward
                    continue
                fn = n if not part else split[n][part == "weight"]
                if fn:
                    out.append((fn, layers[s] if n == f"{stem}_bwd" else 1, {"nosync": ns}))
            return out

        schedules = []
        for rank in range(P):
            entries: list[ArrayAttr] = []
            waits: list[int] = []  # posted recvs (tags) the next compute entry waits for

            def emit(items: list[tuple]) -> None:
                for name, count, opts in items:
                    entries.append(_entry(name, count, wait=tuple(waits), **opts))
                    waits.clear()

            backwards = [0] * n_stages  # torch's backward_counter: the stage's M-th B / W syncs gradients
            forwards = [0] * n_stages  # after a stage's first forward its parameters stay gathered (nogather)
            consumer = {}  # (F | B, stage, microbatch) -> tag of the recv that action waits for
            # blocking: torch's order, each recv waited where it is issued; else single-stage schedules wait
            # for each recv right before its use
            for a in (actions[rank] if async_send or blocking else _wait_at_use(actions[rank])):
                s, k = a.stage, a.microbatch
                if a.kind in COMPUTE:
                    t = consumer.pop(("B" if a.kind == "I" else a.kind, s, k), None)
                    if t is not None:
                        waits.append(t)
                if a.kind == "F":
                    forwards[s] += 1
                    ng = {"nogather": nogather} if nogather and forwards[s] > 1 else {}
                    emit(([(f"{p}_fwd", 1, ng) for p in pre] if s == 0 else []) + [(block, layers[s], ng)]
                         + ([(f"{p}_fwd", 1, ng) for p in post] if s == n_stages - 1 else []))
                elif a.kind in ("B", "W"):
                    backwards[s] += 1
                    ns = nosync if backwards[s] != M else ()
                    # torch runs the first stage's W as its full backward (its I does nothing:
                    # the stage input needs no gradient), see PipelineStage.backward_weight_one_chunk.
                    emit(bwd(s, "weight" if a.kind == "W" and s != 0 else "", ns))
                elif a.kind == "I":
                    if s != 0:  # I runs without gradient sync (last_backward=False)
                        emit(bwd(s, "input", nosync))
                else:
                    send = a.kind.startswith("SEND")
                    is_bwd = a.kind.endswith("_B")
                    peer_stage = s + (1 if (send != is_bwd) else -1)
                    offset = owner[peer_stage] - owner[s]
                    boundary = min(s, peer_stage)
                    entries.append(_entry(p2p(a.kind, offset), 1, tag=tag(boundary, is_bwd, k),
                                          post=blocking and not send))
                    if async_send and not send:  # posted here, waited for by the action that reads it
                        consumer[("F" if a.kind == "RECV_F" else "B", s, k)] = tag(boundary, is_bwd, k)
            assert not consumer, f"recvs without a consumer: {consumer}"
            held = [s for s in range(n_stages) if owner[s] == rank]

            def held_parts(kind: str) -> list[tuple]:
                """The ``<part>_<kind>`` entries of the parts this rank's stages hold, once per step."""
                have = {n for n, _ in parts[kind]}
                out = [(f"{p}_{kind}", 1, {}) for p in pre if 0 in held and f"{p}_{kind}" in have]
                out += [(f"{stem}_{kind}", sum(layers[s] for s in held), {})] if f"{stem}_{kind}" in have else []
                return out + [(f"{p}_{kind}", 1, {}) for p in post if n_stages - 1 in held and f"{p}_{kind}" in have]

            # gradient-norm clipping: the held parts' norms, the step-wide @grad_clip, then the optimizer
            emit(held_parts("norm") + [(n, 1, {}) for n, _ in parts["clip"]] + held_parts("optim"))
            assert not waits, f"recvs nobody waits for: {waits}"
            schedules.append(ArrayAttr(entries))
        for f in new_funcs.values():
            op.body.block.add_op(f)
        op.attributes.pop(SCHEDULE_ATTR, None)
        op.attributes[STAGE_SCHEDULES_ATTR] = ArrayAttr(schedules)
        op.attributes[PIPELINE_ATTR] = DictionaryAttr({
            "axis": StringAttr(self.axis), "ranks": IntegerAttr(P, i64), "stages": IntegerAttr(n_stages, i64),
            "schedule": StringAttr(self.schedule), "microbatches": IntegerAttr(M, i64),
            "stage_ranks": ArrayAttr([IntegerAttr(r, i64) for r in owner]),
            "layers": ArrayAttr([IntegerAttr(n, i64) for n in layers]),
            "grad_sync": StringAttr(self.grad_sync),
            **({"p2p": StringAttr(self.p2p)} if self.p2p != "schedule" else {}),
        })

    @staticmethod
    def _split_backward(op: ModuleOp, funcs: dict[str, func.FuncOp], parts: list[str],
                        added: dict[str, func.FuncOp]) -> dict[str, tuple[str, str]]:
        """``<part>_bwd_input`` / ``<part>_bwd_weight`` for every part a non-first stage runs."""
        from flint.pipeline.backward_split import input_grad_results, split_backward

        out = {}
        for p in parts:
            name = f"{p}_bwd"
            if name not in funcs:
                continue
            fwd = funcs.get(f"{p}_fwd")
            fi, fw = split_backward(funcs[name], input_grad_results(fwd, funcs[name]) if fwd is not None else [])
            names = []
            for f in (fi, fw):
                body = [o for o in f.body.block.ops if not isinstance(o, func.ReturnOp)]
                if body:
                    added[f.sym_name.data] = f
                names.append(f.sym_name.data if body else "")
            out[name] = (names[0], names[1])
        return out

    @staticmethod
    def _boundary_type(fn: func.FuncOp) -> TensorType:
        attrs = fn.arg_attrs.data if fn.arg_attrs is not None else ()
        for arg, a in zip(fn.body.block.args, attrs):
            role = a.data.get(ROLE_ATTR)
            if isinstance(role, StringAttr) and role.data == "activation":
                return arg.type
        raise VerifyException(f"pipeline-split: @{fn.sym_name.data} has no argument with flint.role = "
                              "\"activation\" (the stage-boundary tensor)")


def _wait_at_use(actions: list) -> list:
    """Torch's order with each RECV moved right before the compute action that consumes it.

    torch's runtime posts a recv early (``irecv``) and waits for it at the
    consuming F / B. A ``dist.recv`` here blocks the next compute node, so it is
    placed where torch waits; the simulator still posts it as soon as the
    rank's previous recv completed (recvs depend only on each other), so the
    early posting is kept.
    """
    out, held = [], {}
    for a in actions:
        if a.kind in ("RECV_F", "RECV_B"):
            held[("F" if a.kind == "RECV_F" else "B", a.stage, a.microbatch)] = a
            continue
        key = ("B" if a.kind == "I" else a.kind, a.stage, a.microbatch)
        if key in held:
            out.append(held.pop(key))
        out.append(a)
    assert not held, f"recvs without a consumer: {list(held.values())}"
    return out


def _p2p_func(name: str, kind: str, t: TensorType, grid: str, axis: int, offset: int,
              async_send: bool = False) -> func.FuncOp:
    """``func.func @name`` holding one ``dist.send`` (of an argument) or ``dist.recv`` (returned).

    ``async_send``: the send returns a ``!dist.future<none>`` nobody waits for in the step
    (torch's multi-stage runtime waits for its sends after the last action) and the recv a
    ``!dist.future`` (posted at torch's ``RECV_*`` action; the consuming entry's ``wait``
    option names its tag).
    """
    from xdsl.parser import Parser

    from flint.ir import flint_context

    role = "tangent" if kind.endswith("_B") else "activation"
    if kind.startswith("SEND"):
        text = (f'func.func @{name}(%x: {t} {{flint.role = "{role}"}}) {{\n'
                f"  {'%s = ' if async_send else ''}dist.send %x to @{grid} grid_axes = [{axis}] offset = {offset} "
                f"tag = 0 : {t}{' -> !dist.future<none>' if async_send else ''}\n"
                f"  func.return\n}}")
    else:
        r = f"!dist.future<{t}>" if async_send else f"{t}"
        text = (f"func.func @{name}() -> {r} {{\n"
                f"  %x = dist.recv from @{grid} grid_axes = [{axis}] offset = {offset} tag = 0 : {r}\n"
                f"  func.return %x : {r}\n}}")
    return Parser(flint_context(), text).parse_op()
