"""Which vLLM models the connector drives; the others are left to vLLM."""

from types import SimpleNamespace

import pytest
from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

from kvblend.vllm.model_view import transformers_rotary, unsupported

ONE = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1)


@pytest.mark.parametrize("config", [LlamaConfig(), Qwen2Config(), MistralConfig(sliding_window=None)])
def test_llama_and_qwen_families_are_driven(config):
    assert unsupported(config, ONE) is None
    assert transformers_rotary(config).inv_freq.numel() == config.hidden_size // config.num_attention_heads // 2


@pytest.mark.parametrize("config, why", [
    (Gemma3TextConfig(), "not 'gemma3_text'"),
    (MistralConfig(sliding_window=4096), "sliding-window"),
    (Qwen2Config(use_sliding_window=True), "sliding-window"),
])
def test_other_models_are_left_to_vllm(config, why):
    assert why in unsupported(config, ONE)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_parallel_workers_are_left_to_vllm(tp, pp):
    assert "parallel size 1" in unsupported(Qwen2Config(), SimpleNamespace(tensor_parallel_size=tp,
                                                                            pipeline_parallel_size=pp))
