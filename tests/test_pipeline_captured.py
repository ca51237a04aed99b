"""The captured way into pipeline parallelism: the user's torch.distributed.pipelining stages and schedule
(flint/capture/pipeline.py), against the planned path (pipeline-split of the zoo model under the same plan)."""

from __future__ import annotations

import contextlib
import io
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from xdsl.context import Context

from flint.capture import CaptureError, capture_step
from flint.models import factory
from flint.plan import Plan

PP_FILE = Path(__file__).parent / "data" / "byom" / "pp_llama.py"
SEQ = 64


def _capture_cli(tmp_path: Path, name: str, dp: int, tp: int, *extra: str, lines: str = "") -> Path:
    """``flint capture`` (the CLI's entry point, in this process: no second torch import per capture); ``lines``:
    more plan fields."""
    from flint.tools.flint_cli import main

    plan_file, out = tmp_path / f"{name}.toml", tmp_path / f"{name}.mlir"
    plan_file.write_text(f"pp = 2\ndp_shard = {dp}\ntp = {tp}\n" + ("" if extra else "microbatches = 4\n") + lines)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["capture", "--model", "llama-tiny", "--world-size", str(2 * dp * tp), "--plan-file", str(plan_file),
                   "--batch-size", str(8 * dp), "--seq-len", str(SEQ), "--dtype", "float32", *extra, "-o", str(out)])
    assert rc == 0, err.getvalue()
    return out


def _per_rank(module):
    """Per pipeline rank: FLOPs, communication nodes (kind, type, bytes, tag, peer) of the emitted trace."""
    from flint.chakra.from_ir import trace_from_ir
    from flint.passes.lower_to_chakra import LowerToChakraPass
    from flint.trace import NodeKind

    LowerToChakraPass(device="h100-sxm").apply(Context(), module)
    trace = trace_from_ir(module)
    out = []
    for rank, p in enumerate(trace.ranks):
        t = p.table
        comm = np.nonzero(t.kind != NodeKind.COMP)[0]
        peers = [int(p.peer_ranks[s]) if p.peer_ranks is not None and s >= 0 else int(s)
                 for s in t.comm_peer[comm].tolist()]
        out.append((int(t.flops[t.flops > 0].sum()),
                    Counter(zip(t.kind[comm].tolist(), t.comm_type[comm].tolist(), t.comm_bytes[comm].tolist(),
                                t.comm_tag[comm].tolist(), peers))))
    return out


def order(module) -> list[list[tuple]]:
    """Each pipeline rank's schedule entries, the user's stage parts named as the zoo's."""
    from flint.ir.aten import STAGE_SCHEDULES_ATTR

    names = {"first_stage": "embed", "last_stage": "head"}
    out = []
    for role in module.attributes[STAGE_SCHEDULES_ATTR].data:
        entries = []
        for e in role.data:
            name = e.data[0].data
            for mine, zoo in names.items():
                name = name.replace(mine, zoo)
            entries.append((name, e.data[1].value.data, str(e.data[2]) if len(e.data) > 2 else ""))
        out.append(entries)
    return out


