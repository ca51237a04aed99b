"""Llama-3 (Meta, 2024) in plain PyTorch: GQA attention with SDPA, RMSNorm, SwiGLU, RoPE.

The layout follows Meta's reference ``model.py`` and torchtitan (module names
``attention.wq/wk/wv/wo``, ``feed_forward.w1/w2/w3``, ``attention_norm``,
``ffn_norm``), so PyTorch tensor-parallel plans written for them apply as is.
Heads are inferred from local tensor sizes (``view(..., -1, head_dim)``), so
the same code runs tensor-parallel on head shards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flint.models.base import CrossEntropyHead, StagedLM


@dataclass(frozen=True)
class LlamaConfig:
    """Shapes of a Llama-3 model; presets live in ``configs.toml``."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 8192

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight``, computed in float32 as in the reference."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


class Rotary(nn.Module):
    """Rotary position embedding with a precomputed cos/sin table (a non-persistent buffer)."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` of shape (batch, seq, heads, head_dim) pairwise."""
        seq = x.shape[1]
        cos = self.cos[:seq].view(1, seq, 1, -1)
        sin = self.sin[:seq].view(1, seq, 1, -1)
        xf = x.float().unflatten(-1, (-1, 2))
        x0, x1 = xf[..., 0], xf[..., 1]
        out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
        return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Grouped-query causal self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.rope = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = self.rope(q), self.rope(k)
        n_rep = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(n_rep, dim=2)
        v = v.repeat_interleave(n_rep, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``."""

    def __init__(self, cfg: LlamaConfig, feed_forward: nn.Module | None = None) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = feed_forward if feed_forward is not None else FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Embedding(nn.Module):
    """Token embedding (``tok_embeddings``)."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(tokens)


class Llama(StagedLM):
    """Llama-3 decoder-only transformer returning the training loss."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.head = CrossEntropyHead(RMSNorm(cfg.dim, cfg.norm_eps), cfg.dim, cfg.vocab_size)
