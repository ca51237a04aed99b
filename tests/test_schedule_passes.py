"""The scheduling passes on a captured FSDP step: invariants, lowering, simulation, memory, CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import TensorType

from flint.chakra.from_ir import trace_from_ir
from flint.cost import load_device, load_network, tensor_bytes
from flint.errors import FlintError
from flint.ir.aten import get_schedule, set_schedule
from flint.passes.canonicalize_dist import CanonicalizeDistPass
from flint.passes.lower_to_chakra import LowerToChakraPass
from flint.schedule.pipelines import DDP_PIPELINE, FSDP_PIPELINE, default_pipeline, run_pipeline
from flint.schedule.invariants import ScheduleInvariantError, check_schedule_invariants
from flint.sim import simulate
from flint.sim.lifetimes import step_memory
from tests.captures import imported

LAYERS = 5  # the block body is depth-independent: deepen the schedule instead of recapturing
PASSES = ["reorder-all-gather{prefetch=1}", "reorder-all-gather{prefetch=2}", "reorder-all-gather{prefetch=0}",
          "reorder-all-gather{prefetch=0 delay=true}", "sink-waits", "hoist-starts{max-in-flight=1}",
          "hoist-starts{max-in-flight=4}", "assign-streams", FSDP_PIPELINE]


def fsdp_step(layers: int = LAYERS):
    _, module = imported("llama-tiny", "fsdp", 4)
    m = module.clone()
    set_schedule(m, [(n, layers if n.startswith("block") else c) for n, c in get_schedule(m)])
    return m


def _lowered(module, fast: bool = True):
    m = module.clone()
    CanonicalizeDistPass().apply(Context(), m)
    LowerToChakraPass().apply(Context(), m)
    m.verify()
    return trace_from_ir(m, fast_repeat=fast)


def _estimate(module, spec: str):
    m = module.clone()
    run_pipeline(m, spec)
    mem = step_memory(m)
    res = simulate(_lowered(m), load_device("h100-sxm"), load_network("switch"))
    return res, mem


@pytest.mark.parametrize("spec", PASSES)
def test_passes_keep_the_invariants(spec):
    before = fsdp_step()
    after = before.clone()
    run_pipeline(after, spec)
    check_schedule_invariants(before, after)


def test_checker_catches_a_broken_reordering():
    """A wait moved above its start is named by the shared checker."""
    from flint.ir import dist

    before = fsdp_step()
    after = before.clone()
    run_pipeline(after, "reorder-all-gather{prefetch=1}")
    fn = next(f for f in after.ops if isinstance(f, func.FuncOp) and f.sym_name.data == "block_fwd")
    wait = next(o for o in fn.body.block.ops if isinstance(o, dist.WaitOp))
    wait.detach()
    fn.body.block.insert_op_before(wait, fn.body.block.first_op)
    with pytest.raises(ScheduleInvariantError):
        check_schedule_invariants(before, after)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["reorder-all-gather{prefetch=1}", "reorder-all-gather{prefetch=2}", FSDP_PIPELINE])
def test_prefetch_unrolls_the_same_fast_and_slow(spec):
    """The numpy replication of repeats (from the steady iteration) equals unrolling node by node."""
    m = fsdp_step()
    run_pipeline(m, spec)
    a, b = _lowered(m, True).ranks[0].table, _lowered(m, False).ranks[0].table
    assert len(a) == len(b)
    for col in ("kind", "comm_type", "comm_bytes", "data_dep_ptr", "data_dep_idx", "ctrl_dep_ptr", "ctrl_dep_idx"):
        assert np.array_equal(getattr(a, col), getattr(b, col)), col
    assert a.names == b.names
    if "assign-streams" in spec:
        assert np.array_equal(a.comm_stream, b.comm_stream) and a.stream_names == b.stream_names


def test_prefetch_issues_each_gather_once_k_blocks_ahead():
    """Every gather issued once (no extra for the iterations past the end), the same FLOPs and bytes."""
    base = _lowered(fsdp_step()).ranks[0].table
    for k in (1, 2):
        m = fsdp_step()
        run_pipeline(m, f"reorder-all-gather{{prefetch={k}}}")
        t = _lowered(m).ranks[0].table
        assert np.count_nonzero(t.comm_type == 2) == np.count_nonzero(base.comm_type == 2)
        assert t.flops[t.flops > 0].sum() == base.flops[base.flops > 0].sum()
        assert t.comm_bytes[t.kind == 7].sum() == base.comm_bytes[base.kind == 7].sum()


def test_default_pipeline_hides_communication_and_prefetch_costs_one_block():
    """Acceptance: exposed comm with the default pipeline < without passes; peak memory of prefetch=2 is
    above prefetch=1 by exactly one block's gathered parameters (computed from the shapes)."""
    m = fsdp_step()
    assert default_pipeline(m) == FSDP_PIPELINE
    none, _ = _estimate(m, "")
    default, _ = _estimate(m, FSDP_PIPELINE)
    assert default.exposed_comm_us.mean() < none.exposed_comm_us.mean()
    assert default.iteration_time_us < none.iteration_time_us

    _, mem1 = _estimate(m, "reorder-all-gather{prefetch=1}")
    _, mem2 = _estimate(m, "reorder-all-gather{prefetch=2}")
    fwd = next(f for f in m.ops if isinstance(f, func.FuncOp) and f.sym_name.data == "block_fwd")
    roles = [a.data.get("flint.role") for a in fwd.arg_attrs.data]
    dp = 4
    block_gathered = sum(dp * tensor_bytes(a.type.get_shape(), str(a.type.element_type))
                         for a, r in zip(fwd.body.block.args, roles)
                         if r is not None and r.data == "parameter" and isinstance(a.type, TensorType))
    assert block_gathered > 0
    assert mem2.peak_bytes - mem1.peak_bytes == block_gathered
    _, mem_delay = _estimate(m, "reorder-all-gather{prefetch=0 delay=true}")
    assert mem_delay.peak_bytes <= mem1.peak_bytes


