"""The form of torch's AdamW a step runs (plan field ``optimizer_impl``, torchtitan's
``optimizer.implementation``): ``for-loop`` (kernels per parameter, the default), ``foreach`` (torch's GPU
default: multi-tensor ops) or ``fused`` (one ``_fused_adamw_``), and the multi-tensor ops' pricing (ATen's
``multi_tensor_apply`` launches)."""

from __future__ import annotations

from collections import Counter
from functools import cache

import pytest
import torch
from captures import SEQ
from torch import nn

from flint.capture import capture_step
from flint.cost import load_device
from flint.cost.flops import MTA_CHUNK, MTA_MAX_BLOCKS, MTA_MAX_TENSORS, multi_tensor_launches, op_cost
from flint.errors import FlintError
from flint.models import factory
from flint.plan import Plan, PlanError

MULTI = ("_foreach_", "_fused_adam")


# ----------------------------------------------------------------------------- pricing (no capture)

def test_launches_follow_multi_tensor_apply():
    """MultiTensorApply.cuh's loop: a launch when 2,240 blocks (chunks of 65,536 elements) fill, or when the
    depth's tensor limit fills at a tensor's last chunk; the tensor cut by a full launch continues in the next;
    empty tensors are skipped."""
    assert multi_tensor_launches([10, 20, 0, 30], depth=2) == [60]
    whole = MTA_MAX_BLOCKS * MTA_CHUNK
    assert multi_tensor_launches([whole + 5], depth=1) == [whole, 5]
    assert multi_tensor_launches([whole - MTA_CHUNK, 2 * MTA_CHUNK], depth=1) == [whole, MTA_CHUNK]
    # depth 4 (a fused AdamW: params, grads, exp_avgs, exp_avg_sqs) takes 252 tensors per launch
    assert MTA_MAX_TENSORS[3] == 252
    assert multi_tensor_launches([1] * 300, depth=4) == [252, 48]
    assert multi_tensor_launches([1] * 300, depth=1) == [300]
    assert multi_tensor_launches([1] * 700, depth=1, scalar_list=True) == [672, 28]
    assert multi_tensor_launches([], depth=1) == []


def _sizes(*lists: int) -> dict:
    return {"list_sizes": list(lists)}


def test_fused_adamw_bytes_and_time():
    """Reads params, grads, both moments and the step counts; writes params and both moments (not the
    gradients, which its schema marks mutable); one launch here, priced as streaming pointwise kernels."""
    shapes = [(1024, 1024), (4096,)]
    params = shapes * 4 + [(), ()]
    cost = op_cost("aten._fused_adamw_.default", params, "bf16", [], [], _sizes(2, 2, 2, 2, 0, 2))
    n = 1024 * 1024 + 4096
    assert cost.bytes == 2 * n * 4 + 2 * 2 + 2 * n * 3  # bf16 steps here: the dtype given for every operand
    assert cost.flops == 0 and cost.kernel_shares == (1.0,)
    dev = load_device("h100-sxm")
    from flint.cost.opclass import ELEMENTWISE

    expect = cost.bytes / (dev.hbm_bandwidth_gbytes_per_s * 1e3 * dev.memory_eff(ELEMENTWISE))
    assert dev.op_time_us(cost) == pytest.approx(max(expect, dev.kernel_floor_us))


def test_foreach_bytes_follow_the_schema():
    """In place: the lists it writes are read and written; out of place: its results are written; a scalar
    tensor operand is read once."""
    sh = [(256, 256)] * 3
    mul = op_cost("aten._foreach_mul_.Tensor", sh + [()], "f32", [], [], _sizes(3))
    assert mul.bytes == 3 * 256 * 256 * 4 * 2 + 4
    sqrt = op_cost("aten._foreach_sqrt.default", sh, "f32", sh, "f32", _sizes(3))
    assert sqrt.bytes == 3 * 256 * 256 * 4 * 2
    addcdiv = op_cost("aten._foreach_addcdiv_.ScalarList", sh * 3, "f32", [], [], _sizes(3, 3, 3))
    assert addcdiv.bytes == 3 * 256 * 256 * 4 * 4
    norm = op_cost("aten._foreach_norm.Scalar", sh, "f32", [()] * 3, "f32", _sizes(3))
    assert len(norm.kernel_shares) == 2  # the norms' cleanup kernel after the partial sums


