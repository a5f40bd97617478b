"""HKVD token selection: the reused tokens whose KV deviates most from a fresh computation,
optionally weighted by how much attention the prompt's suffix (the question) pays them."""

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


def weighted(dev: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """The error a stale token leaves in the attention output is about its attention weight times
    its KV deviation: score = a * ||delta|| (dev is the squared distance)."""
    return attention.to(dev.device) * dev.sqrt()


def attention_mass(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, scale: float,
                   window: int | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Attention probability that queries q [H, n, d] at positions q_pos put on each key of
    k [Hkv, T, d] (slot == position), averaged over heads and queries, in fp32: [T]. `bias` [T]
    is added to the logits, as attention adds it.

    Query head h reads key head h // (H / Hkv), as grouped-query attention does.
    """
    return attend_with_mass(q, k, None, q_pos, scale, window, bias)[1]


def attend_with_mass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, q_pos: torch.Tensor,
                     scale: float, window: int | None = None,
                     bias: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The attention output of q over (k, v) [Hkv, T, d], [H, n, d] in q's dtype (None without v),
    and its attention_mass, from one softmax: the probe needs both for its watched rows, and a
    second pass over [n, T] scores for the mass would cost most of the attention again.

    Work is in place on one [group * n, keys] buffer per key head, the softmax left unnormalised
    (its row sums scale the output and weigh the mass instead): each pass over the scores costs as
    much as the attention's matmuls here. Keys no query sees (before the earliest window) are skipped."""
    n_kv, T = k.shape[0], k.shape[1]
    group, n = q.shape[0] // n_kv, q.shape[1]
    first_q, last_q = int(q_pos.min()), int(q_pos.max())
    k0 = 0 if window is None else max(0, first_q - window + 1)  # keys before k0: in no query's window
    # Only keys past the earliest query (causal) or in some query's window but not all need a mask.
    m0 = k0 if window is not None and last_q - window + 1 > k0 else min(first_q + 1, T)
    key_pos = torch.arange(m0, T, device=k.device)
    hidden = key_pos[None, :] > q_pos[:, None]  # [n, T - m0]
    if window is not None:
        hidden |= key_pos[None, :] <= q_pos[:, None] - window
    mass = torch.zeros(T, dtype=torch.float32, device=k.device)
    out = None if v is None else torch.empty_like(q)
    qs = q.float() * scale
    for h in range(n_kv):  # one key head at a time bounds memory to [group * n, T]
        heads = slice(h * group, (h + 1) * group)
        s = qs[heads].reshape(group * n, -1) @ k[h, k0:].float().T  # [group * n, T - k0]
        if bias is not None:
            s += bias[k0:].float()
        s.view(group, n, -1)[:, :, m0 - k0:].masked_fill_(hidden, float("-inf"))
        s -= s.amax(dim=-1, keepdim=True)
        s.exp_()
        inv_sum = s.sum(dim=-1, keepdim=True).reciprocal_()  # [group * n, 1]
        mass[k0:] += (inv_sum.T @ s)[0]
        if out is not None:
            out[heads] = ((s @ v[h, k0:].float()) * inv_sum).view(group, n, -1).to(out.dtype)
    return out, mass / (q.shape[0] * n)


def n_selected(ratio: float, n_reused: int, minimum: int = 0) -> int:
    """How many reused tokens a check layer keeps: `ratio` of all reused tokens, rounded, and at
    least `minimum` of them (all of them when there are fewer). Ratio 0 keeps none: reuse."""
    if ratio == 0:
        return 0
    return min(n_reused, max(int(round(ratio * n_reused)), minimum))


def top_tokens(dev: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices of the `keep` largest deviations, in ascending index order."""
    keep = min(keep, dev.shape[0])
    return torch.topk(dev, keep, sorted=False).indices.sort().values
