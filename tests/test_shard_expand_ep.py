"""shard-expand on a mixture-of-experts step: MoE routing / dispatch / expert / combine rules under data
parallelism (agreeing with the captured path), and expert parallelism along ``ep`` (all_to_all dispatch
and combine, forward and backward, bytes per peer checked against a hand calculation, FLOPs conserved,
lowered and simulated); bad MoE plans refused before any work."""

from __future__ import annotations

import pytest
from captures import imported, single_device, single_device_config
from xdsl.context import Context
from xdsl.dialects import func

from flint.ir import dist
from flint.passes.canonicalize_dist import CanonicalizeDistPass
from flint.passes.shard_annotate import annotate, check_model
from flint.passes.shard_expand import expand
from flint.plan import Plan, PlanError, from_recipe
from flint.sharding.rules import load_rules
from flint.sharding.summary import summarize_program

# moe-tiny with 8 experts (Mixtral's count): hidden 128, top-2, 2 layers; 16 sequences of 64 tokens, f32
BATCH, SEQ, HIDDEN, TOP_K, EXPERTS, LAYERS, F32_BYTES = 16, 64, 128, 2, 8, 2, 4
INT64_BYTES = 8


def single():
    _, m = single_device_config("moe-tiny", BATCH, (("n_experts", EXPERTS),))
    return m


def expanded(plan: Plan, module=None):
    m = (module or single()).clone()
    CanonicalizeDistPass().apply(Context(), m)
    rules = load_rules()
    check_model(m, plan)
    annotate(m, plan, rules)
    expand(m, plan, rules)
    m.verify()
    return m


EP8 = Plan.from_dict({"dp_shard": 8, "ep": 8})  # one expert per rank
EP4_HSDP_CAP = Plan.from_dict({"dp_replicate": 2, "dp_shard": 8, "ep": 4, "capacity_factor": 1.25})


@pytest.mark.parametrize("plan", [EP8, EP4_HSDP_CAP], ids=["ep8", "hsdp-ep4-capacity1.25"])
def test_all_to_all_bytes_match_hand_calculation(plan):
    """Per MoE layer: forward = token counts + dispatch + combine, backward = the two in reverse; each
    dispatch/combine sends tokens x top_k x hidden x 4 B x capacity / ep to every peer."""
    m = expanded(plan)
    ep_axes = ("dp_shard_in_ep",)
    assert plan.axes("ep") == ep_axes
    tokens_per_rank = BATCH * SEQ // plan.dp  # each rank routes its own tokens
    # hand calculation, per peer of the ep group and per collective
    per_peer = tokens_per_rank * TOP_K * HIDDEN * F32_BYTES * plan.capacity_factor / plan.ep
    assert per_peer == {8: 128 * 2 * 128 * 4 / 8, 16: 64 * 2 * 128 * 4 * 1.25 / 4}[plan.world_size]
    counts_bytes = EXPERTS * INT64_BYTES  # torchtitan's all_to_all of the tokens per expert (forward only)
    buffer_bytes = int(per_peer * plan.ep)  # one all_to_all's input (it sends 1/ep of it to each peer)

    s = summarize_program(m)
    assert s.collectives[("all_to_all", ep_axes, "fwd")] == 3 * LAYERS
    assert s.collective_bytes[("all_to_all", ep_axes, "fwd")] == LAYERS * (counts_bytes + 2 * buffer_bytes)
    assert s.collectives[("all_to_all", ep_axes, "bwd")] == 2 * LAYERS
    assert s.collective_bytes[("all_to_all", ep_axes, "bwd")] == LAYERS * 2 * buffer_bytes
    assert not any(k[0] == "all_to_all" and k[1] != ep_axes for k in s.collectives)
    # and per op, in the block's program: input bytes / group size = the hand figure
    block = {f.sym_name.data: f for f in m.ops if isinstance(f, func.FuncOp)}
    for phase in ("fwd", "bwd"):
        big = [o for o in block[f"block_{phase}"].walk() if isinstance(o, dist.AllToAllOp)
               and len(o.input.type.get_shape()) == 3]
        assert len(big) == 2
        for o in big:
            e, rows, h = o.input.type.get_shape()
            assert e * rows * h * F32_BYTES / o.group_size() == per_peer


