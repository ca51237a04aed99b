"""Benchmark: decompose and emit a 1,024-rank all-reduce-heavy step (data parallelism of Llama-3 8B).

capture (DP, one gradient all-reduce per parameter) -> import -> decompose-collectives
-> lower-to-chakra -> SPMD expansion -> write the Chakra ET files (sends and recvs with
concrete peers and tags), per algorithm, each configuration in its own subprocess
so the peak RSS is its own. Prints a table.

    .venv/bin/python bench/decompose.py                                   # llama3-8b, 1,024 ranks, halving-doubling
    .venv/bin/python bench/decompose.py --algorithms halving-doubling,ring --ranks 64
    .venv/bin/python bench/decompose.py --no-write                        # everything but the files
    .venv/bin/python bench/decompose.py --algorithms ring --unrolled      # without dist.steps loops
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


def one(model: str, ranks: int, algorithm: str, chunks: int, seq: int, write: bool, loops: bool = True) -> dict:
    from xdsl.context import Context

    from flint.capture import capture_step
    from flint.chakra import write_trace
    from flint.chakra.from_ir import trace_from_ir
    from flint.importer import import_step
    from flint.models import factory
    from flint.passes.canonicalize_dist import CanonicalizeDistPass
    from flint.passes.decompose_collectives import DecomposeCollectivesPass
    from flint.passes.lower_to_chakra import LowerToChakraPass
    from flint.trace import NodeKind

    row: dict = {"model": model, "ranks": ranks, "algorithm": algorithm if loops else f"{algorithm} (loops=false)"}
    t = time.perf_counter()
    step = capture_step(factory(model), {"tokens": (ranks, seq), "labels": (ranks, seq)}, world_size=ranks,
                        plan="dp", dtype="bfloat16")
    module = import_step(step)
    row["capture_import_s"] = time.perf_counter() - t
    from flint.ir import dist

    row["all_reduces_in_ir"] = sum(1 for o in module.walk() if isinstance(o, dist.AllReduceOp))
    CanonicalizeDistPass().apply(Context(), module)
    row["ir_ops_before"] = sum(1 for _ in module.walk())
    t = time.perf_counter()
    DecomposeCollectivesPass(algorithm=algorithm, chunks=chunks, loops=loops).apply(Context(), module)
    row["decompose_s"] = time.perf_counter() - t
    row["ir_ops"] = sum(1 for _ in module.walk())
    row["steps_loops"] = sum(1 for o in module.walk() if isinstance(o, dist.StepsOp))
    t = time.perf_counter()
    LowerToChakraPass().apply(Context(), module)
    row["lower_s"] = time.perf_counter() - t
    t = time.perf_counter()
    trace = trace_from_ir(module)
    row["expand_s"] = time.perf_counter() - t
    table = trace.ranks[0].table
    row["nodes_per_rank"] = len(table)
    row["p2p_per_rank"] = int(((table.kind == NodeKind.SEND) | (table.kind == NodeKind.RECV)).sum())
    row["write_s"] = row["gb_written"] = float("nan")
    if write:
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
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--algorithms", default="halving-doubling")
    ap.add_argument("--chunks", type=int, default=1)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--unrolled", action="store_true", help="decompose-collectives{loops=false}: every step in the IR")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.model, args.ranks, args.one, args.chunks, args.seq, not args.no_write,
                             not args.unrolled)))
        return
    cols = ["model", "ranks", "algorithm", "capture_import_s", "all_reduces_in_ir", "ir_ops_before", "decompose_s",
            "ir_ops", "steps_loops", "lower_s",
            "expand_s", "nodes_per_rank", "p2p_per_rank", "write_s", "gb_written", "peak_rss_mb"]
    print(" | ".join(cols))
    print(" | ".join("---" for _ in cols))
    for alg in args.algorithms.split(","):
        cmd = [sys.executable, __file__, "--one", alg, "--model", args.model, "--ranks", str(args.ranks),
               "--chunks", str(args.chunks), "--seq", str(args.seq)] + (["--no-write"] if args.no_write else []) + (["--unrolled"] if args.unrolled else [])
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            print(f"{args.model} | {args.ranks} | {alg} | failed: {res.stderr.strip().splitlines()[-1]}")
            continue
        row = json.loads(res.stdout.strip().splitlines()[-1])
        print(" | ".join(f"{row[c]:.2f}" if isinstance(row[c], float) else str(row[c]) for c in cols), flush=True)


if __name__ == "__main__":
    main()
