"""Prompts that blend through vLLM, whose tokenizer sees them whole: the separator must keep its ids."""

import logging

import pytest
from conftest import SEPARATOR

from kvblend.blend.segment import segment, separator_ids
from kvblend.vllm import rag_messages, rag_prompt_text
from kvblend.vllm.connector import warn_if_separator_splits


def test_a_special_token_separator_survives_whole_tokenization(tokenizer):
    docs = ["The first passage.", "A second one, longer than the first."]
    text = rag_prompt_text(tokenizer, "Which is longer?", docs, SEPARATOR)
    ids = tokenizer.encode(text, add_special_tokens=False)
    seg = segment(ids, separator_ids(tokenizer, SEPARATOR))
    assert [tokenizer.decode(ids[a:b]) for a, b in seg.chunks] == docs
    assert [tokenizer.encode(d, add_special_tokens=False) for d in docs] == [ids[a:b] for a, b in seg.chunks]


def test_the_default_separator_is_warned_about(tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="kvblend.vllm.connector"):
        warn_if_separator_splits(tokenizer, separator_ids(tokenizer, " # # "), " # # ")
    assert "special token" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvblend.vllm.connector"):
        warn_if_separator_splits(tokenizer, separator_ids(tokenizer, SEPARATOR), SEPARATOR)
    assert not caplog.text


def test_a_document_holding_the_separator_is_refused():
    with pytest.raises(ValueError, match="document 2 holds the separator"):
        rag_messages("Why?", ["fine", f"split{SEPARATOR}here"], SEPARATOR)
