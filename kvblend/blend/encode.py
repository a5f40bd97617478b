"""Precomputing chunk KV standalone, in the chosen chunk-context mode, so a key always means the
same KV whichever request first met the chunk."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..model.adapter import ChunkAdapter
from ..model.runner import Runner
from ..store.chunk_kv import ChunkKV


@torch.inference_mode()
def encode_chunks(runner: Runner, context_ids: list[int], chunks: list[list[int]],
                  leads: list[list[int]] | None = None, adapter: ChunkAdapter | None = None) -> Iterator[ChunkKV]:
    """KV of each chunk computed right after `context_ids` and then its lead (a neighbour and a
    separator, or nothing); only the chunk's own rows are kept. A chunk adapter acts on the lead's
    and the chunk's rows, never on the context's (the prompt's prefix, which is read exact).

    The context is computed once; each lead and chunk then overwrite the same rows after it. Each
    chunk's KV is yielded as it is computed, so a caller that stores it at once holds one at a time.
    """
    if not chunks:
        return  # nothing to encode: skip the context's forward too
    leads = leads or [[] for _ in chunks]
    C = len(context_ids)
    longest = max((len(lead) + len(c) for lead, c in zip(leads, chunks)), default=0)
    cache = runner.new_cache(C + longest)
    if C:
        runner.forward(torch.tensor(context_ids), torch.arange(C), cache)
    for lead, ids in zip(leads, chunks):
        start, end = C + len(lead), C + len(lead) + len(ids)
        with runner.adapting(adapter):
            runner.forward(torch.tensor(lead + ids), torch.arange(C, end), cache)
        yield ChunkKV(cache.k[:, :, start:end].clone(), cache.v[:, :, start:end].clone(), torch.arange(start, end))
