"""What the server serves and how it is doing: /v1/models, /health, /metrics, and the page at /."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Depends
from fastapi.responses import HTMLResponse, Response

from ..engine.prompts import has_chat_template
from .context import Server, server, tenant

router = APIRouter()


def model_card(s: Server) -> dict:
    return {"id": s.config.model_name, "object": "model", "created": 0, "owned_by": "kvblend",
            "max_model_len": s.engine.max_len}


@router.get("/v1/models")
async def models(_base: str = Depends(tenant), s: Server = Depends(server)):
    return {"object": "list", "data": [model_card(s)]}


@router.get("/v1/models/{model_id:path}")  # :path, since model names hold slashes (org/name)
async def model(model_id: str, _base: str = Depends(tenant), s: Server = Depends(server)):
    s.check_model(model_id)
    return model_card(s)


@router.get("/health")
async def health(s: Server = Depends(server)):
    engine, scheduler = s.engine, s.scheduler
    return {"status": "ok", "model": s.config.model_name, "queue_depth": scheduler.queue_depth,
            "running": scheduler.active, "kv_bytes": scheduler.kv_bytes,
            "store_bytes": engine.store.used_bytes, "store_entries": len(engine.store),
            "chat_template": "model" if has_chat_template(s.tokenizer) else "fallback",
            "blend_available": engine.rerotation_ok}


@router.get("/metrics")
async def prometheus(s: Server = Depends(server)):
    content, media_type = s.metrics.render()
    return Response(content, media_type=media_type)


@router.get("/", response_class=HTMLResponse)
async def page():
    return HTMLResponse(resources.files("kvblend.server").joinpath("page.html").read_text(encoding="utf-8"))
