"""Log-probabilities in OpenAI's shapes, and teacher forcing (kvblend.forced_tokens): the logprobs a
forced continuation gets over HTTP are those the in-process harness computes for the same prompt."""

import httpx
import openai
import pytest
import torch
from serving import MODEL_NAME, live_server, tiny_engine

from kvblend.eval.harness import forced_logits, greedy
from kvblend.engine import prompts

DOCS = ["Marrowick is a town on the Tesk river, known for its glass.",
        "The Tesk river flows north into the Grey Sea.",
        "Glassmaking came to Marrowick in 1412."]
SYSTEM = "Answer from the passages."
QUESTION = "Where does the Tesk river flow?"
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def server():
    with live_server(tiny_engine(), max_tokens=MAX_TOKENS) as (url, app):
        yield url, app


def http(server):
    return httpx.Client(base_url=server[0], timeout=60)


def complete(server, **body):
    r = http(server).post("/v1/completions", json={"model": MODEL_NAME, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def ids_of(names):
    assert all(n.startswith("token_id:") for n in names), names
    return [int(n.removeprefix("token_id:")) for n in names]


def test_greedy_logprobs_top1_is_the_sampled_token(server):
    out = complete(server, prompt=QUESTION, max_tokens=8, logprobs=5, return_tokens_as_token_ids=True)
    lp = out["choices"][0]["logprobs"]
    tokens = ids_of(lp["tokens"])
    assert len(tokens) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) > 0
    for token, logprob, top in zip(tokens, lp["token_logprobs"], lp["top_logprobs"]):
        best = max(top, key=top.get)
        assert ids_of([best]) == [token] and top[best] == logprob
        assert len(top) == 5 and all(v <= 0 for v in top.values())
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    # By text, the tokens spell the completion.
    named = complete(server, prompt=QUESTION, max_tokens=8, logprobs=0)["choices"][0]
    assert "".join(named["logprobs"]["tokens"]) == named["text"]
    assert all(len(t) == 1 for t in named["logprobs"]["top_logprobs"])  # just the sampled token


def test_chat_logprobs_through_the_openai_client_streamed_or_not(server):
    client = openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=60)
    kw = dict(model=MODEL_NAME, messages=[{"role": "user", "content": QUESTION}], max_tokens=6, temperature=0,
              logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens - (whole.choices[0].finish_reason == "stop")
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == entry.logprob and bytes(entry.bytes) == entry.token.encode()
    streamed = [e for chunk in client.chat.completions.create(stream=True, **kw)
                if chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    # The same tokens, and logprobs up to the last bits of fp32: the second request can read the first
    # one's prefix cache, so its rows go through matmuls of another shape (on an AVX2-only CPU in
    # fp32 that moves the last bits).
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    plain = client.chat.completions.create(**{**kw, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_streamed_match_the_whole_reply(server):
    body = dict(prompt=QUESTION, max_tokens=8, logprobs=2, return_tokens_as_token_ids=True)
    whole = complete(server, **body)["choices"][0]["logprobs"]
    parts = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    with http(server).stream("POST", "/v1/completions", json={"model": MODEL_NAME, "temperature": 0, "stream": True,
                                                             **body}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                lp = httpx.Response(200, content=line[6:]).json()["choices"][0]["logprobs"]
                for key in parts if lp else ():
                    parts[key] += lp[key]
    assert parts == whole


def test_forced_continuation_scores_the_given_tokens(server):
    answer = [5, 17, 250, 3, 3, 99]  # not what the model would pick: forced all the same, EOS or not
    out = complete(server, prompt=QUESTION, logprobs=1, return_tokens_as_token_ids=True,
                   kvblend={"forced_tokens": answer, "mode": "full"})
    choice = out["choices"][0]
    assert ids_of(choice["logprobs"]["tokens"]) == answer and choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == len(answer)


@pytest.mark.parametrize("mode", ["full", "blend"])
def test_forced_logprobs_equal_the_in_process_teacher_forced_logits(server, mode, monkeypatch):
    """The server computes the forced tokens in one pass after the prompt, as the harness does, never
    a decode step per token: the same distribution at every position. Equal to float32 rounding, not
    bit for bit: the server's thread may split a reduction over other threads than the test's."""
    engine = server[1].state.engine

    def no_decode(*args, **kwargs):  # a failed step: the request ends with a 500, the scheduler lives on
        raise RuntimeError("a forced continuation took a decode step")

    monkeypatch.setattr(engine.runner, "decode", no_decode)
    ns = f"tf-{mode}"
    assert http(server).post("/v1/chunks", json={"documents": DOCS, "system": SYSTEM, "namespace": ns}).status_code == 200
    here = tiny_engine()  # the same weights, its own store
    ids = prompts.completion_prompt(here.tokenizer, here.settings.separator, here.sep_ids, QUESTION, DOCS, SYSTEM).ids
    with here.namespace(ns):
        here.index_collection([prompts.chunk_prompt(here.tokenizer, here.sep_ids, DOCS, SYSTEM).ids])
        here.precompute(prompts.chunk_prompt(here.tokenizer, here.sep_ids, DOCS, SYSTEM).ids)
        _, full = here.prefill(ids, "full", 40)
        answer = greedy(here, full, len(ids), 8)
        expected, _ = forced_logits(here, ids, mode, None, answer, len(answer))
    out = complete(server, prompt=QUESTION, documents=DOCS, system=SYSTEM, namespace=ns, logprobs=20,
                   return_tokens_as_token_ids=True, kvblend={"forced_tokens": answer, "mode": mode})
    assert out["usage"]["prompt_tokens"] == len(ids) and out["kvblend"]["mode"] == mode
    if mode == "blend":
        assert out["kvblend"]["reused_tokens"] > 0  # really blended, from the posted chunks
    lp = out["choices"][0]["logprobs"]
    assert len(lp["top_logprobs"]) == len(answer) == expected.shape[0]
    for pos, (token, logprob, top) in enumerate(zip(answer, lp["token_logprobs"], lp["top_logprobs"])):
        want = torch.log_softmax(expected[pos].float(), -1)
        assert logprob == pytest.approx(float(want[token]), abs=1e-5)
        listed = dict(zip(ids_of(list(top)), top.values()))
        assert len(listed) == 20 and all(v == pytest.approx(float(want[i]), abs=1e-5) for i, v in listed.items())
        assert min(listed.values()) >= float(torch.topk(want, 21).values[-1]) - 1e-5  # the 20 most likely
    assert engine is not here


VOCAB = 49152  # the default tokenizer's, which the tiny test model shares


@pytest.mark.parametrize("body,param", [
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": "3"}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"kvblend": {"forced_tokens": [1, -2]}}, "kvblend.forced_tokens.1"),
    ({"kvblend": {"forced_tokens": []}}, "kvblend.forced_tokens"),
    ({"kvblend": {"forced_tokens": [1, VOCAB]}}, "kvblend.forced_tokens"),
    ({"kvblend": {"forced_tokens": [1] * (MAX_TOKENS + 1)}}, "kvblend.forced_tokens"),
    ({"kvblend": {"forced_tokens": [1, 2]}, "max_tokens": 3}, "max_tokens"),
    ({"kvblend": {"forced_tokens": [1, 2]}, "stop": ["x"]}, "stop"),
    ({"kvblend": {"forced_tokens": [1.5]}}, "kvblend.forced_tokens.0"),
])
def test_bad_logprobs_and_forced_tokens_are_400(server, body, param):
    r = http(server).post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err


@pytest.mark.parametrize("body,param", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 3}, None),
    ({"logprobs": 3}, "logprobs"),
])
def test_bad_chat_logprobs_are_400(server, body, param):
    r = http(server).post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": [{"role": "user",
                                                                                          "content": "hi"}], **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] and (param is None or err["param"] == param), err
    if param is None:
        assert "top_logprobs needs logprobs" in err["message"]


def test_ignore_eos_decodes_on_to_max_tokens(server):
    engine = server[1].state.engine
    first = ids_of(complete(server, prompt=QUESTION, max_tokens=1, logprobs=0,
                            return_tokens_as_token_ids=True)["choices"][0]["logprobs"]["tokens"])[0]
    saved = engine.eos_ids
    engine.eos_ids = {first}  # the greedy first token ends the answer at once, unless EOS is ignored
    try:
        stopped = complete(server, prompt=QUESTION, max_tokens=5)
        assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["choices"][0]["text"] == ""
        on = complete(server, prompt=QUESTION, max_tokens=5, ignore_eos=True, logprobs=0, return_tokens_as_token_ids=True)
    finally:
        engine.eos_ids = saved
    choice = on["choices"][0]
    assert choice["finish_reason"] == "length" and on["usage"]["completion_tokens"] == 5
    assert ids_of(choice["logprobs"]["tokens"])[0] == first
