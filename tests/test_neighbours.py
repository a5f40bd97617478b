"""Chunks precomputed after their most similar chunk of a known collection (FusionRAG-style)."""

import pytest
import torch
from test_blend_invariants import PREFIX, SEP, SUFFIX, chunks, make_engine, prefill, prompt

from kvblend.blend.neighbours import NeighbourIndex
from kvblend.engine.sampler import SamplingParams
from kvblend.blend.segment import join_segments
from kvblend.model.aliases import stale_key_scale_for
from kvblend.engine.scheduler import generate

A, B, C, D = [1, 2, 3, 4, 5], [1, 2, 3, 9, 9], [40, 41, 42, 43], [40, 41, 50, 51]


def test_each_chunk_gets_its_most_similar_other_chunk():
    index = NeighbourIndex()
    assert index.add([A, B, C, D, A]) == 4  # a repeated chunk is indexed once
    assert index.neighbour_of(A) == B and index.neighbour_of(B) == A
    assert index.neighbour_of(C) == D and index.neighbour_of(D) == C
    assert index.neighbour_of([7, 7, 7]) is None  # outside the collection


def test_a_chunk_sharing_no_token_has_no_neighbour():
    index = NeighbourIndex()
    index.add([A, C, [90, 91]])
    assert index.neighbour_of([90, 91]) is None


def test_old_neighbours_stay_as_the_collection_grows(tmp_path):
    index = NeighbourIndex()
    index.add([A, C])
    assert index.neighbour_of(A) is None  # A and C share no token
    assert index.add([B, D, C]) == 2
    assert index.neighbour_of(A) is None  # not B yet: A switches to it once its KV after B is stored
    assert index.neighbour_of(B) == A and index.neighbour_of(D) == C
    index.save(tmp_path / "n.json")
    loaded = NeighbourIndex.load(tmp_path / "n.json")
    assert [loaded.neighbour_of(c) for c in (A, B, C, D)] == [index.neighbour_of(c) for c in (A, B, C, D)]


def test_more_neighbours_come_farthest_first_and_survive_a_save(tmp_path):
    E = [1, 2, 60, 61, 62]  # shares less with A than B does
    index = NeighbourIndex()
    index.add([A, B, E, C], count=3)
    assert index.neighbour_of(A) == B
    assert index.lead_of(A) == [E, B]  # the nearest last; C shares nothing with A
    assert index.lead_of(C) == [] and index.lead_of([7, 7]) == []
    index.save(tmp_path / "n.json")
    assert NeighbourIndex.load(tmp_path / "n.json").lead_of(A) == [E, B]
    one = NeighbourIndex()
    one.add([A, B, E, C])
    assert one.lead_of(A) == [B]


def test_an_index_written_before_more_neighbours_loads_with_none(tmp_path):
    path = tmp_path / "n.json"
    path.write_text('{"format": "kvblend-neighbours-1", "chunks": [[1, 2], [1, 3]], "neighbour": [1, 0]}')
    assert NeighbourIndex.load(path).lead_of([1, 2]) == [[1, 3]]


@pytest.mark.parametrize("text", ["", "{}", '{"format": "kvblend-neighbours-1", "chunks": [[1]], "neighbour": [5]}',
                                  '{"format": "kvblend-neighbours-1", "chunks": [[1]], "neighbour": [-1], "more": [[3]]}'])
def test_a_bad_index_file_is_a_clear_error(tmp_path, text):
    path = tmp_path / "n.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="neighbour index"):
        NeighbourIndex.load(path)


def indexed_engine(cs, **settings):
    engine = make_engine(chunk_context="prefix", **settings)
    engine.index_collection([prompt(cs)])
    return engine


def test_a_chunk_is_stored_with_the_kv_it_has_after_its_neighbour():
    cs = chunks(3, seed=3)
    cs[1] = cs[0][:12] + cs[1][12:]  # chunks 0 and 1 share half their tokens: each other's neighbour
    engine = indexed_engine(cs)
    assert engine.keys.lead_ids(cs[1]) == cs[0] + SEP
    engine.precompute(prompt(cs))
    # Exactly the rows a prompt [prefix, chunk 0, chunk 1] computes for chunk 1.
    ids = join_segments(PREFIX, cs[:2], SUFFIX, SEP)
    _, full = prefill(engine, ids, "full")
    start = len(PREFIX) + len(SEP) + len(cs[0]) + len(SEP)
    kv = engine.store.get(engine.keys.chunk_key(cs[1], PREFIX + SEP))
    torch.testing.assert_close(kv.k, full.cache.k[:, :, start:start + len(cs[1])], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv.v, full.cache.v[:, :, start:start + len(cs[1])], atol=1e-5, rtol=1e-5)
    # A chunk outside the collection keeps the plain key.
    plain = make_engine(chunk_context="prefix")
    assert engine.keys.chunk_key(cs[1], PREFIX + SEP) != plain.keys.chunk_key(cs[1], PREFIX + SEP)
    assert engine.keys.chunk_key([5, 6, 7], PREFIX + SEP) == plain.keys.chunk_key([5, 6, 7], PREFIX + SEP)


