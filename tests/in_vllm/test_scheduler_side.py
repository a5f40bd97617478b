"""The scheduler side's choices, on requests as vLLM's scheduler hands them over."""

from types import SimpleNamespace

from kvblend.vllm.scheduler_side import SchedulerSide

SEP = [7, 7]
PROMPT = [1, 2, *SEP, 10, 11, 12, *SEP, 20, 21, *SEP, 30, 31]  # prefix, two chunks, a question


def request(rid: str, ids=PROMPT, params=None, **sampling):
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(ids), kv_transfer_params=params,
                           sampling_params=SimpleNamespace(prompt_logprobs=sampling.get("prompt_logprobs")))


def step(side: SchedulerSide, scheduled: list, blocks=((0, 1),)):
    new = [SimpleNamespace(req_id=r.request_id, prompt_token_ids=r.prompt_token_ids, block_ids=blocks)
           for r in scheduled]
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[])
    return side.jobs(SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=cached))


def test_every_row_but_the_last_past_vllms_hit():
    side = SchedulerSide(SEP, "blend", True)
    assert side.matched(request("a"), 0) == len(PROMPT) - 1
    side.after_alloc(request("a"), len(PROMPT) - 1 - 4)  # vLLM kept 4 rows of its own
    (job,) = step(side, [request("a")])
    assert (job.start, job.end, job.mode, job.ratio) == (4, len(PROMPT) - 1, "blend", None)


def test_one_blended_prompt_per_step():
    side = SchedulerSide(SEP, "blend", True)
    assert side.matched(request("a"), 0) > 0
    assert side.matched(request("b"), 0) is None  # asked again next step
    assert side.matched(request("c", ids=[1, 2, 3]), 0) == 0  # no chunks: vLLM's own, now
    step(side, [])
    assert side.matched(request("b"), 0) > 0


def test_what_is_left_to_vllm():
    side = SchedulerSide(SEP, "blend", True)
    assert side.matched(request("a", ids=[1, 2, *SEP, 3]), 0) == 0  # one separator: no chunk
    assert side.matched(request("b", ids=[1, *SEP, *SEP, 3]), 0) == 0  # an empty chunk
    assert side.matched(request("c", prompt_logprobs=5), 0) == 0  # every prompt row's logprobs
    assert side.matched(request("d", params={"kvblend": {"mode": "full"}}), 0) == 0
    assert side.matched(request("e"), len(PROMPT) - 1) == 0  # vLLM holds every row but the last
    assert SchedulerSide(SEP, "full", True).matched(request("f"), 0) == 0
    assert SchedulerSide(SEP, "blend", False).matched(request("g"), 0) == 0  # the rotary gate refused


def test_a_requests_own_mode_and_ratio():
    side = SchedulerSide(SEP, "blend", True)
    r = request("a", params={"kvblend": {"mode": "reuse", "ratio": 0.3}})
    side.after_alloc(r, side.matched(r, 0))
    (job,) = step(side, [r])
    assert (job.mode, job.ratio) == ("reuse", 0.3)
    bad = request("b", params={"kvblend": {"mode": "fastest", "ratio": 7}})  # ignored, not an error
    assert side.request_mode(bad) == ("blend", None)
