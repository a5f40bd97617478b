"""Splitting a prompt into prefix, chunks and suffix by the separator's token ids.

    prefix SEP chunk_1 SEP chunk_2 ... SEP chunk_n SEP suffix

Text prompts are split on the separator *string* and each piece is tokenized on its own, so the
separator always appears as its exact token ids (tokenizing the whole string could merge the
separator's trailing space into the next word).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

Span = tuple[int, int]  # [start, end) in the prompt's token ids


@dataclass(frozen=True)
class Segments:
    n_tokens: int
    prefix: Span
    chunks: list[Span]
    separators: list[Span]
    suffix: Span

    @property
    def exact_end(self) -> int:
        """End of the prefix segment with the separator after it: the context chunks follow."""
        return self.separators[0][1] if self.separators else self.n_tokens


@dataclass(frozen=True)
class Prompt:
    """A prompt's token ids and, when it was built from documents, its segments as built: then
    nothing has to find the separators in it again. None: a raw prompt, split where it is used."""

    ids: list[int]
    seg: Segments | None = None


def separator_ids(tokenizer, separator: str) -> list[int]:
    ids = tokenizer.encode(separator, add_special_tokens=False)
    if not ids:
        raise ValueError(f"separator {separator!r} tokenizes to no tokens")
    return ids


def find_separators(token_ids: Sequence[int], sep: Sequence[int]) -> list[Span]:
    """Non-overlapping occurrences of `sep`, left to right."""
    found, i, n, m = [], 0, len(token_ids), len(sep)
    first = sep[0]
    while i <= n - m:
        if token_ids[i] == first and list(token_ids[i:i + m]) == list(sep):
            found.append((i, i + m))
            i += m
        else:
            i += 1
    return found


def segment(token_ids: Sequence[int], sep: Sequence[int]) -> Segments:
    n = len(token_ids)
    seps = find_separators(token_ids, sep)
    if not seps:
        return Segments(n, (0, n), [], [], (n, n))
    prefix = (0, seps[0][0])
    # Empty chunks (two separators in a row) carry nothing to reuse: skip them.
    chunks = [(a[1], b[0]) for a, b in zip(seps, seps[1:]) if b[0] > a[1]]
    return Segments(n, prefix, chunks, seps, (seps[-1][1], n))


class SeparatorInDocument(ValueError):
    """A document whose token ids hold the separator's (alone, or with its neighbours' ids): as a
    chunk it would be split in two, so it is refused on every way in rather than split silently."""


def join_segments(prefix: Sequence[int], chunks: Sequence[Sequence[int]], suffix: Sequence[int],
                  sep: Sequence[int]) -> list[int]:
    """prefix SEP c1 SEP c2 ... SEP cn SEP suffix, from token ids."""
    return join_prompt(prefix, chunks, suffix, sep).ids


def join_prompt(prefix: Sequence[int], chunks: Sequence[Sequence[int]], suffix: Sequence[int],
                sep: Sequence[int]) -> Prompt:
    """prefix SEP c1 SEP c2 ... SEP cn SEP suffix with its segments, as `segment` finds them where
    no chunk holds the separator (empty chunks carry nothing to reuse: left out)."""
    ids, m = list(prefix), len(sep)
    seps, spans = [], []
    for chunk in chunks:
        seps.append((len(ids), len(ids) + m))
        ids += list(sep)
        if chunk:
            spans.append((len(ids), len(ids) + len(chunk)))
        ids += list(chunk)
    seps.append((len(ids), len(ids) + m))
    ids += list(sep) + list(suffix)
    return Prompt(ids, Segments(len(ids), (0, len(prefix)), spans, seps, (seps[-1][1], len(ids))))


def check_documents_kept_whole(ids: Sequence[int], prefix: Sequence[int], docs: Sequence[Sequence[int]],
                               sep: Sequence[int]) -> None:
    """Raise SeparatorInDocument unless the separators between the prefix and the suffix of `ids`
    (join_segments of `prefix`, `docs` and a suffix) are exactly the ones joining put there."""
    at, joined = len(prefix), []
    for doc in docs:
        joined.append((at, at + len(sep)))
        at += len(sep) + len(doc)
    joined.append((at, at + len(sep)))
    found = [s for s in find_separators(ids, sep) if s[1] > joined[0][0] and s[0] < joined[-1][1]]
    if found != joined:
        # The first separator out of place ends the document that holds it (1-based: its index).
        bad = next((i for i, (f, j) in enumerate(zip(found, joined)) if f != j), len(found))
        raise SeparatorInDocument(f"document {min(max(bad, 1), len(docs))} holds the separator's tokens (alone or "
                                  "with the tokens around it), so it would be split into two chunks: remove the "
                                  "separator text from it, or serve with another separator")


def tokenize_prompt(tokenizer, text: str, separator: str) -> list[int]:
    """Tokenize a text prompt piece by piece around each separator string."""
    pieces = text.split(separator)
    sep = separator_ids(tokenizer, separator)
    ids = tokenizer.encode(pieces[0], add_special_tokens=True)
    for piece in pieces[1:]:
        ids += sep + tokenizer.encode(piece, add_special_tokens=False)
    return ids


def docs_mark() -> str:
    """A fresh placeholder for where documents go in a templated text: fresh, so that no user text
    can contain it (a fixed one in a question would split the prompt in the wrong place)."""
    return f"\x00kvblend-documents-{uuid.uuid4().hex}\x00"


def rag_prompt_ids(tokenizer, sep: Sequence[int], system: str, question: str,
                   documents: Sequence[str]) -> list[int]:
    """The token ids of rag_prompt."""
    return rag_prompt(tokenizer, sep, system, question, documents).ids


def rag_prompt(tokenizer, sep: Sequence[int], system: str, question: str, documents: Sequence[str]) -> Prompt:
    """prefix SEP doc_1 SEP ... SEP doc_n SEP question, through the chat template when the
    tokenizer has one (system message, then the documents and the question as the user turn).
    Each document is tokenized alone, so its ids, and so its cache key, are the same in every
    prompt."""
    mark = docs_mark()
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": mark + question}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        head_specials = False  # the template writes BOS itself where the model wants one
    else:
        text = f"{system}\n{mark}{question}\nAnswer:"
        head_specials = True  # BOS where the tokenizer adds one (Gemma 3 base reads garbage without it)
    return documents_at_mark(tokenizer, text, mark, documents, sep, head_specials)


def documents_at_mark(tokenizer, text: str, mark: str, documents: Sequence[str], sep: Sequence[int],
                      head_specials: bool = False) -> Prompt:
    """`text` with the documents as chunks where `mark` stands: the text before it the prefix (with
    the tokenizer's special tokens where `head_specials`), the text after it the suffix. Each
    document is tokenized alone; SeparatorInDocument where one would not stay one chunk."""
    head, tail = text.split(mark)
    docs = [tokenizer.encode(d, add_special_tokens=False) for d in documents]
    prefix = tokenizer.encode(head, add_special_tokens=head_specials)
    built = join_prompt(prefix, docs, tokenizer.encode(tail, add_special_tokens=False), sep)
    check_documents_kept_whole(built.ids, prefix, docs, sep)
    return built
