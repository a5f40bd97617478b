"""RAG dataset loaders: every format becomes a list of `RagRecord`s whose passages are chunks.

Formats, detected from the file's content:
- CacheBlend list format: a JSON list of {"question", "answers", "ctxs": [{"title", "text"}]}.
- LongBench jsonl: {"context", "input", "answers"}, `context` made of "Passage N:" sections.
- NQ-open oracle jsonl (optionally gzipped): {"question", "answers", "ctxs": [gold passage]};
  k-passage prompts are built from the gold passage plus the gold passages of other records.
"""

from __future__ import annotations

import gzip
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TaskPrompt:
    """How a record's prompt is worded: a system message before the passages and an instruction
    after them, right before the question, as in the CacheBlend paper's own prompts."""

    system: str
    instruction: str


# The CacheBlend paper's QA prompt (its MuSiQue / 2WikiMQA examples): a short answer, asked for
# before and after the passages.
QA = TaskPrompt(
    "You will be asked a question after reading several passages. Please directly answer the question "
    "based on the given passages. Do NOT repeat the question. The answer should be within 5 words.",
    "Answer the question directly based on the given passages. Do NOT repeat the question. "
    "The answer should be within 5 words.",
)
SUMMARY = TaskPrompt("You will be asked to summarize several news passages.",
                     "Write a one-page summary of all the news passages.")
QUERY = TaskPrompt("You will be asked a query after reading several passages.",
                   "Answer the query based on the passages.")

