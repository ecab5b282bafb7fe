"""Structured log lines for the router: one per lifecycle event and per finished request.

Events are logged on the ``pdserve.router`` logger with their fields in
``record.fields``; the message itself reads ``event k=v ...``.
`configure_logging` installs a text or a JSON (one object per line) formatter.
"""
from __future__ import annotations

import json
import logging
import time

logger = logging.getLogger("pdserve.router")

LOG_FORMATS = ("text", "json")


def log_event(event: str, level: int = logging.INFO, **fields: object) -> None:
    """Log one event with key/value fields (never per token)."""
    if not logger.isEnabledFor(level):
        return
    text = " ".join([event] + [f"{k}={_text_value(v)}" for k, v in fields.items()])
    logger.log(level, text, extra={"event": event, "fields": fields})


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, event, and the event's fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": getattr(record, "event", None) or record.getMessage(),
        }
        out.update(getattr(record, "fields", {}))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """``2026-01-01T00:00:00Z INFO pdserve.router event k=v ...``."""

    converter = time.gmtime

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s", "%Y-%m-%dT%H:%M:%SZ")


def configure_logging(fmt: str = "text", level: int = logging.INFO) -> None:
    """Send ``pdserve.*`` logs, and those of the ASGI server (``uvicorn.*``), to stderr as ``fmt``
    ("text" or "json"); uvicorn's levels stay its own (warnings and errors)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler()
    handler._pdserve = True  # type: ignore[attr-defined]
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    for name in ("pdserve", "uvicorn"):
        root = logging.getLogger(name)
        for old in list(root.handlers):
            if getattr(old, "_pdserve", False):
                root.removeHandler(old)
        root.addHandler(handler)
        root.propagate = False
    logging.getLogger("pdserve").setLevel(level)


def _text_value(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    text = str(value)
    plain = text and text.isprintable() and not any(c.isspace() or c in '"=' for c in text)
    return text if plain else json.dumps(text)
