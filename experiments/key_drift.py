"""Is the stale keys' error a shift shared by a chunk's rows, which the recomputed rows could measure?

Per layer, chunk and KV head, the mean difference between full prefill's keys and the stored
ones, taken before the rotation (so one vector stands for every row of the chunk), is added to
the chunk's stale keys. Scored teacher-forced against full's greedy answer (the suffix and the
answer rows computed fresh against each cache):
- `oracle K`: the shift measured on every stale row from full prefill's keys (an upper bound);
- `oracle K+V`: the same for the values too;
- `measured K`: blend's own estimate, from the rows it recomputed in that chunk (their fresh keys
  against their stored ones), at the layers after the check, times each of --shrink;
- `sampled K, n rows`: the oracle's shift taken on only n evenly spaced stale rows of each chunk
  (--sample): what n rows per chunk computed fresh for the purpose could measure.

    python experiments/key_drift.py --model qwen2.5-coder-0.5b-instruct \\
        --data ../shared/data/hotpotqa_s.dev.json --offset 36 --limit 6 --ratios 0.08
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from kvblend.eval.harness import REFERENCE_CAPACITY, full_reference, prompt_ids

from exact_selected import print_scores, score_against

from kvblend.eval.dev_records import add_record_flags, open_records


def evenly_spaced(rows: torch.Tensor, n: int) -> torch.Tensor:
    """`n` evenly spaced entries of `rows`, first and last included (all of them where there are fewer)."""
    if rows.numel() <= n:
        return rows
    return rows[torch.linspace(0, rows.numel() - 1, n, device=rows.device).round().long()]


def unrotated(runner, layer: int, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Keys [Hkv, n, d] at `positions`, rotated back to position 0 (fp32)."""
    return runner.rotaries[runner.layer_rope[layer]].rerotate(k.float(), delta=-positions)


@torch.inference_mode()
def shift_keys(runner, cache, layers, span, stale: torch.Tensor, shift_of, values=None) -> None:
    """Add shift_of(layer) [Hkv, d] (pre-rotation) to the stale rows of `span` at `layers`; with
    `values`, add values(layer) [Hkv, d] to their V too."""
    rows = torch.arange(*span)[stale[span[0]:span[1]]]
    if rows.numel() == 0:
        return
    for layer in layers:
        shift = shift_of(layer)
        if shift is None:
            continue
        rot = runner.rotaries[runner.layer_rope[layer]]
        moved = rot.rerotate(shift[:, None, :].expand(-1, rows.numel(), -1).contiguous(), delta=rows)
        cache.k[layer][:, rows] = (cache.k[layer][:, rows].float() + moved).to(cache.k.dtype)
        if values is not None:
            cache.v[layer][:, rows] = (cache.v[layer][:, rows].float() + values(layer)[:, None, :]).to(cache.v.dtype)


def mean_shift(runner, layer, k_to, k_from, rows):
    if rows.numel() == 0:
        return None
    return (unrotated(runner, layer, k_to[layer][:, rows], rows)
            - unrotated(runner, layer, k_from[layer][:, rows], rows)).mean(dim=1)


def score_oracle_shift(runner, prefill, r: float, segs, stale, full_k, layers, score) -> None:
    """Blend at ratio r with each chunk's stale keys at `layers` shifted by their own mean shift
    from full prefill's keys `full_k` (an upper bound), scored as `blend r, oracle`."""
    c = prefill("blend", r)
    for span in segs.chunks:
        rows = torch.arange(*span)[stale[span[0]:span[1]]]
        shift_keys(runner, c.cache, layers, span, stale,
                   lambda la, rows=rows: mean_shift(runner, la, full_k, c.cache.k, rows))
    score(f"blend {r:g}, oracle", c.cache)


def score_chunk_shifts(runner, prefill, r: float, segs, stale, layers, vectors: dict, label: str, score) -> None:
    """Blend at ratio r with the stale keys of chunk i at `layers` shifted by vectors[i][layer]
    ([L, Hkv, d], before rotation), scored as `label`."""
    c = prefill("blend", r)
    for i, v in vectors.items():
        shift_keys(runner, c.cache, layers, segs.chunks[i], stale, lambda la, v=v: v[la])
    score(label, c.cache)


