"""Device calibrations: the compute model's parameters, one sourced file per device.

A calibration holds every efficiency the compute model uses for one device;
the presets ship one each in ``flint/devices/calibration/<device>.toml``,
every number with its source (vendor documents, published microbenchmarks),
never fitted to a workload. Schema (``[table] key``: valid range)::

    kernel_floor_us                 0 <= x <= 1000   shortest kernel, launch gap included (us)
    comm_sms                        0 <= x <= 1024   SMs one NCCL collective kernel holds while in flight
                                                     (optional; 0 or absent: compute never shares SMs)
    sustained_fraction              0 < x <= 1       share of the calibrated kernel rates a long training
                                                     run sustains: every compute kernel's time is divided
                                                     by it (optional; absent: 1). The presets leave it out
                                                     (no source measures it); a value fitted on published
                                                     runs of the device is in calibration/fitted/<device>.toml
                                                     (bench/accuracy.py: its data and leave-one-out test)
    [gemm]  peak_fraction           0 < x <= 1       MAMF / dense peak (bf16 / fp16 / tf32): the ceiling
            mainloop_fraction       0 < x <= 1       one SM's main-loop throughput / its share of the peak
                                                     (>= peak_fraction)
            latency_us              0 <= x <= 1000   fixed time of one GEMM kernel (us)
            fp8_peak_fraction       0 < x <= 1       MAMF / dense peak for fp8 GEMMs (devices with fp8)
            tiles                   [[tile_m, tile_n, rel], ...], 16 <= tile <= 1024, 0 < rel <= 1
            k_overhead              0 <= x <= 4096   per-tile fixed cost, in K elements
            max_split_k             1 <= x <= 64     largest split-K factor the library uses
    [attention] fwd_fraction        0 < x <= 1       fused attention forward plateau / dense peak
            bwd_fraction            0 < x <= 1       fused attention backward plateau / dense peak
            seq_half                0 <= x <= 1e6    key length at half the plateau
                                                     (the kernel PyTorch's scaled_dot_product_attention
                                                     runs by default: its flash backend, FlashAttention-2)
            dropout_overhead        0 <= x <= 10     the same kernel's extra time with dropout, a fraction
                                                     (optional; absent: no measurement, priced as without)
    [cudnn_attention] (the same keys; optional): cuDNN's fused attention, the kernel
                                                     Transformer Engine prefers on Hopper; ops marked by
                                                     the attention-kernel{kernel=cudnn} pass use it
    [compute_efficiency] <op class> 0 < x <= 1       ops without a shape model ("default" required)
    [memory_efficiency]  <op class> 0 < x <= 1       fraction of HBM bandwidth ("default" required)

A *complete* calibration (a preset's file, or one a custom device names)
must give every key; a missing or out-of-range key is an error naming it and
its valid range. ``--calibration FILE`` (:func:`merge_calibration`) instead
overrides individual keys of the device's calibration, checked against the
same ranges. The model these parameters drive is :mod:`flint.cost.compute`.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from flint.cost.compute import AttentionModel, GemmModel
from flint.errors import FlintError
from flint.tomlio import parse_toml
from flint.limits import MAX_SMS
from flint.opclasses import COST_CLASSES

CALIBRATION_DIR = Path(__file__).resolve().parent.parent / "devices" / "calibration"
FITTED_DIR = CALIBRATION_DIR / "fitted"  # the fitted overrides (bench/accuracy.py writes them): fitted/<device>
_CLASSES = set(COST_CLASSES) | {"default"}

# (table, key) -> (lo, hi, lo_inclusive, kind, unit)
_SCALARS: dict[tuple[str, str], tuple[float, float, bool, type, str]] = {
    ("", "kernel_floor_us"): (0.0, 1000.0, True, float, "us"),
    ("", "comm_sms"): (0, MAX_SMS, True, int, "SMs"),
    ("", "sustained_fraction"): (0.0, 1.0, False, float, "fraction of the calibrated kernel rates"),
    ("gemm", "peak_fraction"): (0.0, 1.0, False, float, "fraction of the dense peak"),
    ("gemm", "fp8_peak_fraction"): (0.0, 1.0, False, float, "fraction of the dense fp8 peak"),
    ("gemm", "mainloop_fraction"): (0.0, 1.0, False, float, "fraction of the per-SM dense peak"),
    ("gemm", "latency_us"): (0.0, 1000.0, True, float, "us"),
    ("gemm", "k_overhead"): (0.0, 4096.0, True, float, "K elements"),
    ("gemm", "max_split_k"): (1, 64, True, int, "slices"),
    ("attention", "fwd_fraction"): (0.0, 1.0, False, float, "fraction of the dense peak"),
    ("attention", "bwd_fraction"): (0.0, 1.0, False, float, "fraction of the dense peak"),
    ("attention", "seq_half"): (0.0, 1e6, True, float, "keys"),
    ("attention", "dropout_overhead"): (0.0, 10.0, True, float, "fraction of the kernel's time"),
    ("cudnn_attention", "fwd_fraction"): (0.0, 1.0, False, float, "fraction of the dense peak"),
    ("cudnn_attention", "bwd_fraction"): (0.0, 1.0, False, float, "fraction of the dense peak"),
    ("cudnn_attention", "seq_half"): (0.0, 1e6, True, float, "keys"),
    ("cudnn_attention", "dropout_overhead"): (0.0, 10.0, True, float, "fraction of the kernel's time"),
}
_TABLE_KEYS = {"gemm": ("peak_fraction", "fp8_peak_fraction", "mainloop_fraction", "tiles", "k_overhead",
                        "max_split_k", "latency_us"),
               "attention": ("fwd_fraction", "bwd_fraction", "seq_half", "dropout_overhead"),
               "cudnn_attention": ("fwd_fraction", "bwd_fraction", "seq_half", "dropout_overhead")}
_OPTIONAL_KEYS = {"fp8_peak_fraction", "dropout_overhead"}  # a new table may leave them out
TOP_KEYS = {"device", "description", "kernel_floor_us", "comm_sms", "sustained_fraction", "gemm", "attention",
            "cudnn_attention", "compute_efficiency", "memory_efficiency"}


@dataclass(frozen=True)
class Calibration:
    """The compute model's parameters for one device (module docstring)."""

    kernel_floor_us: float
    compute_efficiency: Mapping[str, float]
    memory_efficiency: Mapping[str, float]
    gemm: GemmModel | None = None
    gemm_fp8_peak_fraction: float | None = None
    attention: AttentionModel | None = None
    comm_sms: int = 0  # SMs a collective kernel holds while in flight (the simulator slows compute meanwhile)
    cudnn_attention: AttentionModel | None = None  # cuDNN's fused attention (optional)
    sustained_fraction: float = 1.0  # share of these kernel rates a long run sustains (compute times / it)
    source: str = field(default="", compare=False)

    def to_toml(self) -> str:
        """This calibration as a complete TOML document (round-trips through :func:`parse_calibration`)."""
        lines = [f"kernel_floor_us = {float(self.kernel_floor_us)!r}"]
        if self.comm_sms:
            lines.append(f"comm_sms = {self.comm_sms}")
        if self.sustained_fraction != 1.0:
            lines.append(f"sustained_fraction = {float(self.sustained_fraction)!r}")
        if self.gemm is not None:
            g = self.gemm
            tiles = ", ".join(f"[{tm}, {tn}, {float(rel)!r}]" for tm, tn, rel in g.tiles)
            lines += ["[gemm]", f"peak_fraction = {float(g.peak_fraction)!r}"]
            if self.gemm_fp8_peak_fraction is not None:
                lines.append(f"fp8_peak_fraction = {float(self.gemm_fp8_peak_fraction)!r}")
            mainloop = g.peak_fraction if g.mainloop_fraction is None else g.mainloop_fraction
            lines += [f"mainloop_fraction = {float(mainloop)!r}", f"tiles = [{tiles}]",
                      f"k_overhead = {float(g.k_overhead)!r}", f"max_split_k = {g.max_split_k}",
                      f"latency_us = {float(g.latency_us)!r}"]
        for table, a in (("attention", self.attention), ("cudnn_attention", self.cudnn_attention)):
            if a is not None:
                lines += [f"[{table}]", f"fwd_fraction = {float(a.fwd_fraction)!r}",
                          f"bwd_fraction = {float(a.bwd_fraction)!r}", f"seq_half = {float(a.seq_half)!r}"]
                if a.dropout_overhead:
                    lines.append(f"dropout_overhead = {float(a.dropout_overhead)!r}")
        for table in ("compute_efficiency", "memory_efficiency"):
            lines.append(f"[{table}]")
            lines += [f"{k} = {float(v)!r}" for k, v in sorted(getattr(self, table).items())]
        return "\n".join(lines) + "\n"