# LongBench subsets scored by F1 (the others, summaries and query-based summaries, by Rouge-L).
_LONGBENCH_F1 = {"narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "triviaqa"}
_PASSAGE_MARK = re.compile(r"(?m)^Passage \d+:[^\S\n]*\n?")


@dataclass
class RagRecord:
    """One RAG prompt: each passage is one reusable chunk; scored against `answers` by `metric`."""

    question: str
    answers: list
    passages: list[str]
    metric: str  # "f1" or "rougeL"
    task: TaskPrompt


def load_dataset(
    path: str | Path,
    limit: int | None = None,
    nq_k: int = 10,
    nq_gold_pos: int = 0,
    seed: int = 0,
    offset: int = 0,
) -> list[RagRecord]:
    """Load a RAG dataset file of any supported format: `limit` records from record `offset` on
    (all of them by default), so settings can be chosen on some records and reported on others
    (e.g. tuned on 30-59, reported on 0-29). Records [offset, offset + limit) are those that
    `limit=offset + limit` gives, minus the first `offset`.

    For NQ-open, each prompt has `nq_k` passages with its gold one at `nq_gold_pos` (clamped to
    0..k-1); distractors are drawn with `random.Random(seed)` from the gold passages of the
    first max(offset + limit, nq_k) records, so passages recur across prompts as they do on a RAG server.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    items, is_json_list = _read_items(path)
    if not items:
        raise ValueError(f"{path}: no records")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValueError(f"{path}: record {i} is a {type(item).__name__}, expected a JSON object")
    if offset >= len(items):
        raise ValueError(f"{path}: offset {offset} skips all of its {len(items)} records")
    # Records up to the last one asked for are built, then the first `offset` dropped: NQ draws
    # each record's distractors in order, so that is what keeps record i the same.
    n = len(items) if limit is None else offset + limit
    return _records(path, items, is_json_list, n, nq_k, nq_gold_pos, seed)[offset:]


def _records(path: Path, items: list, is_json_list: bool, n: int, nq_k: int, nq_gold_pos: int,
             seed: int) -> list[RagRecord]:
    """The first n records (fewer if the file has fewer), in the file's format."""
    n = min(n, len(items))
    first = items[0]
    if "context" in first and "input" in first:
        return [_longbench_record(path, i, it) for i, it in enumerate(items[:n])]
    if "ctxs" in first:
        # A jsonl file whose records hold exactly one passage each is the NQ oracle layout;
        # anything else with ctxs already lists its retrieved passages.
        one_ctx = all(isinstance(it.get("ctxs"), list) and len(it["ctxs"]) == 1 for it in items)
        if not is_json_list and one_ctx:
            return _nq_records(path, items, n, nq_k, nq_gold_pos, seed)
        return [_list_record(path, i, it) for i, it in enumerate(items[:n])]
    raise ValueError(
        f"{path}: unknown dataset format (record keys {sorted(first)}); expected CacheBlend list "
        "format (question, answers, ctxs), LongBench jsonl (context, input, answers) or NQ-open "
        "oracle jsonl (question, answers, ctxs)"
    )


def _read_items(path: Path) -> tuple[list, bool]:
    """Parse a JSON list or a JSON-lines file (gzipped when named *.gz); returns (items, is_list)."""
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read as text: {e}") from e
    if text.lstrip().startswith("["):
        try:
            return json.loads(text), True
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON: {e}") from e
    items = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            items.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: line {lineno} is not valid JSON: {e}") from e
    return items, False


def _field(path: Path, i: int, item: dict, name: str, types: type | tuple):
    """item[name], checked for presence and type, with an error naming file, record and field."""
    if name not in item:
        raise ValueError(f"{path}: record {i} has no {name!r} field")
    value = item[name]
    if not isinstance(value, types):
        raise ValueError(f"{path}: record {i} field {name!r} is a {type(value).__name__}")
    return value


def _answers(path: Path, i: int, item: dict) -> list:
    answers = _field(path, i, item, "answers", (list, str))
    return [answers] if isinstance(answers, str) else answers


def _passage(path: Path, i: int, ctx) -> str:
    """One ctxs entry as chunk text: "Title: {title}\\n{text}", or the text alone when untitled."""
    if not isinstance(ctx, dict) or not isinstance(ctx.get("text"), str):
        raise ValueError(f"{path}: record {i} has a ctxs entry without a 'text' string")
    title = (ctx.get("title") or "").strip()
    return f"Title: {title}\n{ctx['text']}" if title else ctx["text"]


def _list_record(path: Path, i: int, item: dict) -> RagRecord:
    ctxs = _field(path, i, item, "ctxs", list)
    return RagRecord(
        question=_field(path, i, item, "question", str),
        answers=_answers(path, i, item),
        passages=[_passage(path, i, c) for c in ctxs],
        metric="f1",
        task=QA,
    )


def split_passages(context: str) -> list[str]:
    """Split a LongBench context on its "Passage N:" markers (dropped: they fix a chunk's place)."""
    parts = (p.strip() for p in _PASSAGE_MARK.split(context))
    return [p for p in parts if p]


def _longbench_record(path: Path, i: int, item: dict) -> RagRecord:
    context = _field(path, i, item, "context", str)
    question = _field(path, i, item, "input", str).strip()
    if item.get("dataset") in _LONGBENCH_F1:
        metric, task = "f1", QA
    else:
        metric, task = "rougeL", QUERY if question else SUMMARY
    passages = split_passages(context)
    if not passages:
        raise ValueError(f"{path}: record {i} has an empty 'context'")
    return RagRecord(question, _answers(path, i, item), passages, metric, task)


def _nq_records(
    path: Path, items: list[dict], n: int, k: int, gold_pos: int, seed: int
) -> list[RagRecord]:
    if k < 1:
        raise ValueError(f"nq_k must be >= 1, got {k}")
    gold_pos = max(0, min(gold_pos, k - 1))
    pool = items[: max(n, k)]
    golds = [_passage(path, i, _field(path, i, it, "ctxs", list)[0]) for i, it in enumerate(pool)]
    unique = list(dict.fromkeys(golds))  # some questions share a gold passage: never show it twice
    index = {p: j for j, p in enumerate(unique)}
    if len(unique) < k:
        raise ValueError(
            f"{path}: {k}-passage prompts need at least {k} distinct passages, "
            f"found {len(unique)} in {len(pool)} records"
        )
    rng = random.Random(seed)
    records = []
    for i, item in enumerate(items[:n]):
        # Draw k distinct passages; dropping the gold one if drawn leaves k-1 distractors,
        # each uniformly chosen among the other records' passages.
        drawn = [j for j in rng.sample(range(len(unique)), k) if j != index[golds[i]]][: k - 1]
        passages = [unique[j] for j in drawn]
        passages.insert(gold_pos, golds[i])
        records.append(
            RagRecord(
                question=_field(path, i, item, "question", str),
                answers=_answers(path, i, item),
                passages=passages,
                metric="f1",
                task=QA,
            )
        )
    return records
