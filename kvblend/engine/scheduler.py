"""The engine loop, the one way prompts are answered. LLM.generate runs it in the caller's thread
until its prompts are done (`run`); the server runs it in a thread of its own (`start`), and its
handlers only put requests in and read events out.

Each step admits at most one waiting request (its prefill, or a job such as precomputing chunks),
then runs one decode step for every running request as one batch (Runner.decode: shared
projections and MLP, attention per sequence). A full prefill longer than PREFILL_PIECE tokens runs
one piece per step, so a long prompt does not stall the streams for its whole prefill (a blend
plan runs in one step: it is short, which is the point). A stream's tokens do not depend on what
else is running. A teacher-forced continuation (kvblend.forced_tokens) is computed in one pass
right after its prefill and never joins the decode batch.

Each sequence's text is decoded here as its tokens come (TextStream), so a stop string ends a
sequence in the same way whoever asked, and a token event carries the text that is safe to show.

Requests wait in a queue (the server bounds it: full, the handler answers 429). A cancelled request
(its client went away) leaves the batch at the next step and its KV is freed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..blend.segment import Segments
from ..model.runner import KEY_BLOCK, KVCache
from .engine import Engine, RequestError, RequestMetrics
from .requests import Collected, Completion, Done, Failed, Job, LoopMetrics, Prefilled, Request
from .sampler import SamplingParams
from .text_stream import TextStream
from .token_picker import Token, TokenPicker

log = logging.getLogger(__name__)


@dataclass
class Sequence:
    """A running request: its KV cache, its token picker, the tokens so far and their text."""

    request: Request
    cache: KVCache
    picker: TokenPicker
    tokens: list[int]
    last: Token  # the newest token, with its logprobs when asked
    metrics: RequestMetrics
    text: TextStream
    missed: list[tuple[int, int]] = field(default_factory=list)  # chunks stored once the answer is done

    @property
    def position(self) -> int:
        """Position of the last token, the one fed to the next decode step."""
        return len(self.request.token_ids) + len(self.tokens) - 1


# Tokens of a full prefill per step. A multiple of the runner's key block: pieces that end on block
# boundaries give bit-identical KV and logits to one pass (see runner.KEY_BLOCK).
PREFILL_PIECE = 2 * KEY_BLOCK
# Chunks one job re-encodes after a closer neighbour: running decode steps go on between jobs, so
# a collection whose many old chunks a post is closer to does not stall the streams.
REENCODE_BATCH = 8


@dataclass
class PiecewisePrefill:
    """A full prefill in progress: rows [0, done) are in the cache."""

    request: Request
    cache: KVCache
    done: int = 0


def prefill_piece(runner, job: PiecewisePrefill, piece: int) -> torch.Tensor | None:
    """Compute the next `piece` rows of a full prefill; the last row's logits once all are done."""
    ids = job.request.token_ids
    end = min(job.done + piece, len(ids))
    logits = runner.forward(torch.tensor(ids[job.done:end]), torch.arange(job.done, end), job.cache)
    job.done = end
    return logits[0] if end == len(ids) else None


