"""Activation checkpointing (torchtitan's modes) in capture: the recompute in the backward graph,
the activation memory it saves, the two block roles of selective-layer, and bad input."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch import nn

from flint.capture import capture_step, opclass
from flint.ir.aten import get_schedule
from flint.models import factory
from flint.plan import Plan, PlanError, from_recipe
from flint.sim.lifetimes import step_memory
from tests.captures import SEQ, captured_ac


def _flops(graph) -> int:
    return sum(opclass.node_flops(n) for n in graph.nodes())


def _mm(graph) -> int:
    return sum(1 for n in graph.nodes() if n.target == torch.ops.aten.mm.default)


def _gathers(graph) -> int:
    return sum(1 for n in graph.nodes() if opclass.classify_aten(n.target) == opclass.ALL_GATHER)


def _block_flops(step, phase: str) -> int:
    return sum(_flops(getattr(p, phase)) * p.repeat for p in step.parts if p.name.startswith("block"))


def _activations(module) -> int:
    return step_memory(module).report.category_peak_bytes["activations"]


def _recomputed_flops(fwd, keep) -> int:
    """FLOPs of the forward ops a backward must rerun: the ancestors of what the un-checkpointed
    forward saves for backward, stopping at the values ``keep`` says are saved."""
    out = next(n for n in fwd.gm.graph.nodes if n.op == "output")
    seen, stack = set(), [v for v in out.args[0][1:] if isinstance(v, torch.fx.Node)]
    while stack:
        node = stack.pop()
        if node in seen or node.op != "call_function" or keep(node):
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return sum(opclass.node_flops(n) for n in seen)


def test_full_recomputes_the_block_forward():
    none, _ = captured_ac("none")
    full, _ = captured_ac("full")
    block = none.part("block")
    assert _block_flops(full, "fwd") == _block_flops(none, "fwd")
    extra = _flops(full.part("block").bwd) - _flops(block.bwd)
    # everything the backward reads is recomputed: the forward up to its last saved value (the
    # output projection feeds only the residual add, which backward never reads)
    assert extra == _recomputed_flops(block.fwd, lambda n: False)
    assert _mm(full.part("block").bwd) == _mm(block.bwd) + _mm(block.fwd) - 1
    assert full.summary().flops - none.summary().flops == extra * block.repeat
    # FSDP's gathers stay in their own MUST_RECOMPUTE region: re-gathered in backward under every mode
    assert _gathers(full.part("block").bwd) == _gathers(block.bwd) == _gathers(block.fwd) == 1


def test_selective_op_recomputes_what_torchtitans_policy_does_not_save():
    none, _ = captured_ac("none")
    sac, _ = captured_ac("selective-op")
    block = none.part("block")
    mms = [n for n in block.fwd.nodes() if n.target == torch.ops.aten.mm.default]
    saved = {n for i, n in enumerate(mms) if i % 2 == 0}  # every mm but each second one
    saved |= {n for n in block.fwd.nodes() if "flash_attention" in str(n.target)}
    extra = _flops(sac.part("block").bwd) - _flops(block.bwd)
    assert extra == _recomputed_flops(block.fwd, lambda n: n in saved)
    assert 0 < extra < _recomputed_flops(block.fwd, lambda n: False)
    # the attention kernel is saved, never rerun in backward
    assert not any("flash_attention" in str(n.target) and "backward" not in str(n.target)
                   for n in sac.part("block").bwd.nodes())
    assert _gathers(sac.part("block").bwd) == _gathers(block.bwd) == 1


def test_selective_layer_two_block_roles():
    none, _ = captured_ac("none")
    full, _ = captured_ac("full")
    layer, module = captured_ac("selective-layer", 2)
    n_layers = none.part("block").repeat
    roles = {p.name: p.repeat for p in layer.parts}
    assert roles == {"embed": 1, "block": n_layers - n_layers // 2, "block_ac": n_layers // 2, "head": 1}
    assert _flops(layer.part("block").bwd) == _flops(none.part("block").bwd)
    assert _flops(layer.part("block_ac").bwd) == _flops(full.part("block").bwd)
    extra = layer.summary().flops - none.summary().flops
    assert extra * n_layers == (full.summary().flops - none.summary().flops) * (n_layers // 2)
    # the schedule repeats each body, never unrolled per layer
    assert ("block_ac_bwd", n_layers // 2) in get_schedule(module)
    assert ("block_fwd", n_layers - n_layers // 2) in get_schedule(module)


def test_activation_memory_drops_per_mode():
    acts = {mode: _activations(captured_ac(mode)[1]) for mode in ("none", "selective-op", "full")}
    assert acts["full"] < acts["selective-op"] < acts["none"]
    assert acts["full"] < _activations(captured_ac("selective-layer", 2)[1]) < acts["none"]


def test_ac_without_data_parallelism():
    none, _ = captured_ac("none", plan="dp", world=1)
    full, _ = captured_ac("full", plan="dp", world=1)
    extra = _flops(full.part("block").bwd) - _flops(none.part("block").bwd)
    assert extra == _recomputed_flops(none.part("block").fwd, lambda n: False) > 0


class _NoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([nn.LayerNorm(8) for _ in range(2)])
        self.head = nn.LayerNorm(8)

    def forward(self, tokens):  # pragma: no cover - refused before it runs
        return self.head(self.layers[1](self.layers[0](self.embed(tokens))))


def test_ac_on_blocks_without_linear_layers_is_refused():
    plan = dataclasses.replace(Plan(world_size=1), activation_checkpoint="full")
    with pytest.raises(PlanError, match="activation_checkpoint.*without linear layers"):
        capture_step(_NoLinear, {"tokens": (2, SEQ), "labels": (2, SEQ)}, plan=plan)


def test_ac_without_block_stack_is_refused():
    plan = dataclasses.replace(Plan(world_size=1), activation_checkpoint="selective-op")
    with pytest.raises(PlanError, match="activation_checkpoint.*no layers to checkpoint"):
        capture_step(lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), {"x": (2, 8)}, plan=plan)


def test_ac_every_beyond_the_layers_is_refused():
    plan = dataclasses.replace(from_recipe("dp", 1), activation_checkpoint="selective-layer", ac_every=99)
    with pytest.raises(PlanError, match="ac_every"):
        capture_step(factory("llama-tiny"), {"tokens": (2, SEQ), "labels": (2, SEQ)}, plan=plan)


@functools.cache
def _pipelined(mode: str, layers: int = 4):
    plan = Plan(dp_shard=2, pp=2, microbatches=2, activation_checkpoint=mode,
                ac_every=2 if mode == "selective-layer" else 1).validate()
    return capture_step(factory("llama-tiny", n_layers=layers), {"tokens": (4, SEQ), "labels": (4, SEQ)}, plan=plan)


def test_selective_layer_with_pipeline_stages():
    """Every 2nd block with pp = 2: the repeated block is the pattern (a plain block, then a checkpointed one),
    whole patterns per stage, torchtitan's per-rank count; half of full's recompute. Was refused."""
    none, sel, full = _pipelined("none"), _pipelined("selective-layer"), _pipelined("full")
    assert [(p.name, p.repeat) for p in sel.parts] == [("embed", 1), ("block", 2), ("head", 1)]
    assert sel.plan.pp_layers == (1, 1)  # pipeline-split counts patterns: 2 layers per stage
    assert {p.name for p in sel.part("block").params} == {p.name.replace("layers.0.", f"layers.{i}.")
                                                         for p in none.part("block").params for i in (0, 1)}
    extra = full.summary().flops - none.summary().flops
    assert sel.summary().flops - none.summary().flops == extra // 2 > 0


def test_selective_layer_with_stages_of_part_of_a_pattern_is_refused():
    plan = Plan(dp_shard=1, pp=2, microbatches=2, activation_checkpoint="selective-layer", ac_every=2).validate()
    with pytest.raises(PlanError, match=r"stages of 3, 3 layers: a stage holds whole repeats of the 2-layer pattern.*"
                                        r"\(e\.g\. pp_layers = \[4, 2\]\)") as e:
        capture_step(factory("llama-tiny", n_layers=6), {"tokens": (2, SEQ), "labels": (2, SEQ)}, plan=plan)
    assert e.value.field == "ac_every"


def test_selective_op_under_sequence_parallelism_saves_the_reduce_scatter():
    # torchtitan saves reduce_scatter_tensor: backward reads its (waited) result, never re-runs it
    def count(step, phase, cls):
        graph = getattr(step.part("block"), phase)
        return sum(1 for n in graph.nodes() if opclass.classify_aten(n.target) == cls)

    none, _ = captured_ac("none", plan="fsdp+tp+sp", world=4, tp=2)
    sac, module = captured_ac("selective-op", plan="fsdp+tp+sp", world=4, tp=2)
    assert count(sac, "fwd", opclass.REDUCE_SCATTER) == count(none, "fwd", opclass.REDUCE_SCATTER) > 0
    assert count(sac, "bwd", opclass.REDUCE_SCATTER) == count(none, "bwd", opclass.REDUCE_SCATTER)
    # the SP all-gathers are not in the save list: recomputed
    assert count(sac, "bwd", opclass.ALL_GATHER) > count(none, "bwd", opclass.ALL_GATHER)
    assert _activations(module) < _activations(captured_ac("none", plan="fsdp+tp+sp", world=4, tp=2)[1])


# ------------------------------------------------------- the generic path (any nn.Module)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, h):
        return h + self.down(torch.nn.functional.gelu(self.up(h)))


class _BlockStack(nn.Module):
    """A plain model (not a StagedLM): input projection, a ModuleList of identical blocks, output."""

    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList([_Block() for _ in range(layers)])
        self.out = nn.Linear(32, 10)

    def forward(self, x, target):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return torch.nn.functional.cross_entropy(self.out(h), target)


@functools.cache
def _generic(mode: str, plan: str = "fsdp", world: int = 2, layers: int = 3, every: int = 1):
    p = dataclasses.replace(from_recipe(plan, world), activation_checkpoint=mode, ac_every=every)
    return capture_step(functools.partial(_BlockStack, layers), {"x": (8, 16), "target": (8,)}, plan=p)


def _gemm_flops(graph) -> int:
    return sum(opclass.node_flops(n) for n in graph.nodes() if opclass.classify_aten(n.target) == opclass.GEMM)


@pytest.mark.parametrize("plan,world", [("fsdp", 2), pytest.param("dp", 1, marks=pytest.mark.slow)])
def test_generic_path_full_recomputes_the_block_forward(plan, world):
    none, full = _generic("none", plan, world), _generic("full", plan, world)
    # without data-parallel groups the work outside the blocks is split where it runs; under fsdp one root group
    # holds the input and output layers, gathered once for both: one part
    outside = ["first_stage", "last_stage"] if plan == "dp" else ["model"]
    assert [(p.name, p.repeat) for p in full.parts if p.name != "block"] == [(n, 1) for n in outside]
    assert full.part("block").repeat == 3
    block = none.part("block")
    # the block's two GEMMs rerun in backward (the second one's output is read by backward only through
    # the residual add, so only `up` is needed again: gelu's backward reads up's output)
    extra = _flops(full.part("block").bwd) - _flops(block.bwd)
    assert extra == _recomputed_flops(block.fwd, lambda n: False) > 0
    assert _gemm_flops(full.part("block").bwd) - _gemm_flops(block.bwd) == 2 * (8 // world) * 32 * 64
    assert all("_checkpoint_wrapped_module" not in p.name for p in full.part("block").params)
    for name in outside:  # outside the blocks: no change
        assert _flops(full.part(name).bwd) == _flops(none.part(name).bwd)
    assert full.summary().flops - none.summary().flops == extra * 3


@pytest.mark.slow
def test_generic_path_selective_op_saves_the_policy_list():
    none, sac = _generic("none"), _generic("selective-op")
    # nn.Linear with a bias is addmm, which torchtitan's list (aten.mm) does not save: everything reruns
    extra = _flops(sac.part("block").bwd) - _flops(none.part("block").bwd)
    assert extra == _recomputed_flops(none.part("block").fwd, lambda n: False) > 0


def _one_layers_recompute() -> int:
    """The FLOPs full checkpointing adds per block (3 blocks, every one checkpointed)."""
    return (_generic("full").summary().flops - _generic("none").summary().flops) // 3


@pytest.mark.parametrize("layers", [4, 5])
def test_generic_path_selective_layer_every_second_block(layers):
    """The repeated block is two layers, the second checkpointed; a 5th layer (plain) runs in the model part.
    Before, the stack repeated layer 0 (plain) and the step had no recompute at all."""
    none, sel = _generic("none", layers=layers), _generic("selective-layer", layers=layers, every=2)
    assert [(p.name, p.repeat) for p in sel.parts] == [("model", 1), ("block", 2)]
    assert sel.summary().flops - none.summary().flops == 2 * _one_layers_recompute() > 0
    assert any("repeated block is 2 layers" in n and "activation checkpointing" in n for n in sel.notes)
    assert any("layer(s) 4 captured in the model part, after the repeated block (2 x 2 layer(s)): they do not make "
               "a whole repeat of its pattern" in n for n in sel.notes) == (layers == 5)
    # the model part holds the 5th layer's GEMMs: 2 forward (+ inp, out) when it is there
    assert _mm(sel.part("model").fwd) + sum(1 for n in sel.part("model").fwd.nodes()
                                            if n.target == torch.ops.aten.addmm.default) == 2 + 2 * (layers == 5)


def test_generic_path_selective_layer_with_pipeline_stages():
    """With pp = 2 the pattern is the repeated block, split by whole patterns, and the work outside the blocks
    runs on the first and the last stage (tests/test_pipeline_generic.py). Was refused."""
    def captured(mode: str):
        plan = Plan(dp_shard=2, pp=2, microbatches=2, activation_checkpoint=mode,
                    ac_every=2 if mode == "selective-layer" else 1).validate()
        return capture_step(functools.partial(_BlockStack, 4), {"x": (8, 16), "target": (8,)}, plan=plan)

    none, sel, full = captured("none"), captured("selective-layer"), captured("full")
    assert [(p.name, p.repeat) for p in sel.parts] == [("first_stage", 1), ("block", 2), ("last_stage", 1)]
    assert sel.summary().flops - none.summary().flops == (full.summary().flops - none.summary().flops) // 2 > 0


def _every_second_checkpointed(model, mesh):
    """A training script's own: every second block checkpointed, every block and the root fully sharded."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    for i, key in enumerate(list(model.blocks._modules)):
        if i % 2:
            model.blocks._modules[key] = checkpoint_wrapper(model.blocks._modules[key], preserve_rng_state=False)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _last_block_kept_gathered(model, mesh):
    """A training script's own: the last block not resharded after forward (its backward comes first)."""
    from torch.distributed.fsdp import fully_shard

    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=i < len(model.blocks) - 1)
    fully_shard(model, mesh=mesh)


