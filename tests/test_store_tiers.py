"""Disk and Redis tiers on their own (Redis as one server and as a 3-master cluster): round trips,
the entry format, bad entries, eviction, an unreachable Redis, write failures, torn reads,
read-ahead hints and pipelined reads; and the TieredStore over them."""

from __future__ import annotations

import errno
import json
import os
import threading
import time

import pytest
import redis
import torch
from redis_cluster import any_redis, redis_cluster, start_cluster  # noqa: F401  (fixtures)
from redis_server import RedisServer, redis_server  # noqa: F401  (fixture)
from safetensors import safe_open

from kvblend.store.chunk_kv import ChunkKV
from kvblend.store.disk import HEADER_READAHEAD, DiskTier, tensor_ranges
from kvblend.store.entry_format import FORMAT_VERSION, BadEntry, EntrySpec
from kvblend.store.half import halve
from kvblend.store.int8 import quantize
from kvblend.store.memory import MemoryStore
from kvblend.store.redis_tier import RedisTier
from kvblend.store.tiered import TieredStore

L, H, D = 3, 2, 4
SPEC = EntrySpec("fp-a", "float32", L, H, D)
MB = 1 << 20


def kv(n: int = 5, seed: int = 0, dtype=torch.float32, start: int = 0) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    return ChunkKV(torch.randn(L, H, n, D, generator=g).to(dtype), torch.randn(L, H, n, D, generator=g).to(dtype),
                   torch.arange(start, start + n))


def same(a, b) -> bool:
    return (torch.equal(a.k.view(torch.uint8), b.k.view(torch.uint8)) and
            torch.equal(a.v.view(torch.uint8), b.v.view(torch.uint8)) and torch.equal(a.positions, b.positions))


@pytest.fixture(params=["disk", "redis", "cluster"])
def make_tier(request, tmp_path):
    """A factory of tiers of one kind, all over the same directory, Redis server or Redis Cluster."""
    if request.param == "disk":
        yield lambda spec=SPEC, cap=MB, **kw: DiskTier(tmp_path / "kv", cap, spec)
    else:
        yield from redis_tiers(request, "server" if request.param == "redis" else "cluster")


def redis_tiers(request, kind: str):
    if kind == "server":
        server = RedisServer().start()
        yield lambda spec=SPEC, cap=MB, **kw: RedisTier(server.url, cap, spec, **kw)
        server.kill()
    else:
        cluster = request.getfixturevalue("redis_cluster")
        cluster.flush()
        yield lambda spec=SPEC, cap=MB, **kw: RedisTier(cluster.url, cap, spec, **kw)


@pytest.fixture(params=["disk", "redis"])
def make_kept_tier(request, tmp_path):
    """Tiers whose capacity kvblend keeps itself: disk, and one Redis server (a cluster's masters
    keep theirs: test_a_cluster_evicts_whole_entries_under_its_maxmemory)."""
    if request.param == "disk":
        yield lambda spec=SPEC, cap=MB, **kw: DiskTier(tmp_path / "kv", cap, spec)
    else:
        yield from redis_tiers(request, "server")


# ---- round trips and the format ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_exact_layer_by_layer(make_tier, dtype):
    tier = make_tier(EntrySpec("fp-a", str(dtype).removeprefix("torch."), L, H, D))
    value = kv(7, dtype=dtype, start=3)
    assert tier.put("chunk-a", value)
    entry = tier.get("chunk-a")
    assert entry.tier == tier.name and entry.n_tokens == 7 and entry.positions.tolist() == list(range(3, 10))
    for layer in range(L):
        k, v = entry.layer(layer)
        assert torch.equal(k, value.k[layer]) and torch.equal(v, value.v[layer])
    assert same(entry.materialize(), value)
    assert "chunk-a" in tier and tier.keys() == ["chunk-a"] and tier.used_bytes >= value.k.nbytes * 2
    assert tier.get("chunk-b") is None and "chunk-b" not in tier
    assert tier.delete("chunk-a") and tier.get("chunk-a") is None and tier.keys() == []
    # What the tier counts (a cluster's used_bytes is its masters' memory, whatever they hold).
    assert tier.used_bytes == 0 if not getattr(tier, "cluster", False) else tier.used_bytes > 0


