"""The layerwise runner computes what transformers computes."""

import pytest
import torch
from tiny_models import DEVICES, FAMILIES, tiny_model

from kvblend.model.rotary import apply_rope, check_rerotation
from kvblend.model import runner as runner_mod
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
def test_the_last_layer_computes_only_the_logit_rows(family):
    """Past the last layer's KV only the rows whose logits are asked for go on: the cache is the
    same bit for bit, and their logits agree with those of a pass that finishes every row."""
    m = tiny_model(family, seed=4)
    ids = torch.randint(0, m.config.vocab_size, (70,), generator=torch.Generator().manual_seed(5))
    runner = Runner(m)
    every, last = runner.new_cache(70), runner.new_cache(70)
    all_rows = runner.forward(ids, torch.arange(70), every, logit_rows=slice(None))
    tail = runner.forward(ids, torch.arange(70), last)
    picked = runner.forward(ids, torch.arange(70), runner.new_cache(70), logit_rows=torch.tensor([3, 50]))
    assert tail.shape == (1, m.config.vocab_size) and picked.shape == (2, m.config.vocab_size)
    assert torch.equal(every.k[:, :, :70], last.k[:, :, :70]) and torch.equal(every.v[:, :, :70], last.v[:, :, :70])
    torch.testing.assert_close(tail, all_rows[-1:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(picked, all_rows[[3, 50]], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_long_pass_runs_its_mlp_in_row_pieces_with_the_same_result(family, monkeypatch):
    """The MLP of a pass longer than MLP_ROWS runs on near-equal row pieces (which bounds its
    activations), and every K, V and logit is the same bit for bit as in one piece."""
    m = tiny_model(family, seed=6)
    ids = torch.randint(0, m.config.vocab_size, (70,), generator=torch.Generator().manual_seed(7))
    runner = Runner(m)
    whole, pieces = runner.new_cache(70), runner.new_cache(70)
    one = runner.forward(ids, torch.arange(70), whole, logit_rows=slice(None))
    calls = []
    for block in runner.layers:
        monkeypatch.setattr(block.mlp, "forward", lambda x, f=block.mlp.forward: calls.append(x.shape[0]) or f(x))
    monkeypatch.setattr(runner_mod, "MLP_ROWS", 16)
    split = runner.forward(ids, torch.arange(70), pieces, logit_rows=slice(None))
    assert set(calls) == {14} and len(calls) == 5 * m.config.num_hidden_layers  # 70 rows: 5 pieces of 14
    assert torch.equal(whole.k[:, :, :70], pieces.k[:, :, :70]) and torch.equal(whole.v[:, :, :70], pieces.v[:, :, :70])
    assert torch.equal(one, split)


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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_rerotation_moves_k_to_new_positions(family, device):
    """A chunk computed at offset p, its K re-rotated to q, equals the chunk computed at q with
    the same left context; V needs no change. Gemma 3 moves each layer with its own rotary (local
    base for sliding-window layers, a scaled global one for full layers): one rotary for all fails."""
    m = tiny_model(family, seed=5, device=device)
    runner = Runner(m)
    ids = torch.randint(0, m.config.vocab_size, (30,), generator=torch.Generator().manual_seed(4))
    p, q = 3, 211
    at_p, at_q = runner.new_cache(p + 30), runner.new_cache(q + 30)
    # Same tokens, positions shifted: keys only ever see relative distances.
    runner.forward(ids, torch.arange(p, p + 30), at_p)
    runner.forward(ids, torch.arange(q, q + 30), at_q)
    k_p, v_p = at_p.k[:, :, p:p + 30], at_p.v[:, :, p:p + 30]
    k_q, v_q = at_q.k[:, :, q:q + 30], at_q.v[:, :, q:q + 30]
    tables = runner.shift_tables(torch.full((30,), q - p), k_p.device)
    moved = torch.stack([runner.rerotate(layer, k_p[layer], tables) for layer in range(runner.n_layers)])
    torch.testing.assert_close(moved, k_q, atol=1e-4, rtol=1e-4)
    # The loader writes moved K straight into its cache rows: the same rotation.
    into = torch.full_like(moved, float("nan"))
    for layer in range(runner.n_layers):
        runner.rerotate(layer, k_p[layer], tables, out=into[layer])
    torch.testing.assert_close(into, moved, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(v_p, v_q, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(k_p, k_q, atol=1e-2)  # the rotation really was needed
    if family == "gemma3":  # the layer types really rotate differently
        assert len(set(runner.layer_rope)) == 2
        one = runner.rotaries["sliding_attention"].rerotate(k_p, torch.full((30,), q - p))
        full_layer = runner.layer_rope.index("full_attention")
        assert not torch.allclose(one[full_layer], k_q[full_layer], atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rerotation_into_a_half_precision_cache_rounds_once(dtype):
    """The loader moves bf16 / fp16 K into its cache rows through fp32, rounding once: what
    rotating the same K in fp32 and rounding the result gives, up to one rounding step."""
    rot = Runner(tiny_model("llama", seed=5)).rotaries[None]
    g = torch.Generator().manual_seed(6)
    k = torch.randn(2, 40, rot.inv_freq.shape[0] * 2, generator=g).to(dtype)
    delta = torch.randint(-300, 300, (40,), generator=g)
    into = torch.full_like(k, float("nan"))
    rot.rerotate(k, delta, out=into)
    exact = rot.rerotate(k.float(), delta)
    torch.testing.assert_close(into.float(), exact, atol=1e-3, rtol=torch.finfo(dtype).eps)
    # and the path without `out` rounds the same rotation
    torch.testing.assert_close(into, rot.rerotate(k, delta), atol=1e-3, rtol=torch.finfo(dtype).eps)
    # bit for bit the rotary formula in fp32, rounded once
    assert torch.equal(into, apply_rope(k.float(), *rot.shift_table(delta)).to(dtype))


def test_sliding_window_layers_read_only_their_window():
    """Gemma 3's sliding-window layers never read keys older than their window (in a block of rows
    far into the prompt, and in decode): poisoning those keys with NaN changes nothing, so that
    attention work there is skipped. Full-attention layers still read everything."""
    from tiny_models import GEMMA_WINDOW

    m = tiny_model("gemma3", seed=6, max_position_embeddings=2048)
    runner = Runner(m)
    n = 1210
    ids = torch.randint(0, m.config.vocab_size, (n,), generator=torch.Generator().manual_seed(6))
    ref = m.hf(ids[None]).logits[0]
    sliding = [i for i, w in enumerate(runner.windows) if w is not None]
    assert runner.windows == [GEMMA_WINDOW, GEMMA_WINDOW, None, GEMMA_WINDOW]
    cache = runner.new_cache(n)
    runner.forward(ids[:1100], torch.arange(1100), cache)
    # Rows from 1100 on read keys from the key block holding 1100 - window + 1 (1024) at the earliest.
    cache.k[sliding, :, :1024] = float("nan")
    cache.v[sliding, :, :1024] = float("nan")
    block = runner.forward(ids[1100:1200], torch.arange(1100, 1200), cache, logit_rows=slice(None))
    # Decode reads exactly the last `window` keys.
    cache.k[sliding, :, :1200 - GEMMA_WINDOW + 1] = float("nan")
    cache.v[sliding, :, :1200 - GEMMA_WINDOW + 1] = float("nan")
    steps = torch.cat([runner.forward(ids[i:i + 1], torch.tensor([i]), cache) for i in range(1200, n)])
    torch.testing.assert_close(block, ref[1100:1200], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(steps, ref[1200:], atol=1e-5, rtol=1e-5)
    # The same poison in the full-attention layer is read: the test can see a read.
    cache.k[2, :, :10] = float("nan")
    assert runner.forward(ids[n - 1:], torch.tensor([n - 1]), cache).isnan().all()


def test_rerotation_gate_accepts_static_rope_and_rejects_dynamic():
    assert check_rerotation(tiny_model("llama").hf, 512) == (True, "ok")
    linear = tiny_model("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    assert check_rerotation(linear.hf, 512)[0]
    dynamic = tiny_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    ok, why = check_rerotation(dynamic.hf, 512)
    assert not ok and "dynamic" in why


def test_rerotation_gate_checks_every_layer_types_rotary():
    assert check_rerotation(tiny_model("gemma3").hf, 512) == (True, "ok")
    m = tiny_model("gemma3")
    rot = m.hf.model.rotary_emb
    original = rot.forward
    # Full-attention layers' rotation no longer what their inverse frequencies say.
    rot.forward = lambda x, pos, layer_type: original(x, pos * (2 if layer_type == "full_attention" else 1), layer_type)
    ok, why = check_rerotation(m.hf, 512)
    assert not ok and why.startswith("full_attention layers")


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
