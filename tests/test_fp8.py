"""fp8 plans: torchao's Float8Linear in the captured program, priced at the device's fp8 peak.

What is checked: the captured step holds ``aten._scaled_mm`` for every GEMM of every converted
linear layer and keeps the output head in bf16; torchao's dynamic-scaling ops (amax, scale, float8
casts, e5m2 for the gradient) are in the graphs; FLOPs are unchanged; the converted GEMMs' time
falls by exactly the fp8 / bf16 peak ratio where the GEMM model is compute-bound; bad input
(unknown recipe, a model without linear layers, an fp8 program on a device without fp8) is a
clear error.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from functools import cache

import pytest
import torch
from torch import nn

from flint.capture import capture_step
from flint.cost import load_device
from flint.errors import FlintError
from flint.ir.aten import AtenOp, get_schedule
from flint.models import factory
from flint.passes.annotate_cost import aten_op_cost, aten_op_work
from flint.plan import Plan, PlanError

SEQ = 64
LINEARS_PER_BLOCK = 7  # wq, wk, wv, wo, w1, w2, w3


@cache
def _imported(fp8: str):
    from flint.importer import import_step

    plan = Plan(dp_shard=2, fp8=fp8).validate()
    step = capture_step(factory("llama-tiny"), {"tokens": (4, SEQ), "labels": (4, SEQ)}, plan=plan,
                        dtype="bfloat16")
    return step, import_step(step)


def _ops(module):
    """(function name, repeat, AtenOp) over the step's schedule."""
    from xdsl.dialects import func

    funcs = {f.sym_name.data: f for f in module.ops if isinstance(f, func.FuncOp)}
    for name, count in get_schedule(module):
        for op in funcs[name].walk():
            if isinstance(op, AtenOp):
                yield name, count, op


def _name(op: AtenOp) -> str:
    return op.overload.split(".")[1]


# ------------------------------------------------------------------- plan


def test_plan_field():
    assert Plan.from_dict({"fp8": True}).fp8 == "tensorwise"
    assert Plan.from_dict({"fp8": False}).fp8 == "none"
    assert Plan.from_dict({"fp8": "rowwise"}).describe().endswith("[fp8 rowwise] = 1 ranks")
    with pytest.raises(PlanError, match="plan field 'fp8': unknown float8 recipe 'e4m3'"):
        Plan.from_dict({"fp8": "e4m3"})
    with pytest.raises(PlanError, match="fp8_filter_fqns.*only with fp8"):
        Plan.from_dict({"fp8_filter_fqns": ["output"]})
    p = Plan.from_dict({"fp8": "tensorwise", "fp8_filter_fqns": ["output", "wq"]})
    assert Plan.from_dict(p.to_dict()) == p


# ---------------------------------------------------------------- capture


@pytest.mark.slow
def test_captured_program_runs_scaled_mm_with_scaling_ops():
    step, module = _imported("tensorwise")
    by_func: dict[str, Counter] = {}
    dtypes = Counter()
    for fn, _, op in _ops(module):
        by_func.setdefault(fn, Counter())[_name(op)] += 1
        if _name(op) == "_to_copy":
            dtypes[str(op.outputs[0].type.element_type)] += 1
    # every linear of the block: forward GEMM + input-grad GEMM + weight-grad GEMM in float8
    assert by_func["block_fwd"]["_scaled_mm"] == LINEARS_PER_BLOCK
    assert by_func["block_bwd"]["_scaled_mm"] == 2 * LINEARS_PER_BLOCK
    assert by_func["block_fwd"]["mm"] == 0 and by_func["block_bwd"]["mm"] == 0
    # the output head stays in bf16 (torchtitan's filter_fqns = ["output"])
    assert by_func["head_fwd"]["_scaled_mm"] == 0 and by_func["head_fwd"]["mm"] >= 1
    # tensorwise dynamic scaling: one amax (abs + max) per cast: every weight and every distinct
    # input in forward (wq/wk/wv and w1/w3 share theirs: 4 inputs), every output gradient in backward
    assert by_func["block_fwd"]["abs"] == by_func["block_fwd"]["max"] >= LINEARS_PER_BLOCK + 4
    assert by_func["block_bwd"]["abs"] == by_func["block_bwd"]["max"]
    assert by_func["block_bwd"]["abs"] >= LINEARS_PER_BLOCK
    assert by_func["block_fwd"]["reciprocal"] >= 2 * LINEARS_PER_BLOCK
    # casts to e4m3 (input, weight) and e5m2 (gradient), as MLIR float8 element types
    assert dtypes["f8E4M3FN"] >= 2 * LINEARS_PER_BLOCK and dtypes["f8E5M2"] >= LINEARS_PER_BLOCK
    assert "fp8 tensorwise" in step.plan_name


