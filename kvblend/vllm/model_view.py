"""vLLM's loaded model, seen the way kvblend's runner drives a transformers model.

The runner calls a layer's pieces one at a time (norm, q/k/v, attention of its own, o_proj, MLP) so
that it can compute any subset of rows at any layer. vLLM's modules are those same pieces, with
other names and signatures: one packed qkv projection, linear layers that return (output, bias),
weights packed for the CPU's kernels (so they cannot be read as plain tensors). This view calls
vLLM's modules as they are: the serving process holds one copy of the weights, vLLM's.

Rotary tables come from transformers' own rotary module for the model's config (buffers only, no
weights), as kvblend's runner uses everywhere: chunk KV made by `kvblend store put` and KV made
here are rotated alike.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from ..model.loader import LoadedModel, check_architecture
from ..model.weights import dense_format

# Decoder families whose vLLM modules carry the names below (qkv_proj, o_proj, mlp, the two norms).
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


class ViewError(ValueError):
    """A vLLM model kvblend cannot drive layer by layer."""


class AttentionView:
    """A vLLM attention module as the runner calls it: q, k, v from one packed product; o_proj's
    output without its separate bias; the model's own scaling."""

    def __init__(self, attn: torch.nn.Module):
        self._attn = attn
        self.scaling = attn.scaling
        self._split = [attn.q_size, attn.kv_size, attn.kv_size]
        if hasattr(attn, "q_norm"):  # qwen3: per-head norms on q and k before the rotary
            self.q_norm, self.k_norm = attn.q_norm, attn.k_norm

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out, _ = self._attn.qkv_proj(x)
        return tuple(out.split(self._split, dim=-1))

    def o_proj(self, x: torch.Tensor) -> torch.Tensor:
        return self._attn.o_proj(x)[0]


class LayerView:
    def __init__(self, layer: torch.nn.Module):
        self.self_attn = AttentionView(layer.self_attn)
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.mlp = layer.mlp


class LMHeadView:
    """Logits of hidden rows from vLLM's head (its table may be padded past the vocabulary)."""

    def __init__(self, head: torch.nn.Module, vocab_size: int):
        self.weight, self.vocab_size = head.weight, vocab_size

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.weight[: self.vocab_size])


class DecoderView:
    def __init__(self, model: torch.nn.Module, config, rotary: torch.nn.Module):
        self.embed_tokens = model.embed_tokens
        self.layers = [LayerView(layer) for layer in model.layers]
        self.norm = model.norm
        self.rotary_emb = rotary


class CausalLMView:
    """What kvblend's runner and engine read of a transformers *ForCausalLM: config, model.*, lm_head."""

    def __init__(self, vllm_model: torch.nn.Module, config):
        self.config = config
        model = vllm_model.model
        self.model = DecoderView(model, config, transformers_rotary(config))
        head = vllm_model.lm_head if not config.tie_word_embeddings else model.embed_tokens
        self.lm_head = LMHeadView(head, config.vocab_size)


def transformers_rotary(config) -> torch.nn.Module:
    """transformers' rotary module for this config (Qwen2RotaryEmbedding, LlamaRotaryEmbedding, ...)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]
    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    rotary = getattr(module, name.replace("ForCausalLM", "RotaryEmbedding"))
    return rotary(config=config)


def unsupported(config, parallel_config=None) -> str | None:
    """Why kvblend cannot drive this vLLM model layer by layer, or None where it can."""
    if config.model_type not in SUPPORTED:
        return f"kvblend's vLLM connector drives {', '.join(SUPPORTED)} models, not {config.model_type!r}"
    if getattr(config, "use_sliding_window", False) or (
            config.model_type == "mistral" and getattr(config, "sliding_window", None)):
        return "kvblend's vLLM connector does not drive sliding-window attention yet"
    if parallel_config is not None and (parallel_config.tensor_parallel_size > 1 or parallel_config.pipeline_parallel_size > 1):
        # Each worker would hold a slice of the heads or of the layers; the view needs them all.
        return "kvblend's vLLM connector runs at tensor and pipeline parallel size 1"
    return None


def view_model(vllm_model: torch.nn.Module, config, tokenizer, name: str, fingerprint: str,
               dtype: torch.dtype, device: torch.device) -> LoadedModel:
    """A LoadedModel over vLLM's modules: kvblend's Runner and Engine run on it unchanged."""
    check_architecture(config, name)
    why = unsupported(config)
    if why is None and vllm_model.model.layers[0].self_attn.num_heads != config.num_attention_heads:
        why = "kvblend's vLLM connector runs at tensor parallel size 1"
    if why is not None:
        raise ViewError(why)
    view = CausalLMView(vllm_model, config)
    return LoadedModel(view, tokenizer, name, fingerprint, dtype, device, dense_format(dtype))
