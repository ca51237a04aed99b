"""`flint`: from a model and a plan to traces, estimates and reports.

Subcommands (``flint <command> --help`` explains each):

  capture    capture a model's training step under a plan and write the IR (.mlir)
  emit       lower a step's IR to per-rank Chakra ET files + comm-group JSON
  inspect    summarize and check any Chakra trace directory

Errors name the input that is wrong and exit non-zero; no tracebacks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence

from flint.errors import FlintError


def _load_ir(path: str):
    """Parse and verify a .mlir file, reporting errors with file:line:col."""
    from xdsl.utils.exceptions import ParseError, VerifyException

    from flint.ir import flint_context
    from flint.tools.flint_opt import _RecordingParser

    try:
        text = open(path, "rb").read()
    except OSError as e:
        raise FlintError(f"cannot read IR file {path}: {e.strerror}") from None
    positions: dict = {}
    try:
        module = _RecordingParser(flint_context(), text, path, positions=positions).parse_module()
    except ParseError as e:
        loc = e.span.get_location()
        raise FlintError(f"{loc.file}:{loc.line}:{loc.col}: error: {e.msg}") from None
    try:
        module.verify()
    except VerifyException as e:
        raise FlintError(f"{path}: error: {str(e).splitlines()[0]}") from None
    return module


def cmd_emit(args: argparse.Namespace) -> int:
    from xdsl.context import Context

    from flint.chakra import write_trace
    from flint.chakra.from_ir import trace_from_ir
    from flint.passes.canonicalize_dist import CanonicalizeDistPass
    from flint.passes.lower_to_chakra import LowerToChakraPass

    t0 = time.perf_counter()
    module = _load_ir(args.input)
    if not any(op.name == "chakra.graph" for op in module.ops):
        CanonicalizeDistPass().apply(Context(), module)
        LowerToChakraPass(device=args.device).apply(Context(), module)
        module.verify()
    trace = trace_from_ir(module)
    stats = write_trace(trace, args.output, args.prefix)
    print(f"wrote {stats.ranks} rank files + {args.prefix}.comm_groups.json to {stats.out_dir} "
          f"({stats.nodes / stats.ranks:.0f} nodes per rank, {stats.bytes_written / 1e6:.2f} MB, "
          f"{time.perf_counter() - t0:.2f} s)")
    return 0


def cmd_inspect(argv: Sequence[str]) -> int:
    from flint.chakra.inspect import main as inspect_main

    return inspect_main(argv)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="flint", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", metavar="command")

    emit = sub.add_parser("emit", help="lower a step's IR to per-rank Chakra ET files",
                          description="Lower the step (aten + dist IR, or an already lowered chakra.graph) to "
                                      "Chakra: one <prefix>.<rank>.et per rank of the grid and "
                                      "<prefix>.comm_groups.json, written atomically.")
    emit.add_argument("input", help="the step's IR (.mlir), e.g. from `flint capture`")
    emit.add_argument("-o", "--output", required=True, help="output directory (replaced atomically)")
    emit.add_argument("--prefix", default="trace", help="file-name prefix (default: trace)")
    emit.add_argument("--device", default="h100-sxm", help="device preset or TOML for compute durations (default: h100-sxm)")
    emit.set_defaults(func=cmd_emit)

    sub.add_parser("inspect", help="summarize and check a Chakra trace directory", add_help=False)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "inspect":
        return cmd_inspect(argv[1:])
    ap = build_parser()
    args = ap.parse_args(argv)
    if not getattr(args, "func", None):
        ap.print_help()
        return 2
    try:
        return args.func(args)
    except FlintError as e:
        print(f"flint {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if os.environ.get("FLINT_TRACEBACK"):
            raise
        print(f"flint {args.command}: internal error: {type(e).__name__}: {e}\n"
              "(this is a bug in Flint; set FLINT_TRACEBACK=1 to see the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
