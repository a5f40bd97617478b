"""The server's extensions and its answers to malformed input, over raw HTTP."""

import time

import httpx
import pytest
from serving import MODEL_NAME, live_server

DOCS = ["Marrowick is a town on the Tesk river.", "The Tesk river flows north into the Grey Sea."]
KEYS = {"alice": "sk-alice", "bob": "sk-bob"}


@pytest.fixture(scope="module")
def server():
    with live_server(api_keys=list(KEYS.values()), max_tokens=32, max_documents=4, max_body_bytes=20_000) as s:
        yield s


def http(server, who="alice"):
    return httpx.Client(base_url=server[0], timeout=60, headers={"Authorization": f"Bearer {KEYS[who]}"})


def complete(c, **body):
    return c.post("/v1/completions", json={"model": MODEL_NAME, "max_tokens": 3, "temperature": 0, **body})


def assert_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def test_chunks_precompute_list_hit_and_delete(server):
    c = http(server)
    r = c.post("/v1/chunks", json={"documents": DOCS, "namespace": "kb"})
    assert r.status_code == 200, r.text
    stored = r.json()
    assert stored["stored_new"] == 2 and [d["stored"] for d in stored["data"]] == [True, True]
    keys = [d["key"] for d in stored["data"]]
    assert all(d["n_tokens"] > 0 for d in stored["data"])
    assert c.post("/v1/chunks", json={"documents": DOCS, "namespace": "kb"}).json()["stored_new"] == 0
    listed = c.get("/v1/chunks", params={"namespace": "kb"}).json()["data"]
    assert {d["key"] for d in listed} == set(keys)
    hit = complete(c, prompt="Where is Marrowick?", documents=DOCS[::-1], namespace="kb").json()["kvblend"]
    assert hit["chunk_hits"] == 2 and hit["chunk_misses"] == 0 and hit["reused_tokens"] > 0
    assert c.delete(f"/v1/chunks/{keys[0]}", params={"namespace": "kb"}).json() == {"key": keys[0], "deleted": True}
    assert_error(c.delete(f"/v1/chunks/{keys[0]}", params={"namespace": "kb"}), 404, "key")
    # Second in the prompt: the first chunk comes exact from the prefix cache, never looked up.
    after = complete(c, prompt="Where is Marrowick?", documents=DOCS[::-1], namespace="kb").json()["kvblend"]
    assert after["chunk_hits"] == 1 and after["chunk_misses"] == 1
    assert [d["key"] for d in c.get("/v1/chunks", params={"namespace": "kb"}).json()["data"]] == [keys[1]]


def test_tenants_never_share_cached_kv(server):
    alice, bob = http(server, "alice"), http(server, "bob")
    docs = ["Only Alice knows this passage.", "And this one."]
    keys = [d["key"] for d in alice.post("/v1/chunks", json={"documents": docs}).json()["data"]]
    assert complete(alice, prompt="Q?", documents=docs).json()["kvblend"]["chunk_hits"] == 2
    bob_view = complete(bob, prompt="Q?", documents=docs).json()["kvblend"]
    assert bob_view["chunk_hits"] == 0 and bob_view["chunk_misses"] == 2 and bob_view["prefix_hit_tokens"] == 0
    assert not set(keys) & {d["key"] for d in bob.get("/v1/chunks").json()["data"]}
    assert_error(bob.delete(f"/v1/chunks/{keys[0]}"), 404)
    assert {d["key"] for d in alice.get("/v1/chunks").json()["data"]} >= set(keys)
    # An explicit namespace is a sub-space of the key's own: Bob cannot name his way into Alice's.
    assert complete(bob, prompt="Q?", documents=docs, namespace="default").json()["kvblend"]["chunk_hits"] == 0


