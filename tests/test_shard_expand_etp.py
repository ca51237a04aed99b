"""shard-expand on a mixture-of-experts step under tensor parallelism, as torchtitan's ``apply_moe_ep_tp``:
the experts tensor-parallel (``ep = 1``), expert tensor parallelism (``etp = tp``) and expert parallelism
borrowing the tp ranks (``etp = 1``). Collective kinds, counts and bytes per axis and phase against a hand
calculation, FLOPs conserved up to the replicated router, expert parameter / gradient / optimizer state per
rank as the plan splits them; bad plans refused before any work naming the field."""

from __future__ import annotations

from functools import cache

import pytest
from test_shard_expand_ep import BATCH, EXPERTS, F32_BYTES, HIDDEN, INT64_BYTES, LAYERS, SEQ, TOP_K, _fingerprint, \
    expanded, single
from xdsl.dialects import func

from flint.plan import Plan, PlanError
from flint.sharding.rules import load_rules
from flint.sharding.summary import summarize_program

FFN = 256  # moe-tiny's expert hidden size
VOCAB = 512

TP = {"dp_shard": 2, "tp": 2}  # experts tensor-parallel (torchtitan's TensorParallel), no ep
ETP = {"dp_shard": 4, "tp": 2, "ep": 2, "etp": 2}  # ExpertTensorParallel, experts FSDP over dp_shard_mod_ep = 2
EPTP_SP = {"dp_shard": 4, "tp": 2, "ep": 4, "sp": True}  # etp = 1: ep = dp_shard_in_ep (2) x tp (2), with SP


@cache
def _expanded(fields: tuple):
    m = expanded(Plan.from_dict(dict(fields)))
    return m, summarize_program(m)


def run(fields: dict):
    return _expanded(tuple(sorted(fields.items())))


def _elems(module, role: str, expert: bool) -> int:
    from flint.passes.lower_to_chakra import ROLE_ATTR

    total = 0
    for f in module.ops:
        if isinstance(f, func.FuncOp) and f.sym_name.data == "block_optim":
            for a, attrs in zip(f.body.block.args, f.arg_attrs.data):
                param = attrs.data.get("flint.param")
                if attrs.data[ROLE_ATTR].data == role and param and load_rules().is_expert(param.data) == expert:
                    n = 1
                    for x in a.type.get_shape():
                        n *= x
                    total += n
    return total


def _tp_collectives(s) -> dict:
    return {k: (s.collectives[k], s.collective_bytes[k]) for k in s.collectives if k[1] == ("tp",)}


