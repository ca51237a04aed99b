"""Evaluating one design point: program -> passes -> lower -> estimate, one function per stage.

A point's *workload* axes decide the per-rank program (model, depth, dtype,
plan, global batch and sequence length) and the scheduling passes run on it;
its *system* axes (device, network, per-dimension bandwidth and latency,
degraded NICs, stragglers, collective algorithm) are variants of one trace.
A program comes one of two ways (the ``workload.path`` axis):

- ``planned`` (default): :func:`single_capture_stage` captures the plain
  single-device step once per model and global shape (world size 1, from
  the content-addressed :class:`~flint.explore.cache.CaptureCache`), and
  :func:`expand_stage` runs ``shard-annotate`` + ``shard-expand`` on it for
  the point's plan (under a second per plan, no recapture). A plan
  expansion does not implement (``pp``, ``cp``, ``ep``, activation
  checkpointing, ZeRO-1/2, ...) or a program it refuses falls back to the
  captured path; the point records the reason (output ``path_note``).
- ``captured``: :func:`capture_stage` captures the program under the plan
  with PyTorch's own parallel APIs (one capture per plan and local shape).

Then, for every point:

- :func:`passes_stage`: a ``flint-opt`` pipeline on the program. The
  ``workload.passes`` axis defaults to ``"default"``: the pipeline
  ``flint estimate`` applies for the plan
  (:func:`flint.schedule.pipelines.default_pipeline`: FSDP prefetch +
  sink-waits + streams, DDP bucketing), so a point's estimate equals
  ``flint estimate``'s on the same program; ``""`` runs no pass; any other
  value is the pipeline to run instead.
- :func:`lower_stage`: peak memory from tensor lifetimes, then
  ``canonicalize-dist`` + ``lower-to-chakra`` on the device and the SPMD
  expansion into a per-rank trace (what ``flint estimate`` does).
- :func:`system_stage`: the network with the point's bandwidth, latency and
  NIC overrides, and the trace with straggler ranks' compute slowed.
- :func:`estimate_stage`: the embedded simulator; the outputs of a point.

:class:`Evaluator` chains them and keeps what a later point can reuse in
memory (the single-device module per model and shape, the expanded module
per plan, the lowered trace per (program, passes, device)), so plan
variation costs one expansion and one lowering per plan and system-only
variation one simulation per point. Captures that miss the cache run in a
fresh process each (``isolate_captures``), so no state a capture leaves in
torch or the fake process group reaches the next one.
"""

from __future__ import annotations

import math
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping

from flint.errors import FlintError
from flint.explore.cache import CaptureCache, capture_key
from flint.plan import PROGRAM_FIELDS, Plan

MEMORY_CATEGORIES = ("params", "grads", "optimizer", "activations", "comm", "other")


PATHS = ("planned", "captured")
DEFAULT_PASSES = "default"  # the value of workload.passes meaning "the plan's default pipeline"


