"""Merge `kvblend eval` runs of one model and dataset over different record slices into one
results.json (with its report and frontier plot), optionally taking the TTFT speed-ups from
another run.

Quality barely depends on the device (in bf16 an H100 matched a CPU within 0.002 KL), speed does:
a model's quality over many records can be measured on a GPU in minutes, and its speed-ups on
the CPU over a few records (all of them would take hours). --speed-from names that run; its speed-up for each mode and ratio
replaces the merged rows' own, and the meta says where each came from.

    python benchmarks/merge_evals.py gpu/musique-0/results.json gpu/musique-15/results.json \\
        --speed-from cpu/musique/results.json --out results/qwen05-musique-frontier
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvblend.eval.report import write_report

SAME = ("model", "dtype", "dataset", "chunk_context", "stale_key_scale", "check_layers")  # must agree to merge


def merge(runs: list[dict]) -> dict:
    """One results object: rows averaged over the runs weighted by their prompt counts, answers and
    per-prompt lists concatenated in the order given."""
    first = runs[0]["meta"]
    for run in runs[1:]:
        differ = [k for k in SAME if run["meta"].get(k) != first.get(k)]
        if differ:
            raise SystemExit(f"runs differ in {', '.join(differ)}: not one model and dataset")
    keys = [(r["mode"], r["ratio"]) for r in runs[0]["rows"]]
    for run in runs[1:]:
        if [(r["mode"], r["ratio"]) for r in run["rows"]] != keys:
            raise SystemExit("runs have different modes or ratios")
    rows = []
    for i in range(len(keys)):
        parts = [run["rows"][i] for run in runs]
        n = sum(p["n"] for p in parts)
        row = dict(parts[0], n=n)
        for k, v in parts[0].items():
            if isinstance(v, float) and k != "ratio":
                row[k] = sum(p[k] * p["n"] for p in parts) / n
        row.pop("ttft_median_s", None)  # a median does not merge
        rows.append(row)
    for row in rows:  # a ratio of the merged means, not a mean of the runs' ratios
        row["ttft_ratio_vs_full"] = row["ttft_mean_s"] / rows[0]["ttft_mean_s"]
    meta = dict(first, n_prompts=sum(run["meta"]["n_prompts"] for run in runs),
                records=", ".join(str(run["meta"].get("records", "?")) for run in runs),
                mean_prompt_tokens=round(sum(run["meta"]["mean_prompt_tokens"] * run["meta"]["n_prompts"] for run in runs)
                                         / sum(run["meta"]["n_prompts"] for run in runs)))
    out = {"meta": meta, "rows": rows}
    for part in ("answers", "per_prompt"):
        out[part] = {label: [x for run in runs for x in run.get(part, {}).get(label, [])]
                     for label in runs[0].get(part, {})}
    return out


def take_speed(merged: dict, speed: dict) -> None:
    """Each row's TTFT ratio to full from `speed`'s row of the same mode and ratio (None where it
    has none), and a note in the meta of where quality and speed were measured."""
    by_key = {(r["mode"], r["ratio"]): r for r in speed["rows"]}
    for row in merged["rows"]:
        other = by_key.get((row["mode"], row["ratio"]))
        for k in ("ttft_ratio_vs_full", "ttft_mean_s"):
            row[k] = other[k] if other else None
    m, s = merged["meta"], speed["meta"]
    m["quality_measured_on"] = f"{m.get('device')}, {m.get('dtype')}, records {m.get('records')}"
    m["speed_measured_on"] = (f"{s.get('cpu') or s.get('device')}, {s.get('dtype')}, {s.get('threads')} threads, "
                              f"records {s.get('records')}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="results.json of each run, in record order")
    ap.add_argument("--speed-from", help="a results.json whose TTFT speed-ups replace the merged ones")
    ap.add_argument("--out", required=True, help="folder for results.json, report.md and the plots")
    args = ap.parse_args(argv)
    merged = merge([json.loads(Path(p).read_text()) for p in args.runs])
    if args.speed_from:
        take_speed(merged, json.loads(Path(args.speed_from).read_text()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for path in write_report(merged, out).values():
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
