"""Where stored KV enters a prefill: one layer at a time, read (memory, disk or Redis),
re-encoded to its new positions and written into the request's cache.

With `depth` > 0 a background thread reads and re-encodes up to `depth` layers ahead while the
prefill computes, so a slower tier's reads hide behind compute (CacheBlend's pipelining). The
thread does exactly what the inline path does, so the KV is bitwise the same either way.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from ..model.runner import KVCache, Runner
from .plan import Plan


class ChunkLoader:
    """Writes cached KV (exact prefix blocks at every layer, re-encoded chunks at the layers
    `start` names) into the cache, each layer once, in layer order."""

    def __init__(self, runner: Runner, plan: Plan, cache: KVCache, depth: int = 0):
        self.runner, self.cache, self.depth = runner, cache, depth
        dev = runner.device
        # (source, offset into it, rows [start, end) it supplies, rotation tables or None)
        self.prefix_parts = []
        for (start, end), kv in plan.prefix_blocks:
            end = min(end, plan.prefix_hit)
            if end > start:
                self.prefix_parts.append((kv, 0, start, end, None))
        # Per hit chunk: the rows it supplies (>= prefix_hit) and, when it moved, the rotations
        # that take its K there, one per rotary the model has (computed once, used at every layer).
        self.chunk_parts = []
        for c in plan.read_chunks():
            start = max(c.span[0], plan.prefix_hit)
            offset = start - c.span[0]
            delta = torch.arange(start, c.span[1]) - c.kv.positions[offset:]
            tables = runner.shift_tables(delta, dev) if bool((delta != 0).any()) else None
            self.chunk_parts.append((c.kv, offset, start, c.span[1], tables))
        self.chunk_layers: frozenset[int] = frozenset()
        self.next_layer = 0  # layers below it are loaded
        self.wait_s = 0.0  # time the prefill spent waiting for loads
        self._q: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = False

    def start(self, chunk_layers) -> None:
        """Chunks are needed at `chunk_layers` (where a pass reads their KV before writing it);
        prefix blocks at every layer."""
        self.chunk_layers = frozenset(chunk_layers)
        busy = self.prefix_parts or (self.chunk_parts and self.chunk_layers)
        if self.depth > 0 and busy:
            self._q = queue.Queue(maxsize=self.depth)
            self._thread = threading.Thread(target=self._work, name="kvblend-layer-loader", daemon=True)
            self._thread.start()

    def _write(self, layer: int) -> None:
        """Read this layer's parts and write them, re-encoded, into the cache: straight into its
        rows, since a layer's rows are read only after load_layer hands that layer over."""
        parts = self.prefix_parts + (self.chunk_parts if layer in self.chunk_layers else [])
        dev = self.runner.device
        for src, offset, start, end, tables in parts:
            k, v = src.layer(layer)
            rows = slice(offset, offset + end - start)
            if tables is None:
                self.cache.k[layer, :, start:end] = k[:, rows].to(dev)
            else:
                self.runner.rerotate(layer, k[:, rows].to(dev), tables, out=self.cache.k[layer, :, start:end])
            self.cache.v[layer, :, start:end] = v[:, rows]

    def _work(self) -> None:
        with torch.inference_mode():
            for layer in range(self.runner.n_layers):
                if self._stop:
                    return
                try:
                    self._write(layer)
                except BaseException as e:  # handed to the prefill, which decides
                    self._q.put(e)
                    return
                self._q.put(layer)  # blocks while `depth` layers wait: never further ahead

    def load_layer(self, layer: int) -> None:
        if layer < self.next_layer:
            return  # a second pass (blend after its probe) finds every layer loaded
        if layer != self.next_layer:
            raise RuntimeError(f"layer {layer} loaded before layer {self.next_layer}")
        t0 = time.perf_counter()
        done = self._q.get() if self._thread is not None else self._write(layer)
        self.wait_s += time.perf_counter() - t0
        if isinstance(done, BaseException):
            raise done
        self.next_layer = layer + 1

    def close(self) -> None:
        """Stop the reader (a prefill that failed or ended early) without leaving it blocked."""
        self._stop = True
        while self._thread is not None and self._thread.is_alive():
            try:
                self._q.get_nowait()
            except queue.Empty:
                self._thread.join(0.01)
