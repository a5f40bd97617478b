"""Request bodies -> prompt token ids, laid out for blending:

    prefix SEP doc_1 SEP ... SEP doc_n SEP question

Text prompts keep any separator the user wrote as its exact ids (blend.segment.tokenize_prompt);
`documents` are placed between the system prompt and the question, each tokenized alone so its
ids, and so its cache key, are the same in every prompt (and the same as /v1/chunks stored).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..api import DEFAULT_SYSTEM
from ..blend.segment import (SeparatorInDocument, check_documents_kept_whole, docs_mark, join_segments,
                             rag_prompt_ids, tokenize_prompt)
from .errors import bad_request


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def fallback_chat_text(messages: list[dict]) -> str:
    """A plain template for tokenizers without one: role headers, then the assistant's turn."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


def chat_text(tokenizer, messages: list[dict]) -> str:
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return fallback_chat_text(messages)


def completion_ids(tokenizer, separator: str, sep_ids: list[int], prompt: str | list[int],
                   documents: Sequence[str] | None, system: str | None) -> list[int]:
    if isinstance(prompt, list):
        if documents:
            raise bad_request("documents go with a text prompt (the question), not with token ids", "documents")
        return prompt
    _need_tokenizer(tokenizer)
    if documents:
        return _refused(rag_prompt_ids, tokenizer, sep_ids, system or DEFAULT_SYSTEM, prompt, documents)
    return tokenize_prompt(tokenizer, prompt, separator)


def chat_ids(tokenizer, separator: str, sep_ids: list[int], messages: list[dict],
             documents: Sequence[str] | None, system: str | None) -> list[int]:
    _need_tokenizer(tokenizer)
    if not documents:
        if system is not None:
            messages = [{"role": "system", "content": system}, *messages]
        return tokenize_prompt(tokenizer, chat_text(tokenizer, messages), separator)
    # Documents go at the start of the last user turn; a system turn comes first, so that the
    # prefix (and the chunk keys derived from it) match what /v1/chunks precomputed.
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is None:
        raise bad_request("documents need a user message to go with", "messages")
    mark = docs_mark()
    messages = [dict(m) for m in messages]
    messages[last_user]["content"] = mark + messages[last_user]["content"]
    if messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system or DEFAULT_SYSTEM})
    head, tail = chat_text(tokenizer, messages).split(mark)
    docs = [tokenizer.encode(d, add_special_tokens=False) for d in documents]
    prefix = tokenizer.encode(head, add_special_tokens=False)
    ids = join_segments(prefix, docs, tokenizer.encode(tail, add_special_tokens=False), sep_ids)
    _refused(check_documents_kept_whole, ids, prefix, docs, sep_ids)
    return ids


def chunk_prompt_ids(tokenizer, sep_ids: list[int], documents: Sequence[str], system: str | None) -> list[int]:
    """The prompt /v1/chunks precomputes: the documents after the system prompt, an empty question."""
    _need_tokenizer(tokenizer)
    return _refused(rag_prompt_ids, tokenizer, sep_ids, system or DEFAULT_SYSTEM, "", documents)


def _refused(build, *args):
    """`build(*args)`, a document holding the separator refused as a 400 naming `documents`."""
    try:
        return build(*args)
    except SeparatorInDocument as e:
        raise bad_request(str(e), "documents") from None


def _need_tokenizer(tokenizer) -> None:
    if tokenizer is None:
        raise bad_request("this model has no tokenizer: send the prompt as token ids", "prompt")
