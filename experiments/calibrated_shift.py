"""Is the stale keys' shift the same for every chunk, so that one vector per layer, measured once
per model on calibration records, could stand for it?

Calibration (--calib-offset/--calib-limit of the same file): per layer and KV head, the mean over
every reused row of full prefill's keys minus the stored ones, rotated back to position 0; printed
with how much of each chunk's own mean shift it explains (1 - |chunk - global|^2 / |chunk|^2).
Then, on the scored records, teacher-forced against full's greedy answer:
- `blend r`: the engine as it is;
- `blend r, calibrated x s`: its stale rows, at the layers after the check, shifted by s times the
  calibrated vector;
- `blend r, oracle`: shifted by each chunk's own mean (from full prefill; an upper bound).

    python experiments/calibrated_shift.py --model qwen2.5-coder-0.5b-instruct \\
        --data ../shared/data/hotpotqa_s.dev.json --calib-offset 50 --calib-limit 20 --offset 36 --limit 12
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from kvblend.eval.datasets import load_dataset
from kvblend.eval.harness import prompt_ids

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exact_selected import print_scores  # noqa: E402
from key_drift import mean_shift, reused_rows, scored_record, shift_keys  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # dev_records
from dev_records import add_record_flags, open_records  # noqa: E402


@torch.inference_mode()
def calibrate(engine, records) -> torch.Tensor:
    """The mean unrotated key shift [L, Hkv, d] over every reused row of `records`."""
    runner, L = engine.runner, engine.runner.n_layers
    total, n, per_chunk = None, 0, []
    for record in tqdm(records, desc="calibration"):
        ids = prompt_ids(engine, record)
        engine.precompute(ids)
        _, full = engine.prefill(ids, "full", 0)
        _, reuse = engine.prefill(ids, "reuse", 0)
        segs = engine.segments(ids)
        reused = reused_rows(ids, segs, reuse)
        for span in segs.chunks:
            rows = torch.arange(*span)[reused[span[0]:span[1]]]
            if rows.numel() == 0:
                continue
            shift = torch.stack([mean_shift(runner, la, full.cache.k, reuse.cache.k, rows) for la in range(L)])
            total = shift * rows.numel() if total is None else total + shift * rows.numel()
            n += rows.numel()
            per_chunk.append(shift)
    g = total / n
    chunks = torch.stack(per_chunk)  # [C, L, H, d]
    explained = 1 - ((chunks - g) ** 2).sum(-1) / (chunks ** 2).sum(-1).clamp(min=1e-9)  # [C, L, H]
    print("layer | |global shift| | mean |chunk shift| | share of a chunk's shift explained (median)")
    for la in range(L):
        print(f"{la:5d} | {g[la].norm(dim=-1).mean():.3f} | {chunks[:, la].norm(dim=-1).mean():.3f} "
              f"| {explained[:, la].median():.3f}")
    return g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_record_flags(ap, limit=12)
    ap.add_argument("--calib-offset", type=int, default=50)
    ap.add_argument("--calib-limit", type=int, default=20)
    ap.add_argument("--ratios", default="0.08")
    ap.add_argument("--scales", default="0.5,1", help="scales on the calibrated shift, comma-separated")
    args = ap.parse_args()
    engine, records = open_records(args)
    runner, L = engine.runner, engine.runner.n_layers
    g = calibrate(engine, load_dataset(args.data, limit=args.calib_limit, offset=args.calib_offset))
    check = min(engine.blend_cfg.check_layers)
    after = range(check + 1, L)
    scores: dict[str, list] = {}
    for record in tqdm(records, desc="records"):
        ids, full, segs, score, prefill = scored_record(engine, record, scores)
        reuse = prefill("reuse")
        reused = reused_rows(ids, segs, reuse)
        score("reuse", reuse.cache)
        for r in [float(x) for x in args.ratios.split(",")]:
            blend = prefill("blend", r)
            score(f"blend {r:g}", blend.cache)
            stale = reused.clone()
            stale[torch.tensor(blend.stats.recomputed_positions, dtype=torch.long)] = False
            for s in [float(x) for x in args.scales.split(",")]:
                c = prefill("blend", r)
                for span in segs.chunks:
                    shift_keys(runner, c.cache, after, span, stale, lambda la, s=s: s * g[la])
                score(f"blend {r:g}, calibrated x{s:g}", c.cache)
            c = prefill("blend", r)
            for span in segs.chunks:
                rows = torch.arange(*span)[stale[span[0]:span[1]]]
                shift_keys(runner, c.cache, after, span, stale,
                           lambda la, rows=rows: mean_shift(runner, la, full.cache.k, c.cache.k, rows))
            score(f"blend {r:g}, oracle", c.cache)
    print_scores(args, engine, len(records), scores)


if __name__ == "__main__":
    main()
