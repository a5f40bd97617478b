"""Token ids -> text pieces for streaming, with stop strings.

The whole text is decoded again at each token (ids may merge into one character), and text is
held back while it could still be the start of a stop string or ends in a half-decoded character,
so that a client never sees text it must later take back.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of self.text already handed out
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add a token; return the text that is now safe to send. Sets `stopped` on a stop string."""
        self.ids.append(token_id)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True) if self.tokenizer else ""
        cut = min((i for i in (self.text.find(s, max(0, self.sent - len(s))) for s in self.stops) if i >= 0),
                  default=-1)
        if cut >= 0:
            self.stopped = True
            self.text = self.text[:cut]
            return self._take(cut)
        safe = len(self.text.rstrip("\ufffd"))
        safe -= max((k for s in self.stops for k in range(1, len(s)) if self.text[:safe].endswith(s[:k])), default=0)
        return self._take(max(safe, self.sent))

    def flush(self) -> str:
        """What is left once generation ended (held-back text that turned out not to be a stop)."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        piece, self.sent = self.text[self.sent:end], max(self.sent, end)
        return piece
