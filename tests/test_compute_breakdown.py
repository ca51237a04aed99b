"""`flint estimate`'s compute kernels by op class (``lower-to-chakra{class-times=true}``): the classes add up
to the lowered step's compute, merged or not, each class holds what its ops cost, fused kernels and a
decomposed collective's reductions have classes of their own, a pipelined step reports its busiest pipeline
rank, and the report prints it."""

from __future__ import annotations

import json

import numpy as np
import pytest
from captures import distributed_optimizer, imported
from xdsl.context import Context

from flint.chakra.from_ir import trace_from_ir
from flint.passes.canonicalize_dist import CanonicalizeDistPass
from flint.passes.fuse_pointwise import FusePointwisePass
from flint.passes.lower_to_chakra import LowerToChakraPass
from flint.schedule.pipelines import run_pipeline
from flint.sim.breakdown import COLL_REDUCTION, FUSED, compute_breakdown
from flint.trace import NodeKind

DEVICE = "h100-sxm"


def _both(module, passes: str = ""):
    """(breakdown of the lowering with class-times, per-rank compute sums of the plain lowering's trace);
    the breakdown is the same from an unmerged lowering (one node per kernel)."""
    m = module.clone()
    if passes:
        run_pipeline(m, passes)
    CanonicalizeDistPass().apply(Context(), m)
    plain, unmerged = m.clone(), m.clone()
    LowerToChakraPass(device=DEVICE, class_times=True).apply(Context(), m)
    LowerToChakraPass(device=DEVICE, class_times=True, merge_compute=False).apply(Context(), unmerged)
    LowerToChakraPass(device=DEVICE).apply(Context(), plain)
    trace = trace_from_ir(plain)
    sums = []
    for p in trace.ranks:
        t = p.table
        comp = t.kind == NodeKind.COMP
        sums.append(float(np.nansum(t.duration_us[comp])))
    br, one = compute_breakdown(m), compute_breakdown(unmerged)
    assert br.kernels == one.kernels and br.flops == one.flops and br.bytes == one.bytes
    assert br.time_us == pytest.approx(one.time_us, rel=1e-9)
    return br, sums


def test_classes_add_up_to_the_lowered_compute():
    _, module = imported("llama-tiny", "fsdp", 4)
    br, sums = _both(module, "reorder-all-gather{prefetch=1},sink-waits,assign-streams")
    assert br.graph == "step"
    assert br.total_us == pytest.approx(sums[0], rel=1e-8)  # nodes round their durations to 1e-6 us
    assert list(br.time_us)[:2] == ["gemm", "attention"] and {"elementwise", "memory"} <= set(br.time_us)
    # the GEMMs' FLOPs are the mm / addmm / bmm FLOPs of the functions as often as they run: 6 N tokens for
    # a model's linear layers is the bulk, so the GEMM class holds most of the step's FLOPs
    assert br.flops["gemm"] > 0.8 * sum(br.flops.values())
    assert all(br.kernels[c] > 0 and br.time_us[c] >= 0 for c in br.time_us)


def test_fused_kernels_are_their_own_class():
    _, module = imported("llama-tiny", "fsdp", 4)
    m = module.clone()
    FusePointwisePass(device=DEVICE).apply(Context(), m)
    br, sums = _both(m)
    plain, _ = _both(module)
    assert FUSED in br.time_us and FUSED not in plain.time_us
    assert br.total_us == pytest.approx(sums[0], rel=1e-8)  # nodes round their durations to 1e-6 us
    assert br.time_us["elementwise"] < plain.time_us["elementwise"]  # fusion took elementwise kernels in
    assert br.total_us < plain.total_us


def test_decomposed_collectives_reductions_are_counted_apart():
    _, module = imported("llama-tiny", "fsdp", 4)
    br, sums = _both(module, "sink-waits,decompose-collectives{algorithm=ring channels=2}")
    assert br.kernels[COLL_REDUCTION] > 0
    assert br.total_us == pytest.approx(sums[0], rel=1e-8)  # nodes round their durations to 1e-6 us


def test_reductions_some_ranks_skip_count_with_their_share():
    """A tree all-reduce on 6 ranks: inner ranks add their children's data, leaves add nothing (``flint.active``).
    The breakdown is the mean over ranks (it counted every masked reduction on every rank: 1773 us, not 1717)."""
    _, module = imported("llama-tiny", "dp", 6)
    br, sums = _both(module, "sink-waits,decompose-collectives{algorithm=tree}")
    assert max(sums) > min(sums)  # the ranks do differ
    assert br.total_us == pytest.approx(float(np.mean(sums)), rel=1e-8)
    assert not float(br.kernels[COLL_REDUCTION]).is_integer()  # a mean: some ranks run more than others
    assert all(isinstance(k, int) for c, k in br.kernels.items() if c != COLL_REDUCTION)


def test_pipelined_step_reports_its_busiest_pipeline_rank():
    _, module = distributed_optimizer(pp=2)
    br, sums = _both(module)
    assert br.graph.startswith("step_pp")
    assert br.total_us == pytest.approx(max(sums), rel=1e-8)


def test_a_lowering_without_class_times_is_named():
    from flint.errors import FlintError

    _, module = imported("llama-tiny", "fsdp", 4)
    m = module.clone()
    LowerToChakraPass(device=DEVICE).apply(Context(), m)
    with pytest.raises(FlintError, match=r"has no flint.class_times: lower the step with lower-to-chakra\{class-times=true\}"):
        compute_breakdown(m)


def test_estimate_prints_the_table_and_json(tmp_path, capsys):
    from flint.sim.cli import estimate_main
    from xdsl.printer import Printer

    _, module = imported("llama-tiny", "fsdp", 4)
    ir = tmp_path / "step.mlir"
    with open(ir, "w") as f:
        Printer(stream=f).print_op(module)
    assert estimate_main([str(ir), "--network", "switch"]) == 0
    out = capsys.readouterr().out
    assert "compute kernels by op class (as priced, per rank; SM sharing slows them" in out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("compute kernels by op class"))
    assert lines[head + 1].split() == ["class", "time", "(ms)", "share", "kernels", "TFLOP/s", "TB/s"]
    assert lines[head + 2].split()[0] == "gemm"
    assert estimate_main([str(ir), "--network", "switch", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    br = rep["compute_by_class"]
    assert br["graph"] == "step" and br["total_us"] == pytest.approx(sum(c["time_us"] for c in br["classes"].values()))
    assert br["total_us"] <= rep["compute_time_us"]["max"] + 1e-6  # SM sharing only slows kernels down


def test_estimate_of_ir_lowered_with_class_times(tmp_path, capsys):
    """IR lowered by flint-opt with class-times=true keeps the breakdown; lowered without it, none is printed."""
    from flint.sim.cli import estimate_main
    from xdsl.printer import Printer

    _, module = imported("llama-tiny", "fsdp", 4)
    for class_times in (True, False):
        m = module.clone()
        CanonicalizeDistPass().apply(Context(), m)
        LowerToChakraPass(device=DEVICE, class_times=class_times).apply(Context(), m)
        ir = tmp_path / f"low-{class_times}.mlir"
        with open(ir, "w") as f:
            Printer(stream=f).print_op(m)
        assert estimate_main([str(ir), "--network", "switch", "--json"]) == 0
        rep = json.loads(capsys.readouterr().out)
        assert ("compute_by_class" in rep) == class_times
        if class_times:
            assert rep["compute_by_class"]["total_us"] == pytest.approx(compute_breakdown(m).total_us)
