"""The connector in vLLM's scheduler process: which requests kvblend prefills, and where.

A prompt is blended when it holds chunks between the separator's exact ids (kvblend's own
segmentation) and the model's rotary passed kvblend's re-encoding gate. Then every prompt row
but the last, past vLLM's own prefix-cache hit, is reported as external: the worker computes
them by blending and writes their KV into the request's blocks; vLLM computes the last row and
decodes. Any other request is vLLM's as usual. Chunks are looked up by the worker, which reads
the store (its memory tier is its own process's; disk and Redis are shared with every process).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..blend.fusor import MODES
from ..blend.segment import segment

log = logging.getLogger(__name__)


@dataclass
class LoadJob:
    """One request's rows [start, end) for kvblend to compute and write into its blocks."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int  # rows before it are vLLM's own prefix-cache hit, left as they are
    end: int  # the prompt's last row: vLLM computes it, and the logits, itself
    mode: str
    ratio: float | None = None  # the request's own recompute ratio, else the settings'


@dataclass
class Pending:
    request: object
    external: int
    mode: str
    ratio: float | None


@dataclass
class SchedulerSide:
    sep_ids: list[int]
    mode: str  # the settings' mode: full serves every request with vLLM's own prefill
    rerotation_ok: bool
    pending: dict[str, Pending] = field(default_factory=dict)
    # One blended prompt per step, as kvblend's own engine loop admits one prefill per step: the
    # worker blends a step's prompts one after another before the step's forward, so admitting all
    # waiting prompts at once would hold every first token until the last blend is done.
    admitted: bool = False

    def request_mode(self, request) -> tuple[str, float | None]:
        """The request's own mode and ratio (kv_transfer_params {"kvblend": {"mode": ..., "ratio": ...}}),
        else the settings' (a value out of range is ignored, not an error: the request is still served)."""
        params = getattr(request, "kv_transfer_params", None)
        own = params.get("kvblend") if isinstance(params, dict) else None
        own = own if isinstance(own, dict) else {}
        mode = own.get("mode", self.mode)
        ratio = own.get("ratio")
        ratio = float(ratio) if isinstance(ratio, (int, float)) and 0 <= ratio <= 1 else None
        return (mode if mode in MODES else self.mode), ratio

    def matched(self, request, num_computed: int) -> int | None:
        """How many rows past vLLM's own hit kvblend will provide (0: none, vLLM as usual; None: ask
        again at the next step, this one has its blended prompt)."""
        ids = list(request.prompt_token_ids or [])
        mode, _ = self.request_mode(request)
        if mode not in ("reuse", "blend") or not self.rerotation_ok or len(ids) - 1 <= num_computed:
            return 0
        params = getattr(request, "sampling_params", None)
        if params is not None and getattr(params, "prompt_logprobs", None) is not None:
            return 0  # every prompt row's logits are asked for: only a full prefill has them
        if not segment(ids, self.sep_ids).chunks:
            return 0
        if self.admitted:
            return None
        self.admitted = True
        return len(ids) - 1 - num_computed

    def after_alloc(self, request, external: int) -> None:
        if external > 0:
            self.pending[request.request_id] = Pending(request, external, *self.request_mode(request))
        else:
            self.pending.pop(request.request_id, None)

    def jobs(self, scheduler_output) -> list[LoadJob]:
        """The loads of the requests scheduled for the first time this step (a new step begins)."""
        self.admitted = False
        out = []
        for new in scheduler_output.scheduled_new_reqs:
            p = self.pending.pop(new.req_id, None)
            if p is None:
                continue
            out.append(self._job(new.req_id, p, new.block_ids[0]))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):  # resumed after preemption: its blocks are new ones
            if req_id in cached.resumed_req_ids and req_id in self.pending and cached.new_block_ids[i] is not None:
                out.append(self._job(req_id, self.pending.pop(req_id), cached.new_block_ids[i][0]))
        return out

    @staticmethod
    def _job(req_id: str, p: Pending, block_ids: list[int]) -> LoadJob:
        ids = list(p.request.prompt_token_ids)
        end = len(ids) - 1
        return LoadJob(req_id, ids, list(block_ids), end - p.external, end, p.mode, p.ratio)

    def finished(self, request) -> None:
        self.pending.pop(request.request_id, None)
