"""Prometheus metrics of the router: one `Metrics` object per cluster, its own registry.

Who feeds what::

    GenerationServicer (per finished request) → request_finished: TTFT, TPOT, ITL, E2E,
                                                queue seconds, requests_total{finish_reason}
    RequestCore.rejected (both front doors)   → request_rejected: rejected_requests_total{api,status,reason}
                                                (bad input, capacity, auth, body size, unknown route)
    Dispatcher hooks                          → kv_transfer, transfer_failed, local_prefill,
                                                prefix_hit_tokens, placement{choice} (routing.mode auto)
    pool manager (role flips)                 → role_flipped{from_role, to_role}
    poll_stats (periodic backend.stats())     → blocks_used: pdserve_kv_blocks_used{actor,role},
                                                pdserve_kv_blocks_capacity{actor,role}; per tier below
                                                an actor's cache (kv_cache.tiers): pdserve_kv_tier_*{actor,tier};
                                                pdserve_spec_proposed_tokens_total{actor,role},
                                                pdserve_spec_accepted_tokens_total{actor,role},
                                                pdserve_spec_acceptance_ratio{actor,role}

Every name passes ``promtool check metrics``: ``_total`` on counters only (prometheus_client adds it
to a Counter's name), base units (seconds, bytes) spelled out.

`Metrics.serve(host, port, token)` exposes ``/metrics`` over HTTP on a daemon thread; with a token
a scrape must send ``Authorization: Bearer <token>`` (else 401), and without one it binds loopback
only. `Metrics.exposition()` returns the same text.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from engine.latency import time_per_output_token
from proto.internal_auth import token_matches
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import choose_encoder
from router.roles import ROLE_NAMES
from router.security import bearer_canonical, is_loopback

log = logging.getLogger("pdserve.router")

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


# The reason label's values (a bounded set: never client text).
REJECTION_REASONS = ("capacity", "not_ready", "invalid_input", "duplicate_id", "unknown_model", "body_too_large",
                     "unknown_route", "missing_token", "invalid_token", "deadline", "header_too_large",
                     "header_timeout", "body_timeout", "too_many_connections", "other")
_REASON_OF_STATUS = {"RESOURCE_EXHAUSTED": "capacity", "UNAVAILABLE": "not_ready", "INVALID_ARGUMENT": "invalid_input",
                     "ALREADY_EXISTS": "duplicate_id", "NOT_FOUND": "unknown_model", "DEADLINE_EXCEEDED": "deadline"}


def rejection_reason(status: str) -> str:
    """The reason label of a refusal with this gRPC status name."""
    return _REASON_OF_STATUS.get(status, "other")


TIER_COUNTERS = {     # pdserve_kv_tier_<name>_total{actor,tier}
    "offload_bytes": "Bytes written into the tier (rate(): offload bytes/s).",
    "onboard_bytes": "Bytes read from the tier into the paged cache (rate(): onboard bytes/s).",
    "lookups": "Blocks requests looked for below the paged cache while the tier was on.",
    "hits": "Of those, blocks the tier served (hits / lookups: its hit rate).",
    "dropped_offloads": "Evicted blocks not offloaded: the offload queue was full.",
    "corrupt_blocks": "Blocks that failed a check (fingerprint, hash, length, checksum) and were dropped.",
}
TIER_TOTALS = {"offload_bytes": "offload_bytes", "onboard_bytes": "onboard_bytes", "lookups": "num_lookups",
               "hits": "num_hits", "dropped_offloads": "num_dropped_offloads", "corrupt_blocks": "num_corrupt"}


class Metrics:
    """Every pdserve metric, registered in a private `CollectorRegistry`.

    Hook methods are cheap and never raise into the request path.
    """

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("pdserve_ttft_seconds", "Router receipt to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve_tpot_seconds", "Time per output token after the first, per request.",
                              buckets=TOKEN_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_itl_seconds", "Gap between token messages as the router relays them.",
                             buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_seconds", "Router receipt to last token.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("pdserve_queue_seconds", "Admission plus prefill queue time per request.",
                               buckets=LATENCY_BUCKETS, registry=r)
        self.kv_transfer_seconds = Histogram("pdserve_kv_transfer_seconds", "KV shipping time per request.",
                                             buckets=TRANSFER_BUCKETS, registry=r)
        self.kv_bytes = Counter("pdserve_kv_transfer_bytes", "Uncompressed KV bytes moved prefill to decode.",
                                ["codec"], registry=r)
        self.wire_bytes = Counter("pdserve_kv_wire_bytes", "KV bytes on the wire (after the codec).", registry=r)
        self.prefix_hits = Counter("pdserve_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.",
                                   registry=r)
        self.blocks = Gauge("pdserve_kv_blocks_used", "KV blocks in use per actor.", ["actor", "role"], registry=r)
        self.blocks_capacity = Gauge("pdserve_kv_blocks_capacity", "KV blocks per actor (its cache's size).",
                                     ["actor", "role"], registry=r)
        self.requests = Counter("pdserve_requests", "Finished requests by finish reason (or failure status).",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("pdserve_rejected_requests", "Requests refused before generation, by front door "
                                "(grpc, http), status (the gRPC status name) and reason (`REJECTION_REASONS`).",
                                ["api", "status", "reason"], registry=r)
        self.transfer_failures = Counter("pdserve_transfer_failures", "Failed prefills or KV transfers.", registry=r)
        self.local_prefills = Counter("pdserve_local_prefills", "Prompts prefilled on their decode actor.",
                                      registry=r)
        self.placements = Counter("pdserve_placement_decisions", "routing.mode auto: prompts placed remote "
                                  "(prefill actor + KV transfer) or local (chunked on the decode actor).",
                                  ["choice"], registry=r)
        self.role_flips = Counter("pdserve_role_flips", "Actors switched to another role at run time.",
                                  ["from_role", "to_role"], registry=r)
        self.spec_proposed = Counter("pdserve_spec_proposed_tokens", "Speculative tokens proposed and verified.",
                                     ["actor", "role"], registry=r)
        self.spec_accepted = Counter("pdserve_spec_accepted_tokens", "Speculative tokens the model accepted.",
                                     ["actor", "role"], registry=r)
        self.spec_acceptance = Gauge("pdserve_spec_acceptance_ratio", "Accepted / proposed speculative tokens "
                                     "since the actor started.", ["actor", "role"], registry=r)
        self.refused_connections = Counter(
            "pdserve_internal_refused_connections", "Connections an actor's internal endpoints (KV receiver, "
            "token stream) refused: bad_token, bad_hello (malformed, too slow or evicted before it "
            "authenticated), handshake_mismatch.", ["actor", "role", "reason"], registry=r)
        tier = ["actor", "tier"]
        self.tier_blocks = Gauge("pdserve_kv_tier_blocks", "Blocks held in a tier below an actor's paged cache.",
                                 tier, registry=r)
        self.tier_bytes = Gauge("pdserve_kv_tier_bytes", "Bytes held in a tier below an actor's paged cache.",
                                tier, registry=r)
        self.tier_enabled = Gauge("pdserve_kv_tier_enabled", "1 while the tier is on, 0 once it turned itself "
                                  "off (a full or unwritable disk).", tier, registry=r)
        self.tier_onboard_bandwidth = Gauge("pdserve_kv_tier_onboard_bandwidth_bytes_per_second", "Measured read "
                                            "bandwidth of the tier into the paged cache.", tier, registry=r)
        self.tier_counters = {name: Counter(f"pdserve_kv_tier_{name}", help_text, tier, registry=r)
                              for name, help_text in TIER_COUNTERS.items()}
        self._tier_seen: dict[tuple[str, str, str], int] = {}      # an actor's own tier totals at the last poll
        self._tiers: set[tuple[str, str]] = set()
        self._actors: set[tuple[str, str]] = set()
        self._refused_seen: dict[tuple[str, str, str], int] = {}   # an actor's own totals at the last poll
        self._spec_seen: dict[tuple[str, str, str], int] = {}      # speculative totals at the last poll
        self._http = None

    # ---- router hooks ---------------------------------------------------------
    def request_finished(self, finish_reason: str, *, ttft_s: float | None, e2e_s: float, queue_s: float,
                         num_output_tokens: int, itl_s: Sequence[float] = ()) -> None:
        """One request ended. ``finish_reason`` is stop/length/abort, or a failure status in lower case.

        TPOT excludes the first token (`engine.latency.time_per_output_token`), for two or more tokens.
        """
        self.requests.labels(finish_reason).inc()
        if ttft_s is None:
            return
        self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)
        self.queue.observe(queue_s)
        if num_output_tokens > 1:
            self.tpot.observe(time_per_output_token(ttft_s, e2e_s, num_output_tokens))
        for gap in itl_s:
            self.itl.observe(gap)

    # ---- Dispatcher hooks -----------------------------------------------------
    def request_rejected(self, api: str, status: str, reason: str | None = None) -> None:
        """A request was refused before it reached the backend; ``reason`` is one of `REJECTION_REASONS`
        (default: the status's, `rejection_reason`)."""
        reason = reason if reason in REJECTION_REASONS else rejection_reason(status)
        self.rejected.labels(api, status, reason).inc()

    def kv_transfer(self, seconds: float, kv_bytes: int, wire_bytes: int, codec: str) -> None:
        self.kv_transfer_seconds.observe(seconds)
        self.kv_bytes.labels(codec).inc(kv_bytes)
        self.wire_bytes.inc(wire_bytes)

    def transfer_failed(self) -> None:
        self.transfer_failures.inc()

    def local_prefill(self) -> None:
        self.local_prefills.inc()

    def placement(self, choice: str) -> None:
        self.placements.labels(choice).inc()

    def role_flipped(self, from_role: str, to_role: str) -> None:
        self.role_flips.labels(from_role, to_role).inc()

    def prefix_hit_tokens(self, n: int) -> None:
        if n > 0:
            self.prefix_hits.inc(n)

    # ---- load poll ------------------------------------------------------------
    def blocks_used(self, actor_id: str, role: str, used: int, total: int | None = None) -> None:
        self.blocks.labels(actor_id, role).set(used)
        if total is not None:
            self.blocks_capacity.labels(actor_id, role).set(total)
        self._actors.add((actor_id, role))

    def observe_stats(self, stats: Sequence) -> None:
        """Set the block gauges from `ActorStats`; drop actors that left the pools."""
        seen = set()
        tiers = set()
        for s in stats:
            role = ROLE_NAMES.get(s.role, "unspecified")
            self.blocks_used(s.actor_id, role, s.kv_blocks_used, s.kv_blocks_total)
            seen.add((s.actor_id, role))
            self._count_refused(s)
            for t in s.kv_tiers:
                tiers.add(self._observe_tier(s.actor_id, t))
            self._count_spec(s, role)
        for gone in self._tiers - tiers:
            for gauge in (self.tier_blocks, self.tier_bytes, self.tier_enabled, self.tier_onboard_bandwidth):
                try:
                    gauge.remove(*gone)
                except KeyError:
                    pass
        self._tiers = tiers
        for gone in self._actors - seen:
            for gauge in (self.blocks, self.blocks_capacity, self.spec_acceptance):
                try:
                    gauge.remove(*gone)
                except KeyError:
                    pass
        self._actors = seen

    def _observe_tier(self, actor_id: str, t: dict) -> tuple[str, str]:
        """One tier's gauges, and its counters advanced by what its totals grew since the last poll."""
        key = (actor_id, t["kind"])
        self.tier_blocks.labels(*key).set(t["num_blocks"])
        self.tier_bytes.labels(*key).set(t["num_bytes"])
        self.tier_enabled.labels(*key).set(1 if t["enabled"] else 0)
        self.tier_onboard_bandwidth.labels(*key).set(t["onboard_bytes_per_s"])
        for name, report_key in TIER_TOTALS.items():
            total, last = t[report_key], self._tier_seen.get((*key, name), 0)
            if total != last:
                self.tier_counters[name].labels(*key).inc(total - last if total > last else total)
                self._tier_seen[(*key, name)] = total
        return key

    def _count_refused(self, s) -> None:
        """Add what an actor refused since the last poll (a total that went down: the actor restarted)."""
        for reason, total in s.refused_connections.items():
            key = (s.actor_id, ROLE_NAMES.get(s.role, "unspecified"), reason)
            last = self._refused_seen.get(key, 0)
            if total != last:
                self.refused_connections.labels(*key).inc(total - last if total > last else total)
                self._refused_seen[key] = total

    def _count_spec(self, s, role: str) -> None:
        """Add the speculative tokens an actor verified since the last poll (totals that went down: it restarted)."""
        if not s.spec_proposed_tokens:
            return
        for counter, name, total in ((self.spec_proposed, "proposed", s.spec_proposed_tokens),
                                     (self.spec_accepted, "accepted", s.spec_accepted_tokens)):
            key = (s.actor_id, role, name)
            last = self._spec_seen.get(key, 0)
            if total != last:
                counter.labels(s.actor_id, role).inc(total - last if total > last else total)
                self._spec_seen[key] = total
        self.spec_acceptance.labels(s.actor_id, role).set(s.spec_accepted_tokens / s.spec_proposed_tokens)

    # ---- exposition -----------------------------------------------------------
    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)

    def serve(self, host: str, port: int, token: str | None = None) -> int:
        """Serve ``/metrics`` on ``host:port`` (0 = pick a port) from a daemon thread; returns the port.

        Args:
            token: when set, scrapes must send ``Authorization: Bearer <token>``.
        Raises:
            ValueError: a non-loopback ``host`` without a token (naming ``server.metrics_port``).
        """
        if not token and not is_loopback(host):
            raise ValueError(f"server.metrics_port: refusing to serve /metrics on non-loopback host {host!r} "
                             "without a token; set security.token or bind server.host to 127.0.0.1")
        handler = type("MetricsHandler", (_MetricsHandler,),
                       {"registry": self.registry, "expected": f"Bearer {token}" if token else None})
        self._http = ThreadingHTTPServer((host, port), handler)
        self._http.daemon_threads = True
        threading.Thread(target=self._http.serve_forever, name="metrics-http", daemon=True).start()
        return self._http.server_address[1]

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class _MetricsHandler(BaseHTTPRequestHandler):
    """GET /metrics: the registry in the format the scraper asks for, behind the bearer token if any."""

    registry: CollectorRegistry
    expected: str | None = None   # "Bearer <token>", or None = open (loopback only)
    timeout = 10                  # seconds a client may take to send its request

    def do_GET(self) -> None:  # noqa: N802 — http.server's method name
        if urlsplit(self.path).path not in ("/metrics", "/"):
            self._reply(404, b"not found: scrape /metrics\n", "text/plain; charset=utf-8")
        elif self.expected is not None and not token_matches(bearer_canonical(self.headers.get("Authorization") or ""),
                                                              self.expected):
            self._reply(401, b"missing or invalid bearer token\n", "text/plain; charset=utf-8",
                        {"WWW-Authenticate": 'Bearer realm="pdserve-metrics"'})
        else:
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            self._reply(200, encoder(self.registry), content_type)

    def _reply(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 — scrapes are not worth a log line
        pass


async def poll_stats(backend, metrics: Metrics, interval_s: float = 1.0, timeout_s: float = 3.0) -> None:
    """Feed `metrics.observe_stats` from ``await backend.stats()`` every ``interval_s`` until cancelled;
    a call that takes longer than ``timeout_s`` is given up (logged once until one answers again)."""
    late = False
    while True:
        try:
            metrics.observe_stats(await asyncio.wait_for(backend.stats(), timeout_s))
            if late:
                late = False
                log.info("metrics poll: backend.stats() answers again")
        except asyncio.TimeoutError:
            if not late:
                late = True
                log.warning("metrics poll: backend.stats() did not answer within %.1f s; polling on", timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 — a failed poll must not stop the next one
            log.exception("metrics poll of backend.stats() failed")
        await asyncio.sleep(interval_s)
