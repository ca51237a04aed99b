"""`flint`: from a model and a plan to traces, estimates and reports.

Subcommands (``flint <command> --help`` explains each):

  capture       capture a model's training step under a plan and write the IR (.mlir)
  emit          lower a step's IR to per-rank Chakra ET files + comm-group JSON
  inspect       summarize and check any Chakra trace directory
  estimate      simulate a step (IR or trace) and print iteration time, exposed comm, MFU, memory
  simulate      run a step on a simulator backend (native, or ASTRA-sim) and report per-rank times
  import-trace  read any Chakra trace into the `chakra` dialect (.mlir)
  validate      run real small steps with torch.distributed (gloo) and compare them with Flint's graph
  explore       evaluate a design space (TOML): sweeps and guided search, stored in SQLite, reports and plots

Errors name the input that is wrong and exit non-zero; no tracebacks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence

from flint.errors import FlintError, run_cli
from flint.fileio import write_text_atomic
from flint.ir.parse import load_ir


def _model_factory(spec: str, layers: int | None):
    """A zoo preset name, or ``path/to/file.py[:function]`` defining a model factory."""
    if spec.endswith(".py") or ".py:" in spec:
        import importlib.util

        path, _, fn_name = spec.partition(":")
        fn_name = fn_name or "model_factory"
        if not os.path.isfile(path):
            raise FlintError(f"--model: no such file {path}")
        mod_spec = importlib.util.spec_from_file_location("flint_user_model", path)
        module = importlib.util.module_from_spec(mod_spec)
        try:
            mod_spec.loader.exec_module(module)
        except Exception as e:
            raise FlintError(f"--model: {path} failed to import: {type(e).__name__}: {e}") from None
        fn = getattr(module, fn_name, None)
        if not callable(fn):
            raise FlintError(f"--model: {path} defines no function '{fn_name}' (a zero-argument model factory)")
        if layers is not None:
            raise FlintError("--layers applies to zoo models only; set the depth in your factory")
        return fn, None
    from flint.models import config, factory

    overrides = {"n_layers": layers} if layers is not None else {}
    cfg = config(spec, **overrides)
    return factory(spec, **overrides), cfg


def _fmt_count(x: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} "


def _step_bytes(module) -> int:
    """Bytes all compute ops read and write per step (repeated functions counted each time)."""
    from xdsl.dialects import func

    from flint.ir.aten import AtenOp, get_schedule
    from flint.passes.annotate_cost import aten_op_work

    funcs = {f.sym_name.data: f for f in module.ops if isinstance(f, func.FuncOp)}
    return sum(count * sum(aten_op_work(op).bytes for op in funcs[name].walk() if isinstance(op, AtenOp))
               for name, count in get_schedule(module))


def _capture_plan(args: argparse.Namespace):
    """The plan of ``flint capture``: ``--plan-file`` or a named ``--plan`` (with ``--tp``)."""
    from flint.plan import Plan, from_recipe

    if args.plan_file:
        if args.plan is not None or args.tp is not None:
            raise FlintError("give either --plan-file or --plan/--tp, not both")
        return Plan.load(args.plan_file, world_size=args.world_size)
    if args.world_size is None:
        raise FlintError("--world-size is required with --plan (a plan file may give world_size instead)")
    from flint.capture import RECIPES

    name = args.plan or "fsdp"
    if name not in RECIPES:
        raise FlintError(f"--plan: unknown recipe '{name}'; known: {', '.join(RECIPES)} (or use --plan-file)")
    tp = 1 if args.tp is None else args.tp
    if tp < 1:
        raise FlintError(f"--tp must be at least 1, got {tp}")
    parts = name.split("+")
    if args.tp is not None and "tp" not in parts:
        raise FlintError(f"--tp applies to plans with tp; recipe '{name}' has none")
    if args.tp is not None and not {"dp", "fsdp"} & set(parts) and tp != args.world_size:
        raise FlintError(f"--tp {tp}: recipe '{name}' spans the whole world (tp = {args.world_size}); "
                         "use dp+tp or fsdp+tp for a 2-D mesh")
    return from_recipe(name, args.world_size, tp)


def cmd_capture(args: argparse.Namespace) -> int:
    from io import StringIO

    from xdsl.printer import Printer

    from flint.capture import capture_step
    from flint.importer import import_step

    t0 = time.perf_counter()
    plan = _capture_plan(args)
    model_factory, cfg = _model_factory(args.model, args.layers)
    for name in ("batch_size", "seq_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise FlintError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    seq = args.seq_len or min(getattr(cfg, "max_seq_len", 2048), 2048)
    batch = args.batch_size or plan.dp
    shapes = {"tokens": (batch, seq), "labels": (batch, seq)}
    mesh = plan.mesh()
    print(f"capturing {args.model} ({plan.describe()}; mesh {'x'.join(map(str, mesh.shape))} "
          f"{tuple(mesh.axis_names)}, batch {batch}x{seq}, {args.dtype}) ...", file=sys.stderr)
    step = capture_step(model_factory, shapes, plan=plan, dtype=args.dtype)
    t_capture = time.perf_counter() - t0
    module = import_step(step)
    text = StringIO()
    Printer(stream=text, print_debuginfo=True).print_op(module)
    text.write("\n")
    write_text_atomic(args.output, text.getvalue())
    n_ops = sum(1 for _ in module.walk()) - 1
    summary = step.summary()
    print(f"wrote {args.output}: {n_ops} ops in {len([p for p in step.parts for _ in p.graphs()])} functions "
          f"(capture {t_capture:.1f} s, import {time.perf_counter() - t0 - t_capture:.1f} s)")
    print(f"\nper rank, per step ({'; '.join(f'{p.name} x{p.repeat}' for p in step.parts)}):")
    print(f"  {'op class':<22} {'count':>8}")
    for cls, n in sorted(summary.op_classes.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {cls:<22} {n:>8}")
    print(f"  {'FLOPs':<22} {_fmt_count(summary.flops) + 'FLOP':>12}")
    print(f"  {'bytes read+written':<22} {_fmt_count(_step_bytes(module)) + 'B':>12}")
    if summary.collectives:
        width = max(10, *(len(",".join(ax)) for _, ax, _ in summary.collectives))
        print(f"\n  {'collective':<16} {'axes':<{width}} {'phase':<6} {'count':>6} {'input bytes':>14}")
        for key in sorted(summary.collectives):
            kind, ax, phase = key
            print(f"  {kind:<16} {','.join(ax):<{width}} {phase:<6} {summary.collectives[key]:>6} "
                  f"{_fmt_count(summary.collective_bytes[key]) + 'B':>14}")
    return 0


def cmd_emit(args: argparse.Namespace) -> int:
    from xdsl.context import Context

    from flint.chakra import write_trace
    from flint.chakra.from_ir import trace_from_ir
    from flint.passes.canonicalize_dist import CanonicalizeDistPass
    from flint.passes.lower_to_chakra import LowerToChakraPass

    from flint.pipeline import resolve, run_pipeline

    t0 = time.perf_counter()
    module = load_ir(args.input)
    spec = ""
    if any(op.name == "chakra.graph" for op in module.ops):
        if args.passes:
            raise FlintError(f"--passes: {args.input} is already lowered to chakra.graph; give the aten + dist IR")
    else:
        spec = resolve(module, args.passes)
        run_pipeline(module, spec, args.input)
        CanonicalizeDistPass().apply(Context(), module)
        LowerToChakraPass(device=args.device).apply(Context(), module)
        module.verify()
    trace = trace_from_ir(module)
    stats = write_trace(trace, args.output, args.prefix)
    if args.json:
        import json

        print(json.dumps({"output": str(stats.out_dir), "prefix": args.prefix, "ranks": stats.ranks,
                          "nodes": stats.nodes, "bytes": stats.bytes_written, "passes": spec}, indent=2, sort_keys=True))
        return 0
    print(f"wrote {stats.ranks} rank files + {args.prefix}.comm_groups.json to {stats.out_dir} "
          f"({stats.nodes / stats.ranks:.0f} nodes per rank, {stats.bytes_written / 1e6:.2f} MB, "
          f"{time.perf_counter() - t0:.2f} s; passes: {spec or '(none)'})")
    return 0


def _delegate(command: str, argv: Sequence[str]) -> int:
    """Subcommands whose argument parsing lives with their implementation."""
    if command == "inspect":
        from flint.chakra.inspect import main as run
    elif command == "estimate":
        from flint.sim.cli import estimate_main as run
    elif command == "simulate":
        from flint.sim.cli import simulate_main as run
    elif command == "import-trace":
        from flint.chakra.to_ir import main as run
    elif command == "explore":
        from flint.explore.cli import explore_main as run
    else:
        from flint.validate.cli import main as run
    return run(list(argv))


DELEGATED = {
    "inspect": "summarize and check a Chakra trace directory",
    "estimate": "simulate a step (IR or trace): iteration time, exposed comm, MFU, memory",
    "simulate": "run a step on a simulator backend (native or astra-sim)",
    "import-trace": "read a Chakra trace into the chakra dialect (.mlir)",
    "validate": "compare Flint's graph with real gloo runs (writes docs/validation.md)",
    "explore": "evaluate a design space (TOML): sweeps, guided search, SQLite results, reports and plots",
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="flint", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="From a model and a plan to traces, estimates and reports.",
        epilog="Run `flint <command> --help` for each command's options. Errors name the input that is wrong "
               "and exit non-zero.\nTypical flow: flint capture -> flint estimate (or flint emit -> any Chakra consumer).")
    sub = ap.add_subparsers(dest="command", metavar="command")

    cap = sub.add_parser("capture", help="capture a model's training step under a plan and write the IR",
                         description="Capture one training step (forward, loss, backward, AdamW) of a model with "
                                     "PyTorch's compiler on fake tensors and a fake process group of any world size, "
                                     "import it into Flint's IR and write it as .mlir. Prints a per-rank summary.")
    cap.add_argument("--model", required=True,
                     help="zoo preset (llama3-8b, llama3-70b, llama3-405b, mixtral-8x7b, gpt2-small, ...) or "
                          "path/to/file.py[:function] defining a zero-argument model factory (default function: model_factory)")
    cap.add_argument("--world-size", type=int, default=None,
                     help="number of ranks (required with --plan; optional with a --plan-file that gives world_size)")
    cap.add_argument("--plan", default=None,
                     help="named plan: dp, fsdp, tp, tp+sp, dp+tp, fsdp+tp, fsdp+tp+sp (default: fsdp)")
    cap.add_argument("--tp", type=int, default=None,
                     help="tensor-parallel degree of 2-D plans (dp+tp, fsdp+tp, fsdp+tp+sp; default: 1)")
    cap.add_argument("--plan-file", default=None,
                     help="a plan as TOML (dp_replicate, dp_shard, tp, sp, ...; see flint/plan.py) instead of --plan")
    cap.add_argument("--layers", type=int, default=None, help="override the model's depth (zoo models)")
    cap.add_argument("--batch-size", type=int, default=None, help="global batch size (default: one sequence per data-parallel rank)")
    cap.add_argument("--seq-len", type=int, default=None, help="sequence length (default: min(model max, 2048))")
    cap.add_argument("--dtype", default="bfloat16", help="model dtype (default: bfloat16)")
    cap.add_argument("-o", "--output", required=True, help="output .mlir file (written atomically)")
    cap.set_defaults(func=cmd_capture)

    emit = sub.add_parser("emit", help="lower a step's IR to per-rank Chakra ET files",
                          description="Lower the step (aten + dist IR, or an already lowered chakra.graph) to "
                                      "Chakra: one <prefix>.<rank>.et per rank of the grid and "
                                      "<prefix>.comm_groups.json, written atomically.")
    emit.add_argument("input", help="the step's IR (.mlir), e.g. from `flint capture`")
    emit.add_argument("-o", "--output", required=True, help="output directory (replaced atomically)")
    emit.add_argument("--prefix", default="trace", help="file-name prefix (default: trace)")
    emit.add_argument("--device", default="h100-sxm", help="device preset or TOML for compute durations (default: h100-sxm)")
    emit.add_argument("--passes", default=None, metavar="PIPELINE",
                      help="pass pipeline to run before lowering, flint-opt -p syntax; '' runs none; default: the "
                           "plan's default pipeline (FSDP: reorder-all-gather{prefetch=1},sink-waits,assign-streams; "
                           "DDP: bucket-collectives{bytes=26214400},sink-waits; otherwise none)")
    emit.add_argument("--json", action="store_true", help="print what was written (and the pipeline that ran) as JSON")
    emit.set_defaults(func=cmd_emit)

    for name, text in DELEGATED.items():
        sub.add_parser(name, help=text, add_help=False)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        return _delegate(argv[0], argv[1:])
    ap = build_parser()
    args = ap.parse_args(argv)
    if not getattr(args, "func", None):
        ap.print_help()
        return 2
    return run_cli(f"flint {args.command}", args.func, args)


if __name__ == "__main__":
    sys.exit(main())
