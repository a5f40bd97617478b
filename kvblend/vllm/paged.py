"""Rows of KV into vLLM's paged cache, through the attention backend's own writer.

vLLM's backends lay their caches out each in their own way: the CPU backend keeps, per block and KV
head, K transposed and then V, and packs them differently for AMX; CUDA backends keep
[block, token, head, dim]. Every backend's `do_kv_cache_update` writes K and V rows at cache slots
in its own layout, so the connector writes through it and never assumes one.
"""

from __future__ import annotations

import torch


def slots(block_ids: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Cache slots of token positions [start, end) of a request holding these blocks, in order."""
    pos = torch.arange(start, end)
    table = torch.tensor(block_ids, dtype=torch.long)
    return table[pos // block_size] * block_size + pos % block_size


def write_rows(attn_layer: torch.nn.Module, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """K and V [Hkv, n, d] (kvblend's cache layout) of n rows into `attn_layer`'s paged cache at
    `slot_mapping` [n]."""
    key = k.transpose(0, 1).contiguous()  # the backends take [n, Hkv, d]
    value = v.transpose(0, 1).contiguous()
    cache = attn_layer.kv_cache
    attn_layer.impl.do_kv_cache_update(attn_layer, key, value, cache, slot_mapping.to(cache.device))
