"""pdserve router: the public gRPC front end (validation, auth, TLS, health, streaming).

The router is plain asyncio + grpc.aio and never imports ray; the cluster
plugs in by implementing `Backend` and passing it to `start_server`.
Names are imported on first use, so a client (`from router.client import
generate`) starts without loading the server, the engine or torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "router.backend": ("ActorStats", "Backend", "BackendError", "GenerationChunk", "GenerationInput", "Tokenizer",
                       "Usage"),
    "router.client": ("AsyncGenerationClient", "ClientTLS", "build_request", "generate", "get_stats"),
    "router.log": ("configure_logging",),
    "router.security": ("TLSConfig",),
    "router.server": ("DEFAULT_MAX_MESSAGE_BYTES", "DEFAULT_MAX_QUEUE", "RouterServer", "serve_until_signal",
                      "start_server"),
    "router.request_core": ("AdmittedRequest", "RequestCore"),
    "router.servicer": ("SERVICE_NAME", "GenerationServicer"),
    "router.timing": ("Timeline", "Timing"),
    "router.validation": ("RequestError", "validate_request"),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'router' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)
