"""pdserve router: the public gRPC front end (validation, auth, TLS, health, streaming).

The router is plain asyncio + grpc.aio and never imports ray; the cluster
plugs in by implementing `Backend` and passing it to `start_server`.
"""
from router.backend import (
    ActorStats,
    Backend,
    BackendError,
    GenerationChunk,
    GenerationInput,
    Timing,
    Tokenizer,
    Usage,
)
from router.client import AsyncGenerationClient, ClientTLS, build_request, generate, get_stats
from router.log import configure_logging
from router.security import TLSConfig
from router.server import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_MAX_QUEUE, RouterServer, serve_until_signal, start_server
from router.servicer import SERVICE_NAME, GenerationServicer
from router.validation import RequestError, validate_request

__all__ = [
    "ActorStats", "AsyncGenerationClient", "Backend", "BackendError", "ClientTLS",
    "DEFAULT_MAX_MESSAGE_BYTES", "DEFAULT_MAX_QUEUE", "GenerationChunk", "GenerationInput",
    "GenerationServicer", "RequestError", "RouterServer", "SERVICE_NAME", "TLSConfig", "Timing",
    "Tokenizer", "Usage", "build_request", "configure_logging", "generate", "get_stats",
    "serve_until_signal", "start_server", "validate_request",
]
