import math

import pytest
import torch

from kvblend.eval import metrics
from kvblend.eval.metrics import gold_score, kl_divergence, kl_listed, normalize_answer, qa_f1, rouge_l, top_logprobs


def test_normalize_answer():
    assert normalize_answer("  The Eiffel-Tower, in PARIS! ") == "eiffeltower in paris"
    assert normalize_answer("an apple a day") == "apple day"
    assert normalize_answer("") == ""


def test_qa_f1_exact_partial_none():
    assert qa_f1("The Eiffel Tower.", ["eiffel tower"]) == 1.0
    # pred tokens {eiffel, tower, paris}, gold {eiffel, tower}: P=2/3, R=1, F1=0.8
    assert qa_f1("Eiffel Tower Paris", ["Eiffel Tower"]) == pytest.approx(0.8)
    assert qa_f1("London", ["Eiffel Tower"]) == 0.0


def test_qa_f1_max_over_answers_and_nested_lists():
    assert qa_f1("Paris", ["London", "Paris"]) == 1.0
    # 2WikiMQA: a list of lists of aliases
    assert qa_f1("Croatia", [["Republic of Croatia"], ["Croatia", "Hrvatska"]]) == 1.0
    # "republic of croatia" -> 3 tokens, 1 shared: P=1, R=1/3, F1=0.5
    assert qa_f1("Croatia", [["Republic of Croatia"]]) == pytest.approx(0.5)
    assert qa_f1("anything", []) == 0.0


def test_qa_f1_counts_repeated_tokens_once_each():
    # pred "paris paris", gold "paris": overlap 1, P=1/2, R=1, F1=2/3
    assert qa_f1("paris paris", ["paris"]) == pytest.approx(2 / 3)


def test_rouge_l_identical_disjoint_empty():
    assert rouge_l("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0)
    assert rouge_l("alpha beta", "gamma delta") == 0.0
    assert rouge_l("", "something") == 0.0
    assert rouge_l("something", "") == 0.0
    assert rouge_l("", "") == 0.0


def test_rouge_l_partial_hand_computed():
    # LCS("a b c d", "a c e") = "a c": P=2/4, R=2/3, F1=2*P*R/(P+R)=4/7
    assert rouge_l("a b c d", "a c e") == pytest.approx(4 / 7)
    # case and punctuation are ignored by the tokenizer
    assert rouge_l("A, B; C. D!", "a c e") == pytest.approx(4 / 7)


def test_rouge_l_fallback_matches_library():
    pytest.importorskip("rouge_score")
    pairs = [
        ("a b c d", "a c e"),
        ("The Occupy LA camp got a reprieve.", "Occupy LA got a two-day reprieve, police said."),
        ("Wilhelm Conrad Röntgen", "Röntgen"),
        ("x y z", "z y x"),
    ]
    for pred, ref in pairs:
        assert metrics._rouge_l_lcs(pred, ref) == pytest.approx(rouge_l(pred, ref))


def test_gold_score_dispatch():
    assert gold_score("Paris", [["Paris"]], "f1") == 1.0
    assert gold_score("a b c d", ["zzz", "a c e"], "rougeL") == pytest.approx(4 / 7)
    with pytest.raises(ValueError, match="metric"):
        gold_score("x", ["x"], "bleu")


def test_kl_identical_is_zero():
    logits = torch.randn(4, 50)
    kl = kl_divergence(logits, logits.clone())
    assert kl.shape == (4,)
    assert torch.allclose(kl, torch.zeros(4), atol=1e-6)


def test_kl_two_class_hand_computed():
    # P = (1/2, 1/2), Q = (3/4, 1/4): KL = 0.5 ln(0.5/0.75) + 0.5 ln(0.5/0.25) = 0.5 ln(4/3)
    p = torch.tensor([[0.0, 0.0]])
    q = torch.tensor([[math.log(3.0), 0.0]])
    assert kl_divergence(p, q).item() == pytest.approx(0.5 * math.log(4 / 3), rel=1e-5)
    # and it is not symmetric: KL(Q||P) = 0.75 ln 1.5 + 0.25 ln 0.5
    assert kl_divergence(q, p).item() == pytest.approx(0.75 * math.log(1.5) + 0.25 * math.log(0.5), rel=1e-5)


def test_kl_nonnegative_float32_and_stable():
    torch.manual_seed(0)
    p = (torch.randn(8, 1000) * 30).to(torch.bfloat16)  # large logits, low precision input
    q = (torch.randn(8, 1000) * 30).to(torch.bfloat16)
    kl = kl_divergence(p, q)
    assert kl.dtype == torch.float32
    assert torch.isfinite(kl).all()
    assert (kl >= 0).all()
    assert (kl > 0).all()  # these distributions really differ


def test_kl_shape_mismatch():
    with pytest.raises(ValueError, match="shapes"):
        kl_divergence(torch.zeros(2, 5), torch.zeros(2, 6))


def test_kl_from_listed_logprobs_is_a_lower_bound_reaching_the_exact_kl():
    torch.manual_seed(0)
    p, q = torch.randn(6, 50) * 2, torch.randn(6, 50) * 2
    exact = kl_divergence(p, q)
    for row in range(6):
        coarse = [kl_listed(top_logprobs(p[row], k), top_logprobs(q[row], k)) for k in (1, 5, 20, 50)]
        assert all(c <= float(exact[row]) + 1e-6 for c in coarse)
        assert coarse[-1] == pytest.approx(float(exact[row]), rel=1e-4, abs=1e-6)  # everything listed: exact
    same = top_logprobs(p[0], 20)
    assert kl_listed(same, dict(same)) == pytest.approx(0.0, abs=1e-9)


def test_kl_listed_two_class_hand_computed_and_rest_bucket():
    # Listed {0} on both sides, the rest one bucket: P = (0.5, 0.5), Q = (0.75, 0.25).
    p, q = {0: math.log(0.5)}, {0: math.log(0.75), 7: math.log(0.2)}  # 7: listed by Q only -> rest
    assert kl_listed(p, q) == pytest.approx(0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25), rel=1e-9)
    tokens = top_logprobs(torch.tensor([0.0, 3.0, 1.0]), 1, also=2)
    assert list(tokens) == [1, 2] and tokens[1] > tokens[2]
