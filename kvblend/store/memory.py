"""In-process KV tier: an LRU over entries, bounded by bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict

from .chunk_kv import ChunkKV
from .tier import Counters


class MemoryStore(Counters):
    name = "memory"

    def __init__(self, capacity_bytes: int):
        super().__init__()
        if capacity_bytes < 0:
            raise ValueError(f"store capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[str, ChunkKV] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> ChunkKV | None:
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return value

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def put(self, key: str, value: ChunkKV) -> bool:
        """Insert (or refresh) an entry, evicting least recently used ones to make room.
        An entry larger than the whole capacity is not kept; returns whether it was."""
        size = value.nbytes
        with self._lock:
            self._drop(key)
            if size > self.capacity_bytes:
                return False
            while self.used_bytes + size > self.capacity_bytes:
                self._drop(next(iter(self._entries)))
                self.evictions += 1
            self._entries[key] = value
            self.used_bytes += size
            self.puts += 1
            return True

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._drop(key)

    def _drop(self, key: str) -> bool:
        value = self._entries.pop(key, None)
        if value is None:
            return False
        self.used_bytes -= value.nbytes
        return True

    def keys(self) -> list[str]:
        """Least recently used first."""
        with self._lock:
            return list(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.used_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)


MemoryTier = MemoryStore
