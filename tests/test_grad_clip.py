"""Gradient-norm clipping (plan field ``max_norm``): ``torch.nn.utils.clip_grad_norm_`` between the backward and
the optimizer, as torchtitan (``training.max_norm``) and Megatron-LM (``--clip-grad``) run it by default: each
part's gradients' norms, the total norm's all-reduces over the axes gradients are sharded over (and ``pp``),
and the gradients scaled before the optimizer step."""

from __future__ import annotations

import math
from collections import Counter
from functools import cache

import pytest
import torch
from captures import SEQ
from torch import nn

from flint.capture import capture_step, opclass
from flint.models import factory
from flint.plan import Plan, PlanError

pytestmark = pytest.mark.slow  # each capture compiles with dynamo/AOTAutograd

NORM = torch.ops.aten.linalg_vector_norm.default
ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default


@cache
def captured(max_norm: float, **fields):
    """llama-tiny (2 layers) under ``fields``, two sequences per data-parallel rank."""
    from flint.importer import import_step

    plan = Plan.from_dict({**fields, "max_norm": max_norm})
    dp = plan.dp_replicate * plan.dp_shard
    batch = (2 * dp, SEQ)
    step = capture_step(factory("llama-tiny"), {"tokens": batch, "labels": batch}, plan=plan)
    return step, import_step(step)


def _count(graph, target) -> int:
    return sum(1 for n in graph.nodes() if n.target == target)


def _grads(graph) -> list[str]:
    return [name for name, role in graph.roles.items() if role.kind == "gradient"]


def _clip_axes(step) -> list[tuple[str, ...]]:
    return [tuple(step.mesh.axis_names[a] for a in step.group_axes[opclass.collective_group(n)])
            for n in step.clip.nodes() if n.target == ALL_REDUCE]


def test_plan_field_validated_and_named():
    plan = Plan.from_dict({"dp_shard": 4, "max_norm": 1})
    assert plan.max_norm == 1.0 and "grad clip 1" in plan.describe()
    assert Plan.from_dict(plan.to_dict()) == plan
    assert Plan().max_norm == 0.0 and "clip" not in Plan().describe()
    for bad, why in ((-1.0, "finite number >= 0"), (math.inf, "finite number >= 0"), (math.nan, "finite number"),
                     ("1.0", "must be a number")):
        with pytest.raises(PlanError, match=why) as e:
            Plan.from_dict({"max_norm": bad})
        assert e.value.field == "max_norm"


def test_fsdp_tp_clips_as_torch_does():
    """Per part: one norm per local gradient folded into the running total (the part's norm graph); once per
    step: the total norm made global over dp_shard, then tp (DTensor's full_tensor of a partial norm, one mesh
    dim at a time), and the coefficient; per gradient: one in-place scaling before AdamW. Forward and backward
    are untouched."""
    (off, _), (on, module) = captured(0.0, dp_shard=2, tp=2), captured(1.0, dp_shard=2, tp=2)
    assert off.clip is None and all(p.norm is None for p in off.parts)
    for part, plain in zip(on.parts, off.parts):
        grads = _grads(part.optim)
        assert _grads(part.norm) and len(_grads(part.norm)) == len(grads)
        assert _count(part.norm, NORM) == len(grads) + 1  # each gradient's norm, then the norm of the norms
        coef = next(n for n in part.optim.gm.graph.nodes if n.op == "placeholder"
                     and part.optim.roles[n.name].kind == "clip_coef")
        scaled = [n for n in coef.users if n.target == torch.ops.aten.mul_.Tensor]
        assert len(scaled) == len(grads) == len(coef.users)
        # the scaling is the optimizer's only addition
        extra = Counter(n.target for n in part.optim.nodes()) - Counter(n.target for n in plain.optim.nodes())
        assert extra == Counter({torch.ops.aten.mul_.Tensor: len(grads)})
        for phase in ("fwd", "bwd"):
            assert [n.target for n in getattr(part, phase).nodes()] == \
                   [n.target for n in getattr(plain, phase).nodes()]
    assert _clip_axes(on) == [("dp_shard",), ("tp",)]
    assert all(n.args[0].meta["val"].shape == () for n in on.clip.nodes() if n.target == ALL_REDUCE)
    roles = {r.kind for r in on.clip.roles.values()}
    assert roles == {"grad_norm"}
    added = on.summary().collectives - off.summary().collectives
    assert added == Counter({("all_reduce", ("dp_shard",), "optim"): 1, ("all_reduce", ("tp",), "optim"): 1})
    from flint.ir.aten import get_schedule

    tail = [name for name, _ in get_schedule(module)][6:]
    assert tail == ["embed_norm", "block_norm", "head_norm", "grad_clip", "embed_optim", "block_optim", "head_optim"]


