"""The ``server`` section: the router's public endpoints (gRPC, OpenAI HTTP), its metrics port and log format."""
from __future__ import annotations

import ipaddress
from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from deploy.config.base import FieldProblem, Int, Section


class ServerSection(Section):
    """The router's public gRPC and OpenAI-compatible HTTP endpoints, and its metrics."""

    host: str = Field("127.0.0.1", description="Bind address (gRPC and HTTP); non-loopback needs security.token.")
    port: Int = Field(50051, ge=1, le=65535, description="gRPC port.")
    http_port: Optional[Int] = Field(8000, ge=0, le=65535, description="OpenAI-compatible HTTP port "
                                     "(/v1/completions, /v1/chat/completions, ...; same token and TLS as gRPC); "
                                     "null = no HTTP server; 0 = a free port.")
    metrics_port: Optional[Int] = Field(None, ge=1, le=65535, description="Prometheus "
                                        "/metrics port; unset = no metrics server.")
    log_format: Literal["text", "json"] = Field("text", description="Log line format.")

    @field_validator("http_port", mode="before")
    @classmethod
    def _http_port_off(cls, value: object) -> object:
        # "none" / off (from --http-port none, or --set server.http_port=none: a null override is
        # skipped, and YAML reads off as false) = no HTTP server, like null in the file
        if value is False or isinstance(value, str) and value.strip().lower() in ("none", "null", "off"):
            return None
        return value

    @model_validator(mode="after")
    def _distinct_ports(self) -> "ServerSection":
        if self.metrics_port == self.port:
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