@pytest.mark.slow
def test_flops_unchanged_and_gemm_time_drops_by_the_peak_ratio():
    base_step, base = _imported("none")
    fp8_step, fp8 = _imported("tensorwise")
    assert fp8_step.summary().flops == base_step.summary().flops

    # the converted GEMMs have the same shapes as the bf16 ones they replace
    def dims(module, names):
        return sorted((count, aten_op_work(op).gemm_dims, aten_op_work(op).flops)
                      for fn, count, op in _ops(module) if fn.startswith("block") and _name(op) in names)

    scaled = dims(fp8, {"_scaled_mm"})
    assert [(c, d[1:], f) for c, d, f in scaled] == [(c, d[1:], f) for c, d, f in dims(base, {"mm"})]

    # a device whose GEMM model is compute-bound on these shapes (no launch floor, no fixed GEMM latency,
    # no split-K, the main loop at the MAMF fraction as for fp8): the time ratio is exactly
    # (fp8 peak x fp8 MAMF fraction) / (bf16 peak x bf16 MAMF fraction)
    h100 = load_device("h100-sxm")
    dev = h100.calibrated({"kernel_floor_us": 0.0, "gemm": {
        "max_split_k": 1, "latency_us": 0.0, "mainloop_fraction": h100.calibration.gemm.peak_fraction}})
    t_bf16 = sum(c * aten_op_cost(op, dev)[2] for fn, c, op in _ops(base) if fn.startswith("block")
                 and _name(op) == "mm")
    t_fp8 = sum(c * aten_op_cost(op, dev)[2] for fn, c, op in _ops(fp8) if fn.startswith("block")
                and _name(op) == "_scaled_mm")
    cal = dev.calibration
    expected = (dev.peak_tflops["fp8"] * cal.gemm_fp8_peak_fraction) / (dev.peak_tflops["bf16"]
                                                                       * cal.gemm.peak_fraction)
    assert t_bf16 / t_fp8 == pytest.approx(expected, rel=1e-9)
    assert expected == pytest.approx(1.748, abs=1e-3)

    # the scaling overhead is real work: the fp8 step has more memory-bound kernels
    def kernels(module, cls):
        return sum(c for _, c, op in _ops(module) if aten_op_work(op).op_class == cls)

    assert kernels(fp8, "elementwise") > kernels(base, "elementwise")
    assert kernels(fp8, "reduction") > kernels(base, "reduction")


@pytest.mark.slow
def test_device_without_fp8_is_an_error():
    _, module = _imported("tensorwise")
    dev = load_device("a100-80gb")
    op = next(op for _, _, op in _ops(module) if _name(op) == "_scaled_mm")
    with pytest.raises(FlintError, match=r"'aten._scaled_mm.default' in module '.*' multiplies f8E4M3FN operands "
                       r".*device 'a100-80gb' has no fp8 tensor cores"):
        aten_op_cost(op, dev)


# ------------------------------------------------------------- bad input


class _NoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.conv = nn.Conv1d(16, 16, 3, padding=1)

    def forward(self, input_ids):
        return self.conv(self.emb(input_ids).transpose(1, 2)).sum()


