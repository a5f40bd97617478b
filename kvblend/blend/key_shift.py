"""Correcting stale keys by what the recomputed rows of their chunk measure.

After the check, blend computes a few rows of each chunk fresh while the rest keep their stored
keys. Where a chunk's stored keys are off from full prefill's by a shift that its rows share (the
same context missing for all of them), the recomputed rows measure it: their fresh keys minus
their stored ones, averaged per chunk and KV head before the rotation (so one vector stands for
every row of the chunk). Adding `scale` times that shift to the chunk's stale keys at each layer
moves them toward full prefill's keys at the cost of a rotation of the stale rows' keys.
"""

from __future__ import annotations

import torch

from ..model.rotary import apply_rope
from ..model.runner import KVCache, Runner


class StaleKeyShift:
    def __init__(self, runner: Runner, scale: float, chunk_of: torch.Tensor):
        """chunk_of [T]: each position's chunk (0, 1, ...), -1 outside the reused chunks."""
        self.runner, self.scale, self.chunk_of = runner, scale, chunk_of
        self.n_chunks = int(chunk_of.max()) + 1 if chunk_of.numel() else 0
        self.tables: dict = {}  # rotary key -> (positions, cos, sin) of the stale rows

    def _rope(self, layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = self.runner.layer_rope[layer]
        cached = self.tables.get(key)
        if cached is None or not torch.equal(cached[0], positions):
            cos, sin = self.runner.rotaries[key].cos_sin(positions, torch.float32)
            cached = self.tables[key] = (positions, cos.float(), sin.float())
        return cached[1], cached[2]

    def apply(self, layer: int, cache: KVCache, computed: torch.Tensor, k: torch.Tensor,
              stale: torch.Tensor) -> None:
        """Before `computed` rows' fresh keys k [Hkv, n, d] overwrite their stored ones at `layer`:
        shift the `stale` positions' keys by their chunk's measured shift."""
        chunks = self.chunk_of[computed]
        measured = chunks >= 0
        if not bool(measured.any()) or stale.numel() == 0:
            return
        rows = computed[measured]
        cos, sin = self.runner.rotaries[self.runner.layer_rope[layer]].cos_sin(rows, torch.float32)
        cos, sin = cos.float(), sin.float()
        # Back to position 0: the inverse rotation, then the mean per chunk.
        fresh = apply_rope(k[:, measured].float(), cos, -sin)
        stored = apply_rope(cache.k[layer][:, rows].float(), cos, -sin)
        H, _, d = fresh.shape
        sums = torch.zeros(H, self.n_chunks, d, device=fresh.device)
        sums.index_add_(1, chunks[measured], fresh - stored)
        counts = torch.bincount(chunks[measured], minlength=self.n_chunks).clamp(min=1)
        shift = self.scale * sums / counts[None, :, None]
        # A chunk no row of which was computed gets no shift (its sum is zero).
        cos_s, sin_s = self._rope(layer, stale)
        moved = apply_rope(shift[:, self.chunk_of[stale]], cos_s, sin_s)
        cache.k[layer][:, stale] = (cache.k[layer][:, stale].float() + moved).to(cache.k.dtype)
