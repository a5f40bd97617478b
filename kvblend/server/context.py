"""What every route shares: the engine and its scheduler, the server's limits, and the input
processing all of them go through (who asks, the body, the model, the documents, a generation
request). One per app, kept in app.state.server; routes reach it through `server` and `tenant`."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import queue
from dataclasses import dataclass, field

from fastapi import Request as HTTPRequest
from pydantic import BaseModel, ValidationError

from ..blend.segment import Prompt
from ..engine.engine import Engine, RequestError
from ..engine.sampler import SamplingParams
from ..engine.requests import Request
from ..engine.scheduler import Scheduler
from .errors import bad_request, not_found, overloaded, unauthorized
from .http_input import read_json, validation_error
from .metrics import ServerMetrics
from .schemas import Sampling


@dataclass
class ServerConfig:
    model_name: str  # what /v1/models lists and requests must name
    api_keys: list[str] = field(default_factory=list)  # empty: no authentication
    max_queue: int = 64
    max_batch: int = 32
    max_tokens: int = 2048  # per request
    max_documents: int = 64  # per request
    max_body_bytes: int = 8 << 20
    completion_max_tokens: int = 16  # OpenAI's default for /v1/completions
    catch_up_s: float = 5.0  # how often writes a tier missed while down (Redis) are tried again


@dataclass
class Server:
    engine: Engine
    config: ServerConfig
    metrics: ServerMetrics
    scheduler: Scheduler
    # What /v1/chunks stored: key -> {key, namespace, n_tokens, created}.
    chunks: dict[str, dict] = field(default_factory=dict)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # ---- who is asking -------------------------------------------------------------------------

    def tenant(self, request: HTTPRequest) -> str:
        """The caller's cache namespace: one per API key, so tenants never share cached KV."""
        if not self.config.api_keys:
            return self.engine.settings.namespace
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(token.encode(), k.encode())
                                                 for k in self.config.api_keys):
            raise unauthorized()
        return "key-" + hashlib.sha256(token.encode()).hexdigest()[:16]

    @staticmethod
    def namespace(base: str, requested: str | None) -> str:
        return f"{base}/{requested}" if requested else base

    # ---- requests in -----------------------------------------------------------------------------

    async def body_of(self, request: HTTPRequest, schema: type[BaseModel]):
        data = await read_json(request, self.config.max_body_bytes)
        try:
            return schema.model_validate(data)
        except ValidationError as e:
            raise validation_error(e.errors()[0]) from None

    async def generation_body(self, request: HTTPRequest, schema: type[BaseModel]):
        """A completion or chat body, its model and documents checked."""
        body = await self.body_of(request, schema)
        self.check_model(body.model)
        self.check_documents(body.documents)
        return body

    def check_model(self, name: str) -> None:
        if name != self.config.model_name:
            raise not_found(f"model {name!r} is not served here; this server serves {self.config.model_name!r}",
                            "model", "model_not_found")

    def check_documents(self, documents: list[str] | None) -> None:
        if documents and len(documents) > self.config.max_documents:
            raise bad_request(f"{len(documents)} documents; at most {self.config.max_documents} per request",
                              "documents")

    def generation(self, body: Sampling, prompt: Prompt, max_tokens: int | None, default_max: int,
                   ns: str) -> Request:
        engine, limit, ids = self.engine, self.config.max_tokens, prompt.ids
        forced = body.kvblend.forced_tokens if body.kvblend else None
        if forced is not None:
            max_tokens = self.forced_count(forced, max_tokens, body)
        if max_tokens is None:  # unset: the default, as far as the server's limit and the context allow
            max_tokens = max(1, min(default_max, limit, engine.max_len - len(ids)))
        if max_tokens > limit:
            raise bad_request(f"max_tokens {max_tokens} is over this server's limit of {limit}", "max_tokens")
        try:
            engine.check_ids(ids, max_tokens)
            opts = body.kvblend
            mode = engine.effective_mode(opts.mode if opts else None)
        except RequestError as e:
            raise bad_request(str(e), "prompt") from None
        blend_cfg = None
        if opts and opts.recompute_ratio is not None:
            n = len(engine.blend_cfg.check_layers)
            blend_cfg = dataclasses.replace(engine.blend_cfg, ratios=[opts.recompute_ratio] * n)
        params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                seed=body.seed, stop=list(body.stop or []),
                                ignore_eos=body.ignore_eos or forced is not None)
        return Request(ids, params, mode, ns, blend_cfg, forced=forced, top_logprobs=body.top_logprobs_wanted(),
                       seg=prompt.seg).bind()

    def forced_count(self, forced: list[int], max_tokens: int | None, body: Sampling) -> int:
        """Forced tokens are the whole continuation: max_tokens is their count."""
        param, limit = "kvblend.forced_tokens", self.config.max_tokens
        vocab = self.engine.runner.cfg.vocab_size
        bad = [t for t in forced if t >= vocab]
        if bad:
            raise bad_request(f"{param}: token ids {bad[:5]} are out of the vocabulary: ids must be in [0, {vocab})",
                              param)
        if max_tokens is not None and max_tokens != len(forced):
            raise bad_request(f"max_tokens {max_tokens} differs from the {len(forced)} forced tokens: leave it out "
                              "or give their count", "max_tokens")
        if body.stop:
            raise bad_request("stop strings cannot end a forced continuation: leave stop out", "stop")
        if len(forced) > limit:
            raise bad_request(f"{len(forced)} forced tokens; at most {limit} (this server's max_tokens)", param)
        return len(forced)

    def submit(self, req: Request) -> None:
        try:
            self.scheduler.submit(req)
        except queue.Full:
            raise overloaded(self.config.max_queue) from None


def server(request: HTTPRequest) -> Server:
    """The app's Server (a route dependency)."""
    return request.app.state.server


def tenant(request: HTTPRequest) -> str:
    """The caller's namespace (a route dependency that also checks the API key)."""
    return server(request).tenant(request)
