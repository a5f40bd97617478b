"""Chunk KV kept in bfloat16 for a model that computes in float32: half the bytes to keep, read
and check on every tier. Its rounding (8 significant bits) is far below blend's own error
(docs/storage.md#half-precision). The loader converts it as it writes the request's float32 cache,
so nothing is decoded ahead. Exact prefix blocks stay exact."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .chunk_kv import ChunkKV

HALF = torch.bfloat16


@dataclass
class HalfKV(ChunkKV):
    model_dtype: torch.dtype = torch.float32  # what the request's cache holds
    quant: ClassVar[str] = "bf16"

    @property
    def dtype(self) -> torch.dtype:
        return self.model_dtype


def halve(kv: ChunkKV) -> HalfKV:
    return HalfKV(kv.k.to(HALF), kv.v.to(HALF), kv.positions.clone(), kv.probe_copy, model_dtype=kv.k.dtype)
