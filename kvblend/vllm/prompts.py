"""RAG prompts for vLLM, laid out as kvblend stores chunks: system prompt, then each document after
the separator, then the question after one more.

vLLM tokenizes a text or chat prompt whole, so the separator must keep its ids inside text: one
special token of the model does (Qwen2.5's "<|file_sep|>", SmolLM2's "<file_sep>"); " # # " does
not. With such a separator the ids vLLM makes are the ones `kvblend store put` keys chunks by.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..engine.prompts import DEFAULT_SYSTEM, chat_text


def rag_messages(question: str, documents: Sequence[str], separator: str,
                 system: str = DEFAULT_SYSTEM) -> list[dict]:
    """OpenAI chat messages: the system prompt, then one user turn of the documents and the question."""
    for i, doc in enumerate(documents, 1):
        if separator in doc:
            raise ValueError(f"document {i} holds the separator {separator!r}: it would be split into two chunks")
    content = "".join(separator + doc for doc in documents) + separator + question
    return [{"role": "system", "content": system}, {"role": "user", "content": content}]


def rag_prompt_text(tokenizer, question: str, documents: Sequence[str], separator: str,
                    system: str = DEFAULT_SYSTEM) -> str:
    """The same prompt as text, through the model's chat template (for completions)."""
    return chat_text(tokenizer, rag_messages(question, documents, separator, system))
