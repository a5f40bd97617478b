"""bfloat16 chunk KV for a float32 model: its rounding, its own keys, the blend invariant that
survives it (ratio 1.0 is still full prefill), and where it is not used. Its round trip through
each tier: tests/test_store_tiers.py."""

from __future__ import annotations

from dataclasses import replace

import torch
from test_store_engine import ASKED, STORED, make_engine, stored_engine
from test_store_tiers import kv

from kvblend.store.half import HalfKV, halve


def test_halving_rounds_to_bfloat16_and_halves_the_bytes():
    x = kv(33, seed=4)
    h = halve(x)
    assert h.k.dtype == h.v.dtype == torch.bfloat16 and h.dtype == torch.float32 and h.quant == "bf16"
    assert torch.equal(h.k.float(), x.k.to(torch.bfloat16).float()) and torch.equal(h.positions, x.positions)
    assert h.nbytes - h.positions.nbytes == (x.nbytes - x.positions.nbytes) // 2


def test_half_chunks_have_their_own_keys_and_keep_the_ratio_one_invariant():
    plain, half = make_engine(kv_half=False), make_engine()
    assert half.chunk_storage == "bf16" and plain.chunk_storage == ""
    assert plain.plan(ASKED, "blend").chunks[0].key != half.plan(ASKED, "blend").chunks[0].key
    for e in (plain, half):
        e.precompute(STORED)
    assert isinstance(half.store.get(half.plan(ASKED, "blend").chunks[0].key), HalfKV)
    _, full = half.prefill(ASKED, "full")
    _, one = half.prefill(ASKED, "blend", blend_cfg=replace(half.blend_cfg, ratios=[1.0]))
    torch.testing.assert_close(one.logits, full.logits, atol=1e-4, rtol=1e-4)
    _, reuse_half = half.prefill(ASKED, "reuse")
    _, reuse = plain.prefill(ASKED, "reuse")
    assert not torch.equal(reuse_half.logits, reuse.logits)  # the bf16 copy is really used
    torch.testing.assert_close(reuse_half.logits, reuse.logits, atol=0.02, rtol=0.02)  # and close


def test_half_from_disk_equals_half_from_memory(tmp_path):
    memory = make_engine()
    memory.precompute(STORED)
    _, ref = memory.prefill(ASKED, "blend")
    disk = stored_engine("disk", tmp_path)
    _, out = disk.prefill(ASKED, "blend")
    assert out.stats.chunk_tiers == ["disk"] * 4
    assert torch.equal(out.logits, ref.logits)


def test_only_a_float32_model_stores_half_and_int8_takes_precedence():
    assert make_engine(dtype=torch.bfloat16).chunk_storage == ""
    assert make_engine(kv_int8=True).chunk_storage == "int8"