def test_disk_file_is_safetensors_with_a_full_header(tmp_path):
    tier = DiskTier(tmp_path, MB, SPEC)
    value = kv(4, start=10)
    tier.put("chunk-a", value)
    with safe_open(str(tmp_path / "chunk-a.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted([f"k.{i}" for i in range(L)] + [f"v.{i}" for i in range(L)])
        assert torch.equal(f.get_tensor("v.2"), value.v[2])
        meta = json.loads(f.metadata()["kvblend"])
    assert meta["version"] == FORMAT_VERSION and meta["key"] == "chunk-a" and meta["fingerprint"] == "fp-a"
    assert meta["dtype"] == "float32" and (meta["n_layers"], meta["n_kv_heads"], meta["head_dim"]) == (L, H, D)
    assert meta["n_tokens"] == 4 and meta["positions"] == [10, 11, 12, 13]
    assert len(meta["layer_digests"]) == L and len(meta["checksum"]) == 32
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_redis_entry_is_one_hash_of_its_header_and_layers(any_redis):
    tier = RedisTier(any_redis.url, MB, SPEC, ttl_s=100)
    tier.put("chunk-a", kv())
    c = any_redis.client()
    assert sorted(c.hkeys("kvblend:chunk-a")) == [b"0", b"1", b"2", b"h"]
    assert json.loads(c.hget("kvblend:chunk-a", "h"))["key"] == "chunk-a"
    assert 0 < c.ttl("kvblend:chunk-a") <= 100  # one key: it expires (or is evicted) whole
    assert RedisTier(any_redis.url, MB, SPEC).get("chunk-a") is not None  # another process's view


def test_an_entry_without_its_header_is_a_miss(any_redis):
    tier = RedisTier(any_redis.url, MB, SPEC)
    tier.put("chunk-a", kv())
    any_redis.client().hdel("kvblend:chunk-a", "h")  # never written so (one HSET), but read as a miss
    assert tier.get("chunk-a") is None and "chunk-a" not in tier


def test_a_prompts_headers_and_layers_take_one_pipeline_each(any_redis, monkeypatch):
    """Lookups read ahead in one pipeline, and a layer hinted for several entries is read for all
    of them at once: 20 chunks cost one round trip (per shard) per layer, not 20."""
    tier = RedisTier(any_redis.url, MB, SPEC)
    keys = [f"chunk-{i:02d}" for i in range(20)]
    for i, key in enumerate(keys):
        tier.put(key, kv(seed=i))
    sent, measured = [], []
    pipelined = tier._pipelined
    monkeypatch.setattr(tier, "_pipelined", lambda ks, *a: sent.append(list(ks)) or pipelined(ks, *a))
    monkeypatch.setattr(tier.meter, "record", lambda nbytes, seconds: measured.append(nbytes))
    tier.prefetch(keys + ["chunk-missing"])
    entries = [tier.get(key) for key in keys]
    assert tier.get("chunk-missing") is None and len(sent) == 1  # every lookup answered by the one read
    for layer in range(L):
        for e in entries:
            e.prefetch(layer)
        for i, e in enumerate(entries):
            assert same_layer(e.layer(layer), kv(seed=i), layer)
    assert len(sent) == 1 + L and all(sorted(s) == keys for s in sent[1:])
    # The tier's bandwidth (the loading controller's) is measured over each pipeline, all its bytes.
    assert measured == [20 * entries[0].meta.layer_nbytes] * L
    assert tier.hits == 20 and tier.misses == 1


# ---- bad entries ------------------------------------------------------------------------------

def corrupt_layer(tier, key: str, layer: int) -> None:
    """Flip one byte inside one layer's data."""
    if isinstance(tier, DiskTier):
        path = tier.path(key)
        start, _ = tensor_ranges(path)[f"v.{layer}"]
        data = bytearray(path.read_bytes())
        data[start] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        data = bytearray(tier.client.hget(tier.entry_key(key), str(layer)))
        data[-1] ^= 0xFF
        tier.client.hset(tier.entry_key(key), str(layer), bytes(data))


def test_corrupt_layer_raises_bad_entry_when_read(make_tier):
    tier = make_tier()
    tier.put("chunk-a", kv())
    corrupt_layer(tier, "chunk-a", 1)
    entry = tier.get("chunk-a")  # the header is fine: the damage shows when layer 1 is read
    entry.layer(0)
    with pytest.raises(BadEntry, match="layer 1 checksum mismatch") as e:
        entry.layer(1)
    assert e.value.key == "chunk-a" and e.value.tier == tier.name and e.value.delete
    tier.discard("chunk-a", e.value.reason)
    assert tier.get("chunk-a") is None and tier.bad_entries == 1


def test_truncated_entries_are_misses(make_tier):
    tier = make_tier()
    tier.put("chunk-a", kv())
    if isinstance(tier, DiskTier):
        path = tier.path("chunk-a")
        path.write_bytes(path.read_bytes()[:-7])
        assert tier.get("chunk-a") is None and tier.bad_entries == 1 and not path.exists()
    else:
        c, ek = tier.client, tier.entry_key("chunk-a")
        c.hset(ek, "2", c.hget(ek, "2")[:-7])
        with pytest.raises(BadEntry, match="layer 2 unreadable"):
            tier.get("chunk-a").materialize()


def rewrite_header(tier, key: str, **changes) -> None:
    if isinstance(tier, DiskTier):
        path = tier.path(key)
        with safe_open(str(path), "pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
            meta = json.loads(f.metadata()["kvblend"])
        from safetensors.torch import save_file
        save_file(tensors, str(path), metadata={"kvblend": json.dumps({**meta, **changes})})
    else:
        meta = json.loads(tier.client.hget(tier.entry_key(key), "h"))
        tier.client.hset(tier.entry_key(key), "h", json.dumps({**meta, **changes}))


@pytest.mark.parametrize("change", [{"version": FORMAT_VERSION + 1}, {"fingerprint": "fp-other"},
                                    {"dtype": "bfloat16"}, {"n_kv_heads": H + 1}, {"checksum": "0" * 64}])
def test_wrong_version_model_dtype_or_shape_is_a_deleted_miss(make_tier, change):
    tier = make_tier()
    tier.put("chunk-a", kv())
    rewrite_header(tier, "chunk-a", **change)
    assert tier.get("chunk-a") is None
    assert tier.bad_entries == 1 and "chunk-a" not in tier


def test_entry_of_another_model_or_dtype_is_never_read(make_tier):
    other_model = make_tier(EntrySpec("fp-b", "float32", L, H, D))
    other_dtype = make_tier(EntrySpec("fp-a", "bfloat16", L, H, D))
    other_model.put("chunk-a", kv())
    other_dtype.put("chunk-b", kv(dtype=torch.bfloat16))
    tier = make_tier()
    assert tier.get("chunk-a") is None and tier.get("chunk-b") is None and tier.bad_entries == 2


def test_swapped_entries_are_misses(make_tier):
    tier = make_tier()
    tier.put("chunk-a", kv(seed=1))
    tier.put("chunk-b", kv(seed=2))
    if isinstance(tier, DiskTier):
        a, b = tier.path("chunk-a"), tier.path("chunk-b")
        tmp = a.with_suffix(".x")
        a.rename(tmp), b.rename(a), tmp.rename(b)
    else:  # field by field: the two keys may live on different shards of a cluster
        c, a, b = tier.client, tier.entry_key("chunk-a"), tier.entry_key("chunk-b")
        fields_a, fields_b = c.hgetall(a), c.hgetall(b)
        c.hset(a, mapping=fields_b)
        c.hset(b, mapping=fields_a)
    assert tier.get("chunk-a") is None and tier.get("chunk-b") is None and tier.bad_entries == 2


def test_swapped_redis_layers_fail_their_checksum(any_redis):
    tier = RedisTier(any_redis.url, MB, SPEC)
    tier.put("chunk-a", kv(seed=1))
    tier.put("chunk-b", kv(seed=2))
    c = tier.client
    c.hset("kvblend:chunk-a", "1", c.hget("kvblend:chunk-b", "1"))
    with pytest.raises(BadEntry, match="layer 1 checksum"):
        tier.get("chunk-a").materialize()


# ---- capacity ---------------------------------------------------------------------------------

def test_eviction_keeps_the_tier_under_capacity_lru_first(make_kept_tier):
    make_tier = make_kept_tier
    probe = make_tier(cap=MB)
    probe.put("chunk-size", kv(8))
    size = probe.used_bytes
    probe.delete("chunk-size")
    tier = make_tier(cap=int(size * 3.5))
    for name in "abc":
        assert tier.put(f"chunk-{name}", kv(8))
    assert tier.get("chunk-a") is not None  # a is now more recent than b
    tier.put("chunk-d", kv(8))
    assert tier.used_bytes <= tier.capacity_bytes
    assert "chunk-b" not in tier and all(f"chunk-{n}" in tier for n in "acd")
    assert tier.evictions == 1
    for i in range(10):
        tier.put(f"chunk-x{i}", kv(8, seed=i))
        assert tier.used_bytes <= tier.capacity_bytes
    assert not tier.put("chunk-huge", kv(200)) and "chunk-huge" not in tier


def test_redis_capacity_is_shared_by_processes(redis_server):
    a = RedisTier(redis_server.url, MB, SPEC)
    a.put("chunk-size", kv(8))
    size = a.used_bytes
    a.delete("chunk-size")
    a, b = RedisTier(redis_server.url, size * 2, SPEC), RedisTier(redis_server.url, size * 2, SPEC)
    a.put("chunk-a", kv(8))
    b.put("chunk-b", kv(8))
    a.put("chunk-c", kv(8))
    assert b.used_bytes == 2 * size and sorted(b.keys()) == ["chunk-b", "chunk-c"]


def test_a_cluster_evicts_whole_entries_under_its_maxmemory(redis_cluster):
    """A cluster's masters bound themselves (maxmemory, allkeys-lru): kvblend writes on, each entry
    is read whole or is a clean miss (never a bad entry), and each master stays near its bound."""
    redis_cluster.flush()
    masters = [redis.Redis(port=p) for p in redis_cluster.master_ports()]
    tier = RedisTier(redis_cluster.url, 1 << 30, SPEC)
    values = {f"chunk-{i:03d}": kv(400, seed=i) for i in range(120)}  # 120 entries of 58 kB: 7 MB
    # Room for a replication backlog (1 MB, counted as used memory by Redis 7.0) and 1 MB of entries.
    bound = [int(m.info("memory")["used_memory"]) + (2 << 20) for m in masters]
    try:
        for m, b in zip(masters, bound):
            m.config_set("maxmemory", b)
        for key, value in values.items():
            assert tier.put(key, value)
        evicted = sum(int(m.info("stats")["evicted_keys"]) for m in masters)
        assert evicted > 0 and tier.evictions == 0  # the servers evicted, not kvblend
        for m, b in zip(masters, bound):
            assert int(m.info("memory")["used_memory"]) <= b + 2 * 60_000  # its bound, give or take a write
        whole = 0
        for key, value in values.items():
            entry = tier.get(key)
            if entry is not None:
                assert same(entry.materialize(), value)
                whole += 1
        assert 0 < whole < len(values) and tier.bad_entries == 0
        # Reading fills client output buffers, which Redis counts as used memory, so a master may
        # evict again while we read: the index lists no more than were read whole, and nothing foreign.
        listed = tier.keys()
        assert 0 < len(listed) <= whole and set(listed) <= set(values)
    finally:
        for m in masters:
            m.config_set("maxmemory", 0)


# ---- faults -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["server", "cluster"])
def test_redis_down_at_start_then_back(kind):
    server = RedisServer() if kind == "server" else start_cluster()  # not started
    tier = RedisTier(server.url, MB, SPEC, retry_s=0.0)
    assert tier.get("chunk-a") is None and not tier.put("chunk-a", kv()) and "chunk-a" not in tier
    assert tier.keys() == [] and tier.used_bytes == 0 and tier.unreachable >= 1 and tier.write_errors == 1
    server.start()
    try:
        assert tier.put("chunk-a", kv()) and same(tier.get("chunk-a").materialize(), kv())
    finally:
        server.kill() if kind == "server" else server.stop()


def test_a_down_cluster_master_empties_its_slots_only_until_its_replica_takes_over(redis_cluster):
    redis_cluster.flush()
    tier = RedisTier(redis_cluster.url, MB, SPEC, retry_s=60.0)
    keys = [f"chunk-{i:02d}" for i in range(24)]
    for i, key in enumerate(keys):
        assert tier.put(key, kv(seed=i))
    reading = tier.get(keys[0])
    killed = redis_cluster.master_of(tier.entry_key(keys[0]))
    on_it = [k for k in keys if redis_cluster.master_of(tier.entry_key(k)) == killed]
    elsewhere = [k for k in keys if k not in on_it]
    time.sleep(0.2)  # the replica has the entries (replication is asynchronous)
    redis_cluster.kill(killed)
    try:
        with pytest.raises(BadEntry, match="unreachable") as e:  # mid-read: kept, not deleted
            reading.layer(0)
        assert not e.value.delete and tier.unreachable == 1
        dead = tier._node(keys[0])  # the node the tier's slot map sends those keys to
        tier.prefetch(keys)  # one pipeline: the live shards answer, the dead one's keys read as empty
        got = {k: tier.get(k) for k in keys}
        assert [k for k in keys if got[k] is None] == on_it and tier.misses == len(on_it)
        assert all(same(got[k].materialize(), kv(seed=keys.index(k))) for k in elsewhere)
        assert not tier.put(on_it[0], kv()) and tier.put("chunk-new", kv()) == (tier._node("chunk-new") != dead)
        assert tier.unreachable == 1 and tier.bad_entries == 0 and tier.available
        redis_cluster.wait_healthy()  # the replica has taken over the slots
        tier._down.clear()  # as if retry_s had passed
        back = [k for k in on_it if tier.get(k) is not None]
        assert back == on_it and all(same(tier.get(k).materialize(), kv(seed=keys.index(k))) for k in on_it)
    finally:
        redis_cluster.restart(killed)


def test_redis_dying_mid_read_is_a_bad_entry_that_is_kept(redis_server):
    tier = RedisTier(redis_server.url, MB, SPEC)
    tier.put("chunk-a", kv())
    entry = tier.get("chunk-a")
    redis_server.kill()
    with pytest.raises(BadEntry, match="unreachable") as e:
        entry.layer(0)
    assert not e.value.delete


def test_disk_full_write_fails_softly_and_reads_go_on(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, MB, SPEC)
    tier.put("chunk-a", kv())

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    assert tier.put("chunk-b", kv()) is False and tier.write_errors == 1
    assert "chunk-b" not in tier and sorted(p.name for p in tmp_path.iterdir()) == ["chunk-a.safetensors"]
    assert same(tier.get("chunk-a").materialize(), kv())


def test_read_only_directory_write_fails_softly(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, MB, SPEC)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr("builtins.open", read_only)
    assert tier.put("chunk-a", kv()) is False and tier.write_errors == 1


def test_bad_disk_config_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        DiskTier(tmp_path / "file", MB, SPEC)
    with pytest.raises(ValueError, match="Redis"):
        RedisTier("lm://localhost:65432", MB, SPEC)
    with pytest.raises(ValueError, match="database 0"):
        RedisTier("redis+cluster://localhost:65432/2", MB, SPEC)
    with pytest.raises(ValueError, match="TCP"):
        RedisTier("unix:///tmp/redis.sock", MB, SPEC, cluster=True)
    with pytest.raises(ValueError, match="braces"):
        RedisTier("redis://localhost:65432", MB, SPEC, prefix="kv{b}:")


# ---- concurrency ------------------------------------------------------------------------------

def test_concurrent_writer_and_reader_never_see_a_torn_entry(make_tier):
    """One key, rewritten over and over with one of two different values (as two machines whose
    bf16 kernels differ might): every read is one whole value, or a miss / BadEntry."""
    writer_tier, reader_tier = make_tier(), make_tier()
    values = [kv(16, seed=1), kv(16, seed=2)]
    stop, writes = threading.Event(), [0]

    def write():
        while not stop.is_set():
            writer_tier.delete("chunk-a")
            writer_tier.put("chunk-a", values[writes[0] % 2])
            writes[0] += 1
            stop.wait(0.001)  # let the reader find it whole now and then

    t = threading.Thread(target=write)
    t.start()
    whole = bad = 0
    try:
        while writes[0] < 40 or (whole == 0 and writes[0] < 2000):
            entry = reader_tier.get("chunk-a")
            if entry is None:
                continue
            try:
                got = entry.materialize()
            except BadEntry:
                bad += 1
                continue
            assert same(got, values[0]) or same(got, values[1])
            whole += 1
    finally:
        stop.set()
        t.join()
    assert whole > 0, (whole, bad)


# ---- read-ahead hints -------------------------------------------------------------------------

def test_disk_prefetch_asks_the_kernel_for_each_present_entrys_header(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, MB, SPEC)
    tier.put("chunk-a", kv(seed=1))
    tier.put("chunk-b", kv(seed=2))
    asked, advise = [], os.posix_fadvise

    def spy(fd, offset, length, advice):
        asked.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), offset, length, advice))
        advise(fd, offset, length, advice)
    monkeypatch.setattr(os, "posix_fadvise", spy)
    tier.prefetch(["chunk-b", "chunk-missing", "chunk-a"])
    assert asked == [(f"{key}.safetensors", 0, HEADER_READAHEAD, os.POSIX_FADV_WILLNEED)
                     for key in ("chunk-b", "chunk-a")]

    def refuse(*_):
        raise OSError(errno.EINVAL, "no hints here")
    monkeypatch.setattr(os, "posix_fadvise", refuse)
    tier.prefetch(["chunk-a"])  # a hint the kernel refuses changes nothing
    assert same(tier.get("chunk-a").materialize(), kv(seed=1))
    assert tier.hits == 1 and tier.misses == 0  # a hint is not a lookup


