"""Shared remote tier on Redis, so several kvblend processes (or machines) share one chunk cache.

Per entry, two Redis keys: `<prefix><key>:l`, a hash of one value per layer (that layer's K bytes
then V bytes, fetched alone with HGET; `p<layer>` the compact copy's, where the entry has one),
and `<prefix><key>:h`, the entry header (entry_format) as JSON. The header is written last,
after every layer, so a half-written entry has no header and reads as a miss. Capacity is shared
by every process using the same Redis and prefix: a sorted set orders entries by last use (LRU),
a hash holds their sizes, a counter their sum.

Redis being down is never an error for a request: the tier reads as empty and drops writes
for `retry_s`, then tries again (redis-py reconnects by itself)."""

from __future__ import annotations

import logging
import math
import threading
import time

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from .chunk_kv import ChunkKV
from .entry_format import BadEntry, EntryMeta, EntrySpec, check_meta, describe, raw_bytes, specs_nbytes
from .probe_copy import entry_parts as compact_copy
from .tier import Counters, StoredEntry, TierDown

log = logging.getLogger(__name__)
URL_SCHEMES = ("redis://", "rediss://", "unix://")


def encode_layer(parts: dict[str, torch.Tensor]) -> bytes:
    return b"".join(bytes(raw_bytes(t)) for t in parts.values())


def decode_layer(data: bytes, meta: EntryMeta, compact: bool = False) -> dict[str, torch.Tensor]:
    specs = meta.probe_specs() if compact else meta.part_specs()
    expected = specs_nbytes(specs)
    if len(data) != expected:
        raise ValueError(f"{len(data)} bytes, header says {expected}")
    buf, parts, at = bytearray(data), {}, 0
    for name, (dt, shape) in specs.items():
        n = dt.itemsize * math.prod(shape)
        parts[name] = torch.frombuffer(buf, dtype=dt, count=math.prod(shape), offset=at).view(shape)
        at += n
    return parts


class RedisEntry(StoredEntry):
    def __init__(self, meta: EntryMeta, tier: RedisTier):
        super().__init__(meta, "redis", tier.meter)
        self._tier = tier

    def _read_layer(self, layer: int):
        return self._read(layer, compact=False)

    def _read_probe_layer(self, layer: int):
        return self._read(layer, compact=True)

    def _read(self, layer: int, compact: bool):
        field = f"p{layer}" if compact else str(layer)
        try:
            data = self._tier._run(lambda c: c.hget(self._tier._layers_key(self.key), field))
        except TierDown:
            raise BadEntry(self.key, "redis", "Redis unreachable", delete=False) from None
        if data is None:
            raise BadEntry(self.key, "redis", f"layer {field} missing (evicted or expired meanwhile)")
        return decode_layer(data, self.meta, compact)


