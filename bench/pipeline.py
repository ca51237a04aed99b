"""Benchmark: the whole pipeline on a real captured model, stage by stage.

capture (torch.compile on fake tensors) -> import (FX -> IR) -> lower-to-chakra
-> SPMD expansion (IR -> per-rank tables) -> write (Chakra ET files), for
Llama-3 with FSDP x TP (tp = 8) at several world sizes. Each configuration runs
in its own subprocess so peak RSS is per configuration. Prints a table.

    .venv/bin/python bench/pipeline.py                         # llama3-70b at 128, 1,024 and 16,384 ranks
    .venv/bin/python bench/pipeline.py --model llama3-8b --ranks 64 --plan fsdp --tp 1
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time


def one(model: str, plan: str, ranks: int, tp: int, seq: int) -> dict:
    from xdsl.context import Context

    from flint.capture import capture_step
    from flint.chakra import write_trace
    from flint.chakra.from_ir import trace_from_ir
    from flint.importer import import_step
    from flint.models import factory
    from flint.passes.canonicalize_dist import CanonicalizeDistPass
    from flint.passes.lower_to_chakra import LowerToChakraPass

    row: dict = {"model": model, "plan": plan, "ranks": ranks}
    t = time.perf_counter()
    from flint.plan import from_recipe

    dp = from_recipe(plan, ranks, tp).dp
    step = capture_step(factory(model), {"tokens": (dp, seq), "labels": (dp, seq)}, world_size=ranks,
                        plan=plan, tp=tp, dtype="bfloat16")
    row["capture_s"] = time.perf_counter() - t
    t = time.perf_counter()
    module = import_step(step)
    row["ir_ops"] = sum(1 for _ in module.walk())
    row["import_s"] = time.perf_counter() - t
    t = time.perf_counter()
    CanonicalizeDistPass().apply(Context(), module)
    LowerToChakraPass().apply(Context(), module)
    row["lower_s"] = time.perf_counter() - t
    t = time.perf_counter()
    trace = trace_from_ir(module)
    row["expand_s"] = time.perf_counter() - t
    row["nodes_per_rank"] = len(trace.ranks[0].table)
    out = tempfile.mkdtemp(prefix="flint-bench-")
    try:
        t = time.perf_counter()
        stats = write_trace(trace, f"{out}/t", "trace")
        row["write_s"] = time.perf_counter() - t
        row["gb_written"] = stats.bytes_written / 1e9
    finally:
        shutil.rmtree(out, ignore_errors=True)
    row["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--plan", default="fsdp+tp")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--ranks", default="128,1024,16384")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.model, args.plan, int(args.ranks), args.tp, args.seq)))
        return
    cols = ["model", "plan", "ranks", "capture_s", "import_s", "ir_ops", "lower_s", "expand_s", "nodes_per_rank",
            "write_s", "gb_written", "peak_rss_mb"]
    print(" | ".join(cols))
    print(" | ".join("---" for _ in cols))
    for r in args.ranks.split(","):
        res = subprocess.run([sys.executable, __file__, "--one", "--model", args.model, "--plan", args.plan,
                              "--tp", str(args.tp), "--seq", str(args.seq), "--ranks", r],
                             capture_output=True, text=True)
        if res.returncode != 0:
            print(f"{args.model} | {args.plan} | {r} | failed: {res.stderr.strip().splitlines()[-1]}")
            continue
        row = json.loads(res.stdout.strip().splitlines()[-1])
        print(" | ".join(f"{row[c]:.2f}" if isinstance(row[c], float) else str(row[c]) for c in cols), flush=True)


if __name__ == "__main__":
    main()
