"""int8 chunk KV: quantization error bound, round trips through every tier, its own keys, and
the blend invariant that survives it (ratio 1.0 is still full prefill)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_store_engine import ASKED, STORED, make_engine, stored_engine
from test_store_tiers import kv, make_tier  # noqa: F401  (fixture)

from kvblend.store.entry_format import BadEntry
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
    d = x.k.shape[-1]
    assert q.nbytes - q.positions.nbytes == (x.nbytes - x.positions.nbytes) * (d + 2) // (4 * d)


def test_int8_round_trip_through_a_tier(make_tier):  # noqa: F811
    tier = make_tier()
    q = quantize(kv(9, seed=5))
    assert tier.put("chunk-q", q)
    entry = tier.get("chunk-q")
    assert entry.meta.quant == "int8" and entry.meta.dtype == "float32"
    back = entry.materialize()
    assert isinstance(back, QuantKV)
    for name in ("kq", "vq", "k_scale", "v_scale", "positions"):
        assert torch.equal(getattr(back, name), getattr(q, name))
    for layer in range(q.n_layers):
        assert all(torch.equal(a, b) for a, b in zip(entry.layer(layer), q.layer(layer)))
    # Scales are under the layer digest like the KV itself.
    entry.meta.layer_digests[1] = "0" * 32  # as if layer 1 had been changed after writing
    with pytest.raises(BadEntry, match="layer 1 checksum"):
        entry.layer(1)
    assert torch.equal(dequantize_tensor(q.kq[0], q.k_scale[0], torch.float32), q.layer(0)[0])


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
