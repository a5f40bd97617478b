"""The HTTP app: OpenAI's completions, chat completions and models, kvblend's chunks, health and
metrics, and a page to try it. Handlers validate, tokenize and queue; the engine loop
(scheduler.py) computes; handlers turn the token ids it sends back into text."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import logging
import queue
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib import resources

from fastapi import Depends, FastAPI, Query, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from ..engine.engine import Engine, RequestError
from ..engine.sampler import SamplingParams
from . import access_log, prompts
from .errors import APIError, bad_request, internal, not_found, overloaded, unauthorized
from .http_input import read_json, validation_error, wait_disconnect
from .metrics import MetricsMiddleware, ServerMetrics
from .replies import Reply
from .scheduler import Request, Scheduler
from .schemas import NAMESPACE_PATTERN, ChatRequest, ChunksRequest, CompletionRequest, Sampling
from .text_stream import TextStream

log = logging.getLogger(__name__)
# How long POST /v1/chunks waits for its chunks to reach the shared tiers (disk, Redis) before
# answering anyway: they are in this process's memory already, just not yet visible to replicas.
SHARED_WRITE_TIMEOUT_S = 30.0


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


def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    access_log.install()  # the page's `/?key=` must not reach the access log
    metrics = ServerMetrics()
    scheduler = Scheduler(engine, metrics, config.max_queue, config.max_batch)
    metrics.watch(lambda: scheduler.queue_depth, lambda: scheduler.active, lambda: scheduler.kv_bytes,
                  lambda: engine.store.used_bytes, lambda: len(engine.store))
    metrics.watch_store(engine.store.stats)
    metrics.watch_engine(lambda: engine.neighbour_reencodes)
    tokenizer = engine.tokenizer
    chunks: dict[str, dict] = {}  # key -> {key, namespace, n_tokens, created}: what /v1/chunks stored
    if tokenizer is not None and not prompts.has_chat_template(tokenizer):
        log.warning("the tokenizer has no chat template: chat requests use kvblend's plain role-header template")

    async def catch_up():
        """Writes lost while a tier (Redis) was down go to it once it is back."""
        while True:
            await asyncio.sleep(config.catch_up_s)
            if engine.store.catch_up():
                log.info("store: writing again what a tier missed while it was down")

    @asynccontextmanager
    async def lifespan(_app):
        scheduler.start()
        catching_up = asyncio.create_task(catch_up())
        yield
        catching_up.cancel()
        scheduler.stop()

    app = FastAPI(title="kvblend", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler, app.state.metrics, app.state.engine = scheduler, metrics, engine
    app.add_middleware(MetricsMiddleware, metrics=metrics)

    # ---- errors: always OpenAI's shape ---------------------------------------------------------

    @app.exception_handler(APIError)
    async def _api_error(_req, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_req, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        return validation_error(err).response()

    @app.exception_handler(HTTPException)
    async def _http(_req, e: HTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return APIError(e.status_code, str(e.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def _unexpected(_req, e: Exception):
        log.exception("unhandled error")
        return internal(f"internal error: {type(e).__name__}").response()

    # ---- who is asking -------------------------------------------------------------------------

    def tenant(request: HTTPRequest) -> str:
        """The caller's cache namespace: one per API key, so tenants never share cached KV."""
        if not config.api_keys:
            return engine.settings.namespace
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(token.encode(), k.encode())
                                                 for k in config.api_keys):
            raise unauthorized()
        return "key-" + hashlib.sha256(token.encode()).hexdigest()[:16]

    def namespace(base: str, requested: str | None) -> str:
        return f"{base}/{requested}" if requested else base

    # ---- requests in -----------------------------------------------------------------------------

    async def body_of(request: HTTPRequest, schema: type[BaseModel]):
        data = await read_json(request, config.max_body_bytes)
        try:
            return schema.model_validate(data)
        except ValidationError as e:
            raise validation_error(e.errors()[0]) from None

    def check_model(name: str) -> None:
        if name != config.model_name:
            raise not_found(f"model {name!r} is not served here; this server serves {config.model_name!r}",
                            "model", "model_not_found")

    def check_documents(documents: list[str] | None) -> None:
        if documents and len(documents) > config.max_documents:
            raise bad_request(f"{len(documents)} documents; at most {config.max_documents} per request",
                              "documents")

    def generation(body: Sampling, ids: list[int], max_tokens: int | None, default_max: int, ns: str) -> Request:
        forced = body.kvblend.forced_tokens if body.kvblend else None
        if forced is not None:
            max_tokens = forced_count(forced, max_tokens, body)
        if max_tokens is None:  # unset: the default, as far as the server's limit and the context allow
            max_tokens = max(1, min(default_max, config.max_tokens, engine.max_len - len(ids)))
        if max_tokens > config.max_tokens:
            raise bad_request(f"max_tokens {max_tokens} is over this server's limit of {config.max_tokens}",
                              "max_tokens")
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
        return Request(ids, params, mode, ns, blend_cfg, forced=forced,
                       top_logprobs=body.top_logprobs_wanted()).bind()

    def forced_count(forced: list[int], max_tokens: int | None, body: Sampling) -> int:
        """Forced tokens are the whole continuation: max_tokens is their count."""
        param = "kvblend.forced_tokens"
        vocab = engine.runner.cfg.vocab_size
        bad = [t for t in forced if t >= vocab]
        if bad:
            raise bad_request(f"{param}: token ids {bad[:5]} are out of the vocabulary: ids must be in [0, {vocab})",
                              param)
        if max_tokens is not None and max_tokens != len(forced):
            raise bad_request(f"max_tokens {max_tokens} differs from the {len(forced)} forced tokens: leave it out "
                              "or give their count", "max_tokens")
        if body.stop:
            raise bad_request("stop strings cannot end a forced continuation: leave stop out", "stop")
        if len(forced) > config.max_tokens:
            raise bad_request(f"{len(forced)} forced tokens; at most {config.max_tokens} (this server's max_tokens)",
                              param)
        return len(forced)

    def submit(req: Request) -> None:
        try:
            scheduler.submit(req)
        except queue.Full:
            raise overloaded(config.max_queue) from None

    # ---- routes ----------------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest, base: str = Depends(tenant)):
        body = await body_of(request, CompletionRequest)
        check_model(body.model)
        check_documents(body.documents)
        ids = prompts.completion_ids(tokenizer, engine.settings.separator, engine.sep_ids, body.prompt,
                                     body.documents, body.system)
        req = generation(body, ids, body.max_tokens, config.completion_max_tokens, namespace(base, body.namespace))
        return await respond(request, req, body, "text_completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest, base: str = Depends(tenant)):
        body = await body_of(request, ChatRequest)
        check_model(body.model)
        check_documents(body.documents)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        ids = prompts.chat_ids(tokenizer, engine.settings.separator, engine.sep_ids, messages, body.documents,
                               body.system)
        req = generation(body, ids, body.max_completion_tokens or body.max_tokens, config.max_tokens,
                         namespace(base, body.namespace))
        return await respond(request, req, body, "chat.completion")

    async def respond(request: HTTPRequest, req: Request, body: Sampling, kind: str):
        submit(req)
        stream = Reply(req, TextStream(tokenizer, req.params.stop), kind, config.model_name, metrics,
                       tokens_as_ids=body.return_tokens_as_token_ids)
        if body.stream:
            return StreamingResponse(stream.sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        collect = asyncio.ensure_future(stream.collect())
        gone = asyncio.ensure_future(wait_disconnect(request))
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not collect.done():  # the client left: stop computing for it
            req.cancel()
            collect.cancel()
            stream.client_left()
            return Response(status_code=499)
        return JSONResponse(collect.result())

    def model_card() -> dict:
        return {"id": config.model_name, "object": "model", "created": 0, "owned_by": "kvblend",
                "max_model_len": engine.max_len}

    @app.get("/v1/models")
    async def models(_base: str = Depends(tenant)):
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")  # :path, since model names hold slashes (org/name)
    async def model(model_id: str, _base: str = Depends(tenant)):
        check_model(model_id)
        return model_card()

    @app.post("/v1/chunks")
    async def store_chunks(request: HTTPRequest, base: str = Depends(tenant)):
        body = await body_of(request, ChunksRequest)
        check_documents(body.documents)
        ids = prompts.chunk_prompt_ids(tokenizer, engine.sep_ids, body.documents, body.system)
        try:
            engine.check_ids(ids)
        except RequestError as e:
            raise bad_request(str(e), "documents") from None
        seg = engine.segments(ids)
        if len(seg.chunks) != len(body.documents):  # separators inside documents were refused above
            raise bad_request("a document holds no tokens: each must hold text", "documents")
        ns = namespace(base, body.namespace)

        def precompute(eng: Engine):
            # The documents join the namespace's collection: each is precomputed after its most
            # similar chunk of this namespace (never another's), found again by every replica.
            eng.index_collection([ids])
            stored = eng.precompute(ids, seg)
            context = eng.keys.context_ids(ids, seg)
            return stored, [(eng.keys.chunk_key(ids[a:b], context), b - a) for a, b in seg.chunks]

        try:
            future = scheduler.run_job(scheduler.namespaced(ns, precompute))
        except queue.Full:
            raise overloaded(config.max_queue) from None
        scheduler.reencode_neighbours(ns, ids)  # older chunks these documents are much closer to
        stored, keys = await asyncio.wrap_future(future)
        # Answer once the chunks are written behind too, so another replica on the same Redis hits them.
        if not await asyncio.to_thread(engine.store.wait_written, [k for k, _ in keys], SHARED_WRITE_TIMEOUT_S):
            log.warning("chunks: not all written to the shared tiers after %.0f s; answering anyway",
                        SHARED_WRITE_TIMEOUT_S)
        now = int(time.time())
        data = []
        for key, n in keys:
            chunks.setdefault(key, {"key": key, "namespace": ns, "n_tokens": n, "created": now})
            tiers = await asyncio.to_thread(engine.store.holding, key)
            # stored: in every configured tier, so a replica on the same Redis hits it too.
            data.append({"key": key, "n_tokens": n, "stored": len(tiers) == len(engine.store.tiers), "tiers": tiers})
        owed = engine.store.missed_by(k for k, _ in keys)
        if owed:
            log.warning("chunks: %s down; %d chunks held in %s, written to it when it is back", ", ".join(owed),
                        len(keys), ", ".join(sorted({t for d in data for t in d["tiers"]})) or "no tier")
        return {"object": "list", "data": data, "stored_new": stored, "namespace": ns, "catch_up_tiers": owed}

    @app.get("/v1/chunks")
    async def list_chunks(namespace_: str | None = Query(None, alias="namespace", pattern=NAMESPACE_PATTERN),
                          base: str = Depends(tenant)):
        ns = namespace(base, namespace_)
        for key in [k for k in chunks if k not in engine.store]:  # evicted since: no longer there
            chunks.pop(key)
        return {"object": "list", "data": [c for c in chunks.values() if c["namespace"] == ns]}

    @app.delete("/v1/chunks/{key}")
    async def delete_chunk(key: str, namespace_: str | None = Query(None, alias="namespace", pattern=NAMESPACE_PATTERN),
                           base: str = Depends(tenant)):
        entry = chunks.get(key)
        if entry is None or entry["namespace"] != namespace(base, namespace_):
            raise not_found(f"no chunk {key!r} in this namespace", "key")
        chunks.pop(key)
        engine.store.delete(key)
        return {"key": key, "deleted": True}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": config.model_name, "queue_depth": scheduler.queue_depth,
                "running": scheduler.active, "kv_bytes": scheduler.kv_bytes,
                "store_bytes": engine.store.used_bytes, "store_entries": len(engine.store),
                "chat_template": "model" if prompts.has_chat_template(tokenizer) else "fallback",
                "blend_available": engine.rerotation_ok}

    @app.get("/metrics")
    async def prometheus():
        content, media_type = metrics.render()
        return Response(content, media_type=media_type)

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(resources.files("kvblend.server").joinpath("page.html").read_text(encoding="utf-8"))

    return app
