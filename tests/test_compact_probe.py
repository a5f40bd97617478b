"""The compact copy that blend's attention probe reads from disk and Redis: stored with chunks
(never with exact prefix blocks), checked like the rest of an entry, read by the probe alone, and
never part of the KV an answer is computed from; the read-ahead gives what inline loading gives."""

from __future__ import annotations

import json

import pytest
import torch
from redis_cluster import redis_cluster  # noqa: F401  (fixture)
from redis_server import RedisServer
from safetensors import safe_open
from safetensors.torch import save_file
from test_store_engine import ASKED, STORED, make_engine, same_output, stored_engine

from kvblend.cli import main
from kvblend.config import Settings
from kvblend.store import probe_copy
from kvblend.store.entry_format import BadEntry, entry_checksum, layer_digest
from kvblend.store.disk import DiskEntry
from kvblend.store.tier import StoredEntry
from kvblend.store.throttle import Throttled


@pytest.fixture(params=["disk", "redis", "cluster"])
def stored(request, tmp_path):
    """(kind, an engine whose only tier is `kind`, holding STORED's chunks with compact copies); Redis
    as one server or a cluster."""
    server = RedisServer().start() if request.param == "redis" else None
    url = server and server.url
    if request.param == "cluster":
        cluster = request.getfixturevalue("redis_cluster")
        cluster.flush()
        url = cluster.url
    kind = "disk" if request.param == "disk" else "redis"
    engine = stored_engine(kind, tmp_path, url, compact_probe=True)
    try:
        yield kind, engine
    finally:
        engine.close()  # its writes behind land before the next test empties the cluster
        if server:
            server.kill()


def test_int4_round_trip_is_within_half_a_step_of_each_group():
    x = torch.randn(3, 40, 64) * torch.linspace(0.1, 20, 64)  # channels of very different sizes
    packed, scale = probe_copy.encode(x)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 40, 32) and scale.shape == (3, 40, 2)
    y = probe_copy.decode(packed, scale, torch.float32)
    step = scale.float().repeat_interleave(32, dim=-1)
    assert bool(((y - x).abs() <= step / 2 + 1e-3 * x.abs() + 1e-6).all())
    assert probe_copy.group_size(256) == 32 and probe_copy.group_size(24) == 8 and probe_copy.group_size(7) is None


def test_chunks_are_stored_with_a_copy_that_decodes_close_to_their_kv(stored):
    kind, engine = stored
    plan = engine.plan(ASKED, "blend")
    assert all(c.kv.has_probe_copy for c in plan.chunks)
    assert not any(kv.has_probe_copy for _, kv in plan.prefix_blocks)  # exact blocks: read in full
    entry = plan.chunks[0].kv
    assert entry.meta.probe_layer_nbytes < 0.4 * entry.meta.layer_nbytes  # bf16 here: a quarter and scales
    for layer in (0, engine.runner.n_layers - 1):
        k, v = (t.float() for t in entry.layer(layer))
        pk, pv = probe_copy.layer_kv(entry.parts(layer, compact=True), torch.float32)  # as the loader decodes it
        assert pk.shape == k.shape
        for full, compact in ((k, pk), (v, pv)):
            assert float((full - compact).abs().max()) <= float(full.abs().max()) / 14 + 1e-6


def test_by_default_copies_are_stored_and_read_only_on_the_controllers_word(tmp_path, monkeypatch):
    """compact_probe "auto": the copies are stored; with the loading controller off the probe
    never reads them, so the output is the plain path's; false stores none."""
    assert Settings().compact_probe == "auto" and Settings().probe_reads_copies()
    assert not Settings(loading_controller=False).probe_reads_copies()
    monkeypatch.setenv("KVBLEND_COMPACT_PROBE", "false")
    assert Settings().compact_probe is False and not Settings().probe_reads_copies()
    engine = stored_engine("disk", tmp_path / "auto", compact_probe="auto", loading_controller=False)
    assert all(c.kv.has_probe_copy for c in engine.plan(ASKED, "blend").chunks)
    plain = stored_engine("disk", tmp_path / "off", compact_probe=False, loading_controller=False)
    assert not any(c.kv.has_probe_copy for c in plain.plan(ASKED, "blend").chunks)
    _, out = engine.prefill(ASKED, "blend")
    _, ref = plain.prefill(ASKED, "blend")
    assert out.stats.compact_chunks == 0
    same_output(out, ref)


