"""The server under concurrent load: no request lost, none mixed (each greedy answer equals the same
request run alone), queue and KV empty afterwards; clients that leave mid-request; a full queue."""

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
from serving import MODEL_NAME, live_server

PASSAGES = [f"Passage {i}: the {w} of Marrowick is kept in the {v} hall." for i, (w, v) in enumerate(
    [("glass", "north"), ("salt", "river"), ("iron", "old"), ("wool", "market"), ("bread", "guild"), ("ink", "east")])]
MODES = ["blend", "full", "prefix", "reuse"]


def bodies(n=16):
    out = []
    for i in range(n):
        docs = [PASSAGES[(i + j) % len(PASSAGES)] for j in range(3)][:: 1 if i % 2 else -1]
        body = {"prompt": f"Question {i}: where is the {['glass', 'salt', 'iron'][i % 3]} kept?", "max_tokens": 24,
                "extra_body": {"documents": docs, "kvblend": {"mode": MODES[i % 4]}}}
        if i % 5 == 4:
            body.update(temperature=0.8, seed=i)  # seeded sampling must not depend on the batch either
        else:
            body.update(temperature=0)
        out.append(body)
    return out


def stream_text(client, body):
    pieces, finish = [], None
    for chunk in client.completions.create(model=MODEL_NAME, stream=True, **body):
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    return "".join(pieces), finish


def wait_idle(url, timeout=60):
    """The server's state once it has nothing running (bounded: a hang fails the test)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = httpx.get(url + "/health").json()
        if health["running"] == 0 and health["queue_depth"] == 0:  # running: prefilling too
            return health
        time.sleep(0.05)
    raise AssertionError(f"server still busy after {timeout}s: {health}")


def metric(url, name):
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_16_concurrent_streams_each_equal_to_running_alone():
    with live_server(max_queue=32, max_batch=32, max_tokens=64) as (url, app):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        reqs = bodies()
        for body in reqs:  # warm the chunk and prefix caches, so both passes below see the same store
            stream_text(client, body)
        alone = [stream_text(client, body) for body in reqs]
        assert app.state.scheduler.peak_batch == 1
        with ThreadPoolExecutor(len(reqs)) as pool:
            together = [f.result(timeout=300) for f in [pool.submit(stream_text, client, b) for b in reqs]]
        assert together == alone
        assert all(text for text, _ in together)
        assert app.state.scheduler.peak_batch > 1  # they really were decoded together
        health = wait_idle(url)
        assert health["kv_bytes"] == 0 and app.state.scheduler.running == []


def test_clients_leaving_mid_request_free_their_kv():
    with live_server(max_tokens=1000) as (url, app):
        body = {"model": MODEL_NAME, "prompt": "Tell me a long story about the sea", "max_tokens": 900,
                "temperature": 0}
        client = httpx.Client(base_url=url, timeout=60)
        # A non-streaming client that leaves while its request is being decoded.
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as sock:
            payload = httpx.Request("POST", url + "/v1/completions", json=body).content
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
            deadline = time.monotonic() + 60
            while httpx.get(url + "/health").json()["running"] < 1:
                assert time.monotonic() < deadline, "the request never started"
                time.sleep(0.01)
        assert wait_idle(url)["kv_bytes"] == 0
        assert metric(url, "kvblend_requests_cancelled_total") == 1
        # Streaming clients that leave after their first token.
        streams = []
        for _ in range(4):
            ctx = client.stream("POST", "/v1/completions", json={**body, "stream": True})
            lines = ctx.__enter__().iter_lines()
            while not next(lines).startswith("data: "):  # the first token has arrived: it is running
                pass
            streams.append(ctx)
        assert httpx.get(url + "/health").json()["running"] >= 1
        for ctx in streams:
            ctx.__exit__(None, None, None)  # the client goes away mid-stream
        assert wait_idle(url)["kv_bytes"] == 0
        assert metric(url, "kvblend_requests_cancelled_total") == 5
        # And the server still answers, correctly.
        ok = client.post("/v1/completions", json={**body, "max_tokens": 5})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5


def test_a_full_queue_answers_429():
    with live_server(max_queue=1, max_batch=1, max_tokens=1000) as (url, app):
        body = {"model": MODEL_NAME, "prompt": "Tell me a long story about the sea", "max_tokens": 900,
                "temperature": 0}
        client = httpx.Client(base_url=url, timeout=120)
        ctx = client.stream("POST", "/v1/completions", json={**body, "stream": True})
        lines = ctx.__enter__().iter_lines()
        while not next(lines).startswith("data: "):  # A runs and holds the only batch slot
            pass
        queued = {}
        waiter = threading.Thread(target=lambda: queued.update(r=httpx.post(
            url + "/v1/completions", json={**body, "max_tokens": 3}, timeout=120)))
        waiter.start()
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health").json()["queue_depth"] < 1:  # B waits in the queue
            assert time.monotonic() < deadline, "B never reached the queue"
            time.sleep(0.01)
        refused = httpx.post(url + "/v1/completions", json=body)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
        ctx.__exit__(None, None, None)  # A leaves; B gets its turn
        waiter.join(timeout=120)
        assert queued["r"].status_code == 200 and queued["r"].json()["usage"]["completion_tokens"] == 3
        assert wait_idle(url)["kv_bytes"] == 0


def test_a_long_full_prefill_runs_in_pieces_beside_a_stream_and_answers_as_one_pass():
    with live_server(max_tokens=64) as (url, app):
        scheduler = app.state.scheduler
        scheduler.prefill_piece = 512  # the runner's key block: the 800-token prompt takes two pieces
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        long = {"prompt": list(range(1000, 1800)), "max_tokens": 8, "temperature": 0}
        one_pass = client.completions.create(model=MODEL_NAME, extra_body={"kvblend": {"mode": "prefix"}}, **long)
        assert scheduler.prefill_pieces == 0
        short = {"prompt": "Tell me a story", "max_tokens": 40, "temperature": 0}
        alone = stream_text(client, short)
        with ThreadPoolExecutor(2) as pool:
            beside = pool.submit(stream_text, client, short)
            pieces = client.completions.create(model=MODEL_NAME, extra_body={"kvblend": {"mode": "full"}}, **long)
            assert beside.result(timeout=120) == alone
        assert scheduler.prefill_pieces == 2
        assert pieces.choices[0].text == one_pass.choices[0].text
        assert pieces.model_extra["kvblend"]["recomputed_tokens"] == 800
        assert wait_idle(url)["kv_bytes"] == 0
