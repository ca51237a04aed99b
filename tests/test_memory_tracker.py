"""Flint's peak memory per rank against PyTorch's FSDPMemTracker / MemTracker on fake tensors (flint.validate.memory),
and the runtime overheads data (flint/devices/runtime/memory.toml)."""

from __future__ import annotations

import pytest

from flint.errors import FlintError
from flint.validate.memory import (RUNTIME_MEMORY_TOML, MemoryCase, compare_in_subprocess, communicators,
                                   runtime_overheads, table)


def test_fsdp_peak_within_five_percent_of_fsdp_mem_tracker():
    # a fresh process: the capture and the tracker's fake world start clean
    r = compare_in_subprocess(MemoryCase("llama-tiny", "fsdp", 2))
    assert r.tracker_name == "FSDPMemTracker"
    assert r.within(0.05), (r.flint, r.tracker)
    # resident state agrees exactly: sharded parameters, AdamW's two moments (+ its step), sharded gradients
    assert r.flint.categories["params"] == r.tracker.raw["Sharded Param"]
    assert abs(r.flint.categories["optimizer"] - r.tracker.raw["OptState"]) <= 128  # step scalars
    # gathered parameters (this block's and the prefetched next one) and the reduce-scatter input FSDP2 holds
    tracker_comm = r.tracker.raw["Unsharded Param"] + r.tracker.raw["All Gather"] + r.tracker.raw["Reduce Scatter"]
    assert r.flint.categories["comm"] + r.flint.categories["activations"] >= tracker_comm
    assert "llama-tiny fsdp w2" in table([r], runtime_overheads())


@pytest.mark.slow
@pytest.mark.parametrize("ac", ["full", "selective-op"])
def test_fsdp_tp_with_activation_checkpointing_within_five_percent(ac):
    # Before: the copy-out's unsharded parameters were freed one by one after their last use (FSDP2
    # frees the group at its reshard) and the embedding's backward all-gather, which FSDP2 prefetches
    # during layer 0's backward, was missing: -7.6% (full).
    r = compare_in_subprocess(MemoryCase("llama-tiny", "fsdp+tp", 4, ac))
    assert r.within(0.05), (r.flint, r.tracker)
    # unsharded parameters, the prefetched all-gather and the held reduce-scatter input are all there
    # (Flint's comm also counts tensor-parallel all-reduce outputs, which the tracker calls Temp)
    tracker_comm = r.tracker.raw["Unsharded Param"] + r.tracker.raw["All Gather"] + r.tracker.raw["Reduce Scatter"]
    assert r.flint.categories["comm"] >= tracker_comm, (r.flint, r.tracker)


@pytest.mark.slow
def test_dp_reference_is_the_single_rank_model():
    # DDP does not run on fake tensors; FSDP2's replicate (the previous reference) keeps an unsharded copy
    # of every parameter that DDP does not (-17% on llama-tiny). DDP's memory is the single-rank model's.
    r = compare_in_subprocess(MemoryCase("llama-tiny", "dp", 2))
    assert r.tracker_name == "MemTracker" and "Unsharded Param" not in r.tracker.raw
    assert r.within(0.01), (r.flint, r.tracker)
    assert r.flint.categories["params"] == r.tracker.raw["Parameter"]
    assert r.flint.categories["grads"] == r.tracker.raw["Gradient"]


def test_runtime_overheads_are_named_and_sourced():
    o = runtime_overheads("h100-sxm")
    assert o.cuda_context_bytes > 0 and o.nccl_bytes_per_communicator > 0 and 0 < o.fragmentation_fraction < 1
    assert {"cuda_context_source", "nccl_mib_per_communicator_source", "fragmentation_fraction_source"} <= set(o.sources)
    case = MemoryCase("llama-tiny", "fsdp+tp", 4)
    assert communicators(case) == 2
    peak = 10 * 2**30
    assert o.total_bytes(peak, 2) == o.cuda_context_bytes + 2 * o.nccl_bytes_per_communicator + \
        int(o.fragmentation_fraction * peak + 0.999999)


@pytest.mark.parametrize("text,match", [
    ("[default]\ncuda_context_mib = 700\nnccl_mib_per_communicator = 512\n", "fragmentation_fraction is missing"),
    ("[default]\ncuda_context_mib = 700\nnccl_mib_per_communicator = 512\nfragmentation_fraction = 1.5\n",
     r"fragmentation_fraction = 1.5 is out of range \(valid range 0.0..1.0\)"),
    ("[default]\ncuda_context_mib = 'big'\n", "cuda_context_mib is missing or not a number"),
    ("[default\n", "not valid TOML"),
])
def test_bad_runtime_overheads_name_the_key_and_range(tmp_path, text, match):
    p = tmp_path / "rt.toml"
    p.write_text(text)
    with pytest.raises(FlintError, match=match):
        runtime_overheads("default", p)
    assert RUNTIME_MEMORY_TOML.is_file()


