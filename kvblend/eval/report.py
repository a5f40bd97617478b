"""Eval reports: results.json, a markdown table (report.md), quality and TTFT against the recompute
ratio (report.png) and the quality / speed frontier (frontier.png, see frontier.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .frontier import write_frontier

# (row key, column title, format) for the quality and speed columns of the table.
_COLUMNS = [
    ("n", "n", "int"),
    ("kl_answer", "kl_answer", "q"),
    ("top1_agree", "top1_agree", "q"),
    ("kl_first", "kl_first", "q"),
    ("rougeL_vs_full", "rougeL_vs_full", "q"),
    ("match_full", "match_full", "q"),
    ("gold", "gold", "q"),
    ("ttft_mean_s", "TTFT mean (s)", "s"),
    ("ttft_median_s", "TTFT median (s)", "s"),
    ("ttft_ratio_vs_full", "speed-up vs full", "x"),
    ("recompute_frac", "recompute", "q"),
]


def mode_label(row: dict) -> str:
    """"blend 15%" for a row with a ratio, else the mode name."""
    ratio = row.get("ratio")
    if ratio is None:
        return str(row.get("mode", "?"))
    return f"{row.get('mode', '?')} {round(ratio * 100, 2):g}%"


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _cell(value, fmt: str) -> str:
    if not _is_number(value):
        return "-"
    if fmt == "int":
        return str(int(value))
    if fmt == "x":  # the row stores ttft / ttft_full; a speed-up reads better
        return f"{1 / value:.1f}x" if value > 0 else "-"
    return f"{value:.3f}"


def format_table(rows: list[dict]) -> str:
    """Markdown table, one line per row; missing or non-finite values show as "-"."""
    header = ["mode"] + [title for _, title, _ in _COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in rows:
        cells = [mode_label(row)] + [_cell(row.get(key), fmt) for key, _, fmt in _COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def differing_answers(per: list[dict], labels: list[str], reference: str, first: int = 0) -> list[str]:
    """Per record (numbered from `first`) and label, the greedy answers that are not the
    reference's, each beside the reference's answer."""
    return [f"  {first + i} {k}: {p[k]['answer']!r}  ({reference}: {p[reference]!r})"
            for i, p in enumerate(per) for k in labels if not p[k]["match_full"]]


def _json_default(obj):
    """numpy / torch values and paths in results become plain JSON values."""
    if hasattr(obj, "tolist"):  # numpy and torch scalars and arrays
        return obj.tolist()
    return str(obj)


def _markdown(results: dict, png_name: str, frontier_name: str) -> str:
    meta = results.get("meta", {})
    lines = [f"# kvblend eval: {meta.get('dataset', 'unknown dataset')}", ""]
    for key, value in meta.items():
        lines.append(f"- {key}: {', '.join(map(str, value)) if isinstance(value, (list, tuple)) else value}")
    lines += [
        "",
        format_table(results.get("rows", [])),
        "",
        "kl_answer: mean KL(full || mode) in nats over the teacher-forced answer positions; "
        "top1_agree: share of those positions with full's argmax; kl_first: KL at the first one; "
        "rougeL_vs_full / match_full: the mode's own greedy answer against full's; "
        "gold: task score against the gold answers; speed-up: full TTFT / mode TTFT.",
        "",
        f"![quality against TTFT speed-up over full, one curve per method]({frontier_name})",
        "",
        f"![quality and TTFT against recompute ratio]({png_name})",
        "",
    ]
    return "\n".join(lines)


def _plot(results: dict, path: Path) -> None:
    # A bare Figure renders with Agg and touches no pyplot state: no display, no backend switch
    # in the caller's process, and nothing to close.
    from matplotlib.figure import Figure

    rows = results.get("rows", [])
    blend = sorted((r for r in rows if r.get("mode") == "blend" and _is_number(r.get("ratio"))),
                   key=lambda r: r["ratio"])
    refs = {m: next((r for r in rows if r.get("mode") == m), None) for m in ("full", "reuse")}
    ref_style = {"full": "tab:green", "reuse": "tab:red"}

    fig = Figure(figsize=(11, 4.8))
    ax_q, ax_t = fig.subplots(1, 2)
    ax_top1 = ax_q.twinx()

    def series(key: str) -> tuple[list, list]:
        pts = [(r["ratio"], r[key]) for r in blend if _is_number(r.get(key))]
        return [x for x, _ in pts], [y for _, y in pts]

    if blend:
        ax_q.plot(*series("kl_answer"), "o-", color="tab:blue", label="blend kl_answer")
        ax_top1.plot(*series("top1_agree"), "s-", color="tab:orange", label="blend top1_agree")
        ax_t.plot(*series("ttft_mean_s"), "o-", color="tab:blue", label="blend TTFT mean")
    for mode, row in refs.items():
        if row is None:
            continue
        color = ref_style[mode]
        for ax, key, label in ((ax_q, "kl_answer", "kl_answer"), (ax_top1, "top1_agree", "top1"),
                               (ax_t, "ttft_mean_s", "TTFT")):
            if _is_number(row.get(key)):
                style = ":" if ax is ax_top1 else "--"
                ax.axhline(row[key], ls=style, color=color, alpha=0.8, label=f"{mode} {label}")

    if not blend:
        for ax in (ax_q, ax_t):
            ax.text(0.5, 0.5, "no blend rows", transform=ax.transAxes, ha="center", va="center",
                    color="gray")
    for ax in (ax_q, ax_t):
        ax.set_xlabel("recompute ratio")
        ax.set_xlim(-0.02, max([1.0] + [r["ratio"] for r in blend]) + 0.02)
        ax.grid(alpha=0.3)
    ax_q.set_ylabel("kl_answer (nats)")
    ax_top1.set_ylabel("top1_agree")
    ax_t.set_ylabel("TTFT mean (s)")
    ax_q.set_title("fidelity to full prefill")
    ax_t.set_title("time to first token")

    # Legends go under the panels, where they hide no line; one for both y axes on the left.
    for ax, twins in ((ax_q, (ax_q, ax_top1)), (ax_t, (ax_t,))):
        handles, labels = [], []
        for a in twins:
            h, lab = a.get_legend_handles_labels()
            handles += h
            labels += lab
        if handles:
            ax.legend(handles, labels, fontsize=7, ncol=3, loc="upper center",
                      bbox_to_anchor=(0.5, -0.16), frameon=False)

    meta = results.get("meta", {})
    title = [str(meta[k]) for k in ("dataset", "model") if meta.get(k)]
    title += [f"{k}: {meta[k]}" for k in ("n_prompts", "chunk_context", "neighbour_chunks") if meta.get(k) is not None]
    fig.suptitle("   ".join(title), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_report(results: dict, out_dir: Path) -> dict[str, Path]:
    """Write results.json, report.md, report.png and frontier.png into `out_dir`; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "md": out_dir / "report.md", "png": out_dir / "report.png",
             "frontier": out_dir / "frontier.png"}
    paths["json"].write_text(json.dumps(results, indent=2, default=_json_default) + "\n")
    paths["md"].write_text(_markdown(results, paths["png"].name, paths["frontier"].name))
    _plot(results, paths["png"])
    write_frontier(results, paths["frontier"])
    return paths
