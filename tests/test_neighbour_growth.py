"""A collection that grows: an older chunk gets a much closer chunk that joins later as its
neighbour. It is re-encoded after it in the background, and lookups switch to the new key only
once the new KV is stored: until then the old KV is served."""

import json
import threading
import time

import httpx
import pytest
import torch
from serving import live_server, tiny_engine
from test_blend_invariants import PREFIX, SEP, SUFFIX, make_engine, prefill, prompt
from test_server_faults import metric
from test_server_neighbours import ids_of

from kvblend.blend.neighbours import NeighbourIndex
from kvblend.blend.segment import join_segments
from kvblend.engine.sampler import SamplingParams
from kvblend.engine import scheduler as scheduler_module
from kvblend.engine.scheduler import generate

A = list(range(100, 124))
B = A[:18] + list(range(260, 266))  # much like A
C = A[:12] + list(range(200, 212))  # like A, less than B
# Unrelated chunks: with only two chunks in a collection, TF-IDF weighs the tokens they share at 0.
X, Y, Z = list(range(40, 64)), list(range(64, 88)), list(range(140, 164))
CONTEXT = PREFIX + SEP  # what a chunk is precomputed after in these prompts (chunk_context prefix)


def grow(engine, ns, cs):
    """What posting documents does: index them in the namespace's collection, precompute them."""
    with engine.namespace(ns):
        engine.index_collection([prompt(cs)])
        engine.precompute(prompt(cs))


def reencode(engine, ns, cs):
    with engine.namespace(ns):
        return engine.reencode_neighbours(prompt(cs))


def test_a_chunk_first_indexed_alone_gets_a_neighbour_when_a_similar_one_arrives():
    engine = make_engine(chunk_context="prefix")
    grow(engine, "kb", [A, X])
    assert engine.indexes.get("kb").neighbour_of(A) is None  # nothing like it yet
    grow(engine, "kb", [B, Y])
    assert engine.indexes.get("kb").neighbour_of(A) is None  # pending: its KV after B is not stored
    assert reencode(engine, "kb", [B, Y]) == 1
    engine.store.flush()
    index = engine.indexes.get("kb")
    assert index.neighbour_of(A) == B and index.waiting() == []
    # Stored with exactly the rows a prompt [prefix, B, A] computes for A.
    with engine.namespace("kb"):
        kv = engine.store.get(engine.keys.chunk_key(A, CONTEXT))
        _, full = prefill(engine, join_segments(PREFIX, [B, A], SUFFIX, SEP), "full")
    start = len(PREFIX) + len(SEP) + len(B) + len(SEP)
    torch.testing.assert_close(kv.k, full.cache.k[:, :, start:start + len(A)], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv.v, full.cache.v[:, :, start:start + len(A)], atol=1e-5, rtol=1e-5)
    assert reencode(engine, "kb", [B, Y]) == 0  # nothing waits any more


def test_documents_first_met_in_a_request_switch_older_chunks_after_the_answer():
    engine = make_engine(chunk_context="prefix", exact_first_chunk=False)
    generate(engine, prompt([A, X]), SamplingParams(max_tokens=1))  # stored after the answer
    generate(engine, prompt([B, Y]), SamplingParams(max_tokens=1))  # B joins: A is re-encoded after it
    engine.store.flush()
    a = engine.plan(prompt([X, A]), "blend").chunks[1]
    assert engine.keys.lead_ids(A) == B + SEP and a.kv is not None and engine.neighbour_reencodes == 1


def test_the_old_kv_is_served_until_the_new_kv_is_stored(tmp_path):
    engine = make_engine(chunk_context="prefix", local_disk=str(tmp_path))
    ids = prompt([B, A])  # A second: looked up by its chunk key
    grow(engine, "kb", [A, X])
    with engine.namespace("kb"):
        old = engine.keys.chunk_key(A, CONTEXT)
        new = engine.keys.chunk_key(A, CONTEXT, engine.keys.lead_after([B]))
    grow(engine, "kb", [B, Y])
    gate = threading.Event()
    engine.store.after_writes(gate.wait)  # holds the background writer: nothing behind it is written
    try:
        assert reencode(engine, "kb", [B, Y]) == 1
        assert new in engine.store.tier("memory") and new not in engine.store.tier("disk")
        with engine.namespace("kb"):
            a = engine.plan(ids, "blend").chunks[1]
        assert a.key == old and a.kv is not None  # the old KV: a hit, not a miss
    finally:
        gate.set()
    engine.store.flush()
    assert new in engine.store.tier("disk")
    with engine.namespace("kb"):
        plan = engine.plan(ids, "blend")
    assert plan.chunks[1].key == new and plan.chunks[1].kv is not None and plan.hits == 2
    assert engine.neighbour_reencodes == 1


