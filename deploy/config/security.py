"""The ``security`` section: the shared token and the TLS files."""
from __future__ import annotations

import os
from typing import Optional

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator

from deploy.config.base import FieldProblem, Section, existing_file


class SecuritySection(Section):
    """Shared token (router and internal endpoints) and TLS files."""

    token: Optional[SecretStr] = Field(None, description="Shared bearer token; prefer token_env.")
    token_env: Optional[str] = Field(None,
                                     description="Environment variable holding the token.")
    tls_cert: Optional[str] = Field(None, description="PEM server certificate (with tls_key).")
    tls_key: Optional[str] = Field(None, description="PEM private key of tls_cert.")
    tls_client_ca: Optional[str] = Field(None, description="PEM CA bundle; set = clients need "
                                         "a certificate signed by it (mutual TLS).")

    @field_validator("tls_cert", "tls_key", "tls_client_ca")
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
        if (self.tls_cert is None) != (self.tls_key is None):
            missing = "tls_key" if self.tls_key is None else "tls_cert"
            other = "tls_cert" if missing == "tls_key" else "tls_key"
            raise FieldProblem(missing, f"required when security.{other} is set")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise FieldProblem("tls_cert", "required when security.tls_client_ca is set")
        return self
