"""Property tests: random valid `dist` programs stay valid and equivalent after every scheduling pass.

The generator writes SPMD step functions on a 4 x 2 grid: FSDP-style
gathers of weight shards (waited at once or later), matmuls using them, TP
all-reduces (synchronous or not), gradient reduce-scatters and all-reduces,
barriers and matched send/recv pairs, over a module schedule that repeats
the body. Each pass in ``SCHEDULING_PASSES`` (one line each; a new scheduling
pass joins with one more line) runs on it, the module must verify, and
:func:`flint.schedule.check_schedule_invariants` must hold.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xdsl.parser import Parser

from flint.ir import flint_context
from flint.schedule.pipelines import run_pipeline
from flint.schedule import check_schedule_invariants

# (pipeline as `flint-opt -p` spells it, whether collectives may be fused or split)
SCHEDULING_PASSES = [
    ("bucket-collectives{bytes=4096}", True),
    ("bucket-collectives", True),
    ("split-collectives{bytes=1024}", True),
    ("split-collectives{bytes=100}", True),
    ("overlap-report", False),
    ("sink-waits", False),
    ("hoist-starts", False),
    ("hoist-starts{max-in-flight=1}", False),
    ("assign-streams", False),
    ("reorder-all-gather{prefetch=1}", False),
    ("sink-waits,hoist-starts{max-in-flight=2},bucket-collectives{bytes=8192}", True),
]

GRID = "shard.grid @mesh(shape = 4x2)"
X = "tensor<8x64xbf16>"
W = "tensor<64x64xbf16>"
SHARD = "tensor<16x64xbf16>"


@st.composite
def programs(draw) -> str:
    """A random valid step: ``builtin.module`` text with one repeated body."""
    args = [f"%x: {X}"]
    lines: list[str] = []
    pending: list[tuple[int, str]] = []  # (steps left, wait line) of started collectives
    results: list[tuple[str, str]] = []  # values returned at the end
    act = "%x"
    n = 0

    def fresh(prefix: str) -> str:
        nonlocal n
        n += 1
        return f"%{prefix}{n}"

    def tick(force: bool = False) -> None:
        for item in list(pending):
            left, line = item
            pending.remove(item)
            if force or left <= 0:
                lines.append(line)
            else:
                pending.append((left - 1, line))

    weights: list[str] = []  # gathered weights not yet used
    for step in range(draw(st.integers(2, 9))):
        kind = draw(st.sampled_from(["gather", "gather", "mm", "mm", "tp", "grad_rs", "grad_ar", "barrier", "p2p"]))
        if kind == "gather":
            shard = fresh("ws")
            args.append(f"{shard}: {SHARD}")
            f, w = fresh("f"), fresh("w")
            lines.append(f"{f} = dist.all_gather {shard} on @mesh grid_axes = [0] gather_dim = 0 : {SHARD} -> "
                         f"!dist.future<{W}>")
            pending.append((draw(st.integers(0, 2)), f"{w} = dist.wait {f} : {W}"))
            weights.append(w)
        elif kind == "mm" and weights:
            w = weights.pop(0)
            if any(w in line for _, line in pending):  # wait for it before the use
                for item in [p for p in pending if w in p[1]]:
                    pending.remove(item)
                    lines.append(item[1])
            y = fresh("y")
            lines.append(f'{y} = aten.op "aten.mm.default"({act}, {w}) phase = "fwd" module = "l{step}" : '
                         f"({X}, {W}) -> {X}")
            act = y
        elif kind == "tp":
            y = fresh("tp")
            if draw(st.booleans()):
                lines.append(f"{y} = dist.all_reduce {act} on @mesh grid_axes = [1] : {X} -> {X}")
            else:
                f = fresh("f")
                lines.append(f"{f} = dist.all_reduce {act} on @mesh grid_axes = [1] : {X} -> !dist.future<{X}>")
                lines.append(f"{y} = dist.wait {f} : {X}")
            act = y
        elif kind in ("grad_rs", "grad_ar"):
            cols = draw(st.sampled_from([8, 16, 64]))
            dtype = draw(st.sampled_from(["bf16", "f32"]))
            g = fresh("g")
            gt = f"tensor<64x{cols}x{dtype}>"
            args.append(f"{g}: {gt}")
            f, r = fresh("f"), fresh("r")
            if kind == "grad_rs":
                out = f"tensor<16x{cols}x{dtype}>"
                lines.append(f"{f} = dist.reduce_scatter {g} on @mesh grid_axes = [0] scatter_dim = 0 : {gt} -> "
                             f"!dist.future<{out}>")
            else:
                out = gt
                lines.append(f"{f} = dist.all_reduce {g} on @mesh grid_axes = [0] reduction = average : {gt} -> "
                             f"!dist.future<{out}>")
            pending.append((draw(st.integers(0, 3)), f"{r} = dist.wait {f} : {out}"))
            results.append((r, out))
        elif kind == "barrier":
            tick(force=True)
            lines.append("dist.barrier on @mesh grid_axes = [0]")
        elif kind == "p2p":
            r = fresh("recv")
            lines.append(f"dist.send {act} to @mesh grid_axes = [1] offset = 1 tag = {step} : {X}")
            lines.append(f"{r} = dist.recv from @mesh grid_axes = [1] offset = -1 tag = {step} : {X}")
            results.append((r, X))
        tick()
    tick(force=True)
    # gathered weights nobody used are returned, so no value is dead
    for w in weights:
        results.append((w, W))
    results.append((act, X))
    ret_vals = ", ".join(v for v, _ in results)
    ret_types = ", ".join(t for _, t in results)
    body = "\n    ".join(lines + [f"func.return {ret_vals} : {ret_types}"])
    repeat = draw(st.integers(1, 3))
    return (f'builtin.module attributes {{flint.schedule = [["body", {repeat}]]}} {{\n  {GRID}\n'
            f"  func.func @body({', '.join(args)}) -> ({ret_types}) {{\n    {body}\n  }}\n}}\n")


def parse(text: str):
    module = Parser(flint_context(), text).parse_module()
    module.verify()
    return module


@pytest.mark.parametrize("pipeline,bucketed", SCHEDULING_PASSES, ids=[p for p, _ in SCHEDULING_PASSES])
@settings(max_examples=8)
@given(text=programs())
def test_scheduling_pass_keeps_the_program(pipeline, bucketed, text):
    before = parse(text)
    after = before.clone()
    run_pipeline(after, pipeline)  # verifies after every pass
    check_schedule_invariants(before, after, same_bytes_per_group=bucketed)


@settings(max_examples=8)
@given(text=programs())
def test_generator_makes_valid_programs(text):
    module = parse(text)
    check_schedule_invariants(module, module.clone())