def _range_text(key: str, lo: float, hi: float, lo_inc: bool, unit: str) -> str:
    return f"{lo:g} {'<=' if lo_inc else '<'} {key} <= {hi:g}" + (f" ({unit})" if unit else "")


def _scalar(where: str, table: str, key: str, value: Any) -> float | int:
    lo, hi, lo_inc, kind, unit = _SCALARS[(table, key)]
    name = f"[{table}] {key}" if table else key
    valid = _range_text(key, lo, hi, lo_inc, unit)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise FlintError(f"{where}: {name} = {value!r} must be {'an integer' if kind is int else 'a number'} "
                         f"(valid: {valid})")
    v = kind(value)
    ok = (lo <= v if lo_inc else lo < v) and v <= hi and not (isinstance(v, float) and math.isnan(v))
    if not ok:
        raise FlintError(f"{where}: {name} = {value!r} is out of range (valid: {valid})")
    return v


def _efficiency_table(where: str, table: str, data: Any) -> dict[str, float]:
    if not isinstance(data, Mapping):
        raise FlintError(f"{where}: [{table}] must be a table of op class = fraction")
    out = {}
    for k, v in data.items():
        if k not in _CLASSES:
            raise FlintError(f"{where}: [{table}] unknown op class '{k}' (valid: {', '.join(sorted(_CLASSES))})")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < float(v) <= 1.0:
            raise FlintError(f"{where}: [{table}] {k} = {v!r} is out of range (valid: 0 < {k} <= 1, "
                             "a fraction); efficiency must be in (0, 1]")
        out[k] = float(v)
    return out