def test_a_chunk_after_two_neighbours_is_stored_as_a_prompt_with_both_before_it_computes_it():
    cs = chunks(3, seed=3)
    cs[1] = cs[0][:12] + cs[1][12:]  # 0 is 1's nearest chunk
    cs[2] = cs[1][12:18] + cs[2][6:]  # 2 shares less with 1
    engine = indexed_engine(cs, neighbour_count=2)
    assert engine.keys.lead_ids(cs[1]) == cs[2] + SEP + cs[0] + SEP
    engine.precompute(prompt(cs))
    ids = join_segments(PREFIX, [cs[2], cs[0], cs[1]], SUFFIX, SEP)
    _, full = prefill(engine, ids, "full")
    start = len(PREFIX) + 3 * len(SEP) + len(cs[2]) + len(cs[0])
    kv = engine.store.get(engine.keys.chunk_key(cs[1], PREFIX + SEP))
    torch.testing.assert_close(kv.k, full.cache.k[:, :, start:start + len(cs[1])], atol=1e-5, rtol=1e-5)
    plan, blend = prefill(engine, prompt(cs[::-1]), "blend", ratios=[1.0])
    _, full = prefill(engine, prompt(cs[::-1]), "full")
    assert plan.hits == 3
    torch.testing.assert_close(blend.logits, full.logits, atol=1e-4, rtol=1e-4)


def test_blend_at_ratio_one_equals_full_prefill_with_neighbour_chunks():
    cs = chunks(4, seed=4)
    engine = indexed_engine(cs)
    engine.precompute(prompt(cs))
    ids = prompt([cs[2], cs[0], cs[3], cs[1]])
    _, full = prefill(engine, ids, "full")
    plan, blend = prefill(engine, ids, "blend", ratios=[1.0])
    assert plan.hits == 4
    torch.testing.assert_close(blend.logits, full.logits, atol=1e-4, rtol=1e-4)


def test_indexing_damps_by_the_models_neighbour_scale_unless_set():
    cs = chunks(2, seed=5)
    model = make_engine().settings.model
    assert make_engine().blend_cfg.stale_key_scale == stale_key_scale_for(model, neighbours=False)
    assert indexed_engine(cs).blend_cfg.stale_key_scale == stale_key_scale_for(model, neighbours=True)
    assert indexed_engine(cs, stale_key_scale=0.4).blend_cfg.stale_key_scale == 0.4
    off = make_engine(neighbour_context=False)
    assert off.index_collection([prompt(cs)]) == 0 and off.keys.neighbours is None


def test_a_second_engine_loads_the_saved_index_and_hits_the_stored_chunks(tmp_path):
    cs = chunks(3, seed=6)
    first = indexed_engine(cs, local_disk=str(tmp_path), local_cpu=False)
    first.precompute(prompt(cs))
    first.close()
    assert (tmp_path / "neighbours.json").exists()
    second = make_engine(chunk_context="prefix", local_disk=str(tmp_path), local_cpu=False)
    assert len(second.keys.neighbours) == 3
    plan = second.plan(prompt(cs[::-1]), "blend")
    assert plan.hits == 3


def test_chunks_first_met_in_a_request_join_the_collection_after_the_answer():
    cs = chunks(3, seed=7)
    cs[1] = cs[0][:12] + cs[1][12:]  # 0 and 1: each other's neighbour
    engine = make_engine(chunk_context="prefix", exact_first_chunk=False)
    out = generate(engine, prompt(cs), SamplingParams(max_tokens=2))
    assert out.metrics.chunk_tiers == ["miss"] * 3
    with engine.namespace(engine.keys.namespace):  # its keys as a request gets them: the index as stored now
        index = engine.keys.neighbours
        assert index is not None and len(index) == 3 and index.neighbour_of(cs[1]) == cs[0]
        # Stored after their neighbours: the next request, in another order, hits every one.
        plan = engine.plan(prompt(cs[::-1]), "blend")
        assert plan.hits == 3 and engine.keys.lead_ids(cs[1]) == cs[0] + SEP
        assert engine.keys.chunk_key(cs[1], PREFIX + SEP) in engine.store
