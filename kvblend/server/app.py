"""The HTTP app: OpenAI's completions, chat completions and models, kvblend's chunks, health and
metrics, and a page to try it. Handlers validate, tokenize and queue (context.py holds what they
share); the engine loop (scheduler.py) computes; handlers turn the token ids it sends back into
text. Each family of routes is a module: routes_generate, routes_chunks, routes_info."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from ..engine.engine import Engine
from ..engine.prompts import PromptError, has_chat_template
from ..engine.scheduler import Scheduler
from . import access_log, routes_chunks, routes_generate, routes_info
from .context import Server, ServerConfig
from .errors import APIError, bad_request, internal
from .http_input import validation_error
from .metrics import MetricsMiddleware, ServerMetrics

__all__ = ["ServerConfig", "create_app"]
log = logging.getLogger(__name__)


def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    access_log.install()  # the page's `/?key=` must not reach the access log
    metrics = ServerMetrics()
    scheduler = Scheduler(engine, metrics, config.max_queue, config.max_batch)
    metrics.watch(lambda: scheduler.queue_depth, lambda: scheduler.active, lambda: scheduler.kv_bytes,
                  lambda: engine.store.used_bytes, lambda: len(engine.store))
    metrics.watch_store(engine.store.stats)
    metrics.watch_engine(lambda: engine.neighbour_reencodes)
    if engine.tokenizer is not None and not has_chat_template(engine.tokenizer):
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
    app.state.server = Server(engine, config, metrics, scheduler)
    app.state.scheduler, app.state.metrics, app.state.engine = scheduler, metrics, engine
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    install_error_handlers(app)
    for routes in (routes_generate, routes_chunks, routes_info):
        app.include_router(routes.router)
    return app


def install_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape; an unexpected one is a logged 500 that names only its type."""

    @app.exception_handler(APIError)
    async def _api_error(_req, e: APIError):
        return e.response()

    @app.exception_handler(PromptError)
    async def _prompt_error(_req, e: PromptError):
        return bad_request(str(e), e.param).response()

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
