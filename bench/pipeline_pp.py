"""Benchmark: pipeline-parallel Llama-3 steps, captured, split and emitted end to end.

    .venv/bin/python bench/pipeline_pp.py                 # both configurations below
    .venv/bin/python bench/pipeline_pp.py --only 70b

- Llama-3-70B, dp_shard 8 x tp 4 x pp 4 (128 ranks), 1F1B over 8 microbatches: capture (PyTorch on
  fake tensors, one microbatch), import + ``pipeline-split`` (torch's 1F1B order), emit (lower to
  Chakra, write 128 rank files); seconds per phase and peak RSS of each phase's process.
- Llama-3-405B, tp 8 x pp 16 x dp_shard 128 (16,384 ranks), 1F1B over 16 microbatches: the same,
  with the emit phase's seconds, GB written and peak RSS (targets: < 60 s, < 4 GB).

Each phase runs in its own subprocess (``--worker``) so its peak RSS is its own. Sequence length
2048, one sequence per microbatch per data-parallel rank, bf16. The symbolic_tensor_graph column
is left out when that generator is not installed (it is not on PyPI).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {
    "70b": dict(model="llama3-70b", plan={"dp_shard": 8, "tp": 4, "pp": 4, "microbatches": 8, "pp_schedule": "1f1b"}),
    "405b": dict(model="llama3-405b", plan={"dp_shard": 128, "tp": 8, "pp": 16, "microbatches": 16,
                                            "pp_schedule": "1f1b"}),
}
SEQ = 2048


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux: KiB


def worker_capture(name: str, out: str) -> dict:
    """Capture, split and emit in one process (what `flint capture` + `flint emit` do without the file)."""
    from io import StringIO

    from xdsl.context import Context
    from xdsl.printer import Printer

    from flint.capture import capture_step
    from flint.chakra import write_trace
    from flint.chakra.from_ir import trace_from_ir
    from flint.passes.canonicalize_dist import CanonicalizeDistPass
    from flint.passes.lower_to_chakra import LowerToChakraPass
    from flint.fileio import write_text_atomic
    from flint.importer import import_step
    from flint.models import factory
    from flint.plan import Plan

    cfg = CONFIGS[name]
    plan = Plan.from_dict(cfg["plan"])
    batch = (plan.dp * plan.microbatches, SEQ)
    t0 = time.perf_counter()
    step = capture_step(factory(cfg["model"]), {"tokens": batch, "labels": batch}, plan=plan, dtype="bfloat16")
    t1 = time.perf_counter()
    module = import_step(step)  # runs pipeline-split (torch's schedule) on the captured microbatch
    t2 = time.perf_counter()
    text = StringIO()
    Printer(stream=text).print_op(module)
    write_text_atomic(out, text.getvalue() + "\n")
    n_ops = sum(1 for _ in module.walk()) - 1
    t3 = time.perf_counter()
    CanonicalizeDistPass().apply(Context(), module)
    LowerToChakraPass().apply(Context(), module)
    trace = trace_from_ir(module)
    write_trace(trace, out + ".trace", "trace")
    t4 = time.perf_counter()
    return {"capture_s": t1 - t0, "import_split_s": t2 - t1, "ir_ops": n_ops, "inproc_emit_s": t4 - t3,
            "capture_peak_rss_gb": _rss_gb(), "world": plan.world_size}


def worker_emit(ir: str, out_dir: str) -> dict:

    t0 = time.perf_counter()
    from xdsl.context import Context

    from flint.chakra import write_trace
    from flint.chakra.from_ir import trace_from_ir
    from flint.ir.parse import load_ir
    from flint.passes.canonicalize_dist import CanonicalizeDistPass
    from flint.passes.lower_to_chakra import LowerToChakraPass

    module = load_ir(ir)
    t1, c1 = time.perf_counter(), _cpu_s()
    CanonicalizeDistPass().apply(Context(), module)
    LowerToChakraPass().apply(Context(), module)
    trace = trace_from_ir(module)
    t_lowered = time.perf_counter()
    stats = write_trace(trace, out_dir, "trace")
    t2, c2 = time.perf_counter(), _cpu_s()
    # emit_cpu_s: CPU seconds of the process (all threads) while emitting; the rest of emit_s waits
    # for the file system (3.8 GB of rank files at 16,384 ranks)
    return {"parse_s": t1 - t0, "emit_s": t2 - t1, "emit_lower_s": t_lowered - t1, "emit_write_s": t2 - t_lowered,
            "emit_cpu_s": c2 - c1, "ranks": stats.ranks, "gb_written": stats.bytes_written / 1e9,
            "nodes_per_rank": stats.nodes / stats.ranks, "emit_peak_rss_gb": _rss_gb(),
            "roles": len({id(r.table) for r in trace.ranks})}


def _run(*args: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", *args], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"worker {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=sorted(CONFIGS))
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        kind, *rest = args.worker
        print(json.dumps(worker_capture(*rest) if kind == "capture" else worker_emit(*rest)))
        return
    try:
        import symbolic_tensor_graph  # noqa: F401
        stg = "installed, but Flint has no driver for it yet"
    except ImportError:
        stg = "not installed (not on PyPI): column skipped"
    rows = []
    for name in ([args.only] if args.only else list(CONFIGS)):
        with tempfile.TemporaryDirectory(prefix="flint-pp-") as tmp:
            ir = str(Path(tmp) / "step.mlir")
            cap = _run("capture", name, ir)
            # the capture phase also wrote a trace: flush it to disk first, so the emit phase waits only
            # for its own files (the page cache's writeback of GBs would otherwise be billed to it)
            os.sync()
            em = _run("emit", ir, str(Path(tmp) / "trace"))
        row = {"config": name, **CONFIGS[name]["plan"], **cap, **em,
               "after_capture_s": cap["import_split_s"] + cap["inproc_emit_s"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\nsymbolic_tensor_graph: {stg}")
    print("after capture = import + pipeline-split + lower + expand + write, in the capturing process;\n"
          "emit = `flint emit` of the written IR in its own process: parse, then lower + expand + write")
    print(f"{'config':<6} {'ranks':>6} {'roles':>5} {'capture s':>9} {'after capture s':>15} {'emit parse s':>12} "
          f"{'emit s':>7} {'(lower/write/CPU s)':>19} {'GB written':>10} {'capture RSS GB':>14} {'emit RSS GB':>11}")
    for r in rows:
        print(f"{r['config']:<6} {r['ranks']:>6} {r['roles']:>5} {r['capture_s']:>9.1f} {r['after_capture_s']:>15.1f} "
              f"{r['parse_s']:>12.1f} {r['emit_s']:>7.1f} "
              f"{r['emit_lower_s']:>6.1f}/{r['emit_write_s']:>5.1f}/{r['emit_cpu_s']:>5.1f}  "
              f"{r['gb_written']:>10.3f} {r['capture_peak_rss_gb']:>14.2f} "
              f"{r['emit_peak_rss_gb']:>11.2f}")


if __name__ == "__main__":
    main()
