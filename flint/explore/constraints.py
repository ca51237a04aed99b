"""Constraints that prune design points before any evaluation, each counted by name.

In the order they are checked (a point is counted under the first it fails):

``degrees_divide``  the plan is valid for the world size (degrees multiply to
                    it, TP divides the heads, ...; :meth:`Plan.validate` and
                    :meth:`Plan.check_model`) and the global batch divides
                    over the data-parallel ranks and the microbatches.
``supported``       capture implements every plan field set (the capture
                    recipes' ``CAPTURE_FIELDS``: data, tensor and pipeline
                    parallelism and activation checkpointing), or, for a
                    planned point, ``shard-expand`` does (``EXPAND_FIELDS``:
                    data, tensor, context and expert parallelism).
``max_gpus`` / ``min_gpus``  bounds on the world size.
``memory_fits``     a lower bound of the per-rank memory fits the device's
                    HBM: parameters, gradients and AdamW's two moments at the
                    model dtype, divided by ``tp * pp * ep`` and, under ZeRO-3, by
                    ``dp_shard`` (exact shapes from the model built on the meta
                    device: a zoo preset, or a model file's factory). It never prunes a point that could fit; the
                    evaluated peak (tensor lifetimes) says whether the rest do
                    (output ``fits``).
"""

from __future__ import annotations

from functools import cache
from typing import Any, Mapping

from flint.errors import FlintError


@cache
def _factory(model: str, layers: int | None):
    """(model factory, zoo config or None) of a zoo preset or a model file."""
    from flint.capture.byom import model_factory

    return model_factory(model, layers, "workload.model", "workload.layers")[:2]


@cache
def _built(model: str, layers: int | None):
    """The model on the meta device."""
    import torch

    with torch.device("meta"):
        return _factory(model, layers)[0]()


@cache
def _param_count(model: str, layers: int | None) -> int:
    return sum(p.numel() for p in _built(model, layers).parameters())


# the shape fields checked against a plan: (ours, the zoo config's, Hugging Face's config's)
_SHAPE_FIELDS = (("n_layers", "n_layers", "num_hidden_layers"), ("n_heads", "n_heads", "num_attention_heads"),
                 ("n_kv_heads", "n_kv_heads", "num_key_value_heads"), ("hidden", "dim", "hidden_size"),
                 ("ffn_hidden", "ffn_dim", "intermediate_size"), ("n_experts", "n_experts", None))


@cache
def _model_shape(model: str, layers: int | None) -> dict[str, int]:
    from flint.capture.byom import config_experts

    cfg = _factory(model, layers)[1]
    # a model file's Hugging Face model: its config's names (a zoo preset's config needs no model built)
    hf = getattr(_built(model, layers), "config", None) if cfg is None else None
    out = {}
    for ours, zoo, theirs in _SHAPE_FIELDS:
        v = getattr(cfg, zoo, None) if cfg is not None else getattr(hf, theirs, None) if theirs else None
        if isinstance(v, int) and not isinstance(v, bool):
            out[ours] = v
    if hf is not None and (experts := config_experts(_built(model, layers))):
        out["n_experts"] = experts  # num_local_experts (Mixtral), num_experts (Qwen3-MoE), n_routed_experts, ...
    if "hidden" not in out and isinstance(getattr(cfg, "d_model", None), int):
        out["hidden"] = cfg.d_model
    return out


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


def memory_lower_bound_bytes(point: Mapping[str, Any], plan) -> int:
    """Parameters + gradients + AdamW state per rank, sharded as the plan shards them (module docstring)."""
    n = _param_count(point["workload.model"], point.get("workload.layers"))
    per = _DTYPE_BYTES.get(point.get("workload.dtype", "bfloat16"), 4)
    model = plan.tp * plan.pp * max(plan.ep, 1)  # expert parallelism shards only the experts: dividing
    shard = model * (plan.dp_shard if plan.zero == 3 else 1)  # everything by it keeps the bound below
    state = n * per * 2 / (model * (plan.dp_shard if plan.zero >= 1 else 1))  # AdamW moments
    grads = n * per / (model * (plan.dp_shard if plan.zero >= 2 else 1))
    return int(n * per / shard + grads + state)


def _expandable(point: Mapping[str, Any], plan) -> bool:
    """Whether the planned path (``shard-expand``) implements every plan field set, for a planned point."""
    from flint.passes.shard_annotate import EXPAND_FIELDS, check_plan_checkpointing

    if point.get("workload.path", "planned") != "planned":
        return False
    try:
        plan.require(EXPAND_FIELDS, "shard-expand")
        check_plan_checkpointing(plan)
    except FlintError:
        return False
    return True


def check(point: Mapping[str, Any], constraints: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(constraint, reason)`` for the first constraint ``point`` fails, or None."""
    from flint.capture.recipes import CAPTURE_FIELDS
    from flint.explore.space import plan_of_point

    try:
        plan = plan_of_point(point)
        shape = _model_shape(point["workload.model"], point.get("workload.layers"))
        gb = point.get("workload.global_batch")
        gb = plan.dp if gb is None else gb
        if gb % plan.dp:
            return "degrees_divide", f"global batch {gb} is not divisible by the data-parallel degree {plan.dp}"
        plan.check_model(n_layers=shape.get("n_layers"), n_heads=shape.get("n_heads"),
                         n_kv_heads=shape.get("n_kv_heads"), hidden=shape.get("hidden"),
                         ffn_hidden=shape.get("ffn_hidden"), n_experts=shape.get("n_experts"),
                         seq_len=point.get("workload.seq_len"), local_batch=gb // plan.dp)
    except FlintError as e:
        return "degrees_divide", str(e)
    try:
        plan.require(CAPTURE_FIELDS, "capture")
    except FlintError as e:
        if not _expandable(point, plan):  # neither way in builds this program
            return "supported", str(e)
    if "max_gpus" in constraints and plan.world_size > constraints["max_gpus"]:
        return "max_gpus", f"{plan.world_size} ranks > max_gpus {constraints['max_gpus']}"
    if "min_gpus" in constraints and plan.world_size < constraints["min_gpus"]:
        return "min_gpus", f"{plan.world_size} ranks < min_gpus {constraints['min_gpus']}"
    if constraints.get("memory_fits", True):
        from flint.cost import load_device

        need = memory_lower_bound_bytes(point, plan)
        cap = load_device(point["system.device"]).hbm_capacity_bytes
        if need > cap:
            return "memory_fits", (f"parameters + gradients + optimizer state alone need {need / 2**30:.1f} GiB "
                                   f"per rank, more than {point['system.device']}'s {cap / 2**30:.1f} GiB")
    return None
