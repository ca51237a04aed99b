"""The error ``flint.capture`` raises for bad user input."""

from __future__ import annotations

from flint.errors import FlintError


class CaptureError(FlintError):
    """A capture input is wrong: names the field (and, for model code, the source line)."""

    def __init__(self, field: str, message: str, source: str | None = None) -> None:
        self.field = field
        self.message = message
        self.source = source
        text = f"{field}: {message}"
        if source:
            text += f"\n  at {source}"
        super().__init__(text)
