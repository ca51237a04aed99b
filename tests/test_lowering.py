"""lower-to-chakra: merging compute nodes changes the node count, never the simulated time."""

from __future__ import annotations

from pathlib import Path

import pytest
from xdsl.context import Context
from xdsl.parser import Parser

from flint.chakra.from_ir import mesh_of, trace_from_ir
from flint.cost import load_device, load_network
from flint.ir import flint_context
from flint.passes.lower_to_chakra import LowerToChakraPass
from flint.sim import simulate

LIT = Path(__file__).resolve().parents[1] / "lit_tests" / "passes"


@pytest.mark.parametrize("source", ["lower-to-chakra.mlir", "lower-to-chakra-merge.mlir"])
def test_merge_compute_keeps_simulated_time(source):
    text = (LIT / source).read_text()
    results = {}
    for merge in (False, True):
        module = Parser(flint_context(), text).parse_module()
        LowerToChakraPass(merge_compute=merge).apply(Context(), module)
        trace = trace_from_ir(module)
        res = simulate(trace, load_device("h100-sxm"), load_network("dgx-h100"), mesh_of(module))
        results[merge] = (len(trace.ranks[0].table), res.iteration_time_us, float(res.compute_busy_us.max()))
    (n_sep, t_sep, busy_sep), (n_merged, t_merged, busy_merged) = results[False], results[True]
    assert n_merged <= n_sep
    assert t_merged == pytest.approx(t_sep, rel=1e-9)
    assert busy_merged == pytest.approx(busy_sep, rel=1e-9)


def test_merge_actually_merges():
    module = Parser(flint_context(), (LIT / "lower-to-chakra-merge.mlir").read_text()).parse_module()
    LowerToChakraPass().apply(Context(), module)
    names = [op.node_name.data for op in module.walk() if op.name == "chakra.comp"]
    assert names == ["aten.relu.default +2", "aten.mm.default +1", "aten.relu.default", "aten.neg.default"]


def test_lowering_a_written_ir_does_not_import_the_capture_stack():
    """Emit speed (bench/pipeline_pp.py): lowering classifies ATen ops through flint.capture.opclass,
    which needs torch only; torch._dynamo and DTensor (capture) cost seconds per `flint emit`."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from flint.cost.opclass import classify_target\n"
            "import flint.passes.lower_to_chakra, flint.chakra.from_ir, flint.chakra.writer\n"
            "assert classify_target('aten.mm.default') == 'gemm', classify_target('aten.mm.default')\n"
            "heavy = sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch.distributed.tensor',\n"
            "                                                      'flint.capture.step')))\n"
            "assert not heavy, heavy\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
