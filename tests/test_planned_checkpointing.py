"""Activation checkpointing on the planned path: a single-device capture with ``activation_checkpoint`` (and
``ac_every``), expanded by shard-expand, against the direct capture of the same plan; the modes and
combinations it refuses, by name."""

from __future__ import annotations

from functools import cache

import pytest
from captures import SEQ

from flint.capture import capture_step
from flint.models import factory
from flint.plan import Plan, PlanError

pytestmark = pytest.mark.slow  # each capture compiles with dynamo/AOTAutograd

LAYERS = 4


@cache
def single_device(ac: str, every: int = 1, batch: int = 4):
    from flint.importer import import_step

    plan = Plan.from_dict({"activation_checkpoint": ac, "ac_every": every})
    return import_step(capture_step(factory("llama-tiny", n_layers=LAYERS), {"tokens": (batch, SEQ),
                                                                             "labels": (batch, SEQ)}, plan=plan))


@cache
def captured(**fields):
    from flint.importer import import_step

    plan = Plan.from_dict(fields)
    batch = (4, SEQ)
    return import_step(capture_step(factory("llama-tiny", n_layers=LAYERS), {"tokens": batch, "labels": batch},
                                    plan=plan))


def _figures(module):
    """Step FLOPs, GEMM kernels and time, collectives and peak memory per rank."""
    from xdsl.context import Context

    from flint.chakra.from_ir import mesh_of, trace_from_ir
    from flint.cost import load_device, load_network
    from flint.passes.lower_to_chakra import LowerToChakraPass
    from flint.sharding.summary import summarize_program
    from flint.sim import simulate
    from flint.sim.breakdown import compute_breakdown
    from flint.sim.lifetimes import step_memory

    module = module.clone()
    summary = summarize_program(module)
    peak = step_memory(module).report.peak_bytes
    LowerToChakraPass(device="h100-sxm", class_times=True).apply(Context(), module)
    result = simulate(trace_from_ir(module), load_device("h100-sxm"), load_network("dgx-h100"), mesh_of(module))
    gemm = compute_breakdown(module)
    return summary.flops, gemm.kernels["gemm"], gemm.time_us["gemm"], summary.collectives, peak, \
        result.iteration_time_us


@pytest.mark.parametrize("ac,every", [("full", 1), ("selective-layer", 2)])
def test_planned_path_recomputes_as_the_capture_does(ac, every):
    """FSDP 2 x TP 2: the expanded program runs the direct capture's FLOPs (recompute included), GEMMs and
    collectives (the recomputed forward's TP all-reduces too); its peak memory is within 0.1% and its
    iteration within 2% (the planned path's known FSDP x TP difference without checkpointing)."""
    from flint.explore.stages import expand_stage
    from flint.plan import plan_of

    fields = {"dp_shard": 2, "tp": 2, "activation_checkpoint": ac, "ac_every": every}
    expanded = expand_stage(single_device(ac, every), Plan.from_dict(fields))
    flops, gemms, gemm_us, colls, peak, t = _figures(expanded)
    flops_d, gemms_d, gemm_us_d, colls_d, peak_d, t_d = _figures(captured(**fields))
    plain = _figures(captured(dp_shard=2, tp=2))
    assert flops == flops_d > plain[0] and gemms == gemms_d > plain[1]
    assert gemm_us == pytest.approx(gemm_us_d) and colls == colls_d
    assert peak == pytest.approx(peak_d, rel=1e-3) and peak < plain[4]
    assert t == pytest.approx(t_d, rel=0.02)
    assert (plan_of(expanded).activation_checkpoint, plan_of(expanded).ac_every) == (ac, every)


def test_a_plan_leaving_checkpointing_unset_takes_the_programs():
    from flint.explore.stages import expand_stage
    from flint.plan import plan_of

    expanded = expand_stage(single_device("full"), Plan.from_dict({"dp_shard": 2}))
    assert plan_of(expanded).activation_checkpoint == "full"


def test_refused_by_name():
    """Another mode than the program's; selective-op (its partition is decided on the distributed program);
    selective-layer with pp (two block parts, which pipeline-split does not stage)."""
    from flint.explore.stages import expand_stage

    cases = [(single_device("full"), {"dp_shard": 2, "activation_checkpoint": "selective-layer", "ac_every": 2},
              "the program was captured with 'full'"),
             (single_device("selective-op"), {"dp_shard": 2}, "'selective-op' is not expanded"),
             (single_device("selective-layer", 2, batch=2),
              {"dp_shard": 2, "pp": 2, "microbatches": 2, "activation_checkpoint": "selective-layer", "ac_every": 2},
              "'selective-layer' with pp is not expanded")]
    for program, fields, why in cases:
        with pytest.raises(PlanError, match=why) as e:
            expand_stage(program, Plan.from_dict({**fields, "microbatches": 1}))
        assert e.value.field == "activation_checkpoint"


def test_explore_captures_the_single_device_program_with_it():
    """flint explore's planned point captures its single-device program with the mode (its own cache key); a
    selective-op point takes the captured path."""
    from flint.explore.stages import Workload

    base = {"workload.model": "llama-tiny", "workload.world_size": 2, "workload.seq_len": SEQ,
            "workload.global_batch": 4, "workload.plan.dp_shard": -1}
    plain = Workload.of(base)
    full = Workload.of({**base, "workload.plan.activation_checkpoint": "full"})
    assert full.planned_refusal() is None and full.single_key != plain.single_key
    assert full.single_inputs()["plan"] == {"world_size": 1, "activation_checkpoint": "full"}
    sop = Workload.of({**base, "workload.plan.activation_checkpoint": "selective-op"})
    assert "'selective-op' is not expanded" in sop.planned_refusal() and sop.key == sop.captured_key
