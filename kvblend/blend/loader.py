"""Where stored KV enters a prefill: one layer at a time, read (memory, disk or Redis),
re-encoded to its new positions and written into the request's cache.

With `depth` > 0 a background thread reads and re-encodes up to `depth` steps ahead while the
prefill computes, so a slower tier's reads hide behind compute (CacheBlend's pipelining). The
thread does exactly what the inline path does, so the KV is bitwise the same either way.

The reads follow the passes: blend's attention probe first (where it reads an entry's compact
copy, store.probe_copy, if the entry has one), then the pass that computes the answer's KV, which
reads the full KV of what the probe read compact. A full read waits to be written until the probe
has left that layer, so the probe always sees the compact copy and the blend pass the full KV. The
probe decodes the copies itself as it takes each layer, so the reader streams on meanwhile.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from ..model.runner import KVCache, Runner
from ..model.threads import limit_this_thread
from ..store import probe_copy
from .plan import Plan

# The reader tells a tier that can take a hint (a disk: the kernel's read-ahead) this many steps
# before it reads them, so that a cold entry's bytes are on their way while it works on others.
HINT_AHEAD = 2


@dataclass
class Step:
    """One layer's reads for one pass: (part, compact) pairs, and the step whose compact rows
    these full reads overwrite (it must be done with them first), if any."""

    layer: int
    reads: list[tuple[int, bool]] = field(default_factory=list)
    after: int | None = None


def writes_in_batches(cache: KVCache) -> bool:
    """On a GPU, loading is bound by kernel launches rather than bytes: every moved chunk of a
    layer goes in one batch there. On the CPU each is written straight into its rows (no copy)."""
    return cache.k.is_cuda


class ChunkLoader:
    """Writes cached KV (exact prefix blocks at every layer, re-encoded chunks at the layers
    `start` names) into the cache, in the order the passes ask for it."""

    def __init__(self, runner: Runner, plan: Plan, cache: KVCache, depth: int = 0):
        self.runner, self.cache, self.depth = runner, cache, depth
        dev = runner.device
        # (source, offset into it, rows [start, end) it supplies, rotation tables or None)
        self.parts = []
        for (start, end), kv in plan.prefix_blocks:
            end = min(end, plan.prefix_hit)
            if end > start:
                self.parts.append((kv, 0, start, end, None))
        self.n_prefix = len(self.parts)
        # Per hit chunk: the rows it supplies (>= prefix_hit) and, when it moved, the rotations
        # that take its K there, one per rotary the model has (computed once, used at every layer).
        for c in plan.read_chunks():
            start = max(c.span[0], plan.prefix_hit)
            offset = start - c.span[0]
            delta = torch.arange(start, c.span[1]) - c.kv.positions[offset:]
            tables = runner.shift_tables(delta, dev) if bool((delta != 0).any()) else None
            self.parts.append((c.kv, offset, start, c.span[1], tables))
        # A step's moved chunks are re-encoded and written as one batch where writes_in_batches:
        # per batch, its rows' positions, concatenated rotation tables and each chunk's source rows.
        self.batched = writes_in_batches(cache)
        self._batches: dict[tuple[int, ...], tuple[torch.Tensor, dict, list]] = {}
        self.steps: list[Step] = []
        self.compact_parts = 0  # chunks the probe reads from their compact copies
        self.next_step = 0  # steps below it are handed over
        self.wait_s = 0.0  # time the prefill spent waiting for loads
        # The probe's own time decoding and writing the compact copies the reader handed it (with
        # any prefix blocks of the same steps, a small share), and the copies' bytes: the loading
        # controller weighs that cost against the waits the copies save.
        self.copy_s, self.copy_bytes = 0.0, 0
        # The reading thread's CPU (reading, checking, re-encoding and writing) for the steps that
        # read stored entries, and those bytes: with no core to spare, that CPU is the prefill's.
        self.read_cpu_s, self.read_bytes = 0.0, 0
        self._q: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._handed = threading.Condition()  # the reader waits on next_step before overwriting

    def start(self, chunk_layers, probe_layers=()) -> None:
        """Chunks are needed at `chunk_layers` (where a pass reads their KV before writing it),
        prefix blocks at every layer. With `probe_layers`, a first walk over those layers (the
        probe's) reads every chunk, its compact copy where it has one; the next walk reads the
        chunks at `chunk_layers`, in full where the probe read compact. Without, one read per
        layer serves every pass."""
        chunk_layers, L = frozenset(chunk_layers), self.runner.n_layers
        done = set()  # (part, layer) written in full
        compact_at = {}  # layer -> the probe step that wrote compact rows there
        for layer in probe_layers:
            step = Step(layer)
            for i, (src, *_) in enumerate(self.parts):
                compact = i >= self.n_prefix and getattr(src, "has_probe_copy", False)
                step.reads.append((i, compact))
                if compact:
                    compact_at[layer] = len(self.steps)
                else:
                    done.add((i, layer))
            self.steps.append(step)
        for layer in range(L):
            step = Step(layer, after=compact_at.get(layer))
            for i in range(len(self.parts)):
                if (i < self.n_prefix or layer in chunk_layers) and (i, layer) not in done:
                    step.reads.append((i, False))
            self.steps.append(step)
        self._last = {s.layer: j for j, s in enumerate(self.steps)}  # a layer's last step
        self.compact_parts = len({i for s in self.steps for i, compact in s.reads if compact})
        if self.depth > 0 and any(s.reads for s in self.steps):
            self._q = queue.Queue(maxsize=0 if self.depth >= L else self.depth)  # 0: unbounded
            self._thread = threading.Thread(target=self._work, name="kvblend-layer-loader", daemon=True)
            self._thread.start()

    def _read(self, step: Step) -> list:
        """Each read's K and V, or a compact copy's stored tensors (checked, not yet decoded)."""
        out = []
        for i, compact in step.reads:
            src = self.parts[i][0]
            out.append((i, src.parts(step.layer, compact=True) if compact else src.layer(step.layer)))
        return out

    def _stored_bytes(self, step: Step) -> int:
        """The bytes a step reads from stored entries (disk, Redis; memory's KV is not read)."""
        n = 0
        for i, compact in step.reads:
            meta = getattr(self.parts[i][0], "meta", None)  # a stored entry's header
            if meta is not None:
                n += meta.probe_layer_nbytes if compact else meta.layer_nbytes
        return n

    def _write(self, step: Step, read: list) -> None:
        """Write one step's reads, re-encoded, into the cache: straight into its rows, since a
        layer's rows are read only after load_layer hands that step over."""
        dev, layer = self.runner.device, step.layer
        if self.batched:
            moved = [(i, kv) for i, kv in read if not isinstance(kv, dict) and self.parts[i][4] is not None]
            if len(moved) > 1:
                self._write_batch(layer, moved)
                read = [(i, kv) for i, kv in read if isinstance(kv, dict) or self.parts[i][4] is None]
        for i, kv in read:
            # A compact copy decodes to fp32: re-rotation computes in fp32, writing casts once.
            k, v = probe_copy.layer_kv(kv, torch.float32) if isinstance(kv, dict) else kv
            _, offset, start, end, tables = self.parts[i]
            rows = slice(offset, offset + end - start)
            if tables is None:
                self.cache.k[layer, :, start:end] = k[:, rows].to(dev)
            else:
                self.runner.rerotate(layer, k[:, rows].to(dev), tables, out=self.cache.k[layer, :, start:end])
            self.cache.v[layer, :, start:end] = v[:, rows]

    def _write_batch(self, layer: int, moved: list) -> None:
        """Several moved chunks' K and V of one layer in one batch: concatenated, re-rotated at
        once and written by index, a few kernels for them all."""
        key = tuple(i for i, _ in moved)
        if key not in self._batches:  # the same chunks move at every layer: built once
            parts = [self.parts[i] for i in key]
            dest = torch.cat([torch.arange(start, end) for _, _, start, end, _ in parts]).to(self.runner.device)
            tables = {rk: tuple(torch.cat([p[4][rk][j] for p in parts]) for j in (0, 1)) for rk in parts[0][4]}
            spans = [(offset, offset + end - start) for _, offset, start, end, _ in parts]
            self._batches[key] = dest, tables, spans
        dest, tables, spans = self._batches[key]
        k = torch.cat([kv[0][:, a:b] for (_, kv), (a, b) in zip(moved, spans)], dim=1)
        k = k.to(self.runner.device, self.cache.k.dtype)  # half-stored K is rotated in the cache's dtype
        v = torch.cat([kv[1][:, a:b] for (_, kv), (a, b) in zip(moved, spans)], dim=1)
        self.cache.k[layer][:, dest] = self.runner.rerotate(layer, k, tables)
        self.cache.v[layer][:, dest] = v.to(self.runner.device, self.cache.v.dtype)

    def _work(self) -> None:
        # One thread for the reader's small ops: a second OpenMP team would fight the prefill's
        # threads for the same cores. Only this thread's count (torch.set_num_threads is global).
        limit_this_thread(1)
        with torch.inference_mode():
            for j in range(HINT_AHEAD):
                self._hint(j)
            for j, step in enumerate(self.steps):
                if self._stop:
                    return
                try:
                    cpu0 = time.thread_time()
                    self._hint(j + HINT_AHEAD)
                    read = self._read(step)
                    if any(compact for _, compact in step.reads):
                        # The probe decodes and writes its copies itself: the reader streams on
                        # meanwhile, as a device's reads would, instead of idling while it decodes.
                        self._count(step, time.thread_time() - cpu0)
                        self._q.put(read)
                        continue
                    if step.after is not None:  # the probe still reads this layer's compact rows
                        with self._handed:
                            self._handed.wait_for(lambda: self.next_step > step.after + 1 or self._stop)
                        if self._stop:
                            return
                    self._write(step, read)
                    self._count(step, time.thread_time() - cpu0)  # CPU time: the wait above is not in it
                except BaseException as e:  # handed to the prefill, which decides
                    self._q.put(e)
                    return
                self._q.put(step.layer)  # blocks while `depth` steps wait: never further ahead

    def _hint(self, j: int) -> None:
        """Step j's reads are coming: the entries that can (disk) have their bytes fetched now."""
        if j < len(self.steps):
            step = self.steps[j]
            for i, compact in step.reads:
                prefetch = getattr(self.parts[i][0], "prefetch", None)
                if prefetch is not None:
                    prefetch(step.layer, compact)

    def _count(self, step: Step, cpu_s: float) -> None:
        """A step's CPU on the reading thread, where it read stored entries (the memory tier's
        re-encoding, which every tier's chunks need, is the same with or without the copies)."""
        nbytes = self._stored_bytes(step)
        if nbytes:
            self.read_cpu_s += cpu_s
            self.read_bytes += nbytes

    def load_layer(self, layer: int) -> None:
        """Hand `layer` over to the pass that asks for it: its next step, or nothing where every
        step of that layer is already handed over (a later pass finds it loaded)."""
        j = self.next_step
        if j < len(self.steps) and self.steps[j].layer == layer:
            with self._handed:
                self.next_step = j + 1  # the layers of the steps before j are done with
                self._handed.notify_all()
            t0 = time.perf_counter()
            step = self.steps[j]
            done = self._q.get() if self._thread is not None else self._write(step, self._read(step))
            self.wait_s += time.perf_counter() - t0
            if isinstance(done, BaseException):
                raise done
            if isinstance(done, list):  # a compact step's reads, for this thread to write
                t0 = time.perf_counter()
                self._write(step, done)
                self.copy_s += time.perf_counter() - t0
                self.copy_bytes += sum(t.nbytes for _, kv in done if isinstance(kv, dict) for t in kv.values())
            return
        if self._last.get(layer, -1) >= j:
            raise RuntimeError(f"layer {layer} loaded before layer {self.steps[j].layer}")

    def close(self) -> None:
        """Stop the reader (a prefill that failed or ended early) without leaving it blocked."""
        self._stop = True
        with self._handed:
            self._handed.notify_all()
        while self._thread is not None and self._thread.is_alive():
            try:
                self._q.get_nowait()
            except queue.Empty:
                self._thread.join(0.01)
