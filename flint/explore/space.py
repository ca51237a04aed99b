"""The declarative design space of ``flint explore``: axes, constraints, search settings.

A space file is TOML::

    name = "bandwidth-sweep"

    [search]
    strategy = "grid"            # grid | random | optuna
    samples = 40                 # random / optuna: how many points
    seed = 0
    objectives = ["iteration_time_us", "peak_memory_bytes", "gpus"]   # all minimized

    [workload]                   # what is captured (and how it is scheduled)
    model = "llama-tiny"         # a scalar is one value; a list is an axis; a zoo preset, or
                                 # "path/to/model.py[:function]" (a model factory, relative to this
                                 # file; its batch: the file's example_inputs(), else input_ids and
                                 # labels of global_batch x seq_len)
    layers = 2
    global_batch = [16, 32]
    seq_len = 64
    world_size = { log2 = [8, 64] }          # 8, 16, 32, 64
    passes = ["default", ""]     # pipeline before lowering: "default" (the default, as `flint estimate`
                                 # applies for the plan), "" (none) or any flint-opt pipeline
    path = "planned"             # planned: capture once on one device, shard-expand per plan (falls
                                 # back to captured, reason recorded, where expansion cannot); captured
    [workload.plan]              # any field of flint.plan.Plan
    dp_shard = -1
    tp = [1, 2]

    [system]                     # how it runs: variants of one trace
    device = ["h100-sxm", "b200"]
    network = "dgx-h100"
    algorithm = "ring"
    calibration = ["", "fitted"]  # optional: "" the device's own; "fitted" each device's fitted one; a
                                 # --calibration override (a shipped one by name, or a TOML path
                                 # relative to this file)
    [system.bandwidth_gbits_per_s]           # per network dimension
    ib = { start = 100, stop = 400, step = 100 }
    [system.latency_us]
    ib = [2.0, 5.0]
    [system.nic]                 # a degraded NIC on some ranks
    ranks = [0]
    dim = "ib"
    bandwidth_gbits_per_s = [400, 200, 100]
    [system.straggler]           # ranks whose compute runs slower
    ranks = [3]
    slowdown = [1.0, 1.5]

    [constraints]
    memory_fits = true           # prune plans whose lower-bound memory exceeds the device
    max_gpus = 1024

    [[report.line]]              # line plots: y against x, one line per series
    x = "system.bandwidth_gbits_per_s.ib"
    y = "iteration_time_us"
    series = "workload.world_size"

    [report.reference]           # a point to compare the fastest fitting point with (quote dotted names)
    "workload.plan.tp" = 8

Values: a scalar, a list, ``{ values = [...] }``, an inclusive range
``{ start, stop, step }`` or powers of two ``{ log2 = [lo, hi] }``. Axes
whose one value is itself a list (``plan.order``, ``plan.pp_layers``,
``nic.ranks``, ``straggler.ranks``) take a list of lists as several values.

A *point* maps every axis name (``workload.plan.tp``,
``system.bandwidth_gbits_per_s.ib``, ...) to one value. Its identity is the
hash of all its resolved inputs, so the same point in two runs (or two
strategies) is evaluated once. Everything is checked when the file is read:
an unknown axis or field, an empty range, a value of the wrong type, a network
dimension the network does not have; errors name the file and the axis.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import itertools
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

from flint.errors import FlintError
from flint.tomlio import parse_toml
from flint.plan import Plan, PlanError

STRATEGIES = ("grid", "random", "optuna")
OBJECTIVES = ("iteration_time_us", "peak_memory_bytes", "gpus", "exposed_comm_us", "neg_mfu")
WORKLOAD_KEYS = {"model": str, "layers": int, "global_batch": int, "seq_len": int, "world_size": int,
                 "dtype": str, "passes": str, "path": str}
WORKLOAD_DEFAULTS = {"layers": None, "dtype": "bfloat16", "passes": "default", "global_batch": None, "seq_len": 64,
                     "path": "planned"}
PATHS = ("planned", "captured")
SYSTEM_KEYS = {"device": str, "network": str, "algorithm": str, "calibration": str}  # calibration: optional
SYSTEM_DEFAULTS = {"device": "h100-sxm", "network": "dgx-h100", "algorithm": "ring"}
PER_DIM = {"bandwidth_gbits_per_s": float, "latency_us": float}
NIC_KEYS = {"ranks": list, "dim": str, "bandwidth_gbits_per_s": float}
STRAGGLER_KEYS = {"ranks": list, "slowdown": float}
CONSTRAINTS = ("degrees_divide", "supported", "memory_fits", "max_gpus", "min_gpus")
_PLAN_FIELDS = {f.name: f for f in dataclasses.fields(Plan) if f.name not in ("source", "world_size")}
_LIST_VALUED = {"workload.plan.order", "workload.plan.pp_layers", "system.nic.ranks", "system.straggler.ranks"}


class SpaceError(FlintError):
    """The space file is wrong; the message names the file and the axis or setting."""

    def __init__(self, source: str, where: str, message: str) -> None:
        self.where = where
        super().__init__(f"{source}: {where}: {message}")


@dataclass(frozen=True)
class Axis:
    """One named dimension of the space and its values (in file order)."""

    name: str
    values: tuple[Any, ...]

    @property
    def is_system(self) -> bool:
        return self.name.startswith("system.")


@dataclass(frozen=True)
class LinePlot:
    x: str
    y: str = "iteration_time_us"
    series: str | None = None
    title: str | None = None


@dataclass
class Space:
    """A parsed, checked design space (module docstring)."""

    name: str
    source: str
    axes: tuple[Axis, ...]
    strategy: str = "grid"
    samples: int | None = None
    seed: int = 0
    objectives: tuple[str, ...] = ("iteration_time_us", "peak_memory_bytes", "gpus")
    constraints: dict[str, Any] = field(default_factory=dict)
    lines: tuple[LinePlot, ...] = ()
    breakdown_label: tuple[str, ...] = ()
    reference: dict[str, Any] = field(default_factory=dict)  # axis -> value: a point to compare the best with
    text_hash: str = ""

    # ------------------------------------------------------------------ points

    @property
    def size(self) -> int:
        return math.prod(len(a.values) for a in self.axes)

    def axis(self, name: str) -> Axis:
        return next(a for a in self.axes if a.name == name)

    def varying(self) -> list[str]:
        """Names of the axes with more than one value."""
        return [a.name for a in self.axes if len(a.values) > 1]

    def grid(self) -> Iterator[dict[str, Any]]:
        """Every point, in file order of the axes (the last axis varies fastest)."""
        names = [a.name for a in self.axes]
        for combo in itertools.product(*(a.values for a in self.axes)):
            yield dict(zip(names, combo))

    def point_at(self, index: int) -> dict[str, Any]:
        """The ``index``-th point of :meth:`grid` without enumerating the others."""
        out: dict[str, Any] = {}
        for a in reversed(self.axes):
            index, i = divmod(index, len(a.values))
            out[a.name] = a.values[i]
        return {a.name: out[a.name] for a in self.axes}


def point_id(point: Mapping[str, Any]) -> str:
    """A stable identity of a point: the hash of its inputs (axis order does not matter)."""
    text = json.dumps(point, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def workload_of(point: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in point.items() if k.startswith("workload.")}


def system_of(point: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in point.items() if k.startswith("system.")}


def plan_of_point(point: Mapping[str, Any], source: str | None = None) -> Plan:
    """The validated :class:`Plan` of a point (``PlanError`` names the field)."""
    fields = {k.removeprefix("workload.plan."): v for k, v in point.items() if k.startswith("workload.plan.")}
    return Plan.from_dict(fields, world_size=point["workload.world_size"], source=source)


# ----------------------------------------------------------------- parsing


def load_space(path: str | Path) -> Space:
    """Read and check a space file (errors are :class:`SpaceError` naming the axis)."""
    path = Path(path)
    src = str(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise FlintError(f"{src}: no such space file") from None
    except OSError as e:
        raise FlintError(f"{src}: cannot read: {e.strerror}") from None
    try:
        data = parse_toml(raw)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise FlintError(f"{src}: not valid TOML: {e}") from None
    space = space_from_dict(data, src)
    space.text_hash = hashlib.sha256(raw).hexdigest()[:16]
    return space


def _unknown(src: str, where: str, key: str, known) -> SpaceError:
    close = difflib.get_close_matches(key, sorted(known), n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return SpaceError(src, f"{where}.{key}" if where else key,
                      f"unknown axis or setting{hint}; known: {', '.join(sorted(known))}")


def _values(src: str, name: str, spec: Any, typ: type) -> tuple[Any, ...]:
    """The values of one axis from its spec (module docstring)."""
    list_valued = name in _LIST_VALUED
    if isinstance(spec, dict):
        keys = set(spec)
        if keys == {"values"}:
            vals = spec["values"]
            if not isinstance(vals, list):
                raise SpaceError(src, name, f"'values' must be a list, got {vals!r}")
        elif keys == {"log2"}:
            lo_hi = spec["log2"]
            if not (isinstance(lo_hi, list) and len(lo_hi) == 2 and all(isinstance(v, int) and v > 0 for v in lo_hi)):
                raise SpaceError(src, name, f"log2 needs [lo, hi] with positive integers, got {lo_hi!r}")
            lo, hi = lo_hi
            vals = [1 << k for k in range(max(lo, 1).bit_length() - 1, hi.bit_length()) if lo <= (1 << k) <= hi]
        elif keys <= {"start", "stop", "step"} and {"start", "stop"} <= keys:
            start, stop, step = spec["start"], spec["stop"], spec.get("step", 1)
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (start, stop, step)):
                raise SpaceError(src, name, "start, stop and step must be numbers")
            if step <= 0:
                raise SpaceError(src, name, f"step must be positive, got {step}")
            n = int(math.floor((stop - start) / step + 1e-9)) + 1
            vals = [start + i * step for i in range(max(n, 0))]
            if all(isinstance(v, int) for v in (start, stop, step)):
                vals = [int(v) for v in vals]
        else:
            raise SpaceError(src, name, f"a range is {{ values = [...] }}, {{ start, stop, step }} or "
                             f"{{ log2 = [lo, hi] }}; got keys {sorted(keys)}")
    elif isinstance(spec, list):
        if list_valued and spec and not isinstance(spec[0], list):
            vals = [spec]
        else:
            vals = spec
    else:
        vals = [spec]
    if not vals:
        raise SpaceError(src, name, "empty range: the axis has no values")
    out = []
    for v in vals:
        out.append(_check_type(src, name, v, typ, list_valued))
    if len(set(json.dumps(v) for v in out)) != len(out):
        raise SpaceError(src, name, f"repeats a value in {out}")
    return tuple(out)


def _check_type(src: str, name: str, v: Any, typ: type, list_valued: bool) -> Any:
    if list_valued:
        if not isinstance(v, list):
            raise SpaceError(src, name, f"each value must be a list, got {v!r}")
        return v
    if typ is float and isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    if typ is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise SpaceError(src, name, f"must be an integer, got {v!r}")
    if typ in (str, float, bool) and not isinstance(v, typ):
        raise SpaceError(src, name, f"must be a {typ.__name__}, got {v!r}")
    return v


def _plan_type(f: dataclasses.Field) -> type:
    """A plan field's value type, from its annotation (``flint.plan.Plan``): bool, str, float, else int."""
    base = str(f.type).split("|")[0].strip()
    return {"bool": bool, "str": str, "float": float}.get(base, int)


