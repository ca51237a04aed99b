"""Flint's peak memory per rank against PyTorch's own memory trackers, on fake tensors.

One case is a model preset, a recipe (``dp``, ``fsdp``, ``fsdp+tp``, ...), a
world size and an activation-checkpointing mode. Two sides:

- **tracker**: the same model run *eagerly* on ``FakeTensorMode`` (no real
  memory, no data) over a fake process group of the case's world size, as
  rank 0, parallelized with PyTorch's own APIs exactly as ``flint validate``
  runs it for real (:func:`flint.validate.worker.parallelize`: ``fully_shard``,
  ``parallelize_module``, ``checkpoint_wrapper`` with the recipe's AC policy),
  AdamW (for-loop form, as Flint captures it).
  Two training steps (forward, backward, ``optimizer.step``,
  ``zero_grad``), so the second one runs with optimizer state, under
  ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` (FSDP roots)
  or ``torch.distributed._tools.mem_tracker.MemTracker`` (TP alone, DP).
  This is how torchtitan's ``scripts/estimate/estimation.py``
  runs the tracker. The tracker's peak is the largest live tensor memory it
  saw (CPU fake tensors: exact bytes, no 512-byte rounding of the CUDA
  caching allocator; no allocator cache, no fragmentation).
  DP (``dp`` without TP): DDP does not run on fake tensors (its C++ reducer
  needs real storage) and FSDP2's ``replicate`` keeps an unsharded copy of
  every parameter that DDP does not, so the reference is the single-rank
  model (with the recipe's AC) under ``MemTracker``: DDP's memory with
  ``gradient_as_bucket_view=True`` (buckets are the gradients). DDP's
  default (``False``) holds one more gradient-sized set of bucket buffers
  (DDP's documentation), which neither side counts.
  DTensor's sharding propagation derives output metadata on global-shape
  tensors in the active fake mode; entered under ours, the tracker would
  count them (the whole embedding three times in Llama-3 8B's AdamW step),
  so it runs with a fake mode of its own here, as in a real run.
- **Flint**: :func:`flint.capture.capture_step` of the same model, plan and
  global batch (``MemoryCase.partitioner``: ``min-cut``, what ``torch.compile``
  saves for the backward, or ``eager``, what eager autograd saves, as the
  tracker's eager run does; :mod:`flint.capture.partition`), imported, the default pass pipeline ``flint estimate``
  applies (:func:`flint.schedule.pipelines.resolve`: FSDP2's prefetch, DDP
  bucketing), then :func:`flint.sim.lifetimes.step_memory`.

The peaks are compared in total and by category, the tracker's categories
mapped to Flint's (:data:`TRACKER_TO_FLINT`). Runtime overheads neither side
sees (CUDA context, NCCL buffers, allocator fragmentation) are named
parameters in ``flint/devices/runtime/memory.toml`` (:func:`runtime_overheads`),
reported next to the peak, never part of the comparison.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from flint.errors import FlintError
from flint.tomlio import parse_toml

#: the tracker's reference types -> Flint's memory categories (flint.sim.memory.CATEGORIES)
TRACKER_TO_FLINT = {
    # MemTracker (torch.distributed._tools.mem_tracker._MemRefType)
    "Parameter": "params", "Buffer": "other", "Gradient": "grads", "Activation": "activations",
    "Temp": "activations", "Optstate": "optimizer", "Other": "other",
    # FSDPMemTracker (torch.distributed._tools.fsdp2_mem_tracker._FSDPRefType)
    "Sharded Param": "params", "Unsharded Param": "comm", "Sharded Grad": "grads",
    "Unsharded Grad": "comm", "All Gather": "comm", "Reduce Scatter": "comm", "OptState": "optimizer",
    "Inputs": "other",
}
AC_MODES = ("none", "selective-op", "selective-layer", "full")
RUNTIME_MEMORY_TOML = Path(__file__).resolve().parent.parent / "devices" / "runtime" / "memory.toml"


@dataclass(frozen=True)
class MemoryCase:
    """One configuration: model preset, recipe, world size, AC mode, global batch (sequences, tokens)."""

    model: str
    plan: str
    world_size: int
    ac: str = "none"
    ac_every: int = 2
    layers: int | None = None  # override the preset's depth (None: the preset's)
    batch: tuple[int, int] | None = None  # global (sequences, tokens); None: 2 sequences of 64 per DP rank
    tp: int = 2  # TP degree of 2-D recipes (fsdp+tp)
    partitioner: str = "min-cut"  # Flint's capture: what the backward saves (flint.capture.partition)
    loss_parallel: bool = False  # the plan's loss_parallel (TP recipes): the loss on vocabulary-sharded logits

    def flint_plan(self):
        from flint.plan import Plan, from_recipe

        if self.plan == "hsdp":  # FSDP2's HSDP: 2 replicas, parameters sharded within each
            if self.world_size % 2 or self.world_size < 4:
                raise FlintError(f"hsdp needs an even world size >= 4 (2 replicas), got {self.world_size}")
            p = Plan.from_dict({"dp_replicate": 2, "dp_shard": self.world_size // 2}, world_size=self.world_size)
        else:
            p = from_recipe(self.plan, self.world_size, self.tp)
        every = self.ac_every if self.ac == "selective-layer" else 1
        return dataclasses.replace(p, activation_checkpoint=self.ac, ac_every=every, loss_parallel=self.loss_parallel)

    def global_batch(self) -> tuple[int, int]:
        return self.batch if self.batch is not None else (2 * self.flint_plan().dp, 64)

    def label(self) -> str:
        ac = self.ac + (f"({self.ac_every})" if self.ac == "selective-layer" else "")
        depth = f" L{self.layers}" if self.layers is not None else ""
        part = f" partitioner={self.partitioner}" if self.partitioner != "min-cut" else ""
        part += " loss_parallel" if self.loss_parallel else ""
        return f"{self.model}{depth} {self.plan} w{self.world_size} ac={ac}{part}"


@dataclass(frozen=True)
class Peak:
    """A peak per rank, with its split by Flint category at the peak (and the raw split, if any)."""

    total_bytes: int
    categories: dict[str, int]
    raw: dict[str, int] = field(default_factory=dict)
    where: str = ""


@dataclass(frozen=True)
class MemoryComparison:
    case: MemoryCase
    flint: Peak
    tracker: Peak
    tracker_name: str

    @property
    def gap(self) -> float:
        """(Flint - tracker) / tracker."""
        return (self.flint.total_bytes - self.tracker.total_bytes) / self.tracker.total_bytes

    def within(self, tolerance: float = 0.05) -> bool:
        return abs(self.gap) <= tolerance


# ------------------------------------------------------------------------- Flint


def flint_peak(case: MemoryCase) -> Peak:
    """Flint's peak per rank for ``case`` (capture, import, default pipeline, tensor lifetimes)."""
    from flint.capture import capture_step
    from flint.importer import import_step
    from flint.models import factory
    from flint.schedule.pipelines import resolve, run_pipeline
    from flint.sim.lifetimes import step_memory

    overrides = {"n_layers": case.layers} if case.layers is not None else {}
    b = case.global_batch()
    step = capture_step(factory(case.model, **overrides), {"tokens": b, "labels": b}, plan=case.flint_plan(),
                        partitioner=case.partitioner)
    module = import_step(step)
    run_pipeline(module, resolve(module, None))
    mem = step_memory(module)
    where = f"@{mem.peak_function} iteration {mem.peak_iteration} op {mem.peak_op_index} ({mem.peak_op})"
    return Peak(mem.report.peak_bytes, dict(mem.report.at_peak_bytes), where=where)


