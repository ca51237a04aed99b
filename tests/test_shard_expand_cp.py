"""shard-expand with context parallelism (flint/sharding/cp.py): PyTorch's ring attention along ``cp``
(K/V all-gathered once per attention call, head-tail causal load balance, the K/V gradient passed round
the ring with send/recv), FSDP over dp_shard x cp. Collective bytes against a hand calculation,
conservation of the causal attention work, bad plans, and the step lowered and simulated."""

from __future__ import annotations

from pathlib import Path

import pytest
from captures import SEQ, single_device
from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp

from flint.errors import FlintError
from flint.ir.aten import AtenOp, get_schedule
from flint.passes.canonicalize_dist import CanonicalizeDistPass
from flint.passes.shard_annotate import ShardAnnotatePass
from flint.passes.shard_expand import ShardExpandPass
from flint.passes.verify_p2p import VerifyP2PPass
from flint.plan import PlanError
from flint.sharding.summary import summarize_program

BATCH = 8  # one single-device capture (shared with tests/test_shard_expand.py)
# llama-tiny (flint/models): dim 256, 16 heads of 16, 8 KV heads (repeated to 16 before SDPA), FFN 512,
# vocabulary 1024, 2 layers; the tests' capture is float32 (4 bytes per parameter and activation), and the
# K/V-gradient ring runs in float32 whatever the model dtype (convert_to_f32)
DIM, HEADS, HEAD_DIM, KV_HEADS, FFN, VOCAB, LAYERS, ELEM, F32 = 256, 16, 16, 8, 512, 1024, 2, 4, 4
EMBED_PARAMS = VOCAB * DIM
BLOCK_PARAMS = 2 * DIM + 2 * DIM * DIM + 2 * KV_HEADS * HEAD_DIM * DIM + 3 * FFN * DIM  # 2 norms, wq wo, wk wv, w1 w3 w2
HEAD_PARAMS = DIM + VOCAB * DIM
ALL_PARAMS = EMBED_PARAMS + LAYERS * BLOCK_PARAMS + HEAD_PARAMS


def expand(plan_fields: dict, batch: int = BATCH) -> ModuleOp:
    _, single = single_device("llama-tiny", batch)
    embed = next(f for f in single.ops if getattr(f, "sym_name", None) and f.sym_name.data == "embed_fwd")
    assert str(embed.body.block.args[0].type) == f"tensor<{VOCAB}x{DIM}xf32>"  # the constants above
    m = single.clone()
    CanonicalizeDistPass().apply(Context(), m)
    ShardAnnotatePass(**plan_fields).apply(Context(), m)
    ShardExpandPass().apply(Context(), m)
    m.verify()
    VerifyP2PPass().apply(Context(), m)  # every send has its recv; no deadlock on the concrete mesh
    return m


def test_cp4_collective_bytes_match_the_hand_calculation():
    """cp = 4 alone: FSDP runs over cp (torchtitan's dp_shard_cp), so the cp axis carries the unit
    gathers / reduce-scatters AND the ring attention's K/V traffic."""
    cp = 4
    got = summarize_program(expand({"cp": cp}))
    local_seq = SEQ // cp  # 16 tokens per rank (chunks r and 2cp-1-r of 8)
    kv_elems = 2 * BATCH * HEADS * local_seq * HEAD_DIM  # local K and V after repeat_kv, as SDPA sees them
    fsdp_gather = ALL_PARAMS // cp * ELEM  # per phase: embed, ONE block x 2 layers, head; each unit's shard
    # forward: 4 FSDP unit gathers + 1 K/V all-gather per layer
    assert got.collectives[("all_gather", ("cp",), "fwd")] == 3 + LAYERS + LAYERS - 1
    assert got.collective_bytes[("all_gather", ("cp",), "fwd")] == fsdp_gather + LAYERS * kv_elems * ELEM
    # backward: FSDP re-gathers each unit but the head (kept from its forward, as torchtitan); the ring
    # backward all-gathers K/V again
    assert got.collectives[("all_gather", ("cp",), "bwd")] == 2 + LAYERS + LAYERS - 1
    assert got.collective_bytes[("all_gather", ("cp",), "bwd")] == \
        fsdp_gather - HEAD_PARAMS // cp * ELEM + LAYERS * kv_elems * ELEM
    # backward: cp hops of the float32 K/V gradient per attention call (send to r+1, recv from r-1)
    assert got.collectives[("send", ("cp",), "bwd")] == LAYERS * cp
    assert got.collective_bytes[("send", ("cp",), "bwd")] == LAYERS * cp * kv_elems * F32
    assert got.sends == got.recvs == LAYERS * cp
    # gradients: one flat reduce-scatter per unit over cp (its input is the unit's full gradient)
    assert got.collectives[("reduce_scatter", ("cp",), "bwd")] == 3 + LAYERS - 1
    assert got.collective_bytes[("reduce_scatter", ("cp",), "bwd")] == ALL_PARAMS * ELEM
    assert set(got.collectives) == {("all_gather", ("cp",), "fwd"), ("all_gather", ("cp",), "bwd"),
                                    ("send", ("cp",), "bwd"), ("reduce_scatter", ("cp",), "bwd")}


