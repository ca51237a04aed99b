"""Flint's one unit convention for what it prints.

- Memory and data sizes (tensors, buffers, files): binary units, ``B``, ``KiB``,
  ``MiB``, ``GiB``, ``TiB`` (:func:`fmt_bytes`), as ``nvidia-smi`` and
  ``torch.cuda.memory_summary`` report memory.
- Bandwidth: decimal ``GB/s`` (10^9 bytes per second), as vendors and
  nccl-tests quote links and HBM.
- FLOPs: decimal (``GFLOP``, ``TFLOP/s``) (:func:`fmt_count`).
- Time: ``us`` / ``ms`` / ``s``, named in the column header.
"""

from __future__ import annotations


def fmt_bytes(n: float) -> str:
    """``1536`` -> ``"1.50 KiB"`` (binary units; exact bytes below 1 KiB)."""
    n = float(n)
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.3g} {unit}" if abs(n) < 100 else f"{n:,.0f} {unit}"
    return f"{n:.3g} PiB"


def fmt_count(x: float, unit: str = "") -> str:
    """``2.5e12, "FLOP"`` -> ``"2.50 TFLOP"`` (decimal prefixes)."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}"