def test_model_without_linear_layers():
    with pytest.raises(PlanError, match=r"plan field 'fp8': 'tensorwise' runs the GEMMs of nn.Linear layers "
                       r"in float8, and this model \(_NoLinear\) has no nn.Linear layer"):
        capture_step(_NoLinear, {"input_ids": (2, 8)}, plan=Plan(fp8="tensorwise").validate())


class _OddLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(20, 24)

    def forward(self, x):
        return self.proj(x).sum()


def test_no_linear_layer_qualifies():
    with pytest.raises(PlanError, match=r"none of the model's 1 nn.Linear layers qualifies for float8: 1 have a "
                       r"weight dim that is not a multiple of 16 .*: proj$"):
        capture_step(_OddLinear, {"x": (2, 20)}, plan=Plan(fp8="tensorwise").validate())


@pytest.mark.slow
def test_cli_model_without_linear_layers(tmp_path):
    model = tmp_path / "nolinear.py"
    model.write_text("import torch\nfrom torch import nn\n\n"
                     "class M(nn.Module):\n"
                     "    def __init__(self):\n        super().__init__()\n        self.emb = nn.Embedding(64, 16)\n"
                     "    def forward(self, input_ids):\n        return self.emb(input_ids).sum()\n\n"
                     "def model():\n    return M()\n")
    out = tmp_path / "o.mlir"
    r = subprocess.run([sys.executable, "-m", "flint.tools.flint_cli", "capture", "--model", f"{model}:model",
                        "--world-size", "1", "--plan", "dp", "--fp8", "--inputs", "input_ids=2x8:int64",
                        "-o", str(out)], capture_output=True, text=True)
    assert r.returncode != 0
    assert "plan field 'fp8'" in r.stderr and "has no nn.Linear layer" in r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists()


@pytest.mark.slow
def test_tensor_parallel_gathers_float8():
    """TP+SP with tensorwise float8: torchao's Float8ColwiseParallel / Float8RowwiseParallel /
    PrepareFloat8ModuleInput (torchtitan's choice) cast before the sequence all-gather, so the
    gather moves float8; the weights' amax is all-reduced over the TP group (DTensor max)."""
    from flint.importer import import_step
    from flint.ir import dist

    plan = Plan(tp=2, sp=True, fp8="tensorwise").validate()
    step = capture_step(factory("llama-tiny"), {"tokens": (2, SEQ), "labels": (2, SEQ)}, plan=plan,
                        dtype="bfloat16")
    module = import_step(step)
    names = Counter((fn, _name(op)) for fn, _, op in _ops(module))
    assert names[("block_fwd", "_scaled_mm")] == LINEARS_PER_BLOCK
    assert names[("block_bwd", "_scaled_mm")] == 2 * LINEARS_PER_BLOCK
    from xdsl.dialects import func

    funcs = {f.sym_name.data: f for f in module.ops if isinstance(f, func.FuncOp)}
    gathered = [str(op.operands[0].type.element_type) for op in funcs["block_fwd"].walk()
                if isinstance(op, dist.AllGatherOp)]
    assert gathered and all(d == "f8E4M3FN" for d in gathered)


@pytest.mark.slow
def test_rowwise_with_high_precision_weight_gradient():
    """torchao's ``rowwise_with_gw_hp``: forward and input-gradient GEMMs in float8 with row-wise
    scales, the weight-gradient GEMM kept in bf16; FLOPs still equal the bf16 step's."""
    step, module = _imported("rowwise_with_gw_hp")
    names = Counter((fn, _name(op)) for fn, _, op in _ops(module))
    assert names[("block_fwd", "_scaled_mm")] == LINEARS_PER_BLOCK
    assert names[("block_bwd", "_scaled_mm")] == LINEARS_PER_BLOCK
    assert names[("block_bwd", "mm")] == LINEARS_PER_BLOCK
    scales = [tuple(op.inputs[2].type.get_shape()) for fn, _, op in _ops(module)
              if fn == "block_fwd" and _name(op) == "_scaled_mm"]
    assert all(len(s) == 2 and s[1] == 1 and s[0] > 1 for s in scales)  # one scale per row of the input
    assert step.summary().flops == _imported("none")[0].summary().flops
