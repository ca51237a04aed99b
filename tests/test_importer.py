"""FX -> IR: the imported step verifies, round-trips, and matches the FX graphs op for op."""

from __future__ import annotations

import operator
import subprocess
import sys
from collections import Counter
from io import StringIO

import pytest
import torch
from captures import captured, imported
from xdsl.parser import Parser
from xdsl.printer import Printer

from flint.importer import ImportError_, import_step, schedule_of
from flint.ir import aten, dist, flint_context
from flint.ir.aten import get_schedule

pytestmark = pytest.mark.slow  # each capture compiles with dynamo/AOTAutograd (~10 s)


def step_and_module():
    return imported("llama-tiny", "fsdp+tp", 8, 2)


def _fx_counts(step) -> Counter:
    """call_function nodes per function, by target (getitem makes no op)."""
    out = Counter()
    for p in step.parts:
        for g in p.graphs():
            for n in g.nodes():
                if n.target is not operator.getitem:
                    out[(f"{p.name}_{g.phase}", str(n.target))] += 1
    return out


def _ir_counts(module) -> Counter:
    out = Counter()
    for fn in module.ops:
        if not hasattr(fn, "sym_name") or fn.name != "func.func":
            continue
        for op in fn.body.block.ops:
            if isinstance(op, aten.AtenOp):
                out[(fn.sym_name.data, op.overload)] += 1
            elif isinstance(op, dist.WaitOp):
                out[(fn.sym_name.data, "_c10d_functional.wait_tensor.default")] += 1
            elif isinstance(op, dist.CollectiveOp):
                name = {"dist.all_gather": "all_gather_into_tensor", "dist.reduce_scatter": "reduce_scatter_tensor",
                        "dist.all_reduce": "all_reduce", "dist.all_to_all": "all_to_all_single",
                        "dist.broadcast": "broadcast"}[op.name]
                out[(fn.sym_name.data, f"_c10d_functional.{name}.default")] += 1
    return out


def test_ir_matches_fx_op_for_op():
    step, module = step_and_module()
    fx, ir = _fx_counts(step), _ir_counts(module)
    assert sum(fx.values()) > 500
    assert fx == ir


def test_grid_schedule_and_roles():
    step, module = step_and_module()
    assert get_schedule(module) == schedule_of(step) == [
        ("embed_fwd", 1), ("block_fwd", 2), ("head_fwd", 1), ("head_bwd", 1), ("block_bwd", 2), ("embed_bwd", 1),
        ("embed_optim", 1), ("block_optim", 2), ("head_optim", 1)]
    fn = next(op for op in module.ops if getattr(op, "sym_name", None) and op.sym_name.data == "block_fwd")
    roles = Counter(d.data["flint.role"].data for d in fn.arg_attrs.data)
    assert roles["parameter"] == 9 and roles["activation"] == 1
    # FSDP gathers along dp (axis 0), TP reduces along tp (axis 1)
    axes = Counter((op.name, op.axes()) for op in fn.walk() if isinstance(op, dist.CollectiveOp))
    assert axes[("dist.all_gather", (0,))] >= 1 and axes[("dist.all_reduce", (1,))] >= 1


def test_locations_name_user_model_lines():
    _, module = step_and_module()
    mm = [op for op in module.walk() if isinstance(op, aten.AtenOp) and op.overload == "aten.mm.default"]
    files = {str(op.location.filename.data) for op in mm if hasattr(op.location, "filename")}
    assert any(f.endswith("flint/models/llama.py") for f in files)
    assert any(op.module is not None and "attention" in op.module.data for op in mm)


def test_round_trips_through_flint_opt(tmp_path):
    _, module = step_and_module()
    text = StringIO()
    Printer(stream=text, print_debuginfo=True).print_op(module)
    src = tmp_path / "step.mlir"
    src.write_text(text.getvalue())
    res = subprocess.run([sys.executable, "-m", "flint.tools.flint_opt", str(src), "-p", "verify-dist",
                          "--print-debuginfo"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    again = Parser(flint_context(), res.stdout).parse_module()
    again.verify()
    out = StringIO()
    Printer(stream=out, print_debuginfo=True).print_op(again)
    assert out.getvalue() == text.getvalue()


def test_unknown_op_names_op_and_source_line():
    step = captured("llama-tiny", "fsdp", 8)
    g = step.part("block").fwd.gm
    node = next(n for n in g.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.mm.default)
    original = node.target
    node.target = torch.cos  # not an ATen overload
    try:
        with pytest.raises(ImportError_, match=r"block_fwd: node 'mm.*' \(<built-in method cos.*from .*llama.py:\d+.*does not know op"):
            import_step(step)
    finally:
        node.target = original
