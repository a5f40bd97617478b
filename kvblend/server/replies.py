"""One request's answer, from the engine loop's events to OpenAI's formats: a JSON body, or
server-sent events in OpenAI's chunk format ending in `data: [DONE]`."""

from __future__ import annotations

import json
import logging
import time
import uuid

from .errors import APIError
from .logprobs import Logprobs
from ..engine.requests import Done, Failed, Prefilled, Request
from ..engine.token_picker import Token
from .metrics import ServerMetrics

log = logging.getLogger(__name__)


class Reply:
    """One request's answer, as a JSON body or as server-sent events in OpenAI's chunk format."""

    def __init__(self, req: Request, tokenizer, kind: str, model: str, metrics: ServerMetrics,
                 tokens_as_ids: bool = False):
        self.req, self.kind, self.model, self.metrics = req, kind, model, metrics
        self.logprobs = Logprobs(kind, tokenizer, tokens_as_ids) if req.top_logprobs is not None else None
        self.id = ("cmpl-" if kind == "text_completion" else "chatcmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.prompt_metrics = None
        self.n_tokens = 0
        self.finished = False

    async def pieces(self):
        """Text pieces as tokens arrive; ends with ("finish", reason)."""
        while True:
            event = await self.req.events.get()
            if isinstance(event, Prefilled):
                self.prompt_metrics = event.metrics
            elif isinstance(event, Token):
                self.n_tokens += 1
                if self.logprobs is not None:
                    self.logprobs.add(event)
                if event.text:
                    yield "text", event.text
            elif isinstance(event, Done):
                self.prompt_metrics, self.n_tokens = event.metrics, event.metrics.decode_tokens
                if event.text:
                    yield "text", event.text
                yield "finish", event.finish_reason
                return
            else:
                assert isinstance(event, Failed)
                raise APIError(event.status, event.message, type="server_error" if event.status >= 500
                               else "invalid_request_error")

    def client_left(self) -> None:
        """The client went away before the answer ended: say so, in the log and in /metrics."""
        self.metrics.disconnects.inc()
        log.info("%s: the client went away after %d of at most %d tokens; stopped", self.id, self.n_tokens,
                 self.req.params.max_tokens)

    def finish(self) -> dict:
        """usage and kvblend's metrics for the last message; records the request's latency."""
        self.finished = True
        m = self.prompt_metrics
        n_prompt = len(self.req.token_ids)
        self.metrics.e2e.labels(self.req.mode).observe(time.perf_counter() - self.req.arrival)
        return {
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": self.n_tokens,
                      "total_tokens": n_prompt + self.n_tokens},
            "kvblend": {"mode": m.mode, "ttft_s": m.ttft_s, "queue_s": self.req.admitted - self.req.arrival, "prefix_hit_tokens": m.prefix_hit_tokens,
                        "reused_tokens": m.reused_tokens, "recomputed_tokens": m.recomputed_tokens,
                        "chunk_hits": m.chunk_hits, "chunk_misses": m.chunk_misses,
                        "compute_frac": m.compute_frac, "chunk_tiers": m.chunk_tiers,
                        "bad_entries": m.bad_entries},
        }

    async def collect(self) -> dict:
        texts, finish = [], "length"
        async for what, value in self.pieces():
            if what == "text":
                texts.append(value)
            else:
                finish = value
        text = "".join(texts)
        logprobs = self._take_logprobs()
        if logprobs is None and self.logprobs is not None:  # asked for, but no token came
            logprobs = {"content": [], "refusal": None} if self.kind != "text_completion" else \
                {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if self.kind == "text_completion":
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                      "finish_reason": finish}
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.model,
                "choices": [choice], **self.finish()}

    def _take_logprobs(self) -> dict | None:
        return self.logprobs.take() if self.logprobs is not None else None

    def _chunk(self, piece: str | None, finish: str | None, role: bool = False) -> dict:
        # The logprobs of the tokens since the last chunk (a token whose text is held back, a
        # half character or a possible stop string, comes with the chunk that sends its text).
        logprobs = None if role else self._take_logprobs()
        if self.kind == "text_completion":
            choice = {"index": 0, "text": piece or "", "logprobs": logprobs, "finish_reason": finish}
            kind = "text_completion"
        else:
            delta = {} if piece is None else {"content": piece}
            if role:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            kind = "chat.completion.chunk"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [choice]}

    async def sse(self):
        def event(data: dict) -> str:
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        try:
            if self.kind != "text_completion":
                yield event(self._chunk("", None, role=True))
            try:
                async for what, value in self.pieces():
                    if what == "text":
                        yield event(self._chunk(value, None))
                    else:
                        yield event({**self._chunk(None, value), **self.finish()})
            except APIError as e:  # the status line is gone already: the error travels as an event
                yield event(e.body())
            yield "data: [DONE]\n\n"
            self.finished = True
        finally:
            if not self.finished:  # the generator closed early: the client went away mid-stream
                self.client_left()
            self.req.cancel()  # no-op when finished; frees the KV when the client left mid-stream
