"""Shape-aware kernel time: GEMM tile and wave quantization, fused attention, launch floor.

The device roofline (:meth:`flint.cost.Device.compute_time_us`) prices an op
from its FLOPs and bytes with one efficiency per op class. Real GEMM kernels
are not that uniform: a GEMM is cut into output tiles, the tiles run in
*waves* over the streaming multiprocessors, and every tile pays a fixed
pipeline fill and epilogue besides its main loop. This module prices a GEMM
from its shape, following NVIDIA's *Matrix Multiplication Background User's
Guide* (tile quantization, wave quantization), and fused attention from the
kernel's measured efficiency. Its parameters are a device's calibration
(:mod:`flint.cost.calibration`), sourced per device, never fitted to a
workload.

GEMM of ``batch`` independent ``m x n x k`` products, for each candidate
tile ``(tm, tn, rel)`` and split-K factor ``s``::

    tiles      = batch * ceil(m / tm) * ceil(n / tn) * s
    waves      = ceil(tiles / sm_count)
    per_tile   = 2 * tm * tn * (ceil(k / s) + k_overhead) / (peak / sm_count * mainloop_fraction * rel)
    t_math     = waves * per_tile
    t_bytes    = (inputs + output + (s > 1) * s * m * n * 4 * batch) / (hbm * memory_efficiency[gemm])
    t_ceiling  = 2 * batch * m * n * k / (peak * peak_fraction)
    time       = latency_us + min over (tile, s) of max(t_math, t_bytes, t_ceiling),
                 at least kernel_floor_us

``peak_fraction`` is the Maximum Achievable Matmul FLOPS (MAMF) of the device
over its dense peak: no GEMM runs faster. ``mainloop_fraction`` is the
throughput of one SM's main loop over its share of the dense peak (at least
``peak_fraction``; equal to it where no per-shape data was fitted, which
makes ``t_ceiling`` inactive); ``rel`` is a smaller tile's throughput
relative to the largest; ``k_overhead`` is the per-tile fixed cost in
K-elements (pipeline fill, epilogue), the small-K penalty; ``latency_us``
the fixed time of one GEMM kernel whatever its shape (launch to first tile,
prologue, tail), which dominates small GEMMs. Split-K cuts K into ``s``
slices for shapes with too few output tiles to fill the device, at the
price of an fp32 partial-sum round trip. Where a device's calibration was
fitted to published per-shape measurements, :mod:`flint.cost.gemm_fit` did
it and the data lives beside the calibration (``calibration/data``).

Fused attention (FlashAttention-style, forward or backward)::

    time = flops * work_fraction / (peak * fraction(phase) * s_k / (s_k + seq_half))
           * (1 + dropout_overhead if the kernel applies dropout)

``fraction`` is the kernel's measured plateau (long sequences) for the
phase; ``seq_half`` the key length at which it reaches half of it;
``dropout_overhead`` the measured extra time of the same kernel with
dropout (its in-kernel random mask), 0 where no measurement exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GemmDims = tuple[int, int, int, int]  # (batch, m, n, k)


@dataclass(frozen=True)
class GemmModel:
    """Calibration of the GEMM kernel model (module docstring)."""

    peak_fraction: float
    tiles: tuple[tuple[int, int, float], ...]  # (tile_m, tile_n, relative throughput)
    k_overhead: float
    max_split_k: int
    mainloop_fraction: float | None = None  # None: peak_fraction (no ceiling of its own)
    latency_us: float = 0.0

    def time_us(self, dims: GemmDims, nbytes: float, peak_flops_per_s: float, sm_count: int,
                bytes_per_us: float) -> float:
        """Time of one GEMM without the launch floor (the caller applies it)."""
        batch, m, n, k = (max(int(x), 1) for x in dims)
        mainloop = self.peak_fraction if self.mainloop_fraction is None else self.mainloop_fraction
        per_sm = peak_flops_per_s / sm_count * mainloop / 1e6  # FLOPs per microsecond per SM
        ceiling = 2.0 * batch * m * n * k / (peak_flops_per_s * self.peak_fraction / 1e6)
        best = math.inf
        for tm, tn, rel in self.tiles:
            out_tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
            for s in _splits(out_tiles, k, sm_count, self.max_split_k):
                tiles = out_tiles * s
                waves = math.ceil(tiles / sm_count)
                per_tile = 2.0 * tm * tn * (math.ceil(k / s) + self.k_overhead) / (per_sm * rel)
                extra = 0.0 if s == 1 else 2.0 * s * m * n * 4 * batch  # fp32 partials written + read
                t = max(waves * per_tile, (nbytes + extra) / bytes_per_us, ceiling)
                best = min(best, t)
        return self.latency_us + best


def _splits(out_tiles: int, k: int, sm_count: int, max_split: int) -> range:
    """Split-K factors worth trying: only when the output tiles leave SMs idle."""
    if out_tiles >= sm_count or max_split <= 1:
        return range(1, 2)
    return range(1, min(max_split, max(1, k // 128)) + 1)


@dataclass(frozen=True)
class AttentionModel:
    """Calibration of the fused attention kernel (module docstring)."""

    fwd_fraction: float
    bwd_fraction: float
    seq_half: float
    dropout_overhead: float = 0.0  # extra time with dropout in the kernel (0: no measurement, priced as without)

    def time_us(self, flops: float, seq_k: int, backward: bool, peak_flops_per_s: float,
                dropout: bool = False) -> float:
        frac = self.bwd_fraction if backward else self.fwd_fraction
        eff = frac * seq_k / (seq_k + self.seq_half)
        return flops / (peak_flops_per_s * eff) * 1e6 * (1.0 + self.dropout_overhead if dropout else 1.0)
