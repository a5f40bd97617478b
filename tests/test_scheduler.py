"""The engine loop that LLM.generate and the server share: prompts decoded together give the
tokens each gives alone, and a long full prefill run piecewise gives the KV and logits of one pass,
so a long prompt can share steps with running streams without changing its answer."""

import pytest
import torch
from tiny_models import tiny_model

from kvblend.blend.segment import join_prompt
from kvblend.config import Settings
from kvblend.engine.engine import Engine
from kvblend.engine.requests import Request
from kvblend.engine.sampler import SamplingParams
from kvblend.engine.scheduler import PiecewisePrefill, Scheduler, prefill_piece
from kvblend.model.runner import KEY_BLOCK, Runner

SEP = [7, 7, 3]


def rag_prompts(n: int, seed: int = 0):
    """`n` prompts over a pool of chunks, each with its segments as built."""
    g = torch.Generator().manual_seed(seed)
    pool = [torch.randint(10, 300, (20,), generator=g).tolist() for _ in range(5)]
    picks = [torch.randperm(5, generator=g)[:3].tolist() for _ in range(n)]
    return [join_prompt([1, 20, 21], [pool[i] for i in p], [30 + k, 31, 32], SEP) for k, p in enumerate(picks)]


def engine(family: str) -> Engine:
    return Engine(tiny_model(family), Settings(check_layers=[1], recompute_ratios=[0.15], min_recompute_tokens=0,
                                               kv_half=False), sep_ids=SEP)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("mode", ["full", "blend"])
def test_prompts_decoded_together_give_what_each_gives_alone(family, mode):
    e = engine(family)
    prompts = rag_prompts(4)
    for p in prompts:
        e.precompute(p.ids, p.seg)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    loop = Scheduler(e)
    together = loop.run([Request(p.ids, params, mode, "default", seg=p.seg) for p in prompts])
    assert loop.peak_batch == len(prompts)  # one admitted a step: all four decode together from the fourth
    alone = [Scheduler(e, max_batch=1).run([Request(p.ids, params, mode, "default", seg=p.seg)])[0] for p in prompts]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in together)
    assert [c.metrics.chunk_hits for c in together] == [0 if mode == "full" else 3] * len(prompts)


def test_a_failed_request_fails_alone_and_the_loop_carries_on():
    e = engine("llama")
    good = rag_prompts(2)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    bad = Request(good[0].ids, params, "turbo", "default")  # no such mode: its prefill fails
    loop = Scheduler(e)
    with pytest.raises(RuntimeError, match="unknown mode"):
        loop.run([Request(good[0].ids, params, "blend", "default"), bad])
    assert loop.waiting.empty() and not loop.running  # the other one was answered
    done = loop.run([Request(p.ids, params, "blend", "default") for p in good])
    assert [len(c.token_ids) for c in done] == [2, 2]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_piecewise_prefill_equals_one_pass(family):
    runner = Runner(tiny_model(family, max_position_embeddings=2048))
    ids = torch.randint(0, 300, (1100,), generator=torch.Generator().manual_seed(0)).tolist()
    whole = runner.new_cache(len(ids))
    expected = runner.forward(torch.tensor(ids), torch.arange(len(ids)), whole)[0]
    job = PiecewisePrefill(Request(ids, SamplingParams(), "full", "default"), runner.new_cache(len(ids)))
    results = [prefill_piece(runner, job, KEY_BLOCK) for _ in range(3)]
    assert results[:2] == [None, None] and job.done == len(ids)
    assert torch.equal(results[2], expected)
    assert torch.equal(job.cache.k[:, :, :len(ids)], whole.k[:, :, :len(ids)])
    assert torch.equal(job.cache.v[:, :, :len(ids)], whole.v[:, :, :len(ids)])
