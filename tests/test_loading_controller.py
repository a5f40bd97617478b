"""The loading controller: it never goes below the configured ratio, recomputes more when
reading stored KV is the bottleneck, recomputes whole chunks when reading them is slower than
recomputing them, and reads from the fastest tier; its decision is in the metrics."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from redis_server import redis_server  # noqa: F401  (fixture)
from test_store_engine import ASKED, STORED, make_engine, same_output, stored_engine

from kvblend.blend.controller import LayerReads, LoadingController, Work, play, work
from kvblend.config import Settings
from kvblend.engine.sampler import SamplingParams
from kvblend.store.throttle import Throttled
from kvblend.engine.scheduler import generate

FLOOR = 0.15


def disk_engine(tmp_path, **settings):
    # float32 entries: the rates below are set against their bytes, the copies an eighth of them.
    engine = stored_engine("disk", tmp_path, **{"kv_half": False, **settings})
    return engine, engine.store.tier("disk"), LoadingController(engine.store)


def counts(plan):
    reused = int(plan.reused_mask().sum())
    return plan.n_tokens - plan.prefix_hit - reused, reused


def layer_bytes(plan):
    """Bytes of one layer of every stored entry the plan reads."""
    return sum(c.kv.meta.layer_nbytes for c in plan.chunks) + sum(kv.meta.layer_nbytes for _, kv in plan.prefix_blocks)


def slow_disk(tmp_path, **settings):
    """(engine, disk, controller, plan): compute at 1e4 rows a second, and a disk whose layer read
    takes as long as computing the must-compute rows and 60% of the reused ones."""
    engine, disk, ctl = disk_engine(tmp_path, **settings)
    plan = engine.plan(ASKED, "blend")
    must, reused = counts(plan)
    ctl.compute.rate = 1e4
    disk.meter.rate = layer_bytes(plan) * ctl.compute.rate / (must + 0.6 * reused)
    return engine, disk, ctl, plan


def test_no_measurements_no_change(tmp_path):
    engine, disk, ctl = disk_engine(tmp_path)
    cfg, d = ctl.decide(engine.plan(ASKED, "blend"), engine.blend_cfg)
    assert cfg.ratios == [FLOOR] and d.ratio == FLOOR and "not measured" in d.reason


def test_fast_tier_keeps_the_floor(tmp_path):
    engine, disk, ctl = disk_engine(tmp_path)
    disk.meter.rate, ctl.compute.rate = 1e12, 1e4
    cfg, d = ctl.decide(engine.plan(ASKED, "blend"), engine.blend_cfg)
    assert cfg.ratios == [FLOOR] and d.ratio == FLOOR and d.dropped == 0 and d.load_s < d.compute_s


def test_play_streams_reads_back_to_back_and_each_pass_waits_for_its_layer():
    w = Work(blend_reads=[], compact=False, probe_layers=3, probe_rows=1, blend_rows=[2, 2, 2])
    # Layers arrive at 1, 2, 3 s; the probe's layers (0.1 s) each wait for theirs, the blend pass
    # (0.2 s a layer) finds every layer read.
    assert play(w, LayerReads(full=1.0), pair_s=0.1) == pytest.approx((3.7, 2.8, 2.8))
    # A blend pass that reads its own layers (no probe) waits only where reading is slower.
    w = Work(blend_reads=[1, 2], compact=False, probe_layers=0, probe_rows=0, blend_rows=[30, 3, 3])
    assert play(w, LayerReads(full=2.0), pair_s=0.1) == pytest.approx((4.3, 0.7, 0.0))


def test_play_a_compact_probe_reads_copies_first_and_the_blend_pass_reads_in_full_behind_it():
    w = Work(blend_reads=[0, 1, 2], compact=True, probe_layers=3, probe_rows=1, blend_rows=[10, 10, 10])
    # Copies arrive at 0.25, 0.5, 0.75 s: the probe (0.1 s a layer) waits 0.25 + 0.15 + 0.15 s and
    # ends at 0.85 s. Full layers arrive at 1.75, 2.75, 3.75 s: the blend pass (1 s a layer) waits
    # 0.9 s for the first, then finds each read as it finishes the layer before.
    assert play(w, LayerReads(full=1.0, compact=0.25, rest=1.0), pair_s=0.1) == pytest.approx((4.75, 1.45, 0.55))
    # Decoding a layer's copies (0.05 s) lengthens each probe layer: it ends at 0.9 s, and the
    # blend pass waits 0.85 s for the first full layer instead of 0.9 s.
    reads = LayerReads(full=1.0, compact=0.25, rest=1.0, decode=0.05)
    assert play(w, reads, pair_s=0.1) == pytest.approx((4.75, 1.3, 0.45))


def test_slow_tier_raises_the_ratio_while_the_extra_rows_fill_waits_for_reads(tmp_path):
    """No probe: the blend pass reads each layer from its check layer on, and recomputing more
    rows costs nothing while a layer's read takes longer than its compute."""
    engine, disk, ctl, plan = slow_disk(tmp_path, weight_by_attention=False)
    _, reused = counts(plan)
    cfg, d = ctl.decide(plan, engine.blend_cfg)
    assert d.dropped == 0 and 0.3 < d.ratio < 1.0 and cfg.ratios == [d.ratio]
    L, pair_s = engine.runner.n_layers, 1 / ctl.compute.rate
    reads = LayerReads(full=d.load_s)
    floor_s = play(work(plan, engine.blend_cfg, FLOOR, L), reads, pair_s)[0]
    assert d.ttft_s <= floor_s + d.load_s  # the raise costs at most one layer's read
    assert play(work(plan, engine.blend_cfg, d.ratio + 0.05, L), reads, pair_s)[0] > floor_s + d.load_s
    _, out = engine.prefill(ASKED, "blend", blend_cfg=cfg)
    assert len(out.stats.selected_positions) == round(d.ratio * reused)
    # The decision pins the output: the same ratio set by hand gives the same logits, bit for bit.
    pinned, _, _ = disk_engine(tmp_path / "pinned", weight_by_attention=False, recompute_ratios=[d.ratio])
    assert torch.equal(pinned.prefill(ASKED, "blend")[1].logits, out.logits)