def test_the_probe_reads_copies_and_the_blend_pass_reads_each_layer_once_in_full(tmp_path, monkeypatch):
    engine = stored_engine("disk", tmp_path, compact_probe=True)
    reads = {"full": [], "compact": []}
    parts = StoredEntry.parts

    def counted(self, layer, compact=False):
        reads["compact" if compact else "full"].append((self.key, layer))
        return parts(self, layer, compact)

    monkeypatch.setattr(StoredEntry, "parts", counted)
    plan, out = engine.prefill(ASKED, "blend")
    L, chunks = engine.runner.n_layers, {c.key for c in plan.chunks}
    expected = sorted((key, layer) for key in chunks for layer in range(L))
    assert sorted(reads["compact"]) == expected and out.stats.compact_chunks == len(chunks)
    assert sorted(r for r in reads["full"] if r[0] in chunks) == expected
    # The probe decodes them itself, timed apart from compute, for the loading controller.
    assert out.stats.copy_bytes == L * sum(c.kv.meta.probe_layer_nbytes for c in plan.chunks)
    assert 0 < out.stats.copy_s < out.stats.compute_s + out.stats.copy_s
    reads["full"].clear(), reads["compact"].clear()
    _, out = engine.prefill(ASKED, "reuse")  # no probe: no copy read
    assert out.stats.copy_bytes == 0 and out.stats.copy_s == 0
    assert reads["compact"] == [] and sorted(r for r in reads["full"] if r[0] in chunks) == expected


def test_the_answers_kv_holds_the_full_stored_kv_wherever_blend_did_not_recompute(stored):
    """Every row blend left reused holds, past the check layer, exactly the stored KV moved to
    its position (what reuse from memory holds there), never the probe's compact copy."""
    kind, engine = stored
    memory = make_engine()
    memory.precompute(STORED)
    _, reuse = memory.prefill(ASKED, "reuse")
    plan, out = engine.prefill(ASKED, "blend")
    reused = plan.reused_mask()
    reused[out.stats.recomputed_positions] = False
    reused = reused.nonzero().squeeze(1)
    assert len(reused) > 0.5 * int(plan.reused_mask().sum())
    check = max(engine.blend_cfg.check_layers)
    assert torch.equal(out.cache.k[check + 1:, :, reused], reuse.cache.k[check + 1:, :, reused])
    assert torch.equal(out.cache.v[check + 1:, :, reused], reuse.cache.v[check + 1:, :, reused])


def test_the_reader_hints_each_disk_read_before_it_makes_it(tmp_path, monkeypatch):
    """Every layer the reader takes from disk (copy or full KV) it first asked the kernel to
    fetch, a few steps ahead; the hints change no byte of the output."""
    engine = stored_engine("disk", tmp_path, compact_probe=True)
    _, before = engine.prefill(ASKED, "blend")
    events, parts, prefetch = [], StoredEntry.parts, DiskEntry.prefetch

    def read(self, layer, compact=False):
        events.append(("read", self.key, layer, compact))
        return parts(self, layer, compact)

    def hint(self, layer, compact=False):
        events.append(("hint", self.key, layer, compact))
        prefetch(self, layer, compact)
    monkeypatch.setattr(StoredEntry, "parts", read)
    monkeypatch.setattr(DiskEntry, "prefetch", hint)
    engine.prefetch_depth = engine.runner.n_layers
    _, out = engine.prefill(ASKED, "blend")
    same_output(out, before)
    reads = [i for i, e in enumerate(events) if e[0] == "read"]
    chunk_reads = [i for i in reads if events[i][1].startswith("chunk-")]
    assert len(chunk_reads) == 2 * engine.runner.n_layers * 4  # copies, then full KV, of 4 chunks
    for i in reads:
        first_hint = events.index(("hint", *events[i][1:]))
        assert first_hint < i


