"""The loading controller (CacheBlend's section 5, on measured numbers, for the whole request).

A blend prefill reads stored KV in the order its passes need it: the attention probe's layers
first, then the layers the blend pass reads that the probe did not (with a full-depth probe,
none). One background reader streams them back to back from the moment the request is planned;
each pass's layer starts when the one before it is done and its KV has arrived. The controller
plays that schedule out layer by layer, from each tier's measured read bandwidth
(store.tier.Meter) and the measured compute speed in (layer, row) pairs a second, and chooses:

- which chunks to recompute instead of read: the slowest tier's first, while that makes the
  estimated time to first token shorter (reading them costs more than computing their rows);
- the recompute ratio: raised above the configured ratio (a quality floor, never undercut) as
  far as the estimate grows by at most one layer's read, i.e. while the extra rows compute in
  time the pass would otherwise spend waiting for reads;
- the tier to read a chunk from, when it is on several: the fastest measured (TieredStore).

Where the probe walks every layer it needs every layer's stored KV before the blend pass can
start, so a slow tier's reads fall before the blend pass and no ratio hides them: the controller
keeps the floor and says so (`reason`), with the wait it expects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

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


@dataclass
class Work:
    """What one prefill computes and reads, layer by layer, at one ratio."""

    reads: list[int]  # layers whose chunk KV is read, in the order they are read
    probe_layers: int
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
    load_from = probe_depth if candidates else max(probe_depth, first)
    n_first = cfg.budget(ratios[cfg.check_layers.index(first)], reused)
    early = must + (min(reused, math.ceil(cfg.check_candidates * n_first)) if candidates else reused)
    rows, kept = [], early
    for layer in range(n_layers):
        if layer in cfg.check_layers:
            kept = must + cfg.budget(ratios[cfg.check_layers.index(layer)], reused)
        rows.append(kept)
    return Work([*range(probe_depth), *range(load_from, n_layers)], probe_depth, probe_rows, rows)


def play(w: Work, layer_read_s: float, pair_s: float) -> tuple[float, float]:
    """(seconds to the last layer's end, of which waiting for reads): the reader streams the
    layers back to back from time 0; each pass computes its layers in turn, a layer starting when
    the one before is done and its KV has arrived (a layer nobody reads needs nothing)."""
    arrived, t = {}, 0.0
    for layer in w.reads:
        if layer not in arrived:
            t += layer_read_s
            arrived[layer] = t
    clock = wait = 0.0
    steps = [(layer, w.probe_rows) for layer in range(w.probe_layers)]
    steps += [(layer, rows) for layer, rows in enumerate(w.blend_rows)]
    for layer, rows in steps:
        ready = arrived.pop(layer, 0.0)  # a second pass finds its layer read already
        wait += max(0.0, ready - clock)
        clock = max(clock, ready) + rows * pair_s
    return clock, wait


class LoadingController:
    # A tier whose chunks are recomputed is no longer read, so no longer measured: one decision
    # in this many reads it anyway, to see whether it got faster.
    REMEASURE_EVERY = 16

    def __init__(self, store):
        self.store = store
        self.compute = Meter()  # (layer, row) pairs per second
        self.decisions = 0

    def observe(self, computed_pairs: float, compute_s: float) -> None:
        self.compute.record(computed_pairs, compute_s)

    def _rate(self, tier: str) -> float | None:
        t = self.store.tier(tier)
        return t.meter.rate if t is not None else None

    def _read_s(self, kv) -> float | None:
        """Seconds to read one layer of an entry; 0 from memory (its re-encoding is compute that
        every tier pays alike); None for a tier not measured yet."""
        if kv.tier == "memory":
            return 0.0
        rate = self._rate(kv.tier)
        return None if rate is None else kv.meta.layer_nbytes / rate

    def _load_s(self, plan: Plan) -> float | None:
        """Per layer: every stored chunk's (and prefix block's) layer read, one after another."""
        parts = [c.kv for c in plan.read_chunks()] + [kv for _, kv in plan.prefix_blocks]
        times = [self._read_s(kv) for kv in parts]
        return None if any(t is None for t in times) else sum(times)

    def decide(self, plan: Plan, cfg: BlendConfig) -> tuple[BlendConfig, Decision]:
        """The config to run `plan` with (the plan itself may lose chunks to recompute)."""
        floor = cfg.ratios[0]
        speed, load = self.compute.rate, self._load_s(plan)
        chunks = plan.read_chunks()
        if speed is None or load is None or not chunks or not any(cfg.ratios):
            return cfg, Decision(floor, floor, reason="not measured yet" if chunks else "nothing to read")
        n_layers, pair_s = chunks[0].kv.n_layers, 1.0 / speed

        def estimate(ratio: float) -> tuple[float, float]:
            return play(work(plan, cfg, ratio, n_layers), load, pair_s)

        self.decisions += 1
        remeasure = self.decisions % self.REMEASURE_EVERY == 0
        best, wait = estimate(floor)
        waits = wait > load * (1 + 1e-9)  # past the first layer's read, which nothing hides
        dropped = 0
        slow = sorted((c for c in chunks if c.tier != "memory"), key=lambda c: self._rate(c.tier))
        while slow and waits and not remeasure:
            c = slow.pop(0)
            kv, tier, read_s = c.kv, c.tier, self._read_s(c.kv)
            c.kv, load = None, load - read_s
            trial = estimate(floor)
            if trial[0] >= best:  # computing its rows costs more than reading it: read it after all
                c.kv, load = kv, load + read_s
                break
            c.note, dropped, best = f"{tier}: recomputed", dropped + 1, trial[0]
        # Recompute more while it costs at most one layer's read: in a pass that waits for each
        # layer, the extra rows fill the waits and only the last layer's own compute adds.
        budget = best + load
        ratio, reused = floor, int(plan.reused_mask().sum())
        if reused:
            lo, hi = floor, 1.0
            if estimate(hi)[0] <= budget:
                lo = hi
            for _ in range(20 if lo < hi else 0):  # the estimate grows with the ratio
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if estimate(mid)[0] <= budget else (lo, mid)
            ratio = lo if cfg.budget(lo, reused) > cfg.budget(floor, reused) else floor  # or it changes nothing
        ttft, wait = estimate(ratio)
        w = work(plan, cfg, ratio, n_layers)
        if waits and w.probe_layers == n_layers and not dropped:
            reason = "probe-bound: the probe needs every layer read before the blend pass starts"
        elif dropped or ratio > floor:
            reason = "loading-bound: recompute more instead of waiting"
        else:
            reason = "compute-bound: loading hides behind compute"
        decision = Decision(floor, ratio, dropped, load, w.blend_rows[-1] * pair_s, ttft, wait, reason)
        if ratio == floor:
            return cfg, decision
        return replace(cfg, ratios=[max(r, ratio) for r in cfg.ratios]), decision
