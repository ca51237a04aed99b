"""Evaluating one design point: capture -> passes -> lower -> estimate, one function per stage.

A point's *workload* axes decide the captured program (model, depth, dtype,
plan, global batch and sequence length -> local shapes) and the scheduling
passes run on it; its *system* axes (device, network, per-dimension
bandwidth and latency, degraded NICs, stragglers, collective algorithm)
are variants of one trace. The stages:

- :func:`capture_stage`: the step IR from the content-addressed
  :class:`~flint.explore.cache.CaptureCache`, capturing (and storing) it on
  a miss; the same program is captured once across points, runs and
  processes.
- :func:`passes_stage`: a ``flint-opt`` pipeline (any pass in
  :mod:`flint.passes.registry`, plug-ins included) on the captured module.
- :func:`lower_stage`: peak memory from tensor lifetimes, then
  ``canonicalize-dist`` + ``lower-to-chakra`` on the device and the SPMD
  expansion into a per-rank trace (what ``flint estimate`` does).
- :func:`system_stage`: the network with the point's bandwidth, latency and
  NIC overrides, and the trace with straggler ranks' compute slowed.
- :func:`estimate_stage`: the embedded simulator; the outputs of a point.

:class:`Evaluator` chains them and keeps what a later point can reuse in
memory (the parsed program per capture, the lowered trace per
(program, passes, device)), so system-only variation costs one simulation
per point. When the planned path (``shard-expand``) and pipeline stages land,
they slot in as a stage between capture and lowering.
"""

from __future__ import annotations

import dataclasses
import math
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping

from flint.errors import FlintError
from flint.explore.cache import CaptureCache, capture_key
from flint.plan import Plan

MEMORY_CATEGORIES = ("params", "grads", "optimizer", "activations", "comm", "other")


