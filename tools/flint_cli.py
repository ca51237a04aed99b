"""`flint`: from a model and a plan to traces, estimates and reports.

Subcommands (``flint <command> --help`` explains each):

  capture       capture a model's training step under a plan and write the IR (.mlir)
  emit          lower a step's IR to per-rank Chakra ET files + comm-group JSON
  expand        expand a single-device step to a parallelism plan (the planned path; no recapture)
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
from contextlib import contextmanager
from typing import Sequence

from flint.errors import FlintError, run_cli
from flint.fileio import check_writable, write_text_atomic
from flint.grad_wait import GRAD_WAIT, add_grad_wait_flag
from flint.limits import MAX_WORLD_SIZE
from flint.plan import OPTIMIZER_IMPLS, PROGRAM_FIELDS
from flint.units import fmt_bytes


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
    if "tp" in parts and {"dp", "fsdp"} & set(parts) and tp == 1:
        other = "+".join(p for p in parts if p in ("dp", "fsdp"))
        raise FlintError(f"--plan {name} needs its tensor-parallel degree: --tp N with N >= 2 dividing --world-size "
                         f"{args.world_size} (the rest is {other}); {'without --tp' if args.tp is None else 'with --tp 1'}"
                         f" there is no tensor parallelism (that plan is --plan {other})")
    if args.tp is not None and "tp" not in parts:
        raise FlintError(f"--tp applies to plans with tp; recipe '{name}' has none")
    if args.tp is not None and not {"dp", "fsdp"} & set(parts) and tp != args.world_size:
        raise FlintError(f"--tp {tp}: recipe '{name}' spans the whole world (tp = {args.world_size}); "
                         "use dp+tp or fsdp+tp for a 2-D mesh")
    return from_recipe(name, args.world_size, tp)


def cmd_capture(args: argparse.Namespace) -> int:
    from io import StringIO

    from xdsl.printer import Printer

    from flint.capture import capture_step, pytorch_warnings
    from flint.importer import import_step

    t0 = time.perf_counter()
    for name in ("batch_size", "seq_len", "world_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise FlintError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.world_size is not None and args.world_size > MAX_WORLD_SIZE:
        raise FlintError(f"--world-size {args.world_size:,} is more than Flint can hold ({MAX_WORLD_SIZE:,} ranks)")
    check_writable(args.output)
    from flint.capture.partition import PARTITIONERS

    if args.partitioner not in PARTITIONERS:
        raise FlintError(f"--partitioner: unknown partitioner '{args.partitioner}'; known: "
                         + "; ".join(f"{k} ({v})" for k, v in PARTITIONERS.items()))
    plan = _capture_plan(args)
    if args.microbatches is not None:  # gradient accumulation / pipeline microbatches (flint/pipeline)
        from flint.plan import PlanError

        if args.microbatches < 1:
            raise PlanError("microbatches", f"--microbatches must be at least 1, got {args.microbatches}")
        plan = plan.replace(microbatches=args.microbatches)
    if args.ac is not None or args.ac_every is not None:  # activation checkpointing (flint.capture.recipes)
        from flint.plan import PlanError

        if args.ac_every is not None and args.ac_every < 1:
            raise PlanError("ac_every", f"--ac-every must be at least 1, got {args.ac_every}")
        plan = plan.replace(activation_checkpoint=args.ac or plan.activation_checkpoint,
                            ac_every=plan.ac_every if args.ac_every is None else args.ac_every)
    if args.fp8 is not None:  # float8 linear layers (flint.capture.float8)
        plan = plan.replace(fp8=args.fp8)
    if args.max_norm is not None:  # gradient-norm clipping (flint.capture.step._capture_clip)
        plan = plan.replace(max_norm=args.max_norm)
    if args.optimizer_impl is not None:  # torch's AdamW form (flint.capture.step._capture_optimizer)
        plan = plan.replace(optimizer_impl=args.optimizer_impl)
    from flint.capture.byom import model_factory as _model_factory

    model_factory, cfg, user_module = _model_factory(args.model, args.layers)
    parallelize = None
    if args.parallelize:
        from flint.capture.byom import user_function

        parallelize, _ = user_function(args.parallelize, "--parallelize", "parallelize",
                                       "a function parallelize(model, mesh)")
    seq = args.seq_len or min(getattr(cfg, "max_seq_len", 2048), 2048)
    batch = args.batch_size or plan.dp * plan.microbatches
    if cfg is not None:
        if args.inputs:
            raise FlintError("--inputs applies to model files; zoo models take tokens and labels "
                             "(--batch-size, --seq-len)")
        shapes = {"tokens": (batch, seq), "labels": (batch, seq)}
    else:
        from flint.capture.byom import file_inputs, parse_inputs

        shapes = parse_inputs(args.inputs) if args.inputs else file_inputs(user_module, "--model")
    mesh = plan.mesh()
    what = (", ".join(f"{k} {'x'.join(map(str, v.shape))}" for k, v in shapes.items())
            if shapes and cfg is None else f"batch {batch}x{seq}")
    print(f"capturing {args.model} ({parallelize.__name__ if parallelize else plan.describe()}; mesh "
          f"{'x'.join(map(str, mesh.shape))} {tuple(mesh.axis_names)}, {what}, {args.dtype}) ...", file=sys.stderr)
    with _stage("capture: torch.compile + AOTAutograd of the step's parts (forward, backward, optimizer)"), \
            pytorch_warnings(args.verbose) as caught:
        step = capture_step(model_factory, shapes, plan=plan, dtype=args.dtype, loss=args.loss,
                            default_batch=(batch, seq), parallelize=parallelize, partitioner=args.partitioner)
    t_capture = time.perf_counter() - t0
    with _stage("import into Flint's IR"):
        module = import_step(step)
    with _stage(f"write {args.output}"):
        text = StringIO()
        Printer(stream=text, print_debuginfo=True).print_op(module)
        text.write("\n")
        write_text_atomic(args.output, text.getvalue())
    if caught and not args.verbose:
        print(f"  ({len(caught)} PyTorch warning(s) during capture hidden; --verbose shows them)", file=sys.stderr)
    n_ops = sum(1 for _ in module.walk()) - 1
    summary = step.summary()
    print(f"wrote {args.output}: {n_ops} ops in {len([p for p in step.parts for _ in p.graphs()])} functions "
          f"(capture {t_capture:.1f} s, import {time.perf_counter() - t0 - t_capture:.1f} s)")
    for note in step.notes:
        print(f"note: {note}")
    print(f"\nper rank, per step ({'; '.join(f'{p.name} x{p.repeat}' for p in step.parts)}):")
    print(f"  {'op class':<22} {'count':>8}")
    for cls, n in sorted(summary.op_classes.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {cls:<22} {n:>8}")
    print(f"  {'FLOPs':<22} {_fmt_count(summary.flops) + 'FLOP':>12}")
    print(f"  {'bytes read+written':<22} {fmt_bytes(_step_bytes(module)):>12}")
    if summary.collectives:
        width = max(10, *(len(",".join(ax)) for _, ax, _ in summary.collectives))
        print(f"\n  {'collective':<16} {'axes':<{width}} {'phase':<6} {'count':>6} {'input bytes':>14}")
        for key in sorted(summary.collectives):
            kind, ax, phase = key
            print(f"  {kind:<16} {','.join(ax):<{width}} {phase:<6} {summary.collectives[key]:>6} "
                  f"{fmt_bytes(summary.collective_bytes[key]):>14}")
    return 0


@contextmanager
def _stage(desc: str):
    """A capture stage on stderr as it starts and ends (captures take 10-60 s)."""
    t0 = time.perf_counter()
    print(f"  {desc} ...", file=sys.stderr, flush=True)
    yield
    print(f"  {desc}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def cmd_emit(args: argparse.Namespace) -> int:
    from xdsl.context import Context

    from flint.chakra import write_trace
    from flint.chakra.check import require_sound
    from flint.chakra.from_ir import trace_from_ir
    from flint.passes.canonicalize_dist import CanonicalizeDistPass
    from flint.passes.lower_to_chakra import LowerToChakraPass

    from flint.ir.parse import load_ir
    from flint.schedule.pipelines import resolve, run_pipeline, scheduled_by

    t0 = time.perf_counter()
    check_writable(args.output, is_dir=True)
    module = load_ir(args.input)
    spec = ""
    if any(op.name == "chakra.graph" for op in module.ops):
        for flag, value in (("--passes", args.passes), ("--grad-wait", args.grad_wait)):
            if value:
                raise FlintError(f"{flag}: {args.input} is already lowered to chakra.graph; give the aten + dist IR")
    else:
        spec = resolve(module, args.passes)
        if args.passes is None and (by := scheduled_by(module)) is not None:
            print(f"note: {args.input} was scheduled by flint-opt -p '{by}' (module attribute flint.scheduled_by): "
                  "no default pipeline runs on it (--passes runs one)", file=sys.stderr)
        run_pipeline(module, spec, args.input)
        CanonicalizeDistPass().apply(Context(), module)
        LowerToChakraPass(device=args.device, grad_wait=args.grad_wait or GRAD_WAIT[0]).apply(Context(), module)
        module.verify()
    trace = trace_from_ir(module)
    require_sound(trace, args.input, "nothing was written")
    stats = write_trace(trace, args.output, args.prefix, force=args.force)
    if args.json:
        import json

        print(json.dumps({"output": str(stats.out_dir), "prefix": args.prefix, "ranks": stats.ranks,
                          "nodes": stats.nodes, "bytes": stats.bytes_written, "passes": spec}, indent=2, sort_keys=True))
        return 0
    print(f"wrote {stats.ranks} rank files + {args.prefix}.comm_groups.json to {stats.out_dir} "
          f"({stats.nodes / stats.ranks:.0f} nodes per rank, {fmt_bytes(stats.bytes_written)}, "
          f"{time.perf_counter() - t0:.2f} s; passes: {spec or '(none)'})")
    return 0


def cmd_expand(args: argparse.Namespace) -> int:
    import dataclasses
    from io import StringIO

    from xdsl.context import Context
    from xdsl.printer import Printer

    from flint.ir.parse import load_ir
    from flint.passes.canonicalize_dist import CanonicalizeDistPass
    from flint.passes.shard_annotate import EXPAND_FIELDS, annotate, check_model, check_single_device
    from flint.passes.shard_expand import expand
    from flint.pipeline import PIPELINE_FIELDS, split_by_plan
    from flint.plan import Plan, plan_of
    from flint.sharding.rules import load_rules, rules_for
    from flint.sharding.summary import summarize_program

    t0 = time.perf_counter()
    plan = Plan.load(args.plan, world_size=args.world_size)
    plan.require(EXPAND_FIELDS + PIPELINE_FIELDS, "flint expand")
    load_rules(args.rules)  # a bad rules file fails before the program is read
    module = load_ir(args.input)
    rules = rules_for(module, args.rules)
    CanonicalizeDistPass().apply(Context(), module)
    check_single_device(module)
    # With microbatches the single-device step is ONE microbatch (captured at the global batch over
    # microbatches): the batch check is the plan's without them; pipeline-split runs it M times.
    check_model(module, dataclasses.replace(plan, microbatches=1), rules)
    single = summarize_program(module)
    annotate(module, plan, rules)
    expand(module, plan, rules)
    summary = summarize_program(module)
    # pp / microbatches: the expanded program is ONE microbatch's step; pipeline-split schedules it
    split = split_by_plan(module, plan)
    module.verify()
    text = StringIO()
    Printer(stream=text, print_debuginfo=True).print_op(module)
    text.write("\n")
    write_text_atomic(args.output, text.getvalue())
    mesh = plan.mesh()
    # the plan as recorded: the program's optimizer form, clipping and checkpointing where the file left them unset
    recorded = plan_of(module) or plan
    print(f"wrote {args.output}: {recorded.describe()}; mesh {'x'.join(map(str, mesh.shape))} "
          f"{tuple(mesh.axis_names)} ({time.perf_counter() - t0:.2f} s)")
    unit = "step" if not split else "microbatch, before pipeline-split (every stage's layers)"
    if split:
        print(f"  pipeline-split: {plan.pp_schedule}, {plan.pp} pipeline ranks, {plan.microbatches} microbatches"
              + (f", send/recv {plan.pp_p2p}" if plan.pp_p2p != "schedule" else "") + " "
              f"(one program per pipeline rank; flint estimate / emit for the whole step)")
    print(f"  FLOPs per rank and {unit.split(',')[0]}  {_fmt_count(summary.flops)}FLOP (single device "
          f"{_fmt_count(single.flops)}FLOP, x{single.flops / max(summary.flops, 1):.2f})")
    if summary.collectives:
        print(f"\n  what each axis costs per rank and {unit}:")
        print(f"  {'axes':<24} {'collective':<16} {'phase':<6} {'count':>6} {'input bytes':>14}")
        for key in sorted(summary.collectives, key=lambda k: (k[1], k[0], k[2])):
            kind, ax, phase = key
            print(f"  {','.join(ax):<24} {kind:<16} {phase:<6} {summary.collectives[key]:>6} "
                  f"{_fmt_count(summary.collective_bytes[key]) + 'B':>14}")
        per_axis: dict = {}
        for (kind, ax, phase), b in summary.collective_bytes.items():
            per_axis[ax] = per_axis.get(ax, 0) + b
        for ax, b in sorted(per_axis.items()):
            print(f"  {','.join(ax):<24} {'total':<16} {'':<6} {'':>6} {_fmt_count(b) + 'B':>14}")
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
    from flint.pass_flags import PASSES_HELP

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
                     help="tensor-parallel degree of 2-D plans (dp+tp, fsdp+tp, fsdp+tp+sp: required, >= 2, "
                          "dividing --world-size; tp and tp+sp span the world); "
                          "a model file's layers are split by Flint's TP presets (torchtitan, Hugging Face Llama "
                          "and GPT-2 names) or, for other Hugging Face models, by the TP plan their config "
                          "declares (base_model_tp_plan)")
    cap.add_argument("--plan-file", default=None,
                     help="a plan as TOML (dp_replicate, dp_shard, tp, sp, ...; see flint/plan.py) instead of --plan")
    cap.add_argument("--parallelize", default=None,
                     help="path/to/file.py[:function] (default function: parallelize): fn(model, mesh) applying "
                          "fully_shard / replicate / parallelize_module / activation checkpointing as your training "
                          "script does; the mesh is the plan's (--plan/--tp or --plan-file give its axes); with pp "
                          "> 1 it may build torch.distributed.pipelining PipelineStages (static input_args / "
                          "output_args) and return their schedule")
    cap.add_argument("--inputs", default=None,
                     help="model files: the batch as forward takes it, global shapes, e.g. "
                          "'input_ids=8x2048:int64,labels=8x2048:int64' (default: the file's example_inputs(), "
                          "else input_ids + labels for causal LMs)")
    cap.add_argument("--loss", default="auto",
                     help="auto (the model's own loss, else cross_entropy/mse against an input forward does not "
                          "take, else the output's sum), cross_entropy, mse or sum")
    cap.add_argument("--microbatches", type=int, default=None,
                     help="microbatches per step (gradient accumulation; pipeline microbatches with pp); "
                          "overrides the plan's")
    cap.add_argument("--ac", default=None, metavar="MODE",
                     help="activation checkpointing of the blocks, as torchtitan applies it: none, selective-op, "
                          "selective-layer (every --ac-every-th block) or full; overrides the plan's")
    cap.add_argument("--ac-every", type=int, default=None, metavar="N",
                     help="selective-layer: checkpoint every N-th block (overrides the plan's ac_every)")
    cap.add_argument("--fp8", nargs="?", const="tensorwise", default=None, metavar="RECIPE",
                     help="run the linear layers as torchao's Float8Linear (not the output head), as torchtitan's "
                          "float8 converter: tensorwise (the default), rowwise, rowwise_with_gw_hp; or none")
    cap.add_argument("--max-norm", type=float, default=None, metavar="X",
                     help="clip the gradients' total 2-norm at X before the optimizer, as torch's clip_grad_norm_ "
                          "(torchtitan and Megatron-LM clip at 1.0 by default); 0 clips nothing; overrides the "
                          "plan's max_norm")
    cap.add_argument("--optimizer-impl", choices=OPTIMIZER_IMPLS, default=None,
                     help="the form of torch's AdamW (torchtitan's optimizer.implementation): for-loop (kernels per "
                          "parameter; torch's CPU default and the plan default), foreach (torch's GPU default: "
                          "multi-tensor kernels) or fused (one fused AdamW kernel per part; torchtitan's default); "
                          "foreach and fused also clip with torch's multi-tensor norm; overrides the plan's "
                          "optimizer_impl")
    cap.add_argument("--partitioner", default="min-cut", metavar="NAME",
                     help="which forward values the backward saves: min-cut (what torch.compile saves; cheap ops "
                          "recomputed in the backward; the default) or eager (AOTAutograd's default partitioner: "
                          "what eager autograd saves; for runs without torch.compile)")
    cap.add_argument("--layers", type=int, default=None, help="override the model's depth (zoo models)")
    cap.add_argument("--batch-size", type=int, default=None, help="global batch size (default: one sequence per data-parallel rank and microbatch)")
    cap.add_argument("--seq-len", type=int, default=None, help="sequence length (default: min(model max, 2048))")
    cap.add_argument("--dtype", default="bfloat16", help="model dtype (default: bfloat16)")
    cap.add_argument("-o", "--output", required=True, help="output .mlir file (written atomically)")
    cap.add_argument("--verbose", action="store_true", help="show PyTorch's warnings during capture (hidden by default)")
    cap.set_defaults(func=cmd_capture)

    emit = sub.add_parser("emit", help="lower a step's IR to per-rank Chakra ET files",
                          description="Lower the step (aten + dist IR, or an already lowered chakra.graph) to "
                                      "Chakra: one <prefix>.<rank>.et per rank of the grid and "
                                      "<prefix>.comm_groups.json, written atomically.")
    emit.add_argument("input", help="the step's IR (.mlir), e.g. from `flint capture`")
    emit.add_argument("-o", "--output", required=True,
                      help="output directory, replaced as a whole and atomically when it holds only a trace of the "
                           "same prefix (or is new or empty); otherwise refused unless --force")
    emit.add_argument("--force", action="store_true", help="replace an output directory that holds other files")
    emit.add_argument("--prefix", default="trace", help="file-name prefix (default: trace)")
    emit.add_argument("--device", default="h100-sxm", help="device preset or TOML for compute durations (default: h100-sxm)")
    emit.add_argument("--passes", default=None, metavar="PIPELINE", help=PASSES_HELP)
    add_grad_wait_flag(emit)
    emit.add_argument("--json", action="store_true", help="print what was written (and the pipeline that ran) as JSON")
    emit.set_defaults(func=cmd_emit)

    exp = sub.add_parser("expand", help="expand a single-device step to a parallelism plan (planned path)",
                         description="Expand a step captured on ONE device (flint capture --world-size 1) to the "
                                     "per-rank SPMD program of a plan: shard-annotate + shard-expand. One capture "
                                     "serves a whole sweep of plans. Prints what each mesh axis costs. With pp "
                                     "or microbatches in the plan, pipeline-split then schedules the expanded "
                                     "step: the single-device step is then ONE microbatch (capture it at the "
                                     "global batch over microbatches).")
    exp.add_argument("input", help="the single-device step's IR (.mlir)")
    exp.add_argument("plan", help="the plan as TOML (dp_replicate, dp_shard, tp, sp, tp_style, cp, ep, etp, zero, "
                                  "pp, microbatches, pp_schedule, pp_virtual_stages, pp_layers, grad_sync; see "
                                  f"flint/plan.py). {', '.join(PROGRAM_FIELDS[:-1])} and {PROGRAM_FIELDS[-1]} "
                                  "are the single-device program's own: capture it with them "
                                  "(--world-size 1); the plan may repeat them or leave them unset")
    exp.add_argument("-o", "--output", required=True, help="output .mlir (written atomically)")
    exp.add_argument("--world-size", type=int, default=None, help="world size (for dp_shard = -1)")
    exp.add_argument("--rules", default=None, help="sharding rules TOML (default: flint/sharding/rules.toml)")
    exp.set_defaults(func=cmd_expand)

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
