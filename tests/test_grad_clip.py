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


def test_refused_where_not_built():
    """The planned path (shard-expand) and a pipeline function of the user's do not clip: refused, named."""
    from flint.passes.shard_annotate import EXPAND_FIELDS, check_single_device

    one = capture_step(factory("llama-tiny"), {"tokens": (2, SEQ), "labels": (2, SEQ)},
                       plan=Plan(max_norm=1.0).validate())
    from flint.importer import import_step

    with pytest.raises(PlanError, match="captured with gradient-norm clipping") as e:
        check_single_device(import_step(one))
    assert e.value.field == "max_norm"
    with pytest.raises(PlanError, match="shard-expand does not support it") as e:
        Plan(dp_shard=2, max_norm=1.0).validate().require(EXPAND_FIELDS, "shard-expand")
    assert e.value.field == "max_norm"

    def stages(model, mesh):  # never called: refused before any work
        raise AssertionError

    with pytest.raises(PlanError, match="pipeline function of the user's") as e:
        capture_step(_Plain, {"x": (8, 16), "target": (8,)}, plan=Plan(pp=2, microbatches=2, max_norm=1.0).validate(),
                     parallelize=stages)
    assert e.value.field == "max_norm"
