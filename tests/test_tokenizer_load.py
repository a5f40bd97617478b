"""The tokenizer kvblend loads drops transformers' Python copies of the vocabulary and merges and
tokenizes, renders chats and saves exactly as the tokenizer transformers loads."""

import pytest
from transformers import AutoTokenizer

from kvblend.model.loader import hf_folder
from kvblend.model.tokenizer import drop_construction_copies, load_tokenizer

TEXT = "Passage: Heron wörld 🚀 <|im_start|> the 1987 Ryder Cup\n\n  tabs\tand   spaces"


@pytest.fixture(scope="module")
def folder():
    return hf_folder("qwen2.5-coder-0.5b-instruct")


def test_loaded_tokenizer_drops_copies_and_tokenizes_the_same(folder, tmp_path):
    ours, theirs = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert not hasattr(ours, "_vocab") and not hasattr(ours, "_merges")
    assert len(theirs._vocab) > 100_000  # what is dropped: the copies exist in transformers' own
    ids = theirs.encode(TEXT)
    assert ours.encode(TEXT) == ids and ours.decode(ids) == theirs.decode(ids)
    assert ours.get_vocab() == theirs.get_vocab() and len(ours) == len(theirs)
    chat = [{"role": "user", "content": TEXT}]
    assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(chat, tokenize=False)
    ours.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).encode(TEXT) == ids


def test_classes_that_may_read_their_copies_again_keep_them():
    class WhisperTokenizer:  # saving reads _vocab and _merges back
        _tokenizer = object()
        _vocab, _merges = {"a": 0}, [("a", "b")]

    tok = WhisperTokenizer()
    assert drop_construction_copies(tok) == []
    assert tok._vocab == {"a": 0} and tok._merges == [("a", "b")]
