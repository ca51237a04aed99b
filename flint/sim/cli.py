"""``flint estimate`` and ``flint simulate``: a step's IR or a Chakra trace to performance numbers.

Input is either a step IR file (``.mlir``: `aten` + `dist` functions, an
already lowered ``chakra.graph @step``, or the per-rank graphs ``flint
import-trace`` writes) or a Chakra trace (directory,
``DIR/PREFIX`` or one rank file). IR is run through ``canonicalize-dist``
and ``lower-to-chakra`` (on ``--device``, calibrated by ``--calibration``)
and expanded per rank on the module's grid; traces are read with
:func:`flint.chakra.read_trace`.

- :func:`estimate_main` simulates with the embedded simulator and prints
  iteration time, compute and communication time, exposed communication,
  communication time by kind, MFU and (IR input with functions only) the
  peak memory per rank from tensor lifetimes (:mod:`flint.sim.lifetimes`).
- :func:`simulate_main` runs one backend: ``native`` (the embedded
  simulator) or ``astra-sim`` (writes the trace and the ASTRA-sim configs
  derived from the device and network models, runs the binary, reports per
  rank finish times and exposed communication, and fails unless every rank
  finished).

``python -m flint.sim.cli estimate|simulate ...`` runs them standalone.
Errors are :class:`~flint.errors.FlintError` messages on stderr, exit 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from flint.chakra.check import require_sound
from flint.errors import FlintError, run_cli
from flint.grad_wait import GRAD_WAIT, add_grad_wait_flag

DEFAULT_DEVICE = "h100-sxm"
DEFAULT_NETWORK = "dgx-h100"


@dataclass
class Loaded:
    """What an input became: the per-rank trace, its mesh, and (IR only) the step memory."""

    trace: object
    mesh: object | None
    memory: object | None
    memory_note: str | None
    durations: str
    kind: str  # "ir" or "trace"
    trace_dir: Path | None = None
    pipeline: dict | None = None  # a pipelined IR: schedule, stages, microbatches, peak memory per pipeline rank
    passes: str | None = None  # the pass pipeline run on step IR ("" none; None: not IR)
    scheduled_by: str | None = None  # step IR flint-opt scheduled: its pipeline (no default pipeline ran on it)
    attention: str | None = None  # which attention rates priced the IR's fused attention ops (None: none)
    optimizer: str | None = None  # the form of the IR's AdamW (plan field optimizer_impl; None: no optimizer)
    breakdown: object | None = None  # step IR: the compute kernels by op class (flint.sim.breakdown)


def _parse_algorithm(text: str):
    from flint.cost.collective import coll_kind, parse_algorithm

    if "=" not in text:
        return parse_algorithm(text).value
    out = {}
    for part in text.split(","):
        kind, _, alg = part.partition("=")
        try:
            k = coll_kind(kind.strip())
        except (KeyError, ValueError):
            raise FlintError(f"--algorithm: unknown collective kind '{kind.strip()}'") from None
        out[k.name.lower()] = parse_algorithm(alg.strip()).value
    return out


def _is_ir(path: str) -> bool:
    return path.endswith(".mlir") and Path(path).is_file()


def load_input(path: str, device_name: str, calibration: str | None, *, want_memory: bool = True,
               comm_groups: str | None = None, passes: str | None = None, grad_wait: str | None = None) -> Loaded:
    """Read ``path`` (IR or trace) into a :class:`Loaded` (module docstring).

    ``comm_groups`` (trace input only) overrides the comm-group file found beside the rank files.
    ``passes`` (step IR only) is the pass pipeline to run before lowering (:mod:`flint.schedule.pipelines`):
    ``None`` runs the default pipeline of the module's plan, ``""`` none. ``grad_wait`` (step IR only) is
    ``lower-to-chakra``'s option (``None``: its default).
    """
    if _is_ir(path):
        if comm_groups is not None:
            raise FlintError(f"--comm-groups applies to trace input; {path} is IR, whose groups come from its grid")
        return _load_ir_input(path, device_name, calibration, want_memory, passes, grad_wait)
    if grad_wait:
        raise FlintError(f"--grad-wait applies to step IR (.mlir); {path} is a Chakra trace")
    if path.endswith(".mlir"):
        raise FlintError(f"IR file {path} does not exist")
    if passes:
        raise FlintError(f"--passes applies to step IR (.mlir); {path} is a Chakra trace")
    from flint.chakra.reader import find_rank_files, read_trace

    directory, prefix, _ = find_rank_files(path)
    trace = read_trace(path, comm_groups=comm_groups)
    require_sound(trace, str(directory / prefix), f"`flint inspect {path}` lists them")
    return Loaded(trace, None, None, "needs the step IR (tensor types and lifetimes); a trace has none",
                  "from the trace's duration_micros (device roofline where missing)", "trace", directory / prefix)


def _load_ir_input(path: str, device_name: str, calibration: str | None, want_memory: bool,
                   passes: str | None = None, grad_wait: str | None = None) -> Loaded:
    from xdsl.context import Context
    from xdsl.utils.exceptions import VerifyException

    from flint.chakra.from_ir import mesh_of, trace_from_ir
    from flint.chakra.to_ir import WORLD_ATTR, trace_from_concrete_ir
    from flint.cost import load_device
    from flint.cost.device import device_argument
    from flint.passes.canonicalize_dist import CanonicalizeDistPass
    from flint.passes.lower_to_chakra import LowerToChakraPass
    from flint.ir.parse import load_ir
    from flint.sim.breakdown import CLASS_TIMES_ATTR, compute_breakdown

    module = load_ir(path)
    if WORLD_ATTR in module.attributes:  # concrete per-rank graphs from `flint import-trace`
        trace = trace_from_concrete_ir(module)
        require_sound(trace, path, "`flint inspect` lists them")
        return Loaded(trace, None, None,
                      "the IR holds imported per-rank Chakra graphs, no tensors",
                      "from the imported graphs (device roofline where missing)", "ir")
    memory, note, stage_peaks, attention, breakdown, optimizer = None, None, None, None, None, None
    lowered = any(op.name == "chakra.graph" for op in module.ops)
    spec, by = "", None
    if lowered:
        if passes:
            raise FlintError(f"--passes: {path} is already lowered to chakra.graph; give the aten + dist IR")
        if grad_wait:
            raise FlintError(f"--grad-wait: {path} is already lowered to chakra.graph; give the aten + dist IR")
        note = "the IR is already lowered to chakra.graph; give the aten + dist IR for memory"
        durations = "from the lowered IR"
        if any(CLASS_TIMES_ATTR in o.attributes for o in module.walk() if o.name == "chakra.comp"):
            breakdown = compute_breakdown(module)  # lowered with lower-to-chakra{class-times=true}
    else:
        from flint.schedule.pipelines import resolve, run_pipeline, scheduled_by

        spec = resolve(module, passes)
        by = scheduled_by(module)
        run_pipeline(module, spec, path)
        attention = _attention_summary(module)
        optimizer = _optimizer_summary(module)
        device = load_device(device_name, calibration)
        if want_memory:
            from flint.sim.lifetimes import step_memory

            from flint.ir.aten import stage_roles

            per_role = [step_memory(module, device.hbm_capacity_bytes, role) for role in range(stage_roles(module))]
            memory = max(per_role, key=lambda m: m.report.peak_bytes)  # the pipeline rank that needs most
            stage_peaks = [m.report.peak_bytes for m in per_role]
        try:
            with device_argument(device_name, calibration) as device_arg:
                CanonicalizeDistPass().apply(Context(), module)
                LowerToChakraPass(device=device_arg, grad_wait=grad_wait or GRAD_WAIT[0], class_times=True).apply(
                    Context(), module)
            module.verify()
            breakdown = compute_breakdown(module)
        except VerifyException as e:
            raise FlintError(f"{path}: error: {str(e).splitlines()[0]}") from None
        durations = f"roofline on {device_name}" + (" (calibrated)" if calibration else "")
        sustained = device.calibration.sustained_fraction
        if sustained != 1.0:  # a fitted factor (flint/devices/calibration/fitted/): say so beside the figures
            durations += f", every kernel at {sustained:g} of its calibrated rate " \
                         "(the calibration's sustained_fraction)"
    mesh = mesh_of(module)
    trace = trace_from_ir(module)
    require_sound(trace, path, "emit the step and run `flint inspect` for the full list")
    return Loaded(trace, mesh, memory, note, durations, "ir", pipeline=_pipeline_info(module, stage_peaks),
                  passes=spec, attention=attention, breakdown=breakdown, scheduled_by=by, optimizer=optimizer)


# What each form of AdamW in the IR is (flint.capture.step._capture_optimizer)
_OPTIMIZER_FORMS = {
    "for-loop": "kernels per parameter (AdamW's for-loop form, foreach=False: torch's CPU form; on a GPU torch "
                "runs foreach and torchtitan fused: plan field optimizer_impl)",
    "foreach": "AdamW foreach (multi-tensor ops over each part's tensors, torch's GPU default)",
    "fused": "AdamW fused (one _fused_adamw_ per part, torchtitan's default)",
}


def _optimizer_summary(module) -> str | None:
    """The form of the AdamW the IR's optimizer functions run, from their ops (None: no optimizer)."""
    from flint.ir.aten import optimizer_form_of

    form = optimizer_form_of(module)
    return _OPTIMIZER_FORMS[form] if form else None


