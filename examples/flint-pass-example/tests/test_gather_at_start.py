"""The example pass keeps the step's work: Flint's scheduling checker holds."""

from pathlib import Path

from xdsl.context import Context
from xdsl.parser import Parser

from flint.ir import flint_context
from flint.schedule import check_schedule_invariants
from flint_pass_example.gather_at_start import GatherAtStartPass


def test_keeps_dependencies_and_work():
    text = (Path(__file__).parent / "gather-at-start.mlir").read_text()
    module = Parser(flint_context(), text).parse_module()
    for kind in ("all_gather", "all"):
        after = module.clone()
        GatherAtStartPass(kind=kind).apply(Context(), after)
        check_schedule_invariants(module, after)
