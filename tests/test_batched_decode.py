"""Runner.decode: several sequences' decode steps as one batch, each equal to decoding it alone."""

import pytest
import torch
from tiny_models import tiny_model

from kvblend.model.runner import Runner


def _prefilled(runner, ids, key_bias=False):
    cache = runner.new_cache(len(ids) + 8)
    logits = runner.forward(torch.tensor(ids), torch.arange(len(ids)), cache)
    if key_bias:  # what blending leaves for decode: damped attention to stale chunk keys
        bias = torch.zeros(cache.capacity)
        bias[1: len(ids) // 2] = -0.7
        cache.key_bias = [bias] * runner.n_layers
    return cache, int(logits[0].argmax())


def _greedy(runner, prompts, steps, batched, key_bias=False):
    """Greedy tokens of each prompt: all prompts decoded together, or each on its own."""
    states = [_prefilled(runner, p, key_bias) for p in prompts]
    caches, tokens = [s[0] for s in states], [[s[1]] for s in states]
    groups = [list(range(len(prompts)))] if batched else [[i] for i in range(len(prompts))]
    for group in groups:
        for _ in range(steps):
            logits = runner.decode([tokens[i][-1] for i in group],
                                   [len(prompts[i]) + len(tokens[i]) - 1 for i in group], [caches[i] for i in group])
            for row, i in enumerate(group):
                tokens[i].append(int(logits[row].argmax()))
    return tokens, caches


@pytest.mark.parametrize("family,key_bias", [("llama", False), ("qwen3", False), ("gemma3", False),
                                             ("llama", True), ("gemma3", True)])
def test_batched_decode_equals_each_sequence_alone(family, key_bias):
    runner = Runner(tiny_model(family))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (5, 17, 40, 9, 33, 3)]
    together, caches_t = _greedy(runner, prompts, 6, batched=True, key_bias=key_bias)
    alone, caches_a = _greedy(runner, prompts, 6, batched=False, key_bias=key_bias)
    assert together == alone
    # The KV within rounding: where the CPU's matmul kernel rounds a row alike in every batch of
    # whole row blocks (an AVX2 EPYC) it is equal bit for bit; an AVX-512 Xeon's kernel rounds a
    # row's last bits differently with the batch size, whatever the padding.
    for ct, ca, p in zip(caches_t, caches_a, prompts):
        n = len(p) + 6
        assert ct.length == ca.length == n
        torch.testing.assert_close(ct.k[:, :, :n], ca.k[:, :, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ct.v[:, :, :n], ca.v[:, :, :n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("key_bias", [False, True])
def test_decode_matches_forward(key_bias):
    runner = Runner(tiny_model("llama"))
    ids = list(range(10, 30))
    c1, t1 = _prefilled(runner, ids, key_bias)
    c2, _ = _prefilled(runner, ids, key_bias)
    by_forward = runner.forward(torch.tensor([t1]), torch.tensor([len(ids)]), c1)[0]
    by_decode = runner.decode([t1], [len(ids)], [c2])[0]
    torch.testing.assert_close(by_decode, by_forward, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c2.k[:, :, :21], c1.k[:, :, :21], rtol=1e-5, atol=1e-5)