def test_cp_with_fsdp_and_sequence_parallel_tp_hand_calculation():
    """dp_shard 2 x cp 2 x tp 2 with sp: FSDP over (dp_shard, cp), K/V traffic on cp only (heads split
    by tp), TP+SP traffic as without CP (counts) on half the tokens (bytes)."""
    dp, cp, tp = 2, 2, 2
    got = summarize_program(expand({"dp_shard": dp, "cp": cp, "tp": tp, "sp": True}))
    kv_elems = 2 * (BATCH // dp) * (HEADS // tp) * (SEQ // cp) * HEAD_DIM
    assert got.collectives[("all_gather", ("cp",), "fwd")] == LAYERS
    assert got.collective_bytes[("all_gather", ("cp",), "fwd")] == LAYERS * kv_elems * ELEM
    assert got.collective_bytes[("all_gather", ("cp",), "bwd")] == LAYERS * kv_elems * ELEM
    assert got.collective_bytes[("send", ("cp",), "bwd")] == LAYERS * cp * kv_elems * F32
    # FSDP over dp_shard x cp of the tp shards: every parameter here is tp-split except the 2 norms per
    # block and the final norm (replicated over tp)
    replicated = 2 * LAYERS * DIM + DIM
    per_rank = (ALL_PARAMS - replicated) // tp + replicated
    assert got.collective_bytes[("all_gather", ("dp_shard", "cp"), "fwd")] == per_rank // (dp * cp) * ELEM
    assert got.collective_bytes[("reduce_scatter", ("dp_shard", "cp"), "bwd")] == per_rank * ELEM
    # sequence-parallel TP per block as without CP: the tokens a rank holds are B/dp x S/cp
    tokens = (BATCH // dp) * (SEQ // cp)
    assert got.collectives[("reduce_scatter", ("tp",), "fwd")] == 2 * LAYERS + 1
    assert got.collective_bytes[("reduce_scatter", ("tp",), "fwd")] == (2 * LAYERS + 1) * tokens * DIM * ELEM
    assert got.collectives[("all_gather", ("tp",), "fwd")] == 2 * LAYERS + 2  # + the head's vocab-parallel loss


def _attention_work(module: ModuleOp) -> tuple[int, float, int]:
    """(counted attention FLOPs, causal attention work = FLOPs x causal fraction, other FLOPs), per rank."""
    from xdsl.dialects import func

    from flint.opclasses import ATTENTION
    from flint.passes.annotate_cost import aten_op_work

    funcs = {f.sym_name.data: f for f in module.ops if isinstance(f, func.FuncOp)}
    counted = other = 0
    causal = 0.0
    for name, count in get_schedule(module):
        for op in funcs[name].walk():
            if isinstance(op, AtenOp):
                cost = aten_op_work(op)
                if cost.op_class == ATTENTION:
                    counted += cost.flops * count
                    causal += cost.flops * cost.work_fraction * count
                else:
                    other += cost.flops * count
    return counted, causal, other


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_conserves_causal_attention_work(cp):
    """Per-rank work x cp = the single device's: every non-attention FLOP exactly; the causal attention
    work exactly (head-tail balance: L(L+1)/2 + (cp-1) L^2/2 query-key pairs per rank, L = S/cp); the
    attention FLOPs PyTorch's formula counts (mask ignored) are (cp+1)/(2cp) of the single device's."""
    _, single = single_device("llama-tiny", BATCH)
    one_counted, one_causal, one_other = _attention_work(single)
    counted, causal, other = _attention_work(expand({"cp": cp}))
    assert other * cp == one_other
    assert causal * cp == pytest.approx(one_causal, rel=1e-12)
    assert counted * 2 * cp * cp == one_counted * (cp + 1)
    # the causal-work sum by hand (forward: 4 B H Dh FLOPs per query-key pair; backward: 2.5x forward)
    L = SEQ // cp
    pairs = L * (L + 1) // 2 + (cp - 1) * L * L // 2
    assert causal == pytest.approx(LAYERS * 4 * BATCH * HEADS * HEAD_DIM * pairs * 3.5, rel=1e-12)


def test_cp_not_dividing_the_sequence_is_refused_before_any_work():
    _, single = single_device("llama-tiny", BATCH)
    for cp in (3, 64):  # 2*cp must divide the sequence (64): 6 and 128 do not
        m = single.clone()
        CanonicalizeDistPass().apply(Context(), m)
        before = str(m)
        with pytest.raises(PlanError, match=r"plan field 'cp': sequence length 64 is not divisible by "
                                            rf"{2 * cp} \(2\*cp for load-balanced causal attention"):
            ShardAnnotatePass(cp=cp).apply(Context(), m)
        assert str(m) == before


GOLDEN = Path(__file__).parents[1] / "lit_tests" / "passes" / "shard-expand-cp.mlir"


def _golden_module(causal: bool, tmp_path: Path) -> ModuleOp:
    from flint.ir.parse import load_ir

    path = tmp_path / "block.mlir"
    text = GOLDEN.read_text()
    path.write_text(text if causal else text.replace("is_causal = true", "is_causal = false"))
    return load_ir(str(path))


def test_non_causal_attention_runs_every_ring_step_in_full(tmp_path):
    """Without a causal mask PyTorch refuses load balancing: every step is the local q against a whole
    remote K/V chunk, unmasked."""
    m = _golden_module(False, tmp_path)
    ShardAnnotatePass(cp=2).apply(Context(), m)
    ShardExpandPass().apply(Context(), m)
    m.verify()
    calls = [o for o in m.walk() if isinstance(o, AtenOp) and "flash_attention" in o.overload]
    assert len(calls) == 4  # 2 forward + 2 backward steps
    for o in calls:
        k = o.inputs[1] if o.overload.endswith("for_cpu.default") else o.inputs[2]
        assert list(k.type.get_shape()) == [2, 2, 4, 8]
        assert o.args.data["is_causal"].value.data == 0


def test_cp_refuses_attention_ops_without_a_ring_rule(tmp_path):
    m = _golden_module(True, tmp_path)
    for o in m.walk():
        if isinstance(o, AtenOp) and o.overload == "aten._scaled_dot_product_flash_attention_for_cpu.default":
            from xdsl.dialects.builtin import StringAttr

            o.properties["target"] = StringAttr("aten._scaled_dot_product_efficient_attention.default")
    ShardAnnotatePass(cp=2).apply(Context(), m)
    with pytest.raises(FlintError, match=r"context parallelism: 'aten._scaled_dot_product_efficient_attention"
                                         r".default'.*has no ring-attention rule"):
        ShardExpandPass().apply(Context(), m)


@pytest.mark.slow
def test_cp4_llama_step_expands_lowers_and_simulates(tmp_path, capsys):
    """The acceptance path through the CLI: flint expand (cp = 4) -> flint emit -> flint estimate."""
    from flint.tools.flint_cli import main

    step = tmp_path / "single.mlir"
    assert main(["capture", "--model", "llama-tiny", "--world-size", "1", "--plan", "dp", "--batch-size", "2",
                 "--seq-len", "64", "-o", str(step)]) == 0
    plan = tmp_path / "cp4.toml"
    plan.write_text("cp = 4\n")
    per_rank = tmp_path / "cp4.mlir"
    assert main(["expand", str(step), str(plan), "-o", str(per_rank)]) == 0
    out = capsys.readouterr().out
    assert "cp=4 = 4 ranks" in out and "send" in out
    traces = tmp_path / "et"
    assert main(["emit", str(per_rank), "-o", str(traces)]) == 0
    assert sorted(p.name for p in traces.glob("*.et")) == [f"trace.{r}.et" for r in range(4)]
    capsys.readouterr()
    assert main(["estimate", str(per_rank), "--network", "dgx-h100"]) == 0
    report = capsys.readouterr().out
    assert "comm send" in report and "comm recv" in report and "iteration time" in report


def test_moe_under_cp_routes_each_ranks_own_tokens():
    """The MoE's tokens keep their context-parallel split: each cp rank routes and runs the experts on its own
    sequence shard, as torchtitan's MoE does under CP (tokens are independent there). The MoE rules counted only
    the data-parallel axes as token axes, so the sequence was gathered before every MoE layer and each cp rank
    ran the experts on all its data-parallel shard's tokens: 1.59x the per-rank FLOPs of the same degree of
    FSDP at this size (moe-tiny, cp = 2). Now within a few percent of it (ring attention's causal balance).
    Its output comes back split on the sequence, as its input was: nothing moves between the cp ranks but the
    ring's K/V and FSDP's traffic (the routing's gathers and scatters lost where the tokens' split came from, so
    the output was split on the batch and an all-to-all over cp moved it back: 1 per block in forward, 7 in
    backward)."""
    _, one = single_device("moe-tiny", 4)

    def expanded(fields):
        m = one.clone()
        CanonicalizeDistPass().apply(Context(), m)
        ShardAnnotatePass(**fields).apply(Context(), m)
        ShardExpandPass().apply(Context(), m)
        m.verify()
        return summarize_program(m)

    cp, fsdp = expanded({"cp": 2}), expanded({"dp_shard": 2})
    assert 0.9 * fsdp.flops <= cp.flops <= fsdp.flops
    assert {kind for kind, _, _ in cp.collectives} == {"all_gather", "reduce_scatter", "send"}


@pytest.mark.slow
def test_hugging_face_model_under_cp_moves_no_tokens():
    """A Hugging Face model whose attention runs without a mask (BERT's masked LM: bidirectional SDPA, no padding)
    under cp: its loss's backward keeps the sequence split, so the cp ranks exchange only the ring's K/V and FSDP's
    traffic. The loss gradient (nll_loss_backward, then log_softmax's backward reading the saved output) lost where
    the flattened tokens' split came from and went back to [batch, seq] split on the batch: 9 all-to-alls over cp
    in backward."""
    m = _expand_byom("bert", {"cp": 2})
    assert {kind for kind, _, _ in summarize_program(m).collectives} == {"all_gather", "reduce_scatter", "send"}


def _expand_byom(name: str, plan_fields: dict) -> ModuleOp:
    """The single-device capture of tests/data/byom/hf_models.py's ``name`` (2 x 32 tokens) expanded."""
    from captures import single_device_byom

    m = single_device_byom(name, 2)[1].clone()
    CanonicalizeDistPass().apply(Context(), m)
    ShardAnnotatePass(**plan_fields).apply(Context(), m)
    ShardExpandPass().apply(Context(), m)
    m.verify()
    VerifyP2PPass().apply(Context(), m)
    return m


@pytest.mark.slow
def test_hugging_face_decoder_under_cp_runs_the_causal_ring():
    """A Hugging Face decoder (Llama: 4 query heads, 2 K/V heads of 16, 2 layers, float32) under cp = 2. Its
    capture calls SDPA as eager Hugging Face does (is_causal, no mask, the K/V heads as they are: test_byom), so
    PyTorch's ring runs it: the K/V gradient passes round the ring once per rank and layer in float32, 2 heads
    wide (not repeated to 4), and the causal work and every other FLOP are conserved (head-tail balance). Before,
    the capture built an explicit mask, which cp refused (and before that, expanded against each rank's shard
    and priced as not causal). With FSDP over dp_shard too, the loss's targets (Hugging Face shifts the labels
    inside the model: gathered over cp, padded, sliced) take the logits' split of their [batch * seq] rows (batch
    over dp_shard, sequence over cp): an all-to-all over dp_shard moved them onto the sequence before."""
    from captures import single_device_byom

    single = single_device_byom("llama", 2)[1]
    m = _expand_byom("llama", {"cp": 2})
    got = summarize_program(m)
    kv_elems = 2 * 2 * 2 * (32 // 2) * 16  # K and V: batch 2, 2 heads, 16 local tokens, head dim 16
    assert got.collectives[("send", ("cp",), "bwd")] == got.sends == got.recvs == 2 * 2
    assert got.collective_bytes[("send", ("cp",), "bwd")] == 2 * 2 * kv_elems * F32
    one_counted, one_causal, one_other = _attention_work(single)
    counted, causal, other = _attention_work(m)
    assert other * 2 == one_other and causal * 2 == pytest.approx(one_causal, rel=1e-12)
    assert counted * 2 * 2 * 2 == one_counted * 3
    with_fsdp = summarize_program(_expand_byom("llama", {"cp": 2, "dp_shard": 2}))
    assert {kind for kind, _, _ in with_fsdp.collectives} == {"all_gather", "reduce_scatter", "send"}


@pytest.mark.slow
def test_hugging_face_grouped_gemm_moe_under_cp():
    """Hugging Face's grouped-GEMM experts (Mixtral) under cp x FSDP: each rank routes its own tokens (no
    all-to-all), every FLOP but attention's is a quarter of the single device's, the causal work too. Refused
    before (the traced mask)."""
    from captures import single_device_byom

    single = single_device_byom("mixtral", 2)[1]
    m = _expand_byom("mixtral", {"cp": 2, "dp_shard": 2})
    assert {kind for kind, _, _ in summarize_program(m).collectives} == {"all_gather", "reduce_scatter", "send"}
    _, one_causal, one_other = _attention_work(single)
    _, causal, other = _attention_work(m)
    assert other * 4 == one_other and causal * 4 == pytest.approx(one_causal, rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("name,why", [
    ("mistral", r"'aten._scaled_dot_product_flash_attention_for_cpu.default' at [^ ]*/transformers/[^ ]*\.py:\d+:0 "
              r"\(module 'block.self_attn'\) takes "
              r"an explicit attention mask \(tensor<2x1x32x32xi1>\): PyTorch's context_parallel runs attention "
              r"without one only"),
    ("gpt_oss", r"the program has no fused attention call .* eager attention \(bmm, softmax\) would attend to each "
                r"rank's own shard of the sequence only")])
def test_cp_where_pytorch_runs_no_ring_attention_is_refused(name, why):
    """cp on a program PyTorch's context_parallel does not run as ring attention is refused before any work: an
    attention with an explicit mask (Mistral's sliding window of 16 tokens, shorter than the 32, which eager
    Hugging Face masks too; PyTorch's ring refuses an attention bias; the error names the model's line, not the
    capture's stand-in for SDPA), and eager attention (gpt-oss: bmm, softmax, sinks), which the ring does not
    rewrite. Both
    expanded: the mask whole against the rank's sequence shard, the attention priced as not causal; the eager
    attention's K/V all-gathered over cp, which no PyTorch run does."""
    from captures import single_device_byom

    m = single_device_byom(name, 2)[1].clone()
    CanonicalizeDistPass().apply(Context(), m)
    with pytest.raises(PlanError, match=f"plan field 'cp': {why}"):
        ShardAnnotatePass(cp=2).apply(Context(), m)