def test_list_sizes_required():
    with pytest.raises(FlintError, match="list_sizes"):
        op_cost("aten._foreach_mul_.Scalar", [(4,), (4,)], "f32", [], [], {})


def test_plan_field_validated_and_named():
    plan = Plan.from_dict({"dp_shard": 4, "optimizer_impl": "fused"})
    assert "fused AdamW" in plan.describe() and Plan.from_dict(plan.to_dict()) == plan
    assert Plan().optimizer_impl == "for-loop" and "AdamW" not in Plan().describe()
    with pytest.raises(PlanError, match="unknown form 'apex'") as e:
        Plan.from_dict({"optimizer_impl": "apex"})
    assert e.value.field == "optimizer_impl"


# ----------------------------------------------------------------------------- the real torch form

class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 8, bias=False)


def _names(graph) -> list[str]:
    """The ATen op names of a captured graph's nodes, in order."""
    return [n.target._opname for n in graph.nodes() if isinstance(n.target, torch._ops.OpOverload)]


def _multi_ops(names) -> list[str]:
    return [n.removeprefix("aten::") for n in names if n.removeprefix("aten::").startswith(MULTI)]


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_captured_form_is_the_one_torch_runs(impl):
    """The multi-tensor ops of Flint's captured optimizer (and clipping) are those eager torch runs, in order:
    torch.optim.AdamW and clip_grad_norm_ on real CPU tensors under the profiler. The foreach form's first op
    in torch increments the step counts, which eager torch keeps on the host: Flint leaves it out."""
    from torch.profiler import profile

    from flint.capture.step import _capture_norm, _capture_optimizer

    torch.manual_seed(0)
    model = _Two()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            foreach=impl == "foreach", fused=impl == "fused")
    model.b(model.a(torch.randn(4, 16))).sum().backward()
    with profile() as prof:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
    events = sorted((e for e in prof.events() if e.cpu_parent is None or not
                     e.cpu_parent.name.removeprefix("aten::").startswith(MULTI)), key=lambda e: e.time_range.start)
    real = _multi_ops(e.name for e in events)

    with torch.device("meta"):
        held = [nn.Parameter(torch.empty_like(p, device="meta")) for p in model.parameters()]
    norm = _capture_norm(held, {}, impl)
    optim = _capture_optimizer(held, {}, clip=True, impl=impl)
    ours = _multi_ops(name for g in (norm, optim) for name in _names(g))
    host = ["_foreach_add_"] if impl == "foreach" else []
    assert ours[:2] == ["_foreach_norm", "_foreach_mul_"] and len(ours) > 2  # the clip's, then AdamW's
    assert real == ours[:2] + host + ours[2:]
    steps = [r for r in optim.roles.values() if r.kind == "step"]
    assert len(steps) == (len(held) if impl == "fused" else 0)
    assert not [n for n in optim.gm.graph.nodes if n.op == "get_attr"]  # no host constants left


# ----------------------------------------------------------------------------- captured steps

@cache
def captured(impl: str, **fields):
    """llama-tiny (2 layers) with gradient clipping under ``optimizer_impl = impl``, two sequences per rank."""
    from flint.importer import import_step

    plan = Plan.from_dict({"dp_shard": 2, "max_norm": 1.0, "optimizer_impl": impl, **fields})
    batch = (2 * plan.dp_shard, SEQ)
    dtype = "bfloat16" if "master_dtype" in fields else None  # masters are for a bf16 model
    step = capture_step(factory("llama-tiny"), {"tokens": batch, "labels": batch}, plan=plan, dtype=dtype)
    return step, import_step(step)


def _targets(graph) -> Counter:
    return Counter(_names(graph))


def _estimate(module):
    from xdsl.context import Context

    from flint.chakra.from_ir import mesh_of, trace_from_ir
    from flint.cost import load_network
    from flint.passes.lower_to_chakra import LowerToChakraPass
    from flint.sim import simulate
    from flint.sim.breakdown import compute_breakdown
    from flint.sim.lifetimes import step_memory

    module = module.clone()
    memory = step_memory(module).report
    LowerToChakraPass(device="h100-sxm", class_times=True).apply(Context(), module)
    result = simulate(trace_from_ir(module), load_device("h100-sxm"), load_network("dgx-h100"), mesh_of(module))
    return result.iteration_time_us, memory, compute_breakdown(module)