# The tp collectives of the dense part, per rank (DTensor style, which the MoE shares): the vocabulary-parallel
# embedding's output reduce (fwd), the loss's gather of the logits (fwd) and the column-parallel head's input
# gradient (bwd); per layer attention's
# output (fwd) and its q, k, v input gradients (bwd, DTensor's three). torchtitan's MoE adds ONE reduction of
# its output per layer (Partial -> Replicate / Shard(1)) and ONE of its input gradient in backward; nothing
# inside it (router replicated, tp partial sums carried through the combine).
def test_tp_experts_hand_calculation():
    plan = Plan.from_dict(TP)
    m, s = run(TP)
    tokens = BATCH * SEQ // plan.dp  # per data-parallel rank (512)
    act = tokens * HIDDEN * F32_BYTES  # one [tokens, hidden] activation
    # the router's gradient is partial over tp (it back-propagates the tp-partial expert outputs): FSDP2
    # all-reduces it whole in backward (redistributing it to the router's Replicate), before its reduce-scatter
    router = EXPERTS * HIDDEN * F32_BYTES
    assert _tp_collectives(s) == {
        ("all_reduce", ("tp",), "fwd"): (1 + 2 * LAYERS, (1 + 2 * LAYERS) * act),
        ("all_reduce", ("tp",), "bwd"): (1 + 5 * LAYERS, (1 + 4 * LAYERS) * act + LAYERS * router),
        # the loss gathers the vocabulary-parallel logits
        ("all_gather", ("tp",), "fwd"): (1, tokens * VOCAB // plan.tp * F32_BYTES),
    }
    assert not any(k[0] == "all_to_all" for k in s.collectives)
    # the expert weights: hidden dim over tp, then FSDP over dp_shard, like the dense MLP
    one = single()
    for role in ("parameter", "gradient", "exp_avg"):
        assert _elems(m, role, True) * plan.tp * plan.dp_shard == _elems(one, role, True) > 0
        assert _elems(m, role, False) * plan.dp_shard * plan.tp >= _elems(one, role, False)


@pytest.mark.parametrize("fields", [TP, ETP, EPTP_SP], ids=["tp", "etp", "ep-borrows-tp-sp"])
def test_flops_conserved_up_to_the_replicated_router(fields):
    """Per-rank FLOPs x ranks = single device + (tp - 1) x the router's GEMMs (forward mm and its two backward
    mms on every token, replicated over tp as torchtitan's NoParallel gate); sends match receives (none here)."""
    plan = Plan.from_dict(fields)
    _, s = run(fields)
    one = summarize_program(single())
    router = 3 * 2 * BATCH * SEQ * HIDDEN * EXPERTS * LAYERS
    assert s.flops * plan.world_size == one.flops + (plan.tp - 1) * router
    assert s.sends == s.recvs == 0


def test_etp_hand_calculation():
    """etp = tp: experts split over ep (dp_shard_in_ep) and their hidden dim over tp; every tp rank of an ep
    group dispatches the same tokens (torchtitan's noted redundancy); FSDP of the experts over
    dp_shard_mod_ep."""
    plan = Plan.from_dict(ETP)
    m, s = run(ETP)
    ep, efsdp = ("dp_shard_in_ep",), ("dp_shard_mod_ep",)
    assert plan.axes("ep") == ep and plan.axes("expert_fsdp") == efsdp
    tokens = BATCH * SEQ // plan.dp  # 256 per data-parallel rank, whole on every tp rank
    buffer = tokens * TOP_K * HIDDEN * F32_BYTES  # one dispatch / combine input
    assert buffer // plan.ep == 256 * 2 * 128 * 4 // 2  # bytes to each ep peer
    counts = EXPERTS * INT64_BYTES
    assert s.collectives[("all_to_all", ep, "fwd")] == 3 * LAYERS
    assert s.collective_bytes[("all_to_all", ep, "fwd")] == LAYERS * (counts + 2 * buffer)
    assert s.collectives[("all_to_all", ep, "bwd")] == 2 * LAYERS
    assert s.collective_bytes[("all_to_all", ep, "bwd")] == LAYERS * 2 * buffer
    act = tokens * HIDDEN * F32_BYTES
    router = EXPERTS * HIDDEN * F32_BYTES  # the router's gradient, partial over tp: all-reduced whole in backward
    assert _tp_collectives(s) == {
        ("all_reduce", ("tp",), "fwd"): (1 + 2 * LAYERS, (1 + 2 * LAYERS) * act),
        ("all_reduce", ("tp",), "bwd"): (1 + 5 * LAYERS, (1 + 4 * LAYERS) * act + LAYERS * router),
        # the loss gathers the vocabulary-parallel logits
        ("all_gather", ("tp",), "fwd"): (1, tokens * VOCAB // plan.tp * F32_BYTES),
    }
    # expert FSDP: w1, w2, w3 of E/ep experts, hidden/tp each, sharded over efsdp
    local = 3 * (EXPERTS // plan.ep) * HIDDEN * (FFN // plan.tp) * F32_BYTES
    assert s.collectives[("all_gather", efsdp, "fwd")] == s.collectives[("all_gather", efsdp, "bwd")] == LAYERS
    assert s.collective_bytes[("all_gather", efsdp, "fwd")] == LAYERS * local // 2
    assert s.collectives[("reduce_scatter", efsdp, "bwd")] == LAYERS
    assert s.collective_bytes[("reduce_scatter", efsdp, "bwd")] == LAYERS * local
    one = single()
    for role in ("parameter", "gradient", "exp_avg"):
        assert _elems(m, role, True) * plan.ep * 2 * plan.tp == _elems(one, role, True) > 0


def test_ep_borrowing_tp_with_sequence_parallel_hand_calculation():
    """etp = 1: ep = 4 over dp_shard_in_ep x tp; the MoE input is all-gathered over tp (SP), each tp rank
    routes its 1/tp slice of the tokens (torchtitan's dispatcher with sp_size = tp) and scatters the result into
    zeros: the tp partial sum is reduce-scattered back to the sequence shard."""
    plan = Plan.from_dict(EPTP_SP)
    m, s = run(EPTP_SP)
    ep = ("dp_shard_in_ep", "tp")
    assert plan.axes("ep") == ep
    tokens = BATCH * SEQ // plan.dp // plan.tp  # 128 routed by each rank
    buffer = tokens * TOP_K * HIDDEN * F32_BYTES
    assert buffer // plan.ep == 128 * 2 * 128 * 4 // 4
    counts = EXPERTS * INT64_BYTES
    assert s.collectives[("all_to_all", ep, "fwd")] == 3 * LAYERS
    assert s.collective_bytes[("all_to_all", ep, "fwd")] == LAYERS * (counts + 2 * buffer)
    assert s.collectives[("all_to_all", ep, "bwd")] == 2 * LAYERS
    assert s.collective_bytes[("all_to_all", ep, "bwd")] == LAYERS * 2 * buffer
    assert not any(k[0] == "all_to_all" and k[1] != ep for k in s.collectives)
    # sequence parallelism: per layer attention and MoE each gather their input and reduce-scatter their output
    # (forward), and the reverse pair in backward; plus the embedding's reduce-scatter, the head's gather (and
    # its backward's reduce-scatter), and the loss's gather of the logits' sequence shards
    shard = BATCH * SEQ // plan.dp * HIDDEN * F32_BYTES // plan.tp  # one sequence shard of [tokens, hidden]
    tp = _tp_collectives(s)
    assert tp[("all_gather", ("tp",), "fwd")][0] == 2 * LAYERS + 2
    assert tp[("reduce_scatter", ("tp",), "fwd")] == (2 * LAYERS + 1, (2 * LAYERS + 1) * shard * plan.tp)
    assert tp[("all_gather", ("tp",), "bwd")] == (2 * LAYERS + 1, (2 * LAYERS + 1) * shard)
    assert tp[("reduce_scatter", ("tp",), "bwd")] == (2 * LAYERS + 1, (2 * LAYERS + 1) * shard * plan.tp)
    # partial gradients over tp, all-reduced whole in backward before FSDP's reduce-scatter (FSDP2 redistributes
    # them to their Replicate placement): the sequence-parallel norms' (two per layer and the final one) and the
    # router's
    norms, router = 2 * LAYERS + 1, LAYERS
    assert {k: v for k, v in tp.items() if k[0] == "all_reduce"} == {
        ("all_reduce", ("tp",), "bwd"): (norms + router, (norms * HIDDEN + router * EXPERTS * HIDDEN) * F32_BYTES)}
    # experts whole on each rank, E / ep of them, FSDP over dp_shard_mod_ep (2)
    one = single()
    for role in ("parameter", "gradient", "exp_avg"):
        assert _elems(m, role, True) * plan.ep * 2 == _elems(one, role, True) > 0


_EXPERT_HIDDEN_6 = """
builtin.module {
  func.func @block_fwd(%x: tensor<8x4x16xf32> {flint.role = "activation"},
      %w1: tensor<8x16x6xf32> {flint.role = "parameter", flint.param = "layers.0.feed_forward.w1"}) -> tensor<8x4x16xf32> {
    func.return %x : tensor<8x4x16xf32>
  }
}
"""


@pytest.mark.parametrize("fields,field,match", [
    ({"dp_shard": 4, "tp": 2, "ep": 2, "etp": 3}, "etp", "must be 1 or tp \\(2\\), got 3"),
    ({"dp_shard": 2, "tp": 2, "etp": 2}, "etp", "needs ep > 1"),
])
def test_bad_etp_fields(fields, field, match):
    with pytest.raises(PlanError, match=match) as e:
        Plan.from_dict(fields)
    assert e.value.field == field


@pytest.mark.parametrize("fields,field,match", [
    ({"dp_shard": 16, "tp": 2, "ep": 8, "etp": 2}, "etp", "more expert shards than experts"),
    ({"dp_shard": 16, "tp": 2, "ep": 16, "etp": 2}, "ep", "does not divide the model's 8 experts"),
])
def test_bad_etp_plans_refused_before_any_work(fields, field, match):
    from flint.passes.shard_annotate import check_model

    m = single().clone()
    before = _fingerprint(m)
    with pytest.raises(PlanError, match=match) as e:
        check_model(m, Plan.from_dict(fields))
    assert e.value.field == field
    assert _fingerprint(m) == before


@pytest.mark.parametrize("fields,field", [({"dp_shard": 2, "tp": 4, "ep": 2, "etp": 4}, "etp"),
                                          ({"dp_shard": 2, "tp": 4}, "tp")])
def test_expert_hidden_not_divisible_by_tp(fields, field, tmp_path):
    """Tensor-parallel experts split the expert hidden size (6 here): tp = 4 does not divide it."""
    from flint.ir.parse import load_ir
    from flint.passes.shard_annotate import check_model

    p = tmp_path / "moe.mlir"
    p.write_text(_EXPERT_HIDDEN_6)
    m = load_ir(str(p))
    before = _fingerprint(m)
    with pytest.raises(PlanError, match="4 does not divide dim 2 \\(the expert hidden size 6\\) of "
                                        "'layers.0.feed_forward.w1'") as e:
        check_model(m, Plan.from_dict(fields))
    assert e.value.field == field
    assert _fingerprint(m) == before


def test_cli_expand_etp_plan(tmp_path, capsys):
    from pathlib import Path

    from flint.tools.flint_cli import main

    step = Path(__file__).parents[1] / "lit_tests" / "passes" / "shard-expand-etp.mlir"
    plan = tmp_path / "plan.toml"
    plan.write_text("dp_shard = 4\ntp = 2\nep = 4\netp = 2\n")
    out = tmp_path / "per_rank.mlir"
    assert main(["expand", str(step), str(plan), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ep=4 etp=2" in text and "all_to_all" in text
    assert "dist.all_to_all" in out.read_text()


def test_etp_lowers_and_simulates():
    """The etp = tp program lowers to Chakra and simulates on every rank role; all FLOPs accounted for."""
    from xdsl.context import Context

    from flint.chakra.from_ir import mesh_of, trace_from_ir
    from flint.cost import load_device, load_network
    from flint.passes.lower_to_chakra import LowerToChakraPass
    from flint.sim import simulate

    plan = Plan.from_dict(ETP)
    m = run(ETP)[0].clone()
    LowerToChakraPass(device="h100-sxm").apply(Context(), m)
    res = simulate(trace_from_ir(m), load_device("h100-sxm"), load_network("dgx-h100"), mesh_of(m))
    assert res.world_size == plan.world_size and res.iteration_time_us > 0
    router = 3 * 2 * BATCH * SEQ * HIDDEN * EXPERTS * LAYERS
    assert res.model_flops == summarize_program(single()).flops + (plan.tp - 1) * router
    assert (res.comm_time_us > 0).all()
