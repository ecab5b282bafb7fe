"""Load generator: send a workload to a router and time every request as the client sees it.

Arrivals are a gamma process at ``request_rate`` (shape ``burstiness``: 1 = Poisson,
< 1 burstier, > 1 smoother; ``inf`` sends everything at once), optionally capped at
``concurrency`` requests in flight. Every request asks for exactly its output length
(``ignore_eos``, greedy), so runs with the same seed do the same work.
"""
from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field

from bench.serving.workloads import RequestSpec
from engine.latency import time_per_output_token
from router.timing import Timeline


@dataclass(slots=True)
class RequestRecord:
    """What one request did, timed at the client; server timings from the last message."""

    index: int
    request_id: str
    kind: str
    prompt_len: int
    output_len: int                 # requested
    ok: bool = False
    error: str = ""
    finish_reason: str = ""
    num_output_tokens: int = 0
    cached_prompt_tokens: int = 0
    sent_at: float = 0.0             # seconds from the start of the run
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    queue_s: float = 0.0             # server's breakdown of TTFT
    prefill_s: float = 0.0
    kv_transfer_s: float = 0.0
    decode_queue_s: float = 0.0
    server_ttft_s: float = 0.0
    timeline: dict | None = None     # the server's stages up to the first token (router.timing), seconds

    @property
    def client_s(self) -> float:
        """TTFT at the client less the router's: the request and the first token between client and router."""
        return self.ttft_s - self.server_ttft_s

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (0 with fewer than two tokens)."""
        return time_per_output_token(self.ttft_s, self.e2e_s, self.num_output_tokens)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["tpot_s"] = self.tpot_s
        out["client_s"] = self.client_s
        return out


class Progress:
    """A one-line progress bar on stderr (redrawn where stderr is a terminal, else a line per 10%). Its seconds
    are wall time (`perf_counter`), also in a simulation, where `time.monotonic` reads the virtual clock."""

    def __init__(self, total: int, label: str, enabled: bool = True) -> None:
        self.total, self.label, self.done, self.failed = total, label, 0, 0
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()
        self._last_decile = -1
        self._drawn_at = -math.inf

    REDRAW_S = 0.2          # a terminal's line is redrawn at most this often (and at the end)

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty and self.done < self.total and now - self._drawn_at < self.REDRAW_S:
            return
        self._drawn_at = now
        width, frac = 30, self.done / max(self.total, 1)
        bar = "#" * int(width * frac) + "." * (width - int(width * frac))
        text = (f"\r{self.label} [{bar}] {self.done}/{self.total} "
                f"({self.failed} failed) {now - self.start:.0f}s")
        if self.tty:
            print(text, end="" if self.done < self.total else "\n", file=sys.stderr, flush=True)
        elif int(frac * 10) != self._last_decile:
            self._last_decile = int(frac * 10)
            print(text.strip(), file=sys.stderr, flush=True)


def arrival_gaps(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds between consecutive sends: gamma(shape=burstiness, mean=1/request_rate)."""
    if math.isinf(request_rate):
        return [0.0] * n
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be > 0")
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(n)]


async def one_request(client, spec: RequestSpec, record: RequestRecord, t0: float, timeout: float) -> None:
    """Send ``spec`` through ``client`` (`bench.serving.clients`) and fill ``record`` with the client's
    timings (never raises)."""
    sent = time.monotonic()
    record.sent_at = sent - t0
    last_token_at = None
    try:
        last = None
        async for piece in client.stream(spec, record.request_id, timeout):
            now = time.monotonic()
            if piece.num_tokens:
                if last_token_at is None:
                    record.ttft_s = now - sent
                else:
                    record.itl_s.append(now - last_token_at)
                last_token_at = now
                record.num_output_tokens += piece.num_tokens
            last = piece
        record.e2e_s = time.monotonic() - sent
        if last is None or not last.finish_reason:
            raise RuntimeError("stream ended without a finish reason")
        record.ok = True
        record.finish_reason = last.finish_reason
        if last.completion_tokens is not None:          # the server's count (an SSE chunk may hold several)
            record.num_output_tokens = last.completion_tokens
        record.cached_prompt_tokens = last.cached_prompt_tokens
        if last.timing is not None:
            t = last.timing
            record.queue_s, record.prefill_s, record.kv_transfer_s = t.queue_s, t.prefill_s, t.kv_transfer_s
            record.decode_queue_s, record.server_ttft_s = t.decode_queue_s, t.ttft_s
            if t.HasField("timeline"):
                record.timeline = Timeline.from_proto(t.timeline).as_dict()
    except Exception as e:  # noqa: BLE001 — a failed request is a data point, not a crash
        record.ok = False
        code = getattr(e, "code", None)
        record.error = f"{code().name}: {e.details()}" if callable(code) else f"{type(e).__name__}: {e}"
        record.e2e_s = time.monotonic() - sent


async def run_load(client, specs: list[RequestSpec], *, request_rate: float = math.inf, burstiness: float = 1.0,
                   concurrency: int | None = None, seed: int = 0, label: str = "run", tag: str = "r",
                   progress: bool = True, timeout: float = 600.0) -> tuple[list[RequestRecord], float]:
    """Send every spec on its arrival schedule; return the records and the run's duration.

    The duration runs from the first send to the last response, the denominator of
    every throughput and goodput figure.
    """
    gaps = arrival_gaps(len(specs), request_rate, burstiness, seed)
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    bar = Progress(len(specs), label, progress)
    records = [RequestRecord(i, f"{tag}-{seed}-{i}", s.kind, s.prompt_len, s.output_len) for i, s in enumerate(specs)]
    t0 = time.monotonic()

    async def send(spec: RequestSpec, record: RequestRecord) -> None:
        if limit is None:
            await one_request(client, spec, record, t0, timeout)
        else:
            async with limit:
                await one_request(client, spec, record, t0, timeout)
        bar.update(record.ok)

    tasks = []
    for gap, spec, record in zip(gaps, specs, records):
        if limit is not None:            # closed loop: wait for a free slot before the next arrival
            await limit.acquire()
            limit.release()
        tasks.append(asyncio.ensure_future(send(spec, record)))
        if gap:
            await asyncio.sleep(gap)
    await asyncio.gather(*tasks)
    return records, time.monotonic() - t0
