"""Flint's peak memory per rank vs PyTorch's memory trackers (FSDPMemTracker / MemTracker) on fake tensors.

    .venv/bin/python bench/memory.py                       # tiny models, every plan and AC mode
    .venv/bin/python bench/memory.py --full                # + full-size Llama-3 8B / GPT-2 small, few layers
    .venv/bin/python bench/memory.py --only 'fsdp+tp w4'   # cases whose label contains a substring
    .venv/bin/python bench/memory.py --partitioner eager   # Flint saves what eager autograd saves

Each case runs in a fresh process (flint.validate.memory.compare_in_subprocess): the tracker runs
two eager training steps of the model on fake tensors over a fake process group, Flint captures the
same model, plan and batch and computes its peak from tensor lifetimes. Prints one Markdown table:
both peaks (MiB), the gap (Flint - tracker) / tracker, the per-category split (Flint / tracker), and
Flint's peak plus the runtime overheads of flint/devices/runtime/memory.toml (not compared).
"""

from __future__ import annotations

import argparse
import sys
import time

from flint.errors import FlintError
from flint.validate.memory import AC_MODES, MemoryCase, compare_in_subprocess, runtime_overheads, table

PLANS = (("dp", 2), ("fsdp", 2), ("fsdp+tp", 4))
# tiny models only: TP with sequence parallelism alone, and HSDP (2 replicas x 2 shards)
TINY_PLANS = PLANS + (("tp+sp", 2), ("hsdp", 4))


def cases(full: bool, partitioner: str = "min-cut") -> list[MemoryCase]:
    out = []
    models = [("llama-tiny", 4, None), ("gpt2-tiny", 4, None)]
    if full:  # full-size widths, few layers, one sequence of 1,024 tokens per DP rank
        models += [("llama3-8b", 2, 1024), ("gpt2-small", 2, 1024)]
    for model, layers, seq in models:
        for plan, world in (TINY_PLANS if seq is None else PLANS):
            for ac in AC_MODES:
                case = MemoryCase(model, plan, world, ac, ac_every=2, layers=layers, partitioner=partitioner)
                if seq is not None:
                    case = MemoryCase(model, plan, world, ac, ac_every=2, layers=layers,
                                      batch=(case.flint_plan().dp, seq), partitioner=partitioner)
                out.append(case)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="add full-size model widths (few layers)")
    ap.add_argument("--only", default="", help="substring filter on case labels")
    ap.add_argument("--exclude", default="", help="skip cases whose label contains this substring")
    ap.add_argument("--partitioner", default="min-cut", choices=("min-cut", "eager"),
                    help="Flint's capture: min-cut (what torch.compile saves for the backward) or eager (what "
                         "eager autograd saves, as the tracker's eager run does); default: %(default)s")
    args = ap.parse_args()
    results, failed = [], []
    for case in cases(args.full, args.partitioner):
        if args.only and args.only not in case.label() or args.exclude and args.exclude in case.label():
            continue
        t0 = time.perf_counter()
        try:
            r = compare_in_subprocess(case)
        except FlintError as e:
            print(e, file=sys.stderr, flush=True)
            failed.append(case.label())
            continue
        results.append(r)
        print(f"{case.label()}: tracker {r.tracker.total_bytes / 2**20:.2f} MiB, Flint "
              f"{r.flint.total_bytes / 2**20:.2f} MiB, gap {100 * r.gap:+.1f}% ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    print()
    print(table(results, runtime_overheads("h100-sxm")))
    within = sum(r.within(0.05) for r in results)
    print(f"{within} of {len(results)} cases within 5%; mean |gap| "
          f"{100 * sum(abs(r.gap) for r in results) / max(len(results), 1):.1f}%, max |gap| "
          f"{100 * max((abs(r.gap) for r in results), default=0):.1f}%" + (f"; failed: {failed}" if failed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