def _attention_summary(module) -> str | None:
    """Which calibration rates price the module's fused attention ops (the attention-kernel pass's marks)."""
    from collections import Counter

    from xdsl.dialects.builtin import StringAttr

    from flint.cost.opclass import ATTENTION, classify_target
    from flint.ir.aten import AtenOp
    from flint.passes.annotate_cost import ATTENTION_KERNEL_ATTR, aten_op_work

    kernels, dropout = Counter(), Counter()
    for op in module.walk():
        if isinstance(op, AtenOp) and classify_target(op.overload) == ATTENTION:
            mark = op.attributes.get(ATTENTION_KERNEL_ATTR)
            kernel = mark.data if isinstance(mark, StringAttr) else "flash"
            kernels[kernel] += 1
            dropout[kernel] += aten_op_work(op).attention_dropout
    if not kernels:
        return None

    def with_dropout(kernel: str) -> str:
        return f", {dropout[kernel]} with dropout (the table's dropout_overhead)" if dropout[kernel] else ""

    parts = []
    if kernels["flash"]:
        parts.append(f"{kernels['flash']} fused op{'s' * (kernels['flash'] != 1)} priced as PyTorch SDPA's default "
                     f"kernel ([attention]{with_dropout('flash')}; attention-kernel{{kernel=cudnn}} prices cuDNN's)")
    if kernels["cudnn"]:
        parts.append(f"{kernels['cudnn']} fused op{'s' * (kernels['cudnn'] != 1)} priced as cuDNN's kernel "
                     f"([cudnn_attention]{with_dropout('cudnn')}, marked by attention-kernel)")
    return "; ".join(parts)


