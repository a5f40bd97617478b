"""A master of the Redis Cluster killed under load: every request is answered, each with its own
output, no bad entry is served, the writes lost while its slots had no master are written again
once its replica has taken over, its chunks are hits again, and /metrics counts the fault."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from redis_cluster import redis_cluster  # noqa: F401  (fixture)
from serving import MODEL_NAME, live_server, tiny_engine
from test_server_faults import metric

DOCS = [f"Harbour {name} lies on the {river} river, {km} km from the sea." for name, river, km in [
    ("Alnwick", "Tesk", 12), ("Brora", "Ollin", 40), ("Cullen", "Grey", 7), ("Dunoon", "Marrow", 55),
    ("Elgin", "Tesk", 31), ("Forres", "Ollin", 18), ("Girvan", "Grey", 63), ("Huntly", "Marrow", 9),
    ("Irvine", "Tesk", 27), ("Keith", "Ollin", 71), ("Largs", "Grey", 14), ("Moffat", "Marrow", 48)]]
# Each completion asks its own question, of its own length, over its own pair of documents: an answer
# carries its prompt's length, so one that went to another request would show it.
ASKS = [("How far from the sea" + " and the hills" * (3 * i) + f" is harbour {i}?", [DOCS[i], DOCS[i + 6]])
        for i in range(len(DOCS) // 2)]
LOAD_S_AFTER_FAILOVER = 1.0  # load goes on this long after the replica took over
MAX_LOAD_S = 120.0


def ask(url: str, i: int) -> httpx.Response:
    question, docs = ASKS[i]
    return httpx.post(url + "/v1/completions", timeout=120, json={
        "model": MODEL_NAME, "prompt": question, "max_tokens": 4, "temperature": 0, "documents": docs})


def test_a_master_killed_under_load_loses_no_request(redis_cluster):  # noqa: F811
    redis_cluster.flush()
    engine = tiny_engine(remote_url=redis_cluster.url, local_cpu=False)  # every read goes to the cluster
    engine.store.tier("redis").retry_s = 0.3  # a down node is tried again soon: the test is short
    with live_server(engine, catch_up_s=0.1) as (url, _):
        posted = httpx.post(url + "/v1/chunks", json={"documents": DOCS}, timeout=120).json()
        keys = [d["key"] for d in posted["data"]]
        assert all("redis" in d["tiers"] for d in posted["data"]), posted
        # What each request answers with all its chunks read.
        hit = [ask(url, i).json() for i in range(len(ASKS))]
        assert all(h["kvblend"]["chunk_misses"] == 0 for h in hit)
        lengths = [h["usage"]["prompt_tokens"] for h in hit]
        assert len(set(lengths)) == len(ASKS)
        # The master holding most of the documents' entries goes; its replica takes over.
        masters = [redis_cluster.master_of(f"kvblend:{k}") for k in keys]
        killed = max(set(masters), key=masters.count)
        on_killed = [k for k, m in zip(keys, masters) if m == killed]
        time.sleep(0.3)  # the replica has what was written (replication is asynchronous)

        results: list[tuple[str, int, int, dict]] = []  # (kind, request, status, body)
        stop, lock = threading.Event(), threading.Lock()

        def load(worker: int) -> None:
            n = 0
            while not stop.is_set():
                i = (worker * 2 + n) % len(ASKS)
                if n % 3 == 2:  # now and then new documents too: written during the window or after
                    doc = f"Worker {worker} logged note {n} about harbour {i}."
                    r = httpx.post(url + "/v1/chunks", json={"documents": [doc]}, timeout=120)
                    kind = "chunks"
                else:
                    r, kind = ask(url, i), "completion"
                with lock:
                    results.append((kind, i, r.status_code, r.json()))
                n += 1

        with ThreadPoolExecutor(3) as pool:
            workers = [pool.submit(load, w) for w in range(3)]
            started = time.monotonic()
            while len(results) < 3:  # load is on before the fault
                time.sleep(0.05)
            redis_cluster.kill(killed)
            try:
                redis_cluster.wait_healthy(timeout_s=60)
                took_over = time.monotonic()
                while time.monotonic() < took_over + LOAD_S_AFTER_FAILOVER and time.monotonic() < started + MAX_LOAD_S:
                    time.sleep(0.05)
            finally:
                stop.set()
                for w in workers:
                    w.result()
        try:
            # Every request answered, none with a server error, none with a bad entry.
            assert [r for r in results if r[2] != 200] == [], [r for r in results if r[2] != 200][:3]
            completions = [(i, body) for kind, i, _, body in results if kind == "completion"]
            assert all(body["kvblend"]["bad_entries"] == 0 for _, body in completions)
            # Each its own output: an answer to its own prompt and, where its KV came from where the
            # reference's did (every chunk read, from the same tiers, the same exact prefix), exactly
            # the reference's answer. Otherwise it reads other KV (chunks recomputed in the window,
            # or rows the prefix cache holds since): no exact reference, and the tiny random model's
            # near-flat logits turn on such differences.
            matched = 0
            for i, body in completions:
                assert body["usage"]["prompt_tokens"] == lengths[i]
                same_sources = all(body["kvblend"][k] == hit[i]["kvblend"][k]
                                   for k in ("chunk_tiers", "prefix_hit_tokens", "recomputed_tokens"))
                if same_sources:
                    assert body["choices"][0]["text"] == hit[i]["choices"][0]["text"]
                    matched += 1
            assert matched > 0
            # The fault happened to requests: the down shard's chunks read as empty (recomputed).
            assert any(body["kvblend"]["chunk_misses"] > 0 for _, body in completions)
            # Writes lost in the window are written again; then nothing is owed.
            deadline = time.monotonic() + 60
            while metric(httpx.get(url + "/metrics").text, "kvblend_store_catch_up_pending") > 0:
                assert time.monotonic() < deadline, "writes owed to the cluster were never written"
                time.sleep(0.1)
            text = httpx.get(url + "/metrics").text
            assert metric(text, 'kvblend_store_tier_unreachable_total{tier="redis"}') >= 1
            assert metric(text, "kvblend_store_catch_up_writes_total") >= 1
            assert metric(text, "kvblend_bad_entries_total") == 0
            new_docs = [body["data"][0]["key"] for kind, _, _, body in results if kind == "chunks"]
            assert all(engine.store.tier("redis").header(k) is not None for k in new_docs)
            # The killed shard's chunks (replicated, or stored again) are hits, and answers as before.
            assert on_killed and all(engine.store.tier("redis").header(k) is not None for k in on_killed)
            for i in range(len(ASKS)):
                again = ask(url, i).json()
                assert again["kvblend"]["chunk_misses"] == 0
                assert again["choices"][0]["text"] == hit[i]["choices"][0]["text"]
        finally:
            engine.close()
            redis_cluster.restart(killed)
            redis_cluster.wait_healthy()
