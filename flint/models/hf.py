"""Hugging Face models by name, built from configs (no download), for ``flint validate`` and examples.

``transformers`` is a test dependency (``pip install -e '.[test]'``); it is
imported only when one of these models is built. The capture path for them
is the generic one (:mod:`flint.capture.generic`): inputs ``input_ids`` and
``labels``, the model's own loss.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

HF_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # the shapes of the zoo's llama-tiny, in Hugging Face's LlamaForCausalLM
    "hf-llama-tiny": ("llama", dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                    num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=256,
                                    rope_theta=500000.0, rms_norm_eps=1e-5)),
}


def is_hf(name: str) -> bool:
    return name in HF_MODELS


def build_hf(name: str) -> nn.Module:
    """Instantiate Hugging Face model ``name`` on the current default device."""
    family, fields = HF_MODELS[name]
    if family == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**fields))
    raise KeyError(name)


def hf_factory(name: str) -> Callable[[], nn.Module]:
    if name not in HF_MODELS:
        raise KeyError(name)
    return lambda: build_hf(name)
