"""The loading controller (CacheBlend's section 5, on measured numbers, for the whole request).

A blend prefill reads stored KV in the order its passes need it: the attention probe's layers
first, then the layers the blend pass reads that the probe did not (with a full-depth probe,
none; with compact_probe, in full, those the probe read compact). One background reader
streams them back to back from the moment the request is planned; each pass's layer starts when
the one before it is done and its KV has arrived. The controller plays that schedule out layer
by layer, from each tier's measured read bandwidth (store.tier.Meter) and the measured compute
speed in (layer, row) pairs a second. Where the plain schedule (the configured ratio, the probe
over the full KV) would wait for reads less than ACT_WAIT of the prefill, it changes nothing, so
memory and fast tiers give the output of the controller off, bit for bit. Elsewhere it chooses:

- which chunks to recompute instead of read: the slowest tier's first, while that makes the
  estimated time to first token shorter (reading them costs more than computing their rows);
- the recompute ratio: raised above the configured ratio (a quality floor, never undercut) as
  far as the estimate grows by at most one layer's read, i.e. while the extra rows compute in
  time the pass would otherwise spend waiting for reads;
- the tier to read a chunk from, when it is on several: the fastest measured (TieredStore);
- with compact_probe, whether the probe reads the compact copies: only where the waits they save
  outweigh decoding and writing them on the prefill's own thread, at their measured rate, and,
  on a machine with no core to spare for the reader, the reader's CPU that then runs beside
  compute (the copies, and the full KV under the blend pass) instead of in the probe's waits.

Where the probe walks every layer it needs every layer's stored KV before the blend pass can
start, so a slow tier's reads fall before the blend pass and no ratio hides them: the controller
says so (`reason`), with the wait it expects. With compact_probe the probe reads compact copies
(about a quarter of the bytes) and the full KV streams in behind it, where the blend pass's
compute can cover it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..model.threads import usable_cores
from ..store.tier import Meter
from .fusor import BlendConfig
from .plan import Plan


@dataclass
class Decision:
    floor: float  # the configured ratio
    ratio: float  # the ratio used
    dropped: int = 0  # chunks recomputed instead of read
    load_s: float = 0.0  # estimated seconds to read one layer of the stored KV used
    compute_s: float = 0.0  # estimated seconds to compute one blend-pass layer at `ratio`, past the check
    ttft_s: float = 0.0  # estimated prefill seconds at this decision
    wait_s: float = 0.0  # of which waiting for reads
    reason: str = ""
    compact: bool = False  # the probe reads compact copies (only where compact_probe stored them)
    copies_gain: float = 0.0  # share of the prefill the copies were expected to save, their decoding counted
    copies_cpu_s: float = 0.0  # of which the reader's CPU beside compute they were charged (no spare core)


@dataclass
class Work:
    """What one prefill computes and reads, layer by layer, at one ratio."""

    blend_reads: list[int]  # layers the blend pass reads after the probe's (not those it loaded in full)
    compact: bool  # the probe reads compact copies; the blend pass then reads those entries in full
    probe_layers: int  # the probe reads these first layers (compact copies, with compact_probe)
    probe_rows: int
    blend_rows: list[int]  # rows the blend pass computes at each layer


def work(plan: Plan, cfg: BlendConfig, ratio: float, n_layers: int) -> Work:
    """The rows each pass computes and the layers whose chunk KV it reads, as fusor.prefill lays
    them out (blend mode with at least one check layer)."""
    T, P = plan.n_tokens, plan.prefix_hit
    reused = int(plan.reused_mask().sum())
    must = T - P - reused
    ratios = [max(r, ratio) for r in cfg.ratios]
    first = min(cfg.check_layers)
    suffix = plan.segments.suffix[0]
    probe = cfg.weight_by_attention and suffix < T and reused > 0
    probe_depth = min(cfg.probe_layers or n_layers, n_layers) if probe else 0
    probe_rows = must
    if probe:
        if not cfg.probe_separators:
            probe_rows -= int(plan.separator_mask()[P:].sum())
        if cfg.probe_suffix_tokens:
            probe_rows -= max(0, T - cfg.probe_suffix_tokens - max(suffix, P))
    candidates = probe and cfg.check_candidates
    blend_from = 0 if candidates else first
    compact = cfg.compact_probe and probe_depth > 0
    if not compact:
        blend_from = max(probe_depth, blend_from)
    n_first = cfg.budget(ratios[cfg.check_layers.index(first)], reused)
    early = must + (min(reused, math.ceil(cfg.check_candidates * n_first)) if candidates else reused)
    rows, kept = [], early
    for layer in range(n_layers):
        if layer in cfg.check_layers:
            kept = must + cfg.budget(ratios[cfg.check_layers.index(layer)], reused)
        rows.append(kept)
    return Work(list(range(blend_from, n_layers)), compact, probe_depth, probe_rows, rows)


@dataclass
class LayerReads:
    """Seconds to read one layer of a plan's stored KV, per view."""

    full: float  # every entry in full
    compact: float = 0.0  # what the probe reads with compact_probe: copies where entries have them
    rest: float = 0.0  # what the blend pass then reads in full: the entries the probe read compact
    decode: float = 0.0  # the probe's own time decoding and writing a layer's copies (not the reader's)
    copies_cpu: float = 0.0  # the reader's CPU for a layer's copies and the full KV read after them


