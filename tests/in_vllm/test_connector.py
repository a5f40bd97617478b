"""kvblend's connector inside vLLM (CPU build, fp32): what it writes into vLLM's cache and what vLLM
answers from it, against vLLM's own full prefill and kvblend's own engine."""

import random
from types import SimpleNamespace

import pytest
import torch
from conftest import MODEL, SEPARATOR
from paged_reader import read_rows

from kvblend.vllm import rag_prompt_text
from kvblend.vllm.paged import slots
from kvblend.vllm.worker_side import attention_layers

TOWNS = ["Marrowick", "Tesslow", "Brindle", "Oakhurst", "Fennmoor", "Calder", "Ashby", "Wrenfield"]


def documents(topic: str, n: int = 6) -> list[str]:
    """n passages of a fictional topic, long enough that chunks matter (about 80 tokens each)."""
    rng = random.Random(topic)
    out = []
    for i in range(n):
        town, year, height = rng.choice(TOWNS), rng.randint(1600, 1900), rng.randint(10, 90)
        out.append(f"The {topic} record {i}: in {town} the {topic} hall number {i} was raised in {year}. "
                   f"It stands {height} metres tall, and its keeper writes that the {topic} bell rings "
                   f"{rng.randint(2, 12)} times each morning. Visitors from {rng.choice(TOWNS)} come every "
                   f"spring to see the {topic} hall, which has {rng.randint(3, 40)} windows.")
    return out