@pytest.mark.parametrize("bytes_per_s", [None, 200_000])
def test_read_ahead_with_copies_gives_what_inline_loading_gives(tmp_path, bytes_per_s):
    """Fast reads run ahead of the probe (the full reads wait for it to leave each layer); slow
    reads keep it waiting: either way the KV is the inline path's, bit for bit."""
    engine = stored_engine("disk", tmp_path, compact_probe=True)
    if bytes_per_s:
        engine.store.tiers[0] = Throttled(engine.store.tiers[0], bytes_per_s)
    engine.prefetch_depth = 0
    _, inline = engine.prefill(ASKED, "blend")
    for depth in (1, 2, engine.runner.n_layers):
        engine.prefetch_depth = depth
        _, out = engine.prefill(ASKED, "blend")
        same_output(out, inline)


def test_a_throttled_tier_books_the_copys_bytes_for_a_copys_read(tmp_path):
    engine = stored_engine("disk", tmp_path, compact_probe=True)
    slow = Throttled(engine.store.tiers[0], 1e6, clock=lambda: 0.0, sleep=lambda s: None)  # time stands still
    entry = slow.get(engine.plan(ASKED, "blend").chunks[0].key)
    entry.parts(0, compact=True)
    copy_s = slow.link.free_at
    entry.layer(0)
    assert copy_s == pytest.approx(entry.meta.probe_layer_nbytes / 1e6)
    assert slow.link.free_at - copy_s == pytest.approx(entry.meta.layer_nbytes / 1e6)
    assert entry.meta.layer_nbytes > 2 * entry.meta.probe_layer_nbytes


def rewrite_disk_entry(engine, key, edit):
    """Rewrite a disk entry after `edit(tensors, header)` changed them in place."""
    path = engine.store.tier("disk").path(key)
    with safe_open(str(path), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
        meta = json.loads(f.metadata()["kvblend"])
    edit(tensors, meta)
    save_file(tensors, str(path), metadata={"kvblend": json.dumps(meta)})


def test_a_corrupt_copy_is_a_bad_entry_a_miss_and_verify_finds_it(tmp_path, capsys):
    engine = stored_engine("disk", tmp_path, compact_probe=True)
    key = engine.plan(ASKED, "blend").chunks[1].key

    def flip(tensors, meta):
        tensors["pk.2"][0, 0, 0] ^= 0xFF

    rewrite_disk_entry(engine, key, flip)
    with pytest.raises(BadEntry, match="compact copy checksum"):
        engine.store.tier("disk").get(key).parts(2, compact=True)
    plan, out = engine.prefill(ASKED, "blend")  # the probe meets it: discarded, recomputed
    assert out.stats.bad_entries == 1 and out.stats.chunk_tiers.count("miss") == 1
    assert key not in engine.store.tier("disk")
    other = stored_engine("disk", tmp_path / "other", compact_probe=True)  # `store verify` reads copies too
    rewrite_disk_entry(other, other.plan(ASKED, "blend").chunks[0].key, flip)
    assert main(["store", "verify", "--local-disk", str(tmp_path / "other" / "kv")]) == 1
    assert "compact copy checksum mismatch" in capsys.readouterr().out


def test_an_entry_of_format_1_still_reads(tmp_path):
    """Format 1 had SHA-256 digests and no compact copy: such an entry is read, and probed, in full."""
    engine = stored_engine("disk", tmp_path, compact_probe=False)
    key = engine.plan(ASKED, "blend").chunks[0].key

    def as_format_1(tensors, meta):
        digests = [layer_digest({"k": tensors[f"k.{i}"], "v": tensors[f"v.{i}"]}, "sha256")
                   for i in range(meta["n_layers"])]
        for name in ("probe", "probe_digests", "digest", "layer_digests"):
            del meta[name]
        meta |= {"version": 1, "layer_sha256": digests, "checksum": entry_checksum(digests, "sha256")}

    rewrite_disk_entry(engine, key, as_format_1)
    reader = make_engine(disk=tmp_path / "kv", memory=False)
    plan, out = reader.prefill(ASKED, "blend")
    assert plan.chunks[0].kv is not None and plan.chunks[0].kv.meta.digest == "sha256"
    assert not plan.chunks[0].kv.has_probe_copy
    assert out.stats.bad_entries == 0 and out.stats.chunk_tiers == ["disk"] * 4
    # Changed after writing, a format-1 layer fails its SHA-256 check like any other.
    rewrite_disk_entry(engine, key, lambda tensors, meta: tensors["v.1"].mul_(2))
    with pytest.raises(BadEntry, match="layer 1 checksum"):
        make_engine(disk=tmp_path / "kv", memory=False).store.tier("disk").get(key).layer(1)
