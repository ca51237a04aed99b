"""The issue's capture matrix: GPT-2 small and a 2-layer Llama at world sizes 1, 8 and 1024
with DP, FSDP, TP and FSDP+TP. Expected kinds, counts and sizes follow how PyTorch runs each
configuration (the per-recipe eager comparisons are in test_capture.py)."""

from __future__ import annotations

import math

import pytest
import torch
from captures import captured, imported
from xdsl.context import Context

from flint.ir import dist
from flint.models import build, config
from flint.passes.canonicalize_dist import CanonicalizeDistPass

pytestmark = pytest.mark.slow

TP_DEGREE = {"gpt2-small": 4, "llama-tiny": 8}  # GPT-2 small has 12 heads
# TP all-reduces per block, forward and backward, as DTensor's parallelize_module issues them
TP_PER_BLOCK = {"gpt2-small": (2, 4), "llama-tiny": (2, 5)}


def plan_recipe(model: str, plan: str, world: int) -> tuple[str, int]:
    """(recipe, TP degree): TP at the model's degree, data parallel over the rest."""
    t = min(TP_DEGREE[model], world)
    if plan in ("dp", "fsdp"):
        return plan, 1
    if plan == "tp" and world == t:
        return "tp", world
    return ("dp+tp" if plan == "tp" else "fsdp+tp"), t


def param_bytes(model: str, pad_dim0_to: int = 1) -> int:
    """fp32 bytes of all parameters, each padded on dim 0 to a multiple of ``pad_dim0_to``
    (FSDP shards every parameter on dim 0)."""
    with torch.device("meta"):
        params = list(build(model).parameters())
    total = 0
    for p in params:
        rows = -(-p.shape[0] // pad_dim0_to) * pad_dim0_to
        total += rows * (p.numel() // p.shape[0])
    return total * 4


def totals(step, kind, axis, phase):
    s = step.summary()
    key = (kind, (axis,), phase)
    return s.collectives.get(key, 0), s.collective_bytes.get(key, 0)


CASES = [(m, p, w) for m in TP_DEGREE for w in (1, 8, 1024) for p in ("dp", "fsdp", "tp", "fsdp+tp")]


@pytest.mark.parametrize("model,plan,world", CASES, ids=[f"{m}-{p}-{w}" for m, p, w in CASES])
def test_collectives_match_how_pytorch_runs_it(model, plan, world):
    recipe, t = plan_recipe(model, plan, world)
    step = captured(model, recipe, world, t)
    layers = config(model).n_layers
    groups = layers + 2  # FSDP / DDP units: embedding, each block, head
    tp = t if "tp" in recipe else 1
    dp = world // tp

    if world == 1:
        # no collective over a one-rank group survives canonicalization
        _, module = imported(model, recipe, world, t)
        module = module.clone()
        CanonicalizeDistPass().apply(Context(), module)
        assert not [op for op in module.walk() if isinstance(op, (dist.CollectiveOp, dist.WaitOp))]
        return

    if dp == 1:  # a data-parallel degree of 1 is no data parallelism: no ParamGroup, no collective
        assert not any(set(ax) & {"dp_shard", "dp_replicate"} for _, ax, _ in step.summary().collectives)
    if recipe.startswith("dp") and dp > 1:
        n, b = totals(step, "all_reduce", "dp_replicate", "bwd")
        assert n == groups
        if tp == 1:
            assert b == param_bytes(model)
    if recipe.startswith("fsdp") and dp > 1:
        n_fwd, b_fwd = totals(step, "all_gather", "dp_shard", "fwd")
        n_bwd, b_bwd = totals(step, "all_gather", "dp_shard", "bwd")
        n_rs, b_rs = totals(step, "reduce_scatter", "dp_shard", "bwd")
        # gathered again in backward (reshard after forward), but the head: kept from its forward, as torchtitan
        assert n_fwd == n_rs == groups and n_bwd == groups - 1
        head = sum(math.prod(p.local_shape) * 4 for p in step.part("head").params)  # its gather's input: the shards
        assert b_fwd - head == b_bwd and b_rs == dp * b_fwd  # reduce-scatter input = full (padded) gradient
        if tp == 1:
            assert b_rs == param_bytes(model, pad_dim0_to=dp)
        else:  # TP shards most weights (not norms / biases) before FSDP pads them
            assert param_bytes(model) // tp <= b_rs <= param_bytes(model, pad_dim0_to=dp)
    if tp > 1:
        fwd_per, bwd_per = TP_PER_BLOCK[model]
        assert totals(step, "all_reduce", "tp", "fwd")[0] == fwd_per * layers + 1
        assert totals(step, "all_reduce", "tp", "bwd")[0] == bwd_per * layers + 1
    else:
        assert not any(ax == ("tp",) for _, ax, _ in step.summary().collectives)


@pytest.mark.parametrize("plan", ["dp", "fsdp"])
def test_mixture_of_experts_captures_and_imports(plan):
    step, module = imported("moe-tiny", plan, 8)
    groups = config("moe-tiny").n_layers + 2
    kind, axis = ("all_reduce", "dp_replicate") if plan == "dp" else ("reduce_scatter", "dp_shard")
    assert totals(step, kind, axis, "bwd")[0] == groups
    assert step.summary().op_classes["gemm"] > 0 and step.summary().op_classes["attention"] > 0
    module.verify()


def test_mixture_of_experts_refuses_tensor_parallel():
    from flint.capture import CaptureError

    with pytest.raises(CaptureError, match="tp: capturing tensor parallelism of mixture-of-experts layers is not implemented"):
        captured("moe-tiny", "tp", 2, 2)
