"""Two `kvblend serve` processes on one Redis (a server, or a 3-master cluster): a document stored
through one is a hit on the other.

Both replicas are real subprocesses (the command a user runs) loading one tiny model folder, so
their model fingerprints, and so their cache keys, agree only because the weights do."""

import hashlib
import time

import httpx
import pytest
from redis_cluster import redis_cluster  # noqa: F401  (fixture)
from redis_server import RedisServer, redis_server  # noqa: F401  (fixture)
from serving import MODEL_NAME, default_tokenizer, live_server, serve_process, stop, tiny_engine, wait_healthy
from tiny_models import tiny_hf

KEYS = {"alice": "sk-alice", "bob": "sk-bob"}
DOCS = ["Marrowick is a town on the Tesk river.", "The Tesk river flows north into the Grey Sea.",
        "Grey Sea ferries leave Marrowick at dawn."]


def start_replica(warm_python, folder, redis_url: str):
    # No minimum recompute budget: the short prompts here check that chunks are reused.
    return serve_process(warm_python, folder, "--remote-url", redis_url, "--min-recompute-tokens", "0",
                         *(a for key in KEYS.values() for a in ("--api-key", key)))


@pytest.fixture(scope="module", params=["server", "cluster"])
def replicas(request, tmp_path_factory, warm_python):
    tok = default_tokenizer()
    folder = tmp_path_factory.mktemp("model") / "tiny-llama"
    tiny_hf("llama", vocab_size=len(tok), max_position_embeddings=1024).save_pretrained(folder)
    tok.save_pretrained(folder)
    if request.param == "server":
        redis = RedisServer().start()
    else:
        redis = request.getfixturevalue("redis_cluster")
        redis.flush()
    procs = []
    try:
        # Started together: each loads the model while the other does.
        procs = [start_replica(warm_python, folder, redis.url) for _ in range(2)]
        for proc, url in procs:
            wait_healthy(proc, url)
        yield [url for _, url in procs], redis
    finally:
        for proc, _ in procs:
            stop(proc)
        if request.param == "server":
            redis.kill()


def stored(server, key: str) -> bool:
    """Whether `server` (a Redis server or cluster) holds the entry of `key`, header and all."""
    return bool(server.client().hexists(f"kvblend:{key}", "h"))


def wait_in_redis(server, keys: list[str], why: str) -> None:
    """Until every key's entry is in `server` (60 s at most, then fail saying `why`)."""
    deadline = time.monotonic() + 60
    while not all(stored(server, k) for k in keys):
        assert time.monotonic() < deadline, why
        time.sleep(0.05)


def http(url: str, who: str = "alice") -> httpx.Client:
    return httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {KEYS[who]}"})


