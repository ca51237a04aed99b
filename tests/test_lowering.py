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
from flint.trace import NodeKind

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


def test_a_sustained_fraction_scales_every_compute_node_as_the_trace_scaling_does(tmp_path):
    """Lowering on a calibration with ``sustained_fraction = f`` gives the trace lowered on the preset with
    every compute node's duration / f (``Trace.with_compute_scaled``, which bench/accuracy.py uses to
    simulate a row at several factors without lowering it again), and the same simulated iteration."""
    from captures import imported

    _, module = imported("llama-tiny", "fsdp", 4)
    dev = tmp_path / "slow.toml"
    dev.write_text(load_device("h100-sxm", {"sustained_fraction": 0.8}).to_toml())
    traces = {}
    for device in ("h100-sxm", str(dev)):
        m = module.clone()
        LowerToChakraPass(device=device).apply(Context(), m)
        traces[device] = trace_from_ir(m)
    scaled = traces["h100-sxm"].with_compute_scaled(1 / 0.8)
    a, b = traces[str(dev)].ranks[0].table, scaled.ranks[0].table
    comp = a.kind == NodeKind.COMP
    assert comp.any() and (a.kind == b.kind).all()
    # durations are rounded to 1e-6 us; non-compute nodes have none (nan)
    assert b.duration_us == pytest.approx(a.duration_us, abs=2e-6, nan_ok=True)
    network, mesh = load_network("dgx-h100"), mesh_of(module)
    runs = [simulate(t, load_device("h100-sxm"), network, mesh) for t in (traces[str(dev)], scaled,
                                                                          traces["h100-sxm"])]
    assert runs[0].iteration_time_us == pytest.approx(runs[1].iteration_time_us, rel=1e-6)
    assert runs[0].iteration_time_us > runs[2].iteration_time_us
    assert scaled.ranks[0].table is not traces["h100-sxm"].ranks[0].table  # the original is untouched
    original = traces["h100-sxm"].ranks[0].table.duration_us[comp]
    assert original == pytest.approx(a.duration_us[comp] * 0.8, abs=2e-6)
