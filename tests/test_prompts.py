"""How requests become prompts, for LLM and the server alike: documents as chunks whose segments
travel with the prompt, chat templates and their fallback."""

import copy

import pytest

from serving import default_tokenizer

from kvblend.blend.segment import rag_prompt_ids, segment
from kvblend.engine import prompts

SEP = " # # "
DOCS = ["The Sorrel Bridge has seven arches.", "Marrowick lies on the Tesk."]


def test_chat_documents_are_chunks_with_the_chunk_apis_prefix():
    tok = default_tokenizer()
    sep = tok.encode(SEP, add_special_tokens=False)
    built = prompts.chat_prompt(tok, SEP, sep, [{"role": "user", "content": "How many arches?"}], DOCS, None)
    ids, seg = built.ids, built.seg
    assert seg == segment(ids, sep)  # the segments as built are the ones the separator gives
    assert [ids[a:b] for a, b in seg.chunks] == [tok.encode(d, add_special_tokens=False) for d in DOCS]
    stored = prompts.chunk_prompt(tok, sep, DOCS, None)  # what storing the documents precomputes
    assert stored.seg == segment(stored.ids, sep)
    assert ids[: seg.exact_end] == stored.ids[: stored.seg.exact_end]  # same prefix: same chunk keys
    assert ids == rag_prompt_ids(tok, sep, "You are a helpful assistant. Answer the question using the passages.",
                                 "How many arches?", DOCS)
    assert "How many arches?" in tok.decode(ids[seg.suffix[0]:])


def test_tokenizer_without_chat_template_gets_the_fallback():
    tok = copy.deepcopy(default_tokenizer())
    tok.chat_template = None
    assert not prompts.has_chat_template(tok)
    sep = tok.encode(SEP, add_special_tokens=False)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    plain = prompts.chat_prompt(tok, SEP, sep, messages, None, None)
    assert plain.seg is None  # a raw prompt: split by the separator where it is used
    assert tok.decode(plain.ids) == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    with_docs = prompts.chat_prompt(tok, SEP, sep, messages, DOCS, None)
    assert len(with_docs.seg.chunks) == 2 and with_docs.seg == segment(with_docs.ids, sep)


def test_text_that_looks_like_a_placeholder_is_just_text():
    # Found by hypothesis: a fixed placeholder string in a message split the prompt in two places.
    tok = default_tokenizer()
    sep = tok.encode(SEP, add_special_tokens=False)
    odd = "\x00KVBLEND_DOCUMENTS\x00"
    messages = [{"role": "system", "content": odd}, {"role": "user", "content": "and?" + odd}]
    ids = prompts.chat_prompt(tok, SEP, sep, messages, DOCS, None).ids
    assert len(segment(ids, sep).chunks) == 2
    assert len(segment(prompts.completion_prompt(tok, SEP, sep, odd + "?", DOCS, odd).ids, sep).chunks) == 2


def test_prompt_errors_name_the_field_at_fault():
    tok = default_tokenizer()
    sep = tok.encode(SEP, add_special_tokens=False)
    with pytest.raises(prompts.PromptError, match="separator") as e:
        prompts.completion_prompt(tok, SEP, sep, "Which?", ["fine", f"Marrowick{SEP} lies on the Tesk."], None)
    assert e.value.param == "documents"
    with pytest.raises(prompts.PromptError) as e:
        prompts.chat_prompt(tok, SEP, sep, [{"role": "system", "content": "hi"}], DOCS, None)
    assert e.value.param == "messages"
    with pytest.raises(prompts.PromptError) as e:
        prompts.completion_prompt(tok, SEP, sep, [1, 2, 3], DOCS, None)
    assert e.value.param == "documents"
