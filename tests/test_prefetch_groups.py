"""`reorder-all-gather` in a repeated block of several FSDP groups (Llama 4's layer pattern, selective-layer
checkpointing every 2nd block): ``prefetch`` counts groups, as FSDP2 prefetches one module ahead, and the
memory model and ``lower-to-chakra`` issue a gather where its issue point (``flint.prefetch_at``) runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from xdsl.parser import Parser

from flint.ir import flint_context
from flint.schedule.invariants import check_schedule_invariants
from flint.schedule.pipelines import FSDP_PIPELINE, run_pipeline
from flint.sim.lifetimes import step_memory
from tests.captures import captured_byom

FIXTURE = Path(__file__).parent.parent / "lit_tests" / "passes" / "reorder-all-gather-groups.mlir"
GATHERED = 4096 * 2  # one group's gathered buffer in the fixture (4096 bf16)


def _fixture():
    return Parser(flint_context(), FIXTURE.read_text(), str(FIXTURE)).parse_module()


@pytest.mark.parametrize("k,live", [
    (0, 2),  # both gathered at the block's start, for that block
    (1, 2),  # the current group and the one after it (before: the whole next block too, 4)
    (2, 3),  # the current group and the two after it
])
def test_gathered_parameters_live_k_groups_ahead(k, live):
    m = _fixture()
    run_pipeline(m, f"reorder-all-gather{{prefetch={k}}}")
    m.verify()
    assert step_memory(m).report.category_peak_bytes["comm"] == live * GATHERED


def test_issue_point_without_its_marked_op_falls_back_to_where_the_op_stands():
    """A later pass that drops the flint.prefetch_point op's attribute leaves the gather issued at the top (one
    block ahead), not lost."""
    from flint.ir import dist

    m = _fixture()
    run_pipeline(m, "reorder-all-gather{prefetch=1}")
    for op in m.walk():
        op.attributes.pop(dist.PREFETCH_POINT_ATTR, None)
    assert step_memory(m).report.category_peak_bytes["comm"] == 3 * GATHERED
    from xdsl.context import Context

    from flint.chakra.from_ir import trace_from_ir
    from flint.passes.lower_to_chakra import LowerToChakraPass

    LowerToChakraPass().apply(Context(), m)
    t = trace_from_ir(m).ranks[0].table
    assert np.count_nonzero(t.comm_type == 2) == 4 * 2  # every group gathered once per iteration


@pytest.fixture(scope="module")
def alternating():
    """A narrow and a wide layer alternating (two FSDP groups per repeated block), FSDP on 2 ranks."""
    from flint.importer import import_step

    return import_step(captured_byom("alternating_layers", "fsdp", 2, 1))


@pytest.mark.parametrize("spec", ["reorder-all-gather{prefetch=1}", "reorder-all-gather{prefetch=3}", FSDP_PIPELINE])
def test_captured_block_of_two_groups_keeps_the_invariants_and_unrolls_the_same(alternating, spec):
    from xdsl.context import Context

    from flint.chakra.from_ir import trace_from_ir
    from flint.passes.canonicalize_dist import CanonicalizeDistPass
    from flint.passes.lower_to_chakra import LowerToChakraPass

    after = alternating.clone()
    run_pipeline(after, spec)
    check_schedule_invariants(alternating, after)
    CanonicalizeDistPass().apply(Context(), after)
    LowerToChakraPass().apply(Context(), after)
    after.verify()
    fast = trace_from_ir(after, fast_repeat=True).ranks[0].table
    slow = trace_from_ir(after, fast_repeat=False).ranks[0].table
    for col in ("kind", "comm_type", "comm_bytes", "data_dep_ptr", "data_dep_idx", "ctrl_dep_ptr", "ctrl_dep_idx"):
        assert np.array_equal(getattr(fast, col), getattr(slow, col)), col
    base = alternating.clone()
    LowerToChakraPass().apply(Context(), base)
    t0 = trace_from_ir(base).ranks[0].table
    assert np.count_nonzero(fast.comm_type == 2) == np.count_nonzero(t0.comm_type == 2)
    assert fast.flops[fast.flops > 0].sum() == t0.flops[t0.flops > 0].sum()
