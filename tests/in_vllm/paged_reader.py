"""Reading rows back out of vLLM's paged cache, whatever the attention backend's layout.

The reader learns the layout from the backend itself: it has the backend's own writer put numbered
K and V elements into a scratch copy of the cache and sees where each number lands. So a test holds
kvblend's writes to the layout vLLM's kernels read, on every ISA (vec, AMX) and dtype it runs on.
"""

from __future__ import annotations

import torch


def read_rows(attn_layer, slot_mapping: torch.Tensor, n_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [Hkv, n, d] of the rows at `slot_mapping`, as they sit in `attn_layer`'s cache."""
    cache = attn_layer.kv_cache
    n = slot_mapping.numel()
    size = n * n_kv_heads * head_dim
    numbers = torch.arange(2 * size, dtype=torch.long)  # K's elements, then V's
    base = 256 if cache.dtype in (torch.bfloat16, torch.float16) else 1 << 22  # integers the dtype holds exactly
    scratch = torch.empty_like(cache)
    flat = scratch.view(-1)
    homes, number_at, power = None, None, 1
    while power < 2 * size:  # one pass per base-`base` digit of the element numbers
        digit = ((numbers // power) % base + 1).to(cache.dtype)  # 0 marks a slot the writer left alone
        scratch.zero_()
        k, v = digit[:size].view(n, n_kv_heads, head_dim), digit[size:].view(n, n_kv_heads, head_dim)
        attn_layer.impl.do_kv_cache_update(attn_layer, k, v, scratch, slot_mapping)
        if homes is None:
            homes = flat.nonzero().squeeze(1)
            assert homes.numel() == 2 * size, "the writer put a different number of elements than it was given"
            number_at = torch.zeros(2 * size, dtype=torch.long)
        number_at += (flat[homes].to(torch.long) - 1) * power
        power *= base
    home_of = torch.empty(2 * size, dtype=torch.long)
    home_of[number_at] = homes
    values = cache.view(-1)[home_of]
    k = values[:size].view(n, n_kv_heads, head_dim).transpose(0, 1)
    v = values[size:].view(n, n_kv_heads, head_dim).transpose(0, 1)
    return k, v