def test_a_full_depth_probe_waits_for_every_read_and_recompute_cannot_hide_it(tmp_path):
    """The probe needs every layer's stored KV before the blend pass begins: more recompute in
    the blend pass would only add to the wait, so the ratio stays near the floor and the decision
    says why."""
    engine, disk, ctl, plan = slow_disk(tmp_path, compact_probe=False)
    _, reused = counts(plan)
    cfg, d = ctl.decide(plan, engine.blend_cfg)
    L, pair_s = engine.runner.n_layers, 1 / ctl.compute.rate
    assert "probe-bound" in d.reason and d.dropped == 0 and d.wait_s > (L - 1) * 0.5 * d.load_s
    assert (d.ratio - FLOOR) * reused * L * pair_s <= d.load_s * 1.01  # no more than one layer's read


def test_a_compact_probe_reads_a_fraction_of_the_bytes_so_the_same_tier_is_not_probe_bound(tmp_path):
    """The same tier and compute as above, with compact copies: the probe's reads are short and
    the full reads stream in behind it, so the expected wait falls well below a probe's over full KV."""
    estimates = {}
    for compact in (False, True):
        engine, disk, ctl, plan = slow_disk(tmp_path / str(compact), compact_probe=compact)
        estimates[compact] = ctl.decide(plan, engine.blend_cfg)[1]
    assert all(c.kv is None or c.kv.has_probe_copy for c in plan.chunks)
    assert "probe-bound" in estimates[False].reason and "probe-bound" not in estimates[True].reason
    assert estimates[True].wait_s < 0.5 * estimates[False].wait_s
    assert estimates[True].ttft_s < estimates[False].ttft_s


def test_the_probe_reads_the_copies_only_where_a_full_probe_would_wait_for_reads(tmp_path):
    """A fast tier: the probe waits for nothing, so the copies would only add decoding. A tier
    whose layer read takes about what a blend-pass layer computes: the probe over the full KV
    would wait for every read, the copies let the reads overlap the blend pass."""
    engine, disk, ctl = disk_engine(tmp_path, compact_probe=True)
    plan = engine.plan(ASKED, "blend")
    must, reused = counts(plan)
    ctl.compute.rate = 1e4
    decisions = {}
    for name, rate in (("fast", 1e12), ("slow", layer_bytes(plan) * ctl.compute.rate / (must + 0.6 * reused))):
        disk.meter.rate = rate
        cfg, decisions[name] = ctl.decide(engine.plan(ASKED, "blend"), engine.blend_cfg)
        assert cfg.compact_probe == decisions[name].compact
    assert not decisions["fast"].compact and decisions["slow"].compact
    # Stored without copies there is nothing to choose: the probe reads the full KV.
    plain, plain_disk, plain_ctl = disk_engine(tmp_path / "plain")
    plain_disk.meter.rate, plain_ctl.compute.rate = 1e5, 1e4
    cfg, d = plain_ctl.decide(plain.plan(ASKED, "blend"), replace(plain.blend_cfg, compact_probe=True))
    assert not d.compact and not cfg.compact_probe


