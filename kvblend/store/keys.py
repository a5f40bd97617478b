"""Cache keys. A key names exactly one KV: the model (fingerprint), its dtype, the namespace, how
the chunk was precomputed (context mode and, for `prefix`, the context's own hash) and the
token ids. Two requests can share an entry only if all of these agree."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def _tokens_bytes(token_ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}q", *token_ids)


def tokens_hash(token_ids: Sequence[int]) -> str:
    return hashlib.sha256(_tokens_bytes(token_ids)).hexdigest()


def chunk_key(namespace: str, fingerprint: str, dtype: str, context: str, context_hash: str,
              token_ids: Sequence[int]) -> str:
    h = hashlib.sha256()
    for part in ("chunk", namespace, fingerprint, dtype, context, context_hash):
        h.update(part.encode() + b"\0")
    h.update(_tokens_bytes(token_ids))
    return "chunk-" + h.hexdigest()


def prefix_block_keys(namespace: str, fingerprint: str, dtype: str, token_ids: Sequence[int],
                      bounds: Sequence[tuple[int, int]]) -> list[str]:
    """Hash chain over consecutive blocks from position 0: block i's key covers tokens [0, end_i),
    so a hit on it means its KV is exact for any prompt starting with those tokens."""
    h = hashlib.sha256()
    for part in ("prefix", namespace, fingerprint, dtype):
        h.update(part.encode() + b"\0")
    keys = []
    for start, end in bounds:
        h.update(_tokens_bytes(token_ids[start:end]) + b"|")
        keys.append("prefix-" + h.copy().hexdigest())
    return keys