def _pipeline_info(module, stage_peaks: list[int] | None) -> dict | None:
    """The ``flint.pipeline`` attribute of a pipelined IR as a dict (plus peak memory per pipeline rank)."""
    from flint.ir.aten import PIPELINE_ATTR

    attr = module.attributes.get(PIPELINE_ATTR)
    if attr is None:
        return None
    from xdsl.dialects.builtin import ArrayAttr, StringAttr

    info = {}
    for k, v in attr.data.items():
        if isinstance(v, StringAttr):
            info[k] = v.data
        elif isinstance(v, ArrayAttr):
            info[k] = [x.value.data for x in v.data]
        else:
            info[k] = v.value.data
    if stage_peaks is not None:
        info["peak_memory_bytes_per_pp_rank"] = stage_peaks
    return info


def _common_args(ap: argparse.ArgumentParser) -> None:
    from flint.pass_flags import PASSES_HELP

    from flint.chakra.reader import COMM_GROUPS_HELP

    ap.add_argument("input", help="step IR (.mlir: aten + dist functions, or a lowered chakra.graph) or a Chakra "
                                  "trace (directory, DIR/PREFIX or one rank file)")
    ap.add_argument("--device", default=DEFAULT_DEVICE,
                    help=f"device preset or TOML (default {DEFAULT_DEVICE}); prices compute and gives the MFU peak")
    ap.add_argument("--network", default=DEFAULT_NETWORK, help=f"network preset or TOML (default {DEFAULT_NETWORK})")
    ap.add_argument("--calibration", help="calibration TOML overriding keys of the device's sourced calibration "
                    "(schema: flint/cost/calibration.py), or a shipped one by name: fitted (the device's own), "
                    "fitted/a100-80gb, fitted/h100-sxm (the sustained_fraction fitted on published runs; see "
                    "docs/accuracy.md)")
    ap.add_argument("--algorithm", default="ring",
                    help="collective algorithm: ring, tree, direct, halving-doubling, auto (NCCL's choice: faster of ring and tree for all-reduce); or per kind, e.g. "
                         "'all_reduce=tree,all_gather=ring' (default ring)")
    ap.add_argument("--dtype", default="bf16", help="dtype whose device peak the MFU uses (default bf16)")
    ap.add_argument("--comm-groups", metavar="JSON", help=COMM_GROUPS_HELP)
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--passes", default=None, metavar="PIPELINE", help=PASSES_HELP)
    add_grad_wait_flag(ap, "step IR only: ")