def test_auth(server):
    open_client = httpx.Client(base_url=server[0], timeout=30)
    err = assert_error(open_client.get("/v1/models"), 401)
    assert err["type"] == "authentication_error"
    assert_error(open_client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x"},
                                  headers={"Authorization": "Bearer sk-nope"}), 401)
    assert_error(open_client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x"},
                                  headers={"Authorization": "Basic sk-alice"}), 401)
    assert open_client.get("/health").json()["status"] == "ok"  # probes need no key


RAW_BAD = [
    (b"{", "invalid_json"),
    (b"", "invalid_json"),
    (b"\xff\xfe{}", "invalid_utf8"),
    (b'{"model": "\xc3\x28"}', "invalid_utf8"),
    (b"[1, 2]", "invalid_json"),
    (b'"just a string"', "invalid_json"),
    (b'{"model": "tiny-llama", "prompt": "a", "temperature": NaN}', "invalid_json"),
    (b'{"model": "tiny-llama", "prompt": "\\ud800"}', "invalid_json"),
    (b"[" * 100_00 + b"]" * 100_00, "invalid_json"),
]


@pytest.mark.parametrize("body,code", RAW_BAD)
def test_malformed_bodies(server, body, code):
    r = http(server).post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert assert_error(r, 400)["code"] == code


BAD_FIELDS = [
    ({"prompt": "hi"}, "model"),
    ({"model": MODEL_NAME}, "prompt"),
    ({"model": 5, "prompt": "hi"}, "model"),
    ({"model": MODEL_NAME, "prompt": 5}, None),
    ({"model": MODEL_NAME, "prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 10**40}, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 33}, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": "hi", "temperature": 1e308}, "temperature"),
    ({"model": MODEL_NAME, "prompt": "hi", "top_p": 0}, "top_p"),
    ({"model": MODEL_NAME, "prompt": "hi", "seed": -3}, "seed"),
    ({"model": MODEL_NAME, "prompt": "hi", "seed": 2**70}, "seed"),
    ({"model": MODEL_NAME, "prompt": "hi", "stop": [""]}, "stop"),
    ({"model": MODEL_NAME, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": MODEL_NAME, "prompt": "hi", "stream": "yes"}, "stream"),
    ({"model": MODEL_NAME, "prompt": "hi", "logprobs": 30}, "logprobs"),
    ({"model": MODEL_NAME, "prompt": ["a", "b"]}, None),
    ({"model": MODEL_NAME, "prompt": []}, "prompt"),
    ({"model": MODEL_NAME, "prompt": [1, True]}, None),
    ({"model": MODEL_NAME, "prompt": [1, 2**64]}, "prompt"),
    ({"model": MODEL_NAME, "prompt": [1, 2], "documents": ["a"]}, "documents"),
    ({"model": MODEL_NAME, "prompt": "q", "documents": ["a"] * 5}, "documents"),
    ({"model": MODEL_NAME, "prompt": "q", "documents": [""]}, "documents.0"),
    ({"model": MODEL_NAME, "prompt": "q", "documents": "a"}, "documents"),
    ({"model": MODEL_NAME, "prompt": "q", "kvblend": {"mode": "fast"}}, "kvblend.mode"),
    ({"model": MODEL_NAME, "prompt": "q", "kvblend": {"recompute_ratio": 1.5}}, "kvblend.recompute_ratio"),
    ({"model": MODEL_NAME, "prompt": "q", "kvblend": {"ratio": 0.5}}, "kvblend.ratio"),
    ({"model": MODEL_NAME, "prompt": "q", "namespace": "../other"}, "namespace"),
    ({"model": MODEL_NAME, "prompt": "word " * 2000}, "prompt"),
    ({"model": MODEL_NAME, "prompt": "hi", "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"model": MODEL_NAME, "prompt": "hi", "logit_bias": {"5": 10}}, "logit_bias"),
    ({"model": MODEL_NAME, "prompt": "hi", "tools": [{"type": "function"}]}, "tools"),
    ({"model": MODEL_NAME, "prompt": "hi", "response_format": {"type": "json_object"}}, "response_format"),
    ({"model": MODEL_NAME, "prompt": "hi", "best_of": 3}, "best_of"),
    ({"model": MODEL_NAME, "prompt": "hi", "suffix": "end"}, "suffix"),
]


@pytest.mark.parametrize("body,param", BAD_FIELDS)
def test_malformed_fields(server, body, param):
    r = http(server).post("/v1/completions", json=body)
    assert_error(r, 400, param)


def test_malformed_chat_and_chunks(server):
    c = http(server)
    assert_error(c.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": [{"role": "robot",
                                                                                        "content": "x"}]}), 400)
    assert_error(c.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": [{"role": "user"}]}), 400)
    assert_error(c.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": "hi"}), 400, "messages")
    assert_error(c.post("/v1/chat/completions", json={"model": MODEL_NAME, "documents": ["d"],
                                                      "messages": [{"role": "system", "content": "x"}]}), 400,
                 "messages")
    assert_error(c.post("/v1/chunks", json={"documents": []}), 400, "documents")
    assert_error(c.post("/v1/chunks", json={"documents": ["a # #  b"]}), 400, "documents")  # holds the separator ids
    assert_error(c.post("/v1/chunks", json={"documents": ["x"] * 5}), 400, "documents")
    assert_error(c.get("/v1/chunks", params={"namespace": "a/b"}), 400)
    assert_error(c.get("/v1/nothing"), 404)
    assert_error(c.put("/v1/completions"), 405)


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": "How many arches?"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "How many arches?"}]}),
    ("/v1/chunks", {}),
])
@pytest.mark.parametrize("doc,why", [("Marrowick # #  lies on the Tesk.", "document 2 holds the separator"),
                                     ("\x06\x04", "document 2 holds no tokens")])  # the tokenizer keeps nothing of it