@pytest.mark.parametrize("compact", [False, True])
def test_a_disk_entry_prefetches_exactly_one_layers_bytes(tmp_path, monkeypatch, compact):
    tier = DiskTier(tmp_path, MB, SPEC)
    stored = kv(n=7, seed=3)
    stored.probe_copy = True
    tier.put("chunk-a", stored)
    entry, asked = tier.get("chunk-a"), []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: asked.append((offset, length, advice)))
    entry.prefetch(1, compact)
    data = (tmp_path / "chunk-a.safetensors").read_bytes()
    parts = entry.parts(1, compact)
    assert [(data[o:o + n], advice) for o, n, advice in asked] == [
        (t.contiguous().view(torch.uint8).numpy().tobytes(), os.POSIX_FADV_WILLNEED) for t in parts.values()]
    (tmp_path / "chunk-a.safetensors").unlink()
    entry.prefetch(2, compact)  # the file gone: a hint, not an error
    assert len(asked) == len(parts)


# ---- the tiered store -------------------------------------------------------------------------

def test_tiered_store_reads_in_order_promotes_and_writes_behind(tmp_path, any_redis):
    memory, disk = MemoryStore(MB), DiskTier(tmp_path, MB, SPEC)
    remote = RedisTier(any_redis.url, MB, SPEC)
    store = TieredStore([memory, disk, remote])
    store.put("chunk-a", kv(seed=1))
    assert "chunk-a" in store and memory.get("chunk-a") is not None
    store.flush()
    assert "chunk-a" in disk and "chunk-a" in remote
    # A cluster's used_bytes is its masters' whole memory, which moves by a few KB between two reads
    # (client buffers): the local tiers are summed exactly, the remote one to within that.
    local = memory.used_bytes + disk.used_bytes
    assert len(store) == 3 and local > 0 and abs(store.used_bytes - local - remote.used_bytes) <= 256 << 10

    remote.put("chunk-b", kv(seed=2))  # only in Redis, e.g. stored by another server
    got = store.get("chunk-b")
    assert got.tier == "redis"
    store.flush()  # promotion runs behind the request
    assert "chunk-b" in disk and memory.get("chunk-b").tier == "memory"
    assert same(store.get("chunk-b"), kv(seed=2)) and store.promotions == 1

    memory.delete("chunk-a")
    assert store.get("chunk-a").tier == "disk"
    store.close()


