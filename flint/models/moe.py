"""A Mixtral-style mixture-of-experts transformer (Mistral AI, 2024).

Llama attention and RMSNorm; the feed-forward is a top-k router over
``n_experts`` SwiGLU experts whose weights are stacked into 3-D parameters.

Routing keeps static shapes so the program captures on fake tensors: the
``tokens * top_k`` (token, expert) assignments are sorted by expert and
split into equal groups of ``tokens * top_k / n_experts`` rows, i.e. the
per-step work of a perfectly balanced router (the expected load of an
auxiliary-loss-balanced MoE). Each expert then runs as one batched matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flint.models.base import CrossEntropyHead, StagedLM
from flint.models.llama import Embedding, LlamaConfig, RMSNorm, TransformerBlock


@dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    """Llama shapes plus the number of experts and experts per token."""

    n_experts: int = 8
    top_k: int = 2


class MoEFeedForward(nn.Module):
    """Top-k softmax router + stacked SwiGLU experts (balanced-load dispatch)."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.top_k = top_k
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, dim = x.shape
        flat = x.reshape(-1, dim)
        n_tokens = flat.shape[0]
        scores = F.softmax(self.gate(flat).float(), dim=-1)
        weights, experts = torch.topk(scores, self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).type_as(x)
        order = torch.argsort(experts.flatten(), stable=True)
        token_of = order // self.top_k
        per_expert = n_tokens * self.top_k // self.n_experts
        xs = flat[token_of].view(self.n_experts, per_expert, dim)
        hs = F.silu(torch.bmm(xs, self.w1)) * torch.bmm(xs, self.w3)
        ys = torch.bmm(hs, self.w2).view(-1, dim) * weights.flatten()[order].unsqueeze(-1)
        out = torch.zeros_like(flat).index_add(0, token_of, ys)
        return out.view(bsz, seq, dim)


class MoETransformer(StagedLM):
    """Mixtral-style decoder: Llama blocks whose feed-forward is a mixture of experts."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        if cfg.n_experts < cfg.top_k:
            raise ValueError("top_k must not exceed n_experts")
        self.config = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(
            TransformerBlock(cfg, MoEFeedForward(cfg.dim, cfg.ffn_dim, cfg.n_experts, cfg.top_k))
            for _ in range(cfg.n_layers)
        )
        self.head = CrossEntropyHead(RMSNorm(cfg.dim, cfg.norm_eps), cfg.dim, cfg.vocab_size)