def test_the_copies_are_read_only_while_decoding_them_costs_less_than_the_waits_they_save(tmp_path):
    """Before any request decoded copies their cost is unknown and counted as none: the first
    request they would help reads them, and its decoding rate is measured. Measured slower than
    the waits they save, they are left unread."""
    engine, disk, _ = disk_engine(tmp_path, compact_probe=True, loading_controller=True)
    ctl, plan = engine.controller, engine.plan(ASKED, "blend")
    must, reused = counts(plan)

    def slow():
        ctl.compute.rate = 1e4
        disk.meter.rate = layer_bytes(plan) * ctl.compute.rate / (must + 0.6 * reused)

    slow()
    assert ctl.copies.rate is None and ctl.decide(engine.plan(ASKED, "blend"), engine.blend_cfg)[1].compact
    slow()
    ran, out = engine.prefill(ASKED, "blend")  # it may also recompute a chunk instead of reading it
    read, d = ran.read_chunks(), out.stats.controller
    assert d["compact"] and d["copies_gain"] >= ctl.COPIES_MARGIN and out.stats.compact_chunks == len(read) > 0
    copy_bytes = sum(c.kv.meta.probe_layer_nbytes for c in read) * engine.runner.n_layers
    assert out.stats.copy_bytes == copy_bytes and ctl.copies.rate == pytest.approx(copy_bytes / out.stats.copy_s)
    slow()
    ctl.copies.rate = copy_bytes  # a second to decode a prompt's copies: far more than the waits they save
    cfg, d = ctl.decide(engine.plan(ASKED, "blend"), engine.blend_cfg)
    assert not d.compact and not cfg.compact_probe and d.copies_gain < 0 and "probe-bound" in d.reason


def test_with_no_core_to_spare_the_copies_are_charged_the_reader_cpu_they_put_beside_compute(tmp_path):
    """Where the prefill's threads take every core, reading the copies moves the reader's work
    (the copies, then the full KV under the blend pass) from the probe's waits to beside compute:
    the copies are charged its measured CPU. Dear enough, they are left unread; with a core to
    spare the same reads cost nothing."""
    engine, disk, ctl, plan = slow_disk(tmp_path, compact_probe=True)
    ctl.reader.rate = layer_bytes(plan)  # a CPU-second for each layer of the stored KV
    decisions = {}
    for spare in (True, False):
        ctl.spare_core = spare
        cfg, decisions[spare] = ctl.decide(engine.plan(ASKED, "blend"), engine.blend_cfg)
        assert cfg.compact_probe == decisions[spare].compact
    assert decisions[True].compact and decisions[True].copies_cpu_s == 0
    charged = decisions[False]
    assert not charged.compact and charged.copies_gain < 0 and "probe-bound" in charged.reason
    copies = sum(c.kv.meta.probe_layer_nbytes + c.kv.meta.layer_nbytes for c in plan.read_chunks())
    assert charged.copies_cpu_s == pytest.approx(engine.runner.n_layers * copies / ctl.reader.rate)


def test_the_reader_measures_its_cpu_for_the_bytes_it_takes(tmp_path):
    """What the charge above is made of: every stored byte the reading thread took, and the CPU
    it spent reading, checking and writing them, measured in each prefill."""
    engine, _, _ = disk_engine(tmp_path, loading_controller=True, compact_probe=False)
    ran, out = engine.prefill(ASKED, "blend")
    assert out.stats.read_bytes == engine.runner.n_layers * layer_bytes(ran) > 0 and out.stats.read_cpu_s > 0
    assert engine.controller.reader.rate == pytest.approx(out.stats.read_bytes / out.stats.read_cpu_s)


def test_tier_slower_than_recompute_is_not_read(tmp_path):
    engine, disk, ctl = disk_engine(tmp_path)
    plan = engine.plan(ASKED, "blend")
    disk.meter.rate, ctl.compute.rate = 1.0, 1e6  # reading one byte a second: never worth it
    cfg, d = ctl.decide(plan, engine.blend_cfg)
    assert d.dropped == 4 and d.ratio == FLOOR and all(c.kv is None for c in plan.chunks)
    assert [c.tier for c in plan.chunks] == ["disk: recomputed"] * 4
    # Found in the store, recomputed by choice: hits, never stored again as misses.
    assert plan.hits == 4 and plan.misses == []


def test_a_dropped_tier_is_read_again_now_and_then_to_remeasure_it(tmp_path):
    engine, disk, ctl = disk_engine(tmp_path)
    disk.meter.rate, ctl.compute.rate = 1.0, 1e6
    dropped = [ctl.decide(engine.plan(ASKED, "blend"), engine.blend_cfg)[1].dropped
               for _ in range(2 * ctl.REMEASURE_EVERY)]
    assert dropped.count(0) == 2 and dropped[ctl.REMEASURE_EVERY - 1] == 0 and set(dropped) == {0, 4}


