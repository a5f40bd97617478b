"""Quality metrics: SQuAD-style F1, Rouge-L and KL between next-token distributions."""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from functools import lru_cache

import torch

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lowercase, drop punctuation and articles, collapse whitespace (SQuAD)."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _flatten(answers) -> list[str]:
    """Gold answers as a flat list of str (2WikiMQA nests them as [[str, ...], ...])."""
    if isinstance(answers, str):
        return [answers]
    flat: list[str] = []
    for a in answers:
        flat.extend(_flatten(a))
    return flat


def _token_f1(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        # SQuAD convention: two empty answers agree, one empty one does not.
        return float(pred == ref)
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, answers) -> float:
    """Max token F1 of `prediction` over the gold answers (list of str or list of lists)."""
    return max((_token_f1(prediction, a) for a in _flatten(answers)), default=0.0)


# Rouge-L. rouge-score (Google's reference implementation) is used when installed; the
# fallback below tokenizes exactly as it does (lowercase, [a-z0-9]+ tokens, no stemming),
# so both paths give the same numbers.
_NON_ALNUM = re.compile(r"[^a-z0-9]+")


def _rouge_tokens(text: str) -> list[str]:
    return _NON_ALNUM.sub(" ", text.lower()).split()


def _lcs_len(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence, O(len(a) * len(b)) time, O(len(b)) memory."""
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def _rouge_l_lcs(prediction: str, reference: str) -> float:
    pred, ref = _rouge_tokens(prediction), _rouge_tokens(reference)
    if not pred or not ref:
        return 0.0
    lcs = _lcs_len(ref, pred)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


@lru_cache(maxsize=1)
def _rouge_scorer():
    """The rouge-score scorer, or None when the package is missing (imported lazily: nltk is slow)."""
    try:
        from rouge_score import rouge_scorer
    except ImportError:
        return None
    return rouge_scorer.RougeScorer(["rougeL"])


def rouge_l(prediction: str, reference: str) -> float:
    """Rouge-L F1 of `prediction` against `reference`; 0.0 when either has no tokens."""
    scorer = _rouge_scorer()
    if scorer is None:
        return _rouge_l_lcs(prediction, reference)
    return float(scorer.score(reference, prediction)["rougeL"].fmeasure)


def gold_score(prediction: str, answers, metric: str) -> float:
    """Task score against gold answers: "f1" (QA) or "rougeL" (summaries), max over answers."""
    if metric == "f1":
        return qa_f1(prediction, answers)
    if metric == "rougeL":
        return max((rouge_l(prediction, a) for a in _flatten(answers)), default=0.0)
    raise ValueError(f"unknown metric {metric!r}, expected 'f1' or 'rougeL'")


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Per-row KL(P || Q) in nats from [n, vocab] logits; returns shape [n], float32."""
    if p_logits.shape != q_logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(p_logits.shape)} vs {tuple(q_logits.shape)}")
    # float32 + log_softmax: bf16 logits and exp-then-log lose the small probabilities KL is about.
    log_p = torch.log_softmax(p_logits.float(), dim=-1)
    log_q = torch.log_softmax(q_logits.float().to(log_p.device), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
    return kl.clamp_min(0.0)  # rounding can give -1e-9 for equal distributions


def top_logprobs(logits: torch.Tensor, k: int, also: int | None = None) -> dict[int, float]:
    """One position's k most likely tokens and their logprobs (token id -> logprob), plus token
    `also` (the sampled or forced one), as the server's completions logprobs list them."""
    log_p = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(log_p, k)
    out = dict(zip(top.indices.tolist(), top.values.tolist()))
    if also is not None:
        out.setdefault(also, float(log_p[also]))
    return out


def kl_listed(p: dict[int, float], q: dict[int, float]) -> float:
    """KL(P || Q) in nats from the logprobs each side lists (e.g. its top 20): each token listed on
    both sides is a bucket, everything else one "rest" bucket per side (1 minus the listed mass).
    A token listed on one side only has no known probability on the other, so it goes to rest too.
    This coarse-grains both distributions the same way, so it is a lower bound of the exact KL
    (log-sum inequality), equal to it when every token with mass is listed on both sides."""
    shared = p.keys() & q.keys()
    kl, p_rest, q_rest = 0.0, 1.0, 1.0
    for t in shared:
        pt, qt = math.exp(p[t]), math.exp(q[t])
        kl += pt * (p[t] - q[t])
        p_rest, q_rest = p_rest - pt, q_rest - qt
    p_rest, q_rest = max(p_rest, 0.0), max(q_rest, 1e-12)  # rounding: the listed mass can pass 1 by an ulp
    if p_rest > 1e-12:
        kl += p_rest * math.log(p_rest / q_rest)
    return max(kl, 0.0)
