"""One log line per lifecycle event and per finished request (never per token); JSON format."""
from __future__ import annotations

import io
import json
import logging

from router import generate
from router.log import JsonFormatter, TextFormatter, configure_logging, log_event


def _events(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "pdserve.router"]


def test_lifecycle_and_one_line_per_request(serve, caplog):
    caplog.set_level(logging.INFO, logger="pdserve.router")
    running = serve()
    list(generate(running.address, "abcdef", request_id="log1", max_tokens=6, timeout=10))
    running.loop.run(running.server.drain(timeout=5))
    running.loop.run(running.server.stop(0))
    events = [r.event for r in _events(caplog)]
    assert events == ["started", "ready", "request_finished", "draining", "drained", "stopped"]
    finished = next(r for r in _events(caplog) if r.event == "request_finished")
    f = finished.fields
    assert (f["request_id"], f["status"], f["finish_reason"]) == ("log1", "OK", "length")
    assert (f["prompt_tokens"], f["completion_tokens"], f["cached_prompt_tokens"]) == (6, 6, 0)
    assert f["prefill_s"] == 0.002 and 0 < f["ttft_s"] <= f["e2e_s"]
    assert "request_id=log1" in finished.getMessage()


def test_rejected_request_logged(server, caplog):
    caplog.set_level(logging.INFO, logger="pdserve.router")
    try:
        list(generate(server.address, "", request_id="bad\x01", timeout=10))
    except Exception:  # noqa: BLE001 — the status is tested elsewhere
        pass
    rejected = [r for r in _events(caplog) if r.event == "request_rejected"]
    assert len(rejected) == 1 and rejected[0].fields["status"] == "INVALID_ARGUMENT"
    assert "\x01" not in rejected[0].getMessage()  # control characters are escaped


def test_json_and_text_formatters():
    record = logging.LogRecord("pdserve.router", logging.INFO, __file__, 1, "ready address=127.0.0.1:1", None, None)
    record.event = "ready"
    record.fields = {"address": "127.0.0.1:1", "in_flight": 0}
    line = json.loads(JsonFormatter().format(record))
    assert line["event"] == "ready" and line["address"] == "127.0.0.1:1" and line["level"] == "info"
    assert TextFormatter().format(record).endswith("INFO pdserve.router ready address=127.0.0.1:1")


def test_configure_logging_json():
    loggers = [logging.getLogger(name) for name in ("pdserve", "uvicorn")]
    saved = [(list(lg.handlers), lg.level, lg.propagate) for lg in loggers]
    try:
        configure_logging("json")
        stream = io.StringIO()
        loggers[0].handlers[-1].setStream(stream)
        log_event("started", address="127.0.0.1:9")
        logging.getLogger("uvicorn.error").error("Exception in ASGI application")   # the server's own lines too
        first, second = map(json.loads, stream.getvalue().splitlines())
        assert first["address"] == "127.0.0.1:9"
        assert (second["logger"], second["level"]) == ("uvicorn.error", "error")
    finally:
        for lg, (handlers, level, propagate) in zip(loggers, saved):
            lg.handlers[:] = handlers
            lg.setLevel(level)
            lg.propagate = propagate