class RedisTier(Counters):
    name = "redis"

    def __init__(self, url: str, capacity_bytes: int, spec: EntrySpec | None = None, ttl_s: int | None = None,
                 prefix: str = "kvblend:", retry_s: float = 2.0, timeout_s: float = 2.0):
        super().__init__()
        if not url.startswith(URL_SCHEMES):
            raise ValueError(f"remote_url {url!r}: kvblend's remote tier is Redis; give a "
                             f"redis://host:port[/db] (or rediss://, unix://) URL")
        if capacity_bytes < 0:
            raise ValueError(f"remote tier capacity must be >= 0 bytes, got {capacity_bytes}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"remote TTL must be > 0 seconds, got {ttl_s}")
        self.url, self.capacity_bytes, self.spec, self.ttl_s = url, capacity_bytes, spec, ttl_s
        self.prefix, self.retry_s = prefix, retry_s
        # One quick retry covers a connection that went stale across a Redis restart; no backoff,
        # so a dead server costs a request one refused connect, not seconds.
        self.client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                                           retry=Retry(NoBackoff(), 1))
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.unreachable = 0  # times the tier found Redis down

    # ---- plumbing ----------------------------------------------------------------------------

    def _header_key(self, key: str) -> str:
        return f"{self.prefix}{key}:h"

    def _layers_key(self, key: str) -> str:
        return f"{self.prefix}{key}:l"

    @property
    def _lru(self) -> str:
        return self.prefix + "lru"

    @property
    def _sizes(self) -> str:
        return self.prefix + "sizes"

    @property
    def _used(self) -> str:
        return self.prefix + "used"

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _run(self, fn):
        if not self.available:
            raise TierDown
        try:
            return fn(self.client)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            with self._lock:
                if self.available:
                    self.unreachable += 1
                    log.warning("redis tier %s unreachable (%s); local tiers only for %.0f s", self.url, e,
                                self.retry_s)
                self._down_until = time.monotonic() + self.retry_s
            raise TierDown from e

    def call(self, fn):
        """fn(client) for a neighbour of the entries (the neighbour indexes); TierDown while down."""
        return self._run(fn)

    def counters(self) -> dict[str, int]:
        return {**super().counters(), "unreachable": self.unreachable}

    # ---- reading -----------------------------------------------------------------------------

    def _header(self, key: str, touch: bool) -> EntryMeta | None:
        def read(c):
            p = c.pipeline(transaction=False)
            p.get(self._header_key(key))
            if touch:
                p.zadd(self._lru, {key: time.time()}, xx=True)
            return p.execute()[0]

        try:
            raw = self._run(read)
        except TierDown:
            return None
        if raw is None:
            return None
        try:
            meta = EntryMeta.from_json(raw)
            why = check_meta(meta, key, self.spec)
        except Exception as e:
            why = f"unreadable header ({type(e).__name__}: {e})"
        if why:
            self.discard(key, why)
            return None
        return meta

    def get(self, key: str) -> RedisEntry | None:
        meta = self._header(key, touch=True)
        if meta is None:
            self.misses += 1
            return None
        self.hits += 1
        return RedisEntry(meta, self)

    def header(self, key: str) -> EntryMeta | None:
        return self._header(key, touch=False)

    def __contains__(self, key: str) -> bool:
        try:
            return bool(self._run(lambda c: c.exists(self._header_key(key))))
        except TierDown:
            return False

    def keys(self) -> list[str]:
        """Least recently used first."""
        try:
            return [k.decode() for k in self._run(lambda c: c.zrange(self._lru, 0, -1))]
        except TierDown:
            return []

    def __len__(self) -> int:
        try:
            return int(self._run(lambda c: c.zcard(self._lru)))
        except TierDown:
            return 0

    @property
    def used_bytes(self) -> int:
        try:
            return int(self._run(lambda c: c.get(self._used)) or 0)
        except TierDown:
            return 0

    # ---- writing -----------------------------------------------------------------------------

    def put(self, key: str, kv: ChunkKV) -> bool:
        if self.spec is None:
            raise ValueError("a Redis tier without a model spec is read-only")
        probe = compact_copy(kv) if kv.probe_copy else None
        meta = describe(key, kv, self.spec.fingerprint, probe)
        size = meta.nbytes
        if size > self.capacity_bytes:
            return False
        layers = {str(layer): encode_layer(kv.parts(layer)) for layer in range(kv.n_layers)}
        layers |= {f"p{layer}": encode_layer(p) for layer, p in enumerate(probe or [])}
        ttl = self.ttl_s

        def write(c) -> bool:
            hk, lk = self._header_key(key), self._layers_key(key)
            if c.exists(hk):  # already stored (by us or another process): only refresh its recency
                c.zadd(self._lru, {key: time.time()}, xx=True)
                return False
            p = c.pipeline(transaction=False)
            p.delete(lk)  # layers a dead writer may have left
            p.hset(lk, mapping=layers)
            if ttl:
                p.expire(lk, ttl)
            p.execute()
            p = c.pipeline(transaction=True)  # the header last: only now is the entry visible
            p.set(hk, meta.to_json(), ex=ttl)
            p.hsetnx(self._sizes, key, size)
            p.zadd(self._lru, {key: time.time()})
            if p.execute()[1]:
                c.incrby(self._used, size)
            self._evict(c)
            return True

        try:
            wrote = self._run(write)
        except TierDown:
            self.write_errors += 1
            return False
        if wrote:
            self.puts += 1
        return True

    def _evict(self, c) -> None:
        while int(c.get(self._used) or 0) > self.capacity_bytes:
            popped = c.zpopmin(self._lru, 1)  # atomic: one process evicts each entry
            if not popped:
                break
            self._remove(c, popped[0][0].decode())
            self.evictions += 1

    def _remove(self, c, key: str) -> bool:
        p = c.pipeline(transaction=True)
        p.delete(self._header_key(key))  # header first: nobody starts reading a dying entry
        p.delete(self._layers_key(key))
        p.zrem(self._lru, key)
        p.hget(self._sizes, key)
        p.hdel(self._sizes, key)
        gone_h, _, _, size, had_size = p.execute()
        if had_size and size is not None:
            c.decrby(self._used, int(size))
        return bool(gone_h)

    def delete(self, key: str) -> bool:
        try:
            return self._run(lambda c: self._remove(c, key))
        except TierDown:
            return False

    def discard(self, key: str, reason: str) -> None:
        self.bad_entries += 1
        log.warning("redis tier: dropping entry %s: %s", key[:22], reason)
        self.delete(key)
