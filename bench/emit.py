"""Benchmark: emit a Llama-shaped FSDP x TP training step as per-rank Chakra files.

The trace is built directly with :mod:`flint.trace` (one symbolic table shared
by every rank, per-rank group bindings from :mod:`flint.mesh`), written with
:func:`flint.chakra.write_trace` into a temporary directory, and measured.
Each configuration runs in its own subprocess so peak RSS is per
configuration.

    .venv/bin/python bench/emit.py                       # 70B at 128 and 1,024 ranks, 405B at 16,384
    .venv/bin/python bench/emit.py --model 70b --ranks 128,1024,16384
    .venv/bin/python bench/emit.py --layers 4 --ranks 8 --keep out/bench   # small, keep the files

Per layer (configurable): forward = ``--fwd-comp`` compute nodes + 2 FSDP
all-gathers + 2 TP all-reduces; backward = ``--bwd-comp`` compute nodes + 2
re-gathers + 2 TP all-reduces + 2 gradient reduce-scatters; one optimizer node
per layer at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

MODELS = {
    # hidden, ffn, layers (Llama-3 shapes; attention counted as 4 h^2 parameters, ignoring GQA)
    "70b": (8192, 28672, 80),
    "405b": (16384, 53248, 126),
}
BYTES_PER_PARAM = 2  # bf16


def build_trace(model: str, world: int, tp: int, layers: int | None, fwd_comp: int, bwd_comp: int, tokens: int):
    from flint.mesh import Mesh, assign_group_ids
    from flint.trace import CollKind, NodeTableBuilder, RankProgram, Trace

    hidden, ffn, n_layers = MODELS[model]
    n_layers = layers or n_layers
    if world % tp:
        raise SystemExit(f"world size {world} is not a multiple of tp={tp}")
    dp = world // tp
    mesh = Mesh((dp, tp), ("dp", "tp"))
    groups, lookup = assign_group_ids(mesh, [("dp",), ("tp",)])
    DP_SLOT, TP_SLOT = 0, 1
    attn_bytes = 4 * hidden * hidden * BYTES_PER_PARAM // tp
    mlp_bytes = 3 * hidden * ffn * BYTES_PER_PARAM // tp
    act_bytes = tokens * hidden * BYTES_PER_PARAM
    flops_attn = 2 * tokens * 4 * hidden * hidden // tp
    flops_mlp = 2 * tokens * 3 * hidden * ffn // tp

    b = NodeTableBuilder()
    prev = None

    def dep():
        return [prev] if prev is not None else []

    def comp(name, flops, nbytes):
        nonlocal prev
        prev = b.add_comp(name, duration_us=flops / 400e6, flops=flops, tensor_bytes=nbytes, data_deps=dep())
        return prev

    def coll(name, kind, nbytes, slot):
        nonlocal prev
        prev = b.add_coll(name, kind, nbytes, slot, data_deps=dep())
        return prev

    per_block = max(fwd_comp // 2, 1)
    for layer in range(n_layers):
        for blk, wbytes, fl in (("attn", attn_bytes, flops_attn), ("mlp", mlp_bytes, flops_mlp)):
            coll(f"L{layer}.{blk}.fwd.all_gather", CollKind.ALL_GATHER, wbytes // dp, DP_SLOT)
            for i in range(per_block):
                comp(f"L{layer}.{blk}.fwd.op{i}", fl // per_block, act_bytes)
            coll(f"L{layer}.{blk}.fwd.all_reduce", CollKind.ALL_REDUCE, act_bytes, TP_SLOT)
    per_block = max(bwd_comp // 2, 1)
    for layer in reversed(range(n_layers)):
        for blk, wbytes, fl in (("mlp", mlp_bytes, flops_mlp), ("attn", attn_bytes, flops_attn)):
            coll(f"L{layer}.{blk}.bwd.all_gather", CollKind.ALL_GATHER, wbytes // dp, DP_SLOT)
            for i in range(per_block):
                comp(f"L{layer}.{blk}.bwd.op{i}", 2 * fl // per_block, act_bytes)
            coll(f"L{layer}.{blk}.bwd.all_reduce", CollKind.ALL_REDUCE, act_bytes, TP_SLOT)
            coll(f"L{layer}.{blk}.bwd.reduce_scatter", CollKind.REDUCE_SCATTER, wbytes, DP_SLOT)
    for layer in range(n_layers):
        comp(f"L{layer}.optim", 10 * (attn_bytes + mlp_bytes) // dp, 3 * (attn_bytes + mlp_bytes) // dp)
    table = b.build()
    bind = np.stack([lookup[(0,)], lookup[(1,)]], axis=1)
    empty = np.zeros(0, dtype=np.int64)
    ranks = [RankProgram(table, group_ids=bind[r], peer_ranks=empty) for r in range(world)]
    return Trace(world, ranks, groups)


def run_one(args) -> dict:
    from flint.chakra import write_trace

    t0 = time.perf_counter()
    trace = build_trace(args.model, args.ranks_one, args.tp, args.layers, args.fwd_comp, args.bwd_comp, args.tokens)
    t_build = time.perf_counter() - t0
    base = args.keep or tempfile.mkdtemp(prefix="flint-bench-")
    out = os.path.join(base, f"{args.model}-{args.ranks_one}")
    try:
        stats = write_trace(trace, out, "trace")
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "model": args.model, "ranks": args.ranks_one, "nodes_per_rank": len(trace.ranks[0].table),
        "build_s": round(t_build, 3), "write_s": round(stats.seconds, 3), "bytes": stats.bytes_written,
        "peak_rss_mib": round(rss_kib / 1024, 1),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), help="model shape for every rank count (default: 70b, 405b at 16,384)")
    ap.add_argument("--ranks", default="128,1024,16384", help="comma-separated world sizes")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    ap.add_argument("--fwd-comp", type=int, default=12, help="compute nodes per layer forward")
    ap.add_argument("--bwd-comp", type=int, default=24, help="compute nodes per layer backward")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per rank per step")
    ap.add_argument("--keep", default=None, help="write into this directory and keep the files")
    ap.add_argument("--ranks-one", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.ranks_one is not None:
        args.model = args.model or "70b"
        print(json.dumps(run_one(args)))
        return 0
    rows = []
    for world in (int(x) for x in args.ranks.split(",")):
        model = args.model or ("405b" if world >= 16384 else "70b")
        cmd = [sys.executable, __file__, "--ranks-one", str(world), "--model", model, "--tp", str(args.tp),
               "--fwd-comp", str(args.fwd_comp), "--bwd-comp", str(args.bwd_comp), "--tokens", str(args.tokens)]
        if args.layers:
            cmd += ["--layers", str(args.layers)]
        if args.keep:
            cmd += ["--keep", args.keep]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            print(res.stderr, file=sys.stderr)
            return res.returncode
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    hdr = f"{'model':>6} {'ranks':>7} {'nodes/rank':>10} {'build s':>8} {'write s':>8} {'GB written':>10} {'MB/s':>7} {'peak RSS MiB':>12}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        mbps = r["bytes"] / 1e6 / r["write_s"] if r["write_s"] else 0
        print(f"{r['model']:>6} {r['ranks']:>7} {r['nodes_per_rank']:>10} {r['build_s']:>8.2f} {r['write_s']:>8.2f} "
              f"{r['bytes'] / 1e9:>10.3f} {mbps:>7.0f} {r['peak_rss_mib']:>12.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