@pytest.mark.parametrize("plan", [EP8, Plan.from_dict({"dp_shard": 8, "ep": 4}), Plan.from_dict({"dp_shard": 16, "ep": 8}),
                                  EP4_HSDP_CAP], ids=["ep8", "fsdp-ep4", "fsdp-ep8-dim1", "hsdp-ep4-capacity1.25"])
def test_conservation(plan):
    """FLOPs x ranks = single-device FLOPs under balanced routing (capacity padding moves bytes, not
    expert FLOPs); expert weights and their optimizer state per rank are 1/(ep x expert_fsdp) (with
    more shards than experts FSDP splits dim 1, as torchtitan does)."""
    from flint.passes.lower_to_chakra import ROLE_ATTR

    one = summarize_program(single())
    m = expanded(plan)
    assert summarize_program(m).flops * plan.world_size == one.flops
    shards = plan.ep * plan.dp_shard // plan.ep  # ep x dp_shard_mod_ep = dp_shard

    def expert_elems(module, role):
        total = 0
        for f in module.ops:
            if isinstance(f, func.FuncOp) and f.sym_name.data == "block_optim":
                for a, attrs in zip(f.body.block.args, f.arg_attrs.data):
                    param = attrs.data.get("flint.param")
                    if attrs.data[ROLE_ATTR].data == role and param and load_rules().is_expert(param.data):
                        n = 1
                        for x in a.type.get_shape():
                            n *= x
                        total += n
        return total
    for role in ("parameter", "gradient", "exp_avg"):
        assert expert_elems(m, role) * shards == expert_elems(single(), role) > 0


def test_ep8_lowers_and_simulates():
    from flint.chakra.from_ir import mesh_of, trace_from_ir
    from flint.cost import load_device, load_network
    from flint.passes.lower_to_chakra import LowerToChakraPass
    from flint.sim import simulate

    m = expanded(EP8)
    LowerToChakraPass(device="h100-sxm").apply(Context(), m)
    trace = trace_from_ir(m)
    res = simulate(trace, load_device("h100-sxm"), load_network("dgx-h100"), mesh_of(m))
    assert res.world_size == 8 and res.iteration_time_us > 0
    assert res.model_flops == summarize_program(single()).flops
    assert (res.comm_time_us > 0).all()


def test_dense_path_is_unchanged_by_moe_rules():
    """Expert parallelism off: the MoE step expands under FSDP with no all_to_all, experts gathered with
    the block's other parameters (one FSDP unit, as the captured recipe)."""
    s = summarize_program(expanded(Plan.from_dict({"dp_shard": 8})))
    assert not any(k[0] == "all_to_all" for k in s.collectives)
    assert s.collectives[("all_gather", ("dp_shard",), "fwd")] == LAYERS + 2


@pytest.mark.parametrize("fields,field,match", [
    ({"dp_shard": 16, "ep": 16}, "ep", "16 does not divide the model's 8 experts"),
    ({"dp_shard": 2, "cp": 2, "ep": 2}, "ep", "borrowing context-parallel ranks"),
])
def test_bad_moe_plans_are_refused_before_any_work(fields, field, match):
    m = single().clone()
    before = _fingerprint(m)
    plan = Plan.from_dict(fields)
    with pytest.raises(PlanError, match=match) as e:
        check_model(m, plan)
    assert e.value.field == field
    assert _fingerprint(m) == before


def _fingerprint(m) -> tuple:
    """Ops, their result types and the module attributes (cheaper than printing the module)."""
    return tuple((o.name, tuple(str(r.type) for r in o.results)) for o in m.walk()) + \
        tuple(sorted((k, str(v)) for k, v in m.attributes.items()))


@pytest.mark.parametrize("fields,match", [
    ({"dp_shard": 8, "ep": 8, "capacity_factor": 0.5}, "capacity_factor.*between 1.0 and 64"),
    ({"dp_shard": 8, "capacity_factor": 1.5}, "capacity_factor.*needs ep > 1"),
    ({"dp_shard": 8, "ep": 8, "capacity_factor": "big"}, "capacity_factor.*must be a number"),
])
def test_bad_capacity_factor(fields, match):
    with pytest.raises(PlanError, match=match):
        Plan.from_dict(fields)


