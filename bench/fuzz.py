"""A longer fuzz campaign than the test suite's (flint/fuzz.py): cases tried and problem classes found.

    .venv/bin/python bench/fuzz.py [--cases 600] [--seed 1] [--families ir,trace,config] [--show 3]

Prints a table of invocations per command and mutation class, and every
failing class (hang, internal error, unlocated message, partial output)
with one reproducer each; exits 1 when any case failed.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter, defaultdict


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=600, help="cases to generate (each runs 1-4 commands; default 600)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--families", default="ir,trace,config")
    ap.add_argument("--show", type=int, default=3, help="reproducers to print per failing class")
    args = ap.parse_args()

    from flint.fuzz import campaign

    t0 = time.perf_counter()
    exits: Counter = Counter()
    failures: dict[tuple[str, str], list] = defaultdict(list)
    slowest = [0.0, None]

    def on_case(o) -> None:
        exits[(o.command, "ok" if o.code == 0 else "clean error" if o.problem is None else "FAIL")] += 1
        if o.seconds > slowest[0]:
            slowest[:] = [o.seconds, o]
        if o.problem:
            failures[(o.command, o.problem.split(":")[0])].append(o)

    outcomes = campaign(args.cases, args.seed, families=args.families.split(","), on_case=on_case)
    dt = time.perf_counter() - t0
    mutations = Counter(o.argv[-1] for o in outcomes)
    print(f"flint fuzz campaign: seed {args.seed}, {args.cases} cases, {len(outcomes)} command invocations, "
          f"{len(mutations)} distinct mutation classes, {dt:.0f} s "
          f"(slowest invocation {slowest[0]:.1f} s: "
          f"{f'{slowest[1].command}, {slowest[1].argv[-1]}' if slowest[1] else '-'})\n")
    print(f"{'command':<14} {'exit 0':>8} {'clean error':>12} {'FAIL':>6}")
    for cmd in sorted({c for c, _ in exits}):
        print(f"{cmd:<14} {exits[(cmd, 'ok')]:>8} {exits[(cmd, 'clean error')]:>12} {exits[(cmd, 'FAIL')]:>6}")
    if not failures:
        print("\nno failing class: every invocation succeeded or ended in a located error, no hang, no partial output")
        return 0
    print(f"\n{len(failures)} failing class(es):")
    for (cmd, problem), cases in sorted(failures.items()):
        print(f"\n== {cmd}: {problem} ({len(cases)} case(s))")
        for o in cases[: args.show]:
            print("  " + o.describe().replace("\n", "\n  "))
    return 1


if __name__ == "__main__":
    sys.exit(main())
