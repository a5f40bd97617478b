"""The layerwise runner computes what transformers computes."""

import pytest
import torch
from tiny_models import FAMILIES, tiny_model

from kvblend.model.rotary import check_rerotation
from kvblend.model.runner import Runner


@pytest.mark.parametrize("family", list(FAMILIES))
def test_full_prefill_logits_match_transformers(family):
    m = tiny_model(family)
    ids = torch.randint(0, m.config.vocab_size, (70,), generator=torch.Generator().manual_seed(1))
    ref = m.hf(ids[None]).logits[0]
    runner = Runner(m)
    out = runner.forward(ids, torch.arange(70), runner.new_cache(70), logit_rows=slice(None))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_scattered_rows_and_decode_match_transformers(family):
    """Rows computed in any grouping (a block after a prefix, then one by one) match."""
    m = tiny_model(family, seed=3)
    ids = torch.randint(0, m.config.vocab_size, (90,), generator=torch.Generator().manual_seed(2))
    ref = m.hf(ids[None]).logits[0]
    runner = Runner(m)
    cache = runner.new_cache(8)  # grows on demand
    runner.forward(ids[:40], torch.arange(40), cache)
    block = runner.forward(ids[40:80], torch.arange(40, 80), cache, logit_rows=slice(None))
    steps = [runner.forward(ids[i:i + 1], torch.tensor([i]), cache) for i in range(80, 90)]
    torch.testing.assert_close(block, ref[40:80], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(steps), ref[80:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_rerotation_moves_k_to_new_positions(family):
    """A chunk computed at offset p, its K re-rotated to q, equals the chunk computed at q with
    the same left context; V needs no change."""
    m = tiny_model(family, seed=5)
    runner = Runner(m)
    ids = torch.randint(0, m.config.vocab_size, (30,), generator=torch.Generator().manual_seed(4))
    p, q = 3, 211
    at_p, at_q = runner.new_cache(p + 30), runner.new_cache(q + 30)
    # Same tokens, positions shifted: keys only ever see relative distances.
    runner.forward(ids, torch.arange(p, p + 30), at_p)
    runner.forward(ids, torch.arange(q, q + 30), at_q)
    k_p, v_p = at_p.k[:, :, p:p + 30], at_p.v[:, :, p:p + 30]
    k_q, v_q = at_q.k[:, :, q:q + 30], at_q.v[:, :, q:q + 30]
    moved = runner.rotary.rerotate(k_p, torch.full((30,), q - p))
    torch.testing.assert_close(moved, k_q, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v_p, v_q, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(k_p, k_q, atol=1e-2)  # the rotation really was needed


def test_rerotation_gate_accepts_static_rope_and_rejects_dynamic():
    assert check_rerotation(tiny_model("llama").hf, 512) == (True, "ok")
    linear = tiny_model("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    assert check_rerotation(linear.hf, 512)[0]
    dynamic = tiny_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    ok, why = check_rerotation(dynamic.hf, 512)
    assert not ok and "dynamic" in why


def test_rerotation_gate_catches_a_module_whose_frequencies_differ():
    m = tiny_model("llama")
    m.hf.model.rotary_emb.inv_freq.mul_(1.5)  # forward uses the buffer; make re-rotation disagree
    rot = m.hf.model.rotary_emb
    original = rot.forward
    rot.forward = lambda x, position_ids: original(x, position_ids * 2)
    ok, why = check_rerotation(m.hf, 512)
    assert not ok and "off by" in why


def test_default_model_logits_match_transformers(default_fp32):
    tok = default_fp32.tokenizer
    ids = torch.tensor(tok.encode("The Eiffel Tower is in Paris. Cats are small animals that " * 6))
    ref = default_fp32.hf(ids[None]).logits[0, -5:]
    runner = Runner(default_fp32)
    out = runner.forward(ids, torch.arange(len(ids)), runner.new_cache(len(ids)), logit_rows=slice(-5, None))
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=1e-4)
