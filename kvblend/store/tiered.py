"""The store the engine talks to: memory, then local disk, then Redis.

Reads go down the tiers and a hit in a slower tier is promoted to the faster ones (in the
background: promotion reads every layer and checks it). Writes go to memory at once and to the
slower tiers behind the request, on the background writer. A bad entry met while a prefill
reads it is discarded here (deleted from its tier, counted) and the engine recomputes.
"""

from __future__ import annotations

import logging
import threading

from ..config import Settings
from .chunk_kv import ChunkKV
from .disk import DiskTier
from .entry_format import BadEntry, EntrySpec
from .memory import MemoryStore
from .tier import StoredEntry, Tier
from .writer import BackgroundWriter

log = logging.getLogger(__name__)
GIB = 1 << 30
# Write-behind holds the KV it has not written yet; past this many bytes a slow tier's writes are
# dropped (counted) rather than letting the backlog grow without bound.
MAX_PENDING_BYTES = GIB


class TieredStore:
    def __init__(self, tiers: list[Tier], max_pending_bytes: int = MAX_PENDING_BYTES):
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"each tier once, got {names}")
        self.tiers = tiers
        self._writer_: BackgroundWriter | None = None  # started on first use: a memory-only store needs none
        self._pending: dict[str, ChunkKV] = {}  # written behind, not yet in a tier
        self._pending_bytes, self.max_pending_bytes, self.writes_dropped = 0, max_pending_bytes, 0
        self._promoting: set[str] = set()
        self._lock = threading.Lock()
        self._written = threading.Condition(self._lock)  # notified as write-behind entries land
        self.promotions = 0
        self.pick_by_bandwidth = False  # the loading controller's choice of tier, see read_order
        # Writes a tier that can come back (Redis) failed while it was down: tier name -> key -> KV,
        # written again by catch_up once it answers, within the same byte bound as write-behind.
        self._missed: dict[str, dict[str, ChunkKV]] = {}
        self._retrying: dict[str, set[str]] = {}  # tier name -> keys catch_up is writing again now
        self._missed_bytes, self.caught_up = 0, 0

    @property
    def _writer(self) -> BackgroundWriter:
        with self._lock:
            if self._writer_ is None:
                self._writer_ = BackgroundWriter()
            return self._writer_

    def tier(self, name: str) -> Tier | None:
        return next((t for t in self.tiers if t.name == name), None)

    # ---- reading -----------------------------------------------------------------------------

    def read_order(self) -> list[Tier]:
        """Memory, then the slower tiers: as configured, or (picking by bandwidth) fastest
        measured first, a tier not measured yet before them so that it gets measured."""
        if not self.pick_by_bandwidth:
            return self.tiers
        fast = [t for t in self.tiers if isinstance(t, MemoryStore)]
        slow = [t for t in self.tiers if not isinstance(t, MemoryStore)]
        slow.sort(key=lambda t: -(t.meter.rate if t.meter.rate is not None else float("inf")))
        return fast + slow

    def prefetch(self, keys: list[str]) -> None:
        """These keys are about to be looked up: the slower tiers that can may start fetching
        what a lookup reads (a disk its headers) for the keys no memory tier holds."""
        for tier in self.read_order():
            if isinstance(tier, MemoryStore):
                keys = [k for k in keys if k not in tier]
            elif keys and hasattr(tier, "prefetch"):
                tier.prefetch(keys)

    def get(self, key: str) -> ChunkKV | StoredEntry | None:
        order = self.read_order()
        for i, tier in enumerate(order):
            value = tier.get(key)
            if value is not None:
                if i > 0:
                    with self._lock:
                        fresh = key not in self._promoting
                        self._promoting.add(key)
                    if fresh:
                        self._writer.submit(self._promote, key, value, order[:i])
                return value
        with self._lock:
            return self._pending.get(key)

    def _promote(self, key: str, entry: StoredEntry, faster: list[Tier]) -> None:
        try:
            kv = entry.materialize()
            for tier in faster:
                tier.put(key, kv)
            self.promotions += 1
        except BadEntry as e:
            self.discard(e)
        finally:
            with self._lock:
                self._promoting.discard(key)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            if key in self._pending:
                return True
        return any(key in tier for tier in self.tiers)

    def discard(self, bad: BadEntry) -> None:
        """A prefill met a bad entry: forget it where it was found (an unreachable Redis is
        already marked down by its tier; its entries stay)."""
        tier = self.tier(bad.tier)
        if tier is not None and bad.delete and hasattr(tier, "discard"):
            tier.discard(bad.key, bad.reason)

    # ---- writing -----------------------------------------------------------------------------

    def put(self, key: str, kv: ChunkKV) -> None:
        behind = []
        for tier in self.tiers:
            if isinstance(tier, MemoryStore):
                tier.put(key, kv)  # a reference: cheap enough for the request's path
            else:
                behind.append(tier)
        if behind:
            with self._lock:
                if key in self._pending:
                    return
                if self._pending_bytes + kv.nbytes > self.max_pending_bytes:
                    self.writes_dropped += 1
                    log.warning("store: write-behind backlog over %d bytes; not writing %s to %s",
                                self.max_pending_bytes, key[:22], ", ".join(t.name for t in behind))
                    return
                self._pending[key] = kv
                self._pending_bytes += kv.nbytes
            self._writer.submit(self._write_behind, key, kv, behind)

    def _write_behind(self, key: str, kv: ChunkKV, tiers: list[Tier]) -> None:
        try:
            for tier in tiers:
                self._put_or_remember(tier, key, kv)
        finally:
            with self._lock:
                self._pending.pop(key, None)
                self._pending_bytes -= kv.nbytes
                self._written.notify_all()

    def _put_or_remember(self, tier: Tier, key: str, kv: ChunkKV) -> bool:
        """Write to one tier; a write lost because the tier is down is kept for catch_up."""
        errors = tier.write_errors
        if tier.put(key, kv) or tier.write_errors == errors or not hasattr(tier, "available"):
            return True
        with self._lock:
            missed = self._missed.setdefault(tier.name, {})
            if key in missed:
                return False
            if self._missed_bytes + kv.nbytes > self.max_pending_bytes:
                self.writes_dropped += 1
                log.warning("store: %s is down and the writes kept for it are over %d bytes; %s is not "
                            "written to it", tier.name, self.max_pending_bytes, key[:22])
                return False
            missed[key] = kv
            self._missed_bytes += kv.nbytes
        return False

    def catch_up(self) -> int:
        """Write again, in the background, what a tier missed while it was down, once it may be back
        (a tier still down keeps them for the next call). Returns how many writes were queued."""
        queued = 0
        for tier in self.tiers:
            with self._lock:
                missed = self._missed.get(tier.name)
                if not missed or not tier.available:
                    continue
                self._missed[tier.name] = {}
                self._missed_bytes -= sum(kv.nbytes for kv in missed.values())
                self._retrying.setdefault(tier.name, set()).update(missed)  # still owed until written
            for key, kv in missed.items():
                self._writer.submit(self._catch_up_one, tier, key, kv)
            queued += len(missed)
        return queued

    def _catch_up_one(self, tier: Tier, key: str, kv: ChunkKV) -> None:
        try:
            if self._put_or_remember(tier, key, kv):  # or, failing, owed again in _missed
                self.caught_up += 1
        finally:
            with self._lock:
                self._retrying[tier.name].discard(key)

    def missed_by(self, keys) -> list[str]:
        """Tiers that still owe some of `keys` a write (down when it was tried; caught up later)."""
        keys = set(keys)
        with self._lock:
            return [t.name for t in self.tiers if keys & self._owed(t.name)]

    def _owed(self, tier: str) -> set[str]:
        """Keys a tier still owes a write: missed, or being written again now (under the lock)."""
        return self._missed.get(tier, {}).keys() | self._retrying.get(tier, set())

    def holding(self, key: str) -> list[str]:
        """The tiers that hold `key` now."""
        return [t.name for t in self.tiers if key in t]

    def wait_written(self, keys, timeout_s: float) -> bool:
        """Wait until none of `keys` is still pending write-behind (written, or failed), so that
        other processes on a shared tier can read them. Unlike flush, later writes are not waited
        for. False if `timeout_s` passed first."""
        keys = set(keys)
        with self._written:
            return self._written.wait_for(lambda: not keys & self._pending.keys(), timeout_s)

    def written(self, key: str) -> bool:
        """Whether every tier written behind holds `key` (memory, when it is the only tier): other
        processes on those tiers find it."""
        behind = [t for t in self.tiers if not isinstance(t, MemoryStore)] or self.tiers
        return all(key in t for t in behind)

    def after_writes(self, fn, *args) -> None:
        """Run fn(*args) on the background writer once every write submitted so far is done (its
        queue is first in, first out), off the caller's path."""
        self._writer.submit(fn, *args)

    def delete(self, key: str) -> bool:
        return any([tier.delete(key) for tier in self.tiers])

    def flush(self) -> None:
        if self._writer_ is not None:
            self._writer_.flush()

    def close(self) -> None:
        if self._writer_ is not None:
            self._writer_.flush()
            self._writer_.close()
            self._writer_ = None

    # ---- reporting ---------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Bytes held, summed over the tiers."""
        return sum(t.used_bytes for t in self.tiers)

    def __len__(self) -> int:
        """Entries held, summed over the tiers (an entry in two tiers counts twice)."""
        return sum(len(t) for t in self.tiers)

    def bad_entries(self) -> int:
        return sum(t.counters()["bad_entries"] for t in self.tiers)

    def _owed_count(self) -> int:
        with self._lock:
            return sum(len(self._owed(t.name)) for t in self.tiers)

    def stats(self) -> dict[str, dict]:
        return {t.name: {**t.counters(), "used_bytes": t.used_bytes, "capacity_bytes": t.capacity_bytes}
                for t in self.tiers} | {"store": {"promotions": self.promotions,
                                                  "writer_errors": self._writer_.errors if self._writer_ else 0,
                                                  "writes_dropped": self.writes_dropped,
                                                  "catch_up_writes": self.caught_up,
                                                  "catch_up_pending": self._owed_count()}}


def build_store(s: Settings, spec: EntrySpec | None) -> TieredStore:
    """The tiers the settings ask for, in read order."""
    tiers: list[Tier] = []
    if s.local_cpu:
        tiers.append(MemoryStore(int(s.max_local_cpu_size * GIB)))
    if s.local_disk:
        tiers.append(DiskTier(s.local_disk, int(s.max_local_disk_size * GIB), spec))
    if s.remote_url:
        try:  # redis-py (the [redis] extra) only where a Redis tier is asked for
            from .redis_tier import RedisTier
        except ModuleNotFoundError as e:
            raise ValueError(f"remote_url needs redis-py ({e.name} is missing): pip install 'kvblend[redis]'") from e

        tiers.append(RedisTier(s.remote_url, int(s.max_remote_size * GIB), spec, s.remote_ttl, cluster=s.remote_cluster))
    return TieredStore(tiers)
