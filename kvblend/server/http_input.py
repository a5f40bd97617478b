"""Reading a request body safely: bounded size, strict UTF-8 and JSON, and what a validation
error says; and noticing a client that went away."""

from __future__ import annotations

import json

from fastapi import Request as HTTPRequest

from .errors import APIError, bad_request, too_large


async def read_json(request: HTTPRequest, limit: int) -> dict:
    """The body as a JSON object, read no further than `limit` bytes."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise too_large(limit)
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise too_large(limit)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"request body is not valid UTF-8 (byte {e.start})", code="invalid_utf8") from None
    try:
        data = json.loads(text, parse_constant=_no_constant)
        json.dumps(data, ensure_ascii=False).encode("utf-8")  # lone surrogates ("\ud800") fail here
    except (ValueError, RecursionError) as e:
        raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    return data


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def validation_error(err: dict) -> APIError:
    loc = [str(part) for part in err.get("loc", ()) if part not in ("body",)]
    param = ".".join(loc) or None
    return bad_request(f"{param}: {err['msg']}" if param else err["msg"], param)


async def wait_disconnect(request: HTTPRequest) -> None:
    """Returns when the client goes away (the body is read already: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
