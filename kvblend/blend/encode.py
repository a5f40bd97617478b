"""Precomputing chunk KV standalone, in the chosen chunk-context mode, so a key always means the
same KV whichever request first met the chunk."""

from __future__ import annotations

import torch

from ..model.runner import Runner
from ..store.chunk_kv import ChunkKV


@torch.inference_mode()
def encode_chunks(runner: Runner, context_ids: list[int], chunks: list[list[int]]) -> list[ChunkKV]:
    """KV of each chunk computed right after `context_ids` (whose own KV is dropped).

    The context is computed once; each chunk then overwrites the same rows after it.
    """
    C = len(context_ids)
    longest = max((len(c) for c in chunks), default=0)
    cache = runner.new_cache(C + longest)
    if C:
        runner.forward(torch.tensor(context_ids), torch.arange(C), cache)
    out = []
    for ids in chunks:
        n = len(ids)
        runner.forward(torch.tensor(ids), torch.arange(C, C + n), cache)
        out.append(ChunkKV(cache.k[:, :, C:C + n].clone(), cache.v[:, :, C:C + n].clone(),
                           torch.arange(C, C + n)))
    return out