def play(w: Work, reads: LayerReads, pair_s: float) -> tuple[float, float, float]:
    """(seconds to the last layer's end, of which waiting for reads, of which the probe's): the
    reader streams the probe's layers, then the blend pass's, back to back from time 0; each pass
    computes its layers in turn, a layer starting when the one before is done and its KV has
    arrived (a layer the pass does not read needs nothing); a probe over compact copies decodes
    each layer's itself."""
    t, probe_at, blend_at = 0.0, {}, {}
    for layer in range(w.probe_layers):
        t += reads.compact if w.compact else reads.full
        probe_at[layer] = t
    for layer in w.blend_reads:
        t += reads.rest if w.compact and layer < w.probe_layers else reads.full
        blend_at[layer] = t
    clock = probe_wait = 0.0
    for layer in range(w.probe_layers):
        probe_wait += max(0.0, probe_at[layer] - clock)
        clock = max(clock, probe_at[layer]) + w.probe_rows * pair_s + (reads.decode if w.compact else 0.0)
    wait = probe_wait
    for layer, rows in enumerate(w.blend_rows):
        wait += max(0.0, blend_at.get(layer, 0.0) - clock)
        clock = max(clock, blend_at.get(layer, 0.0)) + rows * pair_s
    return clock, wait, probe_wait


