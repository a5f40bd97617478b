"""int8 chunk KV: quantization error bound, its own keys, and the blend invariant that survives it
(ratio 1.0 is still full prefill). Its round trip through each tier: tests/test_store_tiers.py."""

from __future__ import annotations

from dataclasses import replace

import torch
from test_store_engine import ASKED, STORED, make_engine, stored_engine
from test_store_tiers import kv

from kvblend.store.int8 import QuantKV, dequantize_tensor, quantize


def test_quantization_error_is_at_most_half_a_step():
    x = kv(33, seed=4)
    q = quantize(x)
    assert q.kq.dtype == torch.int8 and q.k_scale.dtype == torch.float16 and q.k_scale.shape[-1] == 1
    for layer in range(x.n_layers):
        k, v = q.layer(layer)
        assert k.dtype == torch.float32
        assert bool(((k - x.k[layer]).abs() <= q.k_scale[layer].float() * 0.5 + 1e-6).all())
        assert bool(((v - x.v[layer]).abs() <= q.v_scale[layer].float() * 0.5 + 1e-6).all())
    assert torch.equal(dequantize_tensor(q.kq[0], q.k_scale[0], torch.float32), q.layer(0)[0])
    d = x.k.shape[-1]
    assert q.nbytes - q.positions.nbytes == (x.nbytes - x.positions.nbytes) * (d + 2) // (4 * d)


def test_int8_chunks_have_their_own_keys_and_keep_the_ratio_one_invariant():
    plain, int8 = make_engine(), make_engine(kv_int8=True)
    assert plain.plan(ASKED, "blend").chunks[0].key != int8.plan(ASKED, "blend").chunks[0].key
    for e in (plain, int8):
        e.precompute(STORED)
    stored = int8.store.get(int8.plan(ASKED, "blend").chunks[0].key)
    assert isinstance(stored, QuantKV)
    _, full = int8.prefill(ASKED, "full")
    _, one = int8.prefill(ASKED, "blend", blend_cfg=replace(int8.blend_cfg, ratios=[1.0]))
    torch.testing.assert_close(one.logits, full.logits, atol=1e-4, rtol=1e-4)
    _, reuse8 = int8.prefill(ASKED, "reuse")
    _, reuse = plain.prefill(ASKED, "reuse")
    assert not torch.equal(reuse8.logits, reuse.logits)  # int8 is really used
    torch.testing.assert_close(reuse8.logits, reuse.logits, atol=0.05, rtol=0.05)  # and close


def test_int8_from_disk_equals_int8_from_memory(tmp_path):
    memory = make_engine(kv_int8=True)
    memory.precompute(STORED)
    _, ref = memory.prefill(ASKED, "blend")
    disk = stored_engine("disk", tmp_path, kv_int8=True)
    _, out = disk.prefill(ASKED, "blend")
    assert out.stats.chunk_tiers == ["disk"] * 4
    assert torch.equal(out.logits, ref.logits)
