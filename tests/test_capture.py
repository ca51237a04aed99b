"""flint.capture: collective kinds, counts and sizes per recipe, checked against PyTorch eager."""

from __future__ import annotations

import inspect
import math
import operator
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from flint.capture import CaptureError, capture_step, classify_aten
from flint.errors import FlintError
from flint.capture.fake_dist import device_mesh, fake_world
from flint.capture.recipes import apply_tp
from flint.models import build, config, factory
from captures import SEQ, captured, imported



def colls(step, phases=("fwd", "bwd")) -> Counter:
    """(kind, axes) -> count over the given phases."""
    out = Counter()
    for (kind, axes, phase), n in step.summary().collectives.items():
        if phase in phases:
            out[(kind, axes)] += n
    return out


def phase_colls(step, phase: str) -> Counter:
    return Counter({(k, a): n for (k, a, p), n in step.summary().collectives.items() if p == phase})


def group_bytes(model: str, part: str, dp: int, tp: int = 1) -> int:
    """FSDP all-gather input bytes of one parameter group on one rank (fp32, dim-0 shards, padded)."""
    with torch.device("meta"):
        m = build(model)
    module = {"embed": m.embed, "block": m.layers[0], "head": m.head}[part]
    total = 0
    for name, p in module.named_parameters():
        shape = list(p.shape)
        if tp > 1 and name.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight",
                                      "wq.bias", "wk.bias", "wv.bias", "w1.bias", "w3.bias", "output.weight")):
            shape[0] //= tp
        elif tp > 1 and name.endswith(("wo.weight", "w2.weight", "tok_embeddings.weight")):
            shape[1 if name.endswith(("wo.weight", "w2.weight")) else 0] //= tp
        total += -(-shape[0] // dp) * math.prod(shape[1:]) * 4
    return total


# ------------------------------------------------------------------ op classes


def test_classify_aten_rules():
    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    table = {
        aten.mm.default: "gemm", aten.addmm.default: "gemm", aten.bmm.default: "gemm",
        aten._scaled_dot_product_flash_attention_for_cpu.default: "attention",
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default: "attention",
        aten.add.Tensor: "elementwise", aten.mul.Tensor: "elementwise", aten.rsqrt.default: "elementwise",
        aten.silu.default: "elementwise", aten.pow.Tensor_Scalar: "elementwise",
        aten.sum.dim_IntList: "reduction", aten.mean.dim: "reduction", aten._log_softmax.default: "reduction",
        aten.view.default: "view", aten.t.default: "view", aten.permute.default: "view",
        aten._unsafe_view.default: "view", aten.slice.Tensor: "view",
        aten.clone.default: "memory", aten.cat.default: "memory", aten.embedding.default: "memory",
        aten.gather.default: "memory",
        c10d.all_gather_into_tensor.default: "all_gather", c10d.reduce_scatter_tensor.default: "reduce_scatter",
        c10d.all_reduce.default: "all_reduce", c10d.all_to_all_single.default: "all_to_all",
        c10d.wait_tensor.default: "wait", operator.getitem: "other",
    }
    for target, cls in table.items():
        assert classify_aten(target) == cls, target


# ----------------------------------------------------------------- recipes


@pytest.mark.slow
@pytest.mark.parametrize("model,world", [("llama-tiny", 8), ("llama-tiny", 1024), ("gpt2-tiny", 8)])
def test_fsdp_gathers_per_group_and_one_reduce_scatter(model, world):
    step = captured(model, "fsdp", world)
    groups = 2 + config(model).n_layers
    assert phase_colls(step, "fwd") == {("all_gather", ("dp_shard",)): groups}
    # the head keeps its forward's gathered parameters for the backward (torchtitan's reshard policy)
    assert phase_colls(step, "bwd") == {("all_gather", ("dp_shard",)): groups - 1,
                                        ("reduce_scatter", ("dp_shard",)): groups}
    assert phase_colls(step, "optim") == {}
    # sizes: the all-gather input is the concatenated local dim-0 shards of the group
    sizes = Counter()
    for part in step.parts:
        for node in part.fwd.nodes():
            if classify_aten(node.target) == "all_gather":
                v = node.args[0].meta["val"]
                sizes[part.name] += v.numel() * v.element_size()
                assert node.meta["val"].numel() == v.numel() * world
    for part in ("embed", "block", "head"):
        assert sizes[part] == group_bytes(model, part, world)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama-tiny", "gpt2-tiny"])
def test_dp_one_all_reduce_per_group(model):
    world = 2 if model == "gpt2-tiny" else 8
    step = captured(model, "dp", world)
    groups = 2 + config(model).n_layers
    assert colls(step, ("fwd",)) == {}
    assert colls(step, ("bwd",)) == {("all_reduce", ("dp_replicate",)): groups}
    with torch.device("meta"):
        n_params = sum(p.numel() for p in build(model).parameters())
    assert step.summary().collective_bytes[("all_reduce", ("dp_replicate",), "bwd")] == 4 * n_params


@pytest.mark.slow
def test_one_rank_is_the_single_device_program():
    step = captured("gpt2-tiny", "dp", 1)
    assert step.summary().collectives == {}
    assert step.mesh.world_size == 1 and step.plan.degrees == {"pp": 1, "dp_replicate": 1, "dp_shard": 1,
                                                                "cp": 1, "tp": 1}


@pytest.mark.slow
def test_hsdp_shards_and_all_reduces_the_gradient_shards():
    from flint.plan import Plan

    plan = Plan.from_dict({"dp_replicate": 2, "dp_shard": 4})
    step = capture_step(factory("llama-tiny"), {"tokens": (8, SEQ), "labels": (8, SEQ)}, plan=plan)
    groups = 2 + config("llama-tiny").n_layers
    assert step.mesh.axis_names == ("dp_replicate", "dp_shard")
    assert phase_colls(step, "fwd") == {("all_gather", ("dp_shard",)): groups}
    bwd = phase_colls(step, "bwd")
    assert bwd == {("all_gather", ("dp_shard",)): groups - 1, ("reduce_scatter", ("dp_shard",)): groups,
                   ("all_reduce", ("dp_replicate",)): groups}
    s = step.summary()
    # the all-reduce is of the gradient shard: the reduce-scatter's output, 1/4 of its input
    assert 4 * s.collective_bytes[("all_reduce", ("dp_replicate",), "bwd")] == \
        s.collective_bytes[("reduce_scatter", ("dp_shard",), "bwd")]
    assert step.batch_local_shapes["tokens"] == (1, SEQ)


@pytest.mark.slow
def test_fsdp_tp_2d_at_1024_ranks():
    step = captured("llama-tiny", "fsdp+tp", 1024, 8)
    layers = config("llama-tiny").n_layers
    assert set(step.group_axes.values()) >= {(0,), (1,)}
    fwd, bwd = phase_colls(step, "fwd"), phase_colls(step, "bwd")
    assert fwd[("all_gather", ("dp_shard",))] == layers + 2
    assert bwd[("all_gather", ("dp_shard",))] == layers + 1  # not the head: kept from its forward
    assert bwd[("reduce_scatter", ("dp_shard",))] == layers + 2
    # TP without SP: rowwise outputs all-reduce (embedding + wo + w2), colwise input grads in backward
    assert fwd[("all_reduce", ("tp",))] == 1 + 2 * layers
    assert bwd[("all_reduce", ("tp",))] == 5 * layers + 1
    assert fwd[("all_gather", ("tp",))] == 1  # replicated logits
    block = step.part("block")
    shards = {r.param: r for r in block.fwd.roles.values() if r.kind == "parameter"}
    wq = shards["layers.0.attention.wq.weight"]
    assert wq.global_shape == (256, 256) and wq.local_shape == (1, 256) and wq.sharding == {"tp": 0, "dp_shard": 0}


class CommCounter(TorchDispatchMode):
    """Counts c10d and functional-collective ops as PyTorch eager issues them."""

    def __enter__(self):
        self.counts = Counter()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional") and "wait" not in func.__name__ \
                and "wrap" not in func.__name__:
            name = func.__name__.split(".")[0]
            self.counts[{"_allgather_base_": "all_gather", "all_gather_into_tensor": "all_gather",
                         "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
                         "allreduce_": "all_reduce", "all_reduce": "all_reduce"}.get(name, name)] += 1
        return func(*args, **(kwargs or {}))


def _eager_counts(model: str, world: int, parallelize) -> tuple[Counter, Counter]:
    """Collectives issued by a real eager fwd+bwd on CPU tensors over the fake process group."""
    with fake_world(world):
        mesh = device_mesh((world,), ("dp_shard",))
        torch.manual_seed(0)
        m = build(model)
        parallelize(m, mesh)
        tokens = torch.zeros(2, SEQ, dtype=torch.long)
        with CommCounter() as counter:
            loss = m(tokens, tokens)
            fwd = Counter(counter.counts)
            loss.backward()
        bwd = counter.counts - fwd
    return fwd, bwd


@pytest.mark.slow
def test_fsdp_matches_eager_fully_shard():
    from torch.distributed.fsdp import fully_shard

    def fsdp2(m, mesh):
        fully_shard(m.embed, mesh=mesh)
        for layer in m.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(m.head, mesh=mesh, reshard_after_forward=False)  # as torchtitan: the backward starts there
        fully_shard(m, mesh=mesh)

    fwd, bwd = _eager_counts("llama-tiny", 8, fsdp2)
    step = captured("llama-tiny", "fsdp", 8)
    assert Counter({k: n for (k, _), n in phase_colls(step, "fwd").items()}) == fwd
    assert Counter({k: n for (k, _), n in phase_colls(step, "bwd").items()}) == bwd


class OrderRecorder(TorchDispatchMode):
    """The all-gathers, reduce-scatters and matmuls a real eager run issues, in order."""

    def __enter__(self):
        self.seq = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        kind = {"_allgather_base_": "all_gather", "all_gather_into_tensor": "all_gather",
                "allgather_into_tensor_coalesced": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
                "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
                "mm": "mm"}.get(name)
        if kind is not None and (kind == "mm") == (func.namespace == "aten"):
            self.seq.append(kind)
        return func(*args, **(kwargs or {}))


def _captured_order(step, phase: str) -> list[str]:
    """The same sequence in the captured graphs: forward embed, blocks, head; backward the reverse."""
    parts = [(p, p.repeat) for p in step.parts]
    if phase == "bwd":
        parts.reverse()
    seq = []
    for part, repeat in parts:
        gm = getattr(part, phase).gm
        one = []
        for n in gm.graph.nodes:
            if n.op != "call_function":
                continue
            kind = classify_aten(n.target)
            if kind in ("all_gather", "reduce_scatter"):
                one.append(kind)
            elif n.target is torch.ops.aten.mm.default:
                one.append("mm")
        seq += one * repeat
    return seq


@pytest.mark.slow
def test_fsdp_order_matches_eager_fully_shard():
    """The captured FSDP step issues its all-gathers and reduce-scatters where FSDP2 does, relative to the
    matmuls: each unit's backward all-gather before ANY of its backward ops (FSDP2's pre-backward hook on
    the unit's output gradient), its reduce-scatter after all of them (the post-backward hook on its
    inputs). Eager FSDP2's implicit backward prefetch is switched off: Flint's captured order is the
    unprefetched one, prefetching is the reorder-all-gather pass. Regression: the captured block backward
    ran w2's weight-gradient mm (it reads no gathered weight) before the block's all-gather."""
    from unittest import mock

    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    with fake_world(8), mock.patch.object(FSDPParamGroup, "_backward_prefetch", lambda self: None):
        mesh = device_mesh((8,), ("dp_shard",))
        m = build("llama-tiny")
        fully_shard(m.embed, mesh=mesh)
        for layer in m.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(m.head, mesh=mesh, reshard_after_forward=False)  # as torchtitan: the backward starts there
        fully_shard(m, mesh=mesh)
        tokens = torch.zeros(2, SEQ, dtype=torch.long)
        with OrderRecorder() as rec:
            loss = m(tokens, tokens)
            fwd = list(rec.seq)
            loss.backward()
        bwd = rec.seq[len(fwd):]
    step = captured("llama-tiny", "fsdp", 8)
    assert _captured_order(step, "fwd") == fwd
    assert _captured_order(step, "bwd") == bwd
    assert bwd[:4] == ["mm", "mm", "reduce_scatter", "all_gather"]  # head (kept gathered), then the last block


def test_fsdp_backward_gathers_before_the_units_backward_ops():
    """In the captured IR each FSDP unit's backward starts with its all-gather and wait (FSDP2's
    pre-backward unshard): no compute op of the unit runs before them, in the block and the embedding. The
    head (whose unit holds the loss, as fully_shard(model.head) does) is not resharded after forward, as
    torchtitan wraps it: no gather in its backward."""
    from flint.cost.opclass import classify_target
    from flint.ir.aten import AtenOp

    _, module = imported("llama-tiny", "fsdp", 4)
    fns = {f.sym_name.data: f for f in module.ops if hasattr(f, "sym_name")}
    assert not any(o.name == "dist.all_gather" for o in fns["head_bwd"].body.block.ops)
    for name in ("embed_bwd", "block_bwd"):
        ops = list(fns[name].body.block.ops)
        gather = next(i for i, o in enumerate(ops) if o.name == "dist.all_gather")
        wait = next(i for i, o in enumerate(ops) if o.name == "dist.wait" and o.operands[0] is ops[gather].results[0])
        # every op but views and FSDP2's copy-in (cat) and copy-out (split_with_sizes_copy)
        compute = [i for i, o in enumerate(ops) if isinstance(o, AtenOp) and classify_target(o.overload) != "view"
                   and o.overload not in ("aten.cat.default", "aten.split_with_sizes_copy.default")]
        assert compute and wait < compute[0], name


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["tp", "tp+sp"])
def test_tp_matches_eager_parallelize_module(plan):
    fwd, bwd = _eager_counts("llama-tiny", 8, lambda m, mesh: apply_tp(m, mesh, plan == "tp+sp"))
    step = captured("llama-tiny", plan, 8, 8)
    assert Counter({k: n for (k, _), n in phase_colls(step, "fwd").items()}) == fwd
    assert Counter({k: n for (k, _), n in phase_colls(step, "bwd").items()}) == bwd
    if plan == "tp+sp":
        # norm-weight grads stay Partial in eager; the optimizer step all-reduces them
        assert phase_colls(step, "optim") == {("all_reduce", ("tp",)): 2 * 2 + 1}