def _models(args):
    from flint.cost import load_device, load_network

    device = load_device(args.device, args.calibration)
    network = load_network(args.network)
    return device, network, _parse_algorithm(args.algorithm)


def _native(args, want_memory: bool) -> tuple[dict, object]:
    from flint.sim import simulate
    from flint.sim.report import estimate_report

    device, network, algorithm = _models(args)
    if getattr(args, "timeline", None):
        from flint.fileio import check_writable

        check_writable(args.timeline)
    loaded = load_input(args.input, args.device, args.calibration, want_memory=want_memory, comm_groups=args.comm_groups,
                        passes=args.passes, grad_wait=args.grad_wait)
    result = simulate(loaded.trace, device, network, loaded.mesh, algorithm=algorithm, dtype=args.dtype)
    rep = estimate_report(result, source=args.input, device=device.name, network=network.name, algorithm=algorithm,
                          dtype=args.dtype, memory=loaded.memory, memory_note=loaded.memory_note,
                          durations=loaded.durations, pipeline=loaded.pipeline)
    if loaded.passes is not None:
        rep["passes"] = loaded.passes
    if loaded.scheduled_by is not None:
        rep["scheduled_by"] = loaded.scheduled_by
    sms = device.calibration.comm_sms
    rep["sm_sharing"] = (f"a collective in flight holds {sms} of {device.sm_count} SMs; compute meanwhile runs on "
                         "the rest" if sms else "off")
    if loaded.attention is not None:
        rep["attention"] = loaded.attention
    if loaded.optimizer is not None:
        rep["optimizer"] = loaded.optimizer
    if loaded.breakdown is not None:
        rep["compute_by_class"] = loaded.breakdown.to_json()
    if getattr(args, "timeline", None):
        from flint.sim.chrome import write_chrome_trace

        ranks = _rank_list(args.timeline_ranks, result.world_size) if args.timeline_ranks else None
        labels = None
        if loaded.pipeline is not None and loaded.mesh is not None:
            # The pipeline per stage: by default one rank per pipeline rank (other coordinates 0).
            pp = loaded.pipeline
            coord = (loaded.mesh.coordinate(pp["axis"]) if pp["axis"] in loaded.mesh.axis_names
                     else np.zeros(result.world_size, np.int64))
            stages = {r: [s for s, o in enumerate(pp["stage_ranks"]) if o == r] for r in range(pp["ranks"])}
            labels = {r: f"[pp {int(coord[r])}: stage{'s' if len(stages[int(coord[r])]) > 1 else ''} "
                         f"{', '.join(map(str, stages[int(coord[r])]))}]" for r in range(result.world_size)}
            if ranks is None:
                ranks = [int(np.nonzero(coord == r)[0][0]) for r in range(pp["ranks"])][:16]
        write_chrome_trace(result, args.timeline, ranks, labels=labels)
        rep["timeline"] = str(args.timeline)
    return rep, result


def _rank_list(text: str, world: int) -> list[int]:
    """``"0,3,8-11"`` -> ``[0, 3, 8, 9, 10, 11]``, checked against the world size."""
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            out.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise FlintError(f"--timeline-ranks '{text}' is not a list of ranks like 0,3,8-11") from None
    bad = [r for r in out if not 0 <= r < world]
    if bad:
        raise FlintError(f"--timeline-ranks: rank {bad[0]} out of range for world size {world}")
    return out


def _timeline_args(ap: argparse.ArgumentParser, what: str = "") -> None:
    ap.add_argument("--timeline", metavar="PATH",
                    help=f"{what}write a Perfetto / Chrome-trace JSON (default: up to 16 representative ranks)")
    ap.add_argument("--timeline-ranks", metavar="LIST", help="ranks to show in the timeline, e.g. 0,8-11")


def _run(prog: str, fn, argv) -> int:
    return run_cli(prog, fn, argv)


