"""``flint validate``: real CPU/gloo runs vs Flint's graph, written to docs/validation.md and a chart.

One command regenerates the page and the chart::

    flint validate            # = python -m flint.validate.cli
    flint validate --memory --ac none,full    # peak memory vs PyTorch's memory trackers instead

Options select the models, recipes and world sizes; a recipe needs a world
size it can use (2-D recipes need dp >= 2 and tp = 2, so world size 4; they
are skipped at other sizes). A failing real run prints ``rank R failed: ...``;
the remaining cases still run, the report lists the failed cases, and the
command exits 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from flint.errors import FlintError

DEFAULT_MODELS = ("llama-tiny", "gpt2-tiny")
DEFAULT_PLANS = ("dp", "fsdp", "tp", "tp+sp", "fsdp+tp")
DEFAULT_WORLD_SIZES = (2, 4)
# A Hugging Face model (flint.models.hf), captured by the generic path, run with the same preset function.
# OLMo 2 runs Hugging Face's own tensor-parallel plan; Qwen3 the hf-llama preset with its plan's q/k-norm
# gradient all-reduces (flint.capture.byom.apply_hf_tp, hf_grad_allreduce). GPT-2's tied embedding is in its
# [wte, ln_f, lm_head] group (FSDP2 refuses one parameter in two groups), under FSDP and FSDP-based replicate.
# Frozen weights (embedding and attention, requires_grad=False): no weight-gradient GEMMs, reductions or steps.
HF_CASES = (("hf-llama-tiny", "fsdp", 2), ("hf-llama-tiny", "tp+sp", 2), ("hf-gpt2-tiny", "tp+sp", 2),
            ("hf-olmo2-tiny", "fsdp+tp", 4), ("hf-qwen3-tiny", "fsdp+tp", 4), ("hf-gpt2-tiny", "fsdp", 2),
            ("hf-gpt2-tiny", "dp", 2), ("hf-llama-tiny-frozen", "dp", 2), ("hf-llama-tiny-frozen", "fsdp", 2))
# Activation checkpointing (torchtitan's modes, checkpoint_wrapper in the real run): model, recipe, world, mode.
AC_CASES = (("llama-tiny", "fsdp", 2, "full"), ("llama-tiny", "fsdp", 2, "selective-op"))
# The plan's loss_parallel (torch's loss_parallel in the real run): model, recipe, world.
LOSS_PARALLEL_CASES = (("llama-tiny", "tp", 2),)
# Gradient-norm clipping (the plan's max_norm; torchtitan's clip_grad_norm_ in the real run): model, recipe, world.
# fsdp: the norm's all-reduce over dp_shard; tp+sp: sequence parallelism's Partial norm-weight gradients,
# all-reduced for the norm as for the optimizer.
CLIP_CASES = (("llama-tiny", "fsdp", 2), ("llama-tiny", "tp+sp", 2))
# AdamW's multi-tensor forms (the plan's optimizer_impl; AdamW(foreach=True) / AdamW(fused=True) in the real run):
# model, recipe, world, form.
OPTIMIZER_CASES = (("llama-tiny", "fsdp", 2, "foreach"), ("llama-tiny", "fsdp", 2, "fused"))
DEFAULT_OUT = "docs/validation.md"
DEFAULT_CHART = "docs/validation_ratios.png"
COMMAND = "flint validate"


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def cases(models, plans, world_sizes):
    """The cases to run: every model × plan × world size a recipe can use."""
    from flint.validate.compare import Case

    out = []
    for model in models:
        for plan in plans:
            parts = set(plan.split("+"))
            for w in world_sizes:
                if "tp" in parts and parts & {"dp", "fsdp"} and (w < 4 or w % 2):
                    continue
                out.append(Case(model, plan, w))
    return out


def hf_cases(models, plans, world_sizes):
    """The Hugging Face cases: with the default models, those of HF_CASES whose plan and world size are
    selected; a Hugging Face model --models names runs every selected plan x world size, as a zoo model."""
    from flint.models.hf import is_hf
    from flint.validate.compare import Case

    if tuple(models) == DEFAULT_MODELS:
        return [Case(m, p, w) for m, p, w in HF_CASES if p in plans and w in world_sizes]
    return cases([m for m in models if is_hf(m)], plans, world_sizes)


def ac_cases(models, plans, world_sizes):
    """The AC cases of AC_CASES whose model, plan and world size are selected."""
    from flint.validate.compare import Case

    return [Case(m, p, w, ac=a) for m, p, w, a in AC_CASES if m in models and p in plans and w in world_sizes]


def loss_parallel_cases(models, plans, world_sizes):
    """The cases of LOSS_PARALLEL_CASES whose model, plan and world size are selected."""
    from flint.validate.compare import Case

    return [Case(m, p, w, loss_parallel=True) for m, p, w in LOSS_PARALLEL_CASES
            if m in models and p in plans and w in world_sizes]


def clip_cases(models, plans, world_sizes):
    """The cases of CLIP_CASES whose model, plan and world size are selected, clipping at 1.0 (torchtitan's
    default max_norm)."""
    from flint.validate.compare import Case

    return [Case(m, p, w, max_norm=1.0) for m, p, w in CLIP_CASES if m in models and p in plans and w in world_sizes]


def optimizer_cases(models, plans, world_sizes):
    """The cases of OPTIMIZER_CASES whose model, plan and world size are selected."""
    from flint.validate.compare import Case

    return [Case(m, p, w, optimizer_impl=f) for m, p, w, f in OPTIMIZER_CASES
            if m in models and p in plans and w in world_sizes]


def _no_case(plans, world_sizes) -> str:
    return (f"flint validate: error: no case to run for --plans {','.join(plans)} at --world-sizes "
            f"{','.join(map(str, world_sizes))}: 2-D recipes need an even world size of at least 4")


def memory_main(models, plans, world_sizes, ac_modes, partitioners=("min-cut",)) -> int:
    """``--memory``: Flint's peak per rank vs PyTorch's memory tracker on fake tensors, one table."""
    from flint.validate.memory import MemoryCase, compare_in_subprocess, runtime_overheads, table

    results, failed = [], 0
    todo = cases(models, plans, world_sizes)
    if not todo:
        print(_no_case(plans, world_sizes), file=sys.stderr)
        return 2
    for case in todo:
        for ac, part in ((a, p) for p in partitioners for a in ac_modes):
            mc = MemoryCase(case.model, case.plan, case.world_size, ac, tp=case.tp if case.tp > 1 else 2,
                            partitioner=part)
            try:
                r = compare_in_subprocess(mc)
            except FlintError as e:
                print(e, file=sys.stderr, flush=True)
                failed += 1
                continue
            results.append(r)
            print(f"{mc.label()}: Flint {r.flint.total_bytes / 2**20:.2f} MiB, {r.tracker_name} "
                  f"{r.tracker.total_bytes / 2**20:.2f} MiB, gap {100 * r.gap:+.1f}%", flush=True)
    if results:
        print(table(results, runtime_overheads()), end="")
        print("(the last column adds flint/devices/runtime/memory.toml's CUDA context, NCCL buffers and "
              "fragmentation, which the tracker does not see)")
    return 1 if failed or not results else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flint validate", description=__doc__.splitlines()[0])
    p.add_argument("--models", "--model", default=",".join(DEFAULT_MODELS),
                   help="comma-separated model presets (default: %(default)s)")
    p.add_argument("--plans", default=",".join(DEFAULT_PLANS), help="comma-separated recipes (default: %(default)s)")
    p.add_argument("--world-sizes", default=",".join(map(str, DEFAULT_WORLD_SIZES)),
                   help="comma-separated world sizes (default: %(default)s)")
    p.add_argument("--out", "-o", default=DEFAULT_OUT, help="Markdown report path (default: %(default)s)")
    p.add_argument("--chart", default=DEFAULT_CHART, help="bar chart path, '' for none (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per real run (default: %(default)s)")
    p.add_argument("--work-dir", default=None, help="where run directories are made (default: system temp)")
    p.add_argument("--memory", action="store_true",
                   help="instead: Flint's peak memory per rank vs PyTorch's FSDPMemTracker / MemTracker on fake "
                        "tensors (flint.validate.memory), one table on stdout")
    p.add_argument("--ac", default="none",
                   help="with --memory: comma-separated activation checkpointing modes (default: %(default)s)")
    p.add_argument("--partitioner", default=None, metavar="NAMES",
                   help="with --memory: comma-separated partitioners of Flint's capture: min-cut (what "
                        "torch.compile saves for the backward; the default) and/or eager (what eager autograd "
                        "saves, as the tracker's eager run does); see flint capture --partitioner")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from flint.capture.errors import CaptureError
    from flint.capture.recipes import RECIPES
    from flint.models import config
    from flint.validate.classify import COMPARED_COLLECTIVES
    from flint.validate.realrun import RealRunError
    from flint.validate.report import chart, markdown
    from flint.validate.run import validate_case

    try:
        models, plans = _csv(args.models), _csv(args.plans)
        from flint.models import ModelConfigError
        from flint.models.hf import HF_MODELS, is_hf

        for m in models:
            if not is_hf(m):
                try:
                    config(m)
                except ModelConfigError as e:
                    raise FlintError(f"--models: {e}; Hugging Face: {', '.join(HF_MODELS)}") from None
            elif args.memory:
                raise FlintError(f"--models {m}: --memory compares zoo models only (Flint's memory model against "
                                 "PyTorch's tracker on the zoo's configs); run it without --memory for the real "
                                 "gloo comparison")
        for p in plans:
            if p not in RECIPES:
                raise FlintError(f"--plans: unknown recipe '{p}'; known: {', '.join(RECIPES)}")
        world_sizes = [int(w) for w in _csv(args.world_sizes)]
        if any(w < 2 for w in world_sizes):
            raise FlintError("--world-sizes: every world size must be at least 2")
    except ValueError:
        print(f"flint validate: error: --world-sizes must be integers, got '{args.world_sizes}'", file=sys.stderr)
        return 2
    except (FlintError, CaptureError) as e:
        print(f"flint validate: error: {e}", file=sys.stderr)
        return 2
    if args.memory:
        from flint.plan import AC_MODES

        modes = _csv(args.ac)
        bad = [m for m in modes if m not in AC_MODES]
        if bad or not modes:
            print(f"flint validate: error: --ac: unknown mode '{bad[0] if bad else args.ac}'; known: "
                  f"{', '.join(AC_MODES)}", file=sys.stderr)
            return 2
        from flint.capture.partition import PARTITIONERS

        parts = _csv(args.partitioner or "min-cut")
        bad = [m for m in parts if m not in PARTITIONERS]
        if bad or not parts:
            print(f"flint validate: error: --partitioner: unknown partitioner '{bad[0] if bad else args.partitioner}'"
                  f"; known: {', '.join(PARTITIONERS)}", file=sys.stderr)
            return 2
        return memory_main(models, plans, world_sizes, modes, parts)
    if args.partitioner is not None:
        print("flint validate: error: --partitioner applies only with --memory", file=sys.stderr)
        return 2
    todo = cases([m for m in models if not is_hf(m)], plans, world_sizes) + hf_cases(models, plans, world_sizes)
    if tuple(models) == DEFAULT_MODELS or any(m in models for m, *_ in AC_CASES):
        todo += ac_cases(models, plans, world_sizes)
    todo += loss_parallel_cases(models, plans, world_sizes) + clip_cases(models, plans, world_sizes)
    todo += optimizer_cases(models, plans, world_sizes)
    if not todo:
        print(_no_case(plans, world_sizes), file=sys.stderr)
        return 2
    results, failed = [], []
    for case in todo:
        t0 = time.perf_counter()
        try:
            res = validate_case(case, work_dir=args.work_dir, timeout_s=args.timeout)
        except (RealRunError, FlintError) as e:
            print(f"{case.label()}: {e}", file=sys.stderr)
            failed.append((case, str(e)))
            continue
        results.append(res)
        colls = [r for r in res.rows if r.cls in COMPARED_COLLECTIVES]
        if all(r.flint == r.executed and r.flint_bytes == r.executed_bytes for r in colls):
            verdict = "match"
        elif all(r.flint == r.executed for r in colls):  # e.g. clipping's norm all-reduce (the report explains)
            verdict = "counts match, bytes DIFFER"
        else:
            verdict = "DIFFER"
        print(f"{case.label()}: collectives {verdict} ({time.perf_counter() - t0:.0f} s)", flush=True)
    if not results:
        print(f"flint validate: every case failed; {args.out} not written", file=sys.stderr)
        return 1
    out = Path(args.out)
    chart_ref = None
    if args.chart:
        chart(results, args.chart)
        chart_ref = str(Path(args.chart).resolve().relative_to(out.resolve().parent)) \
            if Path(args.chart).resolve().is_relative_to(out.resolve().parent) else str(Path(args.chart))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(results, command=COMMAND, chart=chart_ref,
                            failed=[(c.label(), e) for c, e in failed]))
    print(f"wrote {out}" + (f" and {args.chart}" if args.chart else ""))
    if failed:
        print(f"flint validate: {len(failed)} case(s) failed (listed in {out})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
