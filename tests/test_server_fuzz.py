"""Properties: no request body, however malformed, gets a 5xx or hangs (every 4xx has OpenAI's error
body, every 200 a well-formed answer); every well-formed request gets a 200."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from serving import MODEL_NAME, default_tokenizer, live_server

junk = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                 st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
                 st.lists(st.integers(min_value=-5, max_value=60000), max_size=5), st.dictionaries(
                     st.text(max_size=5), st.integers(), max_size=2))
model = st.one_of(st.just(MODEL_NAME), junk)
prompt = st.one_of(st.text(max_size=40), st.lists(st.integers(min_value=-3, max_value=50000), max_size=8),
                   st.lists(st.text(max_size=10), max_size=2), junk)
small_int = st.one_of(st.integers(min_value=-3, max_value=12), junk)
unit = st.one_of(st.floats(min_value=-1, max_value=3, allow_nan=False), junk)
message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), junk),
                                 "content": st.one_of(st.text(max_size=30), junk)})
common = {
    "max_tokens": small_int, "temperature": unit, "top_p": unit, "seed": small_int,
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=5), junk),
    "n": small_int, "stream": st.one_of(st.booleans(), junk),
    "documents": st.one_of(st.lists(st.text(max_size=30), max_size=4), junk),
    "kvblend": st.one_of(st.fixed_dictionaries({}, optional={
        "mode": st.one_of(st.sampled_from(["full", "prefix", "reuse", "blend", "x"]), junk),
        "recompute_ratio": unit}), junk),
    "namespace": st.one_of(st.text(max_size=8), junk),
}
completion = st.fixed_dictionaries({"model": model}, optional={"prompt": prompt, **common})
chat = st.fixed_dictionaries({"model": model}, optional={
    "messages": st.one_of(st.lists(message, max_size=3), junk), **common})

valid_options = {
    "max_tokens": st.integers(1, 8), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "seed": st.integers(0, 2**63 - 1), "stop": st.lists(st.text(min_size=1, max_size=3), max_size=4),
    "stream": st.booleans(), "namespace": st.from_regex(r"[A-Za-z0-9_.-]{1,64}", fullmatch=True),
    "kvblend": st.fixed_dictionaries({}, optional={"mode": st.sampled_from(["full", "prefix", "reuse", "blend"]),
                                                   "recompute_ratio": st.floats(0, 1)}),
}


def tokens_text(max_size: int):
    r"""Text the tokenizer keeps something of: six control characters alone (\x04, \x06, ...) are no tokens,
    and an empty prompt or document is rightly a 400."""
    keeps = lambda s: default_tokenizer().encode(s, add_special_tokens=False)  # noqa: E731
    return st.text(min_size=1, max_size=max_size).filter(keeps)


documents = st.lists(tokens_text(30), min_size=1, max_size=3)
valid_completion = st.one_of(
    st.fixed_dictionaries({"model": st.just(MODEL_NAME), "prompt": tokens_text(40)},
                          optional={**valid_options, "documents": documents}),
    st.fixed_dictionaries({"model": st.just(MODEL_NAME), "prompt": st.lists(st.integers(0, 49151), min_size=1,
                                                                            max_size=8)}, optional=valid_options))
valid_chat = st.fixed_dictionaries(
    {"model": st.just(MODEL_NAME), "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=30)}), max_size=3).map(
        lambda m: [*m, {"role": "user", "content": "and?"}])},
    optional={**valid_options, "documents": documents})


@pytest.fixture(scope="module")
def server():
    with live_server(max_tokens=8, max_documents=3) as (url, _app):
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client


def check(response: httpx.Response, stream: bool) -> None:
    event(f"status {response.status_code}")  # --hypothesis-show-statistics: how many were valid
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        err = response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
    elif stream:
        assert response.text.rstrip().endswith("data: [DONE]") and '"error"' not in response.text
    else:
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=completion)
def test_completions_never_5xx(server, body):
    check(server.post("/v1/completions", json=body), body.get("stream") is True)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=chat)
def test_chat_never_5xx(server, body):
    check(server.post("/v1/chat/completions", json=body), body.get("stream") is True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.one_of(st.binary(max_size=200), st.text(max_size=100).map(str.encode),
                     st.recursive(st.none() | st.integers() | st.text(max_size=5),
                                  lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c,
                                                                                      max_size=3)).map(
                         lambda v: json.dumps(v).encode())),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/chunks"]))
def test_raw_bodies_never_5xx(server, raw, path):
    check(server.post(path, content=raw, headers={"Content-Type": "application/json"}), False)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=valid_completion)
def test_valid_completions_succeed(server, body):
    response = server.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    check(response, body.get("stream") is True)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=valid_chat)
def test_valid_chats_succeed(server, body):
    response = server.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    check(response, body.get("stream") is True)


def test_a_prompt_the_tokenizer_keeps_nothing_of_is_a_clear_400(server):
    response = server.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "\x06\x04"})
    assert response.status_code == 400 and response.json()["error"]["message"] == "the prompt is empty"
