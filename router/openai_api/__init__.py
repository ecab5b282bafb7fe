"""The router's OpenAI-compatible HTTP front door (/v1/completions, /v1/chat/completions, ...).

It shares the gRPC front door's `router.request_core.RequestCore` (admission, in-flight limit,
draining, log line, metrics) and validation; `router.server.start_server` starts it beside the
gRPC server when given an ``http_port``.
"""
import os

from router.openai_api.app import create_app
from router.openai_api.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate, ChatTemplateError
from router.openai_api.errors import APIError
from router.openai_api.http_server import HTTPServer


def served_model_name(model: str) -> str:
    """The name clients use in ``model``: a preset's name, or the model directory's basename."""
    return os.path.basename(os.path.normpath(model)) or model


__all__ = ["APIError", "ChatTemplate", "ChatTemplateError", "DEFAULT_CHAT_TEMPLATE", "HTTPServer", "create_app",
           "served_model_name"]