def test_tiered_prefetch_passes_on_only_the_keys_no_memory_tier_holds(tmp_path):
    memory, disk = MemoryStore(MB), DiskTier(tmp_path, MB, SPEC)
    store = TieredStore([memory, disk])
    memory.put("chunk-a", kv(seed=1))
    hinted = []
    disk.prefetch = hinted.extend
    store.prefetch(["chunk-a", "chunk-b", "chunk-c"])
    assert hinted == ["chunk-b", "chunk-c"]
    store.prefetch(["chunk-a"])  # nothing left to hint
    assert hinted == ["chunk-b", "chunk-c"]
    store.close()


def test_tiered_store_without_memory_serves_pending_writes(tmp_path):
    disk = DiskTier(tmp_path, MB, SPEC)
    store = TieredStore([disk])
    store.put("chunk-a", kv())
    assert "chunk-a" in store and store.get("chunk-a") is not None  # written or still pending
    store.flush()
    assert store.get("chunk-a").tier == "disk"
    store.close()





def test_write_behind_backlog_is_bounded(tmp_path):
    release = threading.Event()

    class SlowDisk(DiskTier):
        def put(self, key, value):
            release.wait()
            return super().put(key, value)

    disk = SlowDisk(tmp_path, MB, SPEC)
    store = TieredStore([disk], max_pending_bytes=2 * kv().nbytes)
    for name in "abc":
        store.put(f"chunk-{name}", kv())
    assert store.writes_dropped == 1 and "chunk-c" not in store and "chunk-a" in store
    release.set()
    store.flush()
    assert sorted(disk.keys()) == ["chunk-a", "chunk-b"] and store.stats()["store"]["writes_dropped"] == 1
    store.close()