def _tiles(where: str, value: Any) -> tuple[tuple[int, int, float], ...]:
    valid = "a list of [tile_m, tile_n, rel] with 16 <= tile <= 1024 and 0 < rel <= 1"
    if not isinstance(value, list) or not value:
        raise FlintError(f"{where}: [gemm] tiles = {value!r} is out of range (valid: {valid})")
    out = []
    for t in value:
        ok = isinstance(t, list) and len(t) == 3 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                         for x in t)
        if ok:
            tm, tn, rel = t
            ok = isinstance(tm, int) and isinstance(tn, int) and 16 <= tm <= 1024 and 16 <= tn <= 1024 \
                and 0.0 < float(rel) <= 1.0
        if not ok:
            raise FlintError(f"{where}: [gemm] tiles entry {t!r} is out of range (valid: {valid})")
        out.append((int(t[0]), int(t[1]), float(t[2])))
    return tuple(out)


def _table(where: str, data: Mapping[str, Any], table: str, base: Mapping[str, Any] | None) -> dict[str, Any]:
    got = data.get(table, {})
    if not isinstance(got, Mapping):
        raise FlintError(f"{where}: [{table}] must be a table")
    unknown = set(got) - set(_TABLE_KEYS[table])
    if unknown:
        raise FlintError(f"{where}: [{table}] unknown keys {sorted(unknown)} (valid: {', '.join(_TABLE_KEYS[table])})")
    out = dict(base or {})
    for key, value in got.items():
        out[key] = _tiles(where, value) if key == "tiles" else _scalar(where, table, key, value)
    return out