@pytest.mark.slow
def test_each_part_steps_with_multi_tensor_ops():
    """foreach: only multi-tensor ops in each part's optimizer (the scaling one _foreach_mul_); fused: the step
    counts' _foreach_add_ and one _fused_adamw_; for-loop: per-parameter kernels. Forward and backward are
    the same programs."""
    loop, foreach, fused = (captured(i)[0] for i in ("for-loop", "foreach", "fused"))
    for a, b, c in zip(loop.parts, foreach.parts, fused.parts):
        n = len([r for r in a.optim.roles.values() if r.kind == "parameter"])
        assert _targets(b.optim) == Counter({"_foreach_mul_": 3, "_foreach_lerp_": 1, "_foreach_addcmul_": 1,
                                             "_foreach_sqrt": 1, "_foreach_div_": 1, "_foreach_add_": 1,
                                             "_foreach_addcdiv_": 1})
        assert _targets(c.optim) == Counter({"_foreach_mul_": 1, "_foreach_add_": 1, "_fused_adamw_": 1})
        assert _targets(a.optim)["mul_"] >= 2 * n and not any(t.startswith(MULTI) for t in _targets(a.optim))
        assert _targets(b.norm)["_foreach_norm"] == 1 and _targets(a.norm)["linalg_vector_norm"] == n + 1
        assert _targets(a.fwd) == _targets(b.fwd) == _targets(c.fwd)
        assert _targets(a.bwd) == _targets(b.bwd) == _targets(c.bwd)


@pytest.mark.slow
def test_time_and_memory_of_each_form():
    """The multi-tensor forms take far fewer kernels and less time than the for-loop; foreach holds all of a
    part's sqrt(exp_avg_sq) temporaries at once (one list), fused none; the step's other costs are equal."""
    (t_loop, m_loop, b_loop), (t_each, m_each, b_each), (t_fused, m_fused, b_fused) = (
        _estimate(captured(i)[1]) for i in ("for-loop", "foreach", "fused"))
    assert t_fused < t_each < t_loop
    assert "multi-tensor" not in b_loop.kernels
    assert b_fused.kernels["multi-tensor"] < b_each.kernels["multi-tensor"] < \
        b_loop.kernels["elementwise"] - b_each.kernels["elementwise"]
    for cls in ("gemm", "attention", "memory"):
        assert b_loop.time_us.get(cls) == pytest.approx(b_each.time_us.get(cls))
    assert b_loop.kernels["reduction"] > b_each.kernels["reduction"]  # the clip's norm per gradient
    step, module = captured("foreach")
    sq = max(sum(r.local_shape and torch.Size(r.local_shape).numel() * r.dtype.itemsize
                 for r in p.optim.roles.values() if r.kind == "exp_avg_sq") for p in step.parts)
    assert m_each.category_peak_bytes["other"] >= sq > m_loop.category_peak_bytes["other"]
    assert m_fused.category_peak_bytes["other"] <= m_loop.category_peak_bytes["other"]


@pytest.mark.slow
def test_master_copies_are_copied_back_with_one_foreach_copy():
    step, _ = captured("fused", master_dtype="float32")
    for part in step.parts:
        t = _targets(part.optim)
        assert t["_foreach_copy_"] == 1 and t["_fused_adamw_"] == 1 and "copy_" not in t
        masters = [r for r in part.optim.roles.values() if r.kind == "master"]
        assert masters and all(r.dtype == torch.float32 for r in masters)


@pytest.mark.slow
def test_pipeline_ranks_step_their_parts_and_traces_are_deterministic():
    """Under pp each pipeline rank steps its own parts' optimizers in the multi-tensor form; the step is
    estimated, and its Chakra traces are the same bytes twice."""
    import tempfile
    from pathlib import Path

    from xdsl.context import Context

    from flint.chakra.from_ir import trace_from_ir
    from flint.chakra.writer import write_trace
    from flint.ir.aten import get_schedule_entries
    from flint.passes.lower_to_chakra import LowerToChakraPass

    step, module = captured("foreach", pp=2, microbatches=2)
    for rank, held in ((0, ["embed", "block"]), (1, ["block", "head"])):
        names = [name for name, _, _ in get_schedule_entries(module, rank)]
        assert names[-len(held):] == [f"{p}_optim" for p in held]
    assert all(_targets(p.optim)["_foreach_addcdiv_"] == 1 for p in step.parts)
    t, memory, _ = _estimate(module)
    assert t > 0 and memory.peak_bytes > 0
    lowered = module.clone()
    LowerToChakraPass(device="h100-sxm").apply(Context(), lowered)
    with tempfile.TemporaryDirectory() as d:
        files = []
        for i in range(2):
            write_trace(trace_from_ir(lowered), Path(d) / str(i))
            files.append({f.name: f.read_bytes() for f in sorted((Path(d) / str(i)).iterdir())})
        assert files[0] == files[1] and len(files[0]) > 2


