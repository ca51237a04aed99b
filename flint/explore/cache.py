"""A content-addressed on-disk cache of captured programs, safe to share between runs.

A captured program is the step IR ``flint capture`` would write (``.mlir``
text). Its key is the hash of everything that decides the program: the
model and its depth, the dtype, the plan (every field, world size
included), the *local* batch shapes each rank sees, and a fingerprint of the
code that captures and imports (Flint's capture, importer and model sources
and the torch version), so an upgrade never serves a stale program.

Files are ``<root>/<key[:2]>/<key>.mlir`` with a ``.json`` sidecar naming
the inputs. Writes go through a temporary file and a rename
(:mod:`flint.fileio`), so a reader sees a whole program or none; a lock file
per key (``fcntl.flock``) makes concurrent runs that need the same program
capture it once while the others wait. A damaged entry (unparsable) is
reported with its path; delete it to capture again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any, Iterator, Mapping

from flint.fileio import write_text_atomic

DEFAULT_ROOT_ENV = "FLINT_CACHE"


def default_root() -> Path:
    """``$FLINT_CACHE`` or ``~/.cache/flint/captures``."""
    env = os.environ.get(DEFAULT_ROOT_ENV)
    return Path(env) if env else Path.home() / ".cache" / "flint" / "captures"


@cache
def code_fingerprint() -> str:
    """Hash of the sources that decide a captured program, plus the torch and xDSL versions."""
    import torch
    import xdsl

    import flint

    root = Path(flint.__file__).resolve().parent
    files = sorted([*root.joinpath("capture").glob("*.py"), *root.joinpath("models").glob("*.py"),
                    root / "models" / "configs.toml", root / "importer.py", root / "plan.py"])
    h = hashlib.sha256()
    h.update(f"torch {torch.__version__} xdsl {getattr(xdsl, '__version__', '?')}".encode())
    for f in files:
        if f.is_file():
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def capture_key(inputs: Mapping[str, Any]) -> str:
    """The content key of a captured program from its inputs (a JSON-able mapping)."""
    text = json.dumps({"inputs": inputs, "code": code_fingerprint()}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class CaptureCache:
    """Captured step IR by content key (module docstring)."""

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.mlir"

    def get(self, key: str) -> str | None:
        p = self.path(key)
        try:
            return p.read_text()
        except FileNotFoundError:
            return None

    def put(self, key: str, text: str, inputs: Mapping[str, Any]) -> Path:
        p = self.path(key)
        write_text_atomic(p.with_suffix(".json"), json.dumps(inputs, indent=1, sort_keys=True) + "\n")
        write_text_atomic(p, text)
        return p

    @contextmanager
    def lock(self, key: str) -> Iterator[None]:
        """Hold the key's lock (other processes needing the same program wait here)."""
        p = self.path(key).with_suffix(".lock")
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
