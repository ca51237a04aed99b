"""Megatron's distributed optimizer as FSDP2 runs it: ZeRO-2 (``zero = 2``, ``reshard_after_forward=False``),
fp32 master parameters gathered in bf16 (``param_dtype``), gradients reduce-scattered in fp32
(``reduce_dtype``), gathered once and reduced once per step under gradient accumulation."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from captures import SEQ, distributed_optimizer
from torch.utils._python_dispatch import TorchDispatchMode

from flint.models import build, config
from flint.plan import Plan, PlanError

# gpt2-tiny (dim 128, ffn 512, vocab 512, 128 positions, 2 blocks), by hand: a block is two LayerNorms
# (2 x 2 x 128), wq / wk / wv / wo (4 x (128 x 128 + 128)), w1 (128 x 512 + 512) and w2 (512 x 128 + 128)
CFG = config("gpt2-tiny")
BLOCK = 2 * 2 * 128 + 4 * (128 * 128 + 128) + (128 * 512 + 512) + (512 * 128 + 128)
EMBED = 512 * 128 + 128 * 128  # tokens, learned positions
HEAD = 2 * 128 + 512 * 128  # final LayerNorm, untied output
PARAMS = EMBED + 2 * BLOCK + HEAD
GROUPS = 4  # FSDP units: embed, two blocks, head


def test_parameter_count_by_hand_is_the_models():
    assert (CFG.dim, CFG.ffn_dim, CFG.vocab_size, CFG.max_seq_len, CFG.n_layers) == (128, 512, 512, 128, 2)
    assert PARAMS == sum(p.numel() for p in build("gpt2-tiny").parameters()) == 544256


# ------------------------------------------------------------------------------------------------- plan


def test_plan_fields_validated_and_named():
    plan = Plan.from_dict({"dp_shard": 8, "zero": 2, "reduce_dtype": "float32", "param_dtype": "bfloat16"})
    assert Plan.from_dict(plan.to_dict()) == plan
    assert "params gathered in bfloat16, grads reduced in float32" in plan.describe()
    with pytest.raises(PlanError, match="plan field 'reduce_dtype': unknown dtype 'fp32'; known: param, float32"):
        Plan.from_dict({"dp_shard": 8, "reduce_dtype": "fp32"})
    with pytest.raises(PlanError, match="'reduce_dtype': 'float32' is the dtype of the data-parallel gradient "
                                        "reduction; this plan has no data parallelism"):
        Plan.from_dict({"tp": 2, "reduce_dtype": "float32"})
    with pytest.raises(PlanError, match="'param_dtype': 'bfloat16' is the dtype FSDP all-gathers parameters in"):
        Plan.from_dict({"dp_replicate": 2, "param_dtype": "bfloat16"})
    with pytest.raises(PlanError, match="'reduce_dtype': must be a string"):
        Plan.from_dict({"dp_shard": 2, "reduce_dtype": 32})


def test_capture_refuses_zero_stages_it_does_not_implement():
    from flint.capture.recipes import check_zero

    with pytest.raises(PlanError, match="plan field 'zero': capture implements ZeRO-2 .* and ZeRO-3 .*ZeRO-1"):
        check_zero(Plan.from_dict({"dp_shard": 4, "zero": 1}))
    with pytest.raises(PlanError, match="plan field 'zero': ZeRO-2 shards over dp_shard; this plan has dp_shard = 1"):
        check_zero(Plan.from_dict({"dp_replicate": 4, "zero": 2}))
    check_zero(Plan.from_dict({"dp_shard": 4, "zero": 2}))


def test_shard_expand_refuses_the_dtypes():
    """The planned path (flint expand) does not implement them: refused by name, not ignored."""
    from flint.passes.shard_annotate import EXPAND_FIELDS

    with pytest.raises(PlanError, match="plan field 'reduce_dtype': .* does not support it yet"):
        Plan.from_dict({"dp_shard": 2, "reduce_dtype": "float32"}).require(EXPAND_FIELDS, "shard-expand")


# ---------------------------------------------------------------------------------------------- capture


def test_captured_collectives_gather_bf16_reduce_fp32():
    """Per micro-batch step as captured: one bf16 gather per FSDP unit in forward, none in backward (ZeRO-2),
    one fp32 reduce-scatter of the unsharded gradient per unit; the optimizer steps fp32 shards."""
    step, _ = distributed_optimizer()
    s = step.summary()
    fwd_ag, rs = ("all_gather", ("dp_shard",), "fwd"), ("reduce_scatter", ("dp_shard",), "bwd")
    assert set(s.collectives) == {fwd_ag, rs}
    assert s.collectives[fwd_ag] == s.collectives[rs] == GROUPS
    assert s.collective_bytes[fwd_ag] == 2 * PARAMS // 2  # bf16 shard in: half the parameters, 2 bytes each
    assert s.collective_bytes[rs] == 4 * PARAMS  # fp32 unsharded gradient in
    shards = [r for p in step.parts for r in p.optim.roles.values() if r.kind in ("parameter", "gradient")]
    assert {r.dtype for r in shards} == {torch.float32}


def _lowered(reduce_dtype: str = "float32"):
    from xdsl.context import Context

    from flint.passes.lower_to_chakra import LowerToChakraPass
    from flint.schedule.pipelines import run_pipeline

    _, module = distributed_optimizer(reduce_dtype)
    m = module.clone()
    run_pipeline(m, "reorder-all-gather{prefetch=1},sink-waits,assign-streams{data-parallel=dp}")
    LowerToChakraPass(device="h100-sxm").apply(Context(), m)
    return m


def test_lowered_step_gathers_once_and_reduces_once_per_step():
    """Two micro-batches: the gathers run in the first one's forward only (the parameters stay gathered:
    torch pipelining's set_reshard_after_backward(False)), the reduce-scatters in the last one's backward
    only (set_requires_gradient_sync(False) before), all on the data-parallel stream."""
    from flint.chakra.from_ir import trace_from_ir
    from flint.trace import CollKind

    table = trace_from_ir(_lowered()).ranks[0].table
    count, nbytes, streams = Counter(), Counter(), set()
    for i, (kind, b) in enumerate(zip(table.comm_type, table.comm_bytes)):
        if kind >= 0:
            count[CollKind(kind)] += 1
            nbytes[CollKind(kind)] += int(b)
            streams.add(table.stream_names[table.comm_stream[i]])
    assert count == {CollKind.ALL_GATHER: GROUPS, CollKind.REDUCE_SCATTER: GROUPS}
    assert nbytes[CollKind.ALL_GATHER] == PARAMS  # half the parameters in bf16, once per step
    assert nbytes[CollKind.REDUCE_SCATTER] == 4 * PARAMS  # all the gradients in fp32, once per step
    assert streams == {"dp"}


def test_memory_holds_the_fp32_gradient_while_accumulating():
    """FSDP2 accumulates the unsharded gradient in reduce_dtype until the last micro-batch's
    reduce-scatter (Megatron: its fp32 grad buffer): the memory model's gradients peak at 4 bytes per
    parameter, plus fp32 gradient shards of the last micro-batch; the parameters are fp32 master shards."""
    from flint.sim.lifetimes import step_memory

    peak = step_memory(distributed_optimizer("float32")[1]).report.category_peak_bytes
    assert peak["params"] == 4 * PARAMS // 2
    assert 4 * PARAMS <= peak["grads"] < 4 * PARAMS + 4 * PARAMS // 2


@pytest.mark.slow
def test_memory_fp32_reduction_costs_two_bytes_per_parameter_more():
    from flint.sim.lifetimes import step_memory

    fp32 = step_memory(distributed_optimizer("float32")[1]).report.category_peak_bytes["grads"]
    bf16 = step_memory(distributed_optimizer("bfloat16")[1]).report.category_peak_bytes["grads"]
    assert fp32 - bf16 == 2 * PARAMS


# ------------------------------------------------------------------------------------- against FSDP2 eager


class _Collectives(TorchDispatchMode):
    """(kind, dtype, input numel) of every all-gather / reduce-scatter an eager run issues."""

    def __enter__(self):
        self.seen = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        kind = {"_allgather_base_": "all_gather", "all_gather_into_tensor": "all_gather",
                "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter"}.get(name)
        if kind is not None and func.namespace in ("c10d", "_c10d_functional"):
            t = args[1] if func.namespace == "c10d" else args[0]  # c10d: (output, input, ...)
            self.seen.append((kind, t.dtype, t.numel()))
        return func(*args, **(kwargs or {}))


@pytest.mark.slow
def test_lowered_bytes_equal_fsdp2_eager_with_mixed_precision_and_accumulation():
    """The real FSDP2 on 2 fake ranks, as torch's pipelining runs micro-batches: fully_shard per block
    with reshard_after_forward=False and MixedPrecisionPolicy(bfloat16, float32) on an fp32 model; the first
    micro-batch's backward without gradient sync or reshard. Its all-gathers and reduce-scatters, by dtype
    and size, are the lowered step's."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from flint.capture.fake_dist import device_mesh, fake_world

    with fake_world(2):
        mesh = device_mesh((2,), ("dp_shard",))
        torch.manual_seed(0)
        m = build("gpt2-tiny")
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for unit in (m.embed, *m.layers, m.head):
            fully_shard(unit, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
        fully_shard(m, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
        tokens = torch.zeros(2, SEQ, dtype=torch.long)
        with _Collectives() as rec:
            for last in (False, True):
                m.set_requires_gradient_sync(last)
                m.set_reshard_after_backward(last)
                m(tokens, tokens).backward()
    eager = Counter()
    for kind, dtype, numel in rec.seen:
        eager[kind, dtype] += numel * dtype.itemsize
    assert eager == {("all_gather", torch.bfloat16): PARAMS, ("reduce_scatter", torch.float32): 4 * PARAMS}
    assert Counter(k for k, _, _ in rec.seen) == {"all_gather": GROUPS, "reduce_scatter": GROUPS}


@pytest.mark.slow
def test_intercepted_fully_shard_reads_mp_policy_reduce_dtype():
    """The user's own fully_shard calls (generic path): MixedPrecisionPolicy(param_dtype, reduce_dtype) and
    reshard_after_forward=False give the same collectives as the plan's fields."""
    from flint.capture import capture_step
    from flint.models import factory

    def parallelize(model, mesh):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for unit in (model.embed, *model.layers, model.head):
            fully_shard(unit, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
        fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp)

    batch = (4, SEQ)
    step = capture_step(factory("gpt2-tiny"), {"tokens": batch, "labels": batch}, plan="fsdp", world_size=2,
                        parallelize=parallelize, dtype="float32")
    s = step.summary()
    ag = sum(b for (kind, _, phase), b in s.collective_bytes.items() if kind == "all_gather" and phase == "fwd")
    rs = sum(b for (kind, _, _), b in s.collective_bytes.items() if kind == "reduce_scatter")
    assert not any(kind == "all_gather" and phase == "bwd" for kind, _, phase in s.collectives)
    assert (ag, rs) == (PARAMS, 4 * PARAMS)


# --------------------------------------------------------------------------- under a pipeline (Megatron's chain)


def _pipelined(prefetch: bool, grad_wait: str = "part"):
    """pp = 2 x dp_shard = 2, two micro-batches, lowered (one table per pipeline rank) and simulated."""
    from xdsl.context import Context

    from flint.chakra.from_ir import mesh_of, trace_from_ir
    from flint.cost import load_device, load_network
    from flint.passes.lower_to_chakra import LowerToChakraPass
    from flint.schedule.pipelines import run_pipeline
    from flint.sim import simulate

    _, module = distributed_optimizer(pp=2)
    m = module.clone()
    run_pipeline(m, ("reorder-all-gather{prefetch=1}," if prefetch else "") + "sink-waits,"
                 "assign-streams{data-parallel=dp}")
    LowerToChakraPass(device="h100-sxm", grad_wait=grad_wait).apply(Context(), m)
    trace = trace_from_ir(m)
    return trace, simulate(trace, load_device("h100-sxm"), load_network("dgx-h100"), mesh_of(m))


def _dp_rows(table, kind):
    from flint.trace import NodeKind

    return [i for i in range(len(table)) if table.kind[i] == NodeKind.COLL and table.comm_type[i] == kind
            and table.stream_names[table.comm_stream[i]] == "dp"]


def _first_reader(table, row: int) -> int:
    from flint.trace import NodeKind

    return next(i for i in range(row + 1, len(table)) if table.kind[i] == NodeKind.COMP and row in table.data_deps(i))


def test_pipelined_parameter_gathers_chain_across_functions():
    """Each pipeline rank's forward gathering runs form one chain (Megatron numbers its gather handles across model
    chunks and each forward pre-hook dispatches the next): the second gather of a rank's step is issued before
    the first gather's reader, not when its own function starts. Same collectives, no longer an iteration."""
    from flint.trace import CollKind

    chained, fast = _pipelined(prefetch=True)
    plain, slow = _pipelined(prefetch=False)
    roles = {id(p.table): p.table for p in chained.ranks}
    assert len(roles) == 2  # one table per pipeline rank
    for table in roles.values():
        ag = _dp_rows(table, CollKind.ALL_GATHER)
        assert len(ag) == 2  # embedding + block on the first rank, block + head on the last
        assert ag[1] < _first_reader(table, ag[0])
    for table in {id(p.table): p.table for p in plain.ranks}.values():
        ag = _dp_rows(table, CollKind.ALL_GATHER)
        assert ag[1] > _first_reader(table, ag[0])

    def colls(trace):
        t = trace.ranks[0].table
        return sorted((int(k), int(b)) for k, b in zip(t.comm_type, t.comm_bytes) if k >= 0)

    assert colls(chained) == colls(plain)
    assert fast.iteration_time_us <= slow.iteration_time_us


def test_grad_wait_optimizer_waits_for_the_reductions_at_the_optimizer():
    """``lower-to-chakra{grad-wait=optimizer}`` (Megatron's finish_grad_sync): one compute node, the optimizer's
    first, waits for the data-parallel reduce-scatters a part leaves unwaited; with ``part`` the backward
    parts after them wait too. Nothing else changes, and the step is no longer."""
    from flint.trace import CollKind, NodeKind

    def waiters(trace):
        out = {}
        for p in trace.ranks:
            t = p.table
            rs = set(_dp_rows(t, CollKind.REDUCE_SCATTER))
            out[id(t)] = (len(rs), [i for i in range(len(t)) if t.kind[i] == NodeKind.COMP
                                    and rs & set(t.ctrl_deps(i).tolist())])
        return list(out.values())

    step_trace, step = _pipelined(prefetch=True, grad_wait="optimizer")
    part_trace, part = _pipelined(prefetch=True, grad_wait="part")
    assert all(n == 2 and len(w) == 1 for n, w in waiters(step_trace))
    assert any(len(w) > 1 for _, w in waiters(part_trace))
    assert step.iteration_time_us <= part.iteration_time_us
    assert sum(len(p.table) for p in step_trace.ranks) == sum(len(p.table) for p in part_trace.ranks)


def test_grad_wait_option_is_checked():
    from flint.errors import FlintError
    from flint.passes.lower_to_chakra import LowerToChakraPass

    with pytest.raises(FlintError, match='lower-to-chakra: option grad-wait="step" is not one of part, optimizer'):
        LowerToChakraPass(grad_wait="step")


def test_cli_grad_wait(tmp_path, capsys):
    """``flint estimate`` and ``flint emit`` take ``--grad-wait``; a trace or a lowered IR refuses it by name."""
    import json

    from flint.tools.flint_cli import main

    src = tmp_path / "step.mlir"
    src.write_text(str(distributed_optimizer(pp=2)[1]))
    times = {}
    for mode in ("part", "optimizer"):
        assert main(["estimate", str(src), "--grad-wait", mode, "--json"]) == 0
        times[mode] = json.loads(capsys.readouterr().out)["iteration_time_us"]
    assert times["optimizer"] <= times["part"]
    assert main(["emit", str(src), "-o", str(tmp_path / "t"), "--grad-wait", "optimizer"]) == 0
    capsys.readouterr()
    assert main(["estimate", str(tmp_path / "t" / "trace"), "--grad-wait", "optimizer"]) == 1
    assert "--grad-wait applies to step IR (.mlir)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["estimate", str(src), "--grad-wait", "later"])
    assert e.value.code == 2 and "invalid choice: 'later' (choose from" in capsys.readouterr().err
    for command in (["estimate", str(src)], ["emit", str(src), "-o", str(tmp_path / "u")]):  # the old name
        with pytest.raises(SystemExit) as e:
            main(command + ["--grad-sync", "step"])
        assert e.value.code == 2 and "--grad-sync is now --grad-wait" in capsys.readouterr().err
    assert not (tmp_path / "u").exists()


def test_generic_path_applies_zero_and_mixed_precision():
    """A model Flint has no recipe for (Hugging Face GPT-2, the generic path's preset fully_shard): the plan's
    zero = 2, param_dtype and reduce_dtype reach fully_shard (reshard_after_forward=False,
    MixedPrecisionPolicy), as on the recipe path: no backward gathers, bf16 gathers, fp32 reduce-scatters.
    (They were ignored: the preset called fully_shard(module, mesh=...) alone.)"""
    import os

    from flint.capture import capture_step
    from flint.capture.byom import user_function

    path = os.path.join(os.path.dirname(__file__), "data", "byom", "hf_models.py")
    fn, _ = user_function(f"{path}:gpt2", "--model", "model_factory", "a model factory")
    params = sum(p.numel() for p in fn().parameters())
    plan = Plan.from_dict({"dp_shard": 2, "zero": 2, "param_dtype": "bfloat16", "reduce_dtype": "float32"},
                          world_size=2)
    step = capture_step(fn, {"input_ids": (4, 32), "labels": (4, 32)}, plan=plan, dtype="float32")
    s = step.summary()
    assert {k for k in s.collectives if k[0] == "all_gather"} == {("all_gather", ("dp_shard",), "fwd")}
    assert s.collective_bytes["all_gather", ("dp_shard",), "fwd"] == 2 * params // 2  # bf16 half-shards
    assert s.collective_bytes["reduce_scatter", ("dp_shard",), "bwd"] == 4 * params  # fp32 gradients


def test_memory_model_follows_the_pipelined_gather_chain():
    """The memory model allocates a chained gather where lower-to-chakra issues it: on the first pipeline
    rank the block's bf16 gathered parameters (2 x BLOCK bytes) are live from the embedding's run on, and
    nothing else moves (ZeRO-2 keeps them for the step, so the peak is the same)."""
    import numpy as np

    from flint.schedule.pipelines import run_pipeline
    from flint.sim.lifetimes import step_memory

    _, module = distributed_optimizer(pp=2)
    live = {}
    for pipeline in ("sink-waits", "reorder-all-gather{prefetch=1},sink-waits"):
        m = module.clone()
        run_pipeline(m, pipeline)
        live[pipeline] = step_memory(m, None, 0).report
    plain, chained = live.values()
    diff = np.asarray(chained.live_bytes) - np.asarray(plain.live_bytes)
    moved = np.nonzero(diff)[0]
    assert set(diff[moved].tolist()) == {2 * BLOCK}
    assert moved[0] == 0 and np.all(np.diff(moved) == 1)  # from the step's start to the block's own gather
    assert chained.peak_bytes == plain.peak_bytes


def test_backward_gathers_stay_out_of_the_chain():
    """ZeRO-3 under a pipeline: only forward runs chain their gathers (a backward's are issued at its start,
    where FSDP2's pre-backward hook runs once the gradient has arrived). On the first pipeline rank, the
    gathers issued before the first backward recv are the forward ones (embedding + block, two micro-batches);
    the memory peak (in backward) does not move."""
    from xdsl.context import Context

    from flint.capture import capture_step
    from flint.chakra.from_ir import trace_from_ir
    from flint.importer import import_step
    from flint.models import factory
    from flint.passes.lower_to_chakra import LowerToChakraPass
    from flint.schedule.pipelines import run_pipeline
    from flint.sim.lifetimes import step_memory
    from flint.trace import CollKind, NodeKind

    plan = Plan.from_dict({"dp_shard": 2, "pp": 2, "zero": 3, "microbatches": 2}, world_size=4)
    module = import_step(capture_step(factory("gpt2-tiny"), {"tokens": (8, SEQ), "labels": (8, SEQ)}, plan=plan))
    peaks = []
    for pipeline in ("sink-waits", "reorder-all-gather{prefetch=1},sink-waits"):
        m = module.clone()
        run_pipeline(m, pipeline)
        peaks.append(step_memory(m, None, 0).report.peak_bytes)
        LowerToChakraPass().apply(Context(), m)
        t = trace_from_ir(m).ranks[0].table
        first_recv = next(i for i in range(len(t)) if t.kind[i] == NodeKind.RECV)
        ag = [i for i in range(len(t)) if t.kind[i] == NodeKind.COLL and t.comm_type[i] == CollKind.ALL_GATHER]
        assert len([i for i in ag if i < first_recv]) == 4
        assert len(ag) > 4  # the backward's re-gathers, after it
    assert peaks[0] == peaks[1]