@cache
def single_device(impl: str, max_norm: float = 0.0):
    """llama-tiny on one device (the planned path's input) under ``optimizer_impl = impl``, the global batch of
    ``captured`` at dp_shard 2."""
    from flint.importer import import_step

    batch = (4, SEQ)
    return import_step(capture_step(factory("llama-tiny"), {"tokens": batch, "labels": batch},
                                    plan=Plan.from_dict({"optimizer_impl": impl, "max_norm": max_norm})))


def _optimizer_ops(module) -> dict[str, list[tuple[str, list]]]:
    """Per optimizer and gradient-norm function: its multi-tensor ops with their operand and result types."""
    from xdsl.dialects import func

    from flint.ir.aten import AtenOp

    return {fn.sym_name.data: [(op.overload, [str(v.type) for v in (*op.operands, *op.results)])
                               for op in fn.walk() if isinstance(op, AtenOp) and op.overload.startswith(
                                   tuple(f"aten.{m}" for m in MULTI))]
            for fn in module.ops if isinstance(fn, func.FuncOp) and fn.sym_name.data.endswith(("_optim", "_norm"))}


@pytest.mark.slow
@pytest.mark.parametrize("impl,max_norm,sp", [("foreach", 0.0, False), ("fused", 0.0, False),
                                               ("foreach", 1.0, False), ("fused", 1.0, True)])
def test_planned_path_expands_the_form_as_the_capture_has_it(impl, max_norm, sp):
    """A single-device capture in a multi-tensor form, expanded by shard-expand (flint explore's planned path) to
    FSDP 2 x TP 2, runs the direct capture's multi-tensor ops on the same local shapes, with the same optimizer
    memory, multi-tensor time and launches; the plan it records names the form. With clipping, each part's
    _foreach_norm takes its local gradient shards and the scaling is one _foreach_mul_, as captured; with
    sequence parallelism that scaling takes the norm weights' gradients still partial over tp (linear), as the
    captured step scales them before reducing them."""
    from flint.explore.stages import expand_stage
    from flint.plan import plan_of

    plan = Plan.from_dict({"dp_shard": 2, "tp": 2, "sp": sp, "optimizer_impl": impl, "max_norm": max_norm})
    expanded = expand_stage(single_device(impl, max_norm), plan)
    direct = captured(impl, max_norm=max_norm, tp=2, sp=sp)[1]
    ops = _optimizer_ops(expanded)
    assert ops == _optimizer_ops(direct) and all(ops.values())
    assert plan_of(expanded).optimizer_impl == impl
    (t_planned, m_planned, b_planned), (t_direct, m_direct, b_direct) = (_estimate(m) for m in (expanded, direct))
    assert m_planned.category_peak_bytes["optimizer"] == m_direct.category_peak_bytes["optimizer"]
    assert b_planned.kernels["multi-tensor"] == b_direct.kernels["multi-tensor"] > 0
    assert b_planned.time_us["multi-tensor"] == pytest.approx(b_direct.time_us["multi-tensor"])


@pytest.mark.slow
def test_planned_path_zero1_gathers_the_stepped_shards():
    """ZeRO-1 (DDP + ZeroRedundancyOptimizer): each rank steps its shard with the multi-tensor ops, which update
    it in place (no result), and the updated shards are all-gathered back into the whole parameters: the same
    collectives as the for-loop form's."""
    from xdsl.dialects import func

    from flint.explore.stages import expand_stage
    from flint.ir import dist

    def gathers(impl):
        module = expand_stage(single_device(impl), Plan.from_dict({"dp_shard": 2, "zero": 1, "optimizer_impl": impl}))
        return {fn.sym_name.data: [str(op.results[0].type) for op in fn.walk() if isinstance(op, dist.AllGatherOp)]
                for fn in module.ops if isinstance(fn, func.FuncOp) and fn.sym_name.data.endswith(("_optim", "_norm"))}

    loop = gathers("for-loop")
    assert all(loop.values()) and gathers("foreach") == gathers("fused") == loop


