"""The ``security`` section: the shared token, the public TLS files and the internal mutual TLS files.

The router's public port takes the token; internal endpoints (KV service, decode token stream)
take a secret derived from it (`proto.internal_auth.internal_secret`). ``tls_*`` secure the
public port; ``internal_tls_*`` put every internal gRPC channel (and the tcp KV transport) under
mutual TLS: each node presents ``internal_tls_cert`` as server and as client certificate, and accepts only peers whose
certificate chains to ``internal_tls_ca``. The files must exist at the same path on every node.
"""
from __future__ import annotations

import os
from typing import Optional

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator

from deploy.config.base import FieldProblem, Section, existing_file
from proto.internal_auth import InternalTLS

INTERNAL_TLS_FILES = ("internal_tls_cert", "internal_tls_key", "internal_tls_ca")


def _sendable(token: str) -> bool:
    """True when ``token`` survives an ``Authorization`` header (HTTP and gRPC metadata) as it is."""
    return token == token.strip(" \t") and all(" " <= char <= "~" for char in token)


class SecuritySection(Section):
    """Shared token (router and internal endpoints) and TLS files."""

    token: Optional[SecretStr] = Field(None, description="Shared bearer token; prefer token_env.")
    token_env: Optional[str] = Field(None,
                                     description="Environment variable holding the token.")
    tls_cert: Optional[str] = Field(None, description="PEM server certificate (with tls_key).")
    tls_key: Optional[str] = Field(None, description="PEM private key of tls_cert.")
    tls_client_ca: Optional[str] = Field(None, description="PEM CA bundle; set = clients need "
                                         "a certificate signed by it (mutual TLS).")
    internal_tls_cert: Optional[str] = Field(None, description="PEM certificate of the internal endpoints, "
                                             "also their client certificate (with internal_tls_key and "
                                             "internal_tls_ca; set = mutual TLS on every internal channel).")
    internal_tls_key: Optional[str] = Field(None, description="PEM private key of internal_tls_cert.")
    internal_tls_ca: Optional[str] = Field(None, description="PEM CA that every internal certificate must "
                                           "chain to.")
    internal_tls_server_name: Optional[str] = Field(None, description="Name internal clients check in a "
                                                    "server certificate; unset = the address dialled.")

    @field_validator("tls_cert", "tls_key", "tls_client_ca", *INTERNAL_TLS_FILES)
    @classmethod
    def _file_exists(cls, value: Optional[str], info: ValidationInfo) -> Optional[str]:
        return existing_file(value, info)

    @model_validator(mode="after")
    def _pairs(self) -> "SecuritySection":
        if self.token_env is not None:
            if self.token is not None:
                raise FieldProblem("token_env", "cannot be combined with security.token")
            value = os.environ.get(self.token_env)
            if not value:
                raise FieldProblem("token_env", f"environment variable {self.token_env} "
                                   "is not set or empty")
            self.token = SecretStr(value)
        if self.token is not None and not self.token.get_secret_value():
            raise FieldProblem("token", "must not be empty")
        if self.token is not None and not _sendable(self.token.get_secret_value()):
            # a client could never present it: header values are printable ASCII, their edges' spaces stripped
            raise FieldProblem("token_env" if self.token_env is not None else "token",
                               "the token must be printable ASCII without leading or trailing spaces (clients "
                               "send it in an Authorization header)")
        if (self.tls_cert is None) != (self.tls_key is None):
            missing = "tls_key" if self.tls_key is None else "tls_cert"
            other = "tls_cert" if missing == "tls_key" else "tls_key"
            raise FieldProblem(missing, f"required when security.{other} is set")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise FieldProblem("tls_cert", "required when security.tls_client_ca is set")
        given = [key for key in INTERNAL_TLS_FILES if getattr(self, key) is not None]
        if given and len(given) < len(INTERNAL_TLS_FILES):
            missing = next(key for key in INTERNAL_TLS_FILES if key not in given)
            raise FieldProblem(missing, f"required when security.{given[0]} is set (internal TLS is mutual: "
                               "certificate, key and CA)")
        if self.internal_tls_server_name is not None and not given:
            raise FieldProblem("internal_tls_cert", "required when security.internal_tls_server_name is set")
        if self.internal_tls_server_name is not None and not self.internal_tls_server_name.strip():
            raise FieldProblem("internal_tls_server_name", "must not be empty")
        return self

    def internal_tls(self):
        """The internal mutual-TLS files as a `proto.internal_auth.InternalTLS`, or None (plaintext)."""
        if self.internal_tls_cert is None:
            return None
        return InternalTLS(self.internal_tls_cert, self.internal_tls_key, self.internal_tls_ca,
                           self.internal_tls_server_name or "")
