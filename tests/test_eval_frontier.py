"""The frontier plot: quality against TTFT speed-up, one curve per method, from a results object."""

import math

from kvblend.eval.frontier import PANELS, curves, frontier_figure, write_frontier
from kvblend.eval.report import write_report


def _row(mode, ratio=None, ttft_ratio=1.0, kl=0.0, top1=1.0, match=1.0, **extra):
    return {"mode": mode, "ratio": ratio, "ttft_ratio_vs_full": ttft_ratio, "kl_answer": kl,
            "top1_agree": top1, "match_full": match, **extra}


ROWS = [
    _row("full"),
    _row("reuse", ttft_ratio=0.08, kl=0.25, top1=0.8, match=0.1),
    _row("blend", 0.3, ttft_ratio=0.4, kl=0.07, top1=0.9, match=0.3),  # out of order on purpose
    _row("blend", 0.05, ttft_ratio=0.2, kl=0.15, top1=0.85, match=0.2),
    _row("blend", 0.15, ttft_ratio=0.25, kl=0.09, top1=0.88, match=float("nan")),
]
RESULTS = {"meta": {"dataset": "tiny.json", "model": "toy", "records": "0-2", "n_prompts": 3}, "rows": ROWS}


def test_curves_sort_by_speedup_and_drop_missing_values():
    c = curves(ROWS, "kl_answer")
    assert set(c) == {"full", "reuse", "blend"}
    assert [round(x, 3) for x, _, _ in c["blend"]] == [2.5, 4.0, 5.0]
    assert [y for _, y, _ in c["blend"]] == [0.07, 0.09, 0.15]
    assert c["full"][0][:2] == (1.0, 0.0) and c["reuse"][0][0] == 12.5
    assert [r["ratio"] for _, _, r in curves(ROWS, "match_full")["blend"]] == [0.3, 0.05]  # the NaN is left out


def test_one_panel_per_measure_and_one_line_per_method():
    fig = frontier_figure(RESULTS)
    assert [ax.get_title() for ax in fig.axes] == [key for key, _ in PANELS]
    for ax, (key, _) in zip(fig.axes, PANELS):
        lines = {line.get_label(): line for line in ax.lines}
        assert set(lines) == {"full", "reuse", "blend"}, key
        assert ax.get_xscale() == "log"
    kl = {line.get_label(): line for line in fig.axes[0].lines}
    assert list(kl["blend"].get_xdata()) == [2.5, 4.0, 5.0] and list(kl["blend"].get_ydata()) == [0.07, 0.09, 0.15]
    assert list(kl["full"].get_xdata()) == [1.0] and math.isclose(kl["reuse"].get_xdata()[0], 12.5)
    assert len({line.get_color() for line in kl.values()}) == 3


def test_methods_of_one_mode_get_curves_of_their_own():
    rows = ROWS + [_row("blend", 0.15, ttft_ratio=0.3, kl=0.05, method="blend + scale"),
                   _row("blend", 0.3, ttft_ratio=0.45, kl=0.03, method="blend + scale")]
    lines = {line.get_label(): line for line in frontier_figure({"rows": rows}).axes[0].lines}
    assert set(lines) == {"full", "reuse", "blend", "blend + scale"}
    assert list(lines["blend + scale"].get_ydata()) == [0.03, 0.05]
    assert lines["blend + scale"].get_color() != lines["blend"].get_color()


def test_plot_files_are_written_beside_the_results(tmp_path):
    path = write_frontier(RESULTS, tmp_path / "f.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    paths = write_report(RESULTS, tmp_path / "out")
    assert paths["frontier"] == tmp_path / "out" / "frontier.png"
    assert paths["frontier"].read_bytes()[:4] == b"\x89PNG"
    assert "(frontier.png)" in paths["md"].read_text()
