"""The engine over disk and Redis tiers (one server and a cluster): what it reads from each tier is
what it would have read from memory, bad entries become recompute (never wrong KV, never a crash),
Redis dying loses no request, and two processes share chunks through Redis."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from redis_cluster import any_redis, redis_cluster  # noqa: F401  (fixtures)
from redis_server import RedisServer, redis_server  # noqa: F401  (fixture)
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_models import tiny_model

from kvblend.blend.segment import join_segments
from kvblend.config import Settings
from kvblend.engine.engine import Engine
from kvblend.engine.sampler import SamplingParams
from kvblend.engine.scheduler import generate
from kvblend.store import redis_tier
from kvblend.store.disk import tensor_ranges

SEP = [7, 7, 3]
PREFIX = [1, 20, 21, 22, 23, 24]
SUFFIX = [30, 31, 32, 33, 34]
TESTS = Path(__file__).parent


def chunks(n, length=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 300, (length,), generator=g).tolist() for _ in range(n)]


def prompt(cs):
    return join_segments(PREFIX, cs, SUFFIX, SEP)


CS = chunks(4, seed=3)
STORED = prompt(CS)
ASKED = prompt([CS[2], CS[0], CS[3], CS[1]])  # every chunk moved


def make_engine(disk=None, redis_url=None, memory=True, seed=0, dtype=torch.float32, **settings):
    # No exact first-chunk blocks: the entries these tests count and damage are the chunks and
    # the system prompt's blocks (tests/test_first_chunk.py covers the others). No minimum
    # recompute budget: on these short prompts the ratio alone sets it, as on long prompts. No
    # loading controller: on a tiny model a read costs more than its rows' compute, so it would
    # recompute chunks and raise the ratio as timings fall (tests/test_loading_controller.py).
    s = Settings(**{"check_layers": [1], "recompute_ratios": [0.15], "min_recompute_tokens": 0, "local_cpu": memory,
                    "local_disk": str(disk) if disk else None, "remote_url": redis_url,
                    "exact_first_chunk": False, "loading_controller": False, **settings})
    engine = Engine(tiny_model("llama", seed=seed, dtype=dtype), s, sep_ids=SEP)
    redis = engine.store.tier("redis")
    if redis is not None:
        redis.retry_s = 0.0  # tests restart Redis at once: try it again on the next call
    MADE.append(engine)
    return engine


MADE: list[Engine] = []  # the engines a test made, closed by tier_kind when it ends


def close_made() -> None:
    """Finish their writes behind now: on the session's cluster a write left running could land
    after the next test emptied it."""
    while MADE:
        MADE.pop().close()


def stored_engine(kind, tmp_path, url=None, **settings):
    """An engine whose only tier is `kind`, holding the chunks of STORED."""
    engine = make_engine(disk=tmp_path / "kv" if kind == "disk" else None,
                         redis_url=url if kind == "redis" else None, memory=False, **settings)
    engine.precompute(STORED)
    engine.store.flush()
    return engine


@pytest.fixture(params=["disk", "redis", "cluster"])
def tier_kind(request):
    """(the tier's name, the Redis server or cluster it is on)."""
    MADE.clear()
    if request.param == "disk":
        yield "disk", None
    elif request.param == "redis":
        server = RedisServer().start()
        yield "redis", server
        close_made()
        server.kill()
    else:
        cluster = request.getfixturevalue("redis_cluster")
        cluster.flush()
        yield "redis", cluster
    close_made()


def same_output(a, b) -> None:
    T = len(ASKED)
    assert torch.equal(a.logits, b.logits)
    assert torch.equal(a.cache.k[:, :, :T], b.cache.k[:, :, :T])
    assert torch.equal(a.cache.v[:, :, :T], b.cache.v[:, :, :T])


# ---- reading from a tier ----------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["reuse", "blend"])
def test_prefill_from_a_tier_equals_prefill_from_memory(tier_kind, tmp_path, mode):
    kind, server = tier_kind
    memory = make_engine()
    memory.precompute(STORED)
    plan_m, ref = memory.prefill(ASKED, mode)
    engine = stored_engine(kind, tmp_path, server and server.url)
    plan, out = engine.prefill(ASKED, mode)
    assert out.stats.chunk_tiers == [kind] * 4 and ref.stats.chunk_tiers == ["memory"] * 4
    assert plan.prefix_hit == plan_m.prefix_hit > 0  # the prefix blocks came from the tier too
    same_output(out, ref)


@pytest.mark.parametrize("depth", [1, 3, "all"])
def test_layer_pipelining_gives_the_same_kv_as_inline_loading(tmp_path, depth):
    engine = stored_engine("disk", tmp_path)
    assert engine.prefetch_depth == engine.runner.n_layers  # the default reads every layer ahead
    engine.prefetch_depth = 0
    _, inline = engine.prefill(ASKED, "blend")
    engine.prefetch_depth = engine.runner.n_layers if depth == "all" else depth
    _, out = engine.prefill(ASKED, "blend")
    same_output(out, inline)
    assert out.stats.load_wait_s >= 0


def test_pipelining_with_a_short_probe_and_stale_key_damping(tmp_path):
    """The probe walks layers 0-1, the blend pass loads chunks again from its check layer 3 on
    (layer 2 computes every row): the read-ahead thread follows that plan exactly."""
    memory = make_engine(check_layers=[3], probe_layers=2, stale_key_scale=0.7)
    memory.precompute(STORED)
    _, ref = memory.prefill(ASKED, "blend")
    engine = stored_engine("disk", tmp_path, check_layers=[3], probe_layers=2, stale_key_scale=0.7)
    for depth in (0, 2, engine.runner.n_layers):
        engine.prefetch_depth = depth
        _, out = engine.prefill(ASKED, "blend")
        same_output(out, ref)


def test_a_plan_hints_every_key_before_its_first_lookup(tmp_path, monkeypatch):
    """One prefetch of all the plan's keys, then the lookups: a cold disk reads their headers
    together rather than one after another."""
    engine = stored_engine("disk", tmp_path)
    store, events = engine.store, []
    monkeypatch.setattr(store, "prefetch", lambda keys: events.append(("prefetch", list(keys))))
    get = store.get
    monkeypatch.setattr(store, "get", lambda key: events.append(("get", key)) or get(key))
    plan = engine.plan(ASKED, "blend")
    (first, hinted), lookups = events[0], [key for what, key in events[1:] if what == "get"]
    assert first == "prefetch" and len(lookups) == len(events) - 1
    assert {c.key for c in plan.chunks} <= set(lookups) <= set(hinted)
    assert plan.hits == len(plan.chunks) == 4


def test_layerwise_off_loads_inline():
    engine = make_engine(layerwise=False, prefetch_depth=4)
    assert engine.prefetch_depth == 0


def test_generate_reports_tiers_and_stores_misses_behind(tmp_path, monkeypatch):
    engine = make_engine(disk=tmp_path, memory=False)
    first = generate(engine, ASKED, SamplingParams(max_tokens=2))
    assert first.metrics.chunk_tiers == ["miss"] * 4
    engine.store.flush()
    moved = generate(engine, STORED, SamplingParams(max_tokens=2))
    assert moved.metrics.chunk_tiers == ["disk"] * 4 and moved.metrics.bad_entries == 0
    # Asked again, the prompt comes exact from the prefix cache: its chunks are not even looked up.
    chunk_keys = {c.key for c in engine.plan(STORED, "blend").chunks}
    looked_up, get = [], engine.store.get
    monkeypatch.setattr(engine.store, "get", lambda key, *a, **k: looked_up.append(key) or get(key, *a, **k))
    again = generate(engine, ASKED, SamplingParams(max_tokens=2))
    assert again.metrics.chunk_tiers == ["prefix"] * 4 and again.metrics.prefix_hit_tokens == len(ASKED) - 1
    assert looked_up and not chunk_keys & set(looked_up)
    assert again.token_ids == first.token_ids
    engine.close()


@pytest.mark.parametrize("first_chunk", [False, True])
def test_precomputing_a_stored_prompt_again_computes_nothing(first_chunk, monkeypatch):
    engine = make_engine(exact_first_chunk=first_chunk)
    assert engine.precompute(STORED) == 4
    calls = []
    forward = engine.runner.forward
    monkeypatch.setattr(engine.runner, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    assert engine.precompute(ASKED) == 0 and calls == []  # the same prefix and chunks, moved


# ---- bad entries ------------------------------------------------------------------------------

def damage(engine, kind, how, key, other=None):
    tier = engine.store.tier(kind)
    if kind == "disk":
        path = tier.path(key)
        if how == "truncate":
            path.write_bytes(path.read_bytes()[:-100])
        elif how == "corrupt":
            data = bytearray(path.read_bytes())
            data[tensor_ranges(path)["k.1"][0] + 5] ^= 0xFF  # inside layer 1's K, which every read reads
            path.write_bytes(bytes(data))
        else:  # swap with another entry
            a, b = path, tier.path(other)
            tmp = a.with_name("swap")
            a.rename(tmp), b.rename(a), tmp.rename(b)
    else:
        c, ek = tier.client, tier.entry_key(key)
        if how == "truncate":
            c.hset(ek, "2", c.hget(ek, "2")[:-10])
        elif how == "corrupt":
            data = bytearray(c.hget(ek, "3"))
            data[5] ^= 0xFF
            c.hset(ek, "3", bytes(data))
        else:  # field by field: on a cluster the two keys may live on different shards
            mine, theirs = c.hgetall(ek), c.hgetall(tier.entry_key(other))
            c.hset(ek, mapping=theirs)
            c.hset(tier.entry_key(other), mapping=mine)


@pytest.mark.parametrize("how", ["corrupt", "truncate", "swap"])
def test_bad_chunk_entry_is_a_counted_miss_and_recomputed(tier_kind, tmp_path, how):
    kind, server = tier_kind
    engine = stored_engine(kind, tmp_path, server and server.url)
    keys = [c.key for c in engine.plan(ASKED, "blend").chunks]
    damage(engine, kind, how, keys[1], other=keys[2])
    _, out = engine.prefill(ASKED, "blend")
    broken = 2 if how == "swap" else 1
    assert out.stats.bad_entries == broken
    assert out.stats.chunk_tiers.count("miss") == broken
    assert engine.store.tier(kind).bad_entries == broken
    # What the request gave is exactly what it gives with those chunks simply not stored.
    _, again = engine.prefill(ASKED, "blend")
    assert again.stats.bad_entries == 0 and again.stats.chunk_tiers == out.stats.chunk_tiers
    same_output(out, again)


def test_every_entry_bad_gives_full_prefill(tier_kind, tmp_path):
    kind, server = tier_kind
    engine = stored_engine(kind, tmp_path, server and server.url)
    keys = engine.store.tier(kind).keys()
    assert len(keys) == 6  # 4 chunks, 2 prefix blocks (system prompt, separator)
    for key in keys:
        damage(engine, kind, "corrupt", key)
    _, out = engine.prefill(ASKED, "blend")
    _, full = engine.prefill(ASKED, "full")
    assert out.stats.chunk_tiers == ["miss"] * 4 and out.stats.prefix_hit_tokens == 0
    # The second prefix block is never read once the first is gone (a hash chain): 5 met.
    assert out.stats.bad_entries == 5 and len(engine.store.tier(kind).keys()) == 1
    torch.testing.assert_close(out.logits, full.logits, atol=1e-5, rtol=1e-5)


def test_entry_of_another_model_or_dtype_is_never_read(tmp_path):
    ours = make_engine(disk=tmp_path, memory=False)
    key = ours.plan(ASKED, "blend").chunks[0].key
    for other in (make_engine(disk=tmp_path / "b", memory=False, seed=1),  # other weights
                  make_engine(disk=tmp_path / "c", memory=False, dtype=torch.bfloat16)):
        other.precompute(STORED)
        other.store.flush()
        # Plant the other model's entry under our key (as a shared cache or a bug might).
        src = other.store.tier("disk").path(other.plan(ASKED, "blend").chunks[0].key)
        with safe_open(str(src), "pt") as f:
            tensors = {n: f.get_tensor(n) for n in f.keys()}
            meta = json.loads(f.metadata()["kvblend"])
        save_file(tensors, str(ours.store.tier("disk").path(key)),
                  metadata={"kvblend": json.dumps({**meta, "key": key})})
        plan, out = ours.prefill(ASKED, "blend")
        assert plan.chunks[0].kv is None and out.stats.bad_entries == 1
    assert ours.store.tier("disk").bad_entries == 2


# ---- Redis going away -------------------------------------------------------------------------

def test_killing_redis_mid_run_loses_no_request(redis_server, monkeypatch):
    engine = stored_engine("redis", None, redis_server.url)
    _, full = engine.prefill(ASKED, "full")
    params = SamplingParams(max_tokens=3)
    assert generate(engine, ASKED, params).metrics.chunk_tiers == ["redis"] * 4

    read_layer = redis_tier.RedisEntry._read_layer

    def dies_at_layer_2(self, layer):
        if layer == 2:
            redis_server.kill()
        return read_layer(self, layer)

    monkeypatch.setattr(redis_tier.RedisEntry, "_read_layer", dies_at_layer_2)
    _, out = engine.prefill(ASKED, "blend")  # Redis dies while the layers are being read
    assert redis_server.proc.poll() is not None  # it did die mid-read
    assert out.stats.chunk_tiers == ["miss"] * 4
    torch.testing.assert_close(out.logits, full.logits, atol=1e-5, rtol=1e-5)
    monkeypatch.undo()
    down = generate(engine, ASKED, params)  # Redis still down: served by recompute
    assert down.metrics.chunk_tiers == ["miss"] * 4 and len(down.token_ids) == 3

    back = RedisServer(redis_server.port).start()  # back, empty (no persistence)
    try:
        generate(engine, ASKED, params)  # misses, stored behind
        engine.store.flush()
        assert generate(engine, STORED, params).metrics.chunk_tiers == ["redis"] * 4  # moved: read
    finally:
        back.kill()


def test_redis_down_at_start_serves_from_recompute():
    engine = make_engine(redis_url=RedisServer().url, memory=False)
    out = generate(engine, ASKED, SamplingParams(max_tokens=2))
    assert out.metrics.chunk_tiers == ["miss"] * 4 and len(out.token_ids) == 2
    engine.close()


# ---- capacity ---------------------------------------------------------------------------------

def test_engine_tiers_stay_under_capacity(tmp_path, redis_server):
    size_gib = 40_000 / (1 << 30)  # a few of the tiny model's entries
    engine = make_engine(disk=tmp_path, redis_url=redis_server.url, max_local_cpu_size=size_gib,
                         max_local_disk_size=size_gib, max_remote_size=size_gib)
    for seed in range(4):
        engine.precompute(prompt(chunks(4, seed=10 + seed)))
        engine.store.flush()
        for tier in engine.store.tiers:
            assert 0 < tier.used_bytes <= tier.capacity_bytes, tier.name
    assert all(t.evictions > 0 for t in engine.store.tiers)


# ---- two processes ----------------------------------------------------------------------------

PROCESS = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from test_store_engine import ASKED, STORED, make_engine
from kvblend.engine.sampler import SamplingParams
from kvblend.engine.scheduler import generate
engine = make_engine(redis_url={url!r})
if sys.argv[1] == "first":
    engine.precompute(STORED)
plan, out = engine.prefill(ASKED, "blend")
done = generate(engine, ASKED, SamplingParams(max_tokens=5), store=False)
engine.close()
torch.save(out.logits, sys.argv[2] + ".pt")
json.dump({{"tiers": out.stats.chunk_tiers, "tokens": done.token_ids}}, open(sys.argv[2] + ".json", "w"))
"""


def test_second_process_blends_chunks_the_first_stored_in_redis(tmp_path, any_redis, warm_python):
    script = tmp_path / "proc.py"
    script.write_text(PROCESS.format(tests=str(TESTS), url=any_redis.url))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results = {}
    for name in ("first", "second"):  # processes of their own (forks of a warm interpreter): no memory shared
        proc = warm_python.run([str(script), name, str(tmp_path / name)], tmp_path, env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[name] = (torch.load(tmp_path / f"{name}.pt"), json.loads((tmp_path / f"{name}.json").read_text()))
    (first_logits, first), (second_logits, second) = results["first"], results["second"]
    assert first["tiers"] == ["memory"] * 4 and second["tiers"] == ["redis"] * 4
    assert torch.equal(first_logits, second_logits) and first["tokens"] == second["tokens"]