@dataclass(frozen=True)
class Workload:
    """What is captured, expanded and scheduled for a point (its ``workload.*`` axes)."""

    model: str
    layers: int | None
    dtype: str
    global_batch: int
    seq_len: int
    plan: Plan
    passes: str
    path: str = "planned"
    model_sha256: str = ""  # a model file's content (its edits are new programs); "" for a zoo preset

    @staticmethod
    def of(point: Mapping[str, Any]) -> "Workload":
        from flint.explore.space import plan_of_point

        plan = plan_of_point(point)
        gb = point.get("workload.global_batch")
        model = point["workload.model"]
        return Workload(model, point.get("workload.layers"), point.get("workload.dtype", "bfloat16"),
                        int(gb) if gb is not None else plan.dp, int(point.get("workload.seq_len", 64)), plan,
                        point.get("workload.passes", DEFAULT_PASSES), point.get("workload.path", "planned"),
                        _file_sha256(model))

    def _model_inputs(self) -> dict[str, Any]:
        out = {"model": self.model, "layers": self.layers, "dtype": self.dtype}
        if self.model_sha256:
            out["model_sha256"] = self.model_sha256
        return out

    def capture_inputs(self) -> dict[str, Any]:
        """What decides the captured program: model (a file's content too), depth, dtype, plan, local shapes."""
        local = (self.global_batch // self.plan.dp, self.seq_len)
        return {**self._model_inputs(), "plan": self.plan.to_dict(),
                "local_shapes": {"tokens": list(local), "labels": list(local)}, "recipe": "flint.capture.capture_step"}

    def single_inputs(self) -> dict[str, Any]:
        """What decides the single-device program the planned path expands: model, depth, dtype, global shapes,
        and the plan fields that are the program's own (:data:`flint.plan.PROGRAM_FIELDS`)."""
        shape = [self.global_batch, self.seq_len]
        return {**self._model_inputs(), "plan": single_device_plan(self.plan).to_dict(),
                "local_shapes": {"tokens": shape, "labels": shape}, "recipe": "flint.capture.capture_step"}

    @property
    def key(self) -> str:
        """The content key of this point's program (captured, or single-device capture + plan expanded)."""
        if self.planned_refusal() is None:
            return capture_key({"expand": self.plan.to_dict(), "single": self.single_inputs()})
        return self.captured_key

    @property
    def captured_key(self) -> str:
        return capture_key(self.capture_inputs())

    @property
    def single_key(self) -> str:
        return capture_key(self.single_inputs())

    def planned_refusal(self) -> str | None:
        """Why this point cannot take the planned path (None when it can)."""
        if self.path != "planned":
            return None if self.path not in PATHS else "the point asks for the captured path"
        from flint.passes.shard_annotate import EXPAND_FIELDS, check_plan_checkpointing

        try:
            self.plan.require(EXPAND_FIELDS, "shard-expand")
            check_plan_checkpointing(self.plan)
        except FlintError as e:
            return str(e)
        return None


def single_device_plan(plan: Plan) -> Plan:
    """The plan the planned path's single-device program of ``plan`` is captured under: one rank, and the
    fields that are the program's own (:data:`flint.plan.PROGRAM_FIELDS`)."""
    default = Plan()
    return Plan.from_dict({f: getattr(plan, f) for f in PROGRAM_FIELDS
                           if getattr(plan, f) != getattr(default, f)}, world_size=1)


def _file_sha256(model: str) -> str:
    """The content hash of a model file (``path.py[:function]``), "" for a zoo preset."""
    import hashlib

    from flint.capture.byom import is_model_file

    if not is_model_file(model):
        return ""
    path = model.partition(":")[0]
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError as e:
        raise FlintError(f"workload.model: cannot read {path}: {e.strerror}") from None


def capture_stage(workload: Workload, cache: CaptureCache, isolated: bool = False) -> tuple[str, bool]:
    """The step IR text of ``workload`` captured under its plan, and whether it came from the cache."""
    return _cached_capture(cache, workload.captured_key, workload.capture_inputs(), _capture_spec(workload, False),
                           isolated)


def single_capture_stage(workload: Workload, cache: CaptureCache, isolated: bool = False) -> tuple[str, bool]:
    """The single-device step IR text for ``workload``'s model and global shapes, and whether it was cached."""
    return _cached_capture(cache, workload.single_key, workload.single_inputs(), _capture_spec(workload, True),
                           isolated)


def _cached_capture(cache: CaptureCache, key: str, inputs: dict, spec: dict, isolated: bool) -> tuple[str, bool]:
    text = cache.get(key)
    if text is not None:
        return text, True
    with cache.lock(key):
        text = cache.get(key)  # another process may have captured it while we waited
        if text is not None:
            return text, True
        text = _capture_isolated(spec) if isolated else capture_program(spec)
        cache.put(key, text, inputs)
        return text, False


def _capture_spec(w: Workload, single: bool) -> dict[str, Any]:
    plan = single_device_plan(w.plan) if single else w.plan
    return {"model": w.model, "layers": w.layers, "dtype": w.dtype, "plan": plan.to_dict(),
            "shapes": {"tokens": [w.global_batch, w.seq_len], "labels": [w.global_batch, w.seq_len]}}


def capture_program(spec: Mapping[str, Any]) -> str:
    """Capture and import one step (``spec``: model (a zoo preset or a model file), layers, dtype, plan dict,
    GLOBAL shapes); the IR text."""
    from io import StringIO

    from xdsl.printer import Printer

    from flint.capture import capture_step
    from flint.capture.byom import file_inputs, model_factory
    from flint.importer import import_step

    fn, cfg, user_module = model_factory(spec["model"], spec["layers"], "workload.model", "workload.layers")
    plan = Plan.from_dict(spec["plan"])
    shapes = {k: tuple(v) for k, v in spec["shapes"].items()}
    # a model file: its example_inputs() (global shapes), else a causal LM's input_ids and labels
    inputs = shapes if cfg is not None else file_inputs(user_module, "workload.model")
    step = capture_step(fn, inputs, plan=plan, dtype=spec["dtype"], default_batch=shapes["tokens"])
    module = import_step(step)
    out = StringIO()
    Printer(stream=out, print_debuginfo=True).print_op(module)
    out.write("\n")
    return out.getvalue()


def _capture_isolated(spec: Mapping[str, Any]) -> str:
    """:func:`capture_program` in a fresh Python process (``python -m flint.explore.stages``) that ends afterwards.

    Two captures in one process can interfere (torch's caches, the fake
    process group's named groups); a process per capture keeps each one as
    ``flint capture`` runs it. Its cost is one interpreter and torch import
    per capture miss, small beside the capture itself. The child reads the
    spec as JSON on stdin, writes the IR to a temporary file and prints one
    JSON line (``{"ok": true}`` or ``{"error": ...}``) last on stdout.
    """
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="flint-capture-") as tmp:
        out = Path(tmp) / "step.mlir"
        proc = subprocess.run([sys.executable, "-m", "flint.explore.stages", str(out)], input=json.dumps(dict(spec)),
                              capture_output=True, text=True)
        last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        try:
            status = json.loads(last)
        except ValueError:
            status = {}
        if status.get("ok") and out.is_file():
            return out.read_text()
        if "error" in status:
            raise FlintError(status["error"])
        tail = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit status {proc.returncode}"
        raise FlintError(f"the capture process failed: {tail}")


