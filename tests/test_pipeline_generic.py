"""Pipeline parallelism of a model outside the zoo under a plan (no pipeline function of the user's): the work
outside the repeated layers runs where it does in torch's pipelining, before them on the first stage and after
them on the last (before, the whole model part, head and loss included, ran on the first stage)."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from torch import nn

from flint.capture import capture_step, opclass
from flint.plan import Plan, PlanError


class _TwoSided(nn.Module):
    """Parameters outside the blocks on both sides, in modules no preset names: an input projection and norm
    before the blocks, a norm and output projection after them."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.inp_norm = nn.LayerNorm(32)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(layers)])
        self.norm = nn.LayerNorm(32)
        self.out = nn.Linear(32, 10)

    def forward(self, x, target):
        h = self.inp_norm(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return nn.functional.cross_entropy(self.out(self.norm(h)), target)


@functools.cache
def _two_sided(pp: int, microbatches: int = 2):
    plan = Plan(dp_shard=2, pp=pp, microbatches=microbatches).validate()
    return capture_step(_TwoSided, {"x": (8, 16), "target": (8,)}, plan=plan)


def test_one_microbatch_is_captured():
    """pipeline-split runs the captured step once per microbatch: the capture is of one microbatch (8 samples /
    2 data-parallel ranks / 2 microbatches), as on the zoo path. Was the whole local batch: M times the work."""
    one, two = _two_sided(1, 1), _two_sided(1, 2)
    assert two.batch_local_shapes["x"] == (2, 16) and one.batch_local_shapes["x"] == (4, 16)
    assert 2 * two.summary().flops == one.summary().flops > 0
    with pytest.raises(PlanError, match="microbatches") as e:
        capture_step(_TwoSided, {"x": (6, 16), "target": (6,)}, plan=Plan(dp_shard=2, microbatches=2).validate())
    assert e.value.field == "microbatches"


def _flops(part) -> int:
    return sum(opclass.node_flops(n) for g in part.graphs() for n in g.nodes())


def _collective_numel(part) -> Counter:
    out = Counter()
    for g in part.graphs():
        for n in g.nodes():
            if (kind := opclass.classify_aten(n.target)) in opclass.COLLECTIVES:
                out[(g.phase, kind)] += n.args[0].meta["val"].numel()
    return out


def _shard_numel(*modules: nn.Module) -> int:
    return sum(-(-p.shape[0] // 2) * (p.numel() // p.shape[0]) for m in modules for p in m.parameters())


def test_the_work_outside_the_blocks_is_split_where_it_runs():
    whole, staged = _two_sided(1), _two_sided(2)
    assert [(p.name, p.repeat) for p in whole.parts] == [("model", 1), ("block", 2)]
    assert [(p.name, p.repeat) for p in staged.parts] == [("first_stage", 1), ("block", 2), ("last_stage", 1)]
    first, last = staged.part("first_stage"), staged.part("last_stage")
    assert {p.name for p in first.params} == {"inp.weight", "inp.bias", "inp_norm.weight", "inp_norm.bias"}
    assert {p.name for p in last.params} == {"norm.weight", "norm.bias", "out.weight", "out.bias"}
    assert "pipeline stages: the first runs the model up to blocks and holds inp, inp_norm; the last runs what " \
           "follows the repeated layers and holds norm, out" in staged.notes
    # the same work and communicated elements as the model part, divided between the two stages (in two FSDP
    # groups, where the model part has one root group: below)
    assert _flops(first) + _flops(last) == _flops(whole.part("model")) > 0
    assert _collective_numel(first) + _collective_numel(last) == _collective_numel(whole.part("model"))
    # the head's GEMM and the loss run on the last stage only
    targets = lambda part: {n.target for g in part.graphs() for n in g.nodes()}  # noqa: E731
    assert torch.ops.aten.nll_loss_forward.default in targets(last)
    assert torch.ops.aten.nll_loss_forward.default not in targets(first)
    # each stage's remaining modules are an FSDP group of their own (torchtitan shards each stage's model part):
    # one gather of exactly its own parameters, where one root group gathered all eight on both stages
    model = _TwoSided()
    for part, modules in ((first, (model.inp, model.inp_norm)), (last, (model.norm, model.out))):
        gathers = [n for n in part.fwd.nodes() if opclass.classify_aten(n.target) == opclass.ALL_GATHER]
        assert [n.args[0].meta["val"].numel() for n in gathers] == [_shard_numel(*modules)]
        # the other stage's parameters are not arguments of this stage's forward
        assert {r.param for r in part.fwd.roles.values() if r.kind == "parameter"} == {p.name for p in part.params}


def test_each_pipeline_rank_runs_its_own_stage():
    from flint.importer import import_step
    from flint.ir.aten import get_schedule

    module = import_step(_two_sided(2))
    ranks = [{name.rsplit("_", 1)[0] for name, _ in get_schedule(module, r)} for r in range(2)]
    assert {"first_stage"} <= ranks[0] and not any(n.startswith("last_stage") for n in ranks[0])
    assert {"last_stage"} <= ranks[1] and not any(n.startswith("first_stage") for n in ranks[1])


def test_tied_embeddings_are_refused_with_pipeline_stages():
    from tests.captures import _byom_factory

    plan = Plan(dp_shard=1, pp=2, microbatches=2).validate()
    with pytest.raises(PlanError, match=r"transformer\.wte\.weight are read both before and after the repeated "
                                        r"layers \(tied input and output embeddings\)") as e:
        capture_step(_byom_factory("gpt2"), {"input_ids": (4, 32), "labels": (4, 32)}, plan=plan)
    assert e.value.field == "pp"


def _planned(name: str, plan: Plan):
    """The planned path (flint expand): a single-device capture of a model file, expanded to ``plan``."""
    from xdsl.context import Context

    from flint.passes.canonicalize_dist import CanonicalizeDistPass
    from flint.passes.shard_annotate import annotate
    from flint.passes.shard_expand import expand
    from flint.sharding.rules import load_rules
    from tests.captures import single_device_byom

    module = single_device_byom(name, 4)[1].clone()
    CanonicalizeDistPass().apply(Context(), module)
    rules = load_rules(None)
    annotate(module, plan, rules)
    expand(module, plan, rules)
    return module


def test_the_planned_path_splits_stages_or_refuses():
    """flint expand with pp: a model file captured on one device is split where its work runs (Llama: the
    embedding on the first stage, the head on the last); a model whose work outside the blocks stays one part
    (GPT-2: tied embeddings) is refused, as that part would run on one stage. Was: accepted, head and loss on
    the first stage."""
    from flint.ir.aten import get_schedule
    from flint.pipeline import split_by_plan

    plan = Plan(pp=2, microbatches=2).validate()
    llama = _planned("llama", plan)
    assert split_by_plan(llama, plan)
    ranks = [{name.rsplit("_", 1)[0] for name, _ in get_schedule(llama, r)} for r in range(2)]
    assert "first_stage" in ranks[0] and "last_stage" not in ranks[0]
    assert "last_stage" in ranks[1] and "first_stage" not in ranks[1]
    gpt2 = _planned("gpt2", plan)
    with pytest.raises(PlanError, match=r"@model_fwd holds a model's work both before and after its repeated "
                                        r"blocks .* capture it with pp in the plan") as e:
        split_by_plan(gpt2, plan)
    assert e.value.field == "pp"


def test_without_stages_the_head_runs_after_the_blocks():
    """A Hugging Face Llama under FSDP without pipeline stages: the embedding runs before the blocks, the head
    and loss after them, and the head's backward before the blocks' (the model part ran all of it before the
    blocks, so a model file's peak memory lacked the head's backward: 9.2 GiB where 12.8 is right on a 128k
    vocabulary). The same FLOPs and collectives as the model captured whole."""
    from flint.importer import import_step
    from flint.ir.aten import get_schedule
    from tests.captures import _byom_factory, captured_byom

    step = captured_byom("llama", "fsdp", 2)
    assert [(p.name, p.repeat) for p in step.parts] == [("first_stage", 1), ("block", 2), ("last_stage", 1)]
    order = [name for name, _ in get_schedule(import_step(step))]
    assert order[:6] == ["first_stage_fwd", "block_fwd", "last_stage_fwd", "last_stage_bwd", "block_bwd",
                         "first_stage_bwd"]
    whole = capture_step(_byom_factory("llama"), {"input_ids": (4, 32), "labels": (4, 32)}, world_size=2,
                         plan="fsdp", repeat=False)
    assert step.summary().flops == whole.summary().flops
    assert step.summary().collectives == whole.summary().collectives
    # one root group over parameters on both sides (FSDP2 gathers it once, for both): one part, said so
    two_sided = _two_sided(1)
    assert [p.name for p in two_sided.parts] == ["model", "block"]
    assert any(n.startswith("the work outside blocks is one part, 'model', scheduled before the repeated layers")
               and "one fully_shard group holds parameters read before the repeated layers (inp.weight) and after "
               "them (norm.weight)" in n for n in two_sided.notes)
