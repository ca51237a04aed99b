"""``flint explore SPACE.toml``: run a design space, store every point, write the reports."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

from flint.errors import FlintError, run_cli


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="flint explore",
        description="Evaluate a design space (TOML: workload axes, system axes, constraints, search) with "
                    "capture -> passes -> estimate per point. Results go to a SQLite database (one row per "
                    "point; interrupted runs resume, repeated runs are instant), reports (CSV, Parquet, "
                    "Markdown, HTML, plots) to --out. See flint/explore/space.py for the file format.")
    ap.add_argument("space", help="the space file (.toml)")
    ap.add_argument("--out", "-o", help="report directory (default: out/explore/<space name>)")
    ap.add_argument("--db", help="results database (default: <out>/results.db); refused if it is not Flint's")
    ap.add_argument("--strategy", choices=("grid", "random", "optuna"), help="override the space's [search] strategy")
    ap.add_argument("--samples", type=int, help="random / optuna: number of points (trials)")
    ap.add_argument("--seed", type=int, help="random / optuna: seed (default: the space's, else 0)")
    ap.add_argument("--jobs", "-j", type=int, default=1,
                    help="local worker processes (default 1: evaluate in this process)")
    ap.add_argument("--executor", choices=("local", "ray"), default="local",
                    help="local (process pool) or ray (an existing cluster, --address)")
    ap.add_argument("--address", help="Ray cluster address (HOST:PORT), with --executor ray")
    ap.add_argument("--cache", help="capture cache directory (default $FLINT_CACHE or ~/.cache/flint/captures)")
    ap.add_argument("--limit", type=int, help="evaluate at most this many new points, then stop (resume later)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--no-report", action="store_true", help="store results only; write no report files")
    return ap


def _explore(argv: Sequence[str]) -> int:
    from flint.explore.report import dataframe, write_reports
    from flint.explore.runner import RunOptions, run_space, study_point_ids
    from flint.explore.space import load_space
    from flint.explore.store import Store

    args = build_parser().parse_args(argv)
    space = load_space(args.space)
    for name in ("samples", "limit"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise FlintError(f"--{name} must be at least 1, got {v}")
    if args.address and args.executor != "ray":
        raise FlintError("--address applies to --executor ray")
    out = Path(args.out) if args.out else Path("out") / "explore" / space.name
    store = Store(args.db or out / "results.db")
    try:
        cache = args.cache or os.environ.get("FLINT_CACHE")
        opts = RunOptions(args.strategy, args.samples, args.seed, args.jobs, args.executor, args.address,
                          str(Path(cache).resolve()) if cache else None,
                          not args.no_progress and sys.stderr.isatty(), args.limit)
        summary = run_space(space, store, opts)
        ids = summary.candidates
        if summary.strategy == "optuna":
            ids = study_point_ids(store, space)
        df = dataframe(store.rows(ids), space)
        ok = int((df["status"] == "ok").sum()) if len(df) else 0
        errors = int((df["status"] == "error").sum()) if len(df) else 0
        pruned = ", ".join(f"{c} {n}" for c, n in sorted(summary.pruned.items())) or "none"
        print(f"{space.name}: {len(ids)} points ({summary.strategy}): evaluated {summary.evaluated} now "
              f"({summary.cache_hits} capture cache hits), reused {summary.reused} stored; ok {ok}, failed {errors}; "
              f"pruned: {pruned}; {summary.wall_s:.1f} s"
              + (" (stopped at --limit; run again to resume)" if summary.stopped_early else ""))
        if len(df) and "pareto" in df:
            print(f"Pareto front: {int(df['pareto'].sum())} points")
        if not args.no_report:
            paths = write_reports(df, space, summary, out)
            print(f"wrote {len(paths)} report files to {out} (summary: {out / 'summary.md'})")
        print(f"results: {store.path}")
    finally:
        store.close()
    return 0


def explore_main(argv: Sequence[str] | None = None) -> int:
    return run_cli("flint explore", _explore, list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(explore_main())
