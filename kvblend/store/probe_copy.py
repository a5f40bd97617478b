"""A compact copy of a stored entry's K and V that only blend's attention probe reads.

The probe walks every layer over a few dozen rows before the blend pass starts, so on a slow tier
it waits for every layer's read and nothing hides that wait. Reading a copy at about a quarter of
the bytes lets it finish early while the full KV streams in behind it for the blend pass, which
alone decides the answer's KV (docs/storage.md#layerwise-pipelining). The probe only ranks which
tokens the question reads, so it tolerates int4: symmetric, one float16 scale per GROUP values of
a head's vector (groups keep a key's outlier channels from flattening the rest), two values a byte.
"""

from __future__ import annotations

import math

import torch

NAME = "int4"  # the entry header's `probe` field for entries that hold this copy
GROUP = 32
SCALE_DTYPE = torch.float16


def group_size(head_dim: int) -> int | None:
    """Values sharing a scale; None where the head size cannot be packed (odd)."""
    return math.gcd(head_dim, GROUP) if head_dim % 2 == 0 else None


def part_specs(n_kv_heads: int, n_tokens: int, head_dim: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    g = group_size(head_dim)
    packed, scale = (n_kv_heads, n_tokens, head_dim // 2), (n_kv_heads, n_tokens, head_dim // g)
    return {"pk": (torch.uint8, packed), "pv": (torch.uint8, packed),
            "pk_scale": (SCALE_DTYPE, scale), "pv_scale": (SCALE_DTYPE, scale)}


def encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[H, n, d] -> (uint8 [H, n, d/2], float16 scales [H, n, d/g])."""
    H, n, d = x.shape
    g = group_size(d)
    xf = x.float().reshape(H, n, d // g, g)
    scale = (xf.abs().amax(-1) / 7.0).clamp(min=1e-8).to(SCALE_DTYPE)
    q = (torch.round(xf / scale.float().unsqueeze(-1)).clamp(-7, 7) + 8).to(torch.uint8).reshape(H, n, d)
    return q[..., 0::2] | (q[..., 1::2] << 4), scale


def decode(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Computed in fp32 (the loader asks for fp32: the rotation after it computes in fp32) in one
    buffer, in place: decoding is memory-bound, and it runs on the probe's thread."""
    H, n, half = packed.shape
    g = 2 * half // scale.shape[-1]
    q = torch.empty(H, n, half, 2, dtype=torch.float32, device=packed.device)
    q[..., 0] = packed & 15
    q[..., 1] = packed >> 4
    q = q.view(H, n, -1, g).sub_(8).mul_(scale.float().unsqueeze(-1))
    return q.view(H, n, 2 * half).to(dtype)


def layer_parts(k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
    """One layer's compact copy, named as stored."""
    pk, pk_scale = encode(k)
    pv, pv_scale = encode(v)
    return {"pk": pk, "pv": pv, "pk_scale": pk_scale, "pv_scale": pv_scale}


def entry_parts(kv) -> list[dict[str, torch.Tensor]] | None:
    """Every layer's compact copy of a ChunkKV or QuantKV; None where the head size can't be packed."""
    layers = [kv.layer(layer) for layer in range(kv.n_layers)]
    if group_size(layers[0][0].shape[-1]) is None:
        return None
    return [layer_parts(k, v) for k, v in layers]


def layer_kv(parts: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return decode(parts["pk"], parts["pk_scale"], dtype), decode(parts["pv"], parts["pv_scale"], dtype)
