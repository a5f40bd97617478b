"""The in-memory LRU store, cache keys, and prefix-cache block bounds."""

from __future__ import annotations

import pytest
import torch

from kvblend.blend.plan import block_bounds
from kvblend.blend.segment import segment
from kvblend.store.chunk_kv import ChunkKV
from kvblend.store.keys import chunk_key, prefix_block_keys
from kvblend.store.memory import MemoryStore


def kv(n: int, fill: float = 0.0) -> ChunkKV:
    """n tokens of one layer, one head, head_dim 1: 4n + 4n + 8n = 16n bytes."""
    return ChunkKV(torch.full((1, 1, n, 1), fill), torch.full((1, 1, n, 1), fill),
                   torch.arange(n, dtype=torch.long))


# ---- MemoryStore ------------------------------------------------------------------------------

def test_chunk_kv_sizes() -> None:
    assert kv(3).n_tokens == 3
    assert kv(3).nbytes == 48


def test_capacity_is_respected_and_oldest_evicted() -> None:
    store = MemoryStore(capacity_bytes=160)  # room for 10 tokens
    assert store.put("a", kv(4)) and store.put("b", kv(4))
    assert store.used_bytes == 128
    assert store.put("c", kv(4))  # needs 64 more: "a" goes
    assert store.keys() == ["b", "c"]
    assert store.used_bytes == 128 <= store.capacity_bytes
    assert store.evictions == 1
    assert "a" not in store and len(store) == 2


def test_get_refreshes_recency() -> None:
    store = MemoryStore(capacity_bytes=160)
    store.put("a", kv(4))
    store.put("b", kv(4))
    assert store.get("a") is not None  # "a" is now the most recently used
    store.put("c", kv(4))
    assert "a" in store and "b" not in store and "c" in store


def test_contains_does_not_refresh_recency() -> None:
    store = MemoryStore(capacity_bytes=160)
    store.put("a", kv(4))
    store.put("b", kv(4))
    assert "a" in store
    store.put("c", kv(4))
    assert "a" not in store


def test_put_again_replaces_value_and_bytes() -> None:
    store = MemoryStore(capacity_bytes=1000)
    store.put("a", kv(4, fill=1.0))
    store.put("b", kv(2))
    assert store.put("a", kv(8, fill=2.0))
    assert store.used_bytes == 16 * 8 + 16 * 2
    assert len(store) == 2
    assert store.get("a").k[0, 0, 0, 0] == 2.0
    assert store.keys()[-1] == "a"  # re-put also makes it the most recent
    store.put("a", kv(1))
    assert store.used_bytes == 16 + 32


def test_put_again_evicts_others_only_if_needed() -> None:
    store = MemoryStore(capacity_bytes=160)
    store.put("a", kv(4))
    store.put("b", kv(4))
    store.put("a", kv(6))  # 96 + 64 = 160 fits once the old "a" is gone
    assert set(store.keys()) == {"a", "b"} and store.evictions == 0
    assert store.used_bytes == 160


def test_entry_larger_than_capacity_is_not_kept() -> None:
    store = MemoryStore(capacity_bytes=100)
    store.put("small", kv(2))
    assert store.put("big", kv(7)) is False  # 112 bytes
    assert "big" not in store
    assert store.keys() == ["small"] and store.used_bytes == 32  # nothing evicted for it
    assert MemoryStore(0).put("x", kv(1)) is False


def test_entry_exactly_capacity_is_kept() -> None:
    store = MemoryStore(capacity_bytes=64)
    store.put("a", kv(1))
    assert store.put("b", kv(4))
    assert store.keys() == ["b"] and store.used_bytes == 64


def test_delete() -> None:
    store = MemoryStore(capacity_bytes=1000)
    store.put("a", kv(2))
    store.put("b", kv(3))
    assert store.delete("a") is True
    assert store.delete("a") is False
    assert store.keys() == ["b"] and store.used_bytes == 48
    assert store.get("a") is None


def test_hit_and_miss_counters() -> None:
    store = MemoryStore(capacity_bytes=1000)
    store.put("a", kv(1))
    assert store.get("a") is not None
    assert store.get("a") is not None
    assert store.get("nope") is None
    assert (store.hits, store.misses) == (2, 1)


def test_clear() -> None:
    store = MemoryStore(capacity_bytes=1000)
    store.put("a", kv(2))
    store.clear()
    assert len(store) == 0 and store.used_bytes == 0


def test_negative_capacity_is_an_error() -> None:
    with pytest.raises(ValueError, match="capacity"):
        MemoryStore(capacity_bytes=-1)


# ---- keys -------------------------------------------------------------------------------------

BASE = dict(namespace="ns", fingerprint="fp", dtype="float32", context="prefix", context_hash="h",
            token_ids=[1, 2, 3])


def test_chunk_key_is_stable_for_equal_inputs() -> None:
    assert chunk_key(**BASE) == chunk_key(**{**BASE, "token_ids": (1, 2, 3)})
    assert chunk_key(**BASE).startswith("chunk-")