def test_ddp_default_pipeline_buckets_and_keeps_the_bytes():
    """DDP's default pipeline (25 MiB buckets, waits sunk) runs on a captured DDP step: same bytes per
    group, every rank finishes, and the asynchronous gradient all-reduces are no longer all exposed."""
    _, module = imported("llama-tiny", "dp", 2)
    before = module.clone()
    set_schedule(before, [(n, LAYERS if n.startswith("block") else c) for n, c in get_schedule(before)])
    assert default_pipeline(before) == DDP_PIPELINE
    after = before.clone()
    run_pipeline(after, DDP_PIPELINE)
    check_schedule_invariants(before, after, same_bytes_per_group=True)
    none = simulate(_lowered(before), load_device("h100-sxm"), load_network("switch"))
    ddp = simulate(_lowered(after), load_device("h100-sxm"), load_network("switch"))
    assert np.all(np.isfinite(ddp.finish_us))
    assert ddp.exposed_comm_us.mean() <= none.exposed_comm_us.mean()


def test_streams_reach_the_simulator():
    m = fsdp_step()
    run_pipeline(m, FSDP_PIPELINE)
    res = simulate(_lowered(m), load_device("h100-sxm"), load_network("switch"))
    assert res.raw.plans[0].stream_names[4:] == ("all_gather", "reduce_scatter")
    assert math.isfinite(res.iteration_time_us)