def _capture_main(argv: list[str]) -> int:
    """The child of :func:`_capture_isolated`."""
    import json
    import sys

    from flint.fileio import write_text_atomic

    try:
        write_text_atomic(argv[0], capture_program(json.loads(sys.stdin.read())))
        status = {"ok": True}
    except BaseException as e:  # reported to the parent as text
        status = {"error": _message(e)}
    sys.stdout.write("\n" + json.dumps(status) + "\n")
    return 0


def parse_program(text: str, where: str):
    """The IR module of a cached program (``FlintError`` naming the cache file when it is damaged)."""
    from xdsl.parser import Parser
    from xdsl.utils.exceptions import ParseError

    from flint.ir import flint_context

    try:
        module = Parser(flint_context(), text, where).parse_module()
        module.verify()
    except ParseError as e:
        raise FlintError(f"{where}: damaged cache entry ({e.msg}); delete it to capture again") from None
    return module


def single_stage(text: str, where: str):
    """The parsed single-device module, with ``canonicalize-dist`` run (what expansion starts from)."""
    from xdsl.context import Context

    from flint.passes.canonicalize_dist import CanonicalizeDistPass

    module = parse_program(text, where)
    CanonicalizeDistPass().apply(Context(), module)
    return module


def expand_stage(single, plan: Plan):
    """``shard-annotate`` + ``shard-expand`` of a copy of ``single`` for ``plan`` (``single`` is kept).

    The plan is checked against the program first (TP divides heads and split
    dims, the data-parallel degree the batch); refusals are ``FlintError``.
    """
    from flint.passes.shard_annotate import annotate, check_model, check_single_device
    from flint.passes.shard_expand import expand
    from flint.sharding.rules import rules_for

    module = single.clone()
    check_single_device(module)
    rules = rules_for(module)
    check_model(module, plan, rules)
    annotate(module, plan, rules)
    expand(module, plan, rules)
    module.verify()
    return module


def passes_stage(module, spec: str, where: str = "") -> str:
    """Run the point's pipeline on ``module`` (in place, verifying after each pass); returns what ran.

    ``spec`` ``"default"`` is the plan's default pipeline (as ``flint estimate``
    without ``--passes``), ``""`` none, anything else a ``flint-opt`` pipeline.
    """
    from flint.schedule.pipelines import resolve, run_pipeline

    ran = resolve(module, None if spec == DEFAULT_PASSES else spec)
    run_pipeline(module, ran, where)
    return ran


@dataclass
class Lowered:
    """A program lowered for one device: its per-rank trace, mesh and peak memory."""

    trace: Any
    mesh: Any
    memory: Any  # flint.sim.lifetimes.StepMemory
    device_name: str
    passes: str = ""  # the pipeline that ran before lowering


def lower_stage(module, device_name: str, calibration: str | None = None) -> Lowered:
    """Peak memory from lifetimes, then ``canonicalize-dist`` + ``lower-to-chakra`` (on the device, with
    ``calibration``'s overrides) and SPMD expansion."""
    from xdsl.context import Context

    from flint.chakra.from_ir import mesh_of, trace_from_ir
    from flint.cost.device import device_argument
    from flint.passes.canonicalize_dist import CanonicalizeDistPass
    from flint.passes.lower_to_chakra import LowerToChakraPass
    from flint.sim.lifetimes import step_memory

    from flint.ir.aten import stage_roles

    # the pipeline rank that needs most, as `flint estimate` reports it
    memory = max((step_memory(module, None, role) for role in range(stage_roles(module))),
                 key=lambda m: m.report.peak_bytes)
    CanonicalizeDistPass().apply(Context(), module)
    with device_argument(device_name, calibration) as device:
        LowerToChakraPass(device=device).apply(Context(), module)
    return Lowered(trace_from_ir(module), mesh_of(module), memory, device_name)


