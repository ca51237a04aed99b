"""Tiny Hugging Face models built from configs (no download), a plain MLP and a small CNN.

Each function is a zero-argument model factory for ``flint capture --model
hf_models.py:<name>`` and for ``flint.capture.capture_step``.
"""

import torch
import torch.nn.functional as F
from torch import nn


def llama(n_layers: int = 2, dim: int = 64, ffn: int = 128, heads: int = 4, kv_heads: int = 2, vocab: int = 256):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=ffn,
                                        num_hidden_layers=n_layers, num_attention_heads=heads,
                                        num_key_value_heads=kv_heads, max_position_embeddings=128,
                                        rope_theta=500000.0))


def llama_frozen_attention():  # fine-tuning the MLPs only: the attention weights frozen (requires_grad=False)
    model = llama()
    for layer in model.model.layers:
        layer.self_attn.requires_grad_(False)
    return model


def llama_frozen_embedding():  # the embedding frozen (as LoRA freezes it): the first layer's input needs no gradient
    model = llama(n_layers=4)
    model.model.embed_tokens.requires_grad_(False)
    return model


def qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        tie_word_embeddings=False))


def mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=128, sliding_window=16))


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=4))


def t5():
    """An encoder-decoder: its stacks copy the config (use_cache stays on in the decoder's copy unless the
    capture turns it off there too) and its self-attention mask is the learned relative position bias."""
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                               num_decoder_layers=2, num_heads=4, decoder_start_token_id=0,
                                               pad_token_id=0))


def phi():  # biases everywhere, the output projection's too (column-parallel under its own plan), parallel block
    from transformers import PhiConfig, PhiForCausalLM

    return PhiForCausalLM(PhiConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))


def gptj():  # rotary sin / cos and position ids tiled with repeat
    from transformers import GPTJConfig, GPTJForCausalLM

    return GPTJForCausalLM(GPTJConfig(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128, rotary_dim=8))


def xglm():  # q/k/v_proj (the Llama-family names), but out_proj, fc1, fc2: no TP preset, no declared plan
    from transformers import XGLMConfig, XGLMForCausalLM

    return XGLMForCausalLM(XGLMConfig(vocab_size=256, d_model=64, num_layers=2, attention_heads=4, ffn_dim=128,
                                      max_position_embeddings=128))


def bert():  # a masked LM: bidirectional SDPA without a mask (no padding), its own loss
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=128, max_position_embeddings=128))


def gemma3():  # per-head q/k norms computing 1 + weight in float32 (their gradients cast back to bf16), sliding window
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              head_dim=16, max_position_embeddings=128,
                                              sliding_window=16)).to(torch.bfloat16)


def mamba():  # a state-space model: depthwise conv1d over the sequence, the selective scan's loop, no attention
    from transformers import MambaConfig, MambaForCausalLM

    return MambaForCausalLM(MambaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, state_size=8))


def stablelm():  # Llama's module names (the hf-llama TP preset matches), but views by the config's head count
    from transformers import StableLmConfig, StableLmForCausalLM

    return StableLmForCausalLM(StableLmConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=128))


def phi3():  # fused QKV and gate-up projections
    from transformers import Phi3Config, Phi3ForCausalLM

    return Phi3ForCausalLM(Phi3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      pad_token_id=0, eos_token_id=1, bos_token_id=1))


def opt():  # learned positions, its own module names
    from transformers import OPTConfig, OPTForCausalLM

    return OPTForCausalLM(OPTConfig(vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=64))


def gemma2():  # logit soft-capping: Hugging Face runs eager attention (matmul, softmax), no SDPA
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          max_position_embeddings=128))


def bloom():  # ALiBi through baddbmm: eager attention only
    from transformers import BloomConfig, BloomForCausalLM

    return BloomForCausalLM(BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4))


def falcon():  # fused_qkv[..., [-2], :]: an index tensor from Python data (flint.constant)
    from transformers import FalconConfig, FalconForCausalLM

    return FalconForCausalLM(FalconConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4))


def qwen3():  # per-head q/k norms: Hugging Face's TP plan all-reduces their weight gradients
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=128, tie_word_embeddings=False))


def gpt_neox(tp_plan: dict | None = None):  # fused query_key_value, no TP preset: Hugging Face's own plan
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=128)
    if tp_plan is not None:
        cfg.base_model_tp_plan = tp_plan
    return GPTNeoXForCausalLM(cfg)


def starcoder2():  # tied embeddings under Hugging Face's plan (vocabulary-sharded embedding and head)
    from transformers import Starcoder2Config, Starcoder2ForCausalLM

    return Starcoder2ForCausalLM(Starcoder2Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=128, bos_token_id=0, eos_token_id=0))


def gpt_bigcode():  # GPT-2's module names, but nn.Linear layers and a multi-query c_attn: no TP preset fits
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    return GPTBigCodeForCausalLM(GPTBigCodeConfig(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                                                  multi_query=True, bos_token_id=0, eos_token_id=0))


