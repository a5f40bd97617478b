"""The `kvblend` command: eval and demo (their code and invariants, on a tiny random model with the default
model's tokenizer), generate on the default model, and its errors."""

import json
import re
from importlib import resources

import pytest

from kvblend.cli import main


def _tiny_dataset(path):
    demo = json.loads(resources.files("kvblend.demo").joinpath("passages.json").read_text())
    records = [{"question": q["question"], "answers": [q["answer"]],
                "ctxs": [{"title": "", "text": demo["passages"][i]} for i in q["passages"]]}
               for q in demo["questions"][:2]]
    path.write_text(json.dumps(records))


def test_eval_writes_reports_and_keeps_the_invariants(tiny_model_folder, tmp_path, capsys):
    data = tmp_path / "tiny.json"
    _tiny_dataset(data)
    out = tmp_path / "out"
    assert main(["eval", "--data", str(data), "--modes", "prefix,reuse,blend", "--ratios", "0,1.0", "--offset", "1",
                 "--answer-tokens", "6", "--tf-positions", "4", "--dtype", "float32", "--model", tiny_model_folder,
                 "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["n_prompts"] == 1 and results["meta"]["records"] == "1-1"
    # The whole file is the collection its chunks' neighbours come from, not only the records scored.
    demo = json.loads(resources.files("kvblend.demo").joinpath("passages.json").read_text())
    assert results["meta"]["neighbour_chunks"] == len({i for q in demo["questions"][:2] for i in q["passages"]})
    rows = {(r["mode"], r["ratio"]): r for r in results["rows"]}
    assert set(rows) == {("full", None), ("prefix", None), ("reuse", None), ("blend", 0.0), ("blend", 1.0)}
    assert rows[("full", None)]["kl_answer"] == 0 and rows[("full", None)]["match_full"] == 1
    assert rows[("blend", 1.0)]["kl_answer"] < 1e-4 and rows[("blend", 1.0)]["match_full"] == 1
    assert rows[("prefix", None)]["kl_answer"] < 1e-4  # exact reuse only
    for key in ("kl_answer", "top1_agree", "recompute_frac"):  # ratio 0 is reuse
        assert rows[("blend", 0.0)][key] == rows[("reuse", None)][key]
    assert rows[("reuse", None)]["recompute_frac"] < 0.5 and rows[("full", None)]["recompute_frac"] == 1
    assert (out / "report.md").is_file() and (out / "report.png").stat().st_size > 0
    assert "blend" in capsys.readouterr().out


def test_demo_runs(tiny_model_folder, capsys):
    demo = json.loads(resources.files("kvblend.demo").joinpath("collection.json").read_text())
    n_passages, n_questions = len(demo["passages"]), len(demo["questions"])
    assert main(["demo", "--max-tokens", "4", "--dtype", "float32", "--model", tiny_model_folder]) == 0
    out = capsys.readouterr().out
    assert "full" in out and "blend" in out and f"stored KV of {n_passages} passages" in out
    summary = re.search(rf"blend's answer equals full's on (\d) of {n_questions} questions; its first token came "
                        r"([0-9.]+)x sooner", " ".join(out.split()))
    assert summary, out
    # Every prompt holds all the passages: full computes all of it, blend the recompute floor and the question.
    shares = [int(a) / int(b) for a, b in re.findall(r"(\d+) / (\d+)", out)]
    assert len(shares) == 2 * n_questions and max(shares[1::2]) < 0.5 and min(shares[0::2]) == 1.0
    assert "These prompts are short" in " ".join(out.split())  # the summary says why the share is high


def test_demo_summary_counts_matching_answers_and_explains_short_prompts():
    from types import SimpleNamespace

    from kvblend.cli import _demo_summary

    def out(text, ttft_s, recomputed, prompt):
        return SimpleNamespace(text=text, metrics=SimpleNamespace(ttft_s=ttft_s, recomputed_tokens=recomputed,
                                                                  prompt_tokens=prompt))

    short = [(out("Seven.", 1.0, 300, 300), out("Seven. ", 0.8, 200, 300)),
             (out("In 1742.", 1.0, 300, 300), out("In 1743.", 0.2, 100, 300))]
    text = _demo_summary(short, 0.08, 256)
    assert text.startswith("blend's answer equals full's on 1 of 2 questions; its first token came 2.0x sooner")
    assert "blend computed 50% of their tokens" in text and "at least 256 chunk tokens" in text
    long = [(out("Seven.", 4.0, 6000, 6000), out("Seven.", 0.5, 600, 6000))]
    assert _demo_summary(long, 0.08, 256) == ("blend's answer equals full's on 1 of 1 questions; its first token "
                                              "came 8.0x sooner in total.")


@pytest.mark.real_model
def test_generate_and_errors(capsys):
    assert main(["generate", "--prompt", "The capital of France is", "--max-tokens", "3"]) == 0
    assert capsys.readouterr().out.strip()
    assert main(["generate", "--prompt", "hi", "--model", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--recompute-ratios", "-1"]) == 2
    assert "recompute_ratios" in capsys.readouterr().err


def test_eval_refuses_the_flags_it_would_ignore(tmp_path, capsys):
    for flags in (["--recompute-ratios", "0.3"], ["--mode", "reuse"]):
        assert main(["eval", "--data", str(tmp_path / "none.json"), *flags]) == 2
        assert "--modes" in capsys.readouterr().err