def _missing(where: str, table: str, key: str) -> FlintError:
    if key == "tiles":
        valid = "a list of [tile_m, tile_n, rel] with 16 <= tile <= 1024 and 0 < rel <= 1"
    else:
        lo, hi, lo_inc, _, unit = _SCALARS[(table, key)]
        valid = _range_text(key, lo, hi, lo_inc, unit)
    name = f"[{table}] {key}" if table else key
    return FlintError(f"{where}: missing {name} (valid: {valid})")


def parse_calibration(data: Mapping[str, Any], where: str, *, needs_fp8: bool = False) -> Calibration:
    """A complete calibration from a parsed TOML table: every key must be present and in range."""
    unknown = set(data) - TOP_KEYS
    if unknown:
        raise FlintError(f"{where}: unknown keys {sorted(unknown)} (valid: {', '.join(sorted(TOP_KEYS))})")
    if "kernel_floor_us" not in data:
        raise _missing(where, "", "kernel_floor_us")
    floor = _scalar(where, "", "kernel_floor_us", data["kernel_floor_us"])
    tables = {}
    for table in ("gemm", "attention", "cudnn_attention"):
        if table == "cudnn_attention" and table not in data:  # optional, but complete when given
            tables[table] = None
            continue
        t = _table(where, data, table, None)
        for key in _TABLE_KEYS[table]:
            optional = key == "dropout_overhead" or (key == "fp8_peak_fraction" and not needs_fp8)
            if key not in t and not optional:
                raise _missing(where, table, key)
        tables[table] = t
    effs = {}
    for table in ("compute_efficiency", "memory_efficiency"):
        e = _efficiency_table(where, table, data.get(table, {}))
        if "default" not in e:
            raise FlintError(f"{where}: missing [{table}] default (valid: 0 < default <= 1, a fraction)")
        effs[table] = e
    cal = _build(floor, tables["gemm"], tables["attention"], effs["compute_efficiency"], effs["memory_efficiency"],
                 where, tables["cudnn_attention"])
    return replace(cal, comm_sms=_top(where, data, "comm_sms", 0),
                   sustained_fraction=_top(where, data, "sustained_fraction", 1.0))


def _top(where: str, data: Mapping[str, Any], key: str, default: float | int) -> float | int:
    """An optional top-level key, range-checked, or ``default``."""
    return _scalar(where, "", key, data[key]) if key in data else default


def _build(floor, g, a, ce, me, where, cudnn=None) -> Calibration:
    if g and g["mainloop_fraction"] < g["peak_fraction"]:
        raise FlintError(f"{where}: [gemm] mainloop_fraction = {g['mainloop_fraction']!r} is out of range "
                         f"(valid: peak_fraction = {g['peak_fraction']!r} <= mainloop_fraction <= 1)")
    gemm = GemmModel(g["peak_fraction"], g["tiles"], g["k_overhead"], g["max_split_k"], g["mainloop_fraction"],
                     g["latency_us"]) if g else None
    def attention(t: Mapping[str, Any] | None) -> AttentionModel | None:
        return AttentionModel(t["fwd_fraction"], t["bwd_fraction"], t["seq_half"], t.get("dropout_overhead", 0.0)) \
            if t else None

    att, cud = attention(a), attention(cudnn)
    return Calibration(float(floor), ce, me, gemm, g.get("fp8_peak_fraction") if g else None, att,
                       cudnn_attention=cud, source=where)


