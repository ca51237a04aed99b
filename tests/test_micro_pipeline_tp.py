"""`micro-pipeline-tp` (async TP, after torch's inductor pass): what it matches on captured and planned
tensor + sequence parallelism, FLOPs and moved bytes conserved, chunk GEMMs priced by the GEMM model,
the simulator hiding the transfers, bad options refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from captures import imported, single_device
from xdsl.context import Context

from flint.chakra.from_ir import mesh_of, trace_from_ir
from flint.cost import load_device, load_network
from flint.errors import FlintError
from flint.ir import dist
from flint.ir.parse import load_ir
from flint.passes.lower_to_chakra import LowerToChakraPass
from flint.passes.verify_p2p import VerifyP2PPass
from flint.passes.micro_pipeline_tp import FUSED_ATTR, MicroPipelineTPPass, rewrite
from flint.sim import simulate
from flint.trace import CollKind, NodeKind

DEVICE = "h100-sxm"


def _lowered(module):
    m = module.clone()
    LowerToChakraPass(device=DEVICE).apply(Context(), m)
    return m


def _wire_bytes(trace) -> float:
    """Bytes rank 0 puts on the wire for all-gathers, reduce-scatters and sends (ring volumes, per run)."""
    t = trace.ranks[0].table
    sizes = {g: len(r) for g, r in trace.comm_groups.items()}
    groups = trace.ranks[0].groups()
    total = 0.0
    for i in range(len(t)):
        if t.kind[i] == NodeKind.SEND:
            total += t.comm_bytes[i]
        elif t.kind[i] == NodeKind.COLL:
            n = sizes.get(int(groups[i]), trace.world_size)
            if t.comm_type[i] == CollKind.ALL_GATHER:
                total += (n - 1) * t.comm_bytes[i]
            elif t.comm_type[i] == CollKind.REDUCE_SCATTER:
                total += (n - 1) / n * t.comm_bytes[i]
    return total


def _check(before, after) -> None:
    """The shared invariants of the rewrite: verifies, same FLOPs per rank, same bytes on the wire, and
    the compute the chunked GEMMs add is theirs (smaller GEMMs are slower per FLOP), never negative."""
    after.verify()
    VerifyP2PPass().apply(Context(), after.clone())  # sends matched one to one, no deadlock
    tb, ta = trace_from_ir(_lowered(before)), trace_from_ir(_lowered(after))
    comp_b = tb.ranks[0].table.kind == NodeKind.COMP
    comp_a = ta.ranks[0].table.kind == NodeKind.COMP
    assert tb.ranks[0].table.flops[comp_b].sum() == ta.ranks[0].table.flops[comp_a].sum()
    assert _wire_bytes(tb) == pytest.approx(_wire_bytes(ta), rel=1e-12)
    assert ta.ranks[0].table.duration_us[comp_a].sum() >= tb.ranks[0].table.duration_us[comp_b].sum()


GOLDEN = Path(__file__).resolve().parent.parent / "lit_tests" / "passes" / "micro-pipeline-tp.mlir"


def test_golden_block_conserves_work_and_bytes():
    """The golden's sequence-parallel block on 4 ranks: one gather -> 2 GEMMs and one GEMM -> scatter
    matched, the others left; FLOPs and wire bytes per rank unchanged; deterministic."""
    module = load_ir(str(GOLDEN))
    m = module.clone()
    st = rewrite(m, MicroPipelineTPPass())
    assert (st.all_gather_matmul, st.matmul_reduce_scatter, st.all_gathers_left, st.reduce_scatters_left) == (1, 1, 1, 1)
    steps = [o for o in m.walk() if isinstance(o, dist.StepsOp)]
    assert [o.count.value.data for o in steps] == [3, 3]
    _check(module, m)
    again = module.clone()
    rewrite(again, MicroPipelineTPPass())
    assert str(again) == str(m)


@pytest.mark.slow
def test_captured_tp_sp_step_matches_torchs_patterns():
    """Llama under DTensor TP + SP (2 ranks), counted as torch's pass would: per block the attention and
    MLP input gathers (wq/wk/wv, w1/w3) and the gathers of wo/w2's output gradients (their data-gradient
    GEMMs), plus the head's input gather; wo, w2 (forward) and w2's... reduce-scatters of one GEMM. Left:
    the backward reduce-scatters of a SUM of GEMMs (wq+wk+wv, w1+w3 data gradients) and the embedding's."""
    _, module = imported("llama-tiny", "tp+sp", 2, 2)
    m = module.clone()
    st = rewrite(m, MicroPipelineTPPass())
    assert (st.all_gather_matmul, st.matmul_reduce_scatter) == (5, 3)
    assert st.reasons["reduce-scatter of no matmul"] == 3
    assert st.all_gathers_left + st.reduce_scatters_left == sum(st.reasons.values())
    steps = [o for o in m.walk() if isinstance(o, dist.StepsOp)]
    assert len(steps) == 8 and {o.count.value.data for o in steps} == {1}
    assert sorted(o.attributes[FUSED_ATTR].data for o in steps).count("all_gather_matmul") == 5
    _check(module, m)
    # the memory model sees the same buffers: outputs and the gathered input written in place
    from flint.sim.lifetimes import step_memory

    before, after = step_memory(module).report, step_memory(m).report
    assert after.at_peak_bytes.get("activations") == before.at_peak_bytes.get("activations")
    assert after.peak_bytes <= before.peak_bytes
    # deterministic
    again = module.clone()
    rewrite(again, MicroPipelineTPPass())
    assert str(again) == str(m)