def gpt_neox_packed():  # a plan style Flint does not capture
    return gpt_neox({"layers.*.attention.query_key_value": "packed_colwise", "layers.*.attention.dense": "rowwise"})


def gpt_neox_misnamed():  # a plan whose rules match no module of the blocks (Hugging Face drops them)
    return gpt_neox({"layers.*.attention.qkv": "colwise", "layers.*.attention.out": "rowwise"})


def mixtral(top_k: int = 2):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=top_k,
                        max_position_embeddings=128)
    # grouped_mm: static shapes (what a real run uses; the eager loop routes with nonzero()),
    # and in bfloat16, the dtype torch._grouped_mm takes off-GPU
    cfg._experts_implementation = "grouped_mm"
    return MixtralForCausalLM(cfg).to(torch.bfloat16)


def qwen3_moe():  # its experts counted by num_experts (Mixtral: num_local_experts)
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                              moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                              num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                              max_position_embeddings=128)).to(torch.bfloat16)


def qwen2_moe():  # a shared expert and its gate: a Linear(hidden, 1), whose one-row weight FSDP pads per rank
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(Qwen2MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                              moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              num_experts=4, num_experts_per_tok=2, max_position_embeddings=128)
                               ).to(torch.bfloat16)


def gpt_oss():  # grouped-GEMM experts with biases (a row per routed token from a per-expert table), sinks
    from transformers import GptOssConfig, GptOssForCausalLM

    return GptOssForCausalLM(GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
                                          sliding_window=16, layer_types=["sliding_attention", "full_attention"])
                             ).to(torch.bfloat16)


def deepseek_v3():  # a dense first layer, then MoE layers with a shared expert and grouped routing; MLA attention
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=128)).to(torch.bfloat16)


def ernie4_5_moe():  # the router's score-correction bias: a parameter with requires_grad=False (no gradient)
    from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM

    cfg = Ernie4_5_MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, moe_num_experts=4,
                             moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=0,
                             max_position_embeddings=128, tie_word_embeddings=False)
    cfg._experts_implementation = "grouped_mm"
    return Ernie4_5_MoeForCausalLM(cfg).to(torch.bfloat16)


def granitemoe():  # its experts under block_sparse_moe (router, experts), not mlp
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM

    cfg = GraniteMoeConfig(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=128, tie_word_embeddings=False)
    cfg._experts_implementation = "grouped_mm"
    return GraniteMoeForCausalLM(cfg).to(torch.bfloat16)


def phimoe():  # its router samples in training (sparsemixer: exponential, rand_like, uniform_)
    from transformers import PhimoeConfig, PhimoeForCausalLM

    cfg = PhimoeConfig(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                       max_position_embeddings=128, tie_word_embeddings=False)
    cfg._experts_implementation = "grouped_mm"
    return PhimoeForCausalLM(cfg).to(torch.bfloat16)


class MLP(nn.Module):
    """A plain MLP: no repeated blocks, logits out (loss: cross-entropy against ``target``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def mlp():
    return MLP()


class CNN(nn.Module):
    """A small CNN with its own loss (conv, batch norm, pooling, cross-entropy)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv1(x)))
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)
        return F.cross_entropy(self.fc(h.flatten(1)), target)


def cnn():
    return CNN()


class ConvNet(nn.Module):
    """Convolutions without batch norm (the planned path's): the first one's input needs no gradient
    (convolution_backward's grad_input is None); the same inputs as the CNN."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv2(F.relu(self.conv1(x))))
        return F.cross_entropy(self.fc(h.flatten(1)), target)


def convnet():
    return ConvNet()


class ResidualBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.relu(h + self.bn(self.conv(h)))


class CNNStack(nn.Module):
    """Batch norm before, inside and after a stack of identical residual blocks (a repeated block between two
    stage parts, each of which runs the whole forward: the other side's batch-norm updates are dead there)."""

    def __init__(self, c: int = 8, n: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.layers = nn.ModuleList(ResidualBlock(c) for _ in range(n))
        self.head_conv = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1, bias=False)
        self.head_bn = nn.BatchNorm2d(2 * c)
        self.fc = nn.Linear(2 * c, 10)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for layer in self.layers:
            h = layer(h)
        h = F.adaptive_avg_pool2d(F.relu(self.head_bn(self.head_conv(h))), 1).flatten(1)
        return F.cross_entropy(self.fc(h), target)


def cnn_stack():
    return CNNStack()


def resnet():  # Hugging Face's ResNet: batch norm, max pooling, stages of unlike blocks; no input embedding
    from transformers import ResNetConfig, ResNetForImageClassification

    return ResNetForImageClassification(ResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 16, 32],
                                                     depths=[1, 1, 2, 1], layer_type="basic", num_labels=10))