def test_replicated_gradients_need_no_all_reduce():
    """DDP: every rank holds the whole gradient, so its norm is already global (DTensor Replicate)."""
    step, _ = captured(1.0, dp_replicate=2)
    assert step.clip is not None and _clip_axes(step) == []
    assert all(p.norm is not None for p in step.parts)


def _estimate(module):
    from xdsl.context import Context

    from flint.chakra.from_ir import mesh_of, trace_from_ir
    from flint.cost import load_device, load_network
    from flint.passes.lower_to_chakra import LowerToChakraPass
    from flint.sim import simulate
    from flint.sim.lifetimes import step_memory

    module = module.clone()
    peak = step_memory(module).report.peak_bytes
    LowerToChakraPass(device="h100-sxm").apply(Context(), module)
    trace = trace_from_ir(module)
    table = trace.ranks[0].table
    comms = sum(1 for kind in table.comm_type if kind >= 0)
    result = simulate(trace, load_device("h100-sxm"), load_network("dgx-h100"), mesh_of(module))
    return result.iteration_time_us, comms, peak


def test_clipping_costs_time_not_memory():
    """The norms read every gradient once more and the scaling reads and writes them; two all-reduces more per
    rank. The peak (in llama-tiny's backward) is unchanged: clipping allocates scalars only."""
    (t_off, c_off, m_off), (t_on, c_on, m_on) = (_estimate(captured(x, dp_shard=2, tp=2)[1]) for x in (0.0, 1.0))
    assert c_on == c_off + 2
    assert t_on > t_off
    assert m_on == m_off


def test_pipeline_stages_join_their_norms_over_pp():
    """torchtitan's clip_grad_norm_ all-reduces the squared norm over the pipeline axis after DTensor's
    reduction; each pipeline rank runs the norms and optimizers of the parts its stage holds, @grad_clip once."""
    step, module = captured(1.0, dp_shard=2, pp=2, microbatches=2)
    assert _clip_axes(step) == [("dp_shard",), ("pp",)]
    from flint.ir.aten import get_schedule_entries

    for rank, held in ((0, ["embed", "block"]), (1, ["block", "head"])):
        names = [name for name, _, _ in get_schedule_entries(module, rank)]
        tail = names[names.index(f"{held[0]}_norm"):]
        assert tail == [f"{p}_norm" for p in held] + ["grad_clip"] + [f"{p}_optim" for p in held]


def test_pipeline_ranks_stay_symmetric_under_the_pp_all_reduce():
    """The all-reduce over pp is the first collective spanning two pipeline stages' tables; the simulator still
    runs one rank per stage (it ran all of them, minutes on the accuracy bench's 768-rank rows), with the same
    timeline as the full simulation."""
    from xdsl.context import Context

    from flint.chakra.from_ir import mesh_of, trace_from_ir
    from flint.cost import load_device, load_network
    from flint.passes.lower_to_chakra import LowerToChakraPass
    from flint.sim import simulate

    module = captured(1.0, dp_shard=2, pp=2, microbatches=2)[1].clone()
    LowerToChakraPass(device="h100-sxm").apply(Context(), module)
    trace = trace_from_ir(module)
    args = (trace, load_device("h100-sxm"), load_network("dgx-h100"), mesh_of(module))
    fast, full = simulate(*args), simulate(*args, symmetric=False)
    assert len(fast.simulated_ranks) == 2 and len(full.simulated_ranks) == 4
    assert fast.iteration_time_us == full.iteration_time_us
    assert (fast.finish_us == full.finish_us).all() and (fast.exposed_comm_us == full.exposed_comm_us).all()


