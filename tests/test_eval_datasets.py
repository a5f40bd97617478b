import gzip
import json

import pytest

from kvblend.eval.datasets import (
    QA,
    SUMMARY,
    RagRecord,
    load_dataset,
    split_passages,
)


def _write_json(path, obj):
    path.write_text(json.dumps(obj))
    return path


def _write_jsonl(path, records, gz=False):
    text = "".join(json.dumps(r) + "\n" for r in records)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def _nq_items(n):
    return [
        {"question": f"q{i}?", "answers": [f"a{i}"],
         "ctxs": [{"title": f"T{i}", "text": f"gold text {i}", "hasanswer": True, "isgold": True}]}
        for i in range(n)
    ]


def test_list_format(tmp_path):
    path = _write_json(tmp_path / "rag.json", [
        {"question": "Who?", "answers": ["Ann"],
         "ctxs": [{"title": "Ann", "text": "Ann wrote it."}, {"title": "", "text": "No title here."}]},
        {"question": "Where?", "answers": [["Croatia", "Hrvatska"]],
         "ctxs": [{"title": "X", "text": "x"}]},
    ])
    recs = load_dataset(path)
    assert len(recs) == 2 and all(isinstance(r, RagRecord) for r in recs)
    assert recs[0] == RagRecord("Who?", ["Ann"], ["Title: Ann\nAnn wrote it.", "No title here."], "f1", QA)
    assert recs[1].answers == [["Croatia", "Hrvatska"]]
    assert [r.question for r in load_dataset(path, limit=1)] == ["Who?"]


def test_longbench_split_and_summary(tmp_path):
    context = "Passage 1:\nFirst story.\nSecond line.\nPassage 2:\nOther story.\nPassage 3:\nThird, quoting Passage 9: inline."
    path = _write_jsonl(tmp_path / "news.jsonl", [
        {"input": "", "context": context, "answers": ["A summary."], "dataset": "multi_news"},
        {"input": "", "context": "Passage 1:\nOnly one.", "answers": ["S2"], "dataset": "multi_news"},
    ])
    recs = load_dataset(path)
    assert recs[0].passages == ["First story.\nSecond line.", "Other story.", "Third, quoting Passage 9: inline."]
    assert recs[0].question == ""
    assert recs[0].task == SUMMARY
    assert recs[0].metric == "rougeL"
    assert recs[0].answers == ["A summary."]
    assert recs[1].passages == ["Only one."]
    assert len(load_dataset(path, limit=1)) == 1


def test_split_passages_without_markers():
    assert split_passages("plain text, no markers") == ["plain text, no markers"]


def test_longbench_with_question_keeps_it(tmp_path):
    path = _write_jsonl(tmp_path / "lb.jsonl", [
        {"input": "What happened?", "context": "Passage 1:\nA.\nPassage 2:\nB.", "answers": ["x"], "dataset": "qmsum"},
    ])
    (rec,) = load_dataset(path)
    assert rec.question == "What happened?" and rec.metric == "rougeL" and rec.task != SUMMARY


def test_nq_gold_position_and_distractors(tmp_path):
    path = _write_jsonl(tmp_path / "nq.jsonl.gz", _nq_items(12), gz=True)
    recs = load_dataset(path, nq_k=5, nq_gold_pos=2, seed=1)
    assert len(recs) == 12
    golds = [f"Title: T{i}\ngold text {i}" for i in range(12)]
    for i, r in enumerate(recs):
        assert r.question == f"q{i}?" and r.answers == [f"a{i}"]
        assert r.metric == "f1" and r.task == QA
        assert len(r.passages) == 5
        assert r.passages[2] == golds[i]
        distractors = r.passages[:2] + r.passages[3:]
        assert golds[i] not in distractors
        assert all(d in golds for d in distractors)  # gold passages of other records
        assert len(set(r.passages)) == 5
    # deterministic for a seed, different for another
    assert load_dataset(path, nq_k=5, nq_gold_pos=2, seed=1) == recs
    assert load_dataset(path, nq_k=5, nq_gold_pos=2, seed=2) != recs


