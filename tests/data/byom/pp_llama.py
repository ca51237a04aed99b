"""A pipeline-parallel training script's stage builder, torchtitan style, for ``flint capture --parallelize``.

Every rank builds the PipelineStage it runs (stages on the meta device with static input and output shapes:
one microbatch) and the schedule over them, exactly as it would before ``schedule.step(tokens, target=labels)``.
Microbatch shape and count: the environment variables below (defaults: 2 sequences of 64 tokens, 4 microbatches).
"""

import os

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

MICROBATCH = int(os.environ.get("PP_MICROBATCH", "2"))
SEQ = int(os.environ.get("PP_SEQ", "64"))
N_MICROBATCHES = int(os.environ.get("PP_MICROBATCHES", "4"))


class Stage(nn.Module):
    """Layers [lo, hi) of a zoo Llama, with the embedding on the first stage and norm + output on the last."""

    def __init__(self, model: nn.Module, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.tok_embeddings = model.embed.tok_embeddings if first else None
        self.layers = nn.ModuleList(model.layers[lo:hi])
        self.norm = model.head.norm if last else None
        self.output = model.head.output if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)) if self.output is not None else h


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logp = nn.functional.log_softmax(logits.float(), dim=-1)
    return -logp.gather(-1, labels.unsqueeze(-1)).mean()


def pipeline(model: nn.Module, mesh, fsdp: bool = False, tp: bool = False) -> Schedule1F1B:
    pp = mesh["pp"]
    rank, n = pp.get_local_rank(), pp.size()
    per = len(model.layers) // n
    first, last = rank == 0, rank == n - 1
    dim = model.config.dim
    dtype = next(model.parameters()).dtype
    module = Stage(model, rank * per, (rank + 1) * per, first, last)
    if tp:  # torchtitan's Llama plan (no sequence parallelism), before FSDP
        t = mesh["tp"]
        if first:
            parallelize_module(module, t, {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(),
                                                                             output_layouts=Replicate())})
        for layer in module.layers:
            parallelize_module(layer, t, {
                **{f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")},
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "attention.wo": RowwiseParallel(), "feed_forward.w2": RowwiseParallel()})
        if last:
            parallelize_module(module, t, {"output": ColwiseParallel(output_layouts=Replicate())})
    if fsdp:  # torchtitan's grouping: the embedding, every block, [norm, output]
        dp = mesh["dp_shard"]
        if first:
            fully_shard(module.tok_embeddings, mesh=dp)
        for layer in module.layers:
            fully_shard(layer, mesh=dp)
        if last:
            fully_shard([module.norm, module.output], mesh=dp, reshard_after_forward=False)  # as torchtitan
    tokens = torch.empty(MICROBATCH, SEQ, dtype=torch.int64, device="meta")
    hidden = torch.empty(MICROBATCH, SEQ, dim, dtype=dtype, device="meta")
    logits = torch.empty(MICROBATCH, SEQ, model.config.vocab_size, dtype=dtype, device="meta")
    stage = PipelineStage(module, rank, n, torch.device("meta"), input_args=tokens if first else hidden,
                          output_args=logits if last else hidden, group=pp.get_group())
    return Schedule1F1B(stage, n_microbatches=N_MICROBATCHES, loss_fn=loss_fn)


def pipeline_fsdp(model: nn.Module, mesh) -> Schedule1F1B:
    """The same stages with FSDP2 over the ``dp_shard`` axis."""
    return pipeline(model, mesh, fsdp=True)


def pipeline_fsdp_tp(model: nn.Module, mesh) -> Schedule1F1B:
    """The same stages with tensor parallelism over ``tp`` and FSDP2 over ``dp_shard``."""
    return pipeline(model, mesh, fsdp=True, tp=True)
