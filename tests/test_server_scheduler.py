"""The engine loop's piecewise full prefill: the same KV and logits as one pass, so a long prompt
can share steps with running streams without changing its answer."""

import pytest
import torch
from tiny_models import tiny_model

from kvblend.engine.sampler import SamplingParams
from kvblend.model.runner import KEY_BLOCK, Runner
from kvblend.server.scheduler import PiecewisePrefill, Request, prefill_piece


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
