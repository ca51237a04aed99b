"""Device models: datasheet peaks and memory, plus the device's calibration.

Presets live in ``flint/devices/<name>.toml`` (public datasheet numbers, dense,
no sparsity); each names its calibration, ``flint/devices/calibration/<name>.toml``
(:mod:`flint.cost.calibration`: the sourced efficiencies of the compute model).
Device keys, all with units in their names::

    name, description
    peak_tflops_fp64 / _fp32 / _tf32 / _bf16 / _fp16 / _fp8   dense peak, 1e12 FLOP/s (fp64: matrix units)
    hbm_capacity_gib                                  HBM capacity, GiB
    hbm_bandwidth_gbytes_per_s                        HBM bandwidth, 1e9 bytes/s
    sm_count                                          streaming multiprocessors / compute units
    power_limit_w                                     board power limit the peaks and calibration assume
    calibration                                       a shipped calibration name or a .toml path
    kernel_floor_us, comm_sms, sustained_fraction, [compute_efficiency], [memory_efficiency], [gemm], [attention]
                                                      inline calibration (a custom device without a file)

A device without ``calibration`` and without ``[gemm]`` uses the plain
roofline: one efficiency per op class (defaults: compute 0.5, memory 0.8,
floor 0), as older device files do.

The roofline (:meth:`Device.compute_time_us`, for callers that know only
FLOPs and bytes)::

    duration_us = max(flops / (peak(dtype) * compute_eff[class]),
                      bytes / (hbm_bandwidth * memory_eff[class]),
                      kernel_floor_us) / sustained_fraction

Every compute kernel's time, by any of the models below, is divided by the calibration's
``sustained_fraction`` (1 unless a calibration sets it: the share of the calibrated rates a long
training run sustains; :mod:`flint.cost.calibration`).

:meth:`Device.op_time_us` prices an op from its shape when the calibration
has a GEMM or attention model (:mod:`flint.cost.compute`; GEMMs in the
matrix-unit dtypes bf16, fp16, tf32 and fp8), and falls back to the roofline
otherwise (fp32 / fp64 GEMMs at the GEMM model's peak fraction). ``view``-class ops launch no kernel and cost 0.

SM sharing (:meth:`Device.compute_rate`): a collective kernel holds the
calibration's ``comm_sms`` SMs from its launch to its end (NCCL's CTAs never
share an SM with other kernels), so a compute kernel meanwhile runs on the
rest: at ``(sm_count - n * comm_sms) / sm_count`` of its speed with ``n``
collectives in flight, never below ``comm_sms / sm_count``. A send whose
kernel holds SMs (``chakra.send`` ``sms``: Transformer Engine's userbuffers
reduce-scatter, ``micro-pipeline-tp{sms=16}``) adds its own count.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import numpy as np

from flint.cost.calibration import (Calibration, list_overrides, load_calibration, merge_calibration,
                                    parse_calibration, read_toml, shipped_override)
from flint.cost.dtypes import canonical_dtype
from flint.cost.opclass import ATTENTION, ELEMENTWISE, GEMM, VIEW
from flint.errors import FlintError

if TYPE_CHECKING:
    from flint.cost.flops import OpCost

DEVICES_DIR = Path(__file__).resolve().parent.parent / "devices"

_PEAK_KEY = {"f64": "fp64", "f32": "fp32", "tf32": "tf32", "bf16": "bf16", "f16": "fp16",
             "f8e4m3fn": "fp8", "f8e5m2": "fp8", "f8e4m3fnuz": "fp8", "f8e5m2fnuz": "fp8"}
_TENSOR_CORE = {"bf16", "fp16", "tf32", "fp8"}  # dtypes whose GEMMs run on tiled matrix units
_CAL_KEYS = {"kernel_floor_us", "comm_sms", "sustained_fraction", "compute_efficiency", "memory_efficiency", "gemm",
             "attention", "cudnn_attention"}
_TOP_KEYS = {"name", "description", "hbm_capacity_gib", "hbm_bandwidth_gbytes_per_s", "sm_count", "power_limit_w",
             "calibration"} | _CAL_KEYS | {f"peak_tflops_{k}" for k in set(_PEAK_KEY.values())}


@dataclass(frozen=True)
class Device:
    """One accelerator model (see the module docstring for the fields' meaning)."""

    name: str
    peak_tflops: Mapping[str, float]  # "fp32" / "tf32" / "bf16" / "fp16" / "fp8" -> dense TFLOP/s
    hbm_capacity_gib: float
    hbm_bandwidth_gbytes_per_s: float
    calibration: Calibration
    sm_count: int | None = None
    power_limit_w: float | None = None
    description: str = ""
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        sms = self.calibration.comm_sms
        if sms and (self.sm_count is None or sms >= self.sm_count):
            where = f"{self.source}: " if self.source else ""
            cal = self.calibration.source
            cal = f" (calibration {cal})" if cal and cal != self.source else ""
            raise FlintError(f"{where}device '{self.name}': comm_sms = {sms}{cal} needs sm_count above it "
                             f"(sm_count = {self.sm_count}; valid: 0 <= comm_sms < sm_count)")

    @property
    def kernel_floor_us(self) -> float:
        return self.calibration.kernel_floor_us

    def compute_rate(self, sms: int) -> float:
        """Speed of a compute kernel, relative to the device alone, while communication kernels hold
        ``sms`` SMs (module docstring: each collective in flight ``comm_sms``, a send its own ``sms``);
        never below one collective kernel's share (``comm_sms``, or one SM)."""
        if sms <= 0:
            return 1.0
        return max(self.sm_count - sms, self.calibration.comm_sms or 1) / self.sm_count

    @property
    def compute_efficiency(self) -> Mapping[str, float]:
        return self.calibration.compute_efficiency

    @property
    def memory_efficiency(self) -> Mapping[str, float]:
        return self.calibration.memory_efficiency

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

    def has_peak(self, dtype: object) -> bool:
        return _PEAK_KEY.get(canonical_dtype(dtype)) in self.peak_tflops

    def compute_eff(self, op_class: str) -> float:
        """Fraction of the peak an op of ``op_class`` reaches when only its FLOPs are known: the
        calibration's ``[compute_efficiency]`` entry, else for ``gemm`` the GEMM model's peak fraction
        and for ``attention`` the mean of its forward and backward plateaus, else ``default``."""
        cls = str(op_class)
        if cls in self.compute_efficiency:
            return self.compute_efficiency[cls]
        cal = self.calibration
        if cls == GEMM and cal.gemm is not None:
            return cal.gemm.peak_fraction
        if cls == ATTENTION and cal.attention is not None:
            return (cal.attention.fwd_fraction + cal.attention.bwd_fraction) / 2
        return self.compute_efficiency["default"]

    def memory_eff(self, op_class: str) -> float:
        return self.memory_efficiency.get(str(op_class), self.memory_efficiency["default"])

    def compute_time_us(self, flops: float, nbytes: float, op_class: str = GEMM, dtype: object = "bf16") -> float:
        """Roofline duration of one kernel in microseconds (module docstring)."""
        if str(op_class) == VIEW:
            return 0.0
        t_flops = flops / (self.peak_flops_per_s(dtype) * self.compute_eff(op_class)) * 1e6
        t_bytes = nbytes / (self.hbm_bandwidth_gbytes_per_s * 1e9 * self.memory_eff(op_class)) * 1e6
        return max(t_flops, t_bytes, self.kernel_floor_us) / self.calibration.sustained_fraction

    def compute_time_us_array(self, flops: np.ndarray, nbytes: np.ndarray, op_class: str = GEMM,
                              dtype: object = "bf16") -> np.ndarray:
        """:meth:`compute_time_us` over arrays (negative flops / bytes count as 0)."""
        f = np.maximum(np.asarray(flops, dtype=np.float64), 0.0)
        b = np.maximum(np.asarray(nbytes, dtype=np.float64), 0.0)
        t_flops = f / (self.peak_flops_per_s(dtype) * self.compute_eff(op_class)) * 1e6
        t_bytes = b / (self.hbm_bandwidth_gbytes_per_s * 1e9 * self.memory_eff(op_class)) * 1e6
        return np.maximum(np.maximum(t_flops, t_bytes), self.kernel_floor_us) / self.calibration.sustained_fraction

    def op_time_us(self, cost: "OpCost", dtype: object = "bf16") -> float:
        """Duration of one op from its :class:`~flint.cost.OpCost`: the shape models where the
        calibration has them (GEMM tiles and waves, fused attention), else the roofline."""
        cls = str(cost.op_class)
        if cls == VIEW:
            return 0.0
        cal = self.calibration
        if cost.kernel_shares:  # a multi-tensor op: its launches stream their share of the bytes, as pointwise ops
            t_bytes = cost.bytes / (self.hbm_bandwidth_gbytes_per_s * 1e3 * self.memory_eff(ELEMENTWISE))
            return sum(max(share * t_bytes, self.kernel_floor_us) for share in cost.kernel_shares) \
                / cal.sustained_fraction
        flops = cost.flops * cost.work_fraction
        key = _PEAK_KEY.get(canonical_dtype(dtype))
        if cls == GEMM and cost.gemm_dims is not None and cal.gemm is not None and self.sm_count \
                and key in _TENSOR_CORE:
            gemm = cal.gemm
            if key == "fp8" and cal.gemm_fp8_peak_fraction is not None:
                # no per-shape fp8 data: the fp8 MAMF fraction is both the ceiling and the main-loop rate
                gemm = replace(gemm, peak_fraction=cal.gemm_fp8_peak_fraction,
                               mainloop_fraction=cal.gemm_fp8_peak_fraction)
            bytes_per_us = self.hbm_bandwidth_gbytes_per_s * 1e3 * self.memory_eff(GEMM)
            t = gemm.time_us(cost.gemm_dims, cost.bytes, self.peak_flops_per_s(dtype), self.sm_count, bytes_per_us)
            return max(t, self.kernel_floor_us) / cal.sustained_fraction
        model = cal.attention
        if cost.attention_kernel == "cudnn" and cls == ATTENTION:
            model = cal.cudnn_attention
            if model is None:
                raise FlintError(f"device '{self.name}' has no [cudnn_attention] in its calibration ({cal.source}): "
                                 "no sourced cuDNN attention rates for it; drop attention-kernel{kernel=cudnn} "
                                 "(the default prices PyTorch's flash backend) or give the table with --calibration")
        if cls == ATTENTION and cost.attention_seq is not None and model is not None:
            seq_k, backward = cost.attention_seq
            t = model.time_us(flops, seq_k, backward, self.peak_flops_per_s(dtype), cost.attention_dropout)
            t_bytes = cost.bytes / (self.hbm_bandwidth_gbytes_per_s * 1e3 * self.memory_eff(ATTENTION))
            return max(t, t_bytes, self.kernel_floor_us) / cal.sustained_fraction
        return self.compute_time_us(flops, cost.bytes, cls, dtype)

    def calibrated(self, calibration: Mapping[str, Any] | str | Path) -> "Device":
        """A copy with ``calibration``'s keys overriding the device's calibration (each range-checked):
        a dict, a TOML path, a shipped override by name (``"fitted/h100-sxm"``: the file
        ``flint/devices/calibration/fitted/h100-sxm.toml``), or ``"fitted"``, this device's fitted one.
        A file whose ``device`` key names another device is refused."""
        if isinstance(calibration, Mapping):
            data, where = dict(calibration), "calibration"
        else:
            if str(calibration) == "fitted":  # this device's own fitted override
                if f"fitted/{self.name}" not in list_overrides():
                    raise FlintError(f"no fitted calibration for device '{self.name}' (fitted: "
                                     f"{', '.join(n.split('/')[1] for n in list_overrides())})")
                calibration = f"fitted/{self.name}"
            path = shipped_override(calibration) or Path(calibration)
            if not path.is_file():
                raise FlintError(f"calibration file '{calibration}' does not exist (or name a shipped one: "
                                 f"fitted, {', '.join(list_overrides())})")
            data, where = read_toml(path, "calibration"), str(path)
        if "device" in data and data["device"] != self.name:
            raise FlintError(f"{where}: a calibration for device {data['device']!r}, not '{self.name}' (remove its "
                             f"'device' key to apply it to '{self.name}' anyway)")
        data.pop("device", None)
        data.pop("description", None)
        return replace(self, calibration=merge_calibration(self.calibration, data, where))

    def to_toml(self) -> str:
        """This device, calibration included, as one self-contained device TOML."""
        lines = [f"name = {json.dumps(self.name)}", f"description = {json.dumps(self.description)}",
                 f"hbm_capacity_gib = {self.hbm_capacity_gib!r}",
                 f"hbm_bandwidth_gbytes_per_s = {self.hbm_bandwidth_gbytes_per_s!r}"]
        if self.sm_count is not None:
            lines.append(f"sm_count = {self.sm_count}")
        if self.power_limit_w is not None:
            lines.append(f"power_limit_w = {float(self.power_limit_w)!r}")
        lines += [f"peak_tflops_{k} = {float(v)!r}" for k, v in sorted(self.peak_tflops.items())]
        return "\n".join(lines) + "\n" + self.calibration.to_toml()


@contextmanager
def device_argument(device_name: str, calibration: Mapping[str, Any] | str | Path | None = None) -> Iterator[str]:
    """What a pass's ``device`` option takes (a preset name or a TOML path): ``device_name`` itself, or
    with ``calibration`` a temporary TOML of the calibrated device, removed on exit."""
    if calibration is None:
        yield device_name
        return
    text = load_device(device_name, calibration).to_toml()
    fd, tmp = tempfile.mkstemp(prefix="flint-device-", suffix=".toml")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        yield tmp
    finally:
        os.unlink(tmp)


def list_devices() -> list[str]:
    """Names of the device presets shipped in ``flint/devices``."""
    return sorted(p.stem for p in DEVICES_DIR.glob("*.toml"))


def _positive(d: Mapping[str, Any], key: str, where: str, kind: type = float) -> Any:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)) \
            or not 0 < v < math.inf:
        raise FlintError(f"{where}: {key} = {v!r} must be a positive {'integer' if kind is int else 'finite number'}")
    return kind(v)