@pytest.mark.slow
def test_repeated_block_equals_full_stack():
    rep = captured("llama-tiny", "fsdp+tp", 1024, 8, True).summary()
    full = captured("llama-tiny", "fsdp+tp", 1024, 8, False).summary()
    assert rep.flops == full.flops > 0
    assert rep.collectives == full.collectives
    assert rep.collective_bytes == full.collective_bytes
    assert rep.op_classes["gemm"] == full.op_classes["gemm"]
    assert rep.op_classes["attention"] == full.op_classes["attention"]


@pytest.mark.slow
def test_roles_mesh_and_optimizer():
    step = captured("llama-tiny", "fsdp", 8)
    assert [p.name for p in step.parts] == ["embed", "block", "head"]
    block = step.part("block")
    assert block.repeat == 2
    kinds = Counter(r.kind for r in block.fwd.roles.values())
    assert kinds["parameter"] == 9 and kinds["activation"] == 1 and kinds["buffer"] == 2
    assert any(r.kind == "tangent" for r in block.bwd.roles.values())
    assert step.group_axes and set(step.group_axes.values()) == {(0,)}
    assert step.mesh.shape == (8,) and step.param_dtype == torch.float32
    optim = Counter(r.kind for r in block.optim.roles.values())
    assert optim == {"parameter": 9, "gradient": 9, "exp_avg": 9, "exp_avg_sq": 9, "step": 1}
    assert step.batch_local_shapes["tokens"] == (2, SEQ)
    s = step.summary()
    # on the meta device SDPA takes PyTorch's math path: bmm + _safe_softmax, no fused kernel
    assert s.op_classes["gemm"] > 0 and s.op_classes["reduction"] > 0 and s.flops > 0