def _estimate(argv: Sequence[str]) -> int:
    from flint.sim.report import format_report

    ap = argparse.ArgumentParser(prog="flint estimate", description="Estimate one training iteration: time, "
                                 "exposed communication, MFU and (IR input) peak memory per rank.")
    _common_args(ap)
    _timeline_args(ap)
    args = ap.parse_args(argv)
    rep, _ = _native(args, want_memory=True)
    print(json.dumps(rep, indent=2, sort_keys=True) if args.json else format_report(rep))
    return 0


def estimate_main(argv: Sequence[str] | None = None) -> int:
    """``flint estimate INPUT [--device D] [--network N] [--calibration C] [--algorithm A] [--timeline P] [--json]``."""
    return _run("flint estimate", _estimate, list(sys.argv[1:] if argv is None else argv))


# -- ASTRA-sim backend ------------------------------------------------------------

_ASTRA_TOPOLOGY = {"ring": "Ring", "switch": "Switch", "fully-connected": "FullyConnected"}
_ASTRA_ALGORITHM = {"ring": "ring", "tree": "doubleBinaryTree", "direct": "direct",
                    "halving-doubling": "halvingDoubling"}


def astra_sim_config(network, world_size: int, algorithm="ring", device=None, roofline: bool = False,
                     dtype: str = "bf16"):
    """ASTRA-sim's configuration for ``network`` at ``world_size`` ranks (size-1 dimensions dropped).

    With ``roofline``, ASTRA-sim prices compute nodes that have no duration
    with one roofline: the device's peak for ``dtype`` times its GEMM
    efficiency, and its HBM bandwidth times its elementwise memory efficiency
    (Flint's own roofline has an efficiency per op class and a kernel floor;
    ASTRA-sim's has neither).
    """
    from flint.chakra.astra_sim import AstraSimConfig, NetworkDim

    net = network.for_world(world_size)
    dims = []
    for d in net.dims:
        if d.size < 2:
            continue
        topo = _ASTRA_TOPOLOGY.get(str(d.link.topology))
        if topo is None:
            raise FlintError(f"network '{net.name}' dimension '{d.name}' is a {d.link.topology}; ASTRA-sim's analytical "
                             f"backend supports {', '.join(_ASTRA_TOPOLOGY)}")
        dims.append(NetworkDim(topo, d.size, d.link.bandwidth_gbytes_per_s, d.link.latency_us * 1e3))
    if not dims:
        raise FlintError(f"ASTRA-sim needs at least 2 ranks; the trace has {world_size}")
    kinds = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
    algs = {k: algorithm for k in kinds} if isinstance(algorithm, str) else {k: algorithm.get(k, "ring") for k in kinds}
    kw = {k: (_ASTRA_ALGORITHM[v],) for k, v in algs.items()}
    if roofline:
        if device is None:
            raise FlintError("the trace has compute nodes without durations: ASTRA-sim's roofline needs a device")
        kw.update(peak_tflops=device.peak_flops_per_s(dtype) * device.compute_eff("gemm") / 1e12,
                  roofline_mem_bw_gbps=device.hbm_bandwidth_gbytes_per_s * device.memory_eff("elementwise"))
    cfg = AstraSimConfig(dims=tuple(dims), roofline=roofline, **kw)
    if cfg.npus_count != world_size:
        raise FlintError(f"network '{net.name}' places {cfg.npus_count} ranks ({' x '.join(str(d.npus) for d in dims)}) "
                         f"but the trace has {world_size}")
    return cfg


def _needs_roofline(trace) -> bool:
    import numpy as np

    from flint.trace import NodeKind

    for p in {id(p.table): p for p in trace.ranks}.values():
        t = p.table
        if np.any((t.kind == NodeKind.COMP) & np.isnan(t.duration_us) & ((t.flops > 0) | (t.tensor_bytes > 0))):
            return True
    return False


