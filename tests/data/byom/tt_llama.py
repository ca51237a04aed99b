"""A Llama with torchtitan's module names and a parallelize function written as torchtitan's is.

``parallelize_llama`` below follows the structure of torchtitan's
``torchtitan/models/llama3/infra/parallelize.py`` (apply_tp, apply_ac,
apply_fsdp with a MixedPrecisionPolicy, blocks then [norm, output] then the
root), unchanged in the calls it makes; Flint runs it as is.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as ptd_checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

DIM, N_HEADS, N_KV, FFN, VOCAB, N_LAYERS = 64, 4, 2, 128, 256, 2


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = DIM // N_HEADS
        self.wq = nn.Linear(DIM, N_HEADS * self.head_dim, bias=False)
        self.wk = nn.Linear(DIM, N_KV * self.head_dim, bias=False)
        self.wv = nn.Linear(DIM, N_KV * self.head_dim, bias=False)
        self.wo = nn.Linear(N_HEADS * self.head_dim, DIM, bias=False)

    def forward(self, x, freqs):
        bs, seq, _ = x.shape
        q = self.wq(x).view(bs, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bs, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bs, seq, -1, self.head_dim).transpose(1, 2)
        q = q * freqs[:seq].view(1, 1, seq, -1)
        k = k * freqs[:seq].view(1, 1, seq, -1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, FFN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = Attention()
        self.feed_forward = FeedForward()
        self.attention_norm = nn.RMSNorm(DIM)
        self.ffn_norm = nn.RMSNorm(DIM)

    def forward(self, x, freqs):
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.register_buffer("freqs", torch.ones(128, DIM // N_HEADS), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock() for i in range(N_LAYERS)})
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens, labels):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def model_factory():
    return Transformer()


def example_inputs():
    return {"tokens": "8x32:int64", "labels": "8x32:int64"}


# ---------------------------------------------------------------- torchtitan-style parallelize


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh):
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=True),
        },
    )
    for transformer_block in model.layers.values():
        layer_plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        parallelize_module(module=transformer_block, device_mesh=tp_mesh, parallelize_plan=layer_plan)


def apply_ac(model: nn.Module):
    for layer_id, transformer_block in model.layers.named_children():
        transformer_block = ptd_checkpoint_wrapper(transformer_block, preserve_rng_state=False)
        model.layers.register_module(layer_id, transformer_block)


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               reshard_after_forward: bool = True):
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    fsdp_config = {"mesh": dp_mesh, "mp_policy": mp_policy}
    fully_shard(model.tok_embeddings, **fsdp_config, reshard_after_forward=reshard_after_forward)
    for transformer_block in model.layers.values():
        fully_shard(transformer_block, **fsdp_config, reshard_after_forward=reshard_after_forward)
    fully_shard([model.norm, model.output], **fsdp_config, reshard_after_forward=False)
    fully_shard(model, **fsdp_config)


def parallelize_llama(model: nn.Module, world_mesh: DeviceMesh):
    if "tp" in (world_mesh.mesh_dim_names or ()):
        apply_tp(model, world_mesh["tp"])
    apply_ac(model)
    apply_fsdp(model, world_mesh["dp_shard"], param_dtype=torch.float32, reduce_dtype=torch.float32)
    return model