def test_ep_on_a_dense_model_is_refused_before_any_work():
    _, dense = single_device("llama-tiny", 8)
    m = dense.clone()
    before = _fingerprint(m)
    with pytest.raises(PlanError, match="expert parallelism needs a mixture-of-experts model"):
        check_model(m, Plan.from_dict({"dp_shard": 2, "ep": 2}))
    assert _fingerprint(m) == before


def test_cli_expand_ep_plan(tmp_path, capsys):
    from pathlib import Path

    from flint.tools.flint_cli import main

    step = Path(__file__).parents[1] / "lit_tests" / "passes" / "shard-expand-ep.mlir"
    plan = tmp_path / "plan.toml"
    plan.write_text("dp_shard = 8\nep = 8\ncapacity_factor = 1.5\n")
    out = tmp_path / "per_rank.mlir"
    assert main(["expand", str(step), str(plan), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ep=8 capacity 1.5" in text and "all_to_all" in text and "dp_shard_in_ep" in text
    assert "dist.all_to_all" in out.read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text("dp_shard = 16\nep = 16\n")
    out2 = tmp_path / "never.mlir"
    assert main(["expand", str(step), str(bad), "-o", str(out2)]) != 0
    assert "plan field 'ep': 16 does not divide the model's 8 experts" in capsys.readouterr().err
    assert not out2.exists()


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["dp", "fsdp"])
def test_moe_planned_path_agrees_with_captured_path(recipe):
    """The zoo MoE model (moe-tiny, 4 experts) under DDP and FSDP: captured with PyTorch's recipe at 2
    ranks vs captured once on one device and expanded: FLOPs and collectives per axis and phase equal."""
    plan = from_recipe(recipe, 2)
    _, one = single_device("moe-tiny", 2 * plan.dp)
    exp = summarize_program(expanded(plan, one))
    _, module = imported("moe-tiny", recipe, 2)
    cap_m = module.clone()
    CanonicalizeDistPass().apply(Context(), cap_m)
    cap = summarize_program(cap_m)
    assert exp.flops == cap.flops
    assert dict(exp.collectives) == dict(cap.collectives)
    assert dict(exp.collective_bytes) == dict(cap.collective_bytes)


def test_capture_refuses_ep_naming_the_field_not_the_model():
    """The captured path has no EP recipe: `ep` on the MoE model is refused as unsupported by capture (the
    planned path expands it), not as 'needs a mixture-of-experts model'."""
    from flint.capture import capture_step
    from flint.models import factory

    with pytest.raises(PlanError, match="plan field 'ep': capture does not support it yet"):
        capture_step(factory("moe-tiny"), {"tokens": (4, SEQ), "labels": (4, SEQ)},
                     plan=Plan.from_dict({"dp_shard": 4, "ep": 4}))
    with pytest.raises(PlanError, match="plan field 'ep': 8 does not divide the model's 4 experts"):
        capture_step(factory("moe-tiny"), {"tokens": (8, SEQ), "labels": (8, SEQ)},
                     plan=Plan.from_dict({"dp_shard": 8, "ep": 8}))


@pytest.mark.slow
def test_top1_routing_with_batch_equal_to_experts():
    """top_k = 1 and batch = experts: the activations between blocks have the expert buffers' shape and
    the same ep split, yet backward still runs exactly two all_to_all per layer (expert-layout values are
    marked by the forward, not guessed from shapes)."""
    _, m = single_device_config("moe-tiny", EXPERTS, (("n_experts", EXPERTS), ("top_k", 1)))
    one = summarize_program(m)
    s = summarize_program(expanded(EP8, m))
    assert s.flops * EP8.world_size == one.flops
    ep_axes = ("dp_shard_in_ep",)
    buffer_bytes = (EXPERTS * SEQ // EP8.dp) * 1 * HIDDEN * F32_BYTES
    assert s.collectives[("all_to_all", ep_axes, "bwd")] == 2 * LAYERS
    assert s.collective_bytes[("all_to_all", ep_axes, "bwd")] == LAYERS * 2 * buffer_bytes
    assert s.collective_bytes[("all_to_all", ep_axes, "fwd")] == LAYERS * (EXPERTS * INT64_BYTES + 2 * buffer_bytes)