def test_planned_path_refuses_an_in_place_write_into_a_resharded_copy():
    """Under ZeRO-1 the gradients are whole and the Adam state sharded: a multi-tensor op writing the gradients
    in place, with the state at the same indices, would need them sliced, and the write would land on the slice.
    shard-expand refuses it, naming the op, the list and the layouts."""
    from pathlib import Path

    from xdsl.context import Context
    from xdsl.parser import Parser

    from flint.ir import flint_context
    from flint.passes.shard_annotate import ShardAnnotatePass
    from flint.passes.shard_expand import ShardExpandPass
    from flint.sharding.engine import ExpandError

    text = (Path(__file__).parents[1] / "lit_tests/passes/shard-expand-multi-tensor.mlir").read_text()
    scale = 'aten.op "aten._foreach_mul_.Scalar"(%p1, %p2)'
    assert scale in text
    text = text.replace(scale, 'aten.op "aten._foreach_mul_.List"(%g1, %g2, %m1, %m2)').replace(
        ': (tensor<32x16xf32>, tensor<16x32xf32>) -> ()\n    aten.op "aten._foreach_lerp_',
        ': (tensor<32x16xbf16>, tensor<16x32xbf16>, tensor<32x16xf32>, tensor<16x32xf32>) -> ()\n    aten.op '
        '"aten._foreach_lerp_', 1).replace("args = {scalar = 9.999700e-01 : f64, list_sizes = [2 : i64]}",
                                            "args = {list_sizes = [2 : i64, 2 : i64]}", 1)
    module = Parser(flint_context(), text).parse_module()
    ShardAnnotatePass(dp_shard=2, zero=1).apply(Context(), module)
    with pytest.raises(ExpandError, match=r"_foreach_mul_.List.*writes tensor 0 of list 'self' in place"):
        ShardExpandPass().apply(Context(), module)


@pytest.mark.slow
def test_planned_path_refuses_a_form_the_program_does_not_run():
    """A plan naming another form than the single-device program's is refused with the field named; a plan
    leaving it unset takes the program's. flint explore captures a planned point's single-device program in the
    point's form (a cache key of its own)."""
    from flint.explore.stages import Workload, expand_stage
    from flint.plan import plan_of

    with pytest.raises(PlanError, match="'foreach': the program's optimizer runs the fused form") as e:
        expand_stage(single_device("fused"), Plan.from_dict({"dp_shard": 2, "optimizer_impl": "foreach"}))
    assert e.value.field == "optimizer_impl"
    assert plan_of(expand_stage(single_device("fused"), Plan.from_dict({"dp_shard": 2}))).optimizer_impl == "fused"
    base = {"workload.model": "llama-tiny", "workload.world_size": 2, "workload.seq_len": SEQ,
            "workload.global_batch": 4, "workload.plan.dp_shard": -1}
    plain, fused = Workload.of(base), Workload.of({**base, "workload.plan.optimizer_impl": "fused"})
    assert fused.planned_refusal() is None and fused.single_key != plain.single_key
    assert fused.single_inputs()["plan"] == {"world_size": 1, "optimizer_impl": "fused"}


@pytest.mark.slow
def test_estimate_names_the_optimizers_form(tmp_path, capsys):
    """flint estimate's header says which AdamW form the IR runs (the default's line points at the plan field);
    IR without an optimizer gets no line."""
    import json

    from test_sim_lifetimes import fwd_bwd

    from flint.sim.cli import estimate_main

    def report(module_text: str, *extra: str) -> tuple[dict, str]:
        ir = tmp_path / "step.mlir"
        ir.write_text(module_text)
        assert estimate_main([str(ir), "--json", *extra]) == 0
        data = json.loads(capsys.readouterr().out)
        assert estimate_main([str(ir), *extra]) == 0
        return data, capsys.readouterr().out

    for impl, start in (("for-loop", "kernels per parameter (AdamW's for-loop form"), ("foreach", "AdamW foreach"),
                        ("fused", "AdamW fused")):
        data, text = report(str(captured(impl)[1]))
        assert data["optimizer"].startswith(start) and f"  optimizer: {start}" in text
    assert "optimizer_impl" in report(str(captured("for-loop")[1]))[0]["optimizer"]
    assert "optimizer" not in report(fwd_bwd(2), "--network", "ring")[0]
