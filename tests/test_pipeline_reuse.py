"""A pipeline's repeated runs, built once and reused: the same IR, trace and simulated times as building every run.

``lower-to-chakra`` clones a pipelined schedule's flat runs of a function (one per microbatch and
virtual stage) from the first run with the same starting nodes (``LowerToChakraPass._flat``). These
tests lower small pipelines both ways (``reuse_flat_runs`` off: every run lowered from its ops) and
require the printed IR to be identical and the simulated iteration times equal (rtol 1e-12), for
GPipe, 1F1B, interleaved 1F1B and ZBV, with tensor-parallel collectives inside the block, an
asynchronous data-parallel gradient all-reduce (skipped for all but the last microbatch) and one
layer per stage (every block run flat) or two (the repeat path, for comparison).
"""

from __future__ import annotations

import numpy as np
import pytest
from xdsl.context import Context
from xdsl.parser import Parser

from flint.chakra.from_ir import trace_from_ir
from flint.cost import load_device
from flint.cost.network import load_network
from flint.ir import flint_context
from flint.passes.lower_to_chakra import LowerToChakraPass
from flint.passes.pipeline_split import PipelineSplitPass
from flint.sim import simulate

A = "tensor<1024x1024xbf16>"
T = "tensor<8x1024xbf16>"


def _module(pp: int, layers: int, tp: int = 2, dp: int = 2) -> str:
    sched = ", ".join(f'["{n}", {c}]' for n, c in (("embed_fwd", 1), ("block_fwd", layers), ("head_fwd", 1),
                                                   ("head_bwd", 1), ("block_bwd", layers), ("embed_bwd", 1),
                                                   ("block_optim", layers)))
    act, par = '{flint.role = "activation"}', '{flint.role = "parameter"}'
    mm, relu = 'aten.op "aten.mm.default"', 'aten.op "aten.relu.default"'
    return f"""builtin.module attributes {{flint.schedule = [{sched}]}} {{
  shard.grid @mesh(shape = {pp}x{dp}x{tp}) {{flint.axis_names = ["pp", "dp_replicate", "tp"]}}
  func.func @embed_fwd(%t: {T} {{flint.role = "input"}}) -> {T} {{
    %y = {relu}(%t) : ({T}) -> {T}
    func.return %y : {T}
  }}
  func.func @block_fwd(%x: {T} {act}, %w: {A} {par}) -> ({T}, {T}) {{
    %h = {mm}(%x, %w) : ({T}, {A}) -> {T}
    %r = dist.all_reduce %h on @mesh grid_axes = [2] : {T} -> {T}
    %o = {relu}(%r) : ({T}) -> {T}
    %p = {mm}(%o, %w) : ({T}, {A}) -> {T}
    func.return %p, %h : {T}, {T}
  }}
  func.func @head_fwd(%x: {T} {act}, %t: {T} {{flint.role = "input"}}) -> {T} {{
    %y = {relu}(%x) : ({T}) -> {T}
    func.return %y : {T}
  }}
  func.func @head_bwd(%t: {T} {{flint.role = "tangent"}}) -> {T} {{
    %y = {relu}(%t) : ({T}) -> {T}
    func.return %y : {T}
  }}
  func.func @block_bwd(%w: {A} {par}, %h: {T} {{flint.role = "saved"}}, %g: {T} {{flint.role = "tangent"}}) -> {T} {{
    %a = {mm}(%g, %w) : ({T}, {A}) -> {T}
    %r = dist.all_reduce %a on @mesh grid_axes = [2] : {T} -> {T}
    %dw = {mm}(%w, %w) : ({A}, {A}) -> {A}
    %f = dist.all_reduce %dw on @mesh grid_axes = [1] : {A} -> !dist.future<{A}>
    %dx = {relu}(%r) : ({T}) -> {T}
    %s = "dist.wait"(%f) : (!dist.future<{A}>) -> {A}
    func.return %dx : {T}
  }}
  func.func @embed_bwd(%g: {T} {{flint.role = "tangent"}}) {{
    %y = {relu}(%g) : ({T}) -> {T}
    func.return
  }}
  func.func @block_optim(%w: {A} {par}, %g: {A} {{flint.role = "gradient"}}) {{
    %y = {relu}(%w) : ({A}) -> {A}
    func.return
  }}
}}"""


def _lower(pp: int, layers: int, reuse: bool, **options):
    module = Parser(flint_context(), _module(pp, layers)).parse_module()
    PipelineSplitPass(stages=pp, dp_axes="dp_replicate", **options).apply(Context(), module)
    old = LowerToChakraPass.reuse_flat_runs
    LowerToChakraPass.reuse_flat_runs = reuse
    try:
        LowerToChakraPass(device="a100-80gb").apply(Context(), module)
    finally:
        LowerToChakraPass.reuse_flat_runs = old
    module.verify()
    return module


CASES = [("gpipe", 4, 1, 6, 1), ("1f1b", 4, 1, 8, 1), ("1f1b", 2, 1, 3, 2), ("interleaved-1f1b", 2, 3, 4, 1),
         ("interleaved-1f1b", 4, 2, 8, 2), ("zbv-zero-bubble", 2, 2, 4, 1)]


@pytest.mark.parametrize("schedule,pp,virtual,m,per_stage", CASES, ids=str)
def test_reused_runs_give_the_same_ir_and_times(schedule, pp, virtual, m, per_stage):
    layers = pp * virtual * per_stage
    opts = dict(schedule=schedule, microbatches=m, virtual=virtual)
    fast, ref = _lower(pp, layers, True, **opts), _lower(pp, layers, False, **opts)
    assert str(fast) == str(ref)
    device, network = load_device("a100-80gb"), load_network("dgx-a100")
    tf, tr = trace_from_ir(fast), trace_from_ir(ref)
    a, b = simulate(tf, device, network, None), simulate(tr, device, network, None)
    assert a.iteration_time_us > 0
    np.testing.assert_allclose(a.iteration_time_us, b.iteration_time_us, rtol=1e-12)
    for x, y in zip(a.raw.finish_us, b.raw.finish_us):
        np.testing.assert_allclose(x, y, rtol=1e-12)
