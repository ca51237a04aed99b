"""The `chakra` output target of `flint-opt`: write per-rank Chakra ET files.

``flint-opt step.mlir -p lower-to-chakra -t 'chakra{out=DIR,prefix=NAME}'``
(``force=true`` to replace a directory holding other files) expands the module's ``chakra.graph @step`` for every rank of its grid and
writes ``DIR/NAME.<rank>.et`` plus ``DIR/NAME.comm_groups.json`` atomically;
the text output is a one-line summary of what was written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import IO

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.utils.target import Target

from flint.chakra import write_trace
from flint.chakra.from_ir import trace_from_ir


@dataclass(frozen=True)
class ChakraTarget(Target):
    """Write the module's `chakra.graph` as per-rank Chakra execution traces."""

    name = "chakra"

    out: str = "chakra_trace"
    prefix: str = "trace"
    graph: str = "step"
    force: bool = False

    def emit(self, ctx: Context, module: ModuleOp, output: IO[str]) -> None:
        from flint.chakra.check import require_sound

        trace = trace_from_ir(module, self.graph)
        require_sound(trace, f"chakra.graph @{self.graph}", "nothing was written")
        stats = write_trace(trace, self.out, self.prefix, force=self.force)
        output.write(
            f"wrote {stats.files} files ({stats.ranks} ranks, {stats.nodes} nodes, "
            f"{stats.bytes_written} bytes) to {stats.out_dir}/{stats.prefix}.*\n"
        )
