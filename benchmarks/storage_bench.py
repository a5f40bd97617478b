"""TTFT and quality of `blend` with chunk KV read from each storage tier (memory, disk, Redis, a Redis
Cluster, and a disk throttled to set bandwidths): at default settings (every layer read ahead from the moment
the request is planned, the loading controller, the compact copies stored for the probe to read
where the controller chooses), with the controller off (the probe over the full KV), with the
probe always reading the compact copies, and with the former read-ahead (two layers ahead). One
run, the same prompts for every configuration, interleaved per prompt in an order shuffled per
prompt and round (--repeats), so that load on the machine and a run's place in the sequence fall
on all alike.

Each prompt's chunks are precomputed once (untimed) and copied into every tier; disk reads are
cold (the entry files' pages are dropped from the page cache with posix_fadvise before each
request); Redis is a redis-server on loopback that this script starts, the cluster three masters
with a replica each on loopback (benchmarks/local_servers.py), started by the script too. Quality is scored as
`kvblend eval` does: full prefill's greedy answer teacher-forced into each configuration's KV,
KL divergence and top-1 agreement over its first 16 positions.

    python benchmarks/storage_bench.py --data ../shared/data/musique_s.dev.json --limit 8

It writes a JSON file (--out), prints a table and draws TTFT against tier bandwidth (--plot).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis
import torch
from tqdm import tqdm

from kvblend.config import Settings, load_settings
from kvblend.engine.engine import Engine
from kvblend.eval.datasets import RagRecord, load_dataset
from kvblend.eval.harness import REFERENCE_CAPACITY, full_reference, prompt_ids, teacher_forced
from kvblend.eval.metrics import kl_divergence
from kvblend.model.loader import load_model
from kvblend.store.throttle import Throttled
from local_servers import redis_cluster  # this script's folder is on sys.path (a test registers it)

FORMER_DEPTH = 2  # the read-ahead every layer replaced as the default


@contextmanager
def redis_and_scratch(prefix: str):
    """A redis-server on a free loopback port and a scratch folder for one run: (url, folder).
    Both are gone afterwards, however the run ends."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        for _ in range(200):
            try:
                redis.Redis(port=port).ping()
                break
            except redis.ConnectionError:
                time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}", tmp
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def save_json(path: str, payload: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {out}")


def drop_page_cache(directory: Path) -> None:
    for p in directory.glob("*.safetensors"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def engine_key(c: "Config") -> tuple:
    return c.tier, c.mb_s, c.schedule


# How each schedule sets the engine: the defaults (the loading controller, which reads the
# compact copies and raises the ratio only where reads would make the prefill wait), the
# controller off (the probe over the full KV), and the probe always reading the copies.
SCHEDULES = {"default": dict(loading_controller=True, compact_probe="auto"),
             "off": dict(loading_controller=False, compact_probe=False),
             "compact": dict(loading_controller=False, compact_probe=True)}


@dataclass
class Config:
    label: str
    tier: str  # memory, disk, redis or throttled
    mb_s: float | None = None  # a throttled disk's bandwidth
    schedule: str = "default"  # a SCHEDULES key
    former: bool = False  # two layers read ahead (with the controller off) instead of every layer

    @property
    def compact(self) -> bool:  # the probe may read the stored copies
        return self.schedule != "off"


TIERS = ("memory", "disk", "redis", "cluster")


def configs_for(bandwidths: list[float], former: bool | set[str] = True, off: bool | set[str] = True,
                plain: bool | set[str] = True, compact: bool | set[str] = True) -> list[Config]:
    """Every tier, then the throttled disks; `plain` (default settings), `off` (the loading
    controller off: the probe reads the full KV), `compact` (the controller off, the probe always
    reading the compact copies) and `former` run at every tier (True) or at the ones named
    ("memory", "disk", "redis", "cluster", or a bandwidth such as "100"). Memory, the yardstick, always
    runs at default settings (its probe reads the full KV it holds)."""
    def at(which, name: str) -> bool:
        return which if isinstance(which, bool) else name in which

    out = []
    for tier in TIERS:
        if tier == "memory" or at(plain, tier):
            out.append(Config(tier, tier))
        if tier != "memory" and at(off, tier):
            out.append(Config(f"{tier}, controller off", tier, schedule="off"))
        if tier != "memory" and at(compact, tier):
            out.append(Config(f"{tier}, compact probe", tier, schedule="compact"))
        if at(former, tier):
            out.append(Config(f"{tier}, {FORMER_DEPTH} layers ahead", tier, schedule="off", former=True))
    for mb in bandwidths:
        if at(plain, f"{mb:g}"):
            out.append(Config(f"disk at {mb:g} MB/s", "throttled", mb))
        if at(off, f"{mb:g}"):
            out.append(Config(f"disk at {mb:g} MB/s, controller off", "throttled", mb, schedule="off"))
        if at(compact, f"{mb:g}"):
            out.append(Config(f"disk at {mb:g} MB/s, compact probe", "throttled", mb, schedule="compact"))
        if at(former, f"{mb:g}"):
            out.append(Config(f"disk at {mb:g} MB/s, {FORMER_DEPTH} layers ahead", "throttled", mb, schedule="off",
                              former=True))
    return out


@contextmanager
def cluster_for(configs: list[Config], url: str | None):
    """The cluster's URL where a configuration reads from one: `url`, or a local one started now."""
    if url or not any(c.tier == "cluster" for c in configs):
        yield url
    else:
        with redis_cluster() as started:
            yield started


def run(model, records: list[RagRecord], base: Settings, configs: list[Config], out: str, plot: str | None,
        quality: bool = True, sep_ids: list[int] | None = None, progress: bool = True, repeats: int = 1,
        cluster_url: str | None = None) -> dict:
    with redis_and_scratch("kvblend-bench-") as (url, tmp), cluster_for(configs, cluster_url) as cluster:
        def engine(**update) -> Engine:
            return Engine(model, base.model_copy(update=update), sep_ids=sep_ids)

        mem = engine(**SCHEDULES["default"])
        engines = {}
        for c in configs:  # the disk and Redis engines share one store each, throttled ones another
            if c.tier != "memory" and engine_key(c) not in engines:
                where = {"disk": dict(local_disk=str(tmp / "disk")), "redis": dict(remote_url=url),
                         "cluster": dict(remote_url=cluster)}
                e = engine(local_cpu=False, **where.get(c.tier, dict(local_disk=str(tmp / "slow"))),
                           **SCHEDULES[c.schedule])
                if c.tier == "throttled":
                    e.store.tiers[0] = Throttled(e.store.tiers[0], c.mb_s * 1e6)
                engines[engine_key(c)] = e
        engines["memory"] = mem

        def engine_of(c: Config) -> Engine:
            return engines[engine_key(c)] if c.tier != "memory" else mem

        copies = list({str(getattr(e.store.tiers[0], "root", "")) + str(getattr(e.store.tiers[0], "url", "")): e
                       for e in engines.values() if e is not mem}.values())
        runs: dict[str, list[dict]] = {c.label: [] for c in configs}
        tokens, stored_bytes, warm = [], [], set()
        for i, record in enumerate(tqdm(records, desc="prompts", disable=not progress)):
            ids = prompt_ids(mem, record)
            if quality:
                _, answer, ref = full_reference(mem, ids)  # precomputes the chunks too
            else:
                mem.precompute(ids)
            entries = {k: mem.store.tiers[0].get(k) for k in mem.store.tiers[0].keys()}
            for key, kv in entries.items():  # stored with the probe's copies where a configuration may read them
                kv.probe_copy = key.startswith("chunk-") and any(c.compact for c in configs)
            for e in copies:  # the throttled engines share one directory
                for key, kv in entries.items():
                    e.store.tiers[0].put(key, kv)
            tokens.append(len(ids))
            plan = mem.plan(ids, "blend")
            stored_bytes.append(sum(c.kv.nbytes for c in plan.chunks if c.kv is not None)
                                / max(1, sum(c.span[1] - c.span[0] for c in plan.chunks if c.kv is not None)))
            # A new order for each prompt and round (seeded: the run repeats): a configuration's
            # place in the sequence (right after memory's run, say) then falls on every one alike.
            for rep, c in [(rep, c) for rep in range(repeats)
                           for c in random.Random(i + 1000 * rep).sample(configs, len(configs))]:
                e = engine_of(c)
                e.prefetch_depth = FORMER_DEPTH if c.former else e.runner.n_layers
                if i == 0 and id(e) not in warm:  # one-time costs, and the controller's first measurements
                    e.prefill(ids, "blend", REFERENCE_CAPACITY)
                    warm.add(id(e))
                for d in (tmp / "disk", tmp / "slow"):
                    drop_page_cache(d)
                t0 = time.perf_counter()
                _, o = e.prefill(ids, "blend", REFERENCE_CAPACITY)
                int(o.logits.argmax())
                row = {"prompt": i, "round": rep, "ttft_s": time.perf_counter() - t0,
                       "load_wait_s": o.stats.load_wait_s,
                       "tiers": sorted(set(o.stats.chunk_tiers)), "recomputed": o.stats.recomputed_tokens,
                       "compute_frac": o.stats.compute_frac, "controller": o.stats.controller,
                       "compact_chunks": o.stats.compact_chunks}
                if quality:
                    logits = teacher_forced(e, o, len(ids), answer, ref.shape[0])
                    row["kl_answer"] = float(kl_divergence(ref, logits).mean())
                    row["top1_agree"] = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
                runs[c.label].append(row)
            for e in engines.values():
                for key in entries:
                    e.store.tiers[0].delete(key)
            # What is measured so far, in case the run is cut short (the full file replaces it).
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps({"partial": True, "prompts_done": i + 1, "runs": runs}, indent=1))
        measured = {}
        for c in configs:
            if c.tier in ("disk", "redis", "cluster"):
                measured.setdefault(c.tier, engine_of(c).store.tiers[0].meter.rate)
        for e in engines.values():
            e.close()

    ref_ttft = statistics.mean(r["ttft_s"] for r in runs["memory"])
    # Each run over memory's run of the same prompt in the same round (minutes apart at most):
    # their median is what a typical request pays, and a burst of load on the shared machine
    # moves it less than it moves the means.
    mem_run = {(r["prompt"], r["round"]): r["ttft_s"] for r in runs["memory"]}
    rows = []
    for c in configs:
        rs = runs[c.label]
        ttft = statistics.mean(r["ttft_s"] for r in rs)
        row = {"config": c.label, "tier": c.tier, "mb_s": c.mb_s, "former": c.former, "schedule": c.schedule,
               "ttft_ms": 1000 * ttft, "vs_memory": ttft / ref_ttft,
               "vs_memory_paired": statistics.median(r["ttft_s"] / mem_run[r["prompt"], r["round"]] for r in rs),
               "load_wait_ms": 1000 * statistics.mean(r["load_wait_s"] for r in rs),
               "recomputed": statistics.mean(r["recomputed"] for r in rs),
               "compact_chunks": statistics.mean(r["compact_chunks"] for r in rs),
               "tiers": sorted({t for r in rs for t in r["tiers"]})}
        if quality:
            row |= {k: statistics.mean(r[k] for r in rs) for k in ("kl_answer", "top1_agree")}
        rows.append(row)
    per_token = statistics.mean(stored_bytes)
    meta = {"model": model.name, "dtype": str(model.dtype), "prompts": len(records),
            "mean_tokens": statistics.mean(tokens), "ratio": base.recompute_ratios,
            "stored_bytes_per_token": per_token, "measured_mb_s": {k: v and v / 1e6 for k, v in measured.items()},
            "cpu_count": os.cpu_count(), "omp_threads": torch.get_num_threads(), "load_avg": os.getloadavg()}
    print(f"\n{meta['prompts']} prompts, {meta['mean_tokens']:.0f} tokens on average, {meta['dtype']}, "
          f"{per_token / 1e3:.1f} kB stored per chunk token, {meta['omp_threads']} threads, "
          f"load average {meta['load_avg'][0]:.1f}")
    print("| chunks from | TTFT ms | vs memory | median run / memory's | waited on loads ms | recomputed rows | "
          "kl_answer | top1_agree |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        q = f"{r['kl_answer']:.4f} | {r['top1_agree']:.3f}" if quality else "- | -"
        print(f"| {r['config']} | {r['ttft_ms']:.0f} | {r['vs_memory']:.2f} | {r['vs_memory_paired']:.2f} | "
              f"{r['load_wait_ms']:.0f} | {r['recomputed']:.0f} | {q} |")
    payload = {"meta": meta, "rows": rows, "runs": runs}
    save_json(out, payload)
    if plot:
        draw(payload, plot)
    return payload


def draw(payload: dict, path: str) -> None:
    """TTFT over memory's against the tier's read bandwidth: the throttled disks at their set
    bandwidth, one line per schedule, and disk and Redis at the bandwidth they measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    series = [("default settings", dict(former=False, schedule="default"), "o-"),
              ("controller off", dict(former=False, schedule="off"), "s--"),
              ("compact probe always", dict(former=False, schedule="compact"), "v-."),
              (f"controller off, {FORMER_DEPTH} layers ahead", dict(former=True), "^:")]
    for name, match, style in series:
        pts = sorted((r["mb_s"], r["vs_memory"]) for r in rows
                     if r["tier"] == "throttled" and all(r[k] == v for k, v in match.items()))
        if pts:
            ax.plot(*zip(*pts), style, label=f"throttled disk, {name}")
    for tier, marker in (("disk", "D"), ("redis", "P"), ("cluster", "X")):
        mb = payload["meta"]["measured_mb_s"].get(tier)
        r = next((r for r in rows if r["config"] == tier), None)
        if mb and r:
            ax.plot([mb], [r["vs_memory"]], marker, markersize=9, label=f"{tier} (measured {mb:.0f} MB/s)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(1.15, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("tier read bandwidth, MB/s")
    ax.set_ylabel("TTFT / TTFT from memory")
    m = payload["meta"]
    ax.set_title(f"{m['model']}, {m['dtype'].removeprefix('torch.')}, {m['prompts']} prompts, "
                 f"{m['mean_tokens']:.0f} tokens", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="../shared/data/musique_s.dev.json")
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--bandwidths", default="1000,300,100", help="throttled disk bandwidths, MB/s, comma-separated")
    ap.add_argument("--plain-at", default="all", help="tiers and bandwidths to run at default settings: "
                    "all, none, or comma-separated (memory always runs)")
    ap.add_argument("--former-at", default="all", help=f"where to run the {FORMER_DEPTH}-layers-ahead schedule too: "
                    "all, none, or tiers and bandwidths, comma-separated (memory,100)")
    ap.add_argument("--compact-at", default="all", help="where to run with the probe always reading the entries' "
                    "compact copies (compact_probe true, the controller off) too: all, none, or tiers and bandwidths, "
                    "comma-separated")
    ap.add_argument("--off-at", default="all", help="where to run with the loading controller off (the probe over "
                    "the full KV, the former default) too: all, none, or tiers and bandwidths, comma-separated")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each configuration on each prompt, in a new "
                    "shuffled order each round; TTFT is their mean, and each run is also set against memory's run of "
                    "the same prompt and round (the median of those ratios)")
    ap.add_argument("--cluster-url", help="a Redis Cluster to read the cluster rows from (redis+cluster://host:port; "
                    "it is written to and its kvblend: keys deleted); default: a local one started for the run")
    ap.add_argument("--no-quality", action="store_true", help="leave out full prefill and the quality columns")
    ap.add_argument("--out", default="results/storage_bench.json")
    ap.add_argument("--plot", default="results/storage_bench.png")
    args = ap.parse_args(argv)

    base = load_settings(dtype=args.dtype)
    model = load_model(base.model, base.dtype, base.device, base.weights)
    records = load_dataset(args.data, limit=args.offset + args.limit)[args.offset:]
    def which(arg: str) -> bool | set[str]:
        return {"all": True, "none": False}.get(arg, set(arg.split(",")))

    configs = configs_for([float(b) for b in args.bandwidths.split(",") if b], which(args.former_at),
                          which(args.off_at), which(args.plain_at), which(args.compact_at))
    run(model, records, base, configs, args.out, args.plot, quality=not args.no_quality, repeats=args.repeats,
        cluster_url=args.cluster_url)


if __name__ == "__main__":
    main()
