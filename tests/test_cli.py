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
