"""Outputs appear whole or not at all (flint/fileio.py): directories swapped as a whole, no debris
after SIGKILL, the user's umask, clean errors for read-only and wrong-kind paths, other mounts."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flint.errors import FlintError
from flint.fileio import atomic_output_dir, check_writable, write_text_atomic
from flint.fuzz import SEED_IR, run_command, warm_up


@pytest.fixture(scope="module", autouse=True)
def _imports_done():
    warm_up()


def _debris(d: Path) -> list[str]:
    return [p.name for p in d.iterdir() if p.name.startswith(".")]


def test_file_write_uses_umask_and_leaves_nothing_on_failure(tmp_path):
    old = os.umask(0o022)
    try:
        p = write_text_atomic(tmp_path / "a.txt", "x")
        assert stat.S_IMODE(p.stat().st_mode) == 0o644
        with pytest.raises(RuntimeError):
            from flint.fileio import atomic_text_file

            with atomic_text_file(tmp_path / "b.txt") as f:
                f.write("partial")
                raise RuntimeError("boom")
        assert not (tmp_path / "b.txt").exists()
        assert _debris(tmp_path) == []
    finally:
        os.umask(old)


def test_directory_modes_follow_umask(tmp_path):
    old = os.umask(0o027)
    try:
        with atomic_output_dir(tmp_path / "out") as d:
            (d / "f").write_text("x")
        assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o750
        assert stat.S_IMODE((tmp_path / "out" / "f").stat().st_mode) == 0o640
    finally:
        os.umask(old)


def test_existing_directory_is_replaced_as_a_whole(tmp_path):
    out = tmp_path / "out"
    with atomic_output_dir(out) as d:
        for i in range(5):
            (d / f"trace.{i}.et").write_text("old")
    ino = out.stat().st_ino
    with atomic_output_dir(out, may_replace=lambda names: all(n.startswith("trace.") for n in names)) as d:
        for i in range(2):
            (d / f"trace.{i}.et").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["trace.0.et", "trace.1.et"]  # no stale rank files
    assert out.stat().st_ino != ino  # a different directory took its place
    assert _debris(tmp_path) == []


def test_foreign_directory_is_refused_without_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FlintError, match="holds other files.*--force"):
        with atomic_output_dir(out, may_replace=lambda names: False):
            pytest.fail("no work may start")
    assert (out / "notes.txt").read_text() == "mine"
    with atomic_output_dir(out, force=True) as d:
        (d / "x").write_text("y")
    assert [p.name for p in out.iterdir()] == ["x"]


def test_failure_keeps_the_old_directory(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "trace.0.et").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_output_dir(out, force=True) as d:
            (d / "trace.0.et").write_text("new")
            raise RuntimeError("boom")
    assert (out / "trace.0.et").read_text() == "old"
    assert _debris(tmp_path) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_location_is_a_clean_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(FlintError, match="not writable"):
            check_writable(ro / "x.mlir")
    finally:
        ro.chmod(0o755)


def test_read_only_output_in_the_cli(tmp_path):
    # As root permissions do not apply; a path under a regular file is unwritable for everyone.
    blocker = tmp_path / "file"
    blocker.write_text("")
    src = tmp_path / "in.mlir"
    src.write_text(SEED_IR)
    o = run_command("emit", [str(src), "-o", str(blocker / "out")])
    assert o.code == 1 and "is not a directory" in o.stderr and "internal" not in o.stderr
    o = run_command("estimate", [str(src), "--timeline", str(tmp_path)])
    assert o.code == 1 and "is a directory" in o.stderr, o.stderr


def test_capture_checks_its_output_before_capturing(tmp_path, monkeypatch):
    import flint.capture
    import flint.capture.byom

    def reached(*a, **k):
        raise AssertionError("the model was built or captured before the output path was checked")

    monkeypatch.setattr(flint.capture, "capture_step", reached)
    monkeypatch.setattr(flint.capture.byom, "model_factory", reached)
    o = run_command("capture", ["--model", "llama-tiny", "--world-size", "2", "-o", str(tmp_path)])
    assert o.code == 1 and "is a directory" in o.stderr, o.stderr


def test_other_mount(tmp_path):
    """An output directory on another file system than the current directory (/dev/shm is tmpfs)."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second file system")
    import tempfile

    base = Path(tempfile.mkdtemp(dir=shm))
    try:
        src = tmp_path / "in.mlir"
        src.write_text(SEED_IR)
        for _ in range(2):  # new, then replacing the existing directory
            o = run_command("emit", [str(src), "-o", str(base / "traces")])
            assert o.code == 0, o.stderr
        assert len(list((base / "traces").glob("trace.*.et"))) == 4
        assert _debris(base) == []
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)


def test_chakra_target_into_existing_directory_leaves_no_stale_files(tmp_path):
    out = tmp_path / "tr"
    src = tmp_path / "in.mlir"
    src.write_text(SEED_IR.replace("shape = 2x2", "shape = 2x4"))
    o = run_command("flint-opt", [str(src), "-p", "lower-to-chakra", "-t", f"chakra{{out=\"{out}\" prefix=trace}}"])
    assert o.code == 0, o.stderr
    assert len(list(out.glob("trace.*.et"))) == 8
    src.write_text(SEED_IR)
    o = run_command("flint-opt", [str(src), "-p", "lower-to-chakra", "-t", f"chakra{{out=\"{out}\" prefix=trace}}"])
    assert o.code == 0, o.stderr
    assert sorted(p.name for p in out.iterdir()) == ["trace.0.et", "trace.1.et", "trace.2.et", "trace.3.et",
                                                     "trace.comm_groups.json"]


_KILL_SCRIPT = """
import sys, time
import flint.chakra.writer as w
real = w._write_file
started = []
def slow(path, data):
    real(path, data)
    if not started:
        started.append(1)
        print("WRITING", flush=True)
    time.sleep(0.1)
w._write_file = slow
from flint.tools.flint_cli import main
sys.exit(main(["emit", sys.argv[1], "-o", sys.argv[2]]))
"""


@pytest.mark.slow
def test_sigkill_leaves_old_or_new_and_no_debris(tmp_path):
    """Kill emit while it writes 64 rank files over an existing 8-rank trace: the directory is the old
    trace or the new one (never a mix), and no temporary directory survives."""
    src_old, src_new = tmp_path / "old.mlir", tmp_path / "new.mlir"
    src_old.write_text(SEED_IR.replace("shape = 2x2", "shape = 2x4"))
    src_new.write_text(SEED_IR.replace("shape = 2x2", "shape = 2x32"))
    out = tmp_path / "out"
    assert run_command("emit", [str(src_old), "-o", str(out)]).code == 0
    old = {p.name: p.read_bytes() for p in out.iterdir()}
    env = dict(os.environ, FLINT_PROGRESS="0")
    for delay in (0.0, 0.8):  # after the first of 65 files (100 ms each, 3 writer threads) was written
        proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(src_new), str(out)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert proc.stdout.readline().strip() == "WRITING"
        time.sleep(delay)
        assert any(p.name.endswith(".tmp") for p in tmp_path.iterdir())  # killed mid-write, staging present
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.time() + 10
        while _debris(tmp_path) and time.time() < deadline:  # the watcher removes the staging directory
            time.sleep(0.05)
        assert _debris(tmp_path) == []
        now = {p.name: p.read_bytes() for p in out.iterdir()}
        assert now == old, f"the old trace changed although the new one never completed ({delay} s)"