@pytest.mark.parametrize("field, other", [
    ("namespace", "ns2"), ("fingerprint", "fp2"), ("dtype", "bfloat16"), ("context", "bare"),
    ("context_hash", "h2"), ("token_ids", [1, 2, 4]), ("token_ids", [1, 2]), ("token_ids", [1, 2, 3, 0]),
])
def test_chunk_key_depends_on_every_part(field: str, other) -> None:
    assert chunk_key(**BASE) != chunk_key(**{**BASE, field: other})


def test_chunk_key_parts_do_not_run_together() -> None:
    # ("ab", "c") and ("a", "bc") must not hash the same.
    a = chunk_key(**{**BASE, "namespace": "ab", "fingerprint": "c"})
    b = chunk_key(**{**BASE, "namespace": "a", "fingerprint": "bc"})
    assert a != b


BOUNDS = [(0, 3), (3, 6), (6, 9), (9, 10)]
TOKENS = list(range(100, 110))


def block_keys(tokens, bounds=BOUNDS, **kw):
    args = dict(namespace="ns", fingerprint="fp", dtype="float32") | kw
    return prefix_block_keys(token_ids=tokens, bounds=bounds, **args)


def test_prefix_block_keys_are_stable_and_distinct() -> None:
    keys = block_keys(TOKENS)
    assert keys == block_keys(list(TOKENS))
    assert len(keys) == len(BOUNDS) == len(set(keys))
    assert all(k.startswith("prefix-") for k in keys)


def test_prefix_block_keys_change_in_block_0_changes_every_key() -> None:
    tokens = TOKENS.copy()
    tokens[1] = 0
    assert all(a != b for a, b in zip(block_keys(TOKENS), block_keys(tokens)))


def test_prefix_block_keys_change_in_block_2_keeps_earlier_keys() -> None:
    tokens = TOKENS.copy()
    tokens[7] = 0
    before, after = block_keys(TOKENS), block_keys(tokens)
    assert before[:2] == after[:2]
    assert before[2] != after[2] and before[3] != after[3]


def test_prefix_block_keys_shared_prefix_shares_keys() -> None:
    longer = TOKENS + [1, 2, 3]
    assert block_keys(longer, BOUNDS + [(10, 13)])[:4] == block_keys(TOKENS)


def test_prefix_block_keys_depend_on_model_and_block_cuts() -> None:
    assert block_keys(TOKENS)[0] != block_keys(TOKENS, fingerprint="other")[0]
    assert block_keys(TOKENS)[0] != block_keys(TOKENS, dtype="bfloat16")[0]
    assert block_keys(TOKENS)[0] != block_keys(TOKENS, namespace="other")[0]
    # Same tokens [0, 6), cut differently: the key for [0, 6) differs.
    assert block_keys(TOKENS, [(0, 2), (2, 6)])[1] != block_keys(TOKENS, [(0, 4), (4, 6)])[1]


# ---- plan.block_bounds ------------------------------------------------------------------------

SEP = [9, 9]


def assert_contiguous(bounds, limit) -> None:
    assert bounds[0][0] == 0 and bounds[-1][1] == limit
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert all(s < e for s, e in bounds)


def test_block_bounds_cut_at_segment_edges_and_every_block() -> None:
    # prefix [0,5)  sep [5,7)  chunk [7,10)  sep [10,12)  suffix [12,20)
    ids = [1] * 5 + SEP + [2] * 3 + SEP + [3] * 8
    seg = segment(ids, SEP)
    bounds = block_bounds(seg, block=4, limit=len(ids))
    assert bounds == [(0, 4), (4, 5), (5, 7), (7, 10), (10, 12), (12, 16), (16, 20)]
    assert_contiguous(bounds, len(ids))


def test_block_bounds_stop_at_limit() -> None:
    ids = [1] * 5 + SEP + [2] * 3 + SEP + [3] * 8
    seg = segment(ids, SEP)
    assert block_bounds(seg, block=4, limit=9) == [(0, 4), (4, 5), (5, 7), (7, 9)]
    bounds = block_bounds(seg, block=3, limit=15)
    assert_contiguous(bounds, 15)
    assert all(e - s <= 3 for s, e in bounds)


def test_block_bounds_chunk_blocks_do_not_depend_on_what_precedes() -> None:
    # A chunk's inner cuts start at its own edge, not at multiples of `block` from 0.
    ids = [1] * 3 + SEP + [2] * 10 + SEP + [3]
    bounds = block_bounds(segment(ids, SEP), block=4, limit=len(ids))
    assert [b for b in bounds if 5 <= b[0] < 15] == [(5, 9), (9, 13), (13, 15)]


def test_block_bounds_without_separator() -> None:
    seg = segment([1] * 10, SEP)
    assert block_bounds(seg, block=4, limit=10) == [(0, 4), (4, 8), (8, 10)]
    assert block_bounds(seg, block=4, limit=0) == []