def cached(path: str | None, compute):
    """compute()'s result, loaded from the .pt file `path` where it exists, else computed and saved
    there (when a path is given): a slow calibration runs once."""
    if path and Path(path).exists():
        return torch.load(path)
    out = compute()
    if path:
        torch.save(out, path)
    return out


def scored_record(engine, record, scores: dict):
    """A record's prompt ids, full prefill, segments, a scorer against full's greedy answer
    (exact_selected.score_against) and prefill(mode, ratio) with room for the answer."""
    ids = prompt_ids(engine, record)
    full, answer, ref = full_reference(engine, ids)
    segs = engine.segments(ids)

    def prefill(mode, r=0.0):
        return engine.prefill(ids, mode, REFERENCE_CAPACITY,
                              blend_cfg=replace(engine.blend_cfg, ratios=[r]) if mode == "blend" else None)[1]

    return ids, full, segs, score_against(engine, ids, answer, ref, segs.suffix[0], scores), prefill


def reused_rows(ids, segs, reuse) -> torch.Tensor:
    """[T] bool: the rows a reuse prefill took from stored chunks (not the prefix cache's)."""
    reused = torch.zeros(len(ids), dtype=torch.bool)
    for span in segs.chunks:
        reused[span[0]:span[1]] = True
    reused[: reuse.stats.prefix_hit_tokens] = False
    return reused


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_record_flags(ap, limit=6)
    ap.add_argument("--ratios", default="0.08")
    ap.add_argument("--shrink", default="1", help="scales on the measured shift, comma-separated")
    ap.add_argument("--sample", default="", help="rows per chunk for the sampled shift, comma-separated")
    args = ap.parse_args()
    engine, records = open_records(args)
    runner, L = engine.runner, engine.runner.n_layers
    ratios = [float(r) for r in args.ratios.split(",")]
    shrinks = [float(x) for x in args.shrink.split(",")]
    samples = [int(n) for n in args.sample.split(",") if n]
    check = min(engine.blend_cfg.check_layers)
    scores: dict[str, list] = {}
    for record in tqdm(records, desc="records"):
        ids, full, segs, score, prefill = scored_record(engine, record, scores)
        fk, fv = full.cache.k, full.cache.v
        reuse = prefill("reuse")
        reused = reused_rows(ids, segs, reuse)
        score("reuse", reuse.cache)
        for with_v in (False, True):
            c = prefill("reuse")
            for span in segs.chunks:
                rows = torch.arange(*span)[reused[span[0]:span[1]]]
                shift_keys(runner, c.cache, range(L), span, reused, lambda la: mean_shift(runner, la, fk, c.cache.k, rows),
                           (lambda la: (fv[la][:, rows].float() - c.cache.v[la][:, rows].float()).mean(1)) if with_v else None)
            score("reuse, oracle K+V" if with_v else "reuse, oracle K", c.cache)
        for r in ratios:
            blend = prefill("blend", r)
            score(f"blend {r:g}", blend.cache)
            stale = reused.clone()
            stale[torch.tensor(blend.stats.recomputed_positions, dtype=torch.long)] = False
            after = range(check + 1, L)
            variants = ([("oracle K", "oracle", 1.0)] + [(f"measured K x{x:g}", "measured", x) for x in shrinks]
                        + [(f"sampled K, {n} rows", "sampled", n) for n in samples])
            for label, kind, arg in variants:
                c = prefill("blend", r)
                for span in segs.chunks:
                    chunk = torch.zeros(len(ids), dtype=torch.bool)
                    chunk[span[0]:span[1]] = True
                    if kind == "measured":  # the chunk's recomputed rows: fresh keys against the stored ones
                        rows = (chunk & reused & ~stale).nonzero().squeeze(1)
                        of = lambda la, rows=rows, x=arg: None if rows.numel() == 0 else x * mean_shift(  # noqa: E731
                            runner, la, c.cache.k, reuse.cache.k, rows)
                    else:
                        rows = (chunk & stale).nonzero().squeeze(1)
                        if kind == "sampled":
                            rows = evenly_spaced(rows, arg)
                        of = lambda la, rows=rows: mean_shift(runner, la, fk, c.cache.k, rows)  # noqa: E731
                    shift_keys(runner, c.cache, after, span, stale, of)
                score(f"blend {r:g}, {label}", c.cache)
    print_scores(args, engine, len(records), scores)


if __name__ == "__main__":
    main()
