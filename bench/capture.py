"""Benchmark: capture Llama-3 8B / 70B / 405B (full depth) at 1,024 ranks.

Each model is captured in a fresh process (so peak RSS is per model) with
the FSDP+TP recipe on a (128, 8) mesh, bf16 parameters, global batch
128 x 8192 tokens. Prints capture seconds, peak RSS, captured op count
(FX call_function nodes over all graphs) and per-step op count (with the
repeated block counted n_layers times).

    .venv/bin/python bench/capture.py [--plan fsdp+tp] [--models llama3-8b,...]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _one(model: str, plan: str, world: int, tp: int, batch: int, seq: int) -> dict:
    from flint.capture import capture_step
    from flint.models import config, factory

    start = time.perf_counter()
    step = capture_step(factory(model), {"tokens": (batch, seq), "labels": (batch, seq)}, world_size=world,
                        plan=plan, tp=tp, dtype="bfloat16")
    mesh = step.mesh.shape
    seconds = time.perf_counter() - start
    summary = step.summary()
    return {
        "model": model, "plan": plan, "mesh": list(mesh), "layers": config(model).n_layers,
        "capture_s": round(seconds, 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "graph_ops": summary.graph_ops,
        "step_ops": sum(summary.op_classes.values()),
        "tflops_per_rank": round(summary.flops / 1e12, 1),
        "collectives_per_step": sum(summary.collectives.values()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama3-8b,llama3-70b,llama3-405b")
    ap.add_argument("--plan", default="fsdp+tp")
    ap.add_argument("--world", type=int, default=1024)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_one(args.child, args.plan, args.world, args.tp, args.batch, args.seq)))
        return
    header = f"{'model':<12} {'plan':<8} {'mesh':<10} {'layers':>6} {'capture s':>9} {'peak RSS MB':>11} " \
             f"{'graph ops':>9} {'step ops':>9} {'TFLOP/rank':>10} {'colls/step':>10}"
    print(header)
    print("-" * len(header))
    for model in args.models.split(","):
        cmd = [sys.executable, __file__, "--child", model, "--plan", args.plan, "--world", str(args.world),
               "--tp", str(args.tp), "--batch", str(args.batch), "--seq", str(args.seq)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            print(f"{model:<12} FAILED: {out.stderr.strip().splitlines()[-1]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{r['model']:<12} {r['plan']:<8} {'x'.join(map(str, r['mesh'])):<10} {r['layers']:>6} "
              f"{r['capture_s']:>9} {r['peak_rss_mb']:>11} {r['graph_ops']:>9} {r['step_ops']:>9} "
              f"{r['tflops_per_rank']:>10} {r['collectives_per_step']:>10}")


if __name__ == "__main__":
    main()
