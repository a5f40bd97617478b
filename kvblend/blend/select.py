"""HKVD token selection: the reused tokens whose KV deviates most from a fresh computation."""

from __future__ import annotations

import torch

DEVIATIONS = ("k", "v", "kv")


def deviation(signal: str, fresh_k: torch.Tensor, cached_k: torch.Tensor, fresh_v: torch.Tensor,
              cached_v: torch.Tensor) -> torch.Tensor:
    """Squared L2 distance per token over all heads, in fp32. Tensors [Hkv, n, d] -> [n]."""
    if signal not in DEVIATIONS:
        raise ValueError(f"unknown deviation signal {signal!r}; choose one of {DEVIATIONS}")
    dev = torch.zeros(fresh_k.shape[1], dtype=torch.float32, device=fresh_k.device)
    if "k" in signal:
        dev += (fresh_k.float() - cached_k.float()).pow(2).sum(dim=(0, 2))
    if "v" in signal:
        dev += (fresh_v.float() - cached_v.float()).pow(2).sum(dim=(0, 2))
    return dev


def n_selected(ratio: float, n_reused: int) -> int:
    """How many reused tokens a check layer keeps: `ratio` of all reused tokens, rounded."""
    return int(round(ratio * n_reused))


def top_tokens(dev: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices of the `keep` largest deviations, in ascending index order."""
    keep = min(keep, dev.shape[0])
    return torch.topk(dev, keep, sorted=False).indices.sort().values