def test_throttled_tier_is_worked_around_and_the_decision_is_in_the_metrics(tmp_path):
    engine = stored_engine("disk", tmp_path, loading_controller=True)
    # ~0.2 s a layer, about ten times its recompute, so reading loses even where shared cores make
    # compute measure slower (at ~0.05 s a layer, the suite's other workers once made it keep reading).
    engine.store.tiers[0] = Throttled(engine.store.tiers[0], bytes_per_s=10_000)
    params = SamplingParams(max_tokens=1)
    first = generate(engine, ASKED, params, store=False).metrics  # measures the tier and compute
    assert first.chunk_tiers == ["disk"] * 4 and "not measured" in first.controller["reason"]
    second = generate(engine, ASKED, params, store=False).metrics
    d = second.controller
    assert "loading-bound" in d["reason"] and d["floor"] == FLOOR
    assert d["dropped"] > 0 or d["ratio"] > FLOOR
    assert d["ratio"] >= FLOOR
    # Chunks it chose to recompute were found all the same: hits in the request's metrics.
    assert (second.chunk_hits, second.chunk_misses) == (4, 0), second.chunk_tiers


def test_memory_only_controller_never_changes_the_ratio():
    engine = make_engine(loading_controller=True)
    engine.precompute(STORED)
    for _ in range(3):
        m = generate(engine, ASKED, SamplingParams(max_tokens=1)).metrics
        assert m.chunk_tiers == ["memory"] * 4 and m.controller["ratio"] == FLOOR


def test_reads_come_from_the_fastest_tier(tmp_path, redis_server):
    engine = make_engine(disk=tmp_path, redis_url=redis_server.url, memory=False, loading_controller=True)
    engine.precompute(STORED)
    engine.store.flush()
    engine.store.tiers[0] = Throttled(engine.store.tiers[0], bytes_per_s=50_000)  # disk, slow
    tiers = [generate(engine, ASKED, SamplingParams(max_tokens=1), store=False).metrics.chunk_tiers[0]
             for _ in range(3)]
    # Disk measured slow, Redis measured, then Redis: read, or (its rate measured on a loaded
    # machine) recomputed rather than read, "redis: recomputed".
    assert [t.split(":")[0] for t in tiers] == ["disk", "redis", "redis"], tiers


def test_controller_on_by_default_and_a_fast_tier_gives_what_it_gives_off(tmp_path):
    """On by default, with the copies stored: where reads hide behind compute it reads in full at
    the floor ratio, so the output is the controller-off engine's, bit for bit."""
    assert Settings().loading_controller and Settings().compact_probe == "auto"
    engine = stored_engine("disk", tmp_path / "on", loading_controller=True, compact_probe="auto")
    off = stored_engine("disk", tmp_path / "off", loading_controller=False, compact_probe=False)
    assert engine.controller is not None and engine.store.pick_by_bandwidth and engine.blend_cfg.compact_probe
    _, ref = off.prefill(ASKED, "blend")
    for _ in range(2):
        engine.store.tier("disk").meter.rate, engine.controller.compute.rate = 1e12, 1e4
        _, out = engine.prefill(ASKED, "blend")
        d = out.stats.controller
        assert d["ratio"] == FLOOR and not d["compact"] and d["reason"].startswith("compute-bound")
        assert out.stats.compact_chunks == 0
        same_output(out, ref)


def test_waits_under_a_twentieth_of_the_prefill_change_nothing(tmp_path, monkeypatch):
    """A tier slow enough for the extra rows to fill some waits: the controller raises the ratio
    only where the plain schedule's expected wait passes ACT_WAIT of its prefill."""
    engine, disk, ctl, plan = slow_disk(tmp_path, weight_by_attention=False)
    _, d = ctl.decide(plan, engine.blend_cfg)
    assert d.ratio > FLOOR
    monkeypatch.setattr(LoadingController, "ACT_WAIT", 1.0)
    cfg, d = ctl.decide(engine.plan(ASKED, "blend"), engine.blend_cfg)
    assert d.ratio == FLOOR and cfg.ratios == [FLOOR] and not cfg.compact_probe and "compute-bound" in d.reason


def test_exact_output_once_decided(tmp_path):
    """What the controller decides is all that changes: the same decision gives the same KV."""
    engine, disk, ctl = disk_engine(tmp_path)
    disk.meter.rate, ctl.compute.rate = 1.0, 1e6
    plan = engine.plan(ASKED, "blend")
    ctl.decide(plan, engine.blend_cfg)
    from kvblend.blend.fusor import prefill

    dropped = prefill(engine.runner, plan, "blend", engine.blend_cfg)
    for c in engine.plan(ASKED, "blend").chunks:
        engine.store.tier("disk").delete(c.key)
    _, unstored = engine.prefill(ASKED, "blend")
    assert torch.equal(dropped.logits, unstored.logits)
