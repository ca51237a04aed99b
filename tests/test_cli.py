"""The `flint` command: errors name the bad input, exit non-zero, and write nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flint.tools.flint_cli import main


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_unknown_model_lists_known(tmp_path, capsys):
    out = tmp_path / "s.mlir"
    rc, _, err = _run(capsys, "capture", "--model", "llama9", "--world-size", "8", "-o", str(out))
    assert rc == 1 and "unknown model 'llama9'" in err and "llama3-8b" in err and "Traceback" not in err
    assert not out.exists()


def test_tp_must_divide_world(tmp_path, capsys):
    out = tmp_path / "s.mlir"
    rc, _, err = _run(capsys, "capture", "--model", "llama-tiny", "--world-size", "12", "--plan", "fsdp+tp",
                      "--tp", "8", "-o", str(out))
    assert rc == 1 and "TP degree 8 does not divide world size 12" in err
    assert not out.exists()


def test_model_file_without_factory(tmp_path, capsys):
    f = tmp_path / "m.py"
    f.write_text("x = 1\n")
    rc, _, err = _run(capsys, "capture", "--model", str(f), "--world-size", "8", "-o", str(tmp_path / "s.mlir"))
    assert rc == 1 and "defines no function 'model_factory'" in err


def test_emit_reports_bad_ir_with_location(tmp_path, capsys):
    bad = tmp_path / "bad.mlir"
    bad.write_text("func.func @f( {\n")
    rc, _, err = _run(capsys, "emit", str(bad), "-o", str(tmp_path / "out"))
    assert rc == 1 and f"{bad}:1:15: error:" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_capture_emit_inspect_end_to_end(tmp_path):
    """flint capture -> flint emit -> flint inspect on a 2-layer tiny Llama with FSDP x TP at 1024 ranks."""
    ir = tmp_path / "step.mlir"
    cap = subprocess.run([sys.executable, "-m", "flint.tools.flint_cli", "capture", "--model", "llama-tiny",
                          "--world-size", "1024", "--plan", "fsdp+tp", "--tp", "8", "--dtype", "float32",
                          "-o", str(ir)], capture_output=True, text=True)
    assert cap.returncode == 0, cap.stderr
    assert "all_gather" in cap.stdout and "reduce_scatter" in cap.stdout and "FLOPs" in cap.stdout
    em = subprocess.run([sys.executable, "-m", "flint.tools.flint_cli", "emit", str(ir), "-o", str(tmp_path / "t")],
                        capture_output=True, text=True)
    assert em.returncode == 0, em.stderr
    assert len(list((tmp_path / "t").glob("trace.*.et"))) == 1024
    ins = subprocess.run([sys.executable, "-m", "flint.tools.flint_cli", "inspect", str(tmp_path / "t" / "trace"),
                          "--json"], capture_output=True, text=True)
    assert ins.returncode == 0, ins.stdout + ins.stderr
    summary = json.loads(ins.stdout)
    assert summary["world_size"] == 1024 and summary["problem_count"] == 0


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "8", "--plan", "dp", "--tp", "2"], "--tp applies to plans with tp; recipe 'dp' has none"),
    (["--world-size", "8", "--plan", "tp", "--tp", "4"], "recipe 'tp' spans the whole world"),
    (["--world-size", "8", "--plan", "zero3"], "unknown recipe 'zero3'"),
    # a 2-D recipe without its TP degree was plain FSDP / DDP, silently
    (["--world-size", "8", "--plan", "fsdp+tp"], "--plan fsdp+tp needs its tensor-parallel degree: --tp N with N >= 2 "
                                                 "dividing --world-size 8 (the rest is fsdp); without --tp there is "
                                                 "no tensor parallelism (that plan is --plan fsdp)"),
    (["--world-size", "8", "--plan", "dp+tp", "--tp", "1"], "with --tp 1 there is no tensor parallelism"),
    (["--plan", "fsdp"], "--world-size is required with --plan"),
    (["--world-size", "8", "--seq-len", "-5"], "--seq-len must be at least 1"),
    (["--world-size", "8", "--batch-size", "0"], "--batch-size must be at least 1"),
])
def test_capture_plan_arguments_are_checked_before_any_work(tmp_path, capsys, argv, message):
    out = tmp_path / "s.mlir"
    rc, _, err = _run(capsys, "capture", "--model", "llama-tiny", *argv, "-o", str(out))
    assert rc == 1 and message in err and "Traceback" not in err
    assert not out.exists()


def test_capture_plan_file_errors_name_the_file_and_field(tmp_path, capsys):
    plan = tmp_path / "plan.toml"
    plan.write_text("dp_shard = 3\ntp = 2\n")
    rc, _, err = _run(capsys, "capture", "--model", "llama-tiny", "--plan-file", str(plan), "--world-size", "8",
                      "-o", str(tmp_path / "s.mlir"))
    assert rc == 1 and f"{plan}: plan field 'world_size'" in err and "= 6, not the world size 8" in err
    plan.write_text("dp_shard = 2\ncp = 2\n")
    rc, _, err = _run(capsys, "capture", "--model", "llama-tiny", "--plan-file", str(plan),
                      "-o", str(tmp_path / "s.mlir"))
    assert rc == 1 and "plan field 'cp': capture does not support it yet" in err
    assert not (tmp_path / "s.mlir").exists()


@pytest.mark.slow
def test_capture_plan_file_hsdp_tp(tmp_path, capsys):
    from flint.ir.parse import load_ir
    from flint.plan import Plan, plan_of

    plan = tmp_path / "plan.toml"
    plan.write_text("[plan]\ndp_replicate = 2\ndp_shard = -1\ntp = 2\nworld_size = 8\n")
    out = tmp_path / "s.mlir"
    rc, stdout, err = _run(capsys, "capture", "--model", "llama-tiny", "--plan-file", str(plan), "-o", str(out))
    assert rc == 0, err
    assert "dp_replicate" in stdout and "dp_shard" in stdout
    module = load_ir(str(out))
    assert plan_of(module) == Plan.from_dict({"dp_replicate": 2, "dp_shard": 2, "tp": 2})
    assert "flint.axis_names = [\"dp_replicate\", \"dp_shard\", \"tp\"]" in out.read_text()


@pytest.mark.parametrize("tool", ["flint.tools.flint_opt", "flint.tools.flint_cli"])
def test_closed_stdout_ends_quietly(tool, tmp_path):
    """`flint-opt step.mlir | head` whose reader is gone: exit 141 (as SIGPIPE) without a message; it was
    reported as an internal error (BrokenPipeError)."""
    import os

    ir = os.path.join(os.path.dirname(__file__), "..", "lit_tests", "dialects", "aten", "ops.mlir")
    argv = [ir] if tool.endswith("opt") else ["inspect", str(tmp_path / "missing")]
    proc = subprocess.Popen([sys.executable, "-m", tool, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader goes away before the tool writes anything
    err = proc.stderr.read().decode()
    rc = proc.wait()
    if tool.endswith("opt"):
        assert rc == 141 and err == ""
    else:  # an error goes to stderr as before: the closed stdout changes nothing
        assert rc not in (0, 141) and "missing" in err and "internal error" not in err


def test_broken_pipe_elsewhere_is_still_a_bug(capsys):
    """A BrokenPipeError from another pipe (a worker's) while stdout is fine is reported as the bug it is."""
    from flint.errors import run_cli

    def fn():
        raise BrokenPipeError(32, "Broken pipe")

    assert run_cli("flint x", fn) == 2
    assert "internal error: BrokenPipeError" in capsys.readouterr().err


def test_every_command_writing_output_takes_dash_o():
    """``flint capture``, ``emit`` and ``expand`` take ``-o``; ``flint explore -o DIR`` and ``flint validate -o
    FILE`` were refused ("unrecognized arguments: -o"), where a user who has typed ``-o`` three times types it
    again."""
    from flint.explore.cli import build_parser as explore_parser
    from flint.validate.cli import build_parser as validate_parser

    assert explore_parser().parse_args(["space.toml", "-o", "reports"]).out == "reports"
    assert validate_parser().parse_args(["-o", "report.md"]).out == "report.md"


def test_help_imports_neither_xdsl_nor_torch():
    """`flint --help` and every subcommand's parser (estimate's and simulate's included) build without xDSL or
    torch: 0.04 s here. Moving the --passes help next to the pipelines once made it import xDSL (0.35 s)."""
    code = ("import argparse, sys\n"
            "from flint.tools.flint_cli import build_parser\n"
            "from flint.sim.cli import _common_args\n"
            "build_parser(); _common_args(argparse.ArgumentParser())\n"
            "print(sorted({m.split('.')[0] for m in sys.modules if m.startswith(('xdsl', 'torch'))}))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr
