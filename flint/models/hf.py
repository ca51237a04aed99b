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
    # the shapes of the zoo's gpt2-tiny, in Hugging Face's GPT2LMHeadModel (tied embedding, Conv1D layers), and
    # like it without dropout (CPU SDPA runs attention with dropout as its math path, a GPU as its flash kernel)
    "hf-gpt2-tiny": ("gpt2", dict(vocab_size=512, n_positions=128, n_embd=128, n_layer=2, n_head=8, n_inner=512,
                                  layer_norm_epsilon=1e-5, bos_token_id=0, eos_token_id=0, attn_pdrop=0.0,
                                  resid_pdrop=0.0, embd_pdrop=0.0)),
    # Hugging Face's own tensor-parallel plans (config.base_model_tp_plan, applied by Hugging Face's code;
    # flint.capture.byom.apply_hf_tp), at hf-llama-tiny's shapes: OLMo 2 (q/k norms over the whole projection,
    # so its plan gathers the q, k, v outputs and splits o_proj's input) and Qwen3 (per-head q/k norms whose
    # weight gradients the plan all-reduces over tp)
    "hf-olmo2-tiny": ("olmo2", dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                    num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=256,
                                    rope_theta=500000.0, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=0,
                                    eos_token_id=0)),
    # hf-llama-tiny with 3 layers and its embedding and attention weights frozen (requires_grad=False: fine-tuning
    # the MLPs and norms), see FROZEN: no weight gradient, reduction or optimizer step of them; the first layer,
    # whose input needs no gradient, runs before the repeated block
    "hf-llama-tiny-frozen": ("llama", dict(vocab_size=1024, hidden_size=256, intermediate_size=512,
                                           num_hidden_layers=3, num_attention_heads=16, num_key_value_heads=8,
                                           max_position_embeddings=256, rope_theta=500000.0, rms_norm_eps=1e-5)),
    "hf-qwen3-tiny": ("qwen3", dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                    num_attention_heads=16, num_key_value_heads=8, head_dim=16,
                                    max_position_embeddings=256, rope_theta=500000.0, rms_norm_eps=1e-5,
                                    tie_word_embeddings=False)),
}


# model -> substrings of the parameter names built frozen (requires_grad=False)
FROZEN: dict[str, tuple[str, ...]] = {"hf-llama-tiny-frozen": ("model.embed_tokens.", ".self_attn.")}


def is_hf(name: str) -> bool:
    return name in HF_MODELS


def build_hf(name: str) -> nn.Module:
    """Instantiate Hugging Face model ``name`` on the current default device."""
    import transformers

    family, fields = HF_MODELS[name]
    config, model = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
                     "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[family]
    built = getattr(transformers, model)(getattr(transformers, config)(**fields))
    for param_name, p in built.named_parameters():
        if any(part in param_name for part in FROZEN.get(name, ())):
            p.requires_grad_(False)
    return built


def hf_factory(name: str) -> Callable[[], nn.Module]:
    if name not in HF_MODELS:
        raise KeyError(name)
    return lambda: build_hf(name)
