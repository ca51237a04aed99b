"""Benchmark: the analyses every estimate runs beside the simulator, at scale.

- memory model (``flint.sim.lifetimes.step_memory``, tensor lifetimes over the step's schedule) on a
  captured llama-tiny FSDP step whose depth is set by ``--layers`` (the captured block repeats, so
  the IR stays small and the schedule grows: the cost that scales with depth);
- trace checker (``flint.chakra.check.check_trace``: groups, peers, collective matching) on the
  synthetic Llama-3-70B trace of ``bench/simulate.py`` at ``--ranks`` ranks.

    .venv/bin/python bench/analyses.py                          # 100, 1,000, 4,000 layers; 1,024 ranks
    .venv/bin/python bench/analyses.py --layers 2000 --ranks 128

Targets (a person waits for these on every estimate): memory model < 2 s at 2,000 layers, trace
check < 5 s at 1,024 ranks. They live here rather than in unit tests: timings on a shared 2-core
machine are noisy.
"""

from __future__ import annotations

import argparse
import time


def memory_row(layers: int) -> list:
    from flint.capture import capture_step
    from flint.importer import import_step
    from flint.models import factory
    from flint.sim.lifetimes import step_memory

    step = capture_step(factory("llama-tiny", n_layers=layers), {"tokens": (2, 64), "labels": (2, 64)},
                        world_size=2, plan="fsdp")
    module = import_step(step)
    t0 = time.perf_counter()
    mem = step_memory(module)
    wall = time.perf_counter() - t0
    return ["memory model", f"llama-tiny fsdp, {layers:,} layers", f"{wall:.2f}",
            f"peak {mem.report.peak_bytes / 2**20:,.1f} MiB"]


def check_row(ranks: int) -> list:
    from simulate import build_trace  # bench/simulate.py, beside this file

    from flint.chakra.check import check_trace

    trace, _, _ = build_trace(ranks)
    t0 = time.perf_counter()
    problems = check_trace(trace)
    wall = time.perf_counter() - t0
    nodes = len(trace.ranks[0].table)
    return ["trace check", f"Llama-3-70B, {ranks:,} ranks x {nodes:,} nodes", f"{wall:.2f}",
            f"{len(problems)} problems"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[100, 1000, 4000],
                    help="depths of the memory-model cases (default: 100 1000 4000)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1024],
                    help="rank counts of the trace-check cases (default: 1024)")
    args = ap.parse_args()
    rows = [memory_row(n) for n in args.layers] + [check_row(r) for r in args.ranks]
    hdr = ["analysis", "case", "wall s", "result"]
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")


if __name__ == "__main__":
    main()
