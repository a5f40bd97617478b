"""Prefill of one planned request in any mode: full, prefix, reuse or blend.

Rows [0, prefix_hit) hold exact KV from the prefix cache. Reused rows hold cached chunk KV moved
to their new positions. Blend computes every other row through the layers before the first check
layer, then at each check layer keeps only the reused rows whose fresh K (or V) deviates most from
the cached one (by default weighted by the attention the suffix pays them, measured in a reuse
pass first); after it only the kept rows (and the rows that must always be computed: separators,
missed chunks, the suffix) go on, at their true positions, and their fresh KV overwrites the
cached rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..model.runner import KVCache, Rows, Runner
from .loader import ChunkLoader
from .plan import Plan
from .select import attention_mass, deviation, n_selected, top_tokens, weighted

MODES = ("full", "prefix", "reuse", "blend")


@dataclass
class BlendConfig:
    check_layers: list[int] = field(default_factory=lambda: [1])
    ratios: list[float] = field(default_factory=lambda: [0.08])
    deviation: str = "v"
    check_layer_kv: str = "fresh"  # KV that unselected rows keep at the check layer itself
    # Weight each token's deviation by the attention the prompt's suffix pays it, measured in a
    # reuse pass first (a few percent of a full prefill's compute): recompute what the question reads.
    weight_by_attention: bool = True

    def __post_init__(self):
        if len(self.ratios) == 1 and len(self.check_layers) > 1:
            self.ratios = self.ratios * len(self.check_layers)
        if len(self.ratios) != len(self.check_layers):
            raise ValueError(f"{len(self.ratios)} recompute ratios for {len(self.check_layers)} check layers")
        if self.check_layer_kv not in ("fresh", "cached"):
            raise ValueError(f"check_layer_kv must be 'fresh' or 'cached', got {self.check_layer_kv!r}")


@dataclass
class PrefillStats:
    prefix_hit_tokens: int = 0
    reused_tokens: int = 0  # rows whose final KV at the last layer came from a cached chunk
    recomputed_tokens: int = 0  # rows computed through every layer after the prefix
    chunk_hits: int = 0
    chunk_misses: int = 0
    compute_frac: float = 1.0  # computed (layer, row) pairs / a full prefill's
    load_wait_s: float = 0.0  # time the layers waited for stored KV to be read and re-encoded
    compute_s: float = 0.0  # time in the layers, waits excluded: what the loading controller measures
    controller: dict | None = None  # the loading controller's decision, where it ran
    chunk_tiers: list[str] = field(default_factory=list)  # per chunk: memory, disk, redis or miss
    bad_entries: int = 0  # stored entries found bad during this request (discarded, recomputed)
    selected_positions: list[int] = field(default_factory=list)  # reused rows chosen for recompute
    recomputed_positions: list[int] = field(default_factory=list)  # every row computed to the end


@dataclass
class PrefillOutput:
    cache: KVCache
    logits: torch.Tensor  # [vocab] of the prompt's last token
    stats: PrefillStats


class Selector:
    """At each check layer, which of the active rows go on: every must-compute row, and the
    reused rows with the highest scores, `ratio` of all reused rows."""

    def __init__(self, checks: dict[int, float], cfg: BlendConfig, reused: torch.Tensor,
                 attention: torch.Tensor | None):
        self.checks, self.reused, self.attention = checks, reused, attention
        self.signal, self.check_layer_kv = cfg.deviation, cfg.check_layer_kv
        self.n_reused = int(reused.sum())

    def keep(self, layer: int, active: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             cache: KVCache) -> torch.Tensor | None:
        """A mask over the active rows, or None where `layer` is no check layer."""
        if layer not in self.checks:
            return None
        cand = self.reused[active]  # reused rows still active: the candidates
        cand_idx = cand.nonzero().squeeze(1)
        cand_pos = active[cand_idx]
        score = deviation(self.signal, k[:, cand_idx], cache.k[layer][:, cand_pos],
                          v[:, cand_idx], cache.v[layer][:, cand_pos])
        if self.attention is not None:
            score = weighted(score, self.attention[cand_pos])
        keep = ~cand
        keep[cand_idx[top_tokens(score, n_selected(self.checks[layer], self.n_reused))]] = True
        return keep


@dataclass
class Pass:
    """One walk through the layers: what it computed and, if asked, what the watched rows read."""

    rows: Rows
    active: torch.Tensor  # positions of the rows computed at the last layer
    computed: int  # (layer, row) pairs computed
    attention: torch.Tensor | None  # [T] attention mass the watched rows put on each position


def run_layers(runner: Runner, cache: KVCache, loader: ChunkLoader, rows: Rows, active: torch.Tensor,
               selector: Selector | None = None, watch: torch.Tensor | None = None) -> Pass:
    """Every layer over the active rows, the loader supplying each layer's cached KV first (once
    per prefill); the selector narrows the rows at its check layers. `watch` (a mask over the
    rows; no selector) sums the attention those rows pay each position, over layers."""
    T = cache.length
    mass = torch.zeros(T, device=runner.device) if watch is not None else None
    computed = 0
    for layer in range(runner.n_layers):
        loader.load_layer(layer)
        q, k, v = runner.qkv(layer, rows)
        keep = selector.keep(layer, active, k, v, cache) if selector is not None else None
        if keep is None:
            cache.write(layer, active, k, v)
        else:
            if selector.check_layer_kv == "fresh":
                cache.write(layer, active, k, v)
            active, q, k, v = active[keep], q[:, keep], k[:, keep], v[:, keep]
            rows = rows.take(keep.nonzero().squeeze(1))
            if selector.check_layer_kv == "cached":
                cache.write(layer, active, k, v)
        computed += active.numel()
        if mass is not None:
            mass += attention_mass(q[:, watch], cache.k[layer][:, :T], active[watch],
                                   runner.layers[layer].self_attn.scaling, runner.windows[layer])
        rows.h = runner.finish(layer, rows, q, cache)
    return Pass(rows, active, computed, mass)


@torch.inference_mode()
def prefill(runner: Runner, plan: Plan, mode: str, cfg: BlendConfig, extra_capacity: int = 0,
            prefetch_depth: int = 0) -> PrefillOutput:
    """`prefetch_depth` layers of stored KV are read ahead in a background thread (0: inline).
    A bad stored entry raises entry_format.BadEntry: the caller discards it and plans again."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
    T = plan.n_tokens
    dev = runner.device
    cache = runner.new_cache(T + extra_capacity)
    cache.length = T  # every layer loads or computes every row before its attention reads them
    loader = ChunkLoader(runner, plan, cache, prefetch_depth)
    P = plan.prefix_hit
    reused = plan.reused_mask().to(dev)
    stats = PrefillStats(prefix_hit_tokens=P, chunk_hits=plan.hits, chunk_misses=len(plan.misses),
                         chunk_tiers=[c.tier for c in plan.chunks])

    checks = dict(zip(cfg.check_layers, cfg.ratios)) if mode == "blend" else {}
    if all(r == 0 for r in checks.values()):
        checks = {}  # selecting nothing needs no check: blend at ratio 0 is reuse
    pos = torch.arange(T, device=dev)
    ids = plan.token_ids.to(dev)
    must = pos[P:][~reused[P:]]  # separators, missed chunks, the suffix
    computed, probe_watch = 0, None
    if mode in ("full", "prefix") or not bool(reused.any()):
        chunk_from, active = runner.n_layers, pos[P:]  # nothing reused: every row, every layer
    elif checks:
        chunk_from, active = min(checks), pos[P:]  # fresh K for all rows up to the first check
        if cfg.weight_by_attention:
            # A reuse pass first, over the must-compute rows only: what its suffix rows attend to
            # is what the question reads. It loads every layer's chunk KV, so the blend pass
            # after it loads nothing, and overwrites every row the probe computed.
            chunk_from, probe_watch = 0, must >= min(plan.segments.suffix[0], T - 1)
    else:
        chunk_from, active = 0, must  # reuse: only the must-compute rows
    selector = Selector(checks, cfg, reused, None) if checks else None
    t0 = time.perf_counter()
    loader.start(chunk_from)
    try:
        if probe_watch is not None:
            probe = run_layers(runner, cache, loader, runner.rows(ids[must], must), must, watch=probe_watch)
            computed, selector.attention = probe.computed, probe.attention
        out = run_layers(runner, cache, loader, runner.rows(ids[active], active), active, selector)
    finally:
        loader.close()
    active = out.active
    stats.load_wait_s = loader.wait_s
    stats.compute_s = time.perf_counter() - t0 - loader.wait_s

    still_reused = reused.clone()
    still_reused[active] = False
    stats.reused_tokens = int(still_reused.sum())
    stats.recomputed_tokens = int(active.numel())
    stats.compute_frac = (computed + out.computed) / (runner.n_layers * T)
    stats.selected_positions = active[reused[active]].tolist()
    stats.recomputed_positions = active.tolist()
    return PrefillOutput(cache, runner.logits(out.rows.h[-1:])[0], stats)
