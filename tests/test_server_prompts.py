"""How request bodies become prompt token ids: documents as chunks, chat templates and their fallback."""

import copy

from serving import default_tokenizer

from kvblend.blend.segment import rag_prompt_ids, segment
from kvblend.server import prompts

SEP = " # # "
DOCS = ["The Sorrel Bridge has seven arches.", "Marrowick lies on the Tesk."]


def test_chat_documents_are_chunks_with_the_chunk_apis_prefix():
    tok = default_tokenizer()
    sep = tok.encode(SEP, add_special_tokens=False)
    ids = prompts.chat_ids(tok, SEP, sep, [{"role": "user", "content": "How many arches?"}], DOCS, None)
    seg = segment(ids, sep)
    assert [ids[a:b] for a, b in seg.chunks] == [tok.encode(d, add_special_tokens=False) for d in DOCS]
    stored = prompts.chunk_prompt_ids(tok, sep, DOCS, None)  # what /v1/chunks precomputes
    assert ids[: seg.exact_end] == stored[: segment(stored, sep).exact_end]  # same prefix: same chunk keys
    assert ids == rag_prompt_ids(tok, sep, "You are a helpful assistant. Answer the question using the passages.",
                                 "How many arches?", DOCS)
    assert "How many arches?" in tok.decode(ids[seg.suffix[0]:])


def test_tokenizer_without_chat_template_gets_the_fallback():
    tok = copy.deepcopy(default_tokenizer())
    tok.chat_template = None
    assert not prompts.has_chat_template(tok)
    sep = tok.encode(SEP, add_special_tokens=False)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.decode(prompts.chat_ids(tok, SEP, sep, messages, None, None))
    assert text == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    with_docs = prompts.chat_ids(tok, SEP, sep, messages, DOCS, None)
    assert len(segment(with_docs, sep).chunks) == 2


def test_text_that_looks_like_a_placeholder_is_just_text():
    # Found by hypothesis: a fixed placeholder string in a message split the prompt in two places.
    tok = default_tokenizer()
    sep = tok.encode(SEP, add_special_tokens=False)
    odd = "\x00KVBLEND_DOCUMENTS\x00"
    messages = [{"role": "system", "content": odd}, {"role": "user", "content": "and?" + odd}]
    ids = prompts.chat_ids(tok, SEP, sep, messages, DOCS, None)
    assert len(segment(ids, sep).chunks) == 2
    assert len(segment(prompts.completion_ids(tok, SEP, sep, odd + "?", DOCS, odd), sep).chunks) == 2
