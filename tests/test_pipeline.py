"""Pipeline parallelism and microbatching: torch's schedule order, bubble, memory, send/recv, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from xdsl.context import Context
from xdsl.parser import Parser

from flint.chakra.from_ir import trace_from_ir
from flint.errors import FlintError
from flint.ir import flint_context
from flint.ir.aten import get_schedule, get_schedule_entries
from flint.passes.lower_to_chakra import LowerToChakraPass
from flint.passes.pipeline_split import PipelineSplitPass
from flint.pipeline import rank_actions
from flint.plan import Plan, PlanError
from flint.trace import NodeKind

# A step of uniform stages: the block is one 4096^3 GEMM on its weight forward and two backward;
# the stage-boundary tensor and embed / head are tiny (negligible communication and edge work).
A = "tensor<4096x4096xbf16>"
T = "tensor<4x4xbf16>"


def _module(pp: int, layers: int, dp: int = 1) -> str:
    shape = "x".join(str(n) for n in (pp, dp) if n > 1) or "1"
    names = ", ".join(f'"{n}"' for n, s in (("pp", pp), ("dp_shard", dp)) if s > 1) or '"dp_shard"'
    sched = ", ".join(f'["{n}", {c}]' for n, c in (("embed_fwd", 1), ("block_fwd", layers), ("head_fwd", 1),
                                                   ("head_bwd", 1), ("block_bwd", layers), ("embed_bwd", 1),
                                                   ("block_optim", layers)))
    act = '{flint.role = "activation"}'
    par = '{flint.role = "parameter"}'
    relu = f'aten.op "aten.relu.default"'
    return f"""builtin.module attributes {{flint.schedule = [{sched}]}} {{
  shard.grid @mesh(shape = {shape}) {{flint.axis_names = [{names}]}}
  func.func @embed_fwd(%t: {T} {{flint.role = "input"}}) -> {T} {{
    %y = {relu}(%t) : ({T}) -> {T}
    func.return %y : {T}
  }}
  func.func @block_fwd(%x: {T} {act}, %w: {A} {par}) -> ({T}, {A}, {A}) {{
    %y = aten.op "aten.mm.default"(%w, %w) : ({A}, {A}) -> {A}
    %o = {relu}(%x) : ({T}) -> {T}
    func.return %o, %w, %y : {T}, {A}, {A}
  }}
  func.func @head_fwd(%x: {T} {act}, %t: {T} {{flint.role = "input"}}) -> {T} {{
    %y = {relu}(%x) : ({T}) -> {T}
    func.return %y : {T}
  }}
  func.func @head_bwd(%t: {T} {{flint.role = "tangent"}}) -> {T} {{
    %y = {relu}(%t) : ({T}) -> {T}
    func.return %y : {T}
  }}
  func.func @block_bwd(%w: {A} {par}, %y: {A} {{flint.role = "saved"}}, %g: {T} {{flint.role = "tangent"}}) -> ({T}, {A}) {{
    %a = aten.op "aten.mm.default"(%y, %w) : ({A}, {A}) -> {A}
    %dw = aten.op "aten.mm.default"(%w, %a) : ({A}, {A}) -> {A}
    %dx = {relu}(%g) : ({T}) -> {T}
    func.return %dx, %dw : {T}, {A}
  }}
  func.func @embed_bwd(%g: {T} {{flint.role = "tangent"}}) {{
    %y = {relu}(%g) : ({T}) -> {T}
    func.return
  }}
  func.func @block_optim(%w: {A} {par}, %g: {A} {{flint.role = "gradient"}}) {{
    func.return
  }}
}}"""


def _split(pp: int, layers: int, **options):
    module = Parser(flint_context(), _module(pp, layers)).parse_module()
    PipelineSplitPass(stages=pp, **options).apply(Context(), module)
    module.verify()
    return module


def _simulate(module):
    from flint.cost import load_device
    from flint.cost.network import load_network
    from flint.sim import simulate

    LowerToChakraPass(device="h100-sxm").apply(Context(), module)
    module.verify()
    trace = trace_from_ir(module)
    return trace, simulate(trace, load_device("h100-sxm"), load_network("dgx-h100"), None)


def _bubble(result) -> float:
    return float(np.mean(1.0 - result.compute_busy_us / result.iteration_time_us))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 4), (4, 8), (8, 16)])
def test_bubble_fraction_matches_theory(schedule, pp, m):
    _, result = _simulate(_split(pp, 2 * pp, schedule=schedule, microbatches=m))
    ideal = (pp - 1) / (m + pp - 1)
    assert _bubble(result) == pytest.approx(ideal, abs=0.01)


@pytest.mark.parametrize("pp,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4)])
def test_interleaving_shrinks_the_bubble_by_v(pp, m, v):
    _, flat = _simulate(_split(pp, 4 * pp, schedule="1f1b", microbatches=m))
    _, inter = _simulate(_split(pp, 4 * pp, schedule="interleaved-1f1b", microbatches=m, virtual=v))
    ideal = (pp - 1) / (v * m + pp - 1)
    assert _bubble(inter) == pytest.approx(ideal, abs=0.01)
    assert _bubble(inter) < _bubble(flat)


def _torch_compute_order(schedule: str, pp: int, m: int, v: int) -> list[list[str]]:
    """The compute order straight from torch: the visualizer's entry point for multi-stage schedules,
    pipeline_order for GPipe (1F1B's pipeline_order is broken in torch 2.13, see flint.pipeline)."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    name = {"gpipe": "GPipe", "interleaved-1f1b": "Interleaved1F1B"}[schedule]
    ops = get_schedule_ops(name, pp, m, v if v > 1 else None)
    return [[str(a) for a in rank if a is not None and a.computation_type.value in ("F", "B", "I", "W")]
            for rank in ops]


@pytest.mark.parametrize("schedule,pp,m,v", [("gpipe", 2, 3, 1), ("gpipe", 4, 8, 1), ("interleaved-1f1b", 2, 4, 2),
                                             ("interleaved-1f1b", 4, 8, 2), ("interleaved-1f1b", 2, 6, 3)])
def test_action_order_equals_torch(schedule, pp, m, v):
    ours = [[str(a) for a in acts if a.kind in ("F", "B", "I", "W")] for acts in rank_actions(schedule, pp, m, v)]
    assert ours == _torch_compute_order(schedule, pp, m, v)


@pytest.mark.parametrize("schedule,pp,m,v", [("gpipe", 2, 4, 1), ("1f1b", 4, 6, 1), ("interleaved-1f1b", 2, 4, 2)])
def test_ir_schedule_follows_the_actions(schedule, pp, m, v):
    """Each rank's IR schedule runs block_fwd / block_bwd exactly in the order of torch's F / B actions."""
    module = _split(pp, 2 * pp * v, schedule=schedule, microbatches=m, virtual=v)
    for rank, acts in enumerate(rank_actions(schedule, pp, m, v)):
        kinds = [n.split("_")[1][0].upper() for n, _ in get_schedule(module, rank) if n.startswith("block_") and
                 not n.endswith("optim")]
        assert kinds == [a.kind for a in acts if a.kind in ("F", "B")]


@pytest.mark.parametrize("schedule,pp,m,v", [("gpipe", 4, 4, 1), ("1f1b", 4, 8, 1), ("interleaved-1f1b", 4, 8, 2)])
def test_every_send_has_one_recv_and_every_rank_finishes(schedule, pp, m, v):
    trace, result = _simulate(_split(pp, 2 * pp * v, schedule=schedule, microbatches=m, virtual=v))
    sends, recvs = _p2p(trace)
    assert sends and sorted(sends) == sorted(recvs)
    assert len(set(sends)) == len(sends)  # tags unique per microbatch
    assert np.all(np.isfinite(result.finish_us)) and len(result.finish_us) == pp
    roles = {id(p.table) for p in trace.ranks}
    assert len(roles) == pp  # one program per pipeline rank


def _p2p(trace) -> tuple[list, list]:
    """(src, dst, tag, bytes) of every send and of every recv."""
    sends, recvs = [], []
    for r, prog in enumerate(trace.ranks):
        t, peers = prog.table, prog.peers()
        for row in np.nonzero((t.kind == NodeKind.SEND) | (t.kind == NodeKind.RECV))[0]:
            key = (int(t.comm_tag[row]), int(t.comm_bytes[row]))
            if t.kind[row] == NodeKind.SEND:
                sends.append((r, int(peers[row]), *key))
            else:
                recvs.append((int(peers[row]), r, *key))
    return sends, recvs


def test_first_stage_memory_1f1b_vs_gpipe():
    from flint.sim.lifetimes import step_memory

    pp, m = 4, 16
    mem = {s: step_memory(_split(pp, pp, schedule=s, microbatches=m), None, 0).report.category_peak_bytes["activations"]
           for s in ("gpipe", "1f1b")}
    saved = 4096 * 4096 * 2  # one microbatch's saved GEMM result
    # the first stage holds p (1F1B) or m (GPipe) microbatches' saved activations, plus one
    # backward's transient GEMM output
    assert mem["1f1b"] == (pp + 1) * saved
    assert mem["gpipe"] == (m + 1) * saved
    assert (mem["gpipe"] - saved) / (mem["1f1b"] - saved) == m / pp


def test_gradient_sync_once_per_step():
    module = Parser(flint_context(), _module(1, 2)).parse_module()
    PipelineSplitPass(stages=1, microbatches=4, dp_axes="dp_shard").apply(Context(), module)
    entries = [e for e in get_schedule_entries(module) if e[0] == "block_bwd"]
    assert [bool(o.get("nosync")) for _, _, o in entries] == [True, True, True, False]
    module = Parser(flint_context(), _module(1, 2)).parse_module()
    PipelineSplitPass(stages=1, microbatches=4, grad_sync="microbatch", dp_axes="dp_shard").apply(Context(), module)
    assert not any(o.get("nosync") for n, _, o in get_schedule_entries(module))


_FSDP_STEP = """builtin.module attributes {flint.schedule = [["block_fwd", 4], ["block_bwd", 4], ["block_optim", 4]]} {
  shard.grid @mesh(shape = 2) {flint.axis_names = ["dp_shard"]}
  func.func @block_fwd(%x: tensor<2x8x16xbf16> {flint.role = "activation"}, %w: tensor<8x16xbf16> {flint.role = "parameter"}) -> tensor<2x8x16xbf16> {
    %g = dist.all_gather %w on @mesh grid_axes = [0] gather_dim = 0 : tensor<8x16xbf16> -> tensor<16x16xbf16>
    %y = aten.op "aten.matmul.default"(%x, %g) : (tensor<2x8x16xbf16>, tensor<16x16xbf16>) -> tensor<2x8x16xbf16>
    func.return %y : tensor<2x8x16xbf16>
  }
  func.func @block_bwd(%w: tensor<8x16xbf16> {flint.role = "parameter"}, %t: tensor<2x8x16xbf16> {flint.role = "tangent"}) -> (tensor<2x8x16xbf16>, tensor<8x16xbf16>) {
    %g = dist.all_gather %w on @mesh grid_axes = [0] gather_dim = 0 : tensor<8x16xbf16> -> tensor<16x16xbf16>
    %dx = aten.op "aten.matmul.default"(%t, %g) : (tensor<2x8x16xbf16>, tensor<16x16xbf16>) -> tensor<2x8x16xbf16>
    %dw = aten.op "aten.mm.default"(%g, %g) : (tensor<16x16xbf16>, tensor<16x16xbf16>) -> tensor<16x16xbf16>
    %rs = dist.reduce_scatter %dw on @mesh grid_axes = [0] scatter_dim = 0 : tensor<16x16xbf16> -> tensor<8x16xbf16>
    func.return %dx, %rs : tensor<2x8x16xbf16>, tensor<8x16xbf16>
  }
  func.func @block_optim(%w: tensor<8x16xbf16> {flint.role = "parameter"}, %g: tensor<8x16xbf16> {flint.role = "gradient"}) {
    func.return
  }
}"""


def test_accumulation_without_sync_holds_unsharded_gradients():
    """FSDP2 with set_requires_gradient_sync(False) keeps each microbatch's gradient unsharded and
    accumulates into it until the last microbatch reduce-scatters: the memory model follows the
    schedule's nosync entries (4 layers: 4 x 512 B unsharded against 4 x 256 B sharded)."""
    from flint.sim.lifetimes import step_memory

    def grads(m: int, sync: str) -> int:
        module = Parser(flint_context(), _FSDP_STEP).parse_module()
        PipelineSplitPass(stages=1, microbatches=m, grad_sync=sync, dp_axes="dp_shard").apply(Context(), module)
        return step_memory(module, None, 0).report.category_peak_bytes["grads"]

    unsharded, sharded = 16 * 16 * 2, 8 * 16 * 2
    assert grads(1, "step") == 4 * sharded  # one microbatch: it syncs
    assert grads(4, "step") >= 4 * unsharded  # accumulated unsharded over microbatches 0..2
    assert grads(4, "microbatch") < 4 * unsharded  # reduce-scattered every microbatch
    assert grads(4, "microbatch") >= 4 * sharded


@pytest.mark.parametrize("fields,field", [
    ({"pp": 4, "microbatches": 8, "pp_schedule": "pipedream"}, "pp_schedule"),
    ({"pp": 4, "microbatches": 6, "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 2}, "microbatches"),
    ({"pp": 4, "microbatches": 8, "pp_schedule": "interleaved-1f1b"}, "pp_virtual_stages"),
    ({"pp": 4, "microbatches": 8, "pp_schedule": "zbv-zero-bubble", "pp_virtual_stages": 3}, "pp_virtual_stages"),
    ({"pp": 4, "microbatches": 2, "pp_schedule": "1f1b"}, "microbatches"),
])
def test_plan_rejects_bad_pipelines(fields, field):
    from flint.pipeline.schedules import check

    with pytest.raises(PlanError) as e:
        p = Plan.from_dict(fields)
        check(p.pp_schedule, p.pp, p.microbatches, p.pp_virtual_stages)
    assert e.value.field == field
    if field == "pp_schedule":
        assert "gpipe" in str(e.value) and "interleaved-1f1b" in str(e.value)


def test_model_checks_name_the_field():
    plan = Plan.from_dict({"pp": 4, "microbatches": 4})
    with pytest.raises(PlanError, match="pp"):
        plan.check_model(n_layers=2)
    with pytest.raises(PlanError, match="microbatches"):
        plan.check_model(local_batch=6)
    with pytest.raises(PlanError, match=r"4 pipeline stages \(stages \* virtual\) for 2 repeated blocks "
                                        r"\(@block_fwd runs 2 times\); a stage holds whole repeated blocks") as e:
        _split(4, 2, microbatches=4)
    assert e.value.field == "pp"


# --- zero-bubble: the backward split into input-gradient (I) and weight-gradient (W) parts ------------

def _zb_module(pp: int, layers: int) -> str:
    """Like _module, but F, I and W are one 4096^3 GEMM each (the zero-bubble papers' F = B = W):
    the input gradient reads the first backward GEMM (through a free view), dW the second."""
    text = _module(pp, layers)
    old_bwd = text[text.index("  func.func @block_bwd("):text.index("  func.func @embed_bwd(")]
    new_bwd = f"""  func.func @block_bwd(%w: {A} {{flint.role = "parameter"}}, %y: {A} {{flint.role = "saved"}}, %g: {T} {{flint.role = "tangent"}}) -> ({T}, {A}) {{
    %a = aten.op "aten.mm.default"(%y, %w) : ({A}, {A}) -> {A}
    %s = aten.op "aten.slice.Tensor"(%a) : ({A}) -> {T}
    %dx = aten.op "aten.add.Tensor"(%g, %s) : ({T}, {T}) -> {T}
    %dw = aten.op "aten.mm.default"(%a, %y) : ({A}, {A}) -> {A}
    func.return %dx, %dw : {T}, {A}
  }}
"""
    return text.replace(old_bwd, new_bwd)


def _zb_split(pp: int, layers: int, **options):
    module = Parser(flint_context(), _zb_module(pp, layers)).parse_module()
    PipelineSplitPass(stages=pp, **options).apply(Context(), module)
    module.verify()
    return module


def _work(module, names=None) -> tuple[int, int, dict]:
    """(FLOPs, bytes, {collective kind: (count, bytes)}) of the functions ``names`` (default: all)."""
    from xdsl.dialects import func

    from flint.cost import load_device
    from flint.ir import dist
    from flint.ir.aten import AtenOp
    from flint.passes.annotate_cost import aten_op_cost

    device = load_device("h100-sxm")
    flops = nbytes = 0
    colls: dict = {}
    for f in module.ops:
        if not isinstance(f, func.FuncOp) or (names is not None and f.sym_name.data not in names):
            continue
        for op in f.body.block.ops:
            if isinstance(op, AtenOp):
                fl, b, _ = aten_op_cost(op, device)
                flops, nbytes = flops + fl, nbytes + b
            elif isinstance(op, dist.CollectiveOp):
                n, b = colls.get((op.name, op.axes()), (0, 0))
                colls[(op.name, op.axes())] = (n + 1, b + int(str(op.input.type).count("x")))
    return flops, nbytes, colls


@pytest.mark.parametrize("schedule,pp,m", [("interleaved-zero-bubble", 2, 4), ("interleaved-zero-bubble", 4, 8),
                                           ("zbv-zero-bubble", 2, 4), ("zbv-zero-bubble", 4, 8)])
def test_zero_bubble_action_order_equals_torch(schedule, pp, m):
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    name = {"interleaved-zero-bubble": "InterleavedZeroBubble", "zbv-zero-bubble": "ZBVZeroBubble"}[schedule]
    theirs = [[str(a) for a in rank if a is not None and a.computation_type.value in ("F", "B", "I", "W")]
              for rank in get_schedule_ops(name, pp, m, 2)]
    ours = [[str(a) for a in acts if a.kind in ("F", "B", "I", "W")] for acts in rank_actions(schedule, pp, m, 2)]
    assert ours == theirs and any("W" in a for a in ours[0])


@pytest.mark.parametrize("schedule", ["interleaved-zero-bubble", "zbv-zero-bubble"])
def test_zero_bubble_ir_schedule_follows_the_actions(schedule):
    """F / I / W run block_fwd / block_bwd_input / block_bwd_weight in torch's order; the first stage's I
    does nothing and its W is the full backward (torch's backward_weight_one_chunk for stage 0)."""
    pp, m = 2, 4
    module = _zb_split(pp, 4 * pp, schedule=schedule, microbatches=m, virtual=2)
    fn = {"F": "block_fwd", "I": "block_bwd_input", "W": "block_bwd_weight"}
    for rank, acts in enumerate(rank_actions(schedule, pp, m, 2)):
        names = [n for n, _ in get_schedule(module, rank) if n.startswith("block_") and not n.endswith("optim")]
        want = [fn[a.kind] if a.stage != 0 or a.kind == "F" else "block_bwd" for a in acts
                if a.kind in ("F", "W") or a.kind == "I" and a.stage != 0]
        assert names == want


def test_backward_split_conserves_work_and_keeps_one_body():
    from xdsl.dialects import func

    module = _zb_split(4, 8, schedule="zbv-zero-bubble", microbatches=8, virtual=2)
    funcs = {f.sym_name.data: f for f in module.ops if isinstance(f, func.FuncOp)}
    assert funcs["block_bwd_input"].attributes["flint.backward_part"].data == "input"
    assert funcs["block_bwd_weight"].attributes["flint.backward_of"].data == "block_bwd"
    full = _work(module, {"block_bwd"})
    i, w = _work(module, {"block_bwd_input"}), _work(module, {"block_bwd_weight"})
    assert i[0] + w[0] == full[0] and i[0] == w[0] == 2 * 4096 ** 3
    # one body per role: the block's backward appears as exactly three functions, whatever pp and m
    assert sorted(n for n in funcs if n.startswith("block_bwd")) == ["block_bwd", "block_bwd_input", "block_bwd_weight"]


@pytest.mark.parametrize("schedule", ["interleaved-zero-bubble", "zbv-zero-bubble"])
def test_zero_bubble_beats_1f1b_and_every_rank_finishes(schedule):
    pp, m = 4, 8
    trace, result = _simulate(_zb_split(pp, 4 * pp, schedule=schedule, microbatches=m, virtual=2))
    flat_trace, flat = _simulate(_zb_split(pp, 4 * pp, schedule="1f1b", microbatches=m))
    assert np.all(np.isfinite(result.finish_us)) and len(result.finish_us) == pp
    assert _bubble(result) < 0.5 * _bubble(flat)
    # the same work in both: FLOPs over all ranks equal (the trace stores FLOPs as float32: rel 1e-9)
    assert sum(float(p.table.flops.sum()) for p in trace.ranks) == pytest.approx(
        sum(float(p.table.flops.sum()) for p in flat_trace.ranks), rel=1e-9)
    sends, recvs = _p2p(trace)
    assert sends and sorted(sends) == sorted(recvs) and len(set(sends)) == len(sends)


def test_zero_bubble_memory_keeps_what_w_reads_until_w():
    """The input part hands the intermediate gradient and the saved activation W reads to W (memory pairs
    W with its I, I with the forward); a W that reads no activation needs strictly less memory."""
    from flint.sim.lifetimes import step_memory

    def peak(text: str, role: int) -> tuple[int, tuple]:
        module = Parser(flint_context(), text).parse_module()
        PipelineSplitPass(stages=2, schedule="interleaved-zero-bubble", microbatches=4, virtual=2).apply(
            Context(), module)
        mem = step_memory(module, None, role)
        return mem.report.category_peak_bytes["activations"], mem.notes

    reads = _zb_module(2, 8)
    blind = reads.replace('%dw = aten.op "aten.mm.default"(%a, %y)', '%dw = aten.op "aten.mm.default"(%w, %w)')
    for role in (0, 1):
        with_w, notes = peak(reads, role)
        without, _ = peak(blind, role)
        assert not [n for n in notes if "block_bwd" in n]  # every I and W paired
        assert with_w > without


@pytest.mark.slow
def test_backward_split_of_a_captured_fsdp_tp_block():
    """A real llama block under FSDP x TP: I + W hold exactly the backward's FLOPs, bytes and collectives;
    the TP all-reduces of the input gradient and the FSDP re-gather are in I, the reduce-scatter in W."""
    from xdsl.dialects import func

    from flint.pipeline.backward_split import input_grad_results, split_backward
    from tests.captures import imported

    _, shared = imported("llama-tiny", "fsdp+tp", 8, 2)
    module = shared.clone()
    funcs = {f.sym_name.data: f for f in module.ops if isinstance(f, func.FuncOp)}
    for stem in ("block", "head"):
        fi, fw = split_backward(funcs[f"{stem}_bwd"], input_grad_results(funcs[f"{stem}_fwd"], funcs[f"{stem}_bwd"]))
        module.body.block.add_op(fi)
        module.body.block.add_op(fw)
        module.verify()
        full, i, w = (_work(module, {n}) for n in (f"{stem}_bwd", fi.sym_name.data, fw.sym_name.data))
        assert i[0] + w[0] == full[0] and i[1] + w[1] == full[1] and i[0] > 0 and w[0] > 0
        assert {k: i[2].get(k, (0, 0))[0] + w[2].get(k, (0, 0))[0] for k in full[2]} == {k: v[0] for k, v in full[2].items()}
        assert {k[0] for k in w[2]} == {"dist.reduce_scatter"}
        assert "dist.all_reduce" in {k[0] for k in i[2]} and "dist.reduce_scatter" not in {k[0] for k in i[2]}


def _trace_work(module) -> tuple[list, object]:
    """Per rank: (FLOPs, sorted (kind, collective type, bytes) of its communication nodes); the sim result."""
    trace, result = _simulate(module)
    out = []
    for p in trace.ranks:
        t = p.table
        comm = np.nonzero(t.kind != NodeKind.COMP)[0]
        out.append((int(t.flops[t.flops > 0].sum()),
                    sorted(zip(t.kind[comm].tolist(), t.comm_type[comm].tolist(), t.comm_bytes[comm].tolist()))))
    return out, result


@pytest.mark.slow
def test_captured_and_planned_pipelines_agree(tmp_path):
    """dp_shard 2 x tp 2 x pp 2, 1F1B over 4 microbatches, two ways: captured at world size 8 (two roles,
    the pipeline and the DP/TP collectives together, reduce-scatters once per step, every rank finishes),
    and planned (one single-device capture of ONE global microbatch, flint expand's shard-expand then
    pipeline-split): the same FLOPs and communication nodes on every rank."""
    import subprocess
    import sys

    from flint.ir.parse import load_ir
    from flint.passes.canonicalize_dist import CanonicalizeDistPass
    from flint.passes.shard_annotate import annotate, check_model
    from flint.passes.shard_expand import expand
    from flint.pipeline import split_by_plan
    from flint.sharding.rules import load_rules
    from tests.captures import SEQ, single_device

    # In a fresh process: a capture after another capture whose mesh has an equal sub-mesh can pick
    # up the earlier world's process-group name (test_stale_process_group_after_an_earlier_capture).
    plan_file, out = tmp_path / "plan.toml", tmp_path / "step.mlir"
    plan_file.write_text("dp_shard = 2\ntp = 2\npp = 2\nmicrobatches = 4\n")
    done = subprocess.run([sys.executable, "-m", "flint.tools.flint_cli", "capture", "--model", "llama-tiny",
                           "--world-size", "8", "--plan-file", str(plan_file), "--batch-size", "16",
                           "--seq-len", str(SEQ), "--dtype", "float32", "-o", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    module = load_ir(str(out))
    rs_per_run = sum(1 for f in module.ops if getattr(f, "sym_name", None) is not None
                     and f.sym_name.data == "block_bwd" for op in f.walk() if op.name == "dist.reduce_scatter")
    captured, result = _trace_work(module)
    trace, _ = _simulate(load_ir(str(out)))
    assert len({id(p.table) for p in trace.ranks}) == 2
    t = trace.ranks[0].table
    n_rs = int(np.sum((t.kind == NodeKind.COLL) & (t.comm_type == 7)))  # REDUCE_SCATTER
    # rank 0 holds 1 of the 2 blocks (+ embed): block reduce-scatters run in the last microbatch only
    assert rs_per_run > 0 and rs_per_run <= n_rs < 4 * rs_per_run
    assert np.all(np.isfinite(result.finish_us))

    # planned: the single-device step (float32, as tests.captures has it) of one global microbatch
    # (16 / 4 sequences), expanded as `flint expand` does
    plan = Plan.load(str(plan_file))
    _, single = single_device("llama-tiny", 4)
    planned = single.clone()
    CanonicalizeDistPass().apply(Context(), planned)
    check_model(planned, plan.replace(microbatches=1))
    rules = load_rules(None)
    annotate(planned, plan, rules)
    expand(planned, plan, rules)
    assert split_by_plan(planned, plan)
    planned.verify()
    work, planned_result = _trace_work(planned)
    assert np.all(np.isfinite(planned_result.finish_us)) and len(work) == 8
    from collections import Counter

    diff = {r: (work[r][0] - captured[r][0], Counter(work[r][1]) - Counter(captured[r][1]),
                Counter(captured[r][1]) - Counter(work[r][1])) for r in range(8) if work[r] != captured[r]}
    assert not diff, diff


@pytest.mark.slow
def test_no_stale_process_group_after_an_earlier_capture():
    """A capture after another whose mesh has an equal sub-mesh (tp over ranks [0, 1]) traces its
    collectives with its OWN world's process groups (DTensor's sharding caches are emptied between worlds)."""
    from flint.capture import capture_step, opclass
    from flint.models import factory
    from tests.captures import captured

    first = captured("llama-tiny", "fsdp+tp", 8, 2)
    plan = Plan.from_dict({"dp_shard": 2, "tp": 2, "pp": 2, "microbatches": 4})
    step = capture_step(factory("llama-tiny", n_layers=4), {"tokens": (8, 32), "labels": (8, 32)}, plan=plan)
    tp_group = next(name for name, axes in step.group_axes.items() if axes == (2,))
    assert tp_group not in first.group_axes  # the two worlds' tp groups have different names
    embed_groups = {opclass.collective_group(n) for n in step.part("embed").fwd.nodes()
                    if opclass.classify_aten(n.target) == opclass.ALL_REDUCE}
    assert embed_groups == {tp_group}  # the vocab-parallel embedding's all-reduce, on this world's tp group
