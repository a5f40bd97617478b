"""Write-behind: storing KV happens on one background thread, off the request's critical path."""

from __future__ import annotations

import logging
import queue
import threading

log = logging.getLogger(__name__)


class BackgroundWriter:
    def __init__(self, name: str = "kvblend-store-writer"):
        self._q: queue.Queue = queue.Queue()
        self.errors = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, *args) -> None:
        self._q.put((fn, args))

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                fn, args = item
                fn(*args)
            except Exception:  # a failed write must not stop the writes after it
                self.errors += 1
                log.exception("store writer: a background write failed")
            finally:
                self._q.task_done()

    def flush(self) -> None:
        """Wait until every write submitted so far is done (tests, shutdown, `kvblend store put`)."""
        self._q.join()

    def close(self) -> None:
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()