def test_a_document_that_would_not_be_one_chunk_is_refused_on_every_route(server, route, body, doc, why):
    docs = ["The bridge has seven arches.", doc]
    r = http(server).post(route, json={"model": MODEL_NAME, "max_tokens": 2, **body, "documents": docs})
    assert_error(r, 400, "documents")
    assert why in r.json()["error"]["message"]


def test_body_size_limit(server):
    c = http(server)
    assert_error(c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x" * 30_000}), 413)

    def chunked():  # no Content-Length: the limit holds while reading
        for _ in range(30):
            yield b" " * 1000
    assert_error(c.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"}), 413)


def test_health_metrics_and_page(server):
    c = http(server)
    complete(c, prompt="warm", documents=["one passage"])
    assert httpx.get(server[0] + "/v1/models").status_code == 401
    # The answer's new passage is stored by a write-behind job queued as the answer ends: on a busy
    # machine it may still wait for the engine thread when /health is asked. Nothing stays queued.
    deadline = time.monotonic() + 30
    while (health := c.get("/health").json())["queue_depth"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert health["model"] == MODEL_NAME and health["queue_depth"] == 0 and health["running"] == 0
    assert health["chat_template"] == "model" and health["store_bytes"] > 0
    text = c.get("/metrics").text
    for name in ("kvblend_http_requests_total", "kvblend_http_errors_total", "kvblend_ttft_seconds_bucket",
                 "kvblend_e2e_seconds_bucket", "kvblend_queue_depth", "kvblend_tokens_reused_total",
                 "kvblend_tokens_recomputed_total", "kvblend_chunk_hits_total", "kvblend_chunk_misses_total",
                 "kvblend_store_bytes", "kvblend_kv_bytes"):
        assert name in text, name
    assert 'kvblend_http_requests_total{code="200",method="POST",route="/v1/completions"}' in text
    assert 'kvblend_http_errors_total{code="401",route="/v1/models"}' in text
    page = c.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "/v1/completions" in page.text and "/v1/chunks" in page.text