def run_astra_backend(args) -> dict:
    """Write the trace (if needed) and the configs, run ASTRA-sim, return the report dict."""
    from flint.chakra import write_trace
    from flint.chakra.astra_sim import roofline_safe, run_astra_sim

    device, network, algorithm = _models(args)
    loaded = load_input(args.input, args.device, args.calibration, want_memory=False, comm_groups=args.comm_groups,
                        passes=args.passes)
    trace = loaded.trace
    roofline = _needs_roofline(trace)
    cfg = astra_sim_config(network, trace.world_size, algorithm, device, roofline, args.dtype)
    with tempfile.TemporaryDirectory(prefix="flint-astra-") as tmp:
        trace_dir, groups = loaded.trace_dir, args.comm_groups
        safe = roofline_safe(trace) if roofline else None
        if trace_dir is None or safe is not None:  # IR input, or compute nodes ASTRA-sim's roofline cannot price
            write_trace(safe or trace, Path(tmp) / "trace", "trace")
            trace_dir, groups = Path(tmp) / "trace" / "trace", None
        work = Path(args.work_dir) if args.work_dir else Path(tmp) / "configs"
        res = run_astra_sim(trace_dir, cfg, binary=args.astra_sim, work_dir=work, timeout_s=args.timeout,
                            comm_groups=groups)
    ranks = sorted(res.cycles)
    rep = {
        "backend": "astra-sim",
        "input": args.input,
        "network": network.name,
        "world_size": trace.world_size,
        "iteration_time_us": res.iteration_cycles / 1e3,
        "finish_us": {r: res.cycles[r] / 1e3 for r in ranks},
        "exposed_comm_us": {r: res.exposed_comm_cycles[r] / 1e3 for r in ranks},
        "roofline": cfg.roofline,
        "notes": [],
    }
    if res.teardown_status is not None:
        rep["notes"].append(f"ASTRA-sim crashed in teardown (status {res.teardown_status}) after every rank finished: "
                            "a known bug of its sub-group collectives on one-dimensional networks; the times are complete")
    if args.work_dir:
        rep["work_dir"] = str(Path(args.work_dir).resolve())
    return rep


def format_astra(rep: dict) -> str:
    lines = [f"flint simulate (astra-sim): {rep['input']}",
             f"  {rep['world_size']} ranks, network {rep['network']}, roofline {'on' if rep['roofline'] else 'off'}", "",
             f"iteration time (ms)  {rep['iteration_time_us'] / 1e3:,.3f}", "",
             f"{'rank':>6}  {'finish (ms)':>12}  {'exposed comm (ms)':>18}"]
    for r, f in rep["finish_us"].items():
        lines.append(f"{r:>6}  {f / 1e3:>12,.3f}  {rep['exposed_comm_us'][r] / 1e3:>18,.3f}")
    lines += [f"note: {n}" for n in rep.get("notes", [])]
    if rep.get("work_dir"):
        lines.append(f"wrote ASTRA-sim's configs to {rep['work_dir']}")
    return "\n".join(lines)


def _simulate(argv: Sequence[str]) -> int:
    from flint.sim.report import format_report

    ap = argparse.ArgumentParser(prog="flint simulate", description="Simulate one training iteration with the "
                                 "embedded simulator (native) or ASTRA-sim.")
    _common_args(ap)
    ap.add_argument("--backend", choices=("native", "astra-sim"), default="native", help="default native")
    _timeline_args(ap, "native: ")
    ap.add_argument("--astra-sim", metavar="PATH", help="ASTRA-sim binary (default $FLINT_ASTRA_SIM, then PATH)")
    ap.add_argument("--work-dir", metavar="DIR", help="astra-sim: keep the generated configs in DIR")
    ap.add_argument("--timeout", type=float, default=None, help="astra-sim: give up after this many seconds")
    args = ap.parse_args(argv)
    if args.backend == "astra-sim":
        if args.timeline:
            raise FlintError("--timeline needs --backend native (ASTRA-sim reports finish times only)")
        rep = run_astra_backend(args)
        print(json.dumps(rep, indent=2) if args.json else format_astra(rep))
        return 0
    rep, _ = _native(args, want_memory=False)
    rep["backend"] = "native"
    print(json.dumps(rep, indent=2, sort_keys=True) if args.json else format_report(rep).replace("flint estimate:", "flint simulate (native):", 1))
    return 0


def simulate_main(argv: Sequence[str] | None = None) -> int:
    """``flint simulate INPUT [--backend native|astra-sim] [--astra-sim PATH] ...`` (see :func:`estimate_main`)."""
    return _run("flint simulate", _simulate, list(sys.argv[1:] if argv is None else argv))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m flint.sim.cli estimate|simulate|import-trace ...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"estimate": estimate_main, "simulate": simulate_main}
    if argv and argv[0] == "import-trace":
        from flint.chakra.to_ir import main as import_main

        return import_main(argv[1:])
    if not argv or argv[0] not in commands:
        print("usage: python -m flint.sim.cli {estimate,simulate,import-trace} ...", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