@pytest.mark.slow
def test_emitted_traces_after_reordering_pass_inspect_and_do_not_deadlock(tmp_path, capsys):
    from flint.chakra import read_trace
    from flint.chakra.inspect import main as inspect_main
    from flint.tools.flint_cli import main as flint_main

    path = tmp_path / "step.mlir"
    path.write_text(str(fsdp_step()))
    for i, spec in enumerate(["reorder-all-gather{prefetch=2},sink-waits,assign-streams",
                              "reorder-all-gather{prefetch=0 delay=true}", "hoist-starts{max-in-flight=2}"]):
        out = tmp_path / f"t{i}"
        assert flint_main(["emit", str(path), "-o", str(out), "--passes", spec, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["passes"] == spec
        assert inspect_main([str(out / "trace")]) == 0, capsys.readouterr()
        capsys.readouterr()
        res = simulate(read_trace(out / "trace"), load_device("h100-sxm"), load_network("switch"), symmetric=False)
        assert math.isfinite(res.iteration_time_us)


@pytest.mark.slow
def test_estimate_cli_reports_the_pipeline(tmp_path, capsys):
    from flint.sim.cli import estimate_main

    path = tmp_path / "step.mlir"
    path.write_text(str(fsdp_step(3)))
    assert estimate_main([str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["passes"] == FSDP_PIPELINE
    assert estimate_main([str(path), "--json", "--passes", ""]) == 0
    assert json.loads(capsys.readouterr().out)["passes"] == ""


@pytest.mark.slow
def test_ir_scheduled_by_flint_opt_gets_no_default_pipeline_on_top(tmp_path, capsys):
    """flint-opt records a scheduling pipeline on the module (flint.scheduled_by); estimate and emit then run no
    default pipeline, whose reorder-all-gather{prefetch=1} would have moved the user's prefetch=2 gathers back
    (before: the file estimated exactly as the unscheduled step). A pipeline of no scheduling pass records
    nothing, and the default pipeline still runs after it."""
    from flint.schedule.pipelines import scheduled_by
    from flint.ir.parse import load_ir
    from flint.sim.cli import estimate_main
    from flint.tools.flint_cli import main as flint_main
    from flint.tools.flint_opt import main as opt_main

    step, mine, tidy = tmp_path / "step.mlir", tmp_path / "mine.mlir", tmp_path / "tidy.mlir"
    step.write_text(str(fsdp_step(3)))
    spec = "reorder-all-gather{prefetch=2}"
    assert opt_main([str(step), "-p", spec, "-o", str(mine)]) == 0
    assert opt_main([str(mine), "-p", "sink-waits", "-o", str(mine)]) == 0
    assert opt_main([str(step), "-p", "canonicalize-dist", "-o", str(tidy)]) == 0
    assert scheduled_by(load_ir(str(mine))) == f"{spec},sink-waits" and scheduled_by(load_ir(str(tidy))) is None

    def estimate(path, *extra):
        assert estimate_main([str(path), "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    base, own = estimate(step), estimate(mine)
    assert own["passes"] == "" and own["scheduled_by"] == f"{spec},sink-waits" and "scheduled_by" not in base
    assert own == {**estimate(step, "--passes", f"{spec},sink-waits"), "input": str(mine), "passes": "",
                   "scheduled_by": f"{spec},sink-waits"}
    assert own["iteration_time_us"] != base["iteration_time_us"]
    assert estimate(tidy)["passes"] == FSDP_PIPELINE
    assert estimate_main([str(mine)]) == 0
    assert f"scheduled by flint-opt before: {spec},sink-waits" in capsys.readouterr().out
    assert flint_main(["emit", str(mine), "-o", str(tmp_path / "t"), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["passes"] == "" and f"note: {mine} was scheduled by flint-opt -p '{spec},sink-waits'" in err


def test_which_pipelines_count_as_scheduling():
    """Flint's scheduling passes and plug-ins (passes Flint does not know) are recorded, on a module with a plan
    only (without one no default pipeline would run anyway); cost and cleanup passes are not."""
    from xdsl.dialects.builtin import ModuleOp

    from flint.passes.registry import FLINT_PASSES
    from flint.plan import Plan, attach
    from flint.schedule.pipelines import record_scheduling, scheduled_by

    builtin = set(FLINT_PASSES) | {"canonicalize", "cse", "dce"}
    for spec, want in [("fuse-pointwise,cse,canonicalize-dist", None), ("my-plugin{k=1}", "my-plugin{k=1}"),
                       ("annotate-cost,assign-streams", "annotate-cost,assign-streams"), ("", None)]:
        m = ModuleOp([])
        attach(m, Plan.from_dict({"dp_shard": 4}, world_size=4))
        record_scheduling(m, spec, builtin)
        assert scheduled_by(m) == want, spec
        assert default_pipeline(m) == ("" if want else FSDP_PIPELINE)
    bare = ModuleOp([])
    record_scheduling(bare, "sink-waits", builtin)
    assert scheduled_by(bare) is None


@pytest.mark.parametrize("spec, message", [
    ("reorder-all-gather{prefetch=-1}", "prefetch=-1 must be >= 0"),
    ("reorder-all-gather{prefetch=1 delay=true}", "delay=true needs prefetch=0"),
    ("hoist-starts{max-in-flight=0}", "max-in-flight=0 must be >= 1"),
    ("no-such-pass", "no-such-pass"),
])
def test_bad_options_are_clear_errors(tmp_path, capsys, spec, message):
    from flint.sim.cli import estimate_main

    path = tmp_path / "step.mlir"
    path.write_text(str(fsdp_step(2)))
    assert estimate_main([str(path), "--passes", spec]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


TP_ONLY = """
builtin.module {
  shard.grid @mesh(shape = 2)
  func.func @f(%x: tensor<8x64xbf16>, %w: tensor<64x32xbf16> {flint.role = "parameter"}) -> tensor<8x32xbf16> {
    %0 = aten.op "aten.mm.default"(%x, %w) phase = "fwd" : (tensor<8x64xbf16>, tensor<64x32xbf16>) -> tensor<8x32xbf16>
    %1 = dist.all_reduce %0 on @mesh grid_axes = [0] : tensor<8x32xbf16> -> !dist.future<tensor<8x32xbf16>>
    %2 = dist.wait %1 : tensor<8x32xbf16>
    func.return %2 : tensor<8x32xbf16>
  }
}
"""


def test_no_fsdp_gathers_says_so_and_changes_nothing(tmp_path, capsys):
    from flint.ir.parse import load_ir

    path = tmp_path / "tp.mlir"
    path.write_text(TP_ONLY)
    module = load_ir(str(path))
    m = module.clone()
    run_pipeline(m, "reorder-all-gather{prefetch=1}")
    assert "no FSDP parameter all-gather" in capsys.readouterr().err
    assert str(m) == str(module)


@pytest.mark.slow
def test_astra_sim_runs_reordered_traces_and_agrees(tmp_path, capsys):
    """The emitted order is valid for a consumer that serializes a rank's communication (ASTRA-sim):
    every rank finishes, and the iteration time matches Flint's simulator with SM sharing off (ASTRA-sim
    does not slow compute under communication); with it on (the device's ``comm_sms``) Flint's is longer."""
    from tests.chakra_helpers import ASTRA_SKIP_REASON, REAL_ASTRA_SIM
    from flint.sim.cli import simulate_main

    if REAL_ASTRA_SIM is None:
        pytest.skip(ASTRA_SKIP_REASON)
    path = tmp_path / "step.mlir"
    path.write_text(str(fsdp_step(4)))
    no_sharing = tmp_path / "no-sharing.toml"
    no_sharing.write_text("comm_sms = 0\n")
    spec = "reorder-all-gather{prefetch=2},sink-waits,assign-streams"
    common = [str(path), "--network", "switch", "--passes", spec, "--json"]
    assert simulate_main(common + ["--backend", "astra-sim", "--astra-sim", str(REAL_ASTRA_SIM)]) == 0
    astra = json.loads(capsys.readouterr().out)["iteration_time_us"]
    assert simulate_main(common + ["--calibration", str(no_sharing)]) == 0
    native = json.loads(capsys.readouterr().out)["iteration_time_us"]
    assert astra == pytest.approx(native, rel=0.01)
    assert simulate_main(common) == 0
    assert json.loads(capsys.readouterr().out)["iteration_time_us"] > native * 1.01