def space_from_dict(data: Mapping[str, Any], src: str = "<space>") -> Space:
    """A :class:`Space` from parsed TOML (``load_space`` adds the file hash)."""
    top = {"name", "description", "search", "workload", "system", "constraints", "report"}
    for key in data:
        if key not in top:
            raise _unknown(src, "", key, top)
    axes: list[Axis] = []
    wl = data.get("workload")
    if not isinstance(wl, dict):
        raise SpaceError(src, "workload", "needs a [workload] table with at least 'model' and 'world_size'")
    for key, spec in wl.items():
        if key == "plan":
            if not isinstance(spec, dict):
                raise SpaceError(src, "workload.plan", "must be a table of plan fields")
            for pk, pv in spec.items():
                if pk not in _PLAN_FIELDS:
                    raise _unknown(src, "workload.plan", pk, _PLAN_FIELDS)
                name = f"workload.plan.{pk}"
                axes.append(Axis(name, _values(src, name, pv, _plan_type(_PLAN_FIELDS[pk]))))
            continue
        if key not in WORKLOAD_KEYS:
            raise _unknown(src, "workload", key, set(WORKLOAD_KEYS) | {"plan"})
        name = f"workload.{key}"
        axes.append(Axis(name, _values(src, name, spec, WORKLOAD_KEYS[key])))
    for key in ("model", "world_size"):
        if key not in wl:
            raise SpaceError(src, f"workload.{key}", "missing: every space names at least 'model' and 'world_size'")
    for key, default in WORKLOAD_DEFAULTS.items():
        if key not in wl:
            axes.append(Axis(f"workload.{key}", (default,)))
    sysd = data.get("system", {})
    if not isinstance(sysd, dict):
        raise SpaceError(src, "system", "must be a table")
    for key, spec in sysd.items():
        if key in PER_DIM:
            if not isinstance(spec, dict) or not spec:
                raise SpaceError(src, f"system.{key}", "must be a table of network dimension -> values")
            for dim, dv in spec.items():
                name = f"system.{key}.{dim}"
                axes.append(Axis(name, _values(src, name, dv, PER_DIM[key])))
        elif key in ("nic", "straggler"):
            known = NIC_KEYS if key == "nic" else STRAGGLER_KEYS
            if not isinstance(spec, dict):
                raise SpaceError(src, f"system.{key}", "must be a table")
            for sk in spec:
                if sk not in known:
                    raise _unknown(src, f"system.{key}", sk, known)
            for sk in known:
                if sk not in spec:
                    raise SpaceError(src, f"system.{key}", f"needs '{sk}'")
                name = f"system.{key}.{sk}"
                axes.append(Axis(name, _values(src, name, spec[sk], known[sk])))
        elif key in SYSTEM_KEYS:
            name = f"system.{key}"
            axes.append(Axis(name, _values(src, name, spec, SYSTEM_KEYS[key])))
        else:
            raise _unknown(src, "system", key, set(SYSTEM_KEYS) | set(PER_DIM) | {"nic", "straggler"})
    for key, default in SYSTEM_DEFAULTS.items():
        if key not in sysd:
            axes.append(Axis(f"system.{key}", (default,)))
    axes = [Axis(a.name, _model_files(src, a.values, wl)) if a.name == "workload.model" else
            Axis(a.name, _calibration_files(src, a.values)) if a.name == "system.calibration" else a for a in axes]
    _check_axis_values(src, axes)

    search = data.get("search", {})
    known_search = {"strategy", "samples", "seed", "objectives"}
    for key in search:
        if key not in known_search:
            raise _unknown(src, "search", key, known_search)
    strategy = search.get("strategy", "grid")
    if strategy not in STRATEGIES:
        raise SpaceError(src, "search.strategy", f"unknown strategy '{strategy}'; known: {', '.join(STRATEGIES)}")
    samples = search.get("samples")
    if samples is not None and (not isinstance(samples, int) or isinstance(samples, bool) or samples < 1):
        raise SpaceError(src, "search.samples", f"must be a positive integer, got {samples!r}")
    seed = search.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise SpaceError(src, "search.seed", f"must be an integer, got {seed!r}")
    objectives = tuple(search.get("objectives", ("iteration_time_us", "peak_memory_bytes", "gpus")))
    for o in objectives:
        if o not in OBJECTIVES:
            raise SpaceError(src, "search.objectives", f"unknown objective '{o}'; known: {', '.join(OBJECTIVES)} "
                             "(all minimized)")
    if not objectives:
        raise SpaceError(src, "search.objectives", "needs at least one objective")

    cons = dict(data.get("constraints", {}))
    for key in cons:
        if key not in CONSTRAINTS:
            raise _unknown(src, "constraints", key, CONSTRAINTS)
    for key in ("degrees_divide", "supported", "memory_fits"):
        v = cons.setdefault(key, True)
        if not isinstance(v, bool):
            raise SpaceError(src, f"constraints.{key}", f"must be true or false, got {v!r}")
    if cons["degrees_divide"] is False or cons["supported"] is False:
        raise SpaceError(src, "constraints", "degrees_divide and supported cannot be turned off: such points "
                         "cannot be captured")
    for key in ("max_gpus", "min_gpus"):
        if key in cons and (not isinstance(cons[key], int) or isinstance(cons[key], bool) or cons[key] < 1):
            raise SpaceError(src, f"constraints.{key}", f"must be a positive integer, got {cons[key]!r}")

    names = {a.name for a in axes}
    report = data.get("report", {})
    lines = []
    for key in report:
        if key not in ("line", "breakdown_label", "reference"):
            raise _unknown(src, "report", key, {"line", "breakdown_label", "reference"})
    for i, ln in enumerate(report.get("line", [])):
        where = f"report.line[{i}]"
        if not isinstance(ln, dict) or "x" not in ln:
            raise SpaceError(src, where, "needs x (an axis name)")
        bad = set(ln) - {"x", "y", "series", "title"}
        if bad:
            raise SpaceError(src, where, f"unknown keys {sorted(bad)} (allowed: x, y, series, title)")
        for k in ("x", "series"):
            if ln.get(k) is not None and ln[k] not in names:
                raise SpaceError(src, f"{where}.{k}", f"'{ln[k]}' is not an axis of this space; axes: "
                                 f"{', '.join(sorted(names))}")
        lines.append(LinePlot(ln["x"], ln.get("y", "iteration_time_us"), ln.get("series"), ln.get("title")))
    label = tuple(report.get("breakdown_label", ()))
    for n in label:
        if n not in names:
            raise SpaceError(src, "report.breakdown_label", f"'{n}' is not an axis of this space")
    reference = dict(report.get("reference", {}))
    for n, v in reference.items():
        if n not in names:
            raise SpaceError(src, f"report.reference.{n}", f"not an axis of this space; axes: {', '.join(sorted(names))}")
        if v not in next(a for a in axes if a.name == n).values:
            raise SpaceError(src, f"report.reference.{n}", f"{v!r} is not one of the axis' values")
    name = data.get("name", Path(src).stem)
    return Space(str(name), src, tuple(axes), strategy, samples, seed, objectives, cons, tuple(lines), label,
                 reference)


