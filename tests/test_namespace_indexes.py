"""One neighbour index per namespace, kept where the store keeps its entries (a file per namespace
in local_disk, a key per namespace in Redis, one server or a cluster): it survives restarts, two processes adding to it
lose nothing, and a corrupt or missing one costs only the neighbours (chunks are served plain)."""

import logging

import pytest
from redis_cluster import redis_cluster  # noqa: F401  (fixture)
from redis_server import RedisServer
from test_blend_invariants import SEP, chunks, make_engine, prompt

from kvblend import SamplingParams
from kvblend.engine.scheduler import generate
from kvblend.store.index_store import FilePlace, RedisPlace, build_index_store
from kvblend.store.redis_tier import RedisTier

CS = chunks(4, seed=11)
CS[1] = CS[0][:16] + CS[1][16:]  # 0 and 1 share most tokens: each other's neighbour
CS[3] = CS[2][:16] + CS[3][16:]


@pytest.fixture(params=["disk", "redis", "cluster"])
def place(request, tmp_path):
    """Settings for an engine whose indexes live on disk, or in Redis (no disk): one server or a cluster."""
    if request.param == "disk":
        yield {"local_disk": str(tmp_path / "kv")}
    elif request.param == "redis":
        server = RedisServer().start()
        yield {"remote_url": server.url}
        server.kill()
    else:
        cluster = request.getfixturevalue("redis_cluster")
        cluster.flush()
        yield {"remote_url": cluster.url}


@pytest.fixture
def new_engine(place):
    """Makes prefix-context engines at `place` and closes them all when the test ends: an engine left
    open could finish a write behind into the next test's cluster, after that test emptied it."""
    made = []

    def make():
        made.append(make_engine(chunk_context="prefix", **place))
        return made[-1]
    yield make
    for engine in made:
        engine.close()


def test_each_namespace_indexes_only_its_own_chunks(new_engine):
    engine = new_engine()
    with engine.namespace("alice"):
        engine.index_collection([prompt([CS[0], CS[2]])])
    with engine.namespace("bob"):
        engine.index_collection([prompt([CS[1], CS[3]])])
    alice, bob = engine.indexes.get("alice"), engine.indexes.get("bob")
    # Globally, 0 and 1 (2 and 3) are each other's neighbours; per namespace they never meet.
    assert alice.neighbour_of(CS[0]) is None and alice.neighbour_of(CS[1]) is None
    assert bob.neighbour_of(CS[1]) is None and len(bob) == 2
    with engine.namespace("bob"):
        engine.index_collection([prompt([CS[0]])])  # now bob has it too: his own copy
        assert engine.keys.lead_ids(CS[0]) == CS[1] + SEP
    assert engine.indexes.get("alice").neighbour_of(CS[0]) is None


def test_the_indexes_survive_a_restart_and_two_writers_lose_nothing(new_engine):
    first, second = new_engine(), new_engine()
    assert second.indexes.get("kb") is None
    with first.namespace("kb"):
        first.index_collection([prompt([CS[0]])])
    with second.namespace("kb"):  # its view predates the first's addition: it reads it again
        assert second.keys.neighbours is not None and len(second.keys.neighbours) == 1
        second.index_collection([prompt([CS[1], CS[2]])])
    third = new_engine()  # a restart
    with third.namespace("kb"):
        index = third.keys.neighbours
        assert len(index) == 3 and index.neighbour_of(CS[0]) is None  # first indexed: kept
        assert index.neighbour_of(CS[1]) == CS[0]
    with first.namespace("kb"):  # the first engine sees the second's chunks too
        assert first.keys.lead_ids(CS[1]) == CS[0] + SEP


def corrupt(engine, ns):
    for p in engine.indexes.store.places:
        if isinstance(p, RedisPlace):
            p.write(ns, '{"format": "kvblend-neighbours-1", "chunks": [[1, 2]], "neighbour": [7]}')
        elif isinstance(p, FilePlace):
            p.path_of(ns).write_bytes(b"\x00\xffnot json")


