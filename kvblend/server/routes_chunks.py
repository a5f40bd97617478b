"""/v1/chunks: documents precomputed and stored ahead of requests, listed and evicted, per namespace."""

from __future__ import annotations

import asyncio
import logging
import queue
import time

from fastapi import APIRouter, Depends, Query, Request as HTTPRequest

from ..engine.engine import Engine, RequestError
from ..engine.prompts import chunk_prompt
from .context import Server, server, tenant
from .errors import bad_request, not_found, overloaded
from .schemas import NAMESPACE_PATTERN, ChunksRequest

log = logging.getLogger(__name__)
router = APIRouter()
# How long POST /v1/chunks waits for its chunks to reach the shared tiers (disk, Redis) before
# answering anyway: they are in this process's memory already, just not yet visible to replicas.
SHARED_WRITE_TIMEOUT_S = 30.0


@router.post("/v1/chunks")
async def store_chunks(request: HTTPRequest, base: str = Depends(tenant), s: Server = Depends(server)):
    body = await s.body_of(request, ChunksRequest)
    s.check_documents(body.documents)
    engine, scheduler = s.engine, s.scheduler
    built = chunk_prompt(s.tokenizer, engine.sep_ids, body.documents, body.system)
    ids, seg = built.ids, built.seg
    try:
        engine.check_ids(ids)
    except RequestError as e:
        raise bad_request(str(e), "documents") from None
    ns = s.namespace(base, body.namespace)

    def precompute(eng: Engine):
        # The documents join the namespace's collection: each is precomputed after its most
        # similar chunk of this namespace (never another's), found again by every replica.
        eng.index_collection([ids], [seg])
        stored = eng.precompute(ids, seg)
        context = eng.keys.context_ids(ids, seg)
        return stored, [(eng.keys.chunk_key(ids[a:b], context), b - a) for a, b in seg.chunks]

    try:
        future = scheduler.run_job(scheduler.namespaced(ns, precompute))
    except queue.Full:
        raise overloaded(s.config.max_queue) from None
    scheduler.reencode_neighbours(ns, ids, seg)  # older chunks these documents are much closer to
    stored, keys = await asyncio.wrap_future(future)
    # Answer once the chunks are written behind too, so another replica on the same Redis hits them.
    if not await asyncio.to_thread(engine.store.wait_written, [k for k, _ in keys], SHARED_WRITE_TIMEOUT_S):
        log.warning("chunks: not all written to the shared tiers after %.0f s; answering anyway",
                    SHARED_WRITE_TIMEOUT_S)
    now = int(time.time())
    data = []
    for key, n in keys:
        s.chunks.setdefault(key, {"key": key, "namespace": ns, "n_tokens": n, "created": now})
        tiers = await asyncio.to_thread(engine.store.holding, key)
        # stored: in every configured tier, so a replica on the same Redis hits it too.
        data.append({"key": key, "n_tokens": n, "stored": len(tiers) == len(engine.store.tiers), "tiers": tiers})
    owed = engine.store.missed_by(k for k, _ in keys)
    if owed:
        log.warning("chunks: %s down; %d chunks held in %s, written to it when it is back", ", ".join(owed),
                    len(keys), ", ".join(sorted({t for d in data for t in d["tiers"]})) or "no tier")
    return {"object": "list", "data": data, "stored_new": stored, "namespace": ns, "catch_up_tiers": owed}


@router.get("/v1/chunks")
async def list_chunks(namespace_: str | None = Query(None, alias="namespace", pattern=NAMESPACE_PATTERN),
                      base: str = Depends(tenant), s: Server = Depends(server)):
    ns = s.namespace(base, namespace_)
    for key in [k for k in s.chunks if k not in s.engine.store]:  # evicted since: no longer there
        s.chunks.pop(key)
    return {"object": "list", "data": [c for c in s.chunks.values() if c["namespace"] == ns]}


@router.delete("/v1/chunks/{key}")
async def delete_chunk(key: str, namespace_: str | None = Query(None, alias="namespace", pattern=NAMESPACE_PATTERN),
                       base: str = Depends(tenant), s: Server = Depends(server)):
    entry = s.chunks.get(key)
    if entry is None or entry["namespace"] != s.namespace(base, namespace_):
        raise not_found(f"no chunk {key!r} in this namespace", "key")
    s.chunks.pop(key)
    s.engine.store.delete(key)
    return {"key": key, "deleted": True}
