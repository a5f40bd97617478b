"""Each next token of a request, and what its reply says about it: sampled, or given (teacher
forcing: the client names the continuation and reads how likely this mode's KV finds it), with its
log-probability and the most likely tokens at that position when the request asks for logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampler import Sampler, SamplingParams


@dataclass
class Token:
    id: int
    logprob: float | None = None  # of `id`, when the request asked for logprobs
    top: list[tuple[int, float]] | None = None  # the most likely ids and their logprobs, best first
    text: str = ""  # the text that is now safe to show (the engine loop fills it in)
    offset: int = 0  # where this token's text starts in the whole text so far


class TokenPicker:
    def __init__(self, params: SamplingParams, forced: list[int] | None = None, top_logprobs: int | None = None):
        self.forced, self.top_logprobs = forced, top_logprobs
        self.sampler = None if forced else Sampler(params)
        self.picked = 0

    def __call__(self, logits: torch.Tensor) -> Token:
        """The next token from this position's logits ([vocab])."""
        token = self.forced[self.picked] if self.forced else self.sampler(logits)
        self.picked += 1
        if self.top_logprobs is None:
            return Token(token)
        # Of the model's distribution (temperature 1), as OpenAI reports them, whatever the sampling.
        logp = torch.log_softmax(logits.float().cpu(), dim=-1)
        top = torch.topk(logp, self.top_logprobs) if self.top_logprobs else None
        return Token(token, float(logp[token]),
                     list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [])
