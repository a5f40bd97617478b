"""The public Python interface: LLM, SamplingParams and per-request outputs.

    from kvblend import LLM, SamplingParams
    llm = LLM()  # the default model, SmolLM2-135M-Instruct
    out = llm.generate("Where is Marrowick?", SamplingParams(max_tokens=32),
                       documents=["Marrowick is a town ...", "The Tesk river ..."])
    print(out[0].text, out[0].metrics.ttft_s, out[0].metrics.reused_tokens)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from .config import Settings, load_settings
from .engine.engine import Completion, Engine, RequestError, RequestMetrics
from .engine.sampler import SamplingParams
from .model.loader import load_model

__all__ = ["LLM", "SamplingParams", "RequestOutput", "RequestMetrics", "RequestError"]

DEFAULT_SYSTEM = "You are a helpful assistant. Answer the question using the passages."


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    metrics: RequestMetrics


class LLM:
    """An offline engine. Keyword arguments override settings from KVBLEND_* / LMCACHE_* env."""

    def __init__(self, model: str | None = None, dtype: str | None = None, device: str | None = None,
                 settings: Settings | None = None, **overrides):
        self.settings = settings or load_settings(model=model, dtype=dtype, device=device, **overrides)
        loaded = load_model(self.settings.model, self.settings.dtype, self.settings.device)
        self.engine = Engine(loaded, self.settings)
        self.tokenizer = loaded.tokenizer
        self._next_id = 0

    # ---- building prompts ------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a text prompt, separators kept as their exact ids."""
        from .blend.segment import tokenize_prompt

        return tokenize_prompt(self.tokenizer, prompt, self.settings.separator)

    def rag_prompt_ids(self, question: str, documents: Sequence[str], system: str | None = None) -> list[int]:
        """prefix SEP doc_1 SEP ... SEP doc_n SEP question (see blend.segment.rag_prompt_ids)."""
        from .blend.segment import rag_prompt_ids

        return rag_prompt_ids(self.tokenizer, self.engine.sep_ids, system or DEFAULT_SYSTEM, question, documents)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):  # base models (gemma3-270m)
            raise RequestError(f"model {self.settings.model!r} has no chat template: send a plain prompt")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.encode(text)

    # ---- generation ------------------------------------------------------------------------

    def generate(self, prompts: str | Sequence[str] | None = None, sampling_params: SamplingParams | None = None,
                 prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 documents: Sequence[str] | Sequence[Sequence[str]] | None = None, mode: str | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for text prompts or token-id prompts. With `documents`, each prompt is the
        question and the documents become reusable chunks (one list per prompt, or one list for
        a single prompt)."""
        params = sampling_params or SamplingParams()
        requests = self._requests(prompts, prompt_token_ids, documents)
        outputs = []
        for ids in tqdm(requests, desc="generate", disable=not use_tqdm):
            done: Completion = self.engine.generate(ids, params, mode)
            outputs.append(RequestOutput(self._next_id, ids, done.text, done.token_ids, done.finish_reason, done.metrics))
            self._next_id += 1
        return outputs

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None,
             mode: str | None = None) -> RequestOutput:
        return self.generate(prompt_token_ids=[self.chat_ids(messages)], sampling_params=sampling_params, mode=mode)[0]

    def store_documents(self, documents: Sequence[str], system: str | None = None) -> int:
        """Precompute and store documents' KV ahead of requests; returns how many were new.
        The documents given together are a collection: with `neighbour_context` each is
        precomputed after its most similar one (see Settings)."""
        ids = self.rag_prompt_ids("", documents, system)
        self.engine.index_collection([ids])
        stored = self.engine.precompute(ids)
        self.engine.reencode_neighbours(ids)  # older documents these are much closer to
        return stored

    def store_stats(self) -> dict[str, dict]:
        """Per tier: hits, misses, evictions, bad entries, write errors, bytes used and capacity."""
        return self.engine.store.stats()

    def close(self) -> None:
        """Finish the background writes to the disk and Redis tiers."""
        self.engine.close()

    def _requests(self, prompts, prompt_token_ids, documents) -> list[list[int]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise RequestError("give exactly one of prompts or prompt_token_ids")
        if prompts is not None:
            prompts = [prompts] if isinstance(prompts, str) else list(prompts)
            if not prompts:
                raise RequestError("no prompts given")
            if documents is None:
                return [self.encode(p) for p in prompts]
            docs = [documents] if documents and isinstance(documents[0], str) else list(documents)
            if len(docs) != len(prompts):
                raise RequestError(f"{len(prompts)} prompts but {len(docs)} document lists")
            return [self.rag_prompt_ids(p, d) for p, d in zip(prompts, docs)]
        if documents is not None:
            raise RequestError("documents go with text prompts, not prompt_token_ids")
        ids = list(prompt_token_ids)
        if not ids:
            raise RequestError("no prompt token ids given")
        if all(isinstance(t, int) for t in ids):
            return [ids]
        return [list(p) for p in ids]
