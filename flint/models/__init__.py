"""The Flint model zoo: plain-PyTorch models, no weights, shapes as data.

Presets are tables in ``configs.toml`` (Llama-3 8B/70B/405B, Mixtral 8x7B,
GPT-2 small and tiny test sizes). ``build("llama3-8b", n_layers=2)`` returns
the module (build it under ``torch.device("meta")`` to allocate nothing);
``factory("llama3-8b")`` returns a zero-argument callable for
``flint.capture.capture_step``.
"""

from __future__ import annotations

import tomllib
from functools import cache
from pathlib import Path
from typing import Any, Callable

from torch import nn

from flint.errors import FlintError
from flint.models.base import StagedLM
from flint.models.gpt2 import GPT2, GPT2Config
from flint.models.llama import Llama, LlamaConfig
from flint.models.moe import MoEConfig, MoETransformer

_FAMILIES: dict[str, tuple[type, type]] = {
    "llama": (LlamaConfig, Llama),
    "moe": (MoEConfig, MoETransformer),
    "gpt2": (GPT2Config, GPT2),
}


class ModelConfigError(FlintError):
    """An unknown preset or a bad override of a model config field."""


@cache
def presets() -> dict[str, dict[str, Any]]:
    """All presets from ``configs.toml``, by name."""
    with open(Path(__file__).with_name("configs.toml"), "rb") as f:
        return tomllib.load(f)


def config(name: str, **overrides: Any):
    """The config dataclass of preset ``name`` with ``overrides`` applied."""
    table = presets()
    if name not in table:
        raise ModelConfigError(f"unknown model '{name}'; known models: {', '.join(sorted(table))}")
    fields = dict(table[name])
    family = fields.pop("family")
    cfg_cls, _ = _FAMILIES[family]
    unknown = set(overrides) - set(cfg_cls.__dataclass_fields__)
    if unknown:
        raise ModelConfigError(f"model '{name}' has no config field(s) {sorted(unknown)}")
    fields.update(overrides)
    return cfg_cls(**fields)


def build(name: str, **overrides: Any) -> nn.Module:
    """Instantiate preset ``name`` (on the current default device)."""
    cfg = config(name, **overrides)
    family = presets()[name]["family"]
    return _FAMILIES[family][1](cfg)


def factory(name: str, **overrides: Any) -> Callable[[], nn.Module]:
    """A zero-argument model factory for ``capture_step``."""
    config(name, **overrides)  # validate early
    return lambda: build(name, **overrides)


__all__ = ["StagedLM", "Llama", "LlamaConfig", "GPT2", "GPT2Config", "MoETransformer", "MoEConfig",
           "ModelConfigError", "presets", "config", "build", "factory"]
