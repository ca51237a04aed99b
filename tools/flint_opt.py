"""`flint-opt`: Flint's `mlir-opt`-style driver.

Built on xDSL's opt driver: parse textual MLIR, run a `-p` pipeline of
passes (with options, e.g. ``-p 'canonicalize-dist{fold-waits=false}'``),
print the result (or hand it to a target with ``-t``). Errors in the input
or raised by a pass are reported as ``file:line:col: error: message`` with
a non-zero exit; ``--verify-diagnostics`` / ``--parsing-diagnostics`` print
them and exit 0, for lit tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import textwrap
from io import StringIO
from typing import IO

from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation
from xdsl.utils.exceptions import ArgSpecParseError, DiagnosticException, ParseError
from xdsl.xdsl_opt_main import xDSLOptMain

from flint.errors import FlintError, run_cli
from flint.fileio import write_text_atomic
from flint.ir.parse import (RecordingParser, check_lexical, decode_source, failing_op, located,
                            parse_error_message)
from flint.ir import FLINT_DIALECTS
from flint.ir.module import verify_module
from flint.passes.registry import FLINT_PASSES, all_passes, options, parse_passes, summary
from flint.schedule.pipelines import SCHEDULING_PASSES, record_scheduling

# Generic xDSL passes that are useful on Flint IR too.
XDSL_PASSES = ("canonicalize", "cse", "dce")


class FlintOptMain(xDSLOptMain):
    """The driver: xDSL's, with Flint's dialects, passes and error reporting."""

    version_format = "flint-opt (Flint 0.1.0) built on xdsl {xdsl_version}"

    def __init__(self, args=None):
        self._positions: dict[Operation, tuple[int, int]] = {}
        super().__init__(description="Flint's optimizer driver: parse IR, run passes, print the result.", args=args)

    def register_all_dialects(self) -> None:
        super().register_all_dialects()
        for dialect in FLINT_DIALECTS:
            self.ctx.register_dialect(dialect.name, lambda d=dialect: d)

    def register_all_passes(self) -> None:
        super().register_all_passes()
        keep = {n: f for n, f in self.available_passes.items() if n in XDSL_PASSES}
        self.available_passes = {**keep, **all_passes()}

    def register_all_targets(self) -> None:
        def chakra_target():
            from flint.tools.chakra_target import ChakraTarget  # imports numpy and the writer: only when used

            return ChakraTarget

        super().register_all_targets()
        # xDSL's other targets (assembly, wasm, GPU shaders) do not apply to Flint's dialects.
        self.available_targets = {"mlir": self.available_targets["mlir"], "chakra": chakra_target}

    def register_all_arguments(self, arg_parser: argparse.ArgumentParser) -> None:
        super().register_all_arguments(arg_parser)
        arg_parser.formatter_class = argparse.RawDescriptionHelpFormatter
        for action in arg_parser._actions:
            if "--target" in action.option_strings:
                action.help = ("output target: mlir (default: print the IR) or chakra{out=DIR prefix=NAME "
                               "force=false} (write per-rank Chakra ET files of the lowered chakra.graph)")
        lines = ["Flint passes (run with -p 'name{option=value,...}', comma-separated; defaults shown):"]
        for name, factory in self.available_passes.items():
            if name in XDSL_PASSES:
                continue
            try:
                cls = factory()
                text = summary(cls)
                opts = options(cls)
            except Exception as e:  # a broken plug-in must not break --help
                text, opts = f"(cannot load: {e})", []
            origin = "" if name in FLINT_PASSES or name in XDSL_PASSES else "  [plug-in]"
            lines.append(f"  {name:<24} {text}{origin}")
            if opts:
                lines.append(f"  {'':<24}   options: {', '.join(opts)}")
        lines.append("")
        lines.append(f"Generic xDSL passes: {', '.join(XDSL_PASSES)}.")
        lines.append("Print the IR after each pass with --print-between-passes.")
        lines.append(textwrap.fill(f"A pipeline with a scheduling pass ({', '.join(sorted(SCHEDULING_PASSES))} or a "
                                   "plug-in) is recorded on a module with a plan (flint.scheduled_by): flint estimate, "
                                   "simulate and emit then run no default pipeline on top of it.", 100,
                                   break_on_hyphens=False) + "\n")
        arg_parser.epilog = "\n".join(lines)

    def setup_pipeline(self) -> None:
        if self.args.passes:  # first, for errors that name the pass and the option at fault
            parse_passes(self.available_passes, self.args.passes)
        super().setup_pipeline()

    # -- input ---------------------------------------------------------------
    def parse_chunk(self, chunk: IO[bytes], file_extension: str, start_offset: int = 0) -> ModuleOp | None:
        if self.args.frontend or file_extension != "mlir":
            return super().parse_chunk(chunk, file_extension, start_offset)
        name = self.get_input_name()
        text = decode_source(chunk.read(), name)
        check_lexical(text, name)
        parser = RecordingParser(
            self.ctx, text, name, positions=self._positions, line_offset=start_offset
        )
        return parser.parse_resolved_module(name, not self.args.no_implicit_module)

    def apply_passes(self, prog: ModuleOp) -> None:
        super().apply_passes(prog)
        verify_module(prog)
        if self.args.passes:  # so that flint estimate / emit run no default schedule on top of this one
            record_scheduling(prog, self.args.passes, set(FLINT_PASSES) | set(XDSL_PASSES))

    # -- errors --------------------------------------------------------------
    def _locate(self, op: Operation | None) -> str:
        return located(self._positions, op, self.get_input_name())

    def _diagnostic(self, module: ModuleOp | None, err: Exception) -> str:
        if isinstance(err, ParseError):
            return parse_error_message(err)
        if isinstance(err, FlintError) and str(err).startswith(f"{self.get_input_name()}:"):
            return str(err)  # already located (non-UTF-8 bytes, nesting)
        where = self._locate(failing_op(module, err) if module is not None else getattr(err, "op", None))
        msg = str(err).strip() or type(err).__name__
        other = getattr(err, "other", None)  # a second op the error is about (verify-p2p's pairs)
        note = f"\n{self._locate(other)}: note: the other op: '{other.name}'" if isinstance(other, Operation) else ""
        return f"{where}: error: {msg}{note}"

    # -- main loop -----------------------------------------------------------
    def run(self) -> int:
        chunks, file_extension = self.prepare_input()
        output = StringIO()
        for i, (chunk, offset) in enumerate(chunks):
            if i > 0:
                output.write("// -----\n")
            module: ModuleOp | None = None
            try:
                module = self.parse_chunk(chunk, file_extension, offset)
                if module is not None:
                    module.verify()
                    verify_module(module)
                    self.apply_passes(module)
                    output.write(self.output_resulting_program(module))
            except ParseError as e:
                e.span = dataclasses.replace(e.span, line_offset=offset)
                if not self.args.parsing_diagnostics:
                    print(self._diagnostic(module, e), file=sys.stderr)
                    return 1
                output.write(self._diagnostic(module, e) + "\n")
            except (DiagnosticException, FlintError) as e:
                if not self.args.verify_diagnostics:
                    print(self._diagnostic(module, e), file=sys.stderr)
                    return 1
                output.write(self._diagnostic(module, e) + "\n")
            finally:
                chunk.close()
        self._write(output.getvalue())
        return 0

    def _write(self, text: str) -> None:
        """Print, or write ``-o`` atomically (temp file, then rename)."""
        if self.args.output_file is None:
            sys.stdout.write(text)
        else:
            write_text_atomic(self.args.output_file, text)


def main(argv: list[str] | None = None) -> int:
    def run() -> int:
        try:
            return FlintOptMain(args=argv).run()
        except BrokenPipeError:  # stdout's reader went away (run_cli ends quietly)
            raise
        except (ValueError, OSError, ArgSpecParseError) as e:  # ArgSpecParseError: a malformed -p / -t spec
            raise FlintError(str(e)) from None

    return run_cli("flint-opt", run)


if __name__ == "__main__":
    sys.exit(main())