def ask(llm, prompt, max_tokens: int = 12, **kvblend) -> tuple[list[int], list[float]]:
    """Greedy token ids and their logprobs; `kvblend` fields go to the connector with the request."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": {"kvblend": kvblend}} if kvblend else None
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=1, extra_args=extra)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]


def prompt(tokenizer, topic: str, docs: list[str]) -> str:
    return rag_prompt_text(tokenizer, f"When was the {topic} hall number 2 raised?", docs, SEPARATOR)


def test_ratio_one_is_vllm_full_prefill(blended, plain, worker, tokenizer):
    docs = documents("amber")
    ask(blended, prompt(tokenizer, "amber", docs))  # stores the chunks
    shuffled = prompt(tokenizer, "amber", docs[::-1])
    ids, logprobs = ask(blended, shuffled, ratio=1.0)
    job, stats = worker.recent[-1]
    assert stats.chunk_hits == len(docs) and stats.chunk_misses == 0  # the reordered chunks were read
    assert job.end - job.start == len(tokenizer.encode(shuffled)) - 1  # every row but the last came from kvblend
    full_ids, full_logprobs = ask(plain, shuffled)
    assert ids == full_ids
    assert logprobs == pytest.approx(full_logprobs, abs=2e-3)


def test_reordered_chunks_are_hits(blended, worker, tokenizer):
    docs = documents("cobalt")
    ask(blended, prompt(tokenizer, "cobalt", docs))
    first, first_stats = worker.recent[-1]
    assert first_stats.chunk_misses == len(docs)  # all new: computed in the request, stored after it
    for order in (docs[::-1], docs[2:] + docs[:2]):
        ask(blended, prompt(tokenizer, "cobalt", order))
        _, stats = worker.recent[-1]
        assert stats.chunk_misses == 0 and stats.chunk_hits == len(docs)
        assert stats.reused_tokens > 0


def test_written_kv_is_kvblend_engines(blended, worker, tokenizer):
    """What the connector wrote into vLLM's paged cache, read back in the backend's own layout,
    is the KV kvblend's own engine computes for the same prompt from the same store."""
    from kvblend.api import LLM as KVBlend

    docs = documents("garnet")
    ask(blended, prompt(tokenizer, "garnet", docs))
    text = prompt(tokenizer, "garnet", docs[1:] + docs[:1])
    ask(blended, text, max_tokens=1)
    job, stats = worker.recent[-1]
    assert stats.reused_tokens > 0
    worker.engine.store.flush()
    n_kv, d = worker.engine.runner.n_kv_heads, worker.engine.runner.head_dim
    config = blended.llm_engine.vllm_config
    layers = attention_layers(SimpleNamespace(no_compile_layers=config.compilation_config.static_forward_context),
                              worker.engine.runner.n_layers)
    at = slots(job.block_ids, config.cache_config.block_size, job.start, job.end)
    own = KVBlend(model=MODEL, dtype="float32", separator=SEPARATOR, local_disk=str(worker.settings.local_disk),
                  local_cpu=False)
    try:
        _, out = own.engine.prefill(job.token_ids, "blend")
    finally:
        own.close()
    assert out.stats.selected_positions == stats.selected_positions
    for layer, attn in enumerate(layers):
        k, v = read_rows(attn, at, n_kv, d)
        torch.testing.assert_close(k, out.cache.k[layer][:, job.start:job.end], atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(v, out.cache.v[layer][:, job.start:job.end], atol=2e-3, rtol=2e-3)


def test_ratio_zero_is_kvblend_reuse(blended, worker, tokenizer):
    docs = documents("jade")
    ask(blended, prompt(tokenizer, "jade", docs))
    text = prompt(tokenizer, "jade", docs[::-1])
    ask(blended, text, max_tokens=1, ratio=0.0)
    _, zero = worker.recent[-1]
    ask(blended, text, max_tokens=1, mode="reuse")
    _, reuse = worker.recent[-1]
    assert zero.recomputed_positions == reuse.recomputed_positions
    assert zero.reused_tokens == reuse.reused_tokens > 0


@pytest.mark.parametrize("text", [
    "What is the tallest hall in Marrowick? Answer in one word.",  # no separator at all
    f"Is {SEPARATOR} a separator? Answer yes or no.",  # one separator: no chunk between two
    f"Two in a row{SEPARATOR}{SEPARATOR}make an empty chunk.",  # nothing between them
])
def test_prompts_without_chunks_are_vllms_own(blended, plain, worker, text):
    before = worker.totals.requests
    assert ask(blended, text) == ask(plain, text)  # bit for bit: the connector took no part
    assert worker.totals.requests == before


def test_corrupt_entries_are_misses(blended, plain, worker, tokenizer, store_dir):
    docs = documents("onyx")
    text = prompt(tokenizer, "onyx", docs)
    ask(blended, text)  # its decode steps store the chunks (a step after the prefill)
    worker.engine.store.flush()
    for f in store_dir.rglob("*"):  # every entry on disk damaged in its middle
        if f.is_file() and f.suffix != ".json" and f.stat().st_size > 1024:
            data = bytearray(f.read_bytes())
            data[len(data) // 2: len(data) // 2 + 64] = bytes(64)
            f.write_bytes(bytes(data))
    worker.engine.store.tier("memory").clear()  # so that the request reads the disk
    shuffled = prompt(tokenizer, "onyx", docs[::-1])
    bad_before = worker.totals.bad_entries
    ids, _ = ask(blended, shuffled, ratio=1.0)
    assert worker.totals.bad_entries > bad_before
    assert ids == ask(plain, shuffled)[0]  # recomputed, never served from a damaged entry


def test_a_failed_blend_is_prefilled_in_full(blended, plain, worker, tokenizer, monkeypatch):
    text = prompt(tokenizer, "ivory", documents("ivory"))
    real = worker.engine.prefill

    def blend_breaks(ids, mode, *args, **kwargs):
        if mode != "full":
            raise RuntimeError("a fault inside the blend")
        return real(ids, mode, *args, **kwargs)

    monkeypatch.setattr(worker.engine, "prefill", blend_breaks)
    faults = worker.totals.faults
    assert ask(blended, text)[0] == ask(plain, text)[0]
    assert worker.totals.faults == faults + 1


def test_a_failed_write_is_recomputed_by_vllm(blended, plain, worker, tokenizer, monkeypatch):
    import kvblend.vllm.worker_side as worker_side

    def write_breaks(*args, **kwargs):
        raise RuntimeError("a fault while writing vLLM's cache")

    text = prompt(tokenizer, "pearl", documents("pearl"))
    monkeypatch.setattr(worker_side, "write_rows", write_breaks)
    failed = worker.totals.failed_loads
    assert ask(blended, text)[0] == ask(plain, text)[0]  # vLLM recomputed the blocks the connector reported
    assert worker.totals.failed_loads == failed + 1


def test_chunks_stored_by_kvblend_are_hits(blended, worker, tokenizer):
    """What `kvblend store put` (LLM.store_documents) stores is what the connector looks up: the
    first request through vLLM reads every chunk."""
    from kvblend.api import LLM as KVBlend

    docs = documents("sable")
    own = KVBlend(model=MODEL, dtype="float32", separator=SEPARATOR, local_disk=str(worker.settings.local_disk),
                  local_cpu=False)
    try:
        own.store_documents(docs)
    finally:
        own.close()
    ask(blended, prompt(tokenizer, "sable", docs[::-1]), max_tokens=1)
    _, stats = worker.recent[-1]
    assert stats.chunk_misses == 0 and stats.chunk_hits == len(docs)
