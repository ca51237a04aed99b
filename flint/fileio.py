"""Atomic output: every file Flint writes appears whole or not at all."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator


@contextmanager
def atomic_text_file(path: str | os.PathLike, mode: str = "w") -> Iterator[IO[str]]:
    """Open a temporary file next to ``path`` for writing; rename it onto
    ``path`` when the block finishes, delete it if the block raises.
    ``mode="wb"`` gives a binary file (:func:`atomic_binary_file`)."""
    path = Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_binary_file(path: str | os.PathLike):
    """:func:`atomic_text_file` for bytes (Parquet, PNG)."""
    return atomic_text_file(path, "wb")


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    with atomic_text_file(path) as f:
        f.write(text)
    return Path(path)
