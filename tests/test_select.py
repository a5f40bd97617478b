"""Token selection signals: KV deviation, the suffix's attention mass, and how they combine."""

import pytest
import torch

import torch.nn.functional as F

from kvblend.blend.select import attend_with_mass, attention_mass, deviation, n_selected, top_tokens, weighted


def _reference_mass(q, k, q_pos, scale, window=None):
    """Plain attention probabilities with grouped heads repeated, averaged over heads and queries."""
    kk = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
    s = q @ kk.transpose(1, 2) * scale
    key_pos = torch.arange(k.shape[1])
    visible = key_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= key_pos[None, :] > q_pos[:, None] - window
    return s.masked_fill(~visible, float("-inf")).softmax(-1).mean(dim=(0, 1))


@pytest.mark.parametrize("window", [None, 7])
def test_attention_mass_matches_plain_attention(window):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(6, 5, 8, generator=g), torch.randn(2, 40, 8, generator=g)
    q_pos = torch.tensor([20, 21, 30, 38, 39])
    mass = attention_mass(q, k, q_pos, 0.35, window)
    torch.testing.assert_close(mass, _reference_mass(q, k, q_pos, 0.35, window))
    assert mass.sum().item() == pytest.approx(1.0, abs=1e-5)  # each query's probabilities sum to 1
    if window is not None:  # queries 20, 21 see keys 14..21; 30 sees 24..30: none sees 0..13, 22, 23
        assert (mass[:14] == 0).all() and (mass[22:24] == 0).all() and (mass[14:22] > 0).all()
    else:  # query 39 sees every key
        assert (mass > 0).all()


@pytest.mark.parametrize("window", [None, 7])
def test_attend_with_mass_is_attention_and_its_mass(window):
    """One softmax gives the probe both: the output equals masked SDPA's, the mass attention_mass's."""
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(6, 5, 8, generator=g), torch.randn(2, 40, 8, generator=g), torch.randn(2, 40, 8, generator=g)
    q_pos, bias = torch.tensor([20, 21, 30, 38, 39]), torch.randn(40, generator=g)
    out, mass = attend_with_mass(q, k, v, q_pos, 0.35, window, bias)
    key_pos = torch.arange(40)
    visible = key_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= key_pos[None, :] > q_pos[:, None] - window
    ref = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=0.35, enable_gqa=True,
                                         attn_mask=torch.where(visible, bias, float("-inf"))[None, None])[0]
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(mass, attention_mass(q, k, q_pos, 0.35, window, bias))
    assert attend_with_mass(q, k, None, q_pos, 0.35)[0] is None


def test_attention_mass_never_reads_future_keys():
    q, k = torch.randn(2, 3, 4), torch.randn(1, 10, 4)
    mass = attention_mass(q, k, torch.tensor([2, 3, 4]), 1.0)
    assert (mass[5:] == 0).all() and (mass[:5] > 0).all()


def test_deviation_signals_are_squared_distances():
    fk, ck, fv, cv = torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), torch.zeros(2, 3, 4)
    ck[:, 1] = 1.0  # K of token 1 off by 1 in 2 heads x 4 dims
    cv[0, 2, 0] = 3.0  # V of token 2 off by 3 in one element
    assert deviation("k", fk, ck, fv, cv).tolist() == [0.0, 8.0, 0.0]
    assert deviation("v", fk, ck, fv, cv).tolist() == [0.0, 0.0, 9.0]
    assert deviation("kv", fk, ck, fv, cv).tolist() == [0.0, 8.0, 9.0]
    with pytest.raises(ValueError, match="deviation signal"):
        deviation("q", fk, ck, fv, cv)


def test_weighting_prefers_what_the_suffix_reads():
    dev = torch.tensor([100.0, 4.0, 1.0, 0.0])  # token 0 deviates most ...
    attention = torch.tensor([0.001, 0.5, 0.3, 0.199])  # ... but the question barely reads it
    assert top_tokens(dev, 2).tolist() == [0, 1]
    assert top_tokens(weighted(dev, attention), 2).tolist() == [1, 2]  # a * ||delta||: 1.0, 0.3 > 0.01
    assert n_selected(0.15, 1000) == 150 and n_selected(0.0, 1000) == 0


