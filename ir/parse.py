"""Reading IR files with diagnostics that name file, line and column."""

from __future__ import annotations

from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation
from xdsl.parser import Parser
from xdsl.utils.exceptions import ParseError, VerifyException

from flint.errors import FlintError


class RecordingParser(Parser):
    """A parser that remembers where each operation started in the source."""

    def __init__(self, *args, positions: dict[Operation, tuple[int, int]], line_offset: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self._positions = positions
        self._line_offset = line_offset

    def parse_operation(self) -> Operation:
        loc = self._current_token.span.get_location()
        op = super().parse_operation()
        self._positions[op] = (loc.line + self._line_offset, loc.col)
        return op


def failing_op(module: ModuleOp, err: Exception) -> Operation | None:
    """The op a verifier error is about: ``err.op`` if set, else the first op that fails to verify."""
    op = getattr(err, "op", None)
    if isinstance(op, Operation):
        return op
    for candidate in module.walk():
        try:
            candidate.verify(verify_nested_ops=False)
        except Exception:
            return candidate
    return None


def parse_error_message(err: ParseError) -> str:
    """``file:line:col: error: msg`` plus the source line with a caret."""
    loc = err.span.get_location()
    context = "\n".join(err.span.print_with_context().rstrip().splitlines()[1:])
    return f"{loc.file}:{loc.line}:{loc.col}: error: {err.msg}\n{context}"


def load_ir(path: str) -> ModuleOp:
    """Parse and verify an IR file; errors are :class:`FlintError` naming file:line:col."""
    from flint.ir import flint_context

    try:
        text = open(path, "rb").read()
    except OSError as e:
        raise FlintError(f"cannot read IR file {path}: {e.strerror}") from None
    positions: dict[Operation, tuple[int, int]] = {}
    try:
        module = RecordingParser(flint_context(), text, path, positions=positions).parse_module()
    except ParseError as e:
        raise FlintError(parse_error_message(e)) from None
    try:
        module.verify()
    except VerifyException as e:
        op = failing_op(module, e)
        where = f"{path}:{positions[op][0]}:{positions[op][1]}" if op in positions else path
        raise FlintError(f"{where}: error: {str(e).splitlines()[0]}") from None
    return module