def _model_files(src: str, values: tuple, workload: Mapping[str, Any]) -> tuple:
    """Model files (``path/to/file.py[:function]``) as absolute paths, relative ones taken from the space
    file's directory; each checked to define its factory (the file is imported). A file whose
    ``example_inputs()`` fixes the batch takes no ``global_batch`` or ``seq_len``."""
    from flint.capture.byom import is_model_file, load_user_module, user_function

    base = Path(src).parent if Path(src).is_file() else Path.cwd()
    out = []
    for v in values:
        if is_model_file(v):
            path, sep, fn = v.partition(":")
            v = str((base / path).resolve()) + sep + fn
            try:
                user_function(v, "workload.model", "model_factory", "a zero-argument model factory")
            except FlintError as e:
                raise SpaceError(src, "workload.model", str(e)) from None
            fixed = callable(getattr(load_user_module(v.partition(":")[0], "workload.model"), "example_inputs", None))
            for key in ("global_batch", "seq_len"):
                if fixed and key in workload:
                    raise SpaceError(src, f"workload.{key}", f"{path} fixes its batch with example_inputs() (global "
                                     "shapes); drop this axis, or change the shapes there")
        out.append(v)
    return tuple(out)


def _calibration_files(src: str, values: tuple) -> tuple:
    """Calibration overrides: "" (the device's own), "fitted" (each device's fitted one), a shipped one by
    name (``fitted/h100-sxm``), or a TOML path taken from the space file's directory (made absolute)."""
    from flint.cost.calibration import shipped_override

    base = Path(src).parent if Path(src).is_file() else Path.cwd()
    return tuple(v if v in ("", "fitted") or shipped_override(v) else str((base / v).resolve()) for v in values)


