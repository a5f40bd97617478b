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

from .blend.segment import Prompt
from .config import Settings, load_settings
from .engine.engine import Engine, RequestError, RequestMetrics
from .engine.prompts import chat_prompt, chunk_prompt, completion_prompt, rag
from .engine.sampler import SamplingParams
from .engine.requests import Request
from .engine.scheduler import Scheduler

__all__ = ["LLM", "SamplingParams", "RequestOutput", "RequestMetrics", "RequestError"]


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
        self.engine = Engine.from_settings(self.settings)
        self.loop = Scheduler(self.engine)  # the server's engine loop, run here in the caller's thread
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    # ---- building prompts (as the server builds them: engine/prompts.py) ------------------------

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a text prompt, separators kept as their exact ids."""
        return completion_prompt(self.tokenizer, self.settings.separator, self.engine.sep_ids, prompt, None, None).ids

    def rag_prompt_ids(self, question: str, documents: Sequence[str], system: str | None = None) -> list[int]:
        """prefix SEP doc_1 SEP ... SEP doc_n SEP question (see blend.segment.rag_prompt)."""
        return rag(self.tokenizer, self.engine.sep_ids, question, documents, system).ids

    def chat_ids(self, messages: list[dict], documents: Sequence[str] | None = None, system: str | None = None) -> list[int]:
        """Messages through the chat template (a plain one where the model has none), with the
        documents as chunks at the start of the last user turn."""
        return self._chat_prompt(messages, documents, system).ids

    def _chat_prompt(self, messages, documents, system) -> Prompt:
        return chat_prompt(self.tokenizer, self.settings.separator, self.engine.sep_ids, messages, documents, system)

    # ---- generation ------------------------------------------------------------------------

    def generate(self, prompts: str | Sequence[str] | None = None, sampling_params: SamplingParams | None = None,
                 prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 documents: Sequence[str] | Sequence[Sequence[str]] | None = None, mode: str | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for text prompts or token-id prompts, batched through the engine loop the server
        runs. With `documents`, each prompt is the question and the documents become reusable
        chunks (one list per prompt, or one list for a single prompt)."""
        return self._generate(self._prompts(prompts, prompt_token_ids, documents), sampling_params, mode, use_tqdm)

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None,
             documents: Sequence[str] | None = None, system: str | None = None,
             mode: str | None = None) -> RequestOutput:
        """One chat turn; with `documents`, as reusable chunks at the start of the last user turn
        (the prompt /v1/chat/completions builds)."""
        return self._generate([self._chat_prompt(messages, documents, system)], sampling_params, mode, False)[0]

    def _generate(self, prompts: list[Prompt], sampling_params: SamplingParams | None, mode: str | None,
                  use_tqdm: bool) -> list[RequestOutput]:
        params = sampling_params or SamplingParams()
        for p in prompts:  # every prompt checked before any is computed
            self.engine.check_ids(p.ids, params.max_tokens)
        mode = self.engine.effective_mode(mode)
        requests = [Request(p.ids, params, mode, self.engine.keys.namespace, seg=p.seg) for p in prompts]
        with tqdm(total=len(requests), desc="generate", disable=not use_tqdm) as bar:
            done = self.loop.run(requests, on_done=bar.update)
        outputs = []
        for p, c in zip(prompts, done):
            outputs.append(RequestOutput(self._next_id, p.ids, c.text, c.token_ids, c.finish_reason, c.metrics))
            self._next_id += 1
        return outputs

    def store_documents(self, documents: Sequence[str], system: str | None = None) -> int:
        """Precompute and store documents' KV ahead of requests; returns how many were new.
        The documents given together are a collection: with `neighbour_context` each is
        precomputed after its most similar one (see Settings)."""
        built = chunk_prompt(self.tokenizer, self.engine.sep_ids, documents, system)
        self.engine.index_collection([built.ids], [built.seg])
        stored = self.engine.precompute(built.ids, built.seg)
        self.engine.reencode_neighbours(built.ids, built.seg)  # older documents these are much closer to
        return stored

    def store_stats(self) -> dict[str, dict]:
        """Per tier: hits, misses, evictions, bad entries, write errors, bytes used and capacity."""
        return self.engine.store.stats()

    def close(self) -> None:
        """Finish the background writes to the disk and Redis tiers."""
        self.engine.close()

    def _prompts(self, prompts, prompt_token_ids, documents) -> list[Prompt]:
        if (prompts is None) == (prompt_token_ids is None):
            raise RequestError("give exactly one of prompts or prompt_token_ids")
        if prompts is not None:
            prompts = [prompts] if isinstance(prompts, str) else list(prompts)
            if not prompts:
                raise RequestError("no prompts given")
            if documents is None:
                return [Prompt(self.encode(p)) for p in prompts]
            docs = [documents] if documents and isinstance(documents[0], str) else list(documents)
            if len(docs) != len(prompts):
                raise RequestError(f"{len(prompts)} prompts but {len(docs)} document lists")
            return [rag(self.tokenizer, self.engine.sep_ids, p, d, None) for p, d in zip(prompts, docs)]
        if documents is not None:
            raise RequestError("documents go with text prompts, not prompt_token_ids")
        ids = list(prompt_token_ids)
        if not ids:
            raise RequestError("no prompt token ids given")
        if all(isinstance(t, int) for t in ids):
            return [Prompt(ids)]
        return [Prompt(list(p)) for p in ids]