class _Plain(nn.Module):
    """A model outside the zoo: blocks between an input projection and an output head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(2)])
        self.out = nn.Linear(32, 10)

    def forward(self, x, target):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return nn.functional.cross_entropy(self.out(h), target)


def test_model_outside_the_zoo_clips_too():
    step = capture_step(_Plain, {"x": (8, 16), "target": (8,)}, plan=Plan(dp_shard=2, max_norm=0.5).validate())
    assert [p.name for p in step.parts if p.norm is not None] == [p.name for p in step.parts]
    assert _clip_axes(step) == [("dp_shard",)]
    clamp = next(n for n in step.clip.nodes() if n.target == torch.ops.aten.clamp.default)
    assert clamp.kwargs.get("max", clamp.args[2] if len(clamp.args) > 2 else None) == 1.0
    assert any(n.args[1] == 0.5 for n in step.clip.nodes() if n.target == torch.ops.aten.mul.Tensor)


@cache
def single_device(batch: int):
    """llama-tiny on one device with clipping at 1.0 (the planned path's input), ``batch`` sequences."""
    from flint.importer import import_step

    return import_step(capture_step(factory("llama-tiny"), {"tokens": (batch, SEQ), "labels": (batch, SEQ)},
                                    plan=Plan(max_norm=1.0).validate()))


def _clipping_ops(module) -> dict[str, list[tuple[str, list[str]]]]:
    """The clipping functions' ops (the parts' norms and @grad_clip) with their types and, for collectives,
    their mesh axes."""
    from xdsl.dialects import func

    from flint.ir import dist

    out = {}
    for fn in module.ops:
        if isinstance(fn, func.FuncOp) and fn.sym_name.data.endswith(("_norm", "grad_clip")):
            out[fn.sym_name.data] = [(getattr(op, "overload", op.name), [str(v.type) for v in op.operands] +
                                      ([str(op.axes())] if isinstance(op, dist.CollectiveOp) else []))
                                     for op in fn.walk() if op is not fn and op.name != "func.return"]
    return out


@pytest.mark.parametrize("fields,reduces", [({"dp_shard": 2, "tp": 2}, 2), ({"dp_replicate": 2}, 0),
                                            ({"dp_shard": 2, "zero": 2}, 1)], ids=["fsdp-tp", "ddp", "zero2"])
def test_planned_path_clips_as_the_capture_does(fields, reduces):
    """A single-device capture with clipping, expanded by shard-expand: each part's norms are of its local
    gradient shards and @grad_clip all-reduces the squared total over each axis the gradients are split on, as
    the direct capture of the plan runs it (FSDP x TP: dp_shard, then tp; ZeRO-2: dp_shard; DDP: whole
    gradients, no all-reduce). The plan records the field."""
    from flint.explore.stages import expand_stage
    from flint.plan import plan_of

    expanded = expand_stage(single_device(4), Plan.from_dict({**fields, "max_norm": 1.0}))
    step, direct = captured(1.0, **fields)
    assert _clipping_ops(expanded) == _clipping_ops(direct)
    assert sum(op == "dist.all_reduce" for op, _ in _clipping_ops(expanded)["grad_clip"]) == reduces
    assert len(_clip_axes(step)) == reduces
    assert plan_of(expanded).max_norm == 1.0
    if "tp" in fields:  # the capture summary and the expansion's agree on the added collectives
        from flint.sharding.summary import summarize_program

        clip = {k: n for k, n in summarize_program(expanded).collectives.items()
                if k[0] == "all_reduce" and k[2] == "optim"}
        assert clip == {("all_reduce", ("dp_shard",), "optim"): 1, ("all_reduce", ("tp",), "optim"): 1}


def test_planned_path_zero1_norms_whole_gradients():
    """ZeRO-1 (the planned path's only: DDP + ZeroRedundancyOptimizer) keeps the gradients whole, so each rank's
    norm is already the global one: no all-reduce, and the norms read whole gradients."""
    from flint.explore.stages import expand_stage

    expanded = expand_stage(single_device(4), Plan(dp_shard=2, zero=1, max_norm=1.0).validate())
    ops = _clipping_ops(expanded)
    assert not any(op.startswith("dist.") for op, _ in ops["grad_clip"])
    assert ops["head_norm"] == _clipping_ops(single_device(4))["head_norm"]


def test_planned_path_joins_pipeline_stages_norms_over_pp():
    """flint expand with pp: the expanded @grad_clip all-reduces over dp_shard, then pp (pipeline-split runs each
    rank's held parts' norms, @grad_clip once, then their optimizers), as the captured pipeline does; the
    iteration and the all-reduce time are the captured step's."""
    from dataclasses import replace

    from flint.ir.aten import get_schedule_entries
    from flint.passes.shard_annotate import annotate, check_model
    from flint.passes.shard_expand import expand
    from flint.pipeline import split_by_plan
    from flint.sharding.rules import rules_for

    plan = Plan.from_dict({"dp_shard": 2, "pp": 2, "microbatches": 2, "max_norm": 1.0})
    expanded = single_device(2).clone()  # as flint expand runs it: the single-device step is one microbatch
    rules = rules_for(expanded)
    check_model(expanded, replace(plan, microbatches=1), rules)
    annotate(expanded, plan, rules)
    expand(expanded, plan, rules)
    assert split_by_plan(expanded, plan)
    step, direct = captured(1.0, dp_shard=2, pp=2, microbatches=2)
    assert _clipping_ops(expanded)["grad_clip"] == _clipping_ops(direct)["grad_clip"]
    for rank in (0, 1):
        tail = [n for n, _, _ in get_schedule_entries(expanded, rank)]
        assert tail[-4:] == [n for n, _, _ in get_schedule_entries(direct, rank)][-4:]
    assert _estimate(expanded)[:2] == _estimate(direct)[:2]


def test_planned_path_refuses_a_threshold_the_program_does_not_run():
    """A plan asking the planned path to clip a program that does not, or at another threshold, is refused
    with the field named; flint explore captures a planned point's single-device program with its clipping
    (its own cache key)."""
    from flint.explore.stages import Workload, expand_stage
    from flint.importer import import_step

    plain = import_step(capture_step(factory("llama-tiny"), {"tokens": (4, SEQ), "labels": (4, SEQ)},
                                     plan=Plan().validate()))
    with pytest.raises(PlanError, match="the program does not clip its gradients") as e:
        expand_stage(plain, Plan(dp_shard=2, max_norm=1.0).validate())
    assert e.value.field == "max_norm"
    with pytest.raises(PlanError, match="2: the program clips at 1") as e:
        expand_stage(single_device(4), Plan(dp_shard=2, max_norm=2.0).validate())
    assert e.value.field == "max_norm"
    base = {"workload.model": "llama-tiny", "workload.world_size": 2, "workload.seq_len": SEQ,
            "workload.global_batch": 4, "workload.plan.dp_shard": -1}
    off, on = Workload.of(base), Workload.of({**base, "workload.plan.max_norm": 1.0})
    assert on.planned_refusal() is None and on.single_key != off.single_key
    assert on.single_inputs()["plan"] == {"world_size": 1, "max_norm": 1.0}
