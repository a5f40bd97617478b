"""What bounds the Redis tier, and how it lists and counts its entries.

One server: kvblend keeps the capacity itself (max_remote_size, shared by every process on that
Redis), as an LRU sorted set of keys, a hash of their sizes and a counter of their sum, written in
the same transaction as the entry. On a cluster those three keys would live on one shard that
every read and write of every shard touches; the servers' own maxmemory, with an LRU policy,
bounds each shard instead (docs/storage.md#redis-cluster has the measurement that chose it).
Either way an entry is one Redis key, evicted or expired whole: an evicted entry is a clean miss.
"""

from __future__ import annotations

import time

from redis.cluster import RedisCluster

# What `kvblend store ls` lists: entry keys (chunk-<hex>, prefix-<hex>), not the neighbour indexes.
ENTRY_KINDS = ("chunk-", "prefix-")


class KeptCapacity:
    """kvblend's own LRU over one server's entries, bounded by `capacity_bytes`."""

    def __init__(self, prefix: str, capacity_bytes: int, entry_key):
        self.lru, self.sizes, self.used = prefix + "lru", prefix + "sizes", prefix + "used"
        self.capacity_bytes, self.entry_key = capacity_bytes, entry_key
        # Entries written by the layout before entries were one key: removed with their keys.
        self._former = lambda key: (f"{prefix}{key}:h", f"{prefix}{key}:l")

    def touch(self, pipe, keys: list[str]) -> None:
        """Queue a read's recency (only keys already stored move)."""
        pipe.zadd(self.lru, {key: time.time() for key in keys}, xx=True)

    def stage(self, pipe, key: str, size: int) -> int:
        """Queue the entry's accounting in its write's transaction; how many results it adds."""
        pipe.hsetnx(self.sizes, key, size)
        pipe.zadd(self.lru, {key: time.time()})
        return 2

    def settle(self, c, key: str, size: int, staged: list) -> int:
        """After the write: count its bytes and evict least recently used entries until they fit.
        Returns how many entries were evicted."""
        if staged[0]:  # new here, not rewritten
            c.incrby(self.used, size)
        evicted = 0
        while int(c.get(self.used) or 0) > self.capacity_bytes:
            popped = c.zpopmin(self.lru, 1)  # atomic: one process evicts each entry
            if not popped:
                break
            self.remove(c, popped[0][0].decode())
            evicted += 1
        return evicted

    def remove(self, c, key: str) -> bool:
        p = c.pipeline(transaction=True)
        p.delete(self.entry_key(key), *self._former(key))
        p.zrem(self.lru, key)
        p.hget(self.sizes, key)
        p.hdel(self.sizes, key)
        gone, _, size, had_size = p.execute()
        if had_size and size is not None:
            c.decrby(self.used, int(size))
        return bool(gone)

    def keys(self, c) -> list[str]:
        """Least recently used first."""
        return [k.decode() for k in c.zrange(self.lru, 0, -1)]

    def count(self, c) -> int:
        return int(c.zcard(self.lru))

    def used_bytes(self, c) -> int:
        return int(c.get(self.used) or 0)


class ServerCapacity:
    """A cluster's masters bound themselves (maxmemory, an LRU policy): nothing to keep here."""

    def __init__(self, prefix: str, capacity_bytes: int, entry_key):
        self.prefix, self.capacity_bytes, self.entry_key = prefix, capacity_bytes, entry_key

    def touch(self, pipe, keys: list[str]) -> None:
        pass  # every read moves a key's own LRU clock on its server

    def stage(self, pipe, key: str, size: int) -> int:
        return 0

    def settle(self, c, key: str, size: int, staged: list) -> int:
        return 0  # the servers evict, and count it (INFO stats: evicted_keys)

    def remove(self, c, key: str) -> bool:
        return bool(c.delete(self.entry_key(key)))

    def keys(self, c) -> list[str]:
        """Every master's entries, least recently used first (as far as the servers' idle times say)."""
        names = [name for kind in ENTRY_KINDS
                 for name in c.scan_iter(match=f"{self.prefix}{kind}*", count=1000,
                                         target_nodes=RedisCluster.PRIMARIES)]
        keys = [n.decode().removeprefix(self.prefix) for n in names]
        keys = [k for k in keys if ":" not in k]  # not the former layout's keys
        p = c.pipeline(transaction=False)
        for key in keys:
            p.object("idletime", self.entry_key(key))
        idle = p.execute(raise_on_error=False)
        return [k for _, k in sorted(zip(idle, keys), key=lambda t: -t[0] if isinstance(t[0], int) else 0)]

    def count(self, c) -> int:
        """Keys on the masters (the neighbour indexes too): a count, not a scan of them all."""
        return int(c.dbsize(target_nodes=RedisCluster.PRIMARIES))  # summed over the masters

    def used_bytes(self, c) -> int:
        """The masters' memory in use, everything they hold counted."""
        return sum(v["used_memory"] for v in c.info("memory", target_nodes=RedisCluster.PRIMARIES).values())