def test_wait_written_waits_for_its_keys_only(tmp_path):
    release = threading.Event()

    class SlowDisk(DiskTier):
        def put(self, key, value):
            if key == "chunk-slow":
                release.wait()
            return super().put(key, value)

    disk = SlowDisk(tmp_path, MB, SPEC)
    store = TieredStore([MemoryStore(MB), disk])
    store.put("chunk-slow", kv(seed=1))
    assert not store.wait_written(["chunk-slow"], 0.05)  # still held by the slow write
    assert store.wait_written(["chunk-other"], 0.05)  # nothing of its own pending
    results: list[bool] = []
    waiter = threading.Thread(target=lambda: results.append(store.wait_written(["chunk-slow"], 30)))
    waiter.start()
    release.set()
    waiter.join(timeout=30)
    assert results == [True] and "chunk-slow" in disk
    store.close()


def test_a_write_caught_up_again_is_still_owed_until_it_lands(tmp_path):
    """catch_up writes a down tier's missed entries again: while such a write is in flight (and
    when it fails again) the tier still owes the key, so a caller is never told it is written."""
    attempt, release = threading.Event(), threading.Event()

    class Flaky(DiskTier):  # a tier that can come back, down while `up` is False
        available, up = True, False

        def put(self, key, value):
            attempt.set()
            release.wait(30)
            if not self.up:
                self.write_errors += 1
                return False
            return super().put(key, value)

    tier = Flaky(tmp_path, MB, SPEC)
    release.set()
    store = TieredStore([MemoryStore(MB), tier])
    store.put("chunk-a", kv())
    store.flush()
    assert store.missed_by(["chunk-a"]) == ["disk"]
    for up in (False, True):
        attempt.clear(), release.clear()
        tier.up = up
        assert store.catch_up() == 1
        assert attempt.wait(30) and store.missed_by(["chunk-a"]) == ["disk"]  # in flight: owed
        assert store.stats()["store"]["catch_up_pending"] == 1
        release.set()
        store.flush()
    assert store.missed_by(["chunk-a"]) == [] and "chunk-a" in tier and store.caught_up == 1
    assert store.stats()["store"]["catch_up_pending"] == 0
    store.close()


