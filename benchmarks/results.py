"""Render docs/results.md's tables and docs/img/*.png from what `make results` measured.

Reads, under --results (default results/):
- eval/<name>/results.json: `kvblend eval` runs (the held-out table, the frontier plot, TTFT points);
- phases/<name>.json: `benchmarks/blend_phases.py` runs (where blend's time goes, TTFT points);
- prefill_bench.json: `benchmarks/prefill_bench.py` (full prefill against prompt length).

Writes the tables between the marker comments of docs/results.md (`<!-- results:NAME:start -->`
... `<!-- results:NAME:end -->`; the text around them is left alone), the README's results table
(its `readme` block, with --readme) and the plots into docs/img/. A source that is missing leaves
its table and plot as they were. Each table says the dtype and machine its runs used.

    python benchmarks/results.py --results results --docs docs --readme README.md
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from kvblend.config import Settings
from kvblend.eval.frontier import STYLES, speedup

DEFAULT_RATIO = Settings().recompute_ratios[0]
PHASE_GROUPS = [  # (bar segment, blend_phases buckets summed into it)
    ("chunk loading", ["chunk loading"]),
    ("probe", ["probe: qkv", "probe: attention", "probe: attention with mass", "probe: rest of layer",
               "probe: selection", "probe: other"]),
    ("q/k/v", ["main: qkv"]),
    ("attention", ["main: attention", "main: attention with mass"]),
    ("rest of the layer", ["main: rest of layer", "main: other", "logits"]),
    ("selection", ["main: selection"]),
]


def load_evals(results: Path) -> list[tuple[str, dict]]:
    return [(p.parent.name, json.loads(p.read_text())) for p in sorted((results / "eval").glob("*/results.json"))]


def load_phases(results: Path) -> list[tuple[str, dict]]:
    return [(p.stem, json.loads(p.read_text())) for p in sorted((results / "phases").glob("*.json"))]


def _cell(row: dict | None) -> str:
    if row is None:
        return ""
    x = speedup(row)
    return f"{row['kl_answer']:.3f} / {row['top1_agree']:.3f} / " + (f"{x:.1f}x" if x else "-")


def heldout_table(evals: list[tuple[str, dict]]) -> str:
    """One line per run: reuse, blend at the default ratio and at the run's highest other ratio."""
    lines = ["| model | dataset, records | prompt tokens (mean) | reuse | blend "
             f"{DEFAULT_RATIO:.0%} (default) | blend, higher ratio | machine |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for _, res in evals:
        meta, rows = res["meta"], res["rows"]
        reuse = next((r for r in rows if r["mode"] == "reuse"), None)
        blend = {r["ratio"]: r for r in rows if r["mode"] == "blend" and r.get("ratio") is not None}
        default = blend.get(DEFAULT_RATIO)
        higher = max((r for r in blend if r > DEFAULT_RATIO), default=None)
        dataset = Path(str(meta.get("dataset", "?"))).name.split(".")[0]
        machine = f"{meta.get('cpu', 'CPU not recorded')}, {meta.get('dtype')}, {meta.get('threads')} threads, " \
                  f"{meta.get('date', 'date not recorded')}"
        higher_cell = f"{higher:.0%}: {_cell(blend[higher])}" if higher is not None else ""
        lines.append(f"| {meta.get('model')} | {dataset} {meta.get('records', '')} | {meta.get('mean_prompt_tokens')} "
                     f"| {_cell(reuse)} | {_cell(default)} | {higher_cell} | {machine} |")
    return "\n".join(lines)


def readme_table(evals: list[tuple[str, dict]]) -> str:
    """The README's table: per run reuse, blend at the default ratio and at its highest other
    ratio, and below it the dtype, machine and date of each run, as measured."""
    higher = sorted({r["ratio"] for _, res in evals for r in res["rows"]
                     if r["mode"] == "blend" and (r.get("ratio") or 0) > DEFAULT_RATIO})
    head = f"blend {higher[-1]:.0%}" if higher else "blend, higher ratio"
    lines = [f"| model | dataset (mean prompt) | reuse (nothing recomputed) | blend {DEFAULT_RATIO:.0%} (default) | "
             f"{head} |", "| --- | --- | --- | --- | --- |"]
    machines = []
    for _, res in evals:
        meta, rows = res["meta"], res["rows"]
        blend = {r["ratio"]: r for r in rows if r["mode"] == "blend" and r.get("ratio") is not None}
        reuse = next((r for r in rows if r["mode"] == "reuse"), None)
        top = max((r for r in blend if r > DEFAULT_RATIO), default=None)
        dataset = Path(str(meta.get("dataset", "?"))).name.split(".")[0].removesuffix("_s")
        tokens = meta.get("mean_prompt_tokens") or 0
        lines.append(f"| {meta.get('model')} | {dataset} {meta.get('records', '')} ({tokens / 1000:.1f}k tokens) "
                     f"| {_cell(reuse)} | {_cell(blend.get(DEFAULT_RATIO))} | "
                     f"{_cell(blend[top]) if top is not None else ''} |")
        machines.append(f"{meta.get('model')} on {dataset}: {meta.get('dtype')}, "
                        f"{meta.get('cpu', 'CPU not recorded')}, {meta.get('threads')} threads, "
                        f"{meta.get('date', 'date not recorded')}")
    return "\n".join(lines) + "\n\n*" + "; ".join(machines) + ".*"


def phase_seconds(phases: dict) -> dict[str, float]:
    return {group: sum(phases.get(b, 0.0) for b in buckets) for group, buckets in PHASE_GROUPS}


def phases_table(runs: list[tuple[str, dict]]) -> str:
    lines = ["| run | variant | TTFT (s) | speed-up | " + " | ".join(g for g, _ in PHASE_GROUPS) + " |",
             "|" + " --- |" * (4 + len(PHASE_GROUPS))]
    for name, run in runs:
        for row in run["rows"]:
            secs = phase_seconds(run["phases"].get(row["variant"], {}))
            lines.append(f"| {name}: {run['n']} prompts of {run['mean_tokens']} tokens, {run['cpu']}, {run['dtype']} "
                         f"| {row['variant']} | {row['ttft_s']:.2f} | {row['speedup']:.1f}x | "
                         + " | ".join(f"{secs[g]:.2f}" for g, _ in PHASE_GROUPS) + " |")
    return "\n".join(lines)


def replace_block(text: str, name: str, body: str, where: str = "docs/results.md") -> str:
    """The text with the block between `name`'s markers replaced; the markers must be there."""
    start, end = f"<!-- results:{name}:start -->", f"<!-- results:{name}:end -->"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise ValueError(f"{where} has no {start} ... {end} block")
    return pattern.sub(lambda _: f"{start}\n{body}\n{end}", text)


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def plot_frontier(evals: list[tuple[str, dict]], path: Path) -> None:
    """kl_answer and top1_agree against TTFT speed-up, one curve per (model, dataset) run."""
    fig = _figure(12, 4.6)
    ax_kl, ax_top1 = fig.subplots(1, 2)
    for i, (name, res) in enumerate(evals):
        color = f"C{i % 10}"
        blend = sorted((r for r in res["rows"] if r["mode"] == "blend" and speedup(r)), key=speedup)
        reuse = [r for r in res["rows"] if r["mode"] == "reuse" and speedup(r)]
        for ax, key in ((ax_kl, "kl_answer"), (ax_top1, "top1_agree")):
            ax.plot([speedup(r) for r in blend], [r[key] for r in blend], "o-", color=color, label=f"{name}: blend")
            for r in blend:
                ax.annotate(f"{r['ratio']:.0%}", (speedup(r), r[key]), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
            ax.plot([speedup(r) for r in reuse], [r[key] for r in reuse], "s", color=color, mfc="none",
                    label=f"{name}: reuse")
    for ax, label in ((ax_kl, "kl_answer against full (nats, lower is better)"),
                      (ax_top1, "top1_agree with full (higher is better)")):
        ax.set_xscale("log")
        ax.set_xlabel("TTFT speed-up over full prefill")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
    ax_top1.legend(fontsize=7, loc="lower left")
    fig.suptitle("quality against speed, the default engine (blend labelled by recompute ratio)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_ttft_length(evals, runs, prefill: dict | None, path: Path) -> None:
    """TTFT against prompt length: full prefill from prefill_bench, and each mode's mean TTFT at
    the mean prompt length of every eval and blend_phases run."""
    fig = _figure(7.5, 4.8)
    ax = fig.subplots()
    points: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _, res in evals:
        for r in res["rows"]:
            if r["mode"] == "blend" and r.get("ratio") != DEFAULT_RATIO or "ttft_mean_s" not in r:
                continue
            mode = f"blend {DEFAULT_RATIO:.0%}" if r["mode"] == "blend" else r["mode"]
            points.setdefault((res["meta"]["model"], mode), []).append((res["meta"]["mean_prompt_tokens"],
                                                                        r["ttft_mean_s"]))
    for _, run in runs:
        for r in run["rows"]:
            points.setdefault(("blend_phases", r["variant"]), []).append((run["mean_tokens"], r["ttft_s"]))
    sources = sorted({source for source, _ in points})
    for (source, mode), pts in sorted(points.items()):
        pts.sort()
        color, _ = STYLES.get(mode.split()[0], ("black", "o"))
        marker = "osD^v"[sources.index(source) % 5]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, ls="-", color=color,
                alpha=1 - 0.25 * (sources.index(source) % 3), label=f"{source}: {mode}")
    if prefill:
        rows = sorted(prefill["results"], key=lambda r: r["length"])
        engines = [k[: -len("_s")] for k in rows[0] if k.endswith("_s") and not k.endswith("tok_s")]
        names = {"runner": "full prefill (kvblend runner)", "hf": "transformers", "hf_fp32": "transformers fp32"}
        for eng in engines:
            if eng == "hf_fp32" and prefill.get("dtype") == "float32":
                continue  # the same run as "hf" when the model already is fp32
            ax.plot([r["length"] for r in rows], [r[f"{eng}_s"] for r in rows], "x--",
                    label=f"prefill_bench: {names.get(eng, eng)}")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (s)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_phases(runs: list[tuple[str, dict]], path: Path) -> None:
    """A stacked bar per variant and run: the prefill's time by phase."""
    fig = _figure(max(6, 1.1 * sum(len(r["rows"]) for _, r in runs)), 4.8)
    ax = fig.subplots()
    labels, bottoms, x = [], [], 0
    bars = {g: [] for g, _ in PHASE_GROUPS}
    for name, run in runs:
        for row in run["rows"]:
            secs = phase_seconds(run["phases"].get(row["variant"], {}))
            for g in bars:
                bars[g].append(secs[g])
            labels.append(row["variant"] if len(runs) == 1 else f"{name}\n{row['variant']}")
            bottoms.append(0.0)
            x += 1
    for i, (group, values) in enumerate(bars.items()):
        ax.bar(range(x), values, bottom=bottoms, label=group, color=f"C{i}")
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.set_xticks(range(x), labels, fontsize=7)
    ax.set_ylabel("seconds")
    ax.legend(fontsize=7)
    title = "where a prefill's time goes (blend_phases.py)"
    ax.set_title(title + (f"\n{runs[0][0]}" if len(runs) == 1 else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def render(results: Path, docs: Path, readme: Path | None = None) -> list[Path]:
    """Update docs/results.md, docs/img/ and (given) the README from `results`; returns the files written."""
    evals, runs = load_evals(results), load_phases(results)
    prefill_path = results / "prefill_bench.json"
    prefill = json.loads(prefill_path.read_text()) if prefill_path.is_file() else None
    img = docs / "img"
    img.mkdir(parents=True, exist_ok=True)
    md = docs / "results.md"
    text = md.read_text(encoding="utf-8")
    written = []
    if evals:
        text = replace_block(text, "heldout", heldout_table(evals))
        plot_frontier(evals, img / "frontier.png")
        written.append(img / "frontier.png")
    if runs:
        text = replace_block(text, "phases", phases_table(runs))
        plot_phases(runs, img / "blend_phases.png")
        written.append(img / "blend_phases.png")
    if evals or runs or prefill:
        plot_ttft_length(evals, runs, prefill, img / "ttft_vs_length.png")
        written.append(img / "ttft_vs_length.png")
    md.write_text(text, encoding="utf-8")
    if readme is not None and evals:
        readme.write_text(replace_block(readme.read_text(encoding="utf-8"), "readme", readme_table(evals),
                                        str(readme)), encoding="utf-8")
        written.append(readme)
    return [md] + written


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=Path("results"))
    ap.add_argument("--docs", type=Path, default=Path("docs"))
    ap.add_argument("--readme", type=Path, help="also rebuild this README's results table")
    args = ap.parse_args(argv)
    for path in render(args.results, args.docs, args.readme):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