@dataclass
class System:
    """The system axes of a point, resolved to models."""

    device: Any
    network: Any
    algorithm: str
    straggler_ranks: tuple[int, ...] = ()
    slowdown: float = 1.0

    @staticmethod
    def of(point: Mapping[str, Any], world_size: int) -> "System":
        from flint.cost import load_device, load_network

        device = load_device(point["system.device"], point.get("system.calibration") or None)
        net = load_network(point["system.network"])
        for key, value in sorted(point.items()):
            parts = key.split(".")
            if len(parts) == 3 and parts[1] == "bandwidth_gbits_per_s":
                net = net.with_link(parts[2], bandwidth_gbytes_per_s=value / 8.0)
            elif len(parts) == 3 and parts[1] == "latency_us":
                net = net.with_link(parts[2], latency_us=value)
        ranks = tuple(point.get("system.nic.ranks", ()))
        if ranks:
            _check_ranks("system.nic.ranks", ranks, world_size)
            net = net.with_nics(ranks, point["system.nic.dim"], point["system.nic.bandwidth_gbits_per_s"] / 8.0)
        stragglers = tuple(point.get("system.straggler.ranks", ()))
        _check_ranks("system.straggler.ranks", stragglers, world_size)
        return System(device, net, point.get("system.algorithm", "ring"), stragglers,
                      float(point.get("system.straggler.slowdown", 1.0)))


def _check_ranks(axis: str, ranks, world: int) -> None:
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise FlintError(f"{axis}: rank {bad[0]} is outside the world of {world} ranks")


def system_stage(lowered: Lowered, system: System):
    """The trace with straggler ranks' compute durations multiplied by the slowdown (shared tables untouched)."""
    trace = lowered.trace
    if not system.straggler_ranks or system.slowdown == 1.0:
        return trace
    try:
        return trace.with_compute_scaled(system.slowdown, system.straggler_ranks)
    except ValueError:
        raise FlintError("a straggler needs compute durations on every compute node") from None


def estimate_stage(lowered: Lowered, system: System, workload: Workload) -> dict[str, Any]:
    """Simulate one iteration; the outputs of a point (all per rank unless named otherwise)."""
    from flint.sim import simulate

    trace = system_stage(lowered, system)
    res = simulate(trace, system.device, system.network, lowered.mesh, algorithm=system.algorithm)
    mem = lowered.memory.report
    capacity = system.device.hbm_capacity_bytes
    out: dict[str, Any] = {
        "gpus": res.world_size,
        "iteration_time_us": res.iteration_time_us,
        "compute_us": float(res.compute_busy_us.max()),
        "comm_us": float(res.comm_time_us.max()),
        "exposed_comm_us": float(res.exposed_comm_us.max()),
        "mfu": res.mfu,
        "tokens_per_s": workload.global_batch * workload.seq_len / (res.iteration_time_us * 1e-6)
        if res.iteration_time_us > 0 else math.inf,
        "peak_memory_bytes": int(mem.peak_bytes),
        "hbm_capacity_bytes": int(capacity),
        "fits": bool(mem.peak_bytes <= capacity),
        "simulated_ranks": len(res.simulated_ranks),
        "sim_wall_s": res.wall_s,
    }
    for c in MEMORY_CATEGORIES:
        out[f"mem_{c}_bytes"] = int(mem.at_peak_bytes.get(c, 0))
    return out


@dataclass
class Program:
    """A point's per-rank program before passes: how it was made, and a way to get a fresh copy."""

    key: str
    path: str          # "planned" or "captured"
    note: str          # why a planned point took the captured path ("" otherwise)
    hit: bool | None   # capture cache hit (of the single-device or the per-plan capture)


