"""A tier slowed to a set read bandwidth: a slow disk or network on demand, for the loading
controller's tests and the storage benchmark."""

from __future__ import annotations

import time


class Throttled:
    def __init__(self, tier, bytes_per_s: float):
        if bytes_per_s <= 0:
            raise ValueError(f"throttle must be > 0 bytes/s, got {bytes_per_s}")
        self.inner, self.bytes_per_s = tier, bytes_per_s

    def __getattr__(self, name):  # everything but reads is the inner tier's
        return getattr(self.inner, name)

    def __contains__(self, key: str) -> bool:
        return key in self.inner

    def __len__(self) -> int:
        return len(self.inner)

    def get(self, key: str):
        entry = self.inner.get(key)
        if entry is None or not hasattr(entry, "_read_layer"):
            return entry
        read, seconds = entry._read_layer, entry.meta.layer_nbytes / self.bytes_per_s

        def slow_read(layer: int):
            t0 = time.perf_counter()
            out = read(layer)
            time.sleep(max(0.0, seconds - (time.perf_counter() - t0)))
            return out

        entry._read_layer = slow_read
        return entry
