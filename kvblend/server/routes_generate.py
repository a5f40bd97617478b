"""/v1/completions and /v1/chat/completions: a prompt (with its documents) in, tokens streamed or
collected out. The handlers only build the request; the scheduler computes it."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine.prompts import chat_prompt, completion_prompt
from .context import Server, server, tenant
from .http_input import wait_disconnect
from .replies import Reply
from ..engine.requests import Request
from .schemas import ChatRequest, CompletionRequest, Sampling

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: HTTPRequest, base: str = Depends(tenant), s: Server = Depends(server)):
    body = await s.generation_body(request, CompletionRequest)
    prompt = completion_prompt(s.tokenizer, s.engine.settings.separator, s.engine.sep_ids, body.prompt,
                               body.documents, body.system)
    req = s.generation(body, prompt, body.max_tokens, s.config.completion_max_tokens, s.namespace(base, body.namespace))
    return await respond(s, request, req, body, "text_completion")


@router.post("/v1/chat/completions")
async def chat_completions(request: HTTPRequest, base: str = Depends(tenant), s: Server = Depends(server)):
    body = await s.generation_body(request, ChatRequest)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    prompt = chat_prompt(s.tokenizer, s.engine.settings.separator, s.engine.sep_ids, messages, body.documents,
                         body.system)
    req = s.generation(body, prompt, body.max_completion_tokens or body.max_tokens, s.config.max_tokens,
                       s.namespace(base, body.namespace))
    return await respond(s, request, req, body, "chat.completion")


async def respond(s: Server, request: HTTPRequest, req: Request, body: Sampling, kind: str):
    s.submit(req)
    stream = Reply(req, s.tokenizer, kind, s.config.model_name, s.metrics, tokens_as_ids=body.return_tokens_as_token_ids)
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