@dataclass(frozen=True)
class Workload:
    """What is captured and scheduled for a point (its ``workload.*`` axes)."""

    model: str
    layers: int | None
    dtype: str
    global_batch: int
    seq_len: int
    plan: Plan
    passes: str

    @staticmethod
    def of(point: Mapping[str, Any]) -> "Workload":
        from flint.explore.space import plan_of_point

        plan = plan_of_point(point)
        gb = point.get("workload.global_batch")
        return Workload(point["workload.model"], point.get("workload.layers"), point.get("workload.dtype", "bfloat16"),
                        int(gb) if gb is not None else plan.dp, int(point.get("workload.seq_len", 64)), plan,
                        point.get("workload.passes", ""))

    def capture_inputs(self) -> dict[str, Any]:
        """What decides the captured program: model, depth, dtype, plan, local shapes."""
        local = (self.global_batch // self.plan.dp, self.seq_len)
        return {"model": self.model, "layers": self.layers, "dtype": self.dtype, "plan": self.plan.to_dict(),
                "local_shapes": {"tokens": list(local), "labels": list(local)}, "recipe": "flint.capture.capture_step"}

    @property
    def key(self) -> str:
        return capture_key(self.capture_inputs())


def capture_stage(workload: Workload, cache: CaptureCache) -> tuple[str, bool]:
    """The step IR text of ``workload`` and whether it came from the cache (captured and stored on a miss)."""
    key = workload.key
    text = cache.get(key)
    if text is not None:
        return text, True
    with cache.lock(key):
        text = cache.get(key)  # another process may have captured it while we waited
        if text is not None:
            return text, True
        text = _capture(workload)
        cache.put(key, text, workload.capture_inputs())
        return text, False


def _capture(w: Workload) -> str:
    from io import StringIO

    from xdsl.printer import Printer

    from flint.capture import capture_step
    from flint.importer import import_step
    from flint.models import factory

    overrides = {"n_layers": w.layers} if w.layers is not None else {}
    shapes = {"tokens": (w.global_batch, w.seq_len), "labels": (w.global_batch, w.seq_len)}
    step = capture_step(factory(w.model, **overrides), shapes, plan=w.plan, dtype=w.dtype)
    module = import_step(step)
    out = StringIO()
    Printer(stream=out, print_debuginfo=True).print_op(module)
    out.write("\n")
    return out.getvalue()


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


def passes_stage(module, spec: str):
    """Run the ``flint-opt`` pipeline ``spec`` on ``module`` (in place) and verify; returns the module."""
    from flint.explore.space import parse_passes
    from flint.ir import flint_context

    pipeline = parse_passes(spec)
    if pipeline.passes:
        pipeline.apply(flint_context(), module)
        module.verify()
    return module


@dataclass
class Lowered:
    """A program lowered for one device: its per-rank trace, mesh and peak memory."""

    trace: Any
    mesh: Any
    memory: Any  # flint.sim.lifetimes.StepMemory
    device_name: str


def lower_stage(module, device_name: str) -> Lowered:
    """Peak memory from lifetimes, then ``canonicalize-dist`` + ``lower-to-chakra`` and SPMD expansion."""
    from xdsl.context import Context

    from flint.chakra.from_ir import mesh_of, trace_from_ir
    from flint.passes.canonicalize_dist import CanonicalizeDistPass
    from flint.passes.lower_to_chakra import LowerToChakraPass
    from flint.sim.lifetimes import step_memory

    memory = step_memory(module)
    CanonicalizeDistPass().apply(Context(), module)
    LowerToChakraPass(device=device_name).apply(Context(), module)
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

        device = load_device(point["system.device"])
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
    import numpy as np

    from flint.trace import NodeKind, RankProgram, Trace

    trace = lowered.trace
    if not system.straggler_ranks or system.slowdown == 1.0:
        return trace
    ranks = list(trace.ranks)
    slowed: dict[int, Any] = {}
    for r in system.straggler_ranks:
        prog = ranks[r]
        t = prog.table
        if id(t) not in slowed:
            comp = t.kind == NodeKind.COMP
            if np.isnan(t.duration_us[comp]).any():
                raise FlintError("a straggler needs compute durations on every compute node")
            dur = np.where(comp, t.duration_us * system.slowdown, t.duration_us)
            slowed[id(t)] = dataclasses.replace(t, duration_us=dur)
        ranks[r] = RankProgram(slowed[id(t)], prog.group_ids, prog.peer_ranks)
    return Trace(trace.world_size, ranks, trace.comm_groups)


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


class Evaluator:
    """Evaluates points, reusing captures (disk + memory) and lowered traces (memory) across them."""

    def __init__(self, cache_root=None, max_lowered: int = 8) -> None:
        self.cache = CaptureCache(cache_root)
        self._texts: OrderedDict[str, str] = OrderedDict()
        self._lowered: OrderedDict[tuple, Lowered] = OrderedDict()
        self._failed: dict[str, str] = {}
        self.max_lowered = max_lowered

    def evaluate(self, point: Mapping[str, Any]) -> dict[str, Any]:
        """``{status, outputs, error, capture_hit, eval_s}`` for one point; never raises for a bad point."""
        t0 = time.perf_counter()
        hit = None
        try:
            workload = Workload.of(point)
            key = workload.key
            if key in self._failed:  # the same program failed to capture for an earlier point: not again
                raise FlintError(self._failed[key])
            text = self._texts.get(key)
            if text is None:
                try:
                    text, hit = capture_stage(workload, self.cache)
                except Exception as e:
                    self._failed[key] = f"capture: {_message(e)}"
                    raise FlintError(self._failed[key]) from None
                self._texts[key] = text
                while len(self._texts) > 4:
                    self._texts.popitem(last=False)
            else:
                hit = True
            lkey = (key, workload.passes, point["system.device"])
            lowered = self._lowered.get(lkey)
            if lowered is None:
                module = parse_program(text, str(self.cache.path(key)))
                passes_stage(module, workload.passes)
                lowered = lower_stage(module, point["system.device"])
                self._lowered[lkey] = lowered
                while len(self._lowered) > self.max_lowered:
                    self._lowered.popitem(last=False)
            system = System.of(point, lowered.trace.world_size)
            outputs = estimate_stage(lowered, system, workload)
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