class Evaluator:
    """Evaluates points, reusing captures (disk + memory), expansions and lowered traces (memory) across them."""

    def __init__(self, cache_root=None, max_lowered: int = 8, isolate_captures: bool = True) -> None:
        self.cache = CaptureCache(cache_root)
        self.isolate_captures = isolate_captures
        self._texts: OrderedDict[str, str] = OrderedDict()      # captured program text per key
        self._singles: OrderedDict[str, Any] = OrderedDict()    # single-device module per key
        self._expanded: OrderedDict[str, Any] = OrderedDict()   # expanded module per program key
        self._lowered: OrderedDict[tuple, Lowered] = OrderedDict()
        self._failed: dict[str, str] = {}
        self.max_lowered = max_lowered

    @staticmethod
    def _remember(cache: OrderedDict, key, value, size: int) -> None:
        cache[key] = value
        while len(cache) > size:
            cache.popitem(last=False)

    def _captured_text(self, w: Workload, single: bool) -> tuple[str, bool]:
        key = w.single_key if single else w.captured_key
        if key in self._failed:  # the same program failed to capture for an earlier point: not again
            raise FlintError(self._failed[key])
        text = self._texts.get(key)
        if text is not None:
            return text, True
        try:
            stage = single_capture_stage if single else capture_stage
            text, hit = stage(w, self.cache, self.isolate_captures)
        except Exception as e:
            what = "single-device capture" if single else "capture"
            self._failed[key] = f"{what}: {_message(e)}"
            raise FlintError(self._failed[key]) from None
        self._remember(self._texts, key, text, 4)
        return text, hit

    def program(self, w: Workload) -> tuple[Program, Any]:
        """The point's program and a function returning a fresh module of it (passes and lowering mutate)."""
        note = w.planned_refusal() if w.path == "planned" else ""
        if w.path == "planned" and note is None:
            key = w.key
            expanded = self._expanded.get(key)
            if key in self._failed:
                note = self._failed[key]
            elif expanded is not None:
                return Program(key, "planned", "", True), expanded.clone
            else:
                # a single-device capture or an expansion that fails sends the point down the captured path
                try:
                    text, hit = self._captured_text(w, single=True)
                    single = self._singles.get(w.single_key)
                    if single is None:
                        single = single_stage(text, str(self.cache.path(w.single_key)))
                        self._remember(self._singles, w.single_key, single, 2)
                    expanded = expand_stage(single, w.plan)
                except FlintError as e:
                    msg = str(e)
                    self._failed[key] = note = msg if msg.startswith("single-device") else f"shard-expand: {msg}"
                else:
                    self._remember(self._expanded, key, expanded, 4)
                    return Program(key, "planned", "", hit), expanded.clone
        try:
            text, hit = self._captured_text(w, single=False)
        except FlintError as e:
            if not note:
                raise
            raise FlintError(f"{note}; then the captured path: {e}") from None  # why neither way in builds it
        where = str(self.cache.path(w.captured_key))
        return Program(w.captured_key, "captured", note or "", hit), lambda: parse_program(text, where)

    def evaluate(self, point: Mapping[str, Any]) -> dict[str, Any]:
        """``{status, outputs, error, capture_hit, eval_s}`` for one point; never raises for a bad point."""
        t0 = time.perf_counter()
        hit = None
        try:
            workload = Workload.of(point)
            prog, fresh = self.program(workload)
            hit = prog.hit
            calibration = point.get("system.calibration") or None
            lkey = (prog.key, workload.passes, point["system.device"], calibration)
            lowered = self._lowered.get(lkey)
            if lowered is None:
                module = fresh()
                ran = passes_stage(module, workload.passes)
                lowered = lower_stage(module, point["system.device"], calibration)
                lowered.passes = ran
                self._remember(self._lowered, lkey, lowered, self.max_lowered)
            system = System.of(point, lowered.trace.world_size)
            outputs = estimate_stage(lowered, system, workload)
            outputs.update({"path": prog.path, "path_note": prog.note, "passes_run": lowered.passes})
            return {"status": "ok", "outputs": outputs, "error": None, "capture_hit": hit,
                    "eval_s": time.perf_counter() - t0}
        except Exception as e:  # recorded with the point; the sweep goes on
            msg = _message(e)
        return {"status": "error", "outputs": None, "error": msg, "capture_hit": hit,
                "eval_s": time.perf_counter() - t0}


def _message(e: BaseException) -> str:
    """A FlintError's message, or an unexpected error's type, first line and origin."""
    if isinstance(e, FlintError):
        return str(e)
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {tb[-1].filename}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}{where}"


_EVALUATORS: dict[str, Evaluator] = {}


def evaluate_chunk(points: list[tuple[str, dict]], cache_root: str | None) -> list[tuple[str, dict]]:
    """Evaluate ``[(point_id, point), ...]`` in this process (one evaluator per process, reused across chunks)."""
    ev = _EVALUATORS.get(cache_root or "")
    if ev is None:
        ev = _EVALUATORS[cache_root or ""] = Evaluator(cache_root)
    return [(pid, ev.evaluate(p)) for pid, p in points]


if __name__ == "__main__":
    import sys

    sys.exit(_capture_main(sys.argv[1:]))
