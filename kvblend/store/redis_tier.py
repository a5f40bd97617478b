"""Shared remote tier on Redis, one server or a Redis Cluster, so several kvblend processes (or
machines) share one chunk cache.

An entry is one Redis hash, `<prefix><key>`: field `h` the entry header (entry_format) as JSON,
one field per layer (that layer's K bytes then V bytes, fetched alone with HGET), `p<layer>` the
compact copy's where the entry has one. It is written by one HSET inside a transaction, so it is
read whole or not at all, lives in one slot of a cluster, and a server that evicts or expires it
takes all of it: an evicted entry is a clean miss. What bounds the tier is redis_capacity's.

Reads of one request are pipelined: its lookups' headers in one round trip (per shard, at once,
on a cluster), and each layer of every chunk it reads in one more, not one per chunk.

A node being down is never an error for a request: the keys it serves read as empty and their
writes fail (TieredStore writes them again later) for `retry_s`, then it is tried again. On a
cluster that is the down master's slots only, until its replica takes over; redis-py reconnects
and relearns the slot map by itself.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref

import redis
import torch

from .chunk_kv import ChunkKV
from .entry_format import BadEntry, EntryMeta, EntrySpec, check_meta, describe, raw_bytes, specs_nbytes
from .probe_copy import entry_parts as compact_copy
from .redis_capacity import KeptCapacity, ServerCapacity
from .redis_client import FAULTS, connect, parse_url
from .tier import Counters, StoredEntry, TierDown

log = logging.getLogger(__name__)
HEADER = "h"
EVERYWHERE = "*"  # the down-mark of the whole tier: one server, or a cluster none of whose nodes answers
PREFETCHED_S = 1.0  # how long a header read ahead of its lookup is trusted


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


def layer_field(layer: int, compact: bool = False) -> str:
    return f"p{layer}" if compact else str(layer)


class RedisEntry(StoredEntry):
    def __init__(self, meta: EntryMeta, tier: RedisTier):
        # No meter of its own: a layer is often read with other entries' in one pipeline, so the
        # tier measures those reads (RedisTier.layer_bytes), not each entry its share of them.
        super().__init__(meta, "redis")
        self._tier = tier
        self.fetched: dict[str, bytes | None] = {}  # layers read with another entry's, not yet taken

    def prefetch(self, layer: int, compact: bool = False) -> None:
        """This layer is read soon: fetched with the same layer of the other entries asked for it."""
        self._tier.want(self, layer_field(layer, compact))

    def _read_layer(self, layer: int):
        return self._read(layer, compact=False)

    def _read_probe_layer(self, layer: int):
        return self._read(layer, compact=True)

    def _read(self, layer: int, compact: bool):
        field = layer_field(layer, compact)
        try:
            data = self._tier.layer_bytes(self, field)
        except TierDown:
            raise BadEntry(self.key, "redis", "Redis unreachable", delete=False) from None
        if data is None:
            raise BadEntry(self.key, "redis", f"layer {field} missing (evicted or expired meanwhile)")
        return decode_layer(data, self.meta, compact)


class RedisTier(Counters):
    name = "redis"

    def __init__(self, url: str, capacity_bytes: int, spec: EntrySpec | None = None, ttl_s: int | None = None,
                 prefix: str = "kvblend:", retry_s: float = 2.0, timeout_s: float = 2.0, cluster: bool = False):
        super().__init__()
        self._url, self.cluster = parse_url(url, cluster)
        if capacity_bytes < 0:
            raise ValueError(f"remote tier capacity must be >= 0 bytes, got {capacity_bytes}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"remote TTL must be > 0 seconds, got {ttl_s}")
        if "{" in prefix or "}" in prefix:  # a brace would make a hash tag of part of every key
            raise ValueError(f"Redis key prefix {prefix!r} must not hold braces")
        self.url, self.capacity_bytes, self.spec, self.ttl_s = url, capacity_bytes, spec, ttl_s
        self.prefix, self.retry_s, self.timeout_s = prefix, retry_s, timeout_s
        kind = ServerCapacity if self.cluster else KeptCapacity
        self.capacity = kind(prefix, capacity_bytes, self.entry_key)
        self._client: redis.Redis | redis.RedisCluster | None = None
        self._down: dict[str, float] = {}  # node name (EVERYWHERE: all) -> until when it reads as empty
        self._lock = threading.Lock()
        self._headers: dict[str, tuple[float, bytes | None]] = {}  # read ahead of their lookups
        self._wanted: dict[str, weakref.WeakSet] = {}  # layer field -> entries that will read it soon
        self.unreachable = 0  # times a node (or the server) was found down

    # ---- plumbing ----------------------------------------------------------------------------

    def entry_key(self, key: str) -> str:
        return self.prefix + key

    @property
    def client(self) -> redis.Redis | redis.RedisCluster:
        """The client, made on first use (a cluster's asks a node for the slot map as it is made)."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = connect(self._url, self.cluster, self.timeout_s)
                    if self.cluster:
                        self._check_eviction(self._client)
        return self._client

    def _check_eviction(self, c) -> None:
        """A cluster is bounded by its masters' maxmemory: say so where one would fill up instead."""
        try:
            configs = c.config_get("maxmemory*", target_nodes=redis.RedisCluster.PRIMARIES)
        except (redis.RedisError, *FAULTS):  # managed services may refuse CONFIG: nothing to say then
            return
        if "maxmemory" in configs:  # one master: redis-py gives its answer alone
            configs = {"the master": configs}
        unbounded = [node for node, cfg in configs.items()
                     if cfg.get("maxmemory") == "0" or cfg.get("maxmemory-policy", "").endswith("noeviction")]
        if unbounded:
            log.warning("redis cluster %s: %s without maxmemory or with noeviction; kvblend leaves a cluster's "
                        "capacity to its servers: set maxmemory and allkeys-lru on every node (docs/storage.md"
                        "#redis-cluster)", self.url, ", ".join(unbounded))

    def _node(self, key: str | None) -> str:
        """Which node serves `key` now, as far as redis-py's slot map says (the down-mark's name)."""
        if key is None or not self.cluster or self._client is None:
            return EVERYWHERE
        try:
            return self._client.get_node_from_key(self.entry_key(key)).name
        except FAULTS:
            return EVERYWHERE

    def _is_down(self, node: str) -> bool:
        now = time.monotonic()
        return now < self._down.get(node, 0.0) or now < self._down.get(EVERYWHERE, 0.0)

    def _mark_down(self, node: str, error: Exception) -> None:
        with self._lock:
            if not self._is_down(node):
                self.unreachable += 1
                where = "redis" if node == EVERYWHERE else f"redis node {node}"
                log.warning("%s of tier %s unreachable (%s: %s); its keys read as empty for %.0f s", where,
                            self.url, type(error).__name__, error, self.retry_s)
            self._down[node] = time.monotonic() + self.retry_s

    @property
    def available(self) -> bool:
        """Whether the tier as a whole may be tried (a down cluster node leaves the others)."""
        return time.monotonic() >= self._down.get(EVERYWHERE, 0.0)

    def _run(self, fn, key: str | None = None):
        """fn(client) for `key` (None: no key in particular); TierDown where its node is down."""
        node = self._node(key)
        if self._is_down(node):
            raise TierDown
        try:
            return fn(self.client)
        except FAULTS as e:
            self._mark_down(node if self._client is not None else EVERYWHERE, e)
            raise TierDown from e

    def _each(self, keys: list[str], add, then=None) -> dict:
        """add(pipeline, key) for every key in one pipeline (one round trip per shard, sent to all
        shards before any answer is read), then then(pipeline, keys) where given; the keys' results
        by key. Keys of a node that is down, or goes down now, are left out (the others answer)."""
        keys = list(dict.fromkeys(k for k in keys if not self._is_down(self._node(k))))
        if not keys:
            return {}
        try:
            return self._pipelined(keys, add, then)
        except FAULTS as e:
            if not self.cluster or self._client is None:
                self._mark_down(EVERYWHERE, e)
                return {}
        out, nodes = {}, {}
        for key in keys:  # a node failed: each node's keys alone, so the others' still answer
            nodes.setdefault(self._node(key), []).append(key)
        for node, group in nodes.items():
            try:
                out |= self._pipelined(group, add, then)
            except FAULTS as e:
                self._mark_down(node, e)
        return out

    def _pipelined(self, keys: list[str], add, then=None) -> dict:
        p = self.client.pipeline(transaction=False)
        for key in keys:
            add(p, key)
        if then is not None:
            then(p, keys)
        return dict(zip(keys, p.execute()))

    def call(self, fn, key: str | None = None):
        """fn(client) for a neighbour of the entries (the neighbour indexes) whose Redis key is
        `key`; TierDown while its node is down."""
        return self._run(fn, key)

    def counters(self) -> dict[str, int]:
        return {**super().counters(), "unreachable": self.unreachable}

    # ---- reading -----------------------------------------------------------------------------

    def prefetch(self, keys: list[str]) -> None:
        """These keys are about to be looked up: read every header in one pipeline, so that the
        lookups wait for one round trip, not one each."""
        now = time.monotonic()
        got = self._each(keys, lambda p, k: p.hget(self.entry_key(k), HEADER), then=self.capacity.touch)
        with self._lock:
            self._headers = {k: v for k, v in self._headers.items() if now - v[0] < PREFETCHED_S}
            self._headers.update((k, (now, raw)) for k, raw in got.items())

    def _touch(self, c, keys: list[str]) -> None:
        if keys:
            p = c.pipeline(transaction=False)
            self.capacity.touch(p, keys)
            p.execute()

    def _header(self, key: str, touch: bool) -> EntryMeta | None:
        with self._lock:
            ahead = self._headers.pop(key, None)
        if ahead is not None and time.monotonic() - ahead[0] < PREFETCHED_S:
            raw = ahead[1]
        else:
            def read(c):
                p = c.pipeline(transaction=False)
                p.hget(self.entry_key(key), HEADER)
                if touch:
                    self.capacity.touch(p, [key])
                return p.execute()[0]

            try:
                raw = self._run(read, key)
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

    def want(self, entry: RedisEntry, field: str) -> None:
        with self._lock:
            self._wanted.setdefault(field, weakref.WeakSet()).add(entry)

    def layer_bytes(self, entry: RedisEntry, field: str) -> bytes | None:
        """One layer field of an entry: read before with others, or now with every entry that
        asked for the same field (RedisEntry.prefetch) in one pipeline. None: not there."""
        with self._lock:
            if field in entry.fetched:
                return entry.fetched.pop(field)
            group = [e for e in self._wanted.pop(field, ()) if e is not entry and field not in e.fetched]
        t0 = time.perf_counter()
        got = self._each([entry.key] + [e.key for e in group], lambda p, k: p.hget(self.entry_key(k), field))
        self.meter.record(sum(len(v) for v in got.values() if v), time.perf_counter() - t0)
        with self._lock:
            for e in group:
                if e.key in got:
                    e.fetched[field] = got[e.key]
        if entry.key not in got:
            raise TierDown
        return got[entry.key]

    def __contains__(self, key: str) -> bool:
        try:
            return bool(self._run(lambda c: c.hexists(self.entry_key(key), HEADER), key))
        except TierDown:
            return False

    def _report(self, fn, default):
        """A figure over the whole tier (every master of a cluster); `default` while it cannot be had."""
        try:
            return self._run(lambda c: fn(c)) if not self.cluster else fn(self.client)
        except (TierDown, *FAULTS):
            return default

    def keys(self) -> list[str]:
        """Least recently used first."""
        return self._report(self.capacity.keys, [])

    def __len__(self) -> int:
        return self._report(self.capacity.count, 0)

    @property
    def used_bytes(self) -> int:
        return self._report(self.capacity.used_bytes, 0)

    # ---- writing -----------------------------------------------------------------------------

    def put(self, key: str, kv: ChunkKV) -> bool:
        if self.spec is None:
            raise ValueError("a Redis tier without a model spec is read-only")
        probe = compact_copy(kv) if kv.probe_copy else None
        meta = describe(key, kv, self.spec.fingerprint, probe)
        size = meta.nbytes
        if size > self.capacity_bytes:
            return False
        fields = {HEADER: meta.to_json()}
        fields |= {layer_field(layer): encode_layer(kv.parts(layer)) for layer in range(kv.n_layers)}
        fields |= {layer_field(layer, True): encode_layer(p) for layer, p in enumerate(probe or [])}
        ek = self.entry_key(key)

        def write(c) -> bool:
            if c.hexists(ek, HEADER):  # already stored (by us or another process): only refresh its recency
                self._touch(c, [key])
                return False
            p = c.pipeline(transaction=True)  # one slot, one transaction: read whole or not at all
            p.delete(ek)
            p.hset(ek, mapping=fields)
            if self.ttl_s:
                p.expire(ek, self.ttl_s)
            n = self.capacity.stage(p, key, size)
            results = p.execute()
            staged = results[len(results) - n:]
            self.evictions += self.capacity.settle(c, key, size, staged)
            return True

        try:
            wrote = self._run(write, key)
        except TierDown:
            self.write_errors += 1
            return False
        except redis.ResponseError as e:  # a full server that evicts nothing (OOM), a refused command
            self.write_errors += 1
            log.warning("redis tier: cannot write %s (%s); going on without it", key[:22], e)
            return False
        if wrote:
            self.puts += 1
        return True

    def delete(self, key: str) -> bool:
        try:
            return self._run(lambda c: self.capacity.remove(c, key), key)
        except TierDown:
            return False

    def discard(self, key: str, reason: str) -> None:
        self.bad_entries += 1
        log.warning("redis tier: dropping entry %s: %s", key[:22], reason)
        self.delete(key)