@pytest.mark.slow
def test_own_parallelize_checkpointing_every_second_block():
    own = capture_step(functools.partial(_BlockStack, 4), {"x": (8, 16), "target": (8,)},
                       plan=_every_second_checkpointed, world_size=2)
    assert [(p.name, p.repeat) for p in own.parts] == [("model", 1), ("block", 2)]
    assert own.summary().flops == _generic("selective-layer", layers=4, every=2).summary().flops


@pytest.mark.slow
def test_own_parallelize_last_block_unresharded():
    """The last block runs in the model part, and backward re-gathers the other three only (before: all four)."""
    def captured(repeat: bool):
        return capture_step(functools.partial(_BlockStack, 4), {"x": (8, 16), "target": (8,)},
                            plan=_last_block_kept_gathered, world_size=2, repeat=repeat)

    rep, whole = captured(True), captured(False)
    assert [(p.name, p.repeat) for p in rep.parts] == [("model", 1), ("block", 3)]
    assert any("layer(s) 3 captured in the model part" in n and "data-parallel groups or their options" in n
               for n in rep.notes)
    gathers = lambda step: sum(_gathers(g) * p.repeat for p in step.parts for g in p.graphs())  # noqa: E731
    assert gathers(rep) == gathers(whole) == 5 + 3  # forward: root and 4 blocks; backward: blocks 0-2
    assert rep.summary().flops == whole.summary().flops


@pytest.mark.parametrize("kinds,period,expected", [
    ("aaaa", 1, (1, 4)),
    ("abab", 1, (2, 2)),
    ("ababa", 1, (2, 2)),      # the 5th layer outside the repeats
    ("aaab", 1, (1, 3)),       # the last one differs
    ("abcd", 1, (1, 1)),       # nothing repeats: captured whole
    ("abaabaab", 1, (3, 2)),
    ("abcdabcd", 2, (4, 2)),   # a multiple of the structure's period
    ("aabbaabb", 2, (4, 2)),
])
def test_repeating_pattern_of_what_parallelize_made(kinds, period, expected):
    from flint.capture.generic import _repeating

    assert _repeating(list(kinds), period) == expected


def test_generic_path_ac_with_own_parallelize_function_is_refused():
    p = dataclasses.replace(from_recipe("fsdp", 2), activation_checkpoint="full")
    with pytest.raises(PlanError, match="activation_checkpoint.*own parallelize"):
        capture_step(_BlockStack, {"x": (8, 16), "target": (8,)}, plan=p, parallelize=lambda model, mesh: None)
