"""`flint estimate` / `flint simulate --backend native` (flint.sim.cli), run in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flint.sim.cli import estimate_main, simulate_main

from test_sim_lifetimes import TRAIN, fwd_bwd

DATA = Path(__file__).parent / "data" / "chakra"


@pytest.fixture
def step_ir(tmp_path):
    p = tmp_path / "step.mlir"
    p.write_text(fwd_bwd(2))
    return p


def run(fn, argv, capsys):
    rc = fn([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_estimate_ir_table_has_units_and_memory(step_ir, capsys):
    rc, out, err = run(estimate_main, [step_ir, "--network", "ring"], capsys)
    assert rc == 0, err
    for heading in ("quantity", "mean/rank (us)", "iteration time", "compute time", "exposed communication",
                    "MFU (%)", "model FLOPs (GFLOP)", "sum of compute-node num_ops",
                    "peak memory per rank (KiB)", "at @block_bwd iteration 1, op 4", "at peak (KiB)"):
        assert heading in out
    assert "2.250" in out  # 2304 B = 2.25 KiB, the hand-computed peak (test_sim_lifetimes)


def test_estimate_json_numbers(step_ir, capsys):
    rc, out, _ = run(estimate_main, [step_ir, "--network", "ring", "--json"], capsys)
    rep = json.loads(out)
    assert rc == 0 and rep["world_size"] == 2
    assert rep["peak_memory"]["peak_bytes"] == 2304
    assert rep["peak_memory"]["at_peak_bytes"]["grads"] == 1024
    # 2 x (mm 2x8x16 fwd) + 2 x (2 mms bwd) per rank, 2 FLOPs per MAC, over 2 ranks.
    assert rep["model_flops"] == 2 * (2 * 512 + 2 * (512 + 512))
    assert rep["iteration_time_us"] > 0
    assert rep["compute_time_us"]["mean"] == pytest.approx(rep["iteration_time_us"])  # no communication


def test_estimate_collectives_by_kind_and_timeline(tmp_path, capsys):
    ir = tmp_path / "train.mlir"
    ir.write_text(TRAIN)
    tl = tmp_path / "out" / "timeline.json"
    rc, out, err = run(estimate_main, [ir, "--network", "ring", "--timeline", tl, "--json"], capsys)
    assert rc == 0, err
    rep = json.loads(out)
    assert set(rep["comm_time_by_kind_us"]) == {"all_gather"}
    assert rep["comm_time_by_kind_us"]["all_gather"] > 0
    assert rep["peak_memory"]["at_peak_bytes"]["comm"] == 512
    events = json.loads(tl.read_text())["traceEvents"]
    assert any(e.get("name") == "dist.all_gather" and e["ph"] == "X" for e in events)


def test_estimate_trace_input_has_no_memory(capsys):
    rc, out, _ = run(estimate_main, [DATA / "stg", "--network", "ring"], capsys)
    assert rc == 0
    assert "comm all_reduce" in out and "comm send" in out
    assert "peak memory per rank: n/a" in out


def test_calibration_slows_compute(step_ir, tmp_path, capsys):
    base = json.loads(run(estimate_main, [step_ir, "--network", "ring", "--json", "--device", "h100-sxm"], capsys)[1])
    cal = tmp_path / "cal.toml"
    cal.write_text("kernel_floor_us = 40.0\n")
    slow = json.loads(run(estimate_main, [step_ir, "--network", "ring", "--json", "--calibration", cal], capsys)[1])
    # 10 kernels per rank (mm, relu; threshold_backward, 2 mm per backward) at the 40 us floor.
    assert slow["compute_time_us"]["mean"] == pytest.approx(10 * 40.0)
    assert base["compute_time_us"]["mean"] < slow["compute_time_us"]["mean"]
    assert "(calibrated)" in slow["compute_durations"] and "sustained_fraction" not in slow["compute_durations"]
    cal.write_text("sustained_fraction = 0.5\n")  # a fitted factor: every kernel twice as long, and said so
    half = json.loads(run(estimate_main, [step_ir, "--network", "ring", "--json", "--calibration", cal], capsys)[1])
    assert half["compute_time_us"]["mean"] == pytest.approx(2 * base["compute_time_us"]["mean"], rel=1e-5)
    assert "every kernel at 0.5 of its calibrated rate (the calibration's sustained_fraction)" \
        in half["compute_durations"]


@pytest.mark.parametrize("argv, message", [
    (["--device", "h999"], "unknown device 'h999' (valid: a100-40gb, a100-80gb, b200, h100-96gb-hbm2e, h100-sxm"),
    (["--network", "moon"], "unknown network 'moon' (valid: dgx-a100, dgx-h100"),
    (["--algorithm", "bogus"], "unknown collective algorithm 'bogus' (valid: ring, tree, direct, halving-doubling, auto)"),
])
def test_bad_options_are_errors_naming_the_valid_choices(step_ir, capsys, argv, message):
    rc, out, err = run(estimate_main, [step_ir, *argv], capsys)
    assert rc == 1 and message in err and "Traceback" not in err and out == ""


def test_bad_inputs_are_errors(tmp_path, capsys):
    rc, _, err = run(estimate_main, [tmp_path / "missing.mlir"], capsys)
    assert rc == 1 and "does not exist" in err
    rc, _, err = run(estimate_main, [tmp_path], capsys)
    assert rc == 1 and "no Chakra rank files" in err
    bad = tmp_path / "bad.mlir"
    bad.write_text("func.func @f( {\n")
    rc, _, err = run(estimate_main, [bad], capsys)
    assert rc == 1 and "bad.mlir:1:" in err


def test_simulate_native_matches_estimate(step_ir, capsys):
    est = json.loads(run(estimate_main, [step_ir, "--network", "ring", "--json"], capsys)[1])
    rc, out, _ = run(simulate_main, [step_ir, "--network", "ring", "--json"], capsys)
    sim = json.loads(out)
    assert rc == 0 and sim["backend"] == "native"
    assert sim["iteration_time_us"] == est["iteration_time_us"]
    assert sim["peak_memory"] is None


def test_lowered_ir_input_is_simulated_without_memory(tmp_path, capsys):
    from xdsl.context import Context
    from xdsl.parser import Parser

    from flint.ir import flint_context
    from flint.passes.lower_to_chakra import LowerToChakraPass

    module = Parser(flint_context(), TRAIN).parse_module()
    LowerToChakraPass().apply(Context(), module)
    lowered = tmp_path / "lowered.mlir"
    lowered.write_text(str(module))
    ir = tmp_path / "train.mlir"
    ir.write_text(TRAIN)
    a = json.loads(run(estimate_main, [lowered, "--network", "ring", "--json"], capsys)[1])
    b = json.loads(run(estimate_main, [ir, "--network", "ring", "--json"], capsys)[1])
    assert a["peak_memory"] is None and "already lowered" in a["peak_memory_note"]
    assert a["iteration_time_us"] == b["iteration_time_us"] and a["model_flops"] == b["model_flops"]


def test_imported_trace_ir_estimates_like_the_trace(tmp_path, capsys):
    from flint.chakra.to_ir import main as import_trace

    ir = tmp_path / "stg.mlir"
    assert import_trace([str(DATA / "stg"), "-o", str(ir)]) == 0
    capsys.readouterr()
    a = json.loads(run(estimate_main, [ir, "--network", "ring", "--json"], capsys)[1])
    b = json.loads(run(estimate_main, [DATA / "stg", "--network", "ring", "--json"], capsys)[1])
    assert a["iteration_time_us"] == b["iteration_time_us"] > 0
    assert a["comm_time_by_kind_us"] == b["comm_time_by_kind_us"] and a["peak_memory"] is None


def test_timeline_ranks(step_ir, tmp_path, capsys):
    tl = tmp_path / "tl.json"
    rc, _, err = run(estimate_main, [step_ir, "--network", "ring", "--timeline", tl, "--timeline-ranks", "1"], capsys)
    assert rc == 0, err
    pids = {e["pid"] for e in json.loads(tl.read_text())["traceEvents"]}
    assert pids == {1}
    rc, _, err = run(estimate_main, [step_ir, "--timeline", tl, "--timeline-ranks", "0-2"], capsys)
    assert rc == 1 and "rank 2 out of range for world size 2" in err


def test_comm_groups_option_on_trace_input(tmp_path, step_ir, capsys):
    from flint.chakra import write_trace

    from chakra_helpers import fsdp_tp_trace

    write_trace(fsdp_tp_trace(), tmp_path / "t", "s")
    (tmp_path / "t" / "s.comm_groups.json").rename(tmp_path / "g.json")
    rc, _, err = run(estimate_main, [tmp_path / "t"], capsys)
    assert rc == 1 and "--comm-groups" in err
    rc, out, err = run(estimate_main, [tmp_path / "t", "--comm-groups", tmp_path / "g.json"], capsys)
    assert rc == 0 and "iteration time" in out, err
    rc, _, err = run(estimate_main, [step_ir, "--comm-groups", tmp_path / "g.json"], capsys)
    assert rc == 1 and "--comm-groups applies to trace input" in err


def test_sm_sharing_is_reported_and_a_calibration_turns_it_off(tmp_path, capsys):
    """The H100's collectives hold 24 of its 132 SMs while in flight; ``comm_sms = 0`` turns that off."""
    ir = tmp_path / "train.mlir"
    ir.write_text(TRAIN)
    off = tmp_path / "off.toml"
    off.write_text("comm_sms = 0\n")
    rc, text, err = run(estimate_main, [ir, "--network", "ring"], capsys)
    assert rc == 0, err
    assert "SM sharing: a collective in flight holds 24 of 132 SMs; compute meanwhile runs on the rest" in text
    shared = json.loads(run(estimate_main, [ir, "--network", "ring", "--json"], capsys)[1])
    alone = json.loads(run(estimate_main, [ir, "--network", "ring", "--json", "--calibration", off], capsys)[1])
    assert alone["sm_sharing"] == "off"
    assert shared["compute_time_us"]["mean"] > alone["compute_time_us"]["mean"]  # the gather overlaps compute


