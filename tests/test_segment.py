"""Finding separators, splitting a prompt into prefix/chunks/suffix, and tokenizing text prompts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvblend.blend.segment import (SeparatorInDocument, check_documents_kept_whole, find_separators, join_prompt,
                                   join_segments, segment, separator_ids, tokenize_prompt)

SEP = [9, 9]


# ---- find_separators --------------------------------------------------------------------------

def test_find_separators_overlapping_pattern_is_taken_left_to_right_without_overlap() -> None:
    assert find_separators([5, 5, 5, 5, 5], [5, 5]) == [(0, 2), (2, 4)]
    assert find_separators([5, 5, 5], [5, 5]) == [(0, 2)]


def test_find_separators_none() -> None:
    assert find_separators([1, 2, 3, 9, 1], SEP) == []
    assert find_separators([], SEP) == []
    assert find_separators([9], SEP) == []


def test_find_separators_at_start_and_end() -> None:
    assert find_separators([9, 9, 1, 2, 9, 9], SEP) == [(0, 2), (4, 6)]


def test_find_separators_partial_match_then_full_match() -> None:
    # 9 1 is not the separator; the real one starts one token later.
    assert find_separators([9, 1, 9, 9, 2], [9, 1, 9, 9]) == [(0, 4)]
    assert find_separators([9, 9, 1, 2], [9, 1]) == [(1, 3)]


# ---- segment ----------------------------------------------------------------------------------

def test_segment_prefix_chunks_suffix() -> None:
    #      prefix  SEP   chunk  SEP    chunk   SEP     suffix
    ids = [1, 2] + SEP + [3] + SEP + [4, 5] + SEP + [6, 7, 8]
    seg = segment(ids, SEP)
    assert seg.n_tokens == len(ids) == 14
    assert seg.prefix == (0, 2)
    assert seg.separators == [(2, 4), (5, 7), (9, 11)]
    assert seg.chunks == [(4, 5), (7, 9)]
    assert seg.suffix == (11, 14)
    assert seg.exact_end == 4  # the prefix and its separator
    assert [ids[a:b] for a, b in seg.chunks] == [[3], [4, 5]]


def test_segment_skips_empty_chunks_between_adjacent_separators() -> None:
    ids = [1] + SEP + SEP + [3] + SEP + SEP + SEP + [4] + SEP + [5]
    seg = segment(ids, SEP)
    assert len(seg.separators) == 6
    assert [ids[a:b] for a, b in seg.chunks] == [[3], [4]]
    assert seg.suffix == (len(ids) - 1, len(ids))


def test_segment_without_separator_is_all_prefix() -> None:
    ids = [1, 2, 3]
    seg = segment(ids, SEP)
    assert seg.prefix == (0, 3)
    assert seg.chunks == [] and seg.separators == []
    assert seg.suffix == (3, 3)
    assert seg.exact_end == 3


def test_segment_single_separator_has_no_chunks() -> None:
    seg = segment([1, 2] + SEP + [3], SEP)
    assert seg.prefix == (0, 2)
    assert seg.chunks == []
    assert seg.suffix == (4, 5)
    assert seg.exact_end == 4


def test_segment_empty_prefix_and_suffix() -> None:
    ids = SEP + [3, 4] + SEP
    seg = segment(ids, SEP)
    assert seg.prefix == (0, 0)
    assert seg.chunks == [(2, 4)]
    assert seg.suffix == (6, 6)
    assert seg.exact_end == 2


# ---- join_segments ----------------------------------------------------------------------------

def test_join_segments_layout() -> None:
    assert join_segments([1], [[2], [3, 4]], [5], SEP) == [1, 9, 9, 2, 9, 9, 3, 4, 9, 9, 5]
    assert join_segments([1], [], [5], SEP) == [1, 9, 9, 5]


def test_join_then_segment_round_trip() -> None:
    prefix, suffix = [1, 2], [7, 8, 6]
    chunks = [[10, 11, 12], [20], [30, 31]]
    ids = join_segments(prefix, chunks, suffix, SEP)
    seg = segment(ids, SEP)
    assert ids[slice(*seg.prefix)] == prefix
    assert [ids[a:b] for a, b in seg.chunks] == chunks
    assert ids[slice(*seg.suffix)] == suffix
    assert len(seg.separators) == len(chunks) + 1


@given(st.lists(st.integers(10, 14), max_size=4), st.lists(st.lists(st.integers(10, 14), max_size=5), max_size=5),
       st.lists(st.integers(10, 14), max_size=4))
def test_a_joined_prompt_carries_the_segments_the_separator_gives(prefix, chunks, suffix) -> None:
    built = join_prompt(prefix, chunks, suffix, SEP)
    assert built.ids == join_segments(prefix, chunks, suffix, SEP)
    assert built.seg == segment(built.ids, SEP)


def test_join_then_segment_drops_empty_chunks_only() -> None:
    ids = join_segments([1], [[2], [], [3]], [4], SEP)
    seg = segment(ids, SEP)
    assert [ids[a:b] for a, b in seg.chunks] == [[2], [3]]


@pytest.mark.parametrize("docs,bad", [
    ([[2], [3, 9, 9, 4], [5]], 2),  # the separator inside a document
    ([[2, 9], [3]], 1),  # a document ending in the separator's first id: the joined ids move the separator
    ([[9], [3]], 1),
])
def test_a_document_holding_the_separator_is_refused_by_number(docs, bad) -> None:
    prefix = [1]
    ids = join_segments(prefix, docs, [7], SEP)
    with pytest.raises(SeparatorInDocument, match=f"document {bad} holds the separator"):
        check_documents_kept_whole(ids, prefix, docs, SEP)


def test_documents_kept_whole_pass_and_a_question_may_hold_the_separator() -> None:
    docs = [[2], [3, 4], [], [5]]
    check_documents_kept_whole(join_segments([1], docs, [7, 9, 9, 8], SEP), [1], docs, SEP)
    check_documents_kept_whole(join_segments([9, 9, 1], docs, [7], SEP), [9, 9, 1], docs, SEP)


# ---- tokenize_prompt with the default model's tokenizer -----------------------------------------

TEXT_SEP = " # # "


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from kvblend.model.loader import _gguf_as_folder, resolve_model_path, weights_identity

    path = resolve_model_path("smollm2-135m-instruct")
    folder = _gguf_as_folder(path, weights_identity(path))  # converts once if the cache lacks it
    return AutoTokenizer.from_pretrained(folder)


def test_separator_ids_nonempty(tokenizer) -> None:
    sep = separator_ids(tokenizer, TEXT_SEP)
    assert len(sep) >= 2
    assert tokenizer.decode(sep) == TEXT_SEP
    with pytest.raises(ValueError):
        separator_ids(tokenizer, "")


def test_tokenize_prompt_keeps_separator_ids_and_pieces(tokenizer) -> None:
    pieces = ["Answer the question from the passages.", "Paris is the capital of France.",
              "The Thames flows through London.", "Question: where is Paris? Answer:"]
    text = TEXT_SEP.join(pieces)
    sep = separator_ids(tokenizer, TEXT_SEP)
    ids = tokenize_prompt(tokenizer, text, TEXT_SEP)

    seg = segment(ids, sep)
    assert len(seg.separators) == len(pieces) - 1
    assert all(ids[a:b] == sep for a, b in seg.separators)
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    assert ids[slice(*seg.prefix)] == tokenizer.encode(pieces[0], add_special_tokens=True)
    assert [ids[a:b] for a, b in seg.chunks] == [encode(p) for p in pieces[1:-1]]
    assert ids[slice(*seg.suffix)] == encode(pieces[-1])
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_whole_string_tokenization_would_merge_separator_into_next_word(tokenizer) -> None:
    # The separator ends in a space; a byte-level BPE tokenizer given the whole string glues that
    # space onto the next word (" Paris"), so the separator's own ids are not in the result and the
    # chunk's ids would depend on what precedes it. That is why tokenize_prompt goes piece by piece.
    text = "Context:" + TEXT_SEP + "Paris is big." + TEXT_SEP + "Question?"
    sep = separator_ids(tokenizer, TEXT_SEP)
    whole = tokenizer.encode(text)
    pieces = tokenize_prompt(tokenizer, text, TEXT_SEP)
    assert whole != pieces
    assert find_separators(whole, sep) == []
    assert len(find_separators(pieces, sep)) == 2
