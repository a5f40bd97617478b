"""A request to the engine loop and what comes back: the events a request is sent as it is
answered (Prefilled, Token..., then Done; or Failed), and the same events gathered into one
Completion for the offline way in."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from ..blend.fusor import BlendConfig
from ..blend.segment import Segments
from .engine import Engine, RequestError, RequestMetrics
from .sampler import SamplingParams
from .token_picker import Token, TokenPicker


@dataclass
class Prefilled:
    metrics: RequestMetrics  # the prompt's: TTFT, tokens reused and recomputed, chunk hits


@dataclass
class Done:
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    metrics: RequestMetrics
    text: str = ""  # text held back to the end (it could have begun a stop string, and did not)
    token_ids: list[int] = field(default_factory=list)  # every token generated, an ending EOS included


@dataclass
class Failed:
    status: int
    message: str


@dataclass
class Request:
    """A prompt to answer. Its events go to `sink`: Prefilled, Token..., then Done; or Failed."""

    token_ids: list[int]
    params: SamplingParams
    mode: str
    namespace: str
    blend_cfg: BlendConfig | None = None
    forced: list[int] | None = None  # teacher forcing: these are the tokens, not sampled ones
    top_logprobs: int | None = None  # logprobs with this many most likely tokens; None: none
    store: bool = True  # store the prompt's exact rows and the chunks it missed
    seg: Segments | None = None  # the prompt's segments as built from documents; None: found by the separator
    arrival: float = field(default_factory=time.perf_counter)
    admitted: float | None = None  # when the engine loop took it from the queue
    sink: Callable[[object], None] | None = None
    events: asyncio.Queue | None = None  # with bind(): the events, for a coroutine to read
    cancelled: threading.Event = field(default_factory=threading.Event)

    def bind(self) -> "Request":
        """Deliver the events to `events`, on the calling coroutine's event loop."""
        loop, self.events = asyncio.get_running_loop(), asyncio.Queue()
        self.sink = lambda event: loop.call_soon_threadsafe(self.events.put_nowait, event)
        return self

    def cancel(self) -> None:
        self.cancelled.set()

    def picker(self) -> TokenPicker:
        return TokenPicker(self.params, self.forced, self.top_logprobs)

    def emit(self, event) -> None:
        if self.sink is None:
            return
        try:
            self.sink(event)
        except RuntimeError:  # the event loop is gone (server shutting down): nobody is listening
            self.cancel()


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    metrics: RequestMetrics


class Collected:
    """A request's events gathered into its Completion (the offline way in)."""

    def __init__(self):
        self.pieces: list[str] = []
        self.end: Done | Failed | None = None

    def __call__(self, event) -> None:
        if isinstance(event, Token):
            self.pieces.append(event.text)
        elif isinstance(event, (Done, Failed)):
            self.end = event

    def completion(self) -> Completion:
        if isinstance(self.end, Failed):
            raise (RequestError if self.end.status < 500 else RuntimeError)(self.end.message)
        return Completion(self.end.token_ids, "".join(self.pieces) + self.end.text, self.end.finish_reason,
                          self.end.metrics)


class LoopMetrics:
    """What the loop reports as it goes; the server's Prometheus metrics implement it."""

    def observe_prefill(self, mode: str, ttft_s: float, m: RequestMetrics) -> None:
        pass

    def count_cancelled(self) -> None:
        pass

    def count_generated(self, n: int) -> None:
        pass


@dataclass
class Job:
    """Engine work that is not a generation (precomputing chunks): fn(engine) in the loop thread."""

    fn: Callable[[Engine], object]
    future: Future = field(default_factory=Future)
