"""The ``server`` section: the router's public endpoints (gRPC, OpenAI HTTP), the HTTP connections' limits,
its metrics port and log format."""
from __future__ import annotations

import ipaddress
from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from deploy.config.base import FieldProblem, Float, Int, Section


class HTTPLimitsSection(Section):
    """``server.http_limits``: what one connection of the OpenAI HTTP port may cost
    (`router.openai_api.http_limits.HTTPLimits`, the same fields)."""

    max_header_bytes: Int = Field(64 * 1024, ge=1024, le=16 << 20, description="Request line + headers, in "
                                  "all; more get 431 and the connection is closed.")
    header_timeout_s: Float = Field(10.0, gt=0, description="The request line and headers must arrive within "
                                    "this of the connection's start (or of the request's first byte after an idle "
                                    "keep-alive); else 408 and closed (a connection that sent nothing is closed).")
    body_timeout_s: Float = Field(10.0, gt=0, description="The body's allowance after the headers; when it runs "
                                  "out, 408 and closed.")
    min_body_bytes_per_s: Int = Field(16 * 1024, ge=0, description="Each this many body bytes received add 1 s "
                                      "to the body's allowance (0: the whole body within body_timeout_s).")
    keep_alive_timeout_s: Float = Field(5.0, gt=0, description="An idle connection between requests is closed "
                                        "after this.")
    max_connections_per_client: Int = Field(256, ge=1, description="Open connections per client IP address; "
                                            "more are answered 503 and closed at once.")


class ServerSection(Section):
    """The router's public gRPC and OpenAI-compatible HTTP endpoints, and its metrics."""

    host: str = Field("127.0.0.1", description="Bind address (gRPC and HTTP); non-loopback needs security.token.")
    port: Int = Field(50051, ge=1, le=65535, description="gRPC port.")
    http_port: Optional[Int] = Field(8000, ge=0, le=65535, description="OpenAI-compatible HTTP port "
                                     "(/v1/completions, /v1/chat/completions, ...; same token and TLS as gRPC); "
                                     "null = no HTTP server; 0 = a free port.")
    http_limits: HTTPLimitsSection = Field(default_factory=HTTPLimitsSection, description="Bounds on each "
                                           "connection of the HTTP port.")
    metrics_port: Optional[Int] = Field(None, ge=0, le=65535, description="Prometheus "
                                        "/metrics port; unset = no metrics server; 0 = a free port (logged at start).")
    log_format: Literal["text", "json"] = Field("text", description="Log line format.")

    @field_validator("http_port", mode="before")
    @classmethod
    def _http_port_off(cls, value: object) -> object:
        # "none" / off (from --http-port none, or --set server.http_port=none; YAML reads off as
        # false) = no HTTP server, like null
        if value is False or isinstance(value, str) and value.strip().lower() in ("none", "null", "off"):
            return None
        return value

    @field_validator("host")
    @classmethod
    def _host_given(cls, value: str) -> str:
        # an empty host (e.g. --host "$UNSET") would bind every interface
        if not value.strip():
            raise ValueError("must not be empty (0.0.0.0 = every interface, 127.0.0.1 = this machine only)")
        return value

    @model_validator(mode="after")
    def _distinct_ports(self) -> "ServerSection":
        if self.metrics_port and self.metrics_port == self.port:
            raise FieldProblem("metrics_port", f"must differ from server.port ({self.port})")
        if self.http_port and self.http_port == self.port:
            raise FieldProblem("http_port", f"must differ from server.port ({self.port})")
        if self.http_port and self.http_port == self.metrics_port:
            raise FieldProblem("http_port", f"must differ from server.metrics_port ({self.metrics_port})")
        return self

    def is_loopback(self) -> bool:
        """True when ``host`` only accepts connections from this machine."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False