# ----------------------------------------------------------------------- tracker


def _fsdp_mem_tracker_class():
    """``FSDPMemTracker`` whose post-backward wrapper does not keep an unsharded gradient alive.

    torch 2.13's wrapper of ``FSDPParamGroup.post_backward`` tags each unsharded gradient in a
    loop whose variable (``unsharded_grad``) stays bound, to the group's *last* parameter's
    gradient, while the real ``post_backward`` runs. FSDP2 drops its own references before the
    reduce-scatter (``fsdp_param.unsharded_param.grad = None``; ``foreach_reduce``'s
    ``unsharded_grads.clear()`` after the copy-in), so in a real run that gradient is freed there,
    under the tracker it is counted through ``foreach_reduce``: e.g. Llama-3 8B's full-vocabulary
    embedding gradient (2 GB, before its tensor-parallel Shard(0) redistribution) at the
    reduce-scatter input and output allocations, +525 MB at the peak. This wrapper is the
    tracker's own, with that reference dropped before the call.
    """
    from functools import wraps

    from torch.distributed._tools.fsdp2_mem_tracker import (FSDPMemTracker, _FSDPModState, _FSDPRefType,
                                                            _FSDPState)

    class Tracker(FSDPMemTracker):
        def _fsdp_param_group_post_backward(self, fsdp_mod, orig_fsdp_param_group_post_backward):
            @wraps(orig_fsdp_param_group_post_backward)
            def inner(*args, **kwargs):
                fsdp_state = fsdp_mod._get_fsdp_state()
                if fsdp_param_group := fsdp_state._fsdp_param_group:
                    for fsdp_param in fsdp_param_group.fsdp_params:
                        if fsdp_param._unsharded_param.grad is not None:
                            self._update_and_maybe_create_winfos(fsdp_param._unsharded_param.grad,
                                                                 _FSDPRefType.UNSHARDED_GRAD, update_existing=True)
                mod_stat = self.memory_tracking[fsdp_mod]
                mod_stat.snapshots.setdefault(_FSDPModState.BEF_POST_BW, []).append(self.get_tracker_snapshot())
                self._fsdp_state = _FSDPState.POST_BW
                orig_fsdp_param_group_post_backward(*args, **kwargs)
                if fsdp_param_group := fsdp_state._fsdp_param_group:
                    for fsdp_param in fsdp_param_group.fsdp_params:
                        if fsdp_param.sharded_param.grad is not None:
                            self._update_and_maybe_create_winfos(fsdp_param.sharded_param.grad,
                                                                 _FSDPRefType.SHARDED_GRAD)
                mod_stat.snapshots.setdefault(_FSDPModState.AFT_POST_BW, []).append(self.get_tracker_snapshot())

            return inner

    return Tracker


