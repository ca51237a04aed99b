"""Run a real small training step on CPU with torch.distributed (gloo), one process per rank.

:func:`run_real` starts ``world_size`` processes of :mod:`flint.validate.worker`
on loopback (a free port found by binding port 0; tried once more with another port if it
was taken in between), each in its own process
group (session), waits with a timeout, converts every rank's host execution
trace with Chakra's own ``chakra_converter PyTorch`` and returns the paths.

Failure handling: as soon as one rank exits non-zero (or the timeout
passes), every other rank is killed (its whole process group), each failed
rank's error is collected (the traceback it wrote, else its stderr tail) and
:class:`RealRunError` is raised naming the rank(s): ``rank 1 failed:
RuntimeError: ...``. The run directory is a fresh temporary directory that is
removed on failure, and on success unless the caller keeps it. SIGTERM to
the parent during a run kills the ranks too (and each rank exits by itself
if its parent dies).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flint.errors import FlintError


class RealRunError(FlintError):
    """A real run failed: which rank(s), and why."""

    def __init__(self, message: str, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})


@dataclass
class RunSpec:
    """One real run: model preset, recipe, world size, global batch (batch, seq)."""

    model: str
    plan: str
    world_size: int
    batch: tuple[int, int]
    tp: int = 1
    overrides: dict = field(default_factory=dict)
    timeout_s: float = 120.0
    port: int | None = None  # None: pick a free one
    fail_ranks: tuple[int, ...] = ()  # testing: ranks that raise before joining
    ac: str = "none"  # activation checkpointing mode (flint.plan AC_MODES; selective-layer: every 2nd block)
    loss_parallel: bool = False  # the plan's loss_parallel: torch's loss_parallel around forward and backward
    max_norm: float = 0.0  # the plan's max_norm: torchtitan's clip_grad_norm_ between backward and optimizer
    optimizer_impl: str = "for-loop"  # the plan's AdamW form: foreach=True / fused=True in the real run


@dataclass
class RealRun:
    """Where a finished real run left its traces (``dir`` is owned by the caller)."""

    spec: RunSpec
    dir: Path
    host_traces: list[Path]  # host ET JSON per rank
    chakra_dir: Path  # converted traces ``step.<rank>.et``
    kineto_traces: list[Path] = field(default_factory=list)  # profiler trace per rank (durations)
    step_wall_us: list[float] = field(default_factory=list)  # measured wall time of the traced step

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _error_text(run_dir: Path, rank: int, stderr_path: Path) -> str:
    err = run_dir / f"error.{rank}.txt"
    if err.exists():
        # the exception's lines: from the traceback's last unindented line (a Flint error goes on, indented,
        # with where it points: "  at file:line", which alone said nothing)
        lines = [ln for ln in err.read_text().strip().splitlines() if ln.strip()]
        start = max((i for i, ln in enumerate(lines) if not ln[:1].isspace()), default=len(lines) - 1)
        return " ".join(ln.strip() for ln in lines[start:]) if lines else "unknown error"
    tail = stderr_path.read_text(errors="replace").strip().splitlines()[-5:] if stderr_path.exists() else []
    return " | ".join(ln.strip() for ln in tail) or "exited without an error message"


def _launch(spec: RunSpec, run_dir: Path) -> dict[int, str]:
    """Run all ranks; {rank: error} for the ranks that failed (empty on success)."""
    port = spec.port if spec.port is not None else free_port()
    payload = asdict(spec) | {"dir": str(run_dir), "port": port}
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps(payload))
    for stale in run_dir.glob("error.*.txt"):  # from an earlier attempt in this directory
        stale.unlink()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs: dict[int, subprocess.Popen] = {}
    logs: dict[int, Path] = {}
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        for rank in range(spec.world_size):
            logs[rank] = run_dir / f"stderr.{rank}.txt"
            with open(logs[rank], "w") as err:
                procs[rank] = subprocess.Popen(
                    [sys.executable, "-m", "flint.validate.worker", str(spec_path), str(rank)],
                    stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
        deadline = time.monotonic() + spec.timeout_s
        failures: dict[int, str] = {}
        while True:
            codes = {r: p.poll() for r, p in procs.items()}
            failed = [r for r, c in codes.items() if c not in (None, 0)]
            if failed:
                time.sleep(0.5)  # let ranks that fail for the same reason report it too
                for r, p in procs.items():
                    if p.poll() not in (None, 0):
                        failures[r] = _error_text(run_dir, r, logs[r])
                return failures
            if all(c == 0 for c in codes.values()):
                return {}
            if time.monotonic() > deadline:
                waiting = [r for r, c in codes.items() if c is None]
                return {r: f"timed out after {spec.timeout_s:.0f} s" for r in waiting}
            time.sleep(0.05)
    finally:
        for p in procs.values():
            _kill(p)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _terminated(signum, frame):  # noqa: ANN001
    raise RealRunError("terminated (SIGTERM) while ranks were running; all ranks killed")


def convert(host_trace: Path, output: Path, log: Path) -> None:
    """``chakra_converter PyTorch --input host_trace --output output`` (the Chakra package's converter)."""
    exe = Path(sys.executable).parent / "chakra_converter"
    cmd = [str(exe) if exe.exists() else "chakra_converter", "--log-filename", str(log), "PyTorch",
           "--input", str(host_trace), "--output", str(output)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0 or not output.exists():
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        raise RealRunError(f"chakra_converter failed on {host_trace.name}: {' | '.join(tail)}")


def repair_orphans(host_trace: Path) -> int:
    """Re-parent host-trace nodes whose parent (``ctrl_deps``) the trace lacks to their thread's root.

    Under activation checkpointing PyTorch's execution trace can name a parent
    node it never wrote (the backward's operators, FSDP's post-backward
    reduce-scatters and backward prefetches below it); ``chakra_converter``
    walks the tree from the roots and silently drops such subtrees (the
    problem mlcommons/chakra#190 describes). Returns the number of nodes
    re-parented; the file is rewritten only when there are some.
    """
    et = json.loads(host_trace.read_text())
    nodes = et.get("nodes", [])
    ids = {n["id"] for n in nodes}

    def tid(n: dict) -> int | None:
        return next((a.get("value") for a in n.get("attrs", ()) if a.get("name") == "tid"), None)

    roots = {tid(n): n["id"] for n in nodes if n.get("name") == "[pytorch|profiler|execution_trace|thread]"}
    fixed = 0
    for n in nodes:
        parent = n.get("ctrl_deps")
        if parent is not None and parent not in ids and tid(n) in roots:
            n["ctrl_deps"] = roots[tid(n)]
            fixed += 1
    if fixed:
        host_trace.write_text(json.dumps(et))
    return fixed


def run_real(spec: RunSpec, work_dir: str | Path | None = None) -> RealRun:
    """Run ``spec`` for real and convert its traces; raises :class:`RealRunError` naming failed ranks."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"flint-validate-{spec.plan.replace('+', '_')}-w{spec.world_size}-",
                                    dir=work_dir))
    try:
        failures = _launch(spec, run_dir)
        if spec.port is None and any("EADDRINUSE" in e for e in failures.values()):
            failures = _launch(spec, run_dir)  # the free port was taken in between: once more, another port
        if failures:
            msg = "; ".join(f"rank {r} failed: {e}" for r, e in sorted(failures.items()))
            raise RealRunError(f"real run {spec.plan} at world size {spec.world_size}: {msg}", failures)
        host = [run_dir / f"host.{r}.json" for r in range(spec.world_size)]
        chakra_dir = run_dir / "chakra"
        chakra_dir.mkdir()
        for r, h in enumerate(host):
            if not h.exists():
                raise RealRunError(f"rank {r} wrote no execution trace", {r: "no execution trace"})
            repair_orphans(h)
            convert(h, chakra_dir / f"step.{r}.et", run_dir / "converter.log")
        kineto = [run_dir / f"kineto.{r}.json" for r in range(spec.world_size)]
        wall = [json.loads((run_dir / f"timing.{r}.json").read_text())["step_wall_us"]
                for r in range(spec.world_size)]
        return RealRun(spec, run_dir, host, chakra_dir, kineto, wall)
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