def _check_axis_values(src: str, axes: list[Axis]) -> None:
    """Values that can be checked without a point: presets exist, network dimensions exist, passes parse."""
    from flint.cost import load_device, load_network

    by = {a.name: a for a in axes}
    for v in by["system.device"].values:
        try:
            load_device(v)
        except FlintError as e:
            raise SpaceError(src, "system.device", str(e)) from None
    for c in by["system.calibration"].values if "system.calibration" in by else ():
        for v in by["system.device"].values if c else ():
            try:
                load_device(v, c)
            except FlintError as e:
                raise SpaceError(src, "system.calibration", str(e)) from None
    nets = []
    for v in by["system.network"].values:
        try:
            nets.append(load_network(v))
        except FlintError as e:
            raise SpaceError(src, "system.network", str(e)) from None
    dims_named = [a.name.split(".")[-1] for a in axes if a.name.split(".")[1] in PER_DIM]
    if "system.nic.dim" in by:
        dims_named += list(by["system.nic.dim"].values)
    for dim in dims_named:
        for net in nets:
            if dim not in {d.name for d in net.dims}:
                where = next((a.name for a in axes if a.name.endswith(f".{dim}") and a.name.split(".")[1] in PER_DIM),
                             "system.nic.dim")
                raise SpaceError(src, where, f"network '{net.name}' has no dimension '{dim}' (its dimensions: "
                                 f"{', '.join(d.name for d in net.dims)})")
    from flint.capture.byom import is_model_file
    from flint.models import presets

    for v in by["workload.model"].values:
        if not is_model_file(v) and v not in presets():
            raise SpaceError(src, "workload.model", f"unknown model '{v}'; known: {', '.join(sorted(presets()))}, "
                             "or path/to/file.py[:function] defining a model factory")
    if any(is_model_file(v) for v in by["workload.model"].values) and \
            any(v is not None for v in by["workload.layers"].values):
        raise SpaceError(src, "workload.layers", "applies to zoo models only; a model file sets its depth in its "
                         "factory")
    for v in by["workload.path"].values:
        if v not in PATHS:
            raise SpaceError(src, "workload.path", f"unknown path '{v}'; known: {', '.join(PATHS)}")
    for v in by["workload.passes"].values:
        if v == "default":
            continue
        try:
            parse_passes(v)
        except FlintError as e:
            raise SpaceError(src, "workload.passes", str(e)) from None
    from flint.cost.collective import parse_algorithm

    for v in by["system.algorithm"].values:
        try:
            parse_algorithm(v)
        except FlintError as e:
            raise SpaceError(src, "system.algorithm", str(e)) from None
    for k in ("system.straggler.slowdown",):
        for v in by.get(k, Axis(k, ())).values:
            if v < 1.0:
                raise SpaceError(src, k, f"a slowdown is a factor >= 1 on compute durations, got {v}")
    for k in [a.name for a in axes if a.name.split(".")[1] in PER_DIM] + ["system.nic.bandwidth_gbits_per_s"]:
        for v in by.get(k, Axis(k, ())).values:
            if v <= 0 and "bandwidth" in k or v < 0:
                raise SpaceError(src, k, f"must be positive, got {v}")
    for k in ("system.nic.ranks", "system.straggler.ranks"):
        for v in by.get(k, Axis(k, ())).values:
            if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in v):
                raise SpaceError(src, k, f"must list rank numbers >= 0, got {v!r}")


def parse_passes(spec: str):
    """A flint-opt pipeline spec (``"a,b{opt=1}"``) as xDSL's PassPipeline over Flint's registry ("" -> none)."""
    from xdsl.passes import PassPipeline

    from flint.passes import registry

    if not spec.strip():
        return PassPipeline(())
    try:
        return registry.parse_passes(registry.all_passes(), spec)
    except FlintError:
        raise
    except Exception as e:  # xDSL raises ValueError / PassOptionError with its own message
        raise FlintError(f"pass pipeline '{spec}': {e}") from None


__all__ = ["Space", "Axis", "SpaceError", "load_space", "space_from_dict", "point_id", "plan_of_point",
           "workload_of", "system_of", "parse_passes", "PlanError"]