def test_the_report_names_the_attention_rates(tmp_path, capsys):
    """The report says which calibration rates priced the fused attention ops: PyTorch SDPA's default
    kernel unless attention-kernel marked them cuDNN's, which are faster on the H100; IR without
    attention gets no line."""
    from captures import imported

    _, module = imported("llama-tiny", "fsdp", 2)
    ir = tmp_path / "step.mlir"
    ir.write_text(str(module))
    default = json.loads(run(estimate_main, [ir, "--json"], capsys)[1])
    cudnn = json.loads(run(estimate_main, [ir, "--json", "--passes", "attention-kernel"], capsys)[1])
    assert default["attention"].startswith("2 fused ops priced as PyTorch SDPA's default kernel")
    assert cudnn["attention"].startswith("2 fused ops priced as cuDNN's kernel")
    assert cudnn["compute_time_us"]["mean"] < default["compute_time_us"]["mean"]
    rc, text, err = run(estimate_main, [ir, "--passes", "attention-kernel"], capsys)
    assert rc == 0 and "  attention: 2 fused ops priced as cuDNN's kernel" in text
    plain = tmp_path / "train.mlir"
    plain.write_text(TRAIN)
    assert "attention" not in json.loads(run(estimate_main, [plain, "--network", "ring", "--json"], capsys)[1])


def test_the_attention_line_counts_the_ops_with_dropout():
    """Fused attention ops that apply dropout (dropout_p > 0) are counted per kernel: the report says their
    table's dropout_overhead priced them (cuDNN's on Hopper: +3.4%; FA2's: none measured)."""
    from xdsl.parser import Parser

    from flint.ir import flint_context
    from flint.sim.cli import _attention_summary

    text = (Path(__file__).resolve().parent.parent / "lit_tests" / "passes" / "attention-kernel.mlir").read_text()
    module = Parser(flint_context(), text, "attention-kernel.mlir").parse_module()
    assert _attention_summary(module) == ("2 fused ops priced as PyTorch SDPA's default kernel ([attention], 1 with "
                                          "dropout (the table's dropout_overhead); attention-kernel{kernel=cudnn} "
                                          "prices cuDNN's)")
