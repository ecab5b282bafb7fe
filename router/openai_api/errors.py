"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

gRPC status names (from `RequestError` / `BackendError`) map to HTTP statuses:

=================== ====== =========================
status name         HTTP   error type
=================== ====== =========================
INVALID_ARGUMENT    400    invalid_request_error
UNAUTHENTICATED     401    authentication_error
NOT_FOUND           404    invalid_request_error
ALREADY_EXISTS      409    invalid_request_error
RESOURCE_EXHAUSTED  429    rate_limit_error
UNAVAILABLE         503    service_unavailable_error
DEADLINE_EXCEEDED   504    timeout_error
anything else       500    server_error
=================== ====== =========================

``code`` is the status name in lower case unless a more specific one applies
(``model_not_found``, ``invalid_api_key``).
"""
from __future__ import annotations

from typing import Any

STATUS_TO_HTTP = {
    "INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "NOT_FOUND": 404, "ALREADY_EXISTS": 409,
    "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504,
}
HTTP_TO_TYPE = {
    400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
    405: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
    429: "rate_limit_error", 503: "service_unavailable_error", 504: "timeout_error",
}
HTTP_TO_CODE = {400: "invalid_argument", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
                409: "already_exists", 413: "request_too_large", 429: "resource_exhausted", 500: "internal",
                503: "unavailable", 504: "deadline_exceeded"}


class APIError(Exception):
    """An error answer: HTTP ``status`` and the OpenAI error body.

    Args:
        status: the HTTP status.
        message: human-readable reason.
        param: the request field to blame, if one is.
        code: machine-readable code (default: from the status).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code or HTTP_TO_CODE.get(status, "internal")
        self.logged = False     # already logged as request_rejected (by the RequestCore)

    @classmethod
    def from_status(cls, status_name: str, message: str, param: str | None = None) -> APIError:
        """From a gRPC status name (`RequestError.code`, `BackendError.code`)."""
        http = STATUS_TO_HTTP.get(status_name, 500)
        return cls(http, message, param, status_name.lower() if http != 500 else "internal")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": HTTP_TO_TYPE.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}
