"""Tiny randomly initialised models of each supported family, built from a config."""

import pytest
import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from kvblend.model.loader import from_hf

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-5, tie_word_embeddings=False)

GEMMA_WINDOW = 20

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(rope_theta=10000.0)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=None, rope_theta=10000.0)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(rope_theta=10000.0)),  # q/k/v bias
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=16, rope_theta=10000.0)),  # q/k norm
    # Sliding-window layers (a window shorter than the test prompts) with a local rotary, a full
    # layer with its own scaled rotary, a query scale that is not head_dim ** -0.5, capped logits.
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=GEMMA_WINDOW, final_logit_softcapping=2.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0}})),
}


def tiny_hf(family: str, seed: int = 0, dtype=torch.float32, **overrides):
    config_cls, model_cls, extra = FAMILIES[family]
    config = config_cls(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    # Random init leaves norms at 1 and biases at 0: perturb them so they are really exercised.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def tiny_model(family: str, seed: int = 0, dtype=torch.float32, device="cpu", **overrides):
    return from_hf(tiny_hf(family, seed, dtype, **overrides).to(device), name=f"tiny-{family}")


# Tests parametrized over DEVICES run on the CPU everywhere and on CUDA where there is a GPU
# (`pytest -m cuda` selects those).
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device")])]
