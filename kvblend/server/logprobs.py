"""A reply's log-probabilities in OpenAI's shapes: chat's `{content: [{token, logprob, bytes,
top_logprobs}]}` and legacy completions' `{tokens, token_logprobs, top_logprobs, text_offset}`.

Tokens are named by their text, or as "token_id:<id>" when the request sets
return_tokens_as_token_ids (vLLM's convention): text can be ambiguous, an id is not. `bytes` is the
UTF-8 of that text (a token holding part of a character reads as U+FFFD there). `text_offset`
counts characters from the start of the completion, not of the prompt (echo is not supported).
"""

from __future__ import annotations

from ..engine.token_picker import Token

# OpenAI's value for a token too unlikely to have a finite logprob; JSON has no -Infinity.
FLOOR = -9999.0


class Logprobs:
    def __init__(self, kind: str, tokenizer, as_ids: bool):
        self.chat = kind != "text_completion"
        self.tokenizer, self.as_ids = tokenizer, as_ids
        self.pending: list[Token] = []  # not handed out yet
        self._names: dict[int, str] = {}

    def add(self, token: Token) -> None:
        self.pending.append(token)

    def take(self) -> dict | None:
        """The tokens added since the last take, in the endpoint's shape; None when there are none."""
        if not self.pending:
            return None
        tokens, self.pending = self.pending, []
        if self.chat:
            return {"content": [{**self._entry(t.id, t.logprob), "top_logprobs": [self._entry(i, lp) for i, lp in t.top]}
                                for t in tokens], "refusal": None}
        tops = []
        for t in tokens:
            top = {self.name(i): _finite(lp) for i, lp in t.top}
            top.setdefault(self.name(t.id), _finite(t.logprob))  # OpenAI: the sampled token is always listed
            tops.append(top)
        return {"tokens": [self.name(t.id) for t in tokens], "token_logprobs": [_finite(t.logprob) for t in tokens],
                "top_logprobs": tops, "text_offset": [t.offset for t in tokens]}

    def name(self, token_id: int) -> str:
        name = self._names.get(token_id)
        if name is None:
            name = (f"token_id:{token_id}" if self.as_ids or self.tokenizer is None
                    else self.tokenizer.decode([token_id]))
            self._names[token_id] = name
        return name

    def _entry(self, token_id: int, logprob: float) -> dict:
        name = self.name(token_id)
        return {"token": name, "logprob": _finite(logprob), "bytes": list(name.encode("utf-8"))}


def _finite(logprob: float) -> float:
    return max(logprob, FLOOR)
