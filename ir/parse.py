"""Reading IR files with diagnostics that name file, line and column."""

from __future__ import annotations

import re
import struct

from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation
from xdsl.parser import Parser
from xdsl.parser.core import ForwardDeclaredValue
from xdsl.utils.exceptions import ParseError, VerifyException

from flint.errors import FlintError


def located(positions: dict[Operation, tuple[int, int]], op: Operation | None, path: str) -> str:
    """``path:line:col`` of ``op`` where the parser recorded it, else ``path``."""
    if op is not None and op in positions:
        line, col = positions[op]
        return f"{path}:{line}:{col}"
    return path


class RecordingParser(Parser):
    """A parser that remembers where each operation started in the source, and the names of values used
    before their definition (``forward_names``)."""

    def __init__(self, *args, positions: dict[Operation, tuple[int, int]], line_offset: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self._positions = positions
        self._line_offset = line_offset
        self.forward_names: dict[ForwardDeclaredValue, str] = {}

    def resolve_operand(self, operand, type):
        value = super().resolve_operand(operand, type)
        if isinstance(value, ForwardDeclaredValue):
            self.forward_names.setdefault(value, operand.operand_name)
        return value

    def parse_resolved_module(self, path: str, implicit: bool = True) -> ModuleOp:
        """``parse_module``, then refuse a use xDSL could not resolve: a value defined inside a region of the
        op that uses it stays a placeholder, on which xDSL's verifier fails without a location."""
        module = self.parse_module(implicit)
        for op in module.walk():
            for value in op.operands:
                if isinstance(value, ForwardDeclaredValue):
                    name = self.forward_names.get(value, "?")
                    raise FlintError(f"{located(self._positions, op, path)}: error: '{op.name}' uses %{name}, which "
                                     "is not defined before it in a scope the op sees (a value defined inside the "
                                     "op's own region, or later)")
        return module

    def parse_operation(self) -> Operation:
        span = self._current_token.span
        loc = span.get_location()
        try:
            op = super().parse_operation()
        except (VerifyException, struct.error, OverflowError, ValueError) as e:
            # An attribute or type constructor refused a value while the op was
            # parsed (an integer beyond its type, an unranked tensor where a
            # ranked one is required, ...): report it at the op.
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if isinstance(e, struct.error):
                msg = f"integer out of range for its attribute ({msg}; grid axes are i16)"
            raise ParseError(span, msg) from None
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


def decode_source(data: bytes, path: str) -> str:
    """IR text as ``str``; a byte that is not UTF-8 is an error naming file:line:col."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        bad = data[e.start:e.end].hex(" ")
        raise FlintError(f"{path}:{line}:{col}: error: byte(s) {bad} are not UTF-8 text ({e.reason}); "
                         "IR files are UTF-8") from None


#: Deepest nesting (brackets, regions, types) an IR file may have; Python's parser recursion ends beyond it.
MAX_NESTING = 64

# What the scan stops at outside a string literal: a newline, a quote, a bracket, a comment.
_LEXICAL = re.compile(r'[\n"()\[\]{}<>]|//')
# A string literal's body as MLIR (and xDSL's lexer) accepts it, matched one character or escape at a time: xDSL's
# own pattern nests quantifiers ("(?:[^"...]+|...)*"), which backtracks exponentially in the length of an
# unterminated literal (a 24-character one took 0.5 s, each further two characters x4): checked here first.
_STRING_BODY = re.compile(r'(?:[^"\\\n\v\f]|\\(?:["nt\\]|[0-9A-Fa-f]{2}))*')


def check_lexical(text: str, path: str) -> None:
    """Refuse absurd nesting before the recursive-descent parser would exhaust Python's stack, and a string
    literal that is not closed on its line or holds an escape MLIR does not have, before xDSL's lexer would
    spend exponential time on it. Linear in the text; errors name file:line:col."""
    depth = 0
    line = 1
    col0 = 0  # offset of the current line's first character
    pos = 0
    while (m := _LEXICAL.search(text, pos)) is not None:
        i, ch = m.start(), m.group()
        pos = m.end()
        if ch == "\n":
            line += 1
            col0 = pos
        elif ch == "//":  # a comment, to the end of its line
            pos = text.find("\n", i)
            if pos < 0:
                return
        elif ch == '"':
            end = _STRING_BODY.match(text, pos).end()
            if end < len(text) and text[end] == '"':
                pos = end + 1
                continue
            where = f"{path}:{line}:{i - col0 + 1}: error:"
            if end < len(text) and text[end] == "\\":
                bad = text[end:end + 3].split("\n")[0]
                raise FlintError(f"{path}:{line}:{end - col0 + 1}: error: invalid escape '{bad}' in a string literal "
                                 "(MLIR's are \\\" \\n \\t \\\\ and \\ with two hex digits)")
            if end < len(text) and text[end] in "\v\f":
                raise FlintError(f"{where} a string literal holds a vertical tab or form feed; write it as \\0B or "
                                 "\\0C")
            raise FlintError(f"{where} unterminated string literal: no closing '\"' before the end of the line")
        elif ch in "([{<":
            depth += 1
            if depth > MAX_NESTING:
                raise FlintError(f"{path}:{line}:{i - col0 + 1}: error: nesting deeper than {MAX_NESTING} levels "
                                 "(brackets, braces, regions); no Flint IR nests like this")
        elif depth > 0 and not (ch == ">" and i > 0 and text[i - 1] == "-"):
            depth -= 1


def read_source(path: str) -> str:
    """Read an IR file as checked UTF-8 text with sane nesting (errors name file:line:col)."""
    try:
        data = open(path, "rb").read()
    except IsADirectoryError:
        raise FlintError(f"cannot read IR file {path}: it is a directory") from None
    except OSError as e:
        raise FlintError(f"cannot read IR file {path}: {e.strerror}") from None
    text = decode_source(data, path)
    check_lexical(text, path)
    return text


def load_ir(path: str) -> ModuleOp:
    """Parse and verify an IR file holding a training step (a module without one is refused); errors are
    :class:`FlintError` naming file:line:col."""
    from flint.ir import flint_context

    text = read_source(path)
    positions: dict[Operation, tuple[int, int]] = {}
    try:
        module = RecordingParser(flint_context(), text, path, positions=positions).parse_resolved_module(path)
    except ParseError as e:
        raise FlintError(parse_error_message(e)) from None
    try:
        module.verify()
        from flint.ir.module import verify_module

        verify_module(module)
    except VerifyException as e:
        op = failing_op(module, e)
        raise FlintError(f"{located(positions, op, path)}: error: {str(e).splitlines()[0]}") from None
    if not any(op.name in ("func.func", "chakra.graph") for op in module.ops):
        raise FlintError(f"{path}:1:1: error: the module holds no training step: no func.func (aten + dist IR) and "
                         "no chakra.graph (lowered or imported per-rank graphs)")
    return module