def complete(c: httpx.Client, **body) -> dict:
    r = c.post("/v1/completions", json={"model": "tiny", "prompt": "Where do the ferries go?", "max_tokens": 6,
                                        "temperature": 0, "documents": DOCS, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_document_stored_through_one_replica_is_a_hit_on_the_other(replicas):
    (url_a, url_b), redis = replicas
    a, b = http(url_a), http(url_b)
    r = a.post("/v1/chunks", json={"documents": DOCS, "namespace": "kb"})
    assert r.status_code == 200, r.text
    assert r.json()["stored_new"] == len(DOCS)
    # /v1/chunks answers once its chunks are written behind to Redis too (each entry in one write).
    keys = [d["key"] for d in r.json()["data"]]
    assert all(stored(redis, key) for key in keys)
    # Indexed in the key's namespace, in Redis: B looks the chunks up by the neighbours A chose.
    ns = "key-" + hashlib.sha256(KEYS["alice"].encode()).hexdigest()[:16] + "/kb"
    assert redis.client().exists(f"kvblend:{{neighbours:{ns}}}")
    on_b = complete(b, namespace="kb")
    assert on_b["kvblend"]["chunk_hits"] == len(DOCS) and on_b["kvblend"]["chunk_misses"] == 0, on_b["kvblend"]
    assert on_b["kvblend"]["reused_tokens"] > 0
    on_a = complete(a, namespace="kb")
    assert on_a["kvblend"]["chunk_hits"] == len(DOCS)
    # Blending the KV read back from Redis gives what blending the KV in A's memory gives.
    assert on_b["choices"][0]["text"] == on_a["choices"][0]["text"]
    assert on_b["usage"]["completion_tokens"] == on_a["usage"]["completion_tokens"] >= 1
    metrics_b = httpx.get(url_b + "/metrics", timeout=30).text
    assert f"kvblend_chunk_hits_total {float(len(DOCS))}" in metrics_b, metrics_b


def test_tenants_stay_apart_across_replicas(replicas):
    (url_a, url_b), redis = replicas
    docs = ["Only Alice has stored this passage.", "Nor has anyone else stored this one."]
    r = http(url_a, "alice").post("/v1/chunks", json={"documents": docs})
    assert r.status_code == 200 and r.json()["stored_new"] == len(docs), r.text
    # In Redis when the answer comes, or (a write that timed out on a loaded machine) owed and
    # said so, then written when Redis answers again: either way B finds them once they are there.
    body = r.json()
    assert all("redis" in d["tiers"] for d in body["data"]) or body["catch_up_tiers"] == ["redis"], body
    wait_in_redis(redis, [d["key"] for d in body["data"]], f"chunks never reached Redis: {body}")
    on_b = complete(http(url_b, "alice"), documents=docs)["kvblend"]
    # Found, each: read, exact in the prefix, or (a slow Redis on a loaded machine) recomputed by choice.
    assert on_b["chunk_hits"] == len(docs), f"B: {on_b['chunk_tiers']} {on_b}; post: {body}"
    # Another key, or another namespace of the same key, on the other replica: all misses.
    bob = complete(http(url_b, "bob"), documents=docs)["kvblend"]
    assert bob["chunk_hits"] == 0 and bob["chunk_misses"] == len(docs) and bob["prefix_hit_tokens"] == 0
    elsewhere = complete(http(url_b, "alice"), documents=docs, namespace="other")["kvblend"]
    assert elsewhere["chunk_hits"] == 0 and elsewhere["chunk_misses"] == len(docs)


def test_chunks_answer_after_a_slow_redis_has_them(redis_server):  # noqa: F811
    """In process, with Redis writes made slow: the answer still comes after they land, which is
    what lets a replica hit chunks the moment /v1/chunks has answered."""
    engine = tiny_engine(remote_url=redis_server.url)
    remote = engine.store.tier("redis")
    put = remote.put

    def slow_put(key, kv):
        time.sleep(0.3)  # far longer than the memory write and the HTTP answer take
        return put(key, kv)

    remote.put = slow_put
    with live_server(engine) as (url, _app):
        r = httpx.post(url + "/v1/chunks", json={"documents": DOCS}, timeout=60)
        assert r.status_code == 200, r.text
        keys = [d["key"] for d in r.json()["data"]]
        assert len(keys) == len(DOCS) and all(stored(redis_server, k) for k in keys)
        hit = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": MODEL_NAME, "prompt": "Q?", "max_tokens": 2, "temperature": 0, "documents": DOCS}).json()
        assert hit["kvblend"]["chunk_hits"] == len(DOCS)
    engine.close()  # its last writes land before the Redis fixture stops


def test_chunks_posted_while_redis_is_down_say_so_and_reach_it_when_it_is_back(redis_server):  # noqa: F811
    engine = tiny_engine(remote_url=redis_server.url)
    engine.store.tier("redis").retry_s = 0.0  # try Redis again at the next write
    with live_server(engine, catch_up_s=0.05) as (url, _app):
        redis_server.kill()
        r = httpx.post(url + "/v1/chunks", json={"documents": DOCS}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        # This replica holds them (memory) and says so; Redis does not, yet.
        assert body["catch_up_tiers"] == ["redis"]
        assert [(d["stored"], d["tiers"]) for d in body["data"]] == [(False, ["memory"])] * len(DOCS)
        keys = [d["key"] for d in body["data"]]
        back = RedisServer(redis_server.port).start()  # back, empty
        try:
            wait_in_redis(back, keys, "the chunks never reached Redis once it was back")
            again = httpx.post(url + "/v1/chunks", json={"documents": DOCS}, timeout=60).json()
            assert again["catch_up_tiers"] == [] and all(d["stored"] for d in again["data"])
            assert {tuple(d["tiers"]) for d in again["data"]} == {("memory", "redis")}
        finally:
            engine.close()
            back.kill()
