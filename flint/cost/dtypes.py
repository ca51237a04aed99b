"""Element sizes of the dtypes Flint meets, under every spelling it meets them.

The importer carries MLIR element types (``bf16``, ``f32``, ``i64``,
``f8E4M3FN``), FX carries ``torch.dtype`` values, users type ``bfloat16``.
:func:`dtype_bytes` accepts all of them, so the byte count of a tensor is
computed in one place.
"""

from __future__ import annotations

import math
from typing import Sequence

from flint.errors import FlintError

_SIZES: dict[str, int] = {
    # canonical short names (MLIR spelling)
    "f64": 8, "f32": 4, "tf32": 4, "f16": 2, "bf16": 2,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e8m0fnu": 1,
    "i64": 8, "i32": 4, "i16": 2, "i8": 1, "ui8": 1, "i1": 1,
    "c64": 8, "c128": 16,
}
_ALIASES: dict[str, str] = {
    "float64": "f64", "double": "f64", "float32": "f32", "float": "f32", "fp32": "f32",
    "float16": "f16", "half": "f16", "fp16": "f16", "bfloat16": "bf16",
    "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2", "float8_e4m3fnuz": "f8e4m3fnuz",
    "float8_e5m2fnuz": "f8e5m2fnuz", "float8_e8m0fnu": "f8e8m0fnu", "fp8": "f8e4m3fn",
    "int64": "i64", "long": "i64", "int32": "i32", "int": "i32", "int16": "i16", "short": "i16",
    "int8": "i8", "uint8": "ui8", "bool": "i1",
    "complex64": "c64", "cfloat": "c64", "complex128": "c128", "cdouble": "c128",
    "complex<f32>": "c64", "complex<f64>": "c128",  # MLIR's spelling (the importer's element types)
}


def canonical_dtype(dtype: object) -> str:
    """The canonical short name (``"bf16"``, ``"f32"``, ...) of ``dtype``.

    Accepts a ``torch.dtype``, ``"torch.bfloat16"``, ``"bfloat16"``,
    ``"bf16"``, MLIR's ``"f8E4M3FN"`` and the like. Raises :class:`FlintError`
    for an unknown spelling.
    """
    name = str(dtype).strip().lower()
    if name.startswith("torch."):
        name = name[len("torch."):]
    name = _ALIASES.get(name, name)
    if name not in _SIZES:
        raise FlintError(f"unknown dtype '{dtype}' (known: {', '.join(sorted(_SIZES))})")
    return name


def dtype_bytes(dtype: object) -> int:
    """Bytes per element of ``dtype`` (``bool`` counts one byte, as in PyTorch)."""
    return _SIZES[canonical_dtype(dtype)]


def tensor_bytes(shape: Sequence[int], dtype: object) -> int:
    """Bytes of a dense tensor of ``shape`` and ``dtype`` (a scalar has shape ``()``)."""
    return math.prod(int(s) for s in shape) * dtype_bytes(dtype)
