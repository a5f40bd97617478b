"""Building prompts for every way in (LLM and the server's routes), laid out for blending:

    prefix SEP doc_1 SEP ... SEP doc_n SEP question

A prompt built from `documents` carries its segments from here to the engine (Prompt.seg): the
separator is looked for only in a raw prompt, where the user wrote it (blend.segment.tokenize_prompt
keeps it as its exact ids). Each document is tokenized alone, so its ids, and so its cache key, are
the same in every prompt. A document that holds the separator's ids is refused (PromptError, param
`documents`): stored as one chunk it would be split in two by any raw prompt that repeats it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..blend.segment import (Prompt, SeparatorInDocument, docs_mark, documents_at_mark, rag_prompt,
                             tokenize_prompt)
from .engine import RequestError

DEFAULT_SYSTEM = "You are a helpful assistant. Answer the question using the passages."


class PromptError(RequestError):
    """A request that cannot be made into a prompt; `param` names the field at fault."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def fallback_chat_text(messages: list[dict]) -> str:
    """A plain template for tokenizers without one: role headers, then the assistant's turn."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


def chat_text(tokenizer, messages: list[dict]) -> str:
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return fallback_chat_text(messages)


def completion_prompt(tokenizer, separator: str, sep_ids: list[int], prompt: str | list[int],
                      documents: Sequence[str] | None, system: str | None) -> Prompt:
    """A text prompt (the question, when documents come with it) or token ids, as given."""
    if isinstance(prompt, list):
        if documents:
            raise PromptError("documents go with a text prompt (the question), not with token ids", "documents")
        return Prompt(prompt)
    if documents:
        return rag(tokenizer, sep_ids, prompt, documents, system)
    _need_tokenizer(tokenizer)
    return Prompt(tokenize_prompt(tokenizer, prompt, separator))


def chat_prompt(tokenizer, separator: str, sep_ids: list[int], messages: list[dict],
                documents: Sequence[str] | None, system: str | None) -> Prompt:
    """Messages through the model's chat template (or the plain fallback), with the documents at the
    start of the last user turn."""
    _need_tokenizer(tokenizer)
    if not documents:
        if system is not None:
            messages = [{"role": "system", "content": system}, *messages]
        return Prompt(tokenize_prompt(tokenizer, chat_text(tokenizer, messages), separator))
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is None:
        raise PromptError("documents need a user message to go with", "messages")
    mark = docs_mark()
    messages = [dict(m) for m in messages]
    messages[last_user]["content"] = mark + messages[last_user]["content"]
    # A system turn comes first, so that the prefix (and the chunk keys derived from it) match
    # what storing the documents precomputed.
    if messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system or DEFAULT_SYSTEM})
    text = chat_text(tokenizer, messages)
    return _kept_whole(tokenizer, documents, lambda: documents_at_mark(tokenizer, text, mark, documents, sep_ids))


def rag(tokenizer, sep_ids: list[int], question: str, documents: Sequence[str], system: str | None) -> Prompt:
    """The question after the documents, after the system prompt (blend.segment.rag_prompt)."""
    _need_tokenizer(tokenizer)
    return _kept_whole(tokenizer, documents,
                       lambda: rag_prompt(tokenizer, sep_ids, system or DEFAULT_SYSTEM, question, documents))


def chunk_prompt(tokenizer, sep_ids: list[int], documents: Sequence[str], system: str | None) -> Prompt:
    """The prompt that storing documents precomputes: the documents after the system prompt and an
    empty question."""
    return rag(tokenizer, sep_ids, "", documents, system)


def _kept_whole(tokenizer, documents: Sequence[str], build) -> Prompt:
    """`build()`, the prompt of these documents, where each is exactly one chunk; else a PromptError on
    `documents`: one holding the separator, or one the tokenizer keeps nothing of (some control characters
    alone), which would silently shift which chunk is which document's."""
    try:
        built = build()
    except SeparatorInDocument as e:
        raise PromptError(str(e), "documents") from None
    if len(built.seg.chunks) != len(documents):
        empty = next((i for i, d in enumerate(documents, 1) if not tokenizer.encode(d, add_special_tokens=False)), "")
        raise PromptError(f"document {empty} holds no tokens (the tokenizer keeps nothing of its text): "
                          "each must hold text", "documents")
    return built


def _need_tokenizer(tokenizer) -> None:
    if tokenizer is None:
        raise PromptError("this model has no tokenizer: send the prompt as token ids", "prompt")
