"""The plan's ``loss_parallel``: torch's ``loss_parallel`` (torchtitan's default with TP, Megatron's
vocab-parallel cross-entropy) keeps the logits sharded over the vocabulary in the head's forward and
backward; without it the output projection all-gathers them and every rank computes the whole loss."""

from __future__ import annotations

import pytest

import captures
from flint.capture import CaptureError, capture_step
from flint.models import factory
from flint.plan import Plan, PlanError

VOCAB = factory("llama-tiny")().config.vocab_size


def _head(on: bool, phase: str):
    step, _ = captures.loss_parallel(on)
    part = next(p for p in step.parts if p.name == "head")
    return getattr(part, phase)


def _collectives(graph) -> list[tuple[str, tuple, object]]:
    """(kind, input shape, reduce op or group size) of each collective the graph issues."""
    out = []
    for n in graph.nodes():
        name = str(n.target)
        if "_c10d_functional" in name and "wait_tensor" not in name:
            out.append((name.split(".")[1], tuple(n.args[0].meta["val"].shape), n.args[1]))
    return out


def _widest(graph) -> int:
    """The largest last dimension of any value the graph computes."""
    dims = [n.meta["val"].shape[-1] for n in graph.nodes()
            if hasattr(n.meta.get("val"), "shape") and len(n.meta["val"].shape) > 0]
    return max(dims)


def test_logits_stay_sharded_over_the_vocabulary():
    off, on = _head(False, "fwd"), _head(True, "fwd")
    # without: the local logits [tokens, vocab / 2] are all-gathered, the loss sees the whole vocabulary
    assert any(kind == "all_gather_into_tensor" and shape[-1] == VOCAB // 2 for kind, shape, _ in _collectives(off))
    assert _widest(off) == VOCAB
    # with: no all-gather of logits; per-token max and sum all-reduces over the shards, then the target logit's
    assert not any(kind == "all_gather_into_tensor" and shape[-1] == VOCAB // 2 for kind, shape, _ in _collectives(on))
    reduces = [(shape, op) for kind, shape, op in _collectives(on) if kind == "all_reduce"]
    assert [op for _, op in reduces] == ["max", "sum", "sum"]
    assert all(shape[-1] == 1 for shape, _ in reduces)
    assert _widest(on) == VOCAB // 2
    # the backward never builds a whole-vocabulary tensor either
    assert _widest(_head(False, "bwd")) == VOCAB and _widest(_head(True, "bwd")) == VOCAB // 2


def _estimate(on: bool):
    from xdsl.context import Context

    from flint.chakra.from_ir import mesh_of, trace_from_ir
    from flint.cost import load_device, load_network
    from flint.passes.lower_to_chakra import LowerToChakraPass
    from flint.sim import simulate
    from flint.sim.lifetimes import step_memory

    module = captures.loss_parallel(on)[1].clone()
    peak = step_memory(module).report.peak_bytes
    LowerToChakraPass(device="h100-sxm").apply(Context(), module)
    trace = trace_from_ir(module)
    table = trace.ranks[0].table
    comm = sum(int(b) for kind, b in zip(table.comm_type, table.comm_bytes) if kind >= 0)
    result = simulate(trace, load_device("h100-sxm"), load_network("dgx-h100"), mesh_of(module))
    return result, comm, peak


def test_loss_parallel_moves_fewer_bytes_and_holds_less():
    """Fewer bytes on the wire (no logits all-gather: the three all-reduces move one value per token each)
    and no higher a peak (no whole-vocabulary log-probabilities). Time is not asserted here: at this
    size (128 tokens x 1,024 words per rank) the parallel loss's extra small kernels, each at the kernel
    floor, cost more than the work they save (1,851 against 1,752 us of compute); on the accuracy bench's
    rows (131,072 words) it is the other way round, see the README."""
    (off, off_comm, off_peak), (on, on_comm, on_peak) = _estimate(False), _estimate(True)
    tokens = 2 * captures.SEQ // 2  # per rank under sequence parallelism
    logits_gather = tokens * (VOCAB // 2) * 4  # the fp32 local logits each rank sends
    assert off_comm - on_comm >= logits_gather - 3 * 2 * tokens * 4
    assert on_peak <= off_peak  # llama-tiny's peak is not at its head; the M rows' is (README)


def test_plan_field():
    plan = Plan.from_dict({"tp": 2, "loss_parallel": True}, world_size=2)
    assert plan.loss_parallel and "loss parallel" in plan.describe()
    assert Plan.from_dict(plan.to_dict()).loss_parallel
    with pytest.raises(PlanError, match="loss_parallel.*needs tp > 1"):
        Plan.from_dict({"dp_shard": 2, "loss_parallel": True}, world_size=2)
    with pytest.raises(PlanError, match="loss_parallel.*true or false"):
        Plan.from_dict({"tp": 2, "loss_parallel": "yes"}, world_size=2)


def test_a_model_outside_the_zoo_is_refused_by_name():
    import torch.nn as nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x).sum()

    plan = Plan.from_dict({"tp": 2, "loss_parallel": True}, world_size=2)
    with pytest.raises((PlanError, CaptureError), match="loss_parallel"):
        capture_step(Net, {"x": (2, 8)}, plan=plan)
