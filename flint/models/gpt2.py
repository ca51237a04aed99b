"""GPT-2 (OpenAI, 2019) in plain PyTorch: learned positions, LayerNorm, GELU MLP.

Module names follow the Llama zoo model (``attention.wq/wk/wv/wo``,
``feed_forward.w1/w2``) so one tensor-parallel plan serves both. The output
projection is a separate parameter (GPT-2 ties it to the token embedding;
capturing embed and head as separate parts keeps them untied here, which
changes neither FLOPs nor activation shapes, only the parameter count).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flint.models.base import CrossEntropyHead, StagedLM


@dataclass(frozen=True)
class GPT2Config:
    """Shapes of a GPT-2 model; presets live in ``configs.toml``."""

    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    ffn_dim: int
    norm_eps: float = 1e-5
    max_seq_len: int = 1024

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def n_kv_heads(self) -> int:
        return self.n_heads


class Attention(nn.Module):
    """Causal multi-head self-attention through SDPA."""

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim)
        self.wk = nn.Linear(cfg.dim, cfg.dim)
        self.wv = nn.Linear(cfg.dim, cfg.dim)
        self.wo = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class MLP(nn.Module):
    """``w2(gelu(w1 x))`` with the tanh GELU approximation of the original."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LayerNorm GPT-2 block."""

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = MLP(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Embedding(nn.Module):
    """Token plus learned absolute position embedding."""

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok_embeddings(tokens) + self.pos_embeddings(pos)


class GPT2(StagedLM):
    """GPT-2 returning the training loss."""

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.config = cfg
        self.embed = Embedding(cfg)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.head = CrossEntropyHead(nn.LayerNorm(cfg.dim, eps=cfg.norm_eps), cfg.dim, cfg.vocab_size)
