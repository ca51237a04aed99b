"""Reading TOML files: :func:`parse_toml`."""

from __future__ import annotations

import tomllib
from typing import Any


def parse_toml(data: bytes | str) -> dict[str, Any]:
    """``tomllib.loads`` of ``data`` (bytes are decoded as UTF-8; a ``UnicodeDecodeError`` is the caller's to
    name), with arrays or tables nested too deeply for tomllib's recursion (about a thousand levels) raised as a
    :class:`tomllib.TOMLDecodeError`, as any other malformed file is, rather than a ``RecursionError``."""
    text = data.decode() if isinstance(data, bytes) else data
    try:
        return tomllib.loads(text)
    except RecursionError:
        raise tomllib.TOMLDecodeError("arrays or inline tables nested too deeply") from None
