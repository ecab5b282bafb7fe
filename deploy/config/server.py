"""The ``server`` section: the router's public endpoint, its metrics port and log format."""
from __future__ import annotations

import ipaddress
from typing import Literal, Optional

from pydantic import Field, model_validator

from deploy.config.base import FieldProblem, Int, Section


class ServerSection(Section):
    """The router's public gRPC endpoint and its metrics."""

    host: str = Field("127.0.0.1", description="Bind address; non-loopback needs security.token.")
    port: Int = Field(50051, ge=1, le=65535, description="gRPC port.")
    metrics_port: Optional[Int] = Field(None, ge=1, le=65535, description="Prometheus "
                                        "/metrics port; unset = no metrics server.")
    log_format: Literal["text", "json"] = Field("text", description="Log line format.")

    @model_validator(mode="after")
    def _distinct_ports(self) -> "ServerSection":
        if self.metrics_port == self.port:
            raise FieldProblem("metrics_port", f"must differ from server.port ({self.port})")
        return self

    def is_loopback(self) -> bool:
        """True when ``host`` only accepts connections from this machine."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False
