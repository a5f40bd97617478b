"""SamplingParams validation and the Sampler: greedy, top-k, top-p, seeds."""

from __future__ import annotations

import pytest
import torch

from kvblend.engine.sampler import Sampler, SamplingParams


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(stop=["ok", ""]), "stop"),
    (dict(stop=""), "stop"),
])
def test_invalid_params(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_valid_edges() -> None:
    SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=0)
    SamplingParams(top_p=1e-6)


def test_stop_string_becomes_list() -> None:
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    assert SamplingParams().stop == []


def sample(params: SamplingParams, logits: torch.Tensor, n: int) -> list[int]:
    sampler = Sampler(params)
    return [sampler(logits) for _ in range(n)]


LOGITS = torch.tensor([0.5, 2.0, -1.0, 1.9, 0.0, 1.0, 3.0, 2.5])  # argmax 6, then 7, 1, 3


def test_greedy_is_argmax() -> None:
    assert sample(SamplingParams(), LOGITS, 3) == [6, 6, 6]
    assert Sampler(SamplingParams())(torch.tensor([0.0, 5.0, 1.0])) == 1
    assert Sampler(SamplingParams())(LOGITS.to(torch.bfloat16)) == 6


def test_top_k_1_is_argmax() -> None:
    flat = torch.zeros(50)
    flat[17] = 0.01
    assert set(sample(SamplingParams(temperature=1.0, top_k=1, seed=0), flat, 100)) == {17}


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    flat = torch.zeros(50)
    flat[23] = 0.01
    assert set(sample(SamplingParams(temperature=1.0, top_p=1e-6, seed=0), flat, 100)) == {23}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    got = set(sample(SamplingParams(temperature=1.0, top_p=0.7, seed=0), probs.log(), 300))
    assert got == {0, 1}


def test_top_k_never_samples_outside_the_top_k() -> None:
    got = sample(SamplingParams(temperature=5.0, top_k=3, seed=1), LOGITS, 300)
    assert set(got) == {6, 7, 1}  # high temperature: all three show up, nothing else does


def test_temperature_sampling_reaches_more_than_argmax() -> None:
    assert len(set(sample(SamplingParams(temperature=1.0, seed=0), torch.zeros(10), 100))) > 1


def test_same_seed_same_draws() -> None:
    params = dict(temperature=1.0, seed=1234)
    flat = torch.zeros(1000)
    assert sample(SamplingParams(**params), flat, 20) == sample(SamplingParams(**params), flat, 20)


def test_different_seeds_different_draws() -> None:
    flat = torch.zeros(1000)
    a = sample(SamplingParams(temperature=1.0, seed=1), flat, 20)
    b = sample(SamplingParams(temperature=1.0, seed=2), flat, 20)
    assert a != b


def test_top_k_with_tied_logits_keeps_exactly_k_tokens():
    s = Sampler(SamplingParams(temperature=1.0, top_k=2, seed=0))
    seen = {s(torch.tensor([3.0, 1.0, 1.0, 1.0, 0.0])) for _ in range(200)}
    assert len(seen) == 2 and 0 in seen


def test_tiny_temperature_is_greedy_not_nan():
    # logits / 1e-299 overflow to inf unless shifted first; softmax of inf is NaN.
    s = Sampler(SamplingParams(temperature=1e-299, seed=0))
    assert {s(torch.tensor([1.0, 5.0, -3.0, 4.9])) for _ in range(20)} == {1}
