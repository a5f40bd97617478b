"""A prompt's first chunk read exact from the prefix cache (exact_first_chunk), never stale."""

import pytest
import torch
from test_blend_invariants import PREFIX, SEP, chunks, make_engine, prefill, prompt

from kvblend.blend.controller import LoadingController
from kvblend.blend.encode import encode_chunks


@pytest.mark.parametrize("neighbours", [True, False])
def test_the_first_chunk_comes_exact_in_any_order(neighbours):
    cs = chunks(3, seed=11)
    cs[1] = cs[0][:12] + cs[1][12:]  # chunks 0 and 1 are each other's neighbour
    engine = make_engine(chunk_context="prefix")
    if neighbours:
        engine.index_collection([prompt(cs)])
    engine.precompute(prompt(cs))
    for first in range(3):
        ids = prompt([cs[first]] + [c for i, c in enumerate(cs) if i != first])
        plan, reuse = prefill(engine, ids, "reuse")
        end = len(PREFIX) + len(SEP) + len(cs[first]) + len(SEP)
        assert plan.prefix_hit == end and plan.hits == 3  # the chunk store still serves the others
        assert not bool(plan.reused_mask()[:end].any())  # so blend never spends recompute on it
        _, full = prefill(engine, ids, "full")
        torch.testing.assert_close(reuse.cache.k[:, :, :end], full.cache.k[:, :, :end], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(reuse.cache.v[:, :, :end], full.cache.v[:, :, :end], atol=1e-5, rtol=1e-5)
        _, blend = prefill(engine, ids, "blend", ratios=[1.0])
        torch.testing.assert_close(blend.logits, full.logits, atol=1e-4, rtol=1e-4)


def test_off_the_first_chunk_is_a_stored_chunk_like_the_others():
    cs = chunks(3, seed=12)
    engine = make_engine(chunk_context="prefix", exact_first_chunk=False)
    engine.index_collection([prompt(cs)])
    engine.precompute(prompt(cs))
    plan = engine.plan(prompt(cs[::-1]), "blend")
    assert plan.prefix_hit == len(PREFIX) + len(SEP) and plan.hits == 3


def test_exact_first_chunks_are_stored_once():
    cs = chunks(3, seed=13)
    engine = make_engine(chunk_context="prefix")
    engine.precompute(prompt(cs))
    assert engine.store_first_chunks(prompt(cs[::-1]), engine.segments(prompt(cs[::-1]))) == 0
    assert engine.store_first_chunks(prompt(chunks(1, seed=14)), engine.segments(prompt(chunks(1, seed=14)))) == 1


def test_a_corrupt_first_chunk_block_falls_back_to_the_stored_chunk(tmp_path):
    cs = chunks(3, seed=15)
    engine = make_engine(chunk_context="prefix", local_disk=str(tmp_path), local_cpu=False)
    engine.precompute(prompt(cs))
    engine.store.flush()
    ids = prompt(cs[::-1])
    plan = engine.plan(ids, "blend")
    block = plan.prefix_blocks[-1][1].key  # the first chunk's last block: its separator
    path = engine.store.tier("disk").path(block)
    path.write_bytes(path.read_bytes()[:-100])
    _, out = prefill(engine, ids, "blend", ratios=[1.0])
    assert out.stats.bad_entries == 1 and out.stats.prefix_hit_tokens == len(PREFIX) + len(SEP) + len(cs[2])
    _, full = prefill(engine, ids, "full")
    torch.testing.assert_close(out.logits, full.logits, atol=1e-4, rtol=1e-4)


def test_the_loading_controller_counts_only_the_chunks_it_reads(tmp_path):
    """The first chunk is a hit whose stored KV is never read: no load time, never dropped."""
    cs = chunks(3, seed=16)
    engine = make_engine(chunk_context="prefix", local_disk=str(tmp_path), local_cpu=False)
    engine.precompute(prompt(cs))
    engine.store.flush()
    ctl = LoadingController(engine.store)
    engine.store.tier("disk").meter.rate, ctl.compute.rate = 1.0, 1e6  # reading: never worth it
    plan = engine.plan(prompt(cs[::-1]), "blend")
    _, d = ctl.decide(plan, engine.blend_cfg)
    assert d.dropped == 2 and [c.tier for c in plan.chunks] == ["prefix"] + ["disk: recomputed"] * 2


def test_a_chunk_with_no_neighbour_is_encoded_once_for_both_stores(monkeypatch):
    """Its chunk-store KV (after the prefix) is the first rows of its first-chunk encoding."""
    cs = chunks(3, seed=17)
    engine = make_engine(chunk_context="prefix")
    inputs, forward = [], engine.runner.forward
    monkeypatch.setattr(engine.runner, "forward", lambda ids, *a, **k: inputs.append(ids.tolist()) or forward(ids, *a, **k))
    ids = prompt(cs)
    assert engine.precompute(ids) == 3
    assert [sum(x[:len(c)] == c for x in inputs) for c in cs] == [1, 1, 1]
    context = ids[: engine.segments(ids).exact_end]
    for c, alone in zip(cs, encode_chunks(engine.runner, context, cs)):
        stored = engine.store.get(engine.keys.chunk_key(c, context))
        torch.testing.assert_close(stored.k, alone.k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(stored.v, alone.v, atol=1e-5, rtol=1e-5)
        assert stored.positions.tolist() == alone.positions.tolist()


def test_in_memory_a_chunk_and_its_first_chunk_blocks_share_one_tensor():
    """Stored once in memory, not twice: the chunk's entry and its blocks are views of one encoding."""
    cs = chunks(2, length=40, seed=18)
    engine = make_engine(chunk_context="prefix")
    ids = prompt(cs)
    engine.precompute(ids)
    context = ids[: engine.segments(ids).exact_end]
    for c in cs:
        chunk = engine.store.get(engine.keys.chunk_key(c, context))
        first = context + c + SEP
        spans = engine._prefix_blocks(first, engine.segments(first), len(first))
        blocks = [engine.store.get(key) for _, key, _ in spans[-2:]]  # the chunk's last block, the separator's
        bases = {b.k.untyped_storage().data_ptr() for b in blocks} | {chunk.k.untyped_storage().data_ptr()}
        assert len(bases) == 1
        torch.testing.assert_close(blocks[0].k[:, :, -1], chunk.k[:, :, -1], atol=0, rtol=0)
