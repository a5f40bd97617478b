"""Where one prefill's time goes, phase by phase, for full, reuse and blend at several ratios.

Phases: chunk loading (copy + re-rotation), the probe pass (its watched rows' attention, which
yields their attention mass too, apart), and in the main pass: q/k/v projections, selection,
attention, the rest of a layer (o_proj, MLP, norms, residuals), logits. Reports TTFT speed-up
over full, compute_frac (computed (layer, row) pairs over full's), efficiency (speed-up x
compute_frac; 1.0 = at the compute bound), work_frac (FLOPs over full's, since late rows read
more keys) with its efficiency, the main pass's attention time per (row, key, head) its calls read,
and names the CPU. Timings are medians over repeats, all modes measured in one run:

    python benchmarks/blend_phases.py --data ../shared/data/musique_s.dev.json --limit 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from kvblend.blend import fusor
from kvblend.config import load_settings
from kvblend.engine.engine import Engine
from kvblend.eval.datasets import load_dataset
from kvblend.eval import machine
from kvblend.eval.harness import prompt_ids
from kvblend.model import runner as runner_mod
from kvblend.model.loader import load_model
from kvblend.eval.flops import work_frac
from kvblend.eval.variants import parse_grid
def cpu_name() -> str:
    return f"{machine.cpu_name()[:-1]}, {torch.get_num_threads()} threads)"


CLOCK = time.perf_counter


class Phases:
    """Wraps the engine's phase functions to add their wall time to the current pass's buckets."""

    def __init__(self):
        self.t = defaultdict(float)
        self.reads = defaultdict(float)  # (query row, key, head) triples each pass's attention read
        self.pass_name = "main"

    @contextmanager
    def timed(self, name: str):
        t0 = CLOCK()
        try:
            yield
        finally:
            self.t[name] += CLOCK() - t0

    def wrap(self, owner, attr: str, name: str, per_pass: bool = True) -> None:
        fn = getattr(owner, attr)

        def wrapped(*a, **kw):
            with self.timed(f"{self.pass_name} {name}" if per_pass else name):
                return fn(*a, **kw)
        setattr(owner, attr, wrapped)

    def install(self) -> None:
        run_layers = fusor.run_layers

        def run_layers_timed(*a, watch=None, **kw):
            self.pass_name = "probe" if watch is not None else "main"
            with self.timed(f"{self.pass_name} pass"):
                return run_layers(*a, watch=watch, **kw)
        fusor.run_layers = run_layers_timed
        # Prefix blocks and chunks load per layer; with pipelining this is the time waited for them.
        self.wrap(fusor.ChunkLoader, "load_layer", "chunk loading", per_pass=False)
        self.wrap(fusor, "attend_with_mass", "attention with mass")
        self.wrap(fusor.Selector, "keep", "selection")
        self.wrap(runner_mod.Runner, "qkv", "qkv")
        self.wrap(runner_mod, "attend", "attention")
        attend = runner_mod.attend

        def attend_counted(q, k, v, groups, scale):
            self.reads[self.pass_name] += q.shape[0] * sum(key_reads(g) for g in groups)
            return attend(q, k, v, groups, scale)
        runner_mod.attend = attend_counted
        self.wrap(runner_mod.Runner, "after_attention", "rest")
        self.wrap(runner_mod.Runner, "logits", "logits", per_pass=False)

    def breakdown(self) -> dict:
        t = dict(self.t)
        out = {"chunk loading": t.pop("chunk loading", 0.0), "logits": t.pop("logits", 0.0)}
        for p in ("probe", "main"):
            parts = {"qkv": "qkv", "attention": "attention", "attention with mass": "attention with mass",
                     "rest of layer": "rest", "selection": "selection"}
            for label, key in parts.items():
                out[f"{p}: {label}"] = t.get(f"{p} {key}", 0.0)
            # what is left: the pass's own glue, and the loads it waited for (also in "chunk loading")
            inner = sum(t.get(f"{p} {key}", 0.0) for key in parts.values())
            out[f"{p}: other"] = max(0.0, t.get(f"{p} pass", 0.0) - inner)
        # The attention kernel's rate: nanoseconds per (row, key, head) it read. Masked rows read
        # every key of their call; the causal kernel skips the upper triangle.
        reads = self.reads.get("main", 0.0)
        out["main: attention ns per row·key·head"] = 1e9 * t.get("main attention", 0.0) / reads if reads else 0.0
        return out


def key_reads(g: runner_mod.QueryGroup) -> float:
    """(row, key) pairs one attention call reads."""
    n = g.rows.stop - g.rows.start
    return n * (n + 1) / 2 if g.causal else n * (g.end - g.start)


def measure(engine: Engine, ids, mode: str, cfg, repeats: int, phases: Phases | None):
    times, stats = [], None
    for _ in range(repeats):
        t0 = CLOCK()
        _, out = engine.prefill(ids, mode, 0, blend_cfg=cfg)
        times.append(CLOCK() - t0)
        stats = out.stats
    return statistics.median(times), stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="../shared/data/musique_s.dev.json")
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--model", default=None, help="model alias or path (default: the default model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--ratios", default="0.08,0.15,0.3")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--variant", action="append", default=[],
                    help='BlendConfig fields for more blend rows at every ratio, e.g. "check_candidates=0" (repeatable)')
    ap.add_argument("--out", default="results/blend_phases.json")
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    settings = load_settings(model=args.model, dtype=args.dtype)
    model = load_model(settings.model, dtype=args.dtype)
    engine = Engine(model, settings)
    records = load_dataset(args.data, limit=args.limit, offset=args.offset)
    variants = [("full", None, ""), ("reuse", None, "")]
    extra = {v: parse_grid(v.split())[0] for v in args.variant}
    variants += [("blend", replace(engine.blend_cfg, ratios=[float(r)], **fields), name)
                 for r in args.ratios.split(",") for name, fields in {"": {}, **extra}.items()]
    label = lambda mode, cfg, name: mode if cfg is None else f"blend {cfg.ratios[0]:g} {name}".strip()  # noqa: E731
    ttft, frac, work = defaultdict(list), defaultdict(list), defaultdict(list)
    for record in records:
        ids = prompt_ids(engine, record)
        engine.precompute(ids)
        measure(engine, ids, "full", None, 1, None)  # warm-up
        for mode, cfg, name in variants:
            t, stats = measure(engine, ids, mode, cfg, args.repeats, None)
            ttft[label(mode, cfg, name)].append(t)
            frac[label(mode, cfg, name)].append(stats.compute_frac)
            work[label(mode, cfg, name)].append(work_frac(engine, len(ids), mode, cfg, stats))
    # One more prefill per variant on the first record, through the phase timers.
    phases = {}
    ids = prompt_ids(engine, records[0])
    timers = Phases()
    timers.install()
    for mode, cfg, name in variants:
        timers.t.clear()
        timers.reads.clear()
        t0 = CLOCK()
        engine.prefill(ids, mode, 0, blend_cfg=cfg)
        phases[label(mode, cfg, name)] = dict(total=CLOCK() - t0, **timers.breakdown())

    full = statistics.mean(ttft["full"])
    rows = []
    for name in ttft:
        speed = full / statistics.mean(ttft[name])
        cf, wf = statistics.mean(frac[name]), statistics.mean(work[name])
        rows.append(dict(variant=name, ttft_s=statistics.mean(ttft[name]), speedup=speed, compute_frac=cf,
                         bound=1 / cf, efficiency=speed * cf, work_frac=wf, work_efficiency=speed * wf))
    cpu = cpu_name()
    mean_tokens = round(statistics.mean(len(prompt_ids(engine, r)) for r in records))
    print(f"\n{cpu}; {model.dtype}; {args.clock} clock; {len(records)} prompts of ~{mean_tokens} tokens from {args.data}")
    print("| variant | TTFT s | speed-up vs full | compute_frac | bound | efficiency | work_frac (FLOPs) | "
          "work efficiency |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['variant']} | {r['ttft_s']:.3f} | {r['speedup']:.2f}x | {r['compute_frac']:.3f} | "
              f"{r['bound']:.1f}x | {r['efficiency']:.2f} | {r['work_frac']:.3f} | {r['work_efficiency']:.2f} |")
    names = list(phases)
    print(f"\nPhases of one prefill (first prompt), seconds:\n| phase | {' | '.join(names)} |\n|{' --- |' * (len(names) + 1)}")
    for key in phases[names[0]]:
        if any(phases[n][key] > 0.0005 for n in names):
            print(f"| {key} | " + " | ".join(f"{phases[n][key]:.3f}" for n in names) + " |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(cpu=cpu, dtype=str(model.dtype), clock=args.clock, data=args.data, offset=args.offset,
                                              n=len(records), mean_tokens=mean_tokens, rows=rows, phases=phases),
                                         indent=2))


if __name__ == "__main__":
    main()
