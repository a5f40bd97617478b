import json

from kvblend.eval.report import differing_answers, format_table, mode_label, write_report


def _row(mode, ratio=None, kl=0.1, top1=0.9, ttft=0.5, ttft_ratio=0.5, recompute=0.2):
    return {"mode": mode, "ratio": ratio, "n": 3, "kl_answer": kl, "top1_agree": top1, "kl_first": kl / 2,
            "rougeL_vs_full": 0.8, "match_full": 0.6666, "gold": 0.12345, "ttft_mean_s": ttft,
            "ttft_median_s": ttft, "ttft_ratio_vs_full": ttft_ratio, "recompute_frac": recompute}


META = {"dataset": "tiny.json", "n_prompts": 3, "model": "toy", "dtype": "float32",
        "chunk_context": "bare", "deviation": "k", "check_layers": [1]}


def _results(rows):
    return {"meta": dict(META), "rows": rows}


def test_mode_label():
    assert mode_label({"mode": "blend", "ratio": 0.15}) == "blend 15%"
    assert mode_label({"mode": "blend", "ratio": 0.075}) == "blend 7.5%"
    assert mode_label({"mode": "full", "ratio": None}) == "full"


def test_format_table():
    table = format_table([
        _row("full", kl=0.0, top1=1.0, ttft=1.0, ttft_ratio=1.0, recompute=1.0),
        _row("reuse", kl=0.254, ttft=0.08, ttft_ratio=0.0813, recompute=0.01),
        _row("blend", 0.15, kl=0.0884, ttft_ratio=0.25),
    ])
    lines = table.splitlines()
    assert len(lines) == 2 + 3
    assert lines[0].startswith("| mode |")
    assert lines[2].startswith("| full |") and "| 1.0x |" in lines[2]
    assert lines[3].startswith("| reuse |") and "| 0.254 |" in lines[3] and "| 12.3x |" in lines[3]
    assert lines[4].startswith("| blend 15% |") and "| 0.088 |" in lines[4] and "| 4.0x |" in lines[4]
    assert "0.667" in lines[4] and "0.123" in lines[4]
    assert all(line.count("|") == lines[0].count("|") for line in lines)


def test_format_table_missing_values():
    line = format_table([{"mode": "prefix", "ratio": None, "n": 2, "kl_answer": float("nan")}]).splitlines()[2]
    assert line.startswith("| prefix | 2 | - |")


def test_write_report(tmp_path):
    rows = [_row("full", ttft_ratio=1.0), _row("prefix"), _row("reuse", kl=0.3),
            _row("blend", 0.3, kl=0.07), _row("blend", 0.15, kl=0.09)]
    paths = write_report(_results(rows), tmp_path / "out")
    assert set(paths) == {"json", "md", "png", "frontier"}
    assert [p.name for p in paths.values()] == ["results.json", "report.md", "report.png", "frontier.png"]
    assert json.loads(paths["json"].read_text()) == _results(rows)
    md = paths["md"].read_text()
    assert md.startswith("# ") and "tiny.json" in md
    assert "- model: toy" in md and "- check_layers: 1" in md
    for label in ("| full |", "| prefix |", "| reuse |", "| blend 15% |", "| blend 30% |"):
        assert label in md
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert paths["frontier"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_write_report_without_blend_rows(tmp_path):
    paths = write_report(_results([_row("full"), _row("reuse")]), tmp_path)
    assert paths["png"].stat().st_size > 1000
    paths = write_report(_results([]), tmp_path / "empty")
    assert paths["png"].exists() and paths["frontier"].exists() and "| mode |" in paths["md"].read_text()


def test_write_report_numpy_values(tmp_path):
    import numpy as np

    row = _row("blend", 0.15)
    row["kl_answer"] = np.float32(0.25)
    paths = write_report(_results([row]), tmp_path)
    assert json.loads(paths["json"].read_text())["rows"][0]["kl_answer"] == 0.25


def test_differing_answers_lists_each_changed_answer_beside_the_references():
    per = [{"full": "Paris", "int8": {"answer": "Paris", "match_full": 1.0}},
           {"full": "Rome", "int8": {"answer": "Milan", "match_full": 0.0}}]
    assert differing_answers(per, ["int8"], "full", first=30) == ["  31 int8: 'Milan'  (full: 'Rome')"]
    assert differing_answers(per[:1], ["int8"], "full") == []
