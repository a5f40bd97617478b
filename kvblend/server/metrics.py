"""Prometheus metrics of one server, in its own registry (several servers may live in one process)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvblend_http_requests", "HTTP requests by route and status code",
                                ["route", "method", "code"], registry=r)
        self.errors = Counter("kvblend_http_errors", "HTTP responses with a 4xx or 5xx code, by route and code",
                              ["route", "code"], registry=r)
        self.ttft = Histogram("kvblend_ttft_seconds", "time to first token, queueing included, by mode", ["mode"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kvblend_e2e_seconds", "request latency from arrival to the last token, by mode",
                             ["mode"], buckets=LATENCY_BUCKETS, registry=r)
        self.reused = Counter("kvblend_tokens_reused", "prompt tokens whose KV came from a cached chunk", registry=r)
        self.recomputed = Counter("kvblend_tokens_recomputed", "prompt tokens computed in prefill", registry=r)
        self.prefix_hit = Counter("kvblend_tokens_prefix_hit", "prompt tokens served exactly by the prefix cache",
                                  registry=r)
        self.generated = Counter("kvblend_tokens_generated", "tokens generated", registry=r)
        self.chunk_hits = Counter("kvblend_chunk_hits", "chunks found in the store", registry=r)
        self.chunk_misses = Counter("kvblend_chunk_misses", "chunks not found in the store", registry=r)
        self.cancelled = Counter("kvblend_requests_cancelled", "requests whose client went away before the end", registry=r)
        self.queue_depth = Gauge("kvblend_queue_depth", "requests waiting for the engine", registry=r)
        self.running = Gauge("kvblend_running_requests", "requests past the queue (prefilling or decoding)", registry=r)
        self.kv_bytes = Gauge("kvblend_kv_bytes", "bytes of KV cache held by running requests", registry=r)
        self.store_bytes = Gauge("kvblend_store_bytes", "bytes held by the chunk store", registry=r)
        self.store_entries = Gauge("kvblend_store_entries", "entries in the chunk store", registry=r)
        self.bad_entries = Counter("kvblend_bad_entries", "bad stored entries requests met (discarded, recomputed)",
                                   registry=r)
        self.disconnects = Counter("kvblend_client_disconnects", "requests whose client went away before the end",
                                   registry=r)

    def watch(self, queue_depth: Callable[[], float], running: Callable[[], float], kv_bytes: Callable[[], float],
              store_bytes: Callable[[], float], store_entries: Callable[[], float]) -> None:
        """Gauges read at scrape time, so they are never stale."""
        self.queue_depth.set_function(queue_depth)
        self.running.set_function(running)
        self.kv_bytes.set_function(kv_bytes)
        self.store_bytes.set_function(store_bytes)
        self.store_entries.set_function(store_entries)

    def observe_prefill(self, mode: str, ttft_s: float, m) -> None:
        self.ttft.labels(mode).observe(ttft_s)
        self.reused.inc(m.reused_tokens)
        self.recomputed.inc(m.recomputed_tokens)
        self.prefix_hit.inc(m.prefix_hit_tokens)
        self.chunk_hits.inc(m.chunk_hits)
        self.chunk_misses.inc(m.chunk_misses)
        self.bad_entries.inc(m.bad_entries)

    def count_cancelled(self) -> None:
        self.cancelled.inc()

    def count_generated(self, n: int) -> None:
        self.generated.inc(n)

    def watch_store(self, stats: Callable[[], dict[str, dict]]) -> None:
        """The store's own counters per tier (hits, misses, bad entries, write errors, ...), read at
        scrape time: faults of the tiers, background writes included, show here, not only in the log."""
        self.registry.register(_StoreCollector(stats))

    def watch_engine(self, neighbour_reencodes: Callable[[], float]) -> None:
        """The engine's background work, read at scrape time: chunks re-encoded after a closer
        neighbour that joined their collection (and switched to it)."""
        self.registry.register(_CounterOf("kvblend_neighbour_reencodes",
                                          "chunks re-encoded after a much closer neighbour and switched to it",
                                          neighbour_reencodes))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class MetricsMiddleware:
    """Counts every response by route template and status code (raw ASGI, so streams pass untouched)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            code = str(status[0])
            self.metrics.requests.labels(route, scope.get("method", ""), code).inc()
            if status[0] >= 400:
                self.metrics.errors.labels(route, code).inc()


# Per-tier counters of TieredStore.stats(): name -> help. Gauges are the sizes, the rest count up.
_TIER_COUNTERS = {
    "hits": "lookups the tier answered", "misses": "lookups the tier did not have",
    "puts": "entries written to the tier", "evictions": "entries the tier evicted for room",
    "bad_entries": "bad entries found in the tier (deleted, recomputed)",
    "write_errors": "writes to the tier that failed", "unreachable": "times the tier was found unreachable",
}
_STORE_COUNTERS = {
    "promotions": "entries copied into a faster tier after a hit",
    "writer_errors": "background writes that raised", "writes_dropped": "writes dropped: backlog over its limit",
    "catch_up_writes": "entries written to a tier after it came back",
}


class _StoreCollector:
    def __init__(self, stats: Callable[[], dict[str, dict]]):
        self.stats = stats

    def describe(self):
        return []  # no fixed set: the tiers are those the settings configure

    def collect(self):
        stats = self.stats()
        store = stats.pop("store", {})
        for name, text in _TIER_COUNTERS.items():
            family = CounterMetricFamily(f"kvblend_store_tier_{name}", f"store: {text}, by tier", labels=["tier"])
            for tier, counters in stats.items():
                if name in counters:
                    family.add_metric([tier], counters[name])
            yield family
        for name, text in (("used_bytes", "bytes held"), ("capacity_bytes", "capacity in bytes")):
            family = GaugeMetricFamily(f"kvblend_store_tier_{name}", f"store: {text}, by tier", labels=["tier"])
            for tier, counters in stats.items():
                family.add_metric([tier], counters[name])
            yield family
        for name, text in _STORE_COUNTERS.items():
            if name in store:
                yield CounterMetricFamily(f"kvblend_store_{name}", f"store: {text}", value=store[name])
        if "catch_up_pending" in store:
            yield GaugeMetricFamily("kvblend_store_catch_up_pending", "store: writes owed to a tier that was down",
                                    value=store["catch_up_pending"])


class _CounterOf:
    """One counter whose value is read at scrape time."""

    def __init__(self, name: str, text: str, value: Callable[[], float]):
        self.name, self.text, self.value = name, text, value

    def describe(self):
        return [CounterMetricFamily(self.name, self.text)]

    def collect(self):
        yield CounterMetricFamily(self.name, self.text, value=self.value())