def test_a_chunk_switches_only_to_a_much_closer_one():
    n = A[:10] + list(range(200, 214))  # a little like A
    closer = A[:11] + list(range(230, 243))  # a little more, by less than the margin
    index = NeighbourIndex()
    index.add([A, n, X])
    assert index.neighbour_of(A) == n
    index.add([closer])
    assert index.waiting() == []
    index.add([B])
    assert index.waiting() == [(A, B, [B])] and index.neighbour_of(A) == n
    assert not index.promote(A, closer) and index.promote(A, B) and index.neighbour_of(A) == B
    assert not index.promote(A, B)  # switched already (by another process): nothing changes


def test_another_namespaces_chunk_never_becomes_a_neighbour():
    engine = make_engine(chunk_context="prefix")
    grow(engine, "alice", [A, X])
    grow(engine, "bob", [B, Y])  # closer to A than anything of Alice's, but Bob's
    grow(engine, "alice", [C, Z])
    for ns, cs in (("alice", [C, Z]), ("bob", [B, Y])):
        reencode(engine, ns, cs)
    engine.store.flush()
    alice, bob = engine.indexes.get("alice"), engine.indexes.get("bob")
    assert alice.neighbour_of(A) == C and bob.neighbour_of(B) is None
    assert sorted(alice.chunks) == sorted([A, X, C, Z]) and sorted(bob.chunks) == sorted([B, Y])
    assert engine.neighbour_reencodes == 1


def test_an_index_written_before_chunks_could_switch_loads_and_grows(tmp_path):
    (tmp_path / "neighbours.json").write_text(json.dumps(
        {"format": "kvblend-neighbours-1", "chunks": [A, X], "neighbour": [-1, -1]}))  # no "pending"
    engine = make_engine(chunk_context="prefix", local_disk=str(tmp_path))
    assert len(engine.keys.neighbours) == 2 and engine.keys.neighbours.waiting() == []
    engine.index_collection([prompt([B, Y])])
    engine.precompute(prompt([B, Y]))
    assert engine.reencode_neighbours(prompt([B, Y])) == 1
    engine.store.flush()
    # The default namespace, outside any `namespace()`: the engine's next plan uses the new key.
    a = engine.plan(prompt([B, A]), "blend").chunks[1]
    assert a.key == engine.keys.chunk_key(A, CONTEXT, engine.keys.lead_after([B])) and a.kv is not None
    saved = json.loads((tmp_path / "neighbours.json").read_text())
    assert saved["neighbour"][0] == saved["chunks"].index(B) and saved["pending"] == [-1] * 4


@pytest.mark.parametrize("pending", ["[5, -1]", "[-1]", "[0.5, -1]", "null"])
def test_a_bad_pending_field_is_a_clear_error(pending):
    text = f'{{"format": "kvblend-neighbours-1", "chunks": [[1], [2]], "neighbour": [-1, -1], "pending": {pending}}}'
    with pytest.raises(ValueError, match="neighbour index"):
        NeighbourIndex.from_json(text)


def test_reencodes_run_in_background_batches_and_are_counted_in_metrics(tmp_path, monkeypatch):
    monkeypatch.setattr(scheduler_module, "REENCODE_BATCH", 1)  # one chunk a job: the next job is queued by it
    engine = tiny_engine(local_disk=str(tmp_path / "kv"))
    first = ["The Tesk river flows north past Marrowick into the Grey Sea.",
             "Marrowick glass is blown in the old town by the river gate.", "Ferries cross at dawn."]
    later = ["The Tesk river flows north past Marrowick into the Grey Sea by the old town.",
             "Marrowick glass is blown in the old town by the river gate at night.", "Bread is baked on Sundays."]
    with live_server(engine) as (url, _app):
        def post(docs):
            r = httpx.post(url + "/v1/chunks", json={"documents": docs}, timeout=60)
            assert r.status_code == 200, r.text

        def reencodes():
            return metric(httpx.get(url + "/metrics").text, "kvblend_neighbour_reencodes_total")

        post(first)
        assert reencodes() == 0
        post(later)  # the first two documents each have a much closer one now: re-encoded after the answer
        deadline = time.monotonic() + 60
        while reencodes() < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reencodes() == 2
        index = engine.indexes.get("default")
        assert index.waiting() == [] and [index.neighbour_of(c) for c in ids_of(first[:2])] == ids_of(later[:2])
    engine.close()