class Scheduler:
    def __init__(self, engine: Engine, metrics: LoopMetrics | None = None, max_queue: int = 0, max_batch: int = 32):
        """max_queue: requests that may wait (0: no bound); max_batch: sequences decoded at once."""
        self.engine, self.metrics = engine, metrics or LoopMetrics()
        self.max_queue, self.max_batch = max_queue, max_batch
        self.waiting: queue.Queue = queue.Queue(maxsize=max_queue)
        self.running: list[Sequence] = []
        self.prefilling: PiecewisePrefill | None = None  # a long full prefill, one piece per step
        self.prefill_piece = PREFILL_PIECE
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvblend-engine", daemon=True)
        self.peak_batch = 0  # most sequences decoded in one step so far
        self.prefill_pieces = 0  # pieces of piecewise full prefills run so far

    # ---- the handlers' side -------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def submit(self, item: Request | Job) -> None:
        """Queue a request or job; raises queue.Full when the queue is full."""
        self.waiting.put_nowait(item)

    def run(self, requests: list[Request], on_done: Callable[[], None] | None = None) -> list[Completion]:
        """Answer `requests` in the calling thread, batched as the server batches them; their
        completions in order. A request the engine refused raises RequestError, once all are done."""
        if self._thread.is_alive():
            raise RuntimeError("this engine loop runs in its own thread: submit requests to it")
        gathered = []
        for req in requests:
            gathered.append(Collected())
            req.sink = _then(gathered[-1], on_done)
            self.submit(req)
        # Then the work the answers queued (storing the chunks they missed), as the server does after them.
        while any(g.end is None for g in gathered) or not self.waiting.empty():
            if self.prefilling is None and not self.running and self.waiting.empty():
                raise RuntimeError("the engine loop went idle with requests unanswered")
            self.step()
        return [g.completion() for g in gathered]

    def run_job(self, fn: Callable[[Engine], object]) -> Future:
        job = Job(fn)
        self.submit(job)
        return job.future

    @property
    def active(self) -> int:
        """Requests past the queue: decoding, or in a piecewise prefill."""
        return len(self.running) + (self.prefilling is not None)

    @property
    def queue_depth(self) -> int:
        return self.waiting.qsize()

    @property
    def kv_bytes(self) -> int:
        prefilling = self.prefilling  # read from other threads: a cache may just have gone
        caches = [s.cache for s in list(self.running)] + [prefilling.cache if prefilling else None]
        return sum(c.k.nbytes + c.v.nbytes for c in caches if c is not None)

    # ---- the loop -------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.step(wait=0.05)
        self._fail_all()

    def step(self, wait: float = 0.0) -> None:
        """Admit one waiting item (waiting up to `wait` seconds for one when idle) or run one piece
        of a long full prefill, then one decode step for every running sequence."""
        if self.prefilling is not None:
            self._prefill_step()
        elif len(self.running) < self.max_batch:
            self._admit(wait)
        self._drop_cancelled()
        if self.running:
            self._decode_step()

    def _admit(self, wait: float) -> None:
        """Take one waiting item: a job runs now; a request is prefilled (a long full one piecewise)."""
        try:  # idle: wait for work; busy: only take what is already there
            item = self.waiting.get(timeout=wait) if wait and not self.running else self.waiting.get_nowait()
        except queue.Empty:
            return
        if isinstance(item, Job):
            self._run_job(item)
            return
        item.admitted = time.perf_counter()
        if item.mode == "full" and len(item.token_ids) > self.prefill_piece:
            capacity = len(item.token_ids) + item.params.max_tokens
            self.prefilling = PiecewisePrefill(item, self.engine.runner.new_cache(capacity))
            self._prefill_step()
        else:
            self._prefill(item)

    def _fail_all(self) -> None:
        """Shutting down: tell whoever still listens."""
        if self.prefilling is not None:
            self.prefilling.request.emit(Failed(503, "the server is shutting down"))
            self.prefilling = None
        for seq in self.running:
            seq.request.emit(Failed(503, "the server is shutting down"))
        self.running.clear()
        while True:
            try:
                item = self.waiting.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Job):
                item.future.cancel()
            else:
                item.emit(Failed(503, "the server is shutting down"))

    def namespaced(self, namespace: str, fn: Callable[[Engine], object]) -> Callable[[Engine], object]:
        """A job function run under `namespace`'s keys."""
        def run(engine: Engine):
            with engine.namespace(namespace):
                return fn(engine)
        return run

    def _run_job(self, job: Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            with torch.inference_mode():
                job.future.set_result(job.fn(self.engine))
        except Exception as e:  # handed to the waiting handler, which turns it into an HTTP error
            job.future.set_exception(e)

    def _prefill(self, req: Request) -> None:
        if req.cancelled.is_set():
            self.metrics.count_cancelled()
            return
        engine = self.engine
        try:
            with torch.inference_mode(), self.engine.namespace(req.namespace):
                plan, out = engine.prefill(req.token_ids, req.mode, extra_capacity=req.params.max_tokens,
                                           blend_cfg=req.blend_cfg, seg=req.seg)
                picker = req.picker()
                first = picker(out.logits)
                metrics = RequestMetrics.from_prefill(req.mode, len(req.token_ids), out.stats)
                metrics.ttft_s = time.perf_counter() - req.arrival
                # Exact rows now (a copy); the chunks it missed after the answer (store_missed).
                missed = engine.store_after(req.token_ids, plan, out, req.mode, misses=False) if req.store else []
        except RequestError as e:
            req.emit(Failed(400, str(e)))
            return
        except Exception as e:
            log.exception("prefill failed")
            req.emit(Failed(500, f"prefill failed: {type(e).__name__}: {e}"))
            return
        self._start(req, out.cache, picker, first, metrics, missed)

    def _prefill_step(self) -> None:
        job = self.prefilling
        req = job.request
        if req.cancelled.is_set():
            self.prefilling = None
            self.metrics.count_cancelled()
            return
        try:
            with torch.inference_mode():
                logits = prefill_piece(self.engine.runner, job, self.prefill_piece)
                self.prefill_pieces += 1
        except Exception as e:
            log.exception("prefill failed")
            self.prefilling = None
            req.emit(Failed(500, f"prefill failed: {type(e).__name__}: {e}"))
            return
        if logits is None:
            return
        self.prefilling = None
        picker = req.picker()
        first = picker(logits)
        n = len(req.token_ids)
        metrics = RequestMetrics(mode="full", prompt_tokens=n, recomputed_tokens=n,
                                 ttft_s=time.perf_counter() - req.arrival)
        self._start(req, job.cache, picker, first, metrics)

    def _start(self, req: Request, cache: KVCache, picker: TokenPicker, first: Token, metrics: RequestMetrics,
               missed: list[tuple[int, int]] | None = None) -> None:
        """A prefilled request joins the running batch with its first token."""
        self.metrics.observe_prefill(req.mode, metrics.ttft_s, metrics)
        seq = Sequence(req, cache, picker, [first.id], first, metrics, TextStream(self.engine.tokenizer, req.params.stop),
                       missed or [])
        self.running.append(seq)
        req.emit(Prefilled(metrics))
        self._after_token(seq)
        if req.forced and seq in self.running:
            self._force_rest(seq)

    def _force_rest(self, seq: Sequence) -> None:
        """Teacher forcing: the forced tokens after the first are known, so they are computed in one
        pass, as more rows of the prompt (what the eval harness's teacher_forced does), not a decode
        step each: the logprobs are then those of the in-process measurement, bit for bit."""
        forced, n = seq.request.forced, len(seq.request.token_ids)
        try:
            with torch.inference_mode():
                logits = self.engine.runner.forward(torch.tensor(forced[:-1]), torch.arange(n, n + len(forced) - 1),
                                                    seq.cache, logit_rows=slice(None))
        except Exception as e:
            log.exception("forced continuation failed")
            self._finish(seq, Failed(500, f"forced continuation failed: {type(e).__name__}: {e}"))
            return
        for row in logits:
            seq.last = seq.picker(row)
            seq.tokens.append(seq.last.id)
            self._after_token(seq)

    def _decode_step(self) -> None:
        batch = list(self.running)
        self.peak_batch = max(self.peak_batch, len(batch))
        try:
            logits = self.engine.runner.decode([s.tokens[-1] for s in batch], [s.position for s in batch],
                                               [s.cache for s in batch])
        except Exception as e:
            log.exception("decode step failed")
            for seq in batch:
                self._finish(seq, Failed(500, f"decode failed: {type(e).__name__}: {e}"))
            return
        for row, seq in enumerate(batch):
            seq.last = seq.picker(logits[row])
            seq.tokens.append(seq.last.id)
            self._after_token(seq)

    def _after_token(self, seq: Sequence) -> None:
        """Send the newest token with its text, or finish the sequence on EOS, on a stop string or at
        max_tokens."""
        params, token = seq.request.params, seq.tokens[-1]
        if not params.ignore_eos and token in self.engine.eos_ids:
            self._finish(seq, Done("stop", seq.metrics))
            return
        seq.last.offset = len(seq.text.text)
        seq.last.text = seq.text.push(token)
        seq.request.emit(seq.last)
        if seq.text.stopped:
            self._finish(seq, Done("stop", seq.metrics))
        elif len(seq.tokens) >= params.max_tokens:
            self._finish(seq, Done("length", seq.metrics))

    def _finish(self, seq: Sequence, event: Done | Failed) -> None:
        if isinstance(event, Done):
            event.text, event.token_ids = seq.text.flush(), list(seq.tokens)
            m = event.metrics
            m.decode_tokens = len(seq.tokens)
            elapsed = time.perf_counter() - seq.request.arrival - m.ttft_s
            m.decode_tokens_per_s = (len(seq.tokens) - 1) / elapsed if elapsed > 0 and len(seq.tokens) > 1 else 0.0
            self.metrics.count_generated(len(seq.tokens))
            if seq.missed:  # queued before the answer ends, so the client's next request finds them
                self.store_missed(seq.request, seq.missed)
        self.running.remove(seq)
        seq.cache = None  # the KV goes with the last reference
        seq.request.emit(event)

    def store_missed(self, req: Request, missed: list[tuple[int, int]]) -> None:
        """Write-behind of documents first met in a request: a job after its answer indexes them in
        the request's namespace and precomputes them (Engine.store_misses), off the request's path."""
        ids, seg = req.token_ids, req.seg
        self._behind(req.namespace, lambda engine: engine.store_misses(ids, missed, seg),
                     f"storing the {len(missed)} chunks a request missed")
        self.reencode_neighbours(req.namespace, ids, seg)  # older chunks they are much closer to

    def reencode_neighbours(self, namespace: str, ids: list[int], seg: Segments | None = None) -> None:
        """Write-behind of chunks a closer chunk just joined the namespace's collection for: jobs
        re-encode them after it (Engine.reencode_neighbours), off the path of whoever posted it,
        REENCODE_BATCH at a time."""
        def batch(engine: Engine) -> int:
            encoded = engine.reencode_neighbours(ids, seg, limit=REENCODE_BATCH)
            if encoded == REENCODE_BATCH:  # more may wait: after the steps queued meanwhile
                self.reencode_neighbours(namespace, ids, seg)
            return encoded

        self._behind(namespace, batch, "re-encoding chunks after their closer neighbours")

    def _behind(self, namespace: str, fn: Callable[[Engine], object], what: str) -> None:
        """Queue fn(engine) under `namespace`'s keys as a job nobody waits on."""
        def run(engine: Engine):
            try:
                return fn(engine)
            except Exception:  # nobody waits on this job: say it here
                log.exception("%s failed", what)
                raise

        try:
            self.submit(Job(self.namespaced(namespace, run)))
        except queue.Full:
            log.warning("queue full: %s skipped", what)

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self.running if s.request.cancelled.is_set()]:
            self.running.remove(seq)
            seq.cache = None
            self.metrics.count_cancelled()
            if seq.missed:  # the client went away: the documents are worth keeping all the same
                self.store_missed(seq.request, seq.missed)


def _then(first: Callable[[object], None], then: Callable[[], None] | None) -> Callable[[object], None]:
    """A sink that hands each event to `first` and calls `then` when the request ends."""
    def sink(event) -> None:
        first(event)
        if then is not None and isinstance(event, (Done, Failed)):
            then()
    return sink


def generate(engine: Engine, token_ids: list[int], params: SamplingParams, mode: str | None = None,
             store: bool = True) -> Completion:
    """One prompt through the engine loop."""
    engine.check_ids(token_ids, params.max_tokens)
    req = Request(token_ids, params, engine.effective_mode(mode), engine.keys.namespace, store=store)
    return Scheduler(engine, max_batch=1).run([req])[0]
