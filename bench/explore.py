"""Design points per second of `flint explore`: system-only variation (one trace reused) and plan variation
with the planned path (one single-device capture, ``shard-expand`` per plan).

    .venv/bin/python bench/explore.py [--model llama-tiny] [--world 16] [--points 60] [--cache DIR]

Rows:
- ``system-only``: one program, ``--points`` system variants (IB bandwidth x
  latency x a degraded NIC on rank 0), the program already in the capture
  cache; the first point expands and lowers the trace, the rest only
  simulate (target >= 10 points/s).
- ``plan, planned (cold)``: 24 plans (FSDP, HSDP, FSDP x TP, DDP x TP over
  8-64 ranks, one global batch) from an empty capture cache: ONE
  single-device capture (in a fresh process) serves them all; each plan is
  an expansion, a lowering (with the plan's default pipeline) and a
  simulation.
- ``plan, planned (warm)``: the same plans again into a new database, the
  single-device program from the disk cache (parse once, then expand +
  lower + simulate per plan).
Each row runs through :func:`flint.explore.runner.run_space` in this
process (``--jobs 1``) into a fresh results database and prints points/s
(wall, and steady state without the first point) and the capture cache hit
rate. The captured path (one capture per plan, 30-60 s each for the big
models) is not timed here: see the README for it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from flint.explore.runner import RunOptions, run_space
from flint.explore.space import space_from_dict
from flint.explore.store import Store


def _space(model: str, world: int, plan: dict, system: dict, name: str):
    return space_from_dict({"name": name, "workload": {"model": model, "world_size": world, "seq_len": 64,
                                                       "global_batch": 2 * world, "plan": plan},
                            "system": system}, f"<bench {name}>")


def _run(space, db: Path, cache: str) -> dict:
    from flint.explore import stages

    stages._EVALUATORS.clear()  # no in-memory reuse across rows: each row starts from the disk cache
    space.text_hash = space.name
    store = Store(db)
    try:
        t0 = time.perf_counter()
        s = run_space(space, store, RunOptions(cache_root=cache, progress=False))
        wall = time.perf_counter() - t0
        rows = list(store.rows(s.candidates))
    finally:
        store.close()
    ok = sum(r["status"] == "ok" for r in rows)
    steady = [r["eval_s"] for r in rows[1:] if r["eval_s"] is not None]
    return {"points": s.evaluated, "ok": ok, "wall_s": wall, "points_per_s": s.evaluated / wall if wall else 0,
            "steady_points_per_s": len(steady) / sum(steady) if steady and sum(steady) > 0 else float("nan"),
            "cache_hit_rate": s.cache_hits / s.evaluated if s.evaluated else float("nan"),
            "first_point_s": rows[0]["eval_s"] if rows else float("nan")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--world", type=int, default=16)
    ap.add_argument("--points", type=int, default=60, help="system variants (rounded to the grid)")
    ap.add_argument("--cache", help="capture cache (default: a fresh temporary directory)")
    args = ap.parse_args(argv)
    tmp = tempfile.TemporaryDirectory(prefix="flint-bench-explore-")
    cache = args.cache or str(Path(tmp.name) / "cache")
    rows = []

    n_bw = max(2, args.points // 6)
    bws = [50 + i * (350 / (n_bw - 1)) for i in range(n_bw)]
    system = {"network": "dgx-h100", "bandwidth_gbits_per_s": {"ib": bws}, "latency_us": {"ib": [2.0, 5.0]},
              "nic": {"ranks": [0], "dim": "ib", "bandwidth_gbits_per_s": [400, 200, 100]}}
    warm = _space(args.model, args.world, {"dp_shard": -1}, {"network": "dgx-h100"}, "warmup")
    _run(warm, Path(tmp.name) / "warm.db", cache)  # capture the program once, outside the timing
    r = _run(_space(args.model, args.world, {"dp_shard": -1}, system, "system-only"), Path(tmp.name) / "sys.db", cache)
    rows.append(("system-only", r))

    plan_axes = {"dp_shard": -1, "dp_replicate": [1, 2], "tp": [1, 2, 4]}
    for label, db in (("plan, planned (cold)", "plan-cold.db"), ("plan, planned (warm)", "plan-warm.db")):
        sp = space_from_dict({"name": "plans", "workload": {"model": args.model, "world_size": [8, 16, 32, 64],
                                                            "seq_len": 64, "global_batch": 64, "plan": plan_axes},
                              "system": {"network": "dgx-h100"}}, "<bench plans>")
        r = _run(sp, Path(tmp.name) / db, str(Path(tmp.name) / "plan-cache"))
        rows.append((label, r))

    print(f"flint explore throughput: {args.model}, one process (--jobs 1); system-only at {args.world} ranks")
    print(f"{'variation':<22} {'points':>6} {'ok':>4} {'wall (s)':>9} {'points/s':>9} {'steady pts/s':>13} "
          f"{'1st pt (s)':>10} {'cache hits':>10}")
    for label, r in rows:
        print(f"{label:<22} {r['points']:>6} {r['ok']:>4} {r['wall_s']:>9.2f} {r['points_per_s']:>9.2f} "
              f"{r['steady_points_per_s']:>13.2f} {r['first_point_s']:>10.2f} {r['cache_hit_rate']:>10.0%}")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
