"""The loading controller (CacheBlend's section 5, on measured numbers).

With layerwise pipelining a layer costs max(read its stored KV, compute its rows). When reading
is the slower, rows can be recomputed for free until compute takes as long as the read: the
controller raises the recompute ratio to that point (the configured ratio is a quality floor it
never goes below). When reading a tier is slower than recomputing every reused row, loading
those chunks cannot pay: it recomputes them instead (slowest tier first). Rates are measured as
the engine runs: each tier's layer-read bandwidth (store.tier.Meter) and compute rows per second.
"""

from __future__ import annotations

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
    compute_s: float = 0.0  # estimated seconds to compute one layer at `ratio`
    reason: str = ""


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

    def _load_s(self, plan: Plan) -> float | None:
        """Per layer: every slow-tier chunk's layer bytes over its tier's bandwidth (memory reads
        cost only re-encoding, which compute pays either way). None: a tier not measured yet."""
        total = 0.0
        for c in plan.read_chunks():
            if c.tier == "memory":
                continue
            rate = self._rate(c.tier)
            if rate is None:
                return None
            total += c.kv.meta.layer_nbytes / rate
        return total

    def decide(self, plan: Plan, cfg: BlendConfig) -> tuple[BlendConfig, Decision]:
        """The config to run `plan` with (the plan itself may lose chunks to recompute)."""
        floor = cfg.ratios[0]
        speed, load = self.compute.rate, self._load_s(plan)
        if speed is None or load is None:
            return cfg, Decision(floor, floor, reason="not measured yet")

        def rows():
            reused = int(plan.reused_mask().sum())
            return plan.n_tokens - plan.prefix_hit - reused, reused

        must, reused = rows()
        self.decisions += 1
        remeasure = self.decisions % self.REMEASURE_EVERY == 0
        at_floor = (must + floor * reused) / speed
        if load <= at_floor:
            return cfg, Decision(floor, floor, 0, load, at_floor, "compute-bound: loading hides behind compute")
        dropped = 0
        slow = sorted((c for c in plan.read_chunks() if c.tier != "memory"),
                      key=lambda c: self._rate(c.tier))
        while slow and not remeasure and load > (must + reused) / speed:  # reading is slower than recomputing it all
            c = slow.pop(0)
            load -= c.kv.meta.layer_nbytes / self._rate(c.tier)
            c.kv, c.note = None, f"{c.tier}: recomputed"
            dropped += 1
            must, reused = rows()
        ratio = floor if reused == 0 else min(1.0, max(floor, (load * speed - must) / reused))
        decision = Decision(floor, ratio, dropped, load, (must + ratio * reused) / speed,
                            "loading-bound: recompute more instead of waiting")
        return replace(cfg, ratios=[max(r, ratio) for r in cfg.ratios]), decision