def test_nq_gold_pos_clamped_and_limit(tmp_path):
    path = _write_jsonl(tmp_path / "nq.jsonl", _nq_items(8))
    recs = load_dataset(path, nq_k=4, nq_gold_pos=99, limit=5)
    assert len(recs) == 5
    assert all(r.passages[3] == f"Title: T{i}\ngold text {i}" for i, r in enumerate(recs))
    # distractors come from the loaded records, so passages recur across prompts
    pool = {f"Title: T{i}\ngold text {i}" for i in range(5)}
    assert all(set(r.passages) <= pool for r in recs)
    # limit below k still finds k-1 other records
    (one,) = load_dataset(path, nq_k=4, limit=1)
    assert len(one.passages) == 4 and one.passages[0] == "Title: T0\ngold text 0"


def test_nq_duplicate_gold_never_repeated(tmp_path):
    items = _nq_items(6)
    items[1]["ctxs"] = items[0]["ctxs"]  # two questions with the same gold passage
    path = _write_jsonl(tmp_path / "nq.jsonl", items)
    for seed in range(5):
        for r in load_dataset(path, nq_k=5, seed=seed):
            assert len(set(r.passages)) == 5


def test_nq_too_few_records(tmp_path):
    path = _write_jsonl(tmp_path / "nq.jsonl", _nq_items(3))
    with pytest.raises(ValueError, match="distinct passages"):
        load_dataset(path, nq_k=10)


def test_missing_file():
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_dataset("/nonexistent/nope.json")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl.*no records"):
        load_dataset(path)
    path = _write_json(tmp_path / "empty.json", [])
    with pytest.raises(ValueError, match="no records"):
        load_dataset(path)


def test_unknown_format(tmp_path):
    path = _write_jsonl(tmp_path / "other.jsonl", [{"prompt": "x", "completion": "y"}])
    with pytest.raises(ValueError, match="other.jsonl.*unknown dataset format"):
        load_dataset(path)


def test_invalid_json(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "q", "answers": ["a"], "ctxs": []}\n{not json\n')
    with pytest.raises(ValueError, match="bad.jsonl: line 2"):
        load_dataset(path)


def test_missing_fields(tmp_path):
    path = _write_json(tmp_path / "nofield.json", [{"question": "q", "ctxs": [{"title": "", "text": "t"}]}])
    with pytest.raises(ValueError, match="nofield.json: record 0 has no 'answers'"):
        load_dataset(path)
    path = _write_json(tmp_path / "notext.json", [{"question": "q", "answers": ["a"], "ctxs": [{"title": "t"}]}])
    with pytest.raises(ValueError, match="notext.json: record 0 .*'text'"):
        load_dataset(path)
    path = _write_jsonl(tmp_path / "lb.jsonl", [{"input": "", "context": "Passage 1:\nx"}])
    with pytest.raises(ValueError, match="'answers'"):
        load_dataset(path)


def test_offset_skips_records_and_keeps_each_record_the_same(tmp_path):
    items = [{"question": f"q{i}?", "answers": [f"a{i}"],
              "ctxs": [{"title": "", "text": f"p{i}"}, {"title": "", "text": "x"}]} for i in range(6)]
    path = _write_json(tmp_path / "rag.json", items)
    assert [r.question for r in load_dataset(path, offset=2, limit=3)] == ["q2?", "q3?", "q4?"]
    assert [r.question for r in load_dataset(path, offset=4)] == ["q4?", "q5?"]
    assert [r.question for r in load_dataset(path, offset=5, limit=10)] == ["q5?"]
    with pytest.raises(ValueError, match="offset 6 skips all of its 6 records"):
        load_dataset(path, offset=6)
    with pytest.raises(ValueError, match="offset must be >= 0"):
        load_dataset(path, offset=-1)
    # NQ draws distractors record by record: an offset run holds the records of the longer run.
    nq = _write_jsonl(tmp_path / "nq.jsonl", _nq_items(12))
    assert load_dataset(nq, nq_k=4, offset=5, limit=3) == load_dataset(nq, nq_k=4, limit=8)[5:]
