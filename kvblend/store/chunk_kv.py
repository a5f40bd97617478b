"""The value kept for a chunk (or a prefix block): its K and V at every layer and the positions
they were computed at, so they can be moved to wherever the chunk appears next."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ChunkKV:
    k: torch.Tensor  # [L, Hkv, n, d], rotated at `positions`
    v: torch.Tensor  # [L, Hkv, n, d]
    positions: torch.Tensor  # [n] int64

    @property
    def n_tokens(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.positions.nbytes