# ------------------------------------------------------------------ bad input


def test_mesh_must_divide_world():
    with pytest.raises(FlintError, match="TP degree 3 does not divide world size 1024"):
        capture_step(factory("llama-tiny"), {"tokens": (8, 8), "labels": (8, 8)}, world_size=1024,
                     plan="fsdp+tp", tp=3)
    with pytest.raises(CaptureError, match="mesh_shape.*has 800 ranks, but world_size is 1024"):
        capture_step(factory("llama-tiny"), {"tokens": (8, 8), "labels": (8, 8)}, world_size=1024,
                     mesh_shape=(100, 8), mesh_axis_names=("dp_shard", "tp"), plan=lambda m, mesh: None)
    with pytest.raises(CaptureError, match="world_size: 16 does not match the plan's 8 ranks"):
        from flint.plan import Plan

        capture_step(factory("llama-tiny"), {"tokens": (8, 8), "labels": (8, 8)}, world_size=16,
                     plan=Plan.from_dict({"dp_shard": 8}))


def test_capture_refuses_plan_fields_it_does_not_implement():
    from flint.plan import Plan

    with pytest.raises(FlintError, match="plan field 'cp': capture does not support it yet"):
        capture_step(factory("llama-tiny"), {"tokens": (8, 8), "labels": (8, 8)},
                     plan=Plan.from_dict({"dp_shard": 2, "cp": 2}))


def test_heads_must_divide_tp():
    with pytest.raises(CaptureError, match="n_kv_heads.*not divisible.*16"):
        capture_step(factory("llama-tiny"), {"tokens": (8, 8), "labels": (8, 8)}, world_size=16, plan="tp")


def test_batch_must_divide_dp():
    with pytest.raises(CaptureError, match=r"batch_shapes\['tokens'\]\[0\]"):
        capture_step(factory("llama-tiny"), {"tokens": (12, 8), "labels": (12, 8)}, world_size=8, plan="fsdp")


class _Breaks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        torch._dynamo.graph_break()  # the user's offending line
        return y.sum()


@pytest.mark.slow
def test_graph_break_names_user_line():
    line = next(i for i, text in enumerate(inspect.getsource(_Breaks).splitlines())
                if "graph_break()" in text) + inspect.getsourcelines(_Breaks)[1]
    with pytest.raises(CaptureError, match="graph break") as err:
        capture_step(_Breaks, {"x": (2, 4)}, world_size=1, plan="dp")
    assert err.value.field == "model"
    assert err.value.source is not None and f"test_capture.py:{line}" in err.value.source
