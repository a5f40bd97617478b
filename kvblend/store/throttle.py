"""A tier slowed to a set read bandwidth: a slow disk or network on demand, for the loading
controller's tests and the storage benchmark.

The bandwidth is shared, as a device's is: each read books the next free stretch of the link
(its bytes over the bandwidth) and returns when that stretch ends, so reads issued at once from
several threads take as long together as one after the other, never less.
"""

from __future__ import annotations

import threading
import time

import torch


class Link:
    """When the shared link is next free: each read books `seconds` of it, after the reads booked
    before it, and learns when its stretch ends."""

    def __init__(self, clock=time.perf_counter):
        self.clock, self.free_at = clock, 0.0
        self._lock = threading.Lock()

    def book(self, seconds: float, started: float) -> float:
        """The time a read that started at `started` and needs `seconds` of the link ends."""
        with self._lock:
            self.free_at = max(self.free_at, started) + seconds
            return self.free_at


class Throttled:
    def __init__(self, tier, bytes_per_s: float, clock=time.perf_counter, sleep=time.sleep):
        if bytes_per_s <= 0:
            raise ValueError(f"throttle must be > 0 bytes/s, got {bytes_per_s}")
        self.inner, self.bytes_per_s = tier, bytes_per_s
        self.link, self._clock, self._sleep = Link(clock), clock, sleep

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
        entry._read_layer = self._slow(entry._read_layer, entry.meta.layer_nbytes)
        entry._read_probe_layer = self._slow(entry._read_probe_layer, entry.meta.probe_layer_nbytes)
        return entry

    def _slow(self, read, nbytes: int):
        seconds = nbytes / self.bytes_per_s

        def slow_read(layer: int):
            t0 = self._clock()
            out = read(layer)  # the real read overlaps the booked stretch, as a device's transfer would
            fetch(out)
            self._sleep(max(0.0, self.link.book(seconds, t0) - self._clock()))
            return out

        return slow_read


PAGE = 4096


def fetch(parts: dict) -> None:
    """Touch one byte of every page of each tensor read: a disk tier's tensors map the file and
    read it only when first touched, which would put the real disk's read after the booked
    stretch instead of under it (a device delivers its bytes by the end of its transfer)."""
    for t in parts.values():
        if t.numel():
            t.reshape(-1).view(torch.uint8)[::PAGE].max()