@pytest.mark.slow
def test_user_pipeline_stages_capture_like_the_planned_split(tmp_path):
    """Llama-tiny, dp_shard 2 x tp 2 x pp 2 (8 ranks), 1F1B over 4 microbatches: the user's
    PipelineStages (torchtitan's TP plan, then FSDP2 on the embedding, every block and [norm, output])
    + Schedule1F1B (tests/data/byom/pp_llama.py) give the planned pipeline-split's FLOPs per rank,
    communication nodes (send/recv bytes, tags and peers; TP all-reduces, FSDP gathers and
    reduce-scatters) and action order."""
    from flint.ir.parse import load_ir

    captured = load_ir(str(_capture_cli(tmp_path, "captured", 2, 2, "--parallelize",
                                        f"{PP_FILE}:pipeline_fsdp_tp")))
    planned = load_ir(str(_capture_cli(tmp_path, "planned", 2, 2)))
    assert captured.attributes["flint.pipeline"] == planned.attributes["flint.pipeline"]
    assert order(captured) == order(planned)
    got, want = _per_rank(captured), _per_rank(planned)
    assert len(got) == 8 and all(r[0] > 0 for r in got)
    assert got == want
    for r in got:  # every rank: 4 microbatches x (activation, gradient), 2 x 64 x 256 float32 each
        p2p = [k for k in r[1].elements() if k[0] in (5, 6)]  # SEND / RECV
        assert len(p2p) == 8 and {k[2] for k in p2p} == {2 * SEQ * 256 * 4}
    types = {k[1] for k in got[0][1] if k[0] == 7}  # COLL: TP all-reduces, FSDP gathers and reduce-scatters
    assert {0, 2, 7} <= types, types


@pytest.mark.slow
def test_user_pipeline_clips_like_the_planned_split(tmp_path):
    """Gradient-norm clipping (max_norm) with the user's PipelineStages + Schedule1F1B (FSDP 2 x PP 2): each
    pipeline rank runs its stages' norms, @grad_clip (all-reduces over dp_shard, then pp) and its optimizers, as
    the zoo model's pipeline does; the same communication nodes per rank."""
    from flint.ir.parse import load_ir

    captured = load_ir(str(_capture_cli(tmp_path, "captured", 2, 1, "--parallelize", f"{PP_FILE}:pipeline_fsdp",
                                        lines="max_norm = 1.0\n")))
    planned = load_ir(str(_capture_cli(tmp_path, "planned", 2, 1, lines="max_norm = 1.0\n")))
    assert order(captured) == order(planned)
    for entries in order(captured):
        names = [n for n, _, _ in entries]
        assert names.index("grad_clip") == names.index(next(n for n in names if n.endswith("_optim"))) - 1
    got, want = _per_rank(captured), _per_rank(planned)
    assert got == want
    for r in got:  # the clip's two all-reduces (COLL type 0) of one fp32 value
        assert sum(n for k, n in r[1].items() if k[0] == 7 and k[1] == 0 and k[2] == 4) == 2


def _build(static: bool, result: str = "schedule"):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from flint.capture.byom import load_user_module

    user = load_user_module(str(PP_FILE), "--parallelize")
    Stage, loss_fn = user.Stage, user.loss_fn

    def pipeline(model, mesh):
        pp = mesh["pp"]
        rank = pp.get_local_rank()
        kw = {}
        if static:
            kw = dict(input_args=torch.empty(2, SEQ, dtype=torch.int64, device="meta") if rank == 0
                      else torch.empty(2, SEQ, 256, device="meta"),
                      output_args=torch.empty(2, SEQ, 256, device="meta") if rank == 0
                      else torch.empty(2, SEQ, 1024, device="meta"))
        stage = PipelineStage(Stage(model, rank, rank + 1, rank == 0, rank == 1), rank, 2, torch.device("meta"),
                              group=pp.get_group(), **kw)
        return stage if result == "stage" else Schedule1F1B(stage, 4, loss_fn=loss_fn)
    return pipeline


@pytest.mark.parametrize("static,result,message", [
    (False, "schedule", "stage 0: give every PipelineStage static input_args and output_args"),
    (True, "stage", "must return the torch.distributed.pipelining schedule it builds"),
])
def test_user_pipeline_refusals(static, result, message):
    with pytest.raises(CaptureError, match=message):
        capture_step(factory("llama-tiny"), {"tokens": (8, SEQ), "labels": (8, SEQ)}, plan=Plan.from_dict({"pp": 2}),
                     parallelize=_build(static, result))


