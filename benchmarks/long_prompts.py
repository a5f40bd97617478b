"""RAG prompts of a chosen length, made of a dataset's real passages.

A prompt is the first record's task and question with passages taken in file order (the first
record's, then the next records'), the last one cut at a token boundary so the prompt comes out
at the asked length, give or take the few tokens that re-tokenizing a cut passage moves. Every
passage is one chunk, as in `kvblend eval`; every length uses the same first passages.
"""

from __future__ import annotations

from kvblend.blend.segment import rag_prompt_ids
from kvblend.eval.datasets import RagRecord


def prompt_of_length(tokenizer, sep_ids: list[int], records: list[RagRecord], n: int) -> list[int]:
    """The token ids of a RAG prompt of about n tokens (never fewer than its frame: the system
    message, the instruction and the question)."""
    if not records:
        raise ValueError("no records to build a prompt from")
    first = records[0]
    tail = first.task.instruction + (f"\nQuestion: {first.question}" if first.question else "")

    def ids(passages: list[str]) -> list[int]:
        return rag_prompt_ids(tokenizer, sep_ids, first.task.system, tail, passages)

    pool = [p for r in records for p in r.passages]
    passages: list[str] = []
    for passage in pool:
        room = n - len(ids(passages + [""]))  # tokens left for this passage after its separator
        if room <= 0:
            break
        tokens = tokenizer.encode(passage, add_special_tokens=False)
        if len(tokens) > room:
            passages.append(tokenizer.decode(tokens[:room]))
            break
        passages.append(passage)
    else:
        if len(ids(passages)) < n:
            raise ValueError(f"the records' passages make at most {len(ids(passages))} tokens, fewer than {n}")
    return ids(passages)
