"""Device models: peak FLOP/s, HBM and efficiencies, loaded from TOML data.

Presets live in ``flint/devices/<name>.toml`` (public datasheet numbers, dense,
no sparsity). Keys, all with units in their names::

    name, description
    peak_tflops_fp64 / _fp32 / _tf32 / _bf16 / _fp16 / _fp8   dense peak, 1e12 FLOP/s (fp64: matrix units)
    hbm_capacity_gib                                  HBM capacity, GiB
    hbm_bandwidth_gbytes_per_s                        HBM bandwidth, 1e9 bytes/s
    kernel_floor_us                                   shortest time any kernel takes
    [compute_efficiency]  <op class> = fraction of dense peak   ("default" for the rest)
    [memory_efficiency]   <op class> = fraction of HBM bandwidth ("default" for the rest)

A calibration TOML (or dict) has the same ``[compute_efficiency]``,
``[memory_efficiency]`` tables and ``kernel_floor_us``; its entries replace
the preset's, per op class.

The roofline (:meth:`Device.compute_time_us`)::

    duration_us = max(flops / (peak(dtype) * compute_eff[class]),
                      bytes / (hbm_bandwidth * memory_eff[class]),
                      kernel_floor_us)

``view``-class ops launch no kernel and cost 0.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from flint.cost.dtypes import canonical_dtype
from flint.cost.opclass import COST_CLASSES, GEMM, VIEW
from flint.errors import FlintError

DEVICES_DIR = Path(__file__).resolve().parent.parent / "devices"

_PEAK_KEY = {"f64": "fp64", "f32": "fp32", "tf32": "tf32", "bf16": "bf16", "f16": "fp16",
             "f8e4m3fn": "fp8", "f8e5m2": "fp8", "f8e4m3fnuz": "fp8", "f8e5m2fnuz": "fp8"}
_TOP_KEYS = {"name", "description", "hbm_capacity_gib", "hbm_bandwidth_gbytes_per_s", "kernel_floor_us",
             "compute_efficiency", "memory_efficiency"} | {f"peak_tflops_{k}" for k in set(_PEAK_KEY.values())}
_CLASSES = set(COST_CLASSES) | {"default"}


@dataclass(frozen=True)
class Device:
    """One accelerator model (see the module docstring for the fields' meaning)."""

    name: str
    peak_tflops: Mapping[str, float]  # "fp32" / "tf32" / "bf16" / "fp16" / "fp8" -> dense TFLOP/s
    hbm_capacity_gib: float
    hbm_bandwidth_gbytes_per_s: float
    kernel_floor_us: float
    compute_efficiency: Mapping[str, float]
    memory_efficiency: Mapping[str, float]
    description: str = ""
    source: str = field(default="", compare=False)

    @property
    def hbm_capacity_bytes(self) -> int:
        return int(self.hbm_capacity_gib * 2**30)

    def peak_flops_per_s(self, dtype: object = "bf16") -> float:
        """Dense peak FLOP/s for ``dtype`` (``FlintError`` if the device has no such unit)."""
        key = _PEAK_KEY.get(canonical_dtype(dtype))
        if key is None or key not in self.peak_tflops:
            raise FlintError(f"device '{self.name}' has no peak for dtype '{dtype}' "
                             f"(it has: {', '.join(sorted(self.peak_tflops))})")
        return self.peak_tflops[key] * 1e12

    def compute_eff(self, op_class: str) -> float:
        return self.compute_efficiency.get(str(op_class), self.compute_efficiency["default"])

    def memory_eff(self, op_class: str) -> float:
        return self.memory_efficiency.get(str(op_class), self.memory_efficiency["default"])

    def compute_time_us(self, flops: float, nbytes: float, op_class: str = GEMM, dtype: object = "bf16") -> float:
        """Roofline duration of one kernel in microseconds (module docstring)."""
        if str(op_class) == VIEW:
            return 0.0
        t_flops = flops / (self.peak_flops_per_s(dtype) * self.compute_eff(op_class)) * 1e6
        t_bytes = nbytes / (self.hbm_bandwidth_gbytes_per_s * 1e9 * self.memory_eff(op_class)) * 1e6
        return max(t_flops, t_bytes, self.kernel_floor_us)

    def compute_time_us_array(self, flops: np.ndarray, nbytes: np.ndarray, op_class: str = GEMM,
                              dtype: object = "bf16") -> np.ndarray:
        """:meth:`compute_time_us` over arrays (negative flops / bytes count as 0)."""
        f = np.maximum(np.asarray(flops, dtype=np.float64), 0.0)
        b = np.maximum(np.asarray(nbytes, dtype=np.float64), 0.0)
        t_flops = f / (self.peak_flops_per_s(dtype) * self.compute_eff(op_class)) * 1e6
        t_bytes = b / (self.hbm_bandwidth_gbytes_per_s * 1e9 * self.memory_eff(op_class)) * 1e6
        return np.maximum(np.maximum(t_flops, t_bytes), self.kernel_floor_us)

    def calibrated(self, calibration: Mapping[str, Any] | str | Path) -> "Device":
        """A copy with ``calibration``'s efficiencies and floor replacing the preset's."""
        cal = _read_toml(calibration, "calibration") if not isinstance(calibration, Mapping) else dict(calibration)
        unknown = set(cal) - {"compute_efficiency", "memory_efficiency", "kernel_floor_us", "name", "description"}
        if unknown:
            raise FlintError(f"calibration for '{self.name}' has unknown keys {sorted(unknown)} "
                             "(allowed: compute_efficiency, memory_efficiency, kernel_floor_us)")
        ce = dict(self.compute_efficiency)
        me = dict(self.memory_efficiency)
        ce.update(_efficiencies(cal.get("compute_efficiency", {}), "calibration [compute_efficiency]"))
        me.update(_efficiencies(cal.get("memory_efficiency", {}), "calibration [memory_efficiency]"))
        return replace(self, compute_efficiency=ce, memory_efficiency=me,
                       kernel_floor_us=float(cal.get("kernel_floor_us", self.kernel_floor_us)))


def _efficiencies(table: Mapping[str, Any], where: str) -> dict[str, float]:
    out = {}
    for k, v in table.items():
        if k not in _CLASSES:
            raise FlintError(f"{where}: unknown op class '{k}' (valid: {', '.join(sorted(_CLASSES))})")
        v = float(v)
        if not 0.0 < v <= 1.0:
            raise FlintError(f"{where}: efficiency {k} = {v} must be in (0, 1]")
        out[k] = v
    return out


def _read_toml(path: str | Path, what: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise FlintError(f"{what} file '{path}' does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise FlintError(f"{what} file '{path}' is not valid TOML: {e}") from None


def list_devices() -> list[str]:
    """Names of the device presets shipped in ``flint/devices``."""
    return sorted(p.stem for p in DEVICES_DIR.glob("*.toml"))


def device_from_dict(d: Mapping[str, Any], where: str = "device") -> Device:
    """Build a :class:`Device` from a parsed device TOML (validating every key)."""
    unknown = set(d) - _TOP_KEYS
    if unknown:
        raise FlintError(f"{where}: unknown keys {sorted(unknown)} (allowed: {', '.join(sorted(_TOP_KEYS))})")
    for k in ("name", "hbm_capacity_gib", "hbm_bandwidth_gbytes_per_s", "peak_tflops_bf16"):
        if k not in d:
            raise FlintError(f"{where}: missing required key '{k}'")
    peaks = {k[len("peak_tflops_"):]: float(v) for k, v in d.items() if k.startswith("peak_tflops_")}
    ce = _efficiencies(d.get("compute_efficiency", {}), f"{where} [compute_efficiency]")
    me = _efficiencies(d.get("memory_efficiency", {}), f"{where} [memory_efficiency]")
    ce.setdefault("default", 0.5)
    me.setdefault("default", 0.8)
    return Device(name=str(d["name"]), peak_tflops=peaks, hbm_capacity_gib=float(d["hbm_capacity_gib"]),
                  hbm_bandwidth_gbytes_per_s=float(d["hbm_bandwidth_gbytes_per_s"]),
                  kernel_floor_us=float(d.get("kernel_floor_us", 0.0)), compute_efficiency=ce,
                  memory_efficiency=me, description=str(d.get("description", "")), source=where)


def load_device(name_or_path: str | Path, calibration: Mapping[str, Any] | str | Path | None = None) -> Device:
    """Load a device preset by name (``"h100-sxm"``) or from a TOML file path.

    ``calibration`` (a TOML path or a dict) overrides efficiencies per op
    class and the kernel floor. An unknown name raises :class:`FlintError`
    listing the valid names.
    """
    s = str(name_or_path)
    p = Path(s)
    if s.endswith(".toml") or p.is_file():
        dev = device_from_dict(_read_toml(p, "device"), where=s)
    else:
        preset = DEVICES_DIR / f"{s}.toml"
        if not preset.is_file():
            raise FlintError(f"unknown device '{s}' (valid: {', '.join(list_devices())}; or give a .toml path)")
        dev = device_from_dict(_read_toml(preset, "device"), where=str(preset))
    return dev.calibrated(calibration) if calibration is not None else dev
