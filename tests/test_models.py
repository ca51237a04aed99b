"""flint.models: preset shapes, parameter counts, plain-PyTorch forward."""

import pytest
import torch

from flint.models import ModelConfigError, build, config, presets


@pytest.mark.parametrize("name,billions", [("llama3-8b", 8.03), ("llama3-70b", 70.55),
                                           ("llama3-405b", 405.85), ("mixtral-8x7b", 46.70)])
def test_parameter_counts_on_meta(name, billions):
    with torch.device("meta"):
        model = build(name)
    n = sum(p.numel() for p in model.parameters())
    assert abs(n / 1e9 - billions) < 0.01
    assert all(p.is_meta for p in model.parameters())


def test_llama3_shapes_are_data():
    cfg = config("llama3-70b")
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim) == (8192, 80, 64, 8, 28672)
    assert config("llama3-8b", n_layers=2).n_layers == 2
    assert set(presets()) >= {"llama3-8b", "llama3-70b", "llama3-405b", "mixtral-8x7b", "gpt2-small"}


@pytest.mark.parametrize("name", ["llama-tiny", "moe-tiny", "gpt2-tiny"])
def test_forward_backward_on_cpu(name):
    torch.manual_seed(0)
    model = build(name)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    tokens = torch.randint(0, config(name).vocab_size, (2, 16))
    loss = model(tokens, tokens)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_unknown_model_and_field():
    with pytest.raises(ModelConfigError, match="unknown model"):
        config("llama3-9000b")
    with pytest.raises(ModelConfigError, match="no config field"):
        config("llama3-8b", n_layer=3)