def tracker_peak(case: MemoryCase) -> tuple[Peak, str]:
    """The tracker's peak per rank for ``case`` and the tracker's name (module docstring)."""
    from unittest import mock

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.tensor import _sharding_prop
    from torch.distributed.fsdp import FSDPModule

    from flint.capture.fake_dist import device_mesh, fake_world
    from flint.capture.recipes import ac_layers, ac_wrap, data_parallel_mode, loss_context
    from flint.models import build
    from flint.validate.worker import BETAS, EPS, LR, WEIGHT_DECAY, parallelize

    plan = case.flint_plan()
    fmesh = plan.mesh()
    overrides = {"n_layers": case.layers} if case.layers is not None else {}
    batch, seq = case.global_batch()
    dp = plan.dp
    with fake_world(case.world_size):
        mesh = device_mesh(fmesh.shape, fmesh.axis_names)
        # built on meta and parallelized outside fake mode (DeviceMesh needs real rank maps), then
        # materialized as fake CPU tensors, as torchtitan's estimation script does (to_empty)
        with torch.device("meta"):
            model = build(case.model, **overrides)
        if data_parallel_mode(plan) == "dp" and plan.tp == 1:
            # DDP does not run on fake tensors (its C++ reducer needs real storage), and FSDP2's
            # replicate keeps an unsharded copy of every parameter that DDP does not. DDP's memory is
            # the single-rank model's (module docstring): track that, with the recipe's AC.
            for i in ac_layers(plan, len(model.layers)):
                model.layers[i] = ac_wrap(model.layers[i], plan)
        else:
            parallelize(model, plan, mesh)
        with FakeTensorMode(allow_non_fake_inputs=True), torch.device("cpu"):
            model.to_empty(device="cpu")
            opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                    foreach=False)
            vocab = model.config.vocab_size
            tokens = torch.randint(0, vocab, (batch // dp, seq))
            labels = torch.randint(0, vocab, (batch // dp, seq))
            if isinstance(model, FSDPModule):
                tracker, name = _fsdp_mem_tracker_class()(model, opt), "FSDPMemTracker"
                tracker.track_inputs((tokens, labels))
            else:
                tracker, name = MemTracker(), "MemTracker"
                tracker.track_external(model, opt, tokens, labels)
            # DTensor's sharding propagation builds global-shape tensors to derive output metadata,
            # in the active fake mode if there is one: here ours, so the tracker would count them as
            # memory (e.g. three full 2 GB embedding-shaped tensors in Llama-3 8B's AdamW step). In
            # a real run it uses a FakeTensorMode of its own, which the tracker skips; so here too.
            with tracker, mock.patch.object(_sharding_prop, "detect_fake_mode", lambda *a, **k: None):
                for it in range(2):  # the first step creates the optimizer state
                    # torchtitan's train context: forward and backward under loss_parallel
                    with loss_context(plan):
                        loss = model(tokens, labels)
                        loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    if it == 0:
                        tracker.reset_mod_stats()
            snap = tracker.get_tracker_snapshot("peak")
    dev = next(iter(snap))
    raw = {str(getattr(k, "value", k)): int(v) for k, v in snap[dev].items()}
    total = raw.pop("Total")
    cats: dict[str, int] = {}
    for k, v in raw.items():
        c = TRACKER_TO_FLINT.get(k, "other")
        cats[c] = cats.get(c, 0) + v
    return Peak(total, cats, raw), name


def compare_case(case: MemoryCase) -> MemoryComparison:
    """Both peaks of ``case``."""
    tracker, name = tracker_peak(case)
    return MemoryComparison(case, flint_peak(case), tracker, name)


# ----------------------------------------------------------- runtime overheads


@dataclass(frozen=True)
class RuntimeOverheads:
    """Memory a real run holds beyond its live tensors (``flint/devices/runtime/memory.toml``)."""

    cuda_context_bytes: int
    nccl_bytes_per_communicator: int
    fragmentation_fraction: float
    sources: dict[str, str]

    def total_bytes(self, peak_bytes: int, communicators: int) -> int:
        """Overhead on top of ``peak_bytes`` live tensor memory with ``communicators`` NCCL communicators."""
        return (self.cuda_context_bytes + communicators * self.nccl_bytes_per_communicator
                + int(math.ceil(self.fragmentation_fraction * peak_bytes)))


_OVERHEAD_KEYS = {"cuda_context_mib": (0.0, 16384.0), "nccl_mib_per_communicator": (0.0, 16384.0),
                  "fragmentation_fraction": (0.0, 1.0)}


def runtime_overheads(device: str = "default", path: Path | str = RUNTIME_MEMORY_TOML) -> RuntimeOverheads:
    """The named overheads of ``device`` (its own table, else ``[default]``), each key range-checked."""
    where = str(path)
    try:
        data = parse_toml(Path(path).read_bytes())
    except OSError as e:
        raise FlintError(f"{where}: cannot read ({e.strerror})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise FlintError(f"{where}: not valid TOML ({e})") from None
    table = dict(data.get("default", {}))
    table.update(data.get(device, {}))
    values = {}
    for key, (lo, hi) in _OVERHEAD_KEYS.items():
        v = table.get(key)
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise FlintError(f"{where}: [{device}] {key} is missing or not a number (valid range {lo}..{hi})")
        if not lo <= v <= hi:
            raise FlintError(f"{where}: [{device}] {key} = {v} is out of range (valid range {lo}..{hi})")
        values[key] = float(v)
    sources = {k: str(v) for k, v in table.items() if k.endswith("_source")}
    return RuntimeOverheads(int(values["cuda_context_mib"] * 2**20), int(values["nccl_mib_per_communicator"] * 2**20),
                            values["fragmentation_fraction"], sources)


def communicators(case: MemoryCase) -> int:
    """NCCL communicators a rank of ``case`` opens: one per mesh axis of size > 1."""
    return sum(1 for s in case.flint_plan().mesh().shape if s > 1)


# -------------------------------------------------------------------- reporting


def table(results: list[MemoryComparison], overheads: RuntimeOverheads | None = None) -> str:
    """A Markdown table: per case, both peaks (MiB), the gap, and the per-category split."""
    mib = 2**20
    head = "| case | tracker | Flint | gap | params F/T | grads F/T | optim F/T | act F/T | comm F/T |"
    if overheads is not None:
        head += " Flint + runtime overheads |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        def pair(c: str) -> str:
            return f"{r.flint.categories.get(c, 0) / mib:.2f} / {r.tracker.categories.get(c, 0) / mib:.2f}"

        row = (f"| {r.case.label()} | {r.tracker.total_bytes / mib:.2f} | {r.flint.total_bytes / mib:.2f} | "
               f"{100 * r.gap:+.1f}% | {pair('params')} | {pair('grads')} | {pair('optimizer')} | "
               f"{pair('activations')} | {pair('comm')} |")
        if overheads is not None:
            extra = overheads.total_bytes(r.flint.total_bytes, communicators(r.case))
            row += f" {(r.flint.total_bytes + extra) / mib:.1f} |"
        lines.append(row)
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------- one case, fresh process


def _to_json(r: MemoryComparison) -> dict:
    return {"case": dataclasses.asdict(r.case), "tracker_name": r.tracker_name,
            "flint": dataclasses.asdict(r.flint), "tracker": dataclasses.asdict(r.tracker)}


def _from_json(d: dict) -> MemoryComparison:
    c = dict(d["case"])
    if c.get("batch") is not None:
        c["batch"] = tuple(c["batch"])
    return MemoryComparison(MemoryCase(**c), Peak(**d["flint"]), Peak(**d["tracker"]), d["tracker_name"])


def compare_in_subprocess(case: MemoryCase, timeout_s: float = 900.0) -> MemoryComparison:
    """:func:`compare_case` in a fresh Python process (each capture and each fake world starts clean)."""
    import json
    import subprocess
    import sys

    arg = json.dumps(dataclasses.asdict(case))
    try:
        proc = subprocess.run([sys.executable, "-m", "flint.validate.memory", arg], capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise FlintError(f"{case.label()}: memory check timed out after {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        last = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-1:] or ["(no output)"]
        raise FlintError(f"{case.label()}: memory check failed: {last[0]}")
    return _from_json(json.loads(proc.stdout.strip().splitlines()[-1]))


def _main(argv: list[str]) -> int:
    import json

    d = json.loads(argv[0])
    if d.get("batch") is not None:
        d["batch"] = tuple(d["batch"])
    print(json.dumps(_to_json(compare_case(MemoryCase(**d)))))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(_main(sys.argv[1:]))
