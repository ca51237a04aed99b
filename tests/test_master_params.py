"""Megatron-LM's mixed-precision optimizer (plan field ``master_dtype``): a bf16 model whose optimizer steps
fp32 master copies of the parameters, with fp32 Adam state and the gradients cast to fp32, and copies the
result back into the parameters (``Float16OptimizerWithFloat16Params``)."""

from __future__ import annotations

import math
from collections import Counter
from functools import cache

import pytest
from captures import SEQ

from flint.capture import CaptureError, capture_step
from flint.models import factory
from flint.plan import Plan, PlanError

pytestmark = pytest.mark.slow  # each capture compiles with dynamo/AOTAutograd


@cache
def captured(master: str):
    """gpt2-tiny in bf16 under FSDP 2 x TP 2 (no FSDP mixed precision), with or without fp32 masters."""
    from flint.importer import import_step

    plan = Plan.from_dict({"dp_shard": 2, "tp": 2, "master_dtype": master}, world_size=4)
    batch = (4, SEQ)
    step = capture_step(factory("gpt2-tiny"), {"tokens": batch, "labels": batch}, plan=plan, dtype="bfloat16")
    return step, import_step(step)


@cache
def single_device(master: str):
    """gpt2-tiny in bf16 on one device (the planned path's input), the global batch of ``captured``."""
    from flint.importer import import_step

    plan = Plan.from_dict({"master_dtype": master})
    return import_step(capture_step(factory("gpt2-tiny"), {"tokens": (4, SEQ), "labels": (4, SEQ)}, plan=plan,
                                    dtype="bfloat16"))


def optim_roles(step, kind: str):
    return [(part, role) for part in step.parts if part.optim for role in part.optim.roles.values()
            if role.kind == kind]


def numel(step, kind: str) -> int:
    return sum(math.prod(role.local_shape) * part.repeat for part, role in optim_roles(step, kind))


def test_plan_field_validated_and_named():
    plan = Plan.from_dict({"tp": 8, "master_dtype": "float32"})
    assert Plan.from_dict(plan.to_dict()) == plan
    assert "float32 master params" in plan.describe()
    with pytest.raises(PlanError, match="plan field 'master_dtype': unknown dtype 'fp32'; known: param, float32"):
        Plan.from_dict({"tp": 2, "master_dtype": "fp32"})
    with pytest.raises(PlanError, match="'master_dtype': FSDP's mixed precision .* already are the master copies"):
        Plan.from_dict({"dp_shard": 2, "param_dtype": "bfloat16", "master_dtype": "float32"})


def test_optimizer_steps_fp32_masters_and_copies_them_back():
    step, _ = captured("float32")
    params = optim_roles(step, "parameter")
    masters = optim_roles(step, "master")
    # one fp32 master per parameter, of its local (FSDP x TP sharded) shape, and fp32 Adam state
    assert [(p.param, p.local_shape) for _, p in params] == [(m.param, m.local_shape) for _, m in masters]
    assert {str(r.dtype) for _, r in params} == {str(r.dtype) for _, r in optim_roles(step, "gradient")} \
        == {"torch.bfloat16"}
    assert {str(r.dtype) for kind in ("master", "exp_avg", "exp_avg_sq") for _, r in optim_roles(step, kind)} \
        == {"torch.float32"}
    for part in step.parts:
        if not part.optim:
            continue
        n = sum(r.kind == "parameter" for r in part.optim.roles.values())
        ops = Counter(str(node.target) for node in part.optim.gm.graph.nodes if node.op == "call_function")
        assert ops["aten.copy_.default"] == n  # each parameter written from its master
        assert ops["aten._to_copy.default"] == n  # each gradient cast to fp32
        assert ops["aten.addcdiv_.default"] == n  # the Adam update, on the masters


def test_memory_adds_the_masters_and_fp32_state():
    from flint.sim.lifetimes import step_memory

    with_masters, plain = captured("float32"), captured("param")
    n = numel(plain[0], "parameter")
    assert numel(with_masters[0], "master") == n
    peak = step_memory(with_masters[1]).report.category_peak_bytes
    base = step_memory(plain[1]).report.category_peak_bytes
    assert peak["params"] == base["params"] == 2 * n  # the bf16 model
    # bf16 Adam state (2 x 2 bytes) becomes fp32 state and a master (3 x 4 bytes): 8 bytes per parameter more
    assert peak["optimizer"] - base["optimizer"] == 8 * n
    assert peak["grads"] == base["grads"]


def test_masters_refused_on_a_float32_model():
    plan = Plan.from_dict({"tp": 2, "master_dtype": "float32"}, world_size=2)
    with pytest.raises(CaptureError, match="master_dtype.*the parameters already are float32"):
        capture_step(factory("gpt2-tiny"), {"tokens": (2, SEQ), "labels": (2, SEQ)}, plan=plan, dtype="float32")


def test_planned_path_expands_the_masters_as_the_capture_has_them():
    """A single-device capture with fp32 masters, expanded by shard-expand to the same FSDP x TP plan: the
    optimizer's state per rank is the direct capture's (masters sharded as the Adam state, every ZeRO stage)."""
    from xdsl.context import Context

    from flint.passes.canonicalize_dist import CanonicalizeDistPass
    from flint.passes.shard_annotate import ShardAnnotatePass
    from flint.passes.shard_expand import ShardExpandPass
    from flint.sim.lifetimes import step_memory

    single = single_device("float32")
    direct = step_memory(captured("float32")[1]).report.category_peak_bytes
    n = numel(captured("float32")[0], "parameter")
    for zero in (1, 2, 3):
        m = single.clone()
        CanonicalizeDistPass().apply(Context(), m)
        ShardAnnotatePass(dp_shard=2, tp=2, zero=zero).apply(Context(), m)
        ShardExpandPass().apply(Context(), m)
        m.verify()
        peak = step_memory(m).report.category_peak_bytes
        steps = sum(p.repeat for p in captured("float32")[0].parts if p.optim)  # fp32 step counters
        assert peak["optimizer"] == direct["optimizer"] == 12 * n + 4 * steps, zero


def test_explore_expands_masters_on_the_planned_path():
    """flint explore captures a planned point's single-device program with its masters (a cache key of its own)
    and expands it; a plan asking for masters the program lacks is refused with the field named."""
    from flint.explore.stages import Workload, expand_stage
    from flint.sim.lifetimes import step_memory

    base = {"workload.model": "gpt2-tiny", "workload.world_size": 4, "workload.seq_len": SEQ,
            "workload.global_batch": 4, "workload.dtype": "bfloat16", "workload.plan.dp_shard": -1,
            "workload.plan.tp": 2}
    plain, masters = Workload.of(base), Workload.of({**base, "workload.plan.master_dtype": "float32"})
    assert masters.planned_refusal() is None and masters.single_key != plain.single_key
    assert masters.single_inputs()["plan"] == {"world_size": 1, "master_dtype": "float32"}
    expanded = expand_stage(single_device("float32"), masters.plan)
    direct = step_memory(captured("float32")[1]).report.category_peak_bytes
    assert step_memory(expanded).report.category_peak_bytes["optimizer"] == direct["optimizer"]
    with pytest.raises(PlanError, match="'master_dtype': 'float32' master parameters: the program's optimizer "
                                        "steps the parameters themselves"):
        expand_stage(single_device("param"), masters.plan)