def device_from_dict(d: Mapping[str, Any], where: str = "device", base_dir: Path | None = None) -> Device:
    """Build a :class:`Device` from a parsed device TOML (validating every key)."""
    unknown = set(d) - _TOP_KEYS
    if unknown:
        raise FlintError(f"{where}: unknown keys {sorted(unknown)} (allowed: {', '.join(sorted(_TOP_KEYS))})")
    for k in ("name", "hbm_capacity_gib", "hbm_bandwidth_gbytes_per_s", "peak_tflops_bf16"):
        if k not in d:
            raise FlintError(f"{where}: missing required key '{k}'")
    peaks = {k[len("peak_tflops_"):]: _positive(d, k, where) for k in d if k.startswith("peak_tflops_")}
    inline = {k: d[k] for k in _CAL_KEYS if k in d}
    if "calibration" in d:
        if inline:
            raise FlintError(f"{where}: give either 'calibration' or the inline keys {sorted(inline)}, not both")
        cal = load_calibration(str(d["calibration"]), needs_fp8="fp8" in peaks, relative_to=base_dir)
    elif "gemm" in inline or "attention" in inline:
        cal = parse_calibration(inline, where, needs_fp8="fp8" in peaks)
    else:  # plain roofline with per-class constants (older device files)
        cal = _legacy_calibration(inline, where)
    return Device(name=str(d["name"]), peak_tflops=peaks, hbm_capacity_gib=_positive(d, "hbm_capacity_gib", where),
                  hbm_bandwidth_gbytes_per_s=_positive(d, "hbm_bandwidth_gbytes_per_s", where), calibration=cal,
                  sm_count=_positive(d, "sm_count", where, int) if "sm_count" in d else None,
                  power_limit_w=_positive(d, "power_limit_w", where) if "power_limit_w" in d else None,
                  description=str(d.get("description", "")), source=where)


def _legacy_calibration(data: Mapping[str, Any], where: str) -> Calibration:
    """A roofline-only calibration (no GEMM / attention shape model)."""
    base = Calibration(0.0, {"default": 0.5}, {"default": 0.8}, source=where)
    return merge_calibration(base, data, where)


def load_device(name_or_path: str | Path, calibration: Mapping[str, Any] | str | Path | None = None) -> Device:
    """Load a device preset by name (``"h100-sxm"``) or from a TOML file path.

    ``calibration`` (a TOML path or a dict) overrides keys of the device's
    calibration. An unknown name raises :class:`FlintError` listing the valid
    names.
    """
    s = str(name_or_path)
    p = Path(s)
    if s.endswith(".toml") or p.is_file():
        dev = device_from_dict(read_toml(p, "device"), where=s, base_dir=p.parent)
    else:
        preset = DEVICES_DIR / f"{s}.toml"
        if not preset.is_file():
            raise FlintError(f"unknown device '{s}' (valid: {', '.join(list_devices())}; or give a .toml path)")
        dev = device_from_dict(read_toml(preset, "device"), where=str(preset), base_dir=preset.parent)
    return dev.calibrated(calibration) if calibration is not None else dev
