"""The value kept for a chunk (or a prefix block): its K and V at every layer and the positions
they were computed at, so they can be moved to wherever the chunk appears next."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass
class ChunkKV:
    k: torch.Tensor  # [L, Hkv, n, d], rotated at `positions`
    v: torch.Tensor  # [L, Hkv, n, d]
    positions: torch.Tensor  # [n] int64
    # Disk and Redis store a compact copy beside it for the attention probe (store.probe_copy):
    # chunks with compact_probe, never exact prefix blocks, which the probe reads in full.
    probe_copy: bool = False
    tier: ClassVar[str] = "memory"  # where a read found it (stored entries say disk or redis)
    quant: ClassVar[str] = ""  # how its tensors are stored: "" in the model's dtype (store.half, store.int8)

    @property
    def n_tokens(self) -> int:
        return self.k.shape[2]

    @property
    def n_layers(self) -> int:
        return self.k.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype: what the request's cache holds."""
        return self.k.dtype

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.positions.nbytes

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [Hkv, n, d] of one layer as stored (the cache converts them as it writes them):
        what the layerwise loader reads (stored entries read it from disk or Redis one layer at a
        time)."""
        return self.k[layer], self.v[layer]

    def parts(self, layer: int) -> dict[str, torch.Tensor]:
        """The tensors stored for one layer (int8 entries add their scales)."""
        return {"k": self.k[layer], "v": self.v[layer]}

    def materialize(self) -> ChunkKV:
        return self
