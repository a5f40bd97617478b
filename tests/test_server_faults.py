"""Faults a server user can see without reading the log: bad stored entries and the tier each chunk
came from in every answer, the tiers' counters in /metrics, and a client that went away."""

import logging
import time

import httpx
import pytest
from serving import MODEL_NAME, live_server, tiny_engine
from test_store_engine import damage

DOCS = ["Marrowick is a town on the Tesk river.", "The Tesk river flows north into the Grey Sea.",
        "Grey Sea ferries leave Marrowick at dawn."]


@pytest.fixture()
def disk_server(tmp_path):
    engine = tiny_engine(local_disk=str(tmp_path / "kv"), local_cpu=False)
    with live_server(engine, max_tokens=500) as (url, _app):
        yield url, engine
    engine.close()


def ask(url, **body):
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": "Where do the ferries go?", "max_tokens": 2, "temperature": 0,
        "documents": DOCS, **body})
    assert r.status_code == 200, r.text
    return r.json()["kvblend"]


def metric(text: str, line_start: str) -> float:
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start + " ")]
    assert len(values) == 1, (line_start, text)
    return values[0]


def test_a_bad_entry_shows_in_the_answer_and_in_metrics(disk_server):
    url, engine = disk_server
    keys = [d["key"] for d in httpx.post(url + "/v1/chunks", json={"documents": DOCS}, timeout=60).json()["data"]]
    good = ask(url)
    assert good["chunk_tiers"] == ["prefix", "disk", "disk"] and good["bad_entries"] == 0
    damage(engine, "disk", "corrupt", keys[2])
    bad = ask(url, prompt="And the river?")
    assert bad["bad_entries"] == 1 and bad["chunk_tiers"] == ["prefix", "disk", "miss"]
    text = httpx.get(url + "/metrics").text
    assert metric(text, 'kvblend_store_tier_bad_entries_total{tier="disk"}') == 1
    assert metric(text, "kvblend_bad_entries_total") == 1
    assert metric(text, 'kvblend_store_tier_hits_total{tier="disk"}') >= 3
    assert metric(text, 'kvblend_store_tier_capacity_bytes{tier="disk"}') > 0
    assert metric(text, "kvblend_store_writes_dropped_total") == 0


def test_a_client_leaving_a_stream_leaves_a_log_line_and_a_count(disk_server, caplog):
    url, _ = disk_server
    caplog.set_level(logging.INFO, logger="kvblend.server.replies")
    body = {"model": MODEL_NAME, "prompt": "Tell a long story.", "max_tokens": 500, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first event: generation has begun; then the client leaves
    deadline = time.monotonic() + 60
    while not any("went away" in rec.getMessage() for rec in caplog.records):
        assert time.monotonic() < deadline, "no log line for the client that left"
        time.sleep(0.05)
    assert metric(httpx.get(url + "/metrics").text, "kvblend_client_disconnects_total") == 1
