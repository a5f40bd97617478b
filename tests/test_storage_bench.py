"""The storage benchmark runs end to end on a tiny model: every tier and schedule, its table,
JSON and plot; and what it measures agrees with what the engine guarantees (the same KV from
every tier and schedule, so the same quality, for a given probe: full or compact copies)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from redis_cluster import redis_cluster  # noqa: F401  (fixture; registers the benchmarks' launcher)
from serving import tiny_engine

from kvblend.eval.datasets import QA, RagRecord

BENCH = Path(__file__).parent.parent / "benchmarks" / "storage_bench.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("storage_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


RECORDS = [
    RagRecord("Where is the bridge?", ["north"], ["The bridge stands north of the old town.",
                                                   "The market opens at dawn every day.",
                                                   "Boats leave the harbour at noon."], "f1", QA),
    RagRecord("When do boats leave?", ["noon"], ["Boats leave the harbour at noon.",
                                                 "The bridge stands north of the old town."], "f1", QA),
]


def test_storage_bench_runs_every_tier_and_schedule_on_a_tiny_model(tmp_path, redis_cluster):  # noqa: F811
    bench = load_bench()
    engine = tiny_engine()
    configs = bench.configs_for([300.0], former=True, off=True)
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    redis_cluster.flush()
    bench.run(engine.model, RECORDS, engine.settings, configs, str(out), str(plot), progress=False, repeats=2,
              cluster_url=redis_cluster.url)
    payload = json.loads(out.read_text())
    rows = {r["config"]: r for r in payload["rows"]}
    assert list(rows) == [c.label for c in configs] and plot.stat().st_size > 0
    assert rows["memory"]["vs_memory"] == rows["memory"]["vs_memory_paired"] == 1.0
    assert all(len(runs) == 2 * len(RECORDS) for runs in payload["runs"].values())
    for label, tier in (("memory", "memory"), ("disk, controller off", "disk"), ("redis, controller off", "redis"),
                        ("cluster, controller off", "redis"), ("disk at 300 MB/s, controller off", "disk")):
        assert set(rows[label]["tiers"]) == {tier, "prefix"}  # the first chunk comes exact, by default
    # At default settings every request carries the loading controller's decision.
    assert all(run["controller"] for c in configs if c.schedule == "default" for run in payload["runs"][c.label])
    # Tiers and schedules read the same KV: the same answers, so the same quality, exactly; where
    # the probe reads stored entries' compact copies, the same among themselves.
    plain = ["memory"] + [c.label for c in configs if c.schedule == "off"]
    copies = [c.label for c in configs if c.schedule == "compact"]
    for same, compact in ((plain, False), (copies, True)):
        assert all((rows[k]["compact_chunks"] > 0) == compact for k in same)  # the probe read the copies
        assert len(same) >= 3 and len({(rows[k]["kl_answer"], rows[k]["top1_agree"]) for k in same}) == 1
    assert all(r["kl_answer"] >= 0 and 0 <= r["top1_agree"] <= 1 for r in rows.values())
