"""Keeps API keys out of the access log: the page takes its key from the URL (`/?key=...`, a
link that fills the form), and uvicorn logs every request's path with its query string."""

from __future__ import annotations

import logging
import re

_KEY_IN_QUERY = re.compile(r"([?&](?:api_)?key=)[^&#\s\"]*", re.IGNORECASE)
REDACTED = "***"


def redact(text: str) -> str:
    return _KEY_IN_QUERY.sub(lambda m: m.group(1) + REDACTED, text)


class RedactKeys(logging.Filter):
    """Rewrites a record's arguments (uvicorn passes the path as one of them) before formatting."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.msg, str):
            record.msg = redact(record.msg)
        return True


def install(logger_name: str = "uvicorn.access") -> None:
    """Once per logger; uvicorn's own logging setup keeps a logger's filters."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, RedactKeys) for f in logger.filters):
        logger.addFilter(RedactKeys())
