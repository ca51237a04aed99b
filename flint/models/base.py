"""The structure every Flint zoo model follows: embed, a stack of identical blocks, head.

``flint.capture`` captures a :class:`StagedLM` part by part: ``embed``
(tokens -> hidden), ONE block of ``layers`` (hidden -> hidden), and ``head``
(hidden, labels -> loss). The stack is then the block body repeated
``len(layers)`` times, so capture time and graph size do not grow with depth.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class StagedLM(nn.Module):
    """A language model as ``head(layers[n-1](... layers[0](embed(tokens))), labels)``.

    Subclasses set ``self.embed``, ``self.layers`` (an ``nn.ModuleList`` of
    blocks with identical parameter shapes, each mapping a hidden-state tensor
    to one of the same shape) and ``self.head`` (a module taking the hidden
    state and the labels and returning the scalar loss).
    """

    embed: nn.Module
    layers: nn.ModuleList
    head: nn.Module

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h, labels)


def is_staged(model: nn.Module) -> bool:
    """Whether ``model`` has :class:`StagedLM`'s shape: ``embed``, ``layers`` and a ``head`` that takes the
    hidden state and the labels (duck-typed; a model whose ``head`` is, say, a bare ``nn.Linear`` and which
    computes its loss in ``forward`` is not staged, and is captured as any module is)."""
    if not all(hasattr(model, a) for a in ("embed", "layers", "head")):
        return False
    if isinstance(model, StagedLM):
        return True
    try:
        inspect.signature(model.head.forward).bind(None, None)
    except (TypeError, ValueError):
        return False
    return True


class CrossEntropyHead(nn.Module):
    """Final norm, output projection to the vocabulary and the mean cross-entropy loss."""

    def __init__(self, norm: nn.Module, dim: int, vocab_size: int, bias: bool = False) -> None:
        super().__init__()
        self.norm = norm
        self.output = nn.Linear(dim, vocab_size, bias=bias)

    def forward(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.output(self.norm(h))
        if isinstance(logits, DTensor):  # vocabulary-sharded (the plan's loss_parallel): torch's parallel loss
            return nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        # cross_entropy spelled out: under torch.compile on meta tensors (torch 2.13) the
        # fused aten::nll_loss has no autograd kernel and silently yields zero gradients.
        logp = nn.functional.log_softmax(logits.float(), dim=-1)
        return -logp.gather(-1, labels.unsqueeze(-1)).mean()