def merge_calibration(base: Calibration, data: Mapping[str, Any], where: str) -> Calibration:
    """``base`` with the keys ``data`` gives replaced (each checked against its range)."""
    unknown = set(data) - TOP_KEYS
    if unknown:
        raise FlintError(f"{where}: unknown keys {sorted(unknown)} (valid: {', '.join(sorted(TOP_KEYS))})")
    floor = _scalar(where, "", "kernel_floor_us", data["kernel_floor_us"]) if "kernel_floor_us" in data \
        else base.kernel_floor_us
    g0 = None
    if base.gemm is not None:
        bg = base.gemm
        g0 = {"peak_fraction": bg.peak_fraction, "tiles": bg.tiles, "k_overhead": bg.k_overhead,
              "max_split_k": bg.max_split_k, "latency_us": bg.latency_us,
              "mainloop_fraction": bg.peak_fraction if bg.mainloop_fraction is None else bg.mainloop_fraction}
        if base.gemm_fp8_peak_fraction is not None:
            g0["fp8_peak_fraction"] = base.gemm_fp8_peak_fraction
    def model_keys(m: AttentionModel | None) -> dict | None:
        return None if m is None else {"fwd_fraction": m.fwd_fraction, "bwd_fraction": m.bwd_fraction,
                                       "seq_half": m.seq_half, "dropout_overhead": m.dropout_overhead}

    a0, c0 = model_keys(base.attention), model_keys(base.cudnn_attention)
    g = _table(where, data, "gemm", g0) if ("gemm" in data or g0) else None
    a = _table(where, data, "attention", a0) if ("attention" in data or a0) else None
    c = _table(where, data, "cudnn_attention", c0) if ("cudnn_attention" in data or c0) else None
    for table, t, t0 in (("gemm", g, g0), ("attention", a, a0), ("cudnn_attention", c, c0)):
        if t and t0 is None:  # a new table on a device without one must be complete
            for key in _TABLE_KEYS[table]:
                if key not in t and key not in _OPTIONAL_KEYS:
                    raise _missing(where, table, key)
    ce = dict(base.compute_efficiency)
    ce.update(_efficiency_table(where, "compute_efficiency", data.get("compute_efficiency", {})))
    me = dict(base.memory_efficiency)
    me.update(_efficiency_table(where, "memory_efficiency", data.get("memory_efficiency", {})))
    return replace(_build(floor, g, a, ce, me, where, c), comm_sms=_top(where, data, "comm_sms", base.comm_sms),
                   sustained_fraction=_top(where, data, "sustained_fraction", base.sustained_fraction),
                   source=f"{base.source} + {where}")


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """A TOML file as a dict; a missing or malformed file is a :class:`FlintError` naming it."""
    try:
        return parse_toml(Path(path).read_bytes())
    except FileNotFoundError:
        raise FlintError(f"{what} file '{path}' does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise FlintError(f"{what} file '{path}' is not valid TOML: {e}") from None
    except OSError as e:
        raise FlintError(f"cannot read {what} file '{path}': {e.strerror}") from None


def shipped_override(name: str | Path) -> Path | None:
    """The shipped ``--calibration`` override a name stands for (``"fitted/h100-sxm"``:
    ``flint/devices/calibration/fitted/h100-sxm.toml``), or ``None`` for a file path or an unknown name."""
    s = str(name)
    p = CALIBRATION_DIR / f"{s}.toml"
    return p if s and not s.endswith(".toml") and not Path(s).is_file() and p.is_file() else None


def list_overrides() -> list[str]:
    """Names of the shipped ``--calibration`` overrides (the fitted ones: ``fitted/<device>``)."""
    return sorted(f"fitted/{p.stem}" for p in FITTED_DIR.glob("*.toml"))


def list_calibrations() -> list[str]:
    """Names of the calibrations shipped in ``flint/devices/calibration``."""
    return sorted(p.stem for p in CALIBRATION_DIR.glob("*.toml"))


def load_calibration(name_or_path: str | Path, *, needs_fp8: bool = False, relative_to: Path | None = None
                     ) -> Calibration:
    """A complete calibration: a shipped one by name (``"h100-sxm"``) or a TOML path."""
    s = str(name_or_path)
    p = Path(s)
    if relative_to is not None and not p.is_absolute() and s.endswith(".toml"):
        p = relative_to / p
    if not (s.endswith(".toml") or p.is_file()):
        p = CALIBRATION_DIR / f"{s}.toml"
        if not p.is_file():
            raise FlintError(f"unknown calibration '{s}' (valid: {', '.join(list_calibrations())}; or a .toml path)")
    return parse_calibration(read_toml(p, "calibration"), str(p), needs_fp8=needs_fp8)
