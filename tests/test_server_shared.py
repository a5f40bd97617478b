"""A collection the operator publishes once (`kvblend store put --namespace NAME`) that every
tenant reads, with `shared_namespace`: tenants hit it and never write into it."""

import hashlib

import httpx
import pytest
from serving import MODEL_NAME, default_tokenizer, live_server, tiny_engine

from kvblend.cli import _settings, build_parser
from kvblend.engine import prompts

KEYS = ["sk-alice", "sk-bob"]
DOCS = ["Marrowick is a town on the Tesk river.", "The Tesk river flows north into the Grey Sea.",
        "Grey Sea ferries leave Marrowick at dawn."]
NEW = "Ollin is a village in the hills."


def publish(kv, docs):
    """What `kvblend store put --namespace published` does with these documents."""
    engine = tiny_engine(local_disk=str(kv), local_cpu=False, namespace="published")
    ids = prompts.chunk_prompt(default_tokenizer(), engine.sep_ids, docs, None).ids
    engine.index_collection([ids])
    engine.precompute(ids)
    engine.close()


def chunk_key(engine, namespace, doc):
    ids = prompts.chunk_prompt(default_tokenizer(), engine.sep_ids, [doc], None).ids
    seg = engine.segments(ids)
    with engine.namespace(namespace):
        return engine.keys.chunk_key(ids[slice(*seg.chunks[0])], engine.keys.context_ids(ids, seg))


def ask(url, key, docs):
    r = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60, json={
        "model": MODEL_NAME, "prompt": "Where do the ferries go?", "max_tokens": 2, "temperature": 0,
        "documents": docs})
    assert r.status_code == 200, r.text
    return r.json()["kvblend"]


@pytest.mark.parametrize("shared", [True, False])
def test_every_tenant_reads_the_published_collection_and_none_writes_it(tmp_path, shared):
    publish(tmp_path / "kv", DOCS)
    engine = tiny_engine(local_disk=str(tmp_path / "kv"), shared_namespace="published" if shared else None)
    with live_server(engine, api_keys=KEYS) as (url, _app):
        for key in KEYS:
            got = ask(url, key, DOCS[::-1])
            if not shared:  # each key its own namespace: nothing published is theirs
                assert got["chunk_hits"] == 0 and got["prefix_hit_tokens"] == 0
                continue
            # The first document comes exact from the published prefix blocks, the others from its chunks.
            assert got["chunk_hits"] == len(DOCS) and got["chunk_misses"] == 0, got
            assert got["chunk_tiers"][0] == "prefix" and got["prefix_hit_tokens"] > 0
        # A document first met in a tenant's request is stored in that tenant's namespace only.
        assert ask(url, KEYS[0], [DOCS[0], NEW])["chunk_misses"] == 1
        # Stored after the answer; a later request is served after that (one queue, in order).
        assert ask(url, KEYS[0], [DOCS[0], NEW])["chunk_misses"] == 0
        engine.store.flush()
        alice = "key-" + hashlib.sha256(KEYS[0].encode()).hexdigest()[:16]  # her key's namespace
        assert chunk_key(engine, alice, NEW) in engine.store
        assert chunk_key(engine, "published", NEW) not in engine.store
        assert chunk_key(engine, "published", DOCS[1]) in engine.store
    engine.close()


def test_namespace_flags_reach_the_settings():
    args = build_parser().parse_args(["store", "put", "a.txt", "--namespace", "published"])
    assert _settings(args).namespace == "published" and _settings(args).shared_namespace is None
    args = build_parser().parse_args(["serve", "--shared-namespace", "published"])
    assert _settings(args).shared_namespace == "published"
