"""Chunk KV stored as int8 with one scale per (layer, head, token) for K and for V: a quarter of
fp32's bytes (half of bf16's) plus 2 bytes of scale per 2 x head_dim values. Symmetric absmax
quantization: q = round(x / s), s = max|x| / 127 over the head's vector. Decoded to the model's
dtype as each layer is read. Only chunk KV is quantized: exact prefix blocks stay exact."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .chunk_kv import ChunkKV

SCALE_DTYPE = torch.float16


def quantize_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-8).to(SCALE_DTYPE)
    q = torch.round(xf / scale.float()).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_tensor(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.float()).to(dtype)


@dataclass
class QuantKV:
    kq: torch.Tensor  # [L, Hkv, n, d] int8
    vq: torch.Tensor
    k_scale: torch.Tensor  # [L, Hkv, n, 1] float16
    v_scale: torch.Tensor
    positions: torch.Tensor  # [n] int64
    dtype: torch.dtype  # the model's: what layers decode to
    probe_copy: bool = False  # as ChunkKV.probe_copy
    tier: ClassVar[str] = "memory"
    quant: ClassVar[str] = "int8"

    @property
    def n_tokens(self) -> int:
        return self.kq.shape[2]

    @property
    def n_layers(self) -> int:
        return self.kq.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.kq, self.vq, self.k_scale, self.v_scale, self.positions))

    def parts(self, layer: int) -> dict[str, torch.Tensor]:
        return {"k": self.kq[layer], "v": self.vq[layer], "k_scale": self.k_scale[layer],
                "v_scale": self.v_scale[layer]}

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (dequantize_tensor(self.kq[layer], self.k_scale[layer], self.dtype),
                dequantize_tensor(self.vq[layer], self.v_scale[layer], self.dtype))

    def materialize(self) -> QuantKV:
        return self


def quantize(kv: ChunkKV) -> QuantKV:
    kq, ks = quantize_tensor(kv.k)
    vq, vs = quantize_tensor(kv.v)
    return QuantKV(kq, vq, ks, vs, kv.positions.clone(), kv.k.dtype, kv.probe_copy)
