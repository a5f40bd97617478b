"""Sampling parameters and picking the next token from logits."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        logits = logits.float().cpu()
        if p.temperature == 0:
            return int(logits.argmax())
        # Shifted, in float64: a tiny temperature (1e-300 is 0 in float32) must not make inf or NaN.
        logits = (logits.double() - logits.max()) / p.temperature
        if p.top_k:
            # Mask by index, not by value: ties at the k-th logit must not let in more than k.
            keep = torch.topk(logits, min(p.top_k, logits.numel())).indices
            logits = torch.full_like(logits, float("-inf")).scatter(0, keep, logits[keep])
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1:
            sorted_p, order = probs.sort(descending=True)
            # Keep the smallest set whose mass reaches top_p (the first token always stays).
            drop = sorted_p.cumsum(0) - sorted_p >= p.top_p
            sorted_p[drop] = 0
            probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))
