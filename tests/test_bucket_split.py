"""bucket-collectives and split-collectives keep the step's work: the scheduling checker
(same bytes per group) holds on the goldens' inputs and on a captured FSDP step."""

from __future__ import annotations

from pathlib import Path

import pytest
from xdsl.context import Context
from xdsl.parser import Parser

from flint.errors import FlintError
from flint.ir import dist, flint_context
from flint.passes.bucket_collectives import BucketCollectivesPass
from flint.passes.split_collectives import SplitCollectivesPass
from flint.schedule import ScheduleInvariantError, check_schedule_invariants

LIT = Path(__file__).resolve().parent.parent / "lit_tests" / "passes"


def load(name: str):
    return Parser(flint_context(), (LIT / name).read_text()).parse_module()


def run(pass_, module):
    before = module.clone()
    pass_.apply(Context(), module)
    module.verify()
    return before, module


def count(module, attr):
    return sum(1 for o in module.walk() if isinstance(o, dist.CollectiveOp) and attr in o.attributes)


@pytest.mark.parametrize("nbytes", [1, 500, 1024, 3072, 26214400])
def test_bucketing_keeps_the_work(nbytes):
    before, after = run(BucketCollectivesPass(bytes=nbytes), load("bucket-collectives.mlir"))
    check_schedule_invariants(before, after, same_bytes_per_group=True)


@pytest.mark.parametrize("nbytes", [8, 100, 512, 1000, 1 << 20])
def test_splitting_keeps_the_work(nbytes):
    before, after = run(SplitCollectivesPass(bytes=nbytes), load("split-collectives.mlir"))
    check_schedule_invariants(before, after, same_bytes_per_group=True)
    for o in after.walk():
        if isinstance(o, dist.CollectiveOp) and "split_of" in o.attributes:
            t = o.input.type
            assert t.get_shape()[0] * 2 <= nbytes  # bf16 pieces within the limit


def test_bucketing_changes_the_collective_multiset():
    """Without the bucketing allowance the checker rejects it: the pass really fused."""
    before, after = run(BucketCollectivesPass(), load("bucket-collectives.mlir"))
    assert count(after, "bucketed") == 2
    with pytest.raises(ScheduleInvariantError, match="communication changed"):
        check_schedule_invariants(before, after)


def test_split_then_bucket_round_trip():
    """Splitting into pieces and bucketing them again gives back one collective per original."""
    module = load("split-collectives.mlir")
    before = module.clone()
    SplitCollectivesPass(bytes=512).apply(Context(), module)
    assert count(module, "split_of") == 4
    BucketCollectivesPass(bytes=1024).apply(Context(), module)
    module.verify()
    check_schedule_invariants(before, module, same_bytes_per_group=True)
    assert count(module, "bucketed") == 2
    kinds = sorted(o.name for o in module.walk() if isinstance(o, dist.CollectiveOp))
    assert kinds == sorted(o.name for o in before.walk() if isinstance(o, dist.CollectiveOp))


@pytest.mark.parametrize("cls", [BucketCollectivesPass, SplitCollectivesPass])
@pytest.mark.parametrize("bad", [0, -1])
def test_bytes_must_be_positive(cls, bad):
    with pytest.raises(FlintError, match=f"option bytes must be a positive number of bytes, got {bad}"):
        cls(bytes=bad)


def test_nothing_to_do_says_so_and_changes_nothing(capsys):
    module = load("bucket-collectives.mlir")
    text = str(module)
    BucketCollectivesPass(bytes=500).apply(Context(), module)
    assert str(module) == text
    assert "nothing to bucket" in capsys.readouterr().err
    SplitCollectivesPass().apply(Context(), module)
    assert str(module) == text
    assert "nothing to split" in capsys.readouterr().err


@pytest.mark.slow
def test_split_and_bucket_a_captured_fsdp_step():
    """On a real FSDP2 capture (flattened per-block gathers): split each block's collectives, bucket them back."""
    from captures import imported

    _, module = imported("llama-tiny", "fsdp", 4)
    module = module.clone()
    before = module.clone()
    SplitCollectivesPass(bytes=1 << 19).apply(Context(), module)
    module.verify()
    check_schedule_invariants(before, module, same_bytes_per_group=True)
    assert count(module, "split_of") > 0
    BucketCollectivesPass(bytes=1 << 22).apply(Context(), module)
    module.verify()
    check_schedule_invariants(before, module, same_bytes_per_group=True)
    assert count(module, "bucketed") > 0