# ---- a throttled tier ---------------------------------------------------------------------------

def test_throttle_shares_its_bandwidth_between_concurrent_reads(tmp_path):
    """Reads issued at once from several threads book the link one after another: together they
    take as long as in a row, so reading in parallel cannot beat the set bandwidth."""
    from kvblend.store.throttle import Throttled

    now, slept = [100.0], []
    tier = DiskTier(tmp_path / "kv", MB, SPEC)
    tier.put("a", kv(8))
    slow = Throttled(tier, bytes_per_s=1000.0, clock=lambda: now[0], sleep=slept.append)
    entries = [slow.get("a") for _ in range(3)]
    seconds = entries[0].meta.layer_nbytes / 1000.0
    for e in entries:  # three reads started at the same instant (the fake clock never moves)
        assert same_layer(e.layer(0), kv(8))
    assert slept == pytest.approx([seconds, 2 * seconds, 3 * seconds])
    now[0] += 10 * seconds  # the link has been idle: the next read books from now, not from the past
    entries[0].layer(1)
    assert slept[-1] == pytest.approx(seconds)


def same_layer(got, want: ChunkKV, layer: int = 0) -> bool:
    return torch.equal(got[0], want.k[layer]) and torch.equal(got[1], want.v[layer])


@pytest.mark.parametrize("form", ["bf16", "int8"])
def test_each_stored_form_round_trips_through_a_tier_under_its_layer_digests(make_tier, form):
    x = {"bf16": halve, "int8": quantize}[form](kv(9, seed=5))
    tier = make_tier()
    assert tier.put("chunk", x)
    entry = tier.get("chunk")
    assert entry.meta.quant == form and entry.meta.dtype == "float32"
    assert entry.meta.layer_nbytes * x.n_layers == x.nbytes - x.positions.nbytes
    back = entry.materialize()
    assert type(back) is type(x) and back.dtype == torch.float32
    for name, t in vars(x).items():
        if isinstance(t, torch.Tensor):
            assert torch.equal(getattr(back, name), t), name
    for layer in range(x.n_layers):
        assert all(torch.equal(a, b) for a, b in zip(entry.layer(layer), x.layer(layer)))
    # Every stored tensor (int8's scales too) is under the layer digest.
    entry.meta.layer_digests[1] = "0" * 32  # as if layer 1 had been changed after writing
    with pytest.raises(BadEntry, match="layer 1 checksum"):
        entry.layer(1)