class _GatedBlock(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return h + self.lin(h) * gate


class _Gated(torch.nn.Module):
    """Blocks that read a second tensor with a gradient: a gate the first stage computes from the embedding."""

    def __init__(self, vocab: int = 64, dim: int = 32, n: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.gate = torch.nn.Linear(dim, dim)
        self.layers = torch.nn.ModuleList(_GatedBlock(dim) for _ in range(n))
        self.out = torch.nn.Linear(dim, vocab)


class _GatedStage(torch.nn.Module):
    def __init__(self, model: _Gated, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.embed, self.gate = (model.embed, model.gate) if first else (None, None)
        self.layers = torch.nn.ModuleList(model.layers[lo:hi])
        self.out = model.out if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        gate = self.gate(h) if self.gate is not None else h.sigmoid()
        for layer in self.layers:
            h = layer(h, gate)
        return self.out(h) if self.out is not None else h


class _UnusedStage(_GatedStage):
    """The gate computed and not read: the blocks take the hidden state only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers:
            h = layer(h, torch.ones_like(h))
        return self.out(h) if self.out is not None else h


@pytest.mark.parametrize("stage,message", [
    # the first and last stages are captured with their blocks passed through; a block input besides the hidden
    # state that needs a gradient would be left unread, and the first stage's gate GEMM would drop out of the
    # step (before this check the capture succeeded without it)
    (_GatedStage, r"stage 0's blocks cannot be passed through in its capture: _GatedBlock.forward's 'gate' needs "
                  r"a gradient"),
    # a stage parameter the loss does not depend on (as on the generic path)
    (_UnusedStage, r"part 'first_stage' gives no gradient to 2 parameter\(s\): gate.weight, gate.bias"),
])
def test_user_pipeline_stage_that_would_lose_a_gradient_is_refused(stage, message):
    with pytest.raises(CaptureError, match=message):
        capture_step(_Gated, {"tokens": (4, 8), "labels": (4, 8)}, plan=Plan.from_dict({"pp": 2}),
                     parallelize=_two_stages(stage))


def _two_stages(stage):
    """A pipeline function: ``stage`` over _Gated's blocks 0-1 on pipeline rank 0, 2-3 on rank 1, 1F1B."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    def pipeline(model, mesh):
        pp = mesh["pp"]
        rank = pp.get_local_rank()
        io = dict(input_args=torch.empty(2, 8, dtype=torch.int64, device="meta") if rank == 0
                  else torch.empty(2, 8, 32, device="meta"),
                  output_args=torch.empty(2, 8, 32 if rank == 0 else 64, device="meta"))
        module = stage(model, 2 * rank, 2 * rank + 2, rank == 0, rank == 1)
        return Schedule1F1B(PipelineStage(module, rank, 2, torch.device("meta"), group=pp.get_group(), **io), 2,
                            loss_fn=lambda logits, y: torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                                                        y.flatten()))
    return pipeline


class _CheckpointedOnRank1(_GatedStage):
    """Blocks that read the hidden state only; the pipeline function checkpoints the second stage's blocks."""

    def __init__(self, model: _Gated, lo: int, hi: int, first: bool, last: bool) -> None:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        super().__init__(model, lo, hi, first, last)
        self.gate = None
        if not first:
            self.layers = torch.nn.ModuleList(checkpoint_wrapper(b, preserve_rng_state=False) for b in self.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers:
            h = layer(h, 1.0)
        return self.out(h) if self.out is not None else h


def test_user_pipeline_blocks_treated_differently_are_refused():
    """One block body stands for every stage's blocks: before this check, stage 1's checkpointing was dropped
    (stage 0's plain block repeated for all)."""
    with pytest.raises(CaptureError, match=r"stage 1's block 0 and stage 0's block 0 differ in activation "
                                           r"checkpointing: Flint's pipeline capture repeats one block body"):
        capture_step(_Gated, {"tokens": (4, 8), "labels": (4, 8)}, plan=Plan.from_dict({"pp": 2}),
                     parallelize=_two_stages(_CheckpointedOnRank1))