def test_tracker_post_backward_does_not_keep_the_unsharded_gradient():
    # torch 2.13's FSDPMemTracker wraps FSDPParamGroup.post_backward with a loop whose variable keeps the
    # group's last unsharded gradient alive while the real post_backward runs (FSDP2 itself drops it:
    # unsharded_param.grad = None, unsharded_grads.clear()). Under tensor parallelism the gradient FSDP2
    # reduces is a redistributed copy, so the original stayed counted through the reduce-scatter:
    # Llama-3 8B FSDP x TP's 2 GB full-vocabulary embedding gradient, +525 MB at the tracker's peak
    # (Flint was -5.2%, now equal to the byte). The reference's tracker drops that reference.
    import torch
    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPModState
    from torch.distributed.fsdp import fully_shard

    from flint.capture.fake_dist import device_mesh, fake_world
    from flint.validate.memory import _fsdp_mem_tracker_class

    def unsharded_grad_after_post_backward(cls) -> int:
        with fake_world(2):
            mesh = device_mesh((2,), ("dp_shard",))
            with torch.device("meta"):
                model = nn.Sequential(nn.Linear(64, 64, bias=False))
            fully_shard(model, mesh=mesh)
            with FakeTensorMode(allow_non_fake_inputs=True), torch.device("cpu"):
                model.to_empty(device="cpu")
                tracker = cls(model)
                with tracker:
                    model(torch.randn(1, 64)).sum().backward()
                snaps = tracker.memory_tracking[model].snapshots[_FSDPModState.AFT_POST_BW]
        return sum(v for snap in snaps for d in snap.values() for k, v in d.items()
                   if getattr(k, "value", k) == "Unsharded Grad")

    assert unsharded_grad_after_post_backward(FSDPMemTracker) == 64 * 64 * 4  # the artefact, in torch itself
    assert unsharded_grad_after_post_backward(_fsdp_mem_tracker_class()) == 0


@pytest.mark.slow
@pytest.mark.parametrize("plan,world,tracker", [("hsdp", 4, "FSDPMemTracker"), ("tp+sp", 2, "MemTracker")])
def test_hsdp_and_tp_sequence_parallel_within_five_percent(plan, world, tracker):
    # HSDP: fully_shard on the 2-D (dp_replicate, dp_shard) mesh; TP with sequence parallelism alone.
    r = compare_in_subprocess(MemoryCase("llama-tiny", plan, world, layers=4))
    assert r.tracker_name == tracker
    assert r.within(0.05), (r.flint, r.tracker)
    sharded = r.tracker.raw.get("Sharded Param", r.tracker.raw.get("Parameter"))
    assert r.flint.categories["params"] == sharded  # parameters sharded over dp_shard (HSDP) / tp


@pytest.mark.slow
def test_fsdp_tp_without_ac_eager_partition_within_five_percent():
    # The tracker runs eagerly; with the min-cut partition (what torch.compile saves) Flint was -7.6% here,
    # eager autograd saving RMSNorm's x * rsqrt and SiLU's output that the compiled run recomputes. Flint's
    # eager partition (flint.capture.partition) saves what eager autograd saves: like with like.
    r = compare_in_subprocess(MemoryCase("llama-tiny", "fsdp+tp", 4, layers=4, partitioner="eager"))
    assert r.within(0.05), (r.flint, r.tracker)
    assert r.flint.categories["params"] == r.tracker.raw["Sharded Param"]
    assert "partitioner=eager" in r.case.label()


@pytest.mark.slow
def test_loss_parallel_memory_drop_against_the_tracker():
    """The plan's loss_parallel against FSDPMemTracker running torch's loss_parallel eagerly, on a model whose
    peak is the head's backward (GPT-2 small, 2 layers, 1,024 tokens x 50,257 words per rank, fsdp+tp 4).
    Without it Flint equals the tracker (0.00%). With it both peaks drop (tracker 1,057 -> 851 MB), Flint's
    more (-> 748 MB, -12.1%): eager DTensor's nll_loss backward handler keeps grad_input and the saved shifted
    logits alive until it returns, so four logits-sized fp32 buffers meet at its last multiply; the captured
    graph frees each after its last use (three at most). A known gap, README "Not there yet"."""
    base = dict(layers=2, batch=(4, 512), partitioner="eager")
    off = compare_in_subprocess(MemoryCase("gpt2-small", "fsdp+tp", 4, **base))
    on = compare_in_subprocess(MemoryCase("gpt2-small", "fsdp+tp", 4, loss_parallel=True, **base))
    assert off.within(0.01), (off.flint, off.tracker)
    assert on.tracker.total_bytes < 0.85 * off.tracker.total_bytes
    assert on.flint.total_bytes < on.tracker.total_bytes
    logits = 1024 * (50257 + 1) // 2 * 4  # one rank's fp32 logits shard (the vocabulary padded to an even split)
    assert on.tracker.total_bytes - on.flint.total_bytes <= logits + 2**20
