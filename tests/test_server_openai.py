"""The server through the official `openai` client, over real HTTP on a loopback port."""

import openai
import pytest
from serving import MODEL_NAME, live_server

DOCS = ["Marrowick is a town on the Tesk river, known for its glass.",
        "The Tesk river flows north into the Grey Sea.",
        "Glassmaking came to Marrowick in 1412."]


@pytest.fixture(scope="module")
def server():
    with live_server(api_keys=["sk-test"], max_tokens=64) as (url, app):
        yield url, app


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="sk-test", max_retries=0, timeout=60)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def test_completion_text_and_token_ids(client):
    out = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=6,
                                    temperature=0)
    assert out.object == "text_completion" and len(out.choices) == 1
    assert out.choices[0].finish_reason in ("length", "stop") and out.choices[0].text
    assert out.usage.completion_tokens <= 6 and out.usage.prompt_tokens > 0
    again = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=6,
                                      temperature=0)
    assert again.choices[0].text == out.choices[0].text  # greedy is deterministic
    ids = client.completions.create(model=MODEL_NAME, prompt=[1, 2, 3, 4, 5], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 5


def test_seeded_sampling_repeats(client):
    kw = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=8, temperature=1.0, top_p=0.9)
    a = client.completions.create(seed=7, **kw).choices[0].text
    assert client.completions.create(seed=7, **kw).choices[0].text == a


def test_chat_and_streaming_give_the_same_text(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is Marrowick?"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    text = whole.choices[0].message.content
    pieces, finish, roles = [], None, []
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0,
                                                stream=True):
        assert chunk.object == "chat.completion.chunk"
        delta = chunk.choices[0].delta
        roles += [delta.role] if delta.role else []
        pieces.append(delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    assert roles == ["assistant"] and "".join(pieces) == text and finish == whole.choices[0].finish_reason


def test_completion_stream_matches_and_ends_with_usage(client):
    whole = client.completions.create(model=MODEL_NAME, prompt="Tell me", max_tokens=8, temperature=0)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="Tell me", max_tokens=8, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_string_cuts_the_text(client):
    full = client.completions.create(model=MODEL_NAME, prompt="A list:", max_tokens=12, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), f"the answer {text!r} has no usable middle"
    cut = client.completions.create(model=MODEL_NAME, prompt="A list:", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.find(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL_NAME, prompt="A list:", max_tokens=12, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_documents_are_reused_chunks(client):
    kw = dict(model=MODEL_NAME, prompt="Where is Marrowick?", max_tokens=4, temperature=0)
    first = client.completions.create(extra_body={"documents": DOCS, "namespace": "docs-test"}, **kw)
    again = client.completions.create(extra_body={"documents": DOCS[::-1], "namespace": "docs-test"}, **kw)
    m1, m2 = first.model_extra["kvblend"], again.model_extra["kvblend"]
    assert m1["mode"] == "blend" and m1["chunk_misses"] == 3 and m1["chunk_hits"] == 0
    assert 0 <= m1["queue_s"] <= m1["ttft_s"]
    assert m2["chunk_hits"] == 3 and m2["reused_tokens"] > 0  # any order reuses every chunk
    assert m2["recomputed_tokens"] < again.usage.prompt_tokens
    full = client.completions.create(extra_body={"documents": DOCS, "namespace": "docs-test",
                                                 "kvblend": {"mode": "full"}}, **kw)
    assert full.model_extra["kvblend"]["recomputed_tokens"] == full.usage.prompt_tokens
    ratio1 = client.completions.create(extra_body={"documents": DOCS, "namespace": "docs-test",
                                                   "kvblend": {"mode": "blend", "recompute_ratio": 1.0}}, **kw)
    assert ratio1.choices[0].text == full.choices[0].text  # blend at ratio 1 is full prefill


def test_chat_with_documents(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Where?"}],
                                         max_tokens=3, temperature=0,
                                         extra_body={"documents": DOCS[:2], "namespace": "chat-docs"})
    m = out.model_extra["kvblend"]
    assert m["chunk_misses"] == 2 and out.usage.completion_tokens >= 1


def test_errors_are_openai_errors(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1000)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="hi", n=2)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=[5, 10**6], max_tokens=2)
    assert "invalid token ids" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="hi " * 1200, max_tokens=2)
    assert "exceeds the model's context" in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], stream=True,
                                       temperature=-1)
    wrong_key = openai.OpenAI(base_url=server[0] + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.models.list()


def test_models_retrieve_names_the_served_model_and_404s_an_unknown_one(client):
    card = client.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.object == "model" and card.owned_by == "kvblend"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("org/no-such-model")
    assert e.value.code == "model_not_found" and "no-such-model" in e.value.message
