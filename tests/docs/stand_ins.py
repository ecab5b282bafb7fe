"""Stand-in servers for the docs' snippets: the router's real gRPC + OpenAI HTTP front doors over
`ScriptedBackend` (tests/router/openai_support.py), on free ports of 127.0.0.1.

- ``quick_start``: what ``pdserve serve`` with the embedded default config serves: no token, and the
  default config's model name (``pydoc``), so a snippet that names another model gets the 404 a user gets.
- ``cluster``: what docs/multinode.md's cluster serves: a bearer token, and the model folder the doc
  downloads (``--local-dir ~/.pdserve/models/<name>``: served by its folder name).
"""
from __future__ import annotations

import asyncio
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "router"))   # openai_support

from openai_support import ScriptedBackend  # noqa: E402

from deploy.config import load_config  # noqa: E402
from router import RouterServer, start_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_TOKEN = "docs-snippet-token"


@dataclass
class StandIn:
    server: RouterServer
    backend: ScriptedBackend
    model_name: str
    token: str | None

    @property
    def grpc_port(self) -> int:
        return self.server.port

    @property
    def http_port(self) -> int:
        return self.server.http_port


def cluster_model_name() -> str:
    """The folder docs/multinode.md downloads the checkpoint into, which the cluster serves it as."""
    [name] = set(re.findall(r"--local-dir ~/\.pdserve/models/(\S+)", (ROOT / "docs/multinode.md").read_text()))
    return name


@pytest.fixture(scope="session")
def stand_ins():
    """{"quick_start": StandIn, "cluster": StandIn}; on teardown no request may be left in flight."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="docs-snippet-loop", daemon=True)
    thread.start()

    def run(coro, timeout=10.0):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    servers = {}
    for key, model_name, token in (("quick_start", load_config(None).model.name, None),
                                   ("cluster", cluster_model_name(), CLUSTER_TOKEN)):
        backend = ScriptedBackend()
        server = run(start_server(backend, port=0, http_port=0, model_name=model_name, token=token,
                                  ready_poll_s=0.01))
        assert run(server.wait_ready(5.0))
        servers[key] = StandIn(server, backend, model_name, token)
    yield servers
    for s in servers.values():
        run(s.server.stop(0))
        assert not s.backend.active and s.server.core.num_in_flight == 0
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