@pytest.mark.parametrize("how", ["corrupt", "missing"])
def test_a_corrupt_or_missing_index_loses_nothing(new_engine, how, caplog):
    engine = new_engine()
    ids = prompt([CS[0], CS[1], CS[2]])
    with engine.namespace("kb"):
        engine.index_collection([ids])
        engine.precompute(ids)
        assert engine.plan(ids, "blend").hits == 3
    engine.close()  # its writes behind reach disk or Redis before the restart looks
    if how == "corrupt":
        corrupt(engine, "kb")
    else:
        for p in engine.indexes.store.places:
            if isinstance(p, RedisPlace):
                p.tier.client.delete(p._key("kb"))
            elif isinstance(p, FilePlace):
                p.path_of("kb").unlink()
    restarted = new_engine()
    with caplog.at_level(logging.WARNING, logger="kvblend.blend.namespace_indexes"), restarted.namespace("kb"):
        assert restarted.keys.neighbours is None  # nothing usable: the chunks are plain
        plan = restarted.plan(ids, "blend")
        # The first chunk comes exact from the prefix blocks (no neighbour in their keys); the
        # others were stored under keys naming their neighbours: misses, recomputed, stored plain.
        assert plan.hits == 1 and len(plan.misses) == 2
        generate(restarted, ids, SamplingParams(max_tokens=2))
        assert restarted.plan(ids, "blend").hits == 3
        restarted.index_collection([ids])  # the next addition rebuilds it
        assert len(restarted.keys.neighbours) == 3
    assert (how == "corrupt") == any("cannot be read" in r.getMessage() or "is not a" in r.getMessage()
                                     for r in caplog.records)


def test_index_store_places_and_names(tmp_path):
    store = build_index_store(None, str(tmp_path), None)
    store.update("default", lambda text: "a")
    store.update("key-1/kb", lambda text: (text or "") + "b")
    store.update("../x", lambda text: "c")
    assert (tmp_path / "neighbours.json").read_text() == "a"  # where one index used to live
    assert store.read("key-1/kb") == "b" and store.read("../x") == "c"
    assert sorted(p.name for p in (tmp_path / "neighbours").glob("*.json")) == ["..%2Fx.json", "key-1%2Fkb.json"]
    memory = build_index_store(None, None, None)
    assert memory.read("a") is None and memory.update("a", lambda t: "x") == "x" and memory.read("a") == "x"


def test_redis_down_reads_the_disk_copy_and_an_empty_redis_starts_from_it(tmp_path):
    server = RedisServer().start()
    try:
        tier = RedisTier(server.url, 1 << 20, retry_s=0.0)
        store = build_index_store(tier, str(tmp_path), None)
        store.update("kb", lambda t: "one")
        server.kill()
        assert store.read("kb") == "one"  # from the disk copy
        server = RedisServer(server.port).start()  # back, empty
        assert store.update("kb", lambda t: t + "+two") == "one+two"  # nothing indexed is lost
        assert server.client().get("kvblend:{neighbours:kb}") == b"one+two"
        assert store.read("kb") == "one+two"
    finally:
        server.kill()


def test_a_namespace_index_and_its_version_share_a_cluster_slot(redis_cluster):  # noqa: F811
    """An update is a transaction over the index and its version: on a cluster both keys must
    hash to one slot, whatever the namespace holds (braces too)."""
    redis_cluster.flush()
    tier = RedisTier(redis_cluster.url, 1 << 20, retry_s=0.0)
    store = build_index_store(tier, None, None)
    for ns in ("kb", "key-1/kb", "a}b{c", "}"):
        assert store.update(ns, lambda t, ns=ns: (t or "") + ns) == ns
        assert store.update(ns, lambda t: t + "!") == ns + "!"
        place = store.places[0]
        assert tier.client.get(place._key(ns)) == (ns + "!").encode() and tier.client.get(place._version_key(ns)) == b"2"
        assert tier.client.keyslot(place._key(ns)) == tier.client.keyslot(place._version_key(ns))
    assert tier.unreachable == 0
