"""What a stored entry takes per token for a model's shape, in each form kvblend stores chunk KV:
what a user plans a tier's capacity with (`kvblend store size`, docs/storage.md#planning-capacity).

The figures come from the entry format itself (an EntryMeta of the shape, its header included), so
they are what the tiers write: every layer's K and V, int8's scales, the compact copy's bytes,
the positions, and the JSON header (its positions and digests)."""

from __future__ import annotations

from dataclasses import dataclass

from . import probe_copy
from .entry_format import FORMAT_VERSION, EntryMeta

DIGEST_CHARS = 32  # an XXH3-128 digest in hex


@dataclass(frozen=True)
class Shape:
    n_layers: int
    n_kv_heads: int
    head_dim: int


def entry_bytes(shape: Shape, dtype: str, quant: str = "", compact: bool = False, n_tokens: int = 256) -> int:
    """Bytes of one entry of `n_tokens` tokens: tensors, positions and header. `quant` as EntryMeta's
    ("", "bf16", "int8"); `compact`: with the probe's compact copy (disk and Redis store one with
    each chunk unless compact_probe is false; never where the head size cannot be packed)."""
    if n_tokens <= 0:
        raise ValueError(f"an entry holds at least one token, not {n_tokens}")
    probe = probe_copy.NAME if compact and probe_copy.group_size(shape.head_dim) else ""
    digest = "0" * DIGEST_CHARS
    meta = EntryMeta(FORMAT_VERSION, "chunk-" + "0" * 64, "0" * 16, dtype, shape.n_layers, shape.n_kv_heads,
                     n_tokens, shape.head_dim, list(range(n_tokens)), [digest] * shape.n_layers, digest, quant,
                     probe, [digest] * shape.n_layers if probe else [])
    return meta.nbytes + len(meta.to_json())


def forms(dtype: str) -> list[tuple[str, str]]:
    """(label, quant) of each way chunk KV of a model computing in `dtype` can be stored."""
    out = [(dtype, "")]
    if dtype == "float32":
        out.append(("bfloat16 (kv_half)", "bf16"))
    return out + [("int8 (kv_int8)", "int8")]