class LoadingController:
    # A tier whose chunks are recomputed is no longer read, so no longer measured: one decision
    # in this many reads it anyway, to see whether it got faster.
    REMEASURE_EVERY = 16
    # The compact copies are read where the model, their decoding and (with no core to spare)
    # the reader's CPU beside compute counted, expects them to shorten the prefill by more than
    # this share: the noise of its inputs. Until a request has decoded copies, and one has read
    # a stored tier, those costs are unknown and counted as none: the first request the copies
    # would help reads them, and measures them.
    COPIES_MARGIN = 0.03
    # Where the plain schedule (the floor ratio, the probe over the full KV) is expected to wait
    # for reads less than this share of the prefill, nothing changes: a fast tier then gives what
    # the controller off gives, bit for bit, and a noisy bandwidth estimate cannot flip it.
    ACT_WAIT = 0.05

    def __init__(self, store):
        self.store = store
        self.compute = Meter()  # (layer, row) pairs per second
        self.copies = Meter()  # compact-copy bytes the probe decodes and writes per second
        self.reader = Meter()  # stored bytes the reading thread takes (reads, checks, writes) per CPU-second
        # The reader's thread has a core of its own when the prefill's threads leave one free;
        # otherwise every CPU-second it spends beside compute is taken from the prefill.
        self.spare_core = usable_cores() > torch.get_num_threads()
        self.decisions = 0

    def observe(self, computed_pairs: float, compute_s: float, copy_bytes: int = 0, copy_s: float = 0.0,
                read_bytes: int = 0, read_cpu_s: float = 0.0) -> None:
        """One prefill's compute, the compact copies its probe decoded (if any), and the CPU its
        reads of stored entries took."""
        self.compute.record(computed_pairs, compute_s)
        self.copies.record(copy_bytes, copy_s)
        self.reader.record(read_bytes, read_cpu_s)

    def _rate(self, tier: str) -> float | None:
        t = self.store.tier(tier)
        return t.meter.rate if t is not None else None

    def _read_s(self, nbytes: int, tier: str) -> float | None:
        """Seconds to read `nbytes` from a tier; 0 from memory (its re-encoding is compute that
        every tier pays alike); None for a tier not measured yet."""
        if tier == "memory":
            return 0.0
        rate = self._rate(tier)
        return None if rate is None else nbytes / rate

    def _reads(self, plan: Plan) -> LayerReads | None:
        """Per layer: every stored chunk's (and prefix block's) layer read, one after another."""
        full = compact = rest = 0.0
        copy_bytes = copies_read = 0
        for kv in [c.kv for c in plan.read_chunks()] + [kv for _, kv in plan.prefix_blocks]:
            meta = getattr(kv, "meta", None)
            whole = self._read_s(meta.layer_nbytes if meta else 0, kv.tier)
            if whole is None:
                return None
            full += whole
            if getattr(kv, "has_probe_copy", False):
                compact += self._read_s(meta.probe_layer_nbytes, kv.tier)
                rest += whole
                copy_bytes += meta.probe_layer_nbytes
                copies_read += meta.probe_layer_nbytes + meta.layer_nbytes
            else:
                compact += whole
        decode = copy_bytes / self.copies.rate if self.copies.rate else 0.0
        beside = copies_read / self.reader.rate if self.reader.rate and not self.spare_core else 0.0
        return LayerReads(full, compact, rest, decode, beside)

    def decide(self, plan: Plan, cfg: BlendConfig) -> tuple[BlendConfig, Decision]:
        """The config to run `plan` with (the plan itself may lose chunks to recompute)."""
        floor = cfg.ratios[0]
        speed, reads = self.compute.rate, self._reads(plan)
        chunks = plan.read_chunks()
        plain = replace(cfg, compact_probe=False)
        if speed is None or reads is None or not chunks or not any(cfg.ratios):
            return plain, Decision(floor, floor, reason="not measured yet" if chunks else "nothing to read")
        n_layers, pair_s = chunks[0].kv.n_layers, 1.0 / speed
        self.decisions += 1
        w = work(plan, plain, floor, n_layers)
        at_floor = play(w, reads, pair_s)  # (ttft, wait, probe's wait) of the schedule chosen, at the floor
        if at_floor[1] <= self.ACT_WAIT * at_floor[0]:  # the plain schedule: the floor ratio, the probe over full KV
            return plain, Decision(floor, floor, 0, reads.full, w.blend_rows[-1] * pair_s, *at_floor[:2],
                                   "compute-bound: loading hides behind compute")
        copies_gain = copies_cpu_s = 0.0
        if cfg.compact_probe and reads.compact < reads.full:
            # Read the copies only where the waits they save outweigh decoding them, and the
            # reader's CPU that then runs beside compute rather than in the probe's waits: where a
            # probe over the full KV would wait long for its reads.
            w_copies = work(plan, cfg, floor, n_layers)
            with_copies = play(w_copies, reads, pair_s)
            copies_cpu_s = reads.copies_cpu * w_copies.probe_layers
            copies_gain = 1 - (with_copies[0] + copies_cpu_s) / at_floor[0]
            if copies_gain < self.COPIES_MARGIN:
                cfg = plain
            else:
                w, at_floor = w_copies, with_copies
        else:
            cfg = plain

        def estimate(ratio: float) -> tuple[float, float, float]:
            return play(work(plan, cfg, ratio, n_layers), reads, pair_s)

        first_read = reads.compact if w.compact else reads.full  # nothing hides the first layer's read
        remeasure = self.decisions % self.REMEASURE_EVERY == 0
        best, wait, _ = at_floor
        waits = wait > first_read * (1 + 1e-9)
        dropped = 0
        slow = sorted((c for c in chunks if c.tier != "memory"), key=lambda c: self._rate(c.tier))
        while slow and waits and not remeasure:
            c = slow.pop(0)
            kv, tier, before = c.kv, c.tier, reads
            c.kv = None
            reads = self._reads(plan)
            trial = estimate(floor)
            if trial[0] >= best:  # computing its rows costs more than reading it: read it after all
                c.kv, reads = kv, before
                break
            c.note, dropped, best = f"{tier}: recomputed", dropped + 1, trial[0]
        # Recompute more while it costs at most one layer's read: in a pass that waits for each
        # layer, the extra rows fill the waits and only the last layer's own compute adds.
        budget = best + (reads.rest if w.compact else reads.full)
        ratio, reused = floor, int(plan.reused_mask().sum())
        if reused:
            lo, hi = floor, 1.0
            if estimate(hi)[0] <= budget:
                lo = hi
            for _ in range(20 if lo < hi else 0):  # the estimate grows with the ratio
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if estimate(mid)[0] <= budget else (lo, mid)
            ratio = lo if cfg.budget(lo, reused) > cfg.budget(floor, reused) else floor  # or it changes nothing
        ttft, wait, probe_wait = estimate(ratio)
        w = work(plan, cfg, ratio, n_layers)
        if waits and probe_wait > wait / 2 and not dropped:
            reason = ("probe-bound: the probe waits for its reads before the blend pass starts"
                      + ("" if w.compact else " (compact_probe would read about a quarter of the bytes)"))
        elif dropped or ratio > floor:
            reason = "loading-bound: recompute more instead of waiting"
        else:
            reason = "compute-bound: loading hides behind compute"
        decision = Decision(floor, ratio, dropped, reads.full, w.blend_rows[-1] * pair_s, ttft, wait, reason,
                            cfg.compact_probe, copies_gain, copies_cpu_s)
        if ratio == floor:
            return cfg, decision
        return replace(cfg, ratios=[max(r, ratio) for r in cfg.ratios]), decision
