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

from ..model.runner import KVCache, Runner


def evenly_spaced(rows: torch.Tensor, n: int) -> torch.Tensor:
    """`n` evenly spaced entries of `rows`, first and last included (all of them where there are fewer)."""
    if rows.numel() <= n:
        return rows
    return rows[torch.linspace(0, rows.numel() - 1, n, device=rows.device).round().long()]


def spread_rows(chunk_of: torch.Tensor, n: int) -> torch.Tensor:
    """Positions of `n` evenly spaced rows of each chunk (all of a shorter one's), first and last
    included. chunk_of [T]: each position's chunk (0, 1, ...), -1 outside the reused chunks."""
    picked = []
    for c in range(int(chunk_of.max()) + 1 if chunk_of.numel() else 0):
        picked.append(evenly_spaced((chunk_of == c).nonzero().squeeze(1), n))
    return torch.cat(picked) if picked else chunk_of.new_zeros(0)


class StaleKeyShift:
    def __init__(self, runner: Runner, scale: float, chunk_of: torch.Tensor, measure: torch.Tensor | None = None):
        """chunk_of [T]: each position's chunk (0, 1, ...), -1 outside the reused chunks. `measure`
        [T] bool: the rows that measure the shift where they are computed (None: every computed row)."""
        self.runner, self.scale, self.chunk_of, self.measure = runner, scale, chunk_of, measure
        self.n_chunks = int(chunk_of.max()) + 1 if chunk_of.numel() else 0
        # The rows a check leaves are the same at every later layer: what depends on them alone
        # (their chunks and counts, their rotations back to position 0, the stale rows') is built once.
        self._computed = self._measured = None
        self._stale, self._to_stale = None, None

    def apply(self, layer: int, cache: KVCache, computed: torch.Tensor, k: torch.Tensor,
              stale: torch.Tensor) -> None:
        """Before `computed` rows' fresh keys k [Hkv, n, d] overwrite their stored ones at `layer`:
        shift the `stale` positions' keys by their chunk's measured shift."""
        if self._computed is not computed:
            chunks = self.chunk_of[computed]
            measured = chunks >= 0
            if self.measure is not None:
                measured &= self.measure[computed]
            rows = computed[measured]
            # Back to position 0: the loader's re-rotation, by minus each row's position.
            self._computed = computed
            counts = torch.bincount(chunks[measured], minlength=self.n_chunks).clamp(min=1)
            self._measured = measured, rows, chunks[measured], counts, self.runner.shift_tables(-rows, rows.device)
        measured, rows, chunks, counts, back = self._measured
        if rows.numel() == 0 or stale.numel() == 0:
            return
        runner = self.runner
        fresh = runner.rerotate(layer, k[:, measured].float(), back)
        stored = runner.rerotate(layer, cache.k[layer][:, rows].float(), back)
        H, _, d = fresh.shape
        sums = torch.zeros(H, self.n_chunks, d, device=fresh.device)
        sums.index_add_(1, chunks, fresh - stored)
        shift = self.scale * sums / counts[None, :, None]  # the mean per chunk
        # A chunk no row of which was computed gets no shift (its sum is zero).
        if self._stale is not stale:
            self._stale, self._to_stale = stale, runner.shift_tables(stale, stale.device)
        moved = runner.rerotate(layer, shift[:, self.chunk_of[stale]], self._to_stale)
        cache.k[layer][:, stale] = (cache.k[layer][:, stale].float() + moved).to(cache.k.dtype)