def convnext():  # Hugging Face's ConvNeXt: depthwise 7x7 convolutions, stride-2 downsampling, layer scale
    from transformers import ConvNextConfig, ConvNextForImageClassification

    return ConvNextForImageClassification(ConvNextConfig(hidden_sizes=[8, 16, 16, 32], depths=[1, 1, 2, 1],
                                                         num_labels=10))


class Encoder(nn.Module):
    """torch's own nn.TransformerEncoder, whose forward reads its first layer's attributes
    (``layers[0].self_attn.batch_first``) before running the layers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 64)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128, batch_first=True), 2)
        self.head = nn.Linear(64, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(tokens)))


def encoder():
    return Encoder()


class FloatStack(nn.Module):
    """Repeated layers on a float input that needs no gradient. ``norm_first``: a LayerNorm reads the input
    first, and its backward skips the input gradient (output_mask [False, True, True])."""

    def __init__(self, norm_first: bool = True) -> None:
        super().__init__()
        self.norm_in = nn.LayerNorm(16) if norm_first else nn.Identity()
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = self.norm_in(x)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x), target)


def float_stack():
    return FloatStack()


def float_into_layers():  # the float input straight into the repeated layers: its hidden state needs no gradient
    return FloatStack(norm_first=False)


def bart():  # an encoder-decoder whose decoder layers take encoder_hidden_states, which needs a gradient
    from transformers import BartConfig, BartForConditionalGeneration

    return BartForConditionalGeneration(BartConfig(vocab_size=256, d_model=32, encoder_layers=2, decoder_layers=2,
                                                   encoder_attention_heads=2, decoder_attention_heads=2,
                                                   encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32))


def seq2seq():  # torch's nn.Transformer: its decoder layers read the encoder's output (memory), which needs a gradient
    return nn.Transformer(d_model=32, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=64,
                          batch_first=True)


class MixedLayer(nn.Module):
    """A pre-norm residual layer whose MLP is narrow (dense) or wide: one class, two shapes."""

    def __init__(self, wide: bool) -> None:
        super().__init__()
        width = 128 if wide else 64
        self.norm = nn.LayerNorm(32)
        self.mlp = nn.Sequential(nn.Linear(32, width), nn.GELU(), nn.Linear(width, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class MixedLayers(nn.Module):
    """A causal LM whose layers are not all alike, as DeepSeek-V3's dense first layers before its MoE ones:
    by default one narrow layer, then three wide ones. Its forward reads a wrapped module's parameter outside
    that module's forward, as Llama 4's does (``embed_tokens.weight.device``)."""

    def __init__(self, wide: tuple[bool, ...] = (False, True, True, True)) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 32)
        self.layers = nn.ModuleList([MixedLayer(w) for w in wide])
        self.out = nn.Linear(32, 256)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids.to(self.embed.weight.device))
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.out(x).flatten(0, 1), labels.flatten())


def mixed_layers():
    return MixedLayers()


def alternating_layers():  # narrow and wide layers alternate, as Llama 4's dense and MoE ones
    return MixedLayers((False, True) * 3)


def llama4():
    """Llama 4: dense and MoE layers alternate (interleave_moe_layer_step = 2), its rotary embedding is complex
    (torch.polar), and its forward reads ``embed_tokens.weight.device``."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    cfg = Llama4TextConfig(vocab_size=256, hidden_size=64, intermediate_size=64, intermediate_size_mlp=128,
                           num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2)
    return Llama4ForCausalLM(cfg)


class RNNLM(nn.Module):
    """An LSTM language model (Dynamo refuses nn.LSTM unless ``allow_rnn``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        self.rnn = nn.LSTM(32, 64, batch_first=True)
        self.out = nn.Linear(64, 100)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(self.emb(tokens))[0])


def rnn():
    return RNNLM()


def example_inputs():
    """Inputs of the CNN (``--model hf_models.py:cnn`` takes them from here)."""
    return {"x": "8x3x16x16:float32", "target": "8:int64"}


def llama_frozen_bottom():  # the embedding and the bottom two of six layers frozen (partial fine-tuning)
    model = llama(n_layers=6)
    model.model.embed_tokens.requires_grad_(False)
    for layer in model.model.layers[:2]:
        layer.requires_grad_(False)
    return model


def llama_input_require_grads():  # LoRA-style set-up: the embedding frozen, Hugging Face's gradient checkpointing,
    # and enable_input_require_grads (a forward hook calling requires_grad_() on the embedding's output)
    model = llama(n_layers=4)
    model.model.embed_tokens.requires_grad_(False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    return model


def gpt2_input_require_grads():  # the same hook on a model with tied embeddings (its work outside its layers is one
    # part in the capture)
    model = gpt2()
    model.transformer.wte.requires_grad_(False)
    model.enable_input_require_grads()
    return model
