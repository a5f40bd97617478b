"""Documents posted to /v1/chunks join their namespace's own collection: each is precomputed after
its most similar chunk of that namespace, never after another tenant's."""

import hashlib

import httpx
import pytest
from serving import MODEL_NAME, default_tokenizer, live_server, tiny_engine

from kvblend.engine import engine as engine_module

KEYS = {"alice": "sk-alice", "bob": "sk-bob"}
# Bob's passages are near copies of Alice's: one index for everyone would pair them across tenants.
ALICE = ["The Tesk river flows north past Marrowick into the Grey Sea.",
         "Marrowick glass is blown in the old town by the river gate.",
         "Ferries cross the Grey Sea at dawn."]
BOB = ["The Tesk river flows north past Ollin into the Grey Sea.",
       "Ollin glass is blown in the old town by the river gate.",
       "Old town glass of Ollin is sold by the river gate at dawn.",
       "Ferries cross the Grey Sea from Ollin."]


def namespace_of(who: str) -> str:
    return "key-" + hashlib.sha256(KEYS[who].encode()).hexdigest()[:16]


def post(url, who, docs, **body):
    r = httpx.post(url + "/v1/chunks", json={"documents": docs, **body}, timeout=60,
                   headers={"Authorization": f"Bearer {KEYS[who]}"})
    assert r.status_code == 200, r.text
    return r.json()


def ask(url, who, docs):
    r = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {KEYS[who]}"}, timeout=60,
                   json={"model": MODEL_NAME, "prompt": "Where does the Tesk flow?", "max_tokens": 2,
                         "temperature": 0, "documents": docs})
    assert r.status_code == 200, r.text
    return r.json()["kvblend"]


def ids_of(docs):
    tok = default_tokenizer()
    return [tok.encode(d, add_special_tokens=False) for d in docs]


@pytest.fixture()
def leads(monkeypatch):
    """What every chunk the engine encodes was precomputed after (its neighbour and a separator)."""
    seen = []
    encode = engine_module.encode_chunks

    def spy(runner, context, chunk_ids, lead_ids=None, adapter=None):
        seen.extend(zip(map(list, chunk_ids), lead_ids or [[]] * len(chunk_ids)))
        return encode(runner, context, chunk_ids, lead_ids, adapter)

    monkeypatch.setattr(engine_module, "encode_chunks", spy)
    return seen


def test_no_chunk_is_precomputed_after_another_namespaces_chunk(tmp_path, leads):
    engine = tiny_engine(local_disk=str(tmp_path / "kv"))
    with live_server(engine, api_keys=list(KEYS.values())) as (url, _app):
        post(url, "alice", ALICE)
        post(url, "bob", BOB[:1])  # alone in his collection: nothing of his own is like it
        post(url, "bob", BOB[1:])
        post(url, "bob", ALICE[:1], namespace="sub")  # a sub-namespace is a collection of its own
        engine.store.flush()
        sep = engine.sep_ids
        own = {"alice": ids_of(ALICE), "bob": ids_of(BOB), "sub": ids_of(ALICE[:1])}
        after = {tuple(chunk): lead[:-len(sep)] for chunk, lead in leads if lead}
        alice, bob = own["alice"], own["bob"]
        # Bob's first document came alone: nothing of his own was like it, so it is plain,
        # though Alice's twin of it was indexed already.
        assert tuple(bob[0]) not in after
        # Bob's later ones follow Bob's; Alice's follow Alice's.
        assert [after.get(tuple(c)) for c in bob[1:]] == [bob[2], bob[1], bob[0]]
        assert [after.get(tuple(c)) for c in alice] == [alice[2], alice[0], alice[0]]
        for chunk, lead in after.items():
            assert lead in (bob if list(chunk) in bob else alice), "precomputed after another namespace's chunk"
        # Each namespace's index holds its own chunks only, in its own file.
        for who, ns in (("alice", namespace_of("alice")), ("bob", namespace_of("bob")),
                        ("sub", namespace_of("bob") + "/sub")):
            index = engine.indexes.get(ns)
            assert sorted(index.chunks) == sorted(own[who])
        assert len(list((tmp_path / "kv" / "neighbours").glob("*.json"))) == 3
        # Asked with their documents, each tenant hits the chunks precomputed after neighbours.
        assert ask(url, "bob", BOB[::-1])["chunk_hits"] == 4
        assert ask(url, "alice", ALICE[::-1])["chunk_hits"] == 3
    engine.close()


def test_a_restarted_server_finds_the_namespace_indexes_and_hits(tmp_path):
    first = tiny_engine(local_disk=str(tmp_path / "kv"), local_cpu=False)
    with live_server(first, api_keys=list(KEYS.values())) as (url, _app):
        post(url, "bob", BOB)
    first.close()
    again = tiny_engine(local_disk=str(tmp_path / "kv"), local_cpu=False)
    with live_server(again, api_keys=list(KEYS.values())) as (url, _app):
        got = ask(url, "bob", BOB[::-1])
        assert got["chunk_hits"] == 4 and got["chunk_tiers"] == ["prefix", "disk", "disk", "disk"]
    again.close()


def test_a_corrupt_index_is_logged_and_its_chunks_served_plain(tmp_path, caplog):
    first = tiny_engine(local_disk=str(tmp_path / "kv"), local_cpu=False)
    with live_server(first, api_keys=list(KEYS.values())) as (url, _app):
        post(url, "bob", BOB)
    first.close()
    (path,) = (tmp_path / "kv" / "neighbours").glob("*.json")
    path.write_text('{"format": "kvblend-neighbours-1", "chunks": [[1]]')  # cut short
    again = tiny_engine(local_disk=str(tmp_path / "kv"), local_cpu=False)
    with live_server(again, api_keys=list(KEYS.values())) as (url, _app):
        got = ask(url, "bob", BOB)
        assert got["chunk_tiers"][0] == "prefix" and got["chunk_misses"] == 3  # served, plain
        assert any("cannot be read" in r.getMessage() for r in caplog.records)
        # Posted again, the documents are indexed again (the same neighbours): the KV stored under
        # those keys before is found, nothing is encoded again.
        assert post(url, "bob", BOB)["stored_new"] == 0
        assert ask(url, "bob", BOB[::-1])["chunk_hits"] == 4
    again.close()


def test_documents_first_met_in_a_request_are_indexed_for_the_next(tmp_path, leads):
    engine = tiny_engine()
    with live_server(engine, api_keys=list(KEYS.values())) as (url, _app):
        first = ask(url, "bob", BOB)
        assert first["chunk_hits"] == 0 and first["chunk_misses"] == len(BOB)
        # After the answer, the documents joined Bob's collection and were precomputed after
        # their neighbours there; the next request with them, in any order, hits them all.
        again = ask(url, "bob", BOB[::-1])
        assert again["chunk_hits"] == len(BOB) and again["chunk_misses"] == 0
        bob = ids_of(BOB)
        assert sorted(engine.indexes.get(namespace_of("bob")).chunks) == sorted(bob)
        after = {tuple(chunk): lead[:-len(engine.sep_ids)] for chunk, lead in leads if lead}
        assert [after.get(tuple(c)) for c in bob] == [bob[3], bob[2], bob[1], bob[0]]
        # Alice never met them: nothing of Bob's is in her collection or her cache.
        assert engine.indexes.get(namespace_of("alice")) is None
        assert ask(url, "alice", BOB)["chunk_hits"] == 0
    engine.close()