@pytest.mark.slow
def test_simulator_overlaps_the_pieces():
    """On the simulated step, exposed communication drops with the pass (transfer s + 1 under GEMM s)."""
    _, module = imported("llama-tiny", "tp+sp", 2, 2)
    m = module.clone()
    rewrite(m, MicroPipelineTPPass())

    def exposed(mod):
        low = _lowered(mod)
        r = simulate(trace_from_ir(low), load_device(DEVICE), load_network("dgx-h100"), mesh_of(low))
        return float(np.mean(r.exposed_comm_us))

    assert exposed(m) < exposed(module)


def test_chunk_gemms_are_priced_by_the_shape_model():
    """A chunk GEMM's duration is the GEMM model's for its own shape, not 1/n of the whole GEMM's."""
    from flint.passes.annotate_cost import aten_op_cost

    m = load_ir(str(GOLDEN))
    rewrite(m, MicroPipelineTPPass())
    device = load_device(DEVICE)
    steps = next(o for o in m.walk() if isinstance(o, dist.StepsOp))
    mm = next(o for o in steps.body.block.ops if getattr(o, "overload", "") in ("aten.mm.default", "aten.addmm.default"))
    flops, _, t = aten_op_cost(mm, device)
    from flint.passes.annotate_cost import aten_op_work

    assert t == pytest.approx(device.op_time_us(aten_op_work(mm)))
    assert flops > 0


@pytest.mark.slow
def test_planned_path_gives_the_same_patterns():
    """`shard-expand` with tp + sp writes the same gather/scatter -> GEMM shapes as the captured path."""
    from flint.passes.canonicalize_dist import CanonicalizeDistPass
    from flint.passes.shard_annotate import ShardAnnotatePass
    from flint.passes.shard_expand import ShardExpandPass

    _, single = single_device("llama-tiny", 4)
    m = single.clone()
    CanonicalizeDistPass().apply(Context(), m)
    ShardAnnotatePass(tp=2, sp=True).apply(Context(), m)
    ShardExpandPass().apply(Context(), m)
    before = m.clone()
    st = rewrite(m, MicroPipelineTPPass())
    assert (st.all_gather_matmul, st.matmul_reduce_scatter) == (5, 3)
    _check(before, m)


def test_reduce_scatter_steps_holding_sms_slow_the_overlapped_compute():
    """sms=16 (Transformer Engine's userbuffers reduce-scatter kernels): only the reduce-scatter steps'
    sends hold SMs, and the simulated step is slower than with copy-engine transfers (sms=0); FLOPs and
    bytes do not change."""
    _, module = imported("llama-tiny", "tp+sp", 2, 2)
    runs = {}
    for sms in (0, 16):
        m = module.clone()
        rewrite(m, MicroPipelineTPPass(sms=sms))
        low = _lowered(m)
        trace = trace_from_ir(low)
        t = trace.ranks[0].table
        runs[sms] = (simulate(trace, load_device(DEVICE), load_network("dgx-h100"), mesh_of(low)), t)
    (r0, t0), (r16, t16) = runs[0], runs[16]
    assert t0.comm_sms is None
    sends = t16.kind == NodeKind.SEND
    held = t16.comm_sms[sends]
    assert set(held.tolist()) == {0, 16} and (t16.comm_sms[~sends] == 0).all()  # all-gather steps: none
    assert t16.flops.sum() == t0.flops.sum() and t16.comm_bytes.sum() == t0.comm_bytes.sum()
    assert r16.iteration_time_us > r0.iteration_time_us


@pytest.mark.parametrize("opts,word", [
    (dict(all_gather=False, reduce_scatter=False), "all-gather=false and reduce-scatter=false"),
    (dict(stream="a b"), 'stream="a b"'),
    (dict(stream=""), 'stream=""'),
    (dict(all_gather=1), "all-gather must be true or false"),
    (dict(sms=-1), "sms=-1 must be an SM count"),
    (dict(sms=1025), "sms=1025 must be an SM count"),
])
def test_bad_options_are_refused_by_name(opts, word):
    with pytest.raises(FlintError, match=word.replace("(", r"\(")):
        MicroPipelineTPPass(**opts)
