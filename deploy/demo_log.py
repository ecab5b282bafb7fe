"""The demo's log file: what a `pdserve demo` run logs besides the tour, kept off the terminal.

Two sources write to it:

- this process's log records (the router's ``pdserve.*`` loggers, uvicorn, Ray's own ``ray`` logger,
  Python warnings): while a `DemoLog` is open, one handler on the file replaces the root logger's, the
  ``ray`` logger's and ``logging.lastResort`` (``ray.init(configure_logging=False)`` leaves the ``ray``
  logger without handlers: its warnings go to the last resort);
- the actors' output. Under ``ray.init(log_to_driver=False)`` Ray forwards none of it and keeps each
  worker's stdout and stderr in ``<temp dir>/<session>/logs/worker-*.out|err`` on its node; `follow`
  copies their new lines every `POLL_S`, each prefixed as Ray's forwarding prefixes it,
  ``(PrefillActor pid=123)``, without colour codes.

Only this node's worker files are followed: actors on other nodes of a joined cluster keep their logs there.
"""
from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
import time
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
ACTOR_MARKER = ":actor_name:"                # Ray's first lines in a worker's files name its job and actor
OTHER_MARKERS = (":job_id:", ":task_name:")
POLL_S = 0.25


def default_path() -> Path:
    return Path(tempfile.gettempdir()) / f"pdserve-demo-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"


def ray_logs_dir() -> Path:
    """This node's log folder of the Ray session this process is connected to."""
    import ray
    context = ray.get_runtime_context()
    return Path(context.get_temp_dir()) / context.get_session_name() / "logs"


class _WorkerFile:
    """How far one worker file was copied, its unfinished last line, and whose output it holds."""

    __slots__ = ("offset", "partial", "pid", "actor_name")

    def __init__(self, path: Path):
        self.offset, self.partial = 0, b""
        self.pid = path.stem.rsplit("-", 1)[-1]          # worker-<worker id>-<job id>-<pid>.out|err
        self.actor_name = ""

    @property
    def prefix(self) -> str:
        return f"({self.actor_name} pid={self.pid})" if self.actor_name else f"(pid={self.pid})"


class DemoLog:
    """A context manager: while open, log records and (after `follow`) actor output go to ``path``."""

    def __init__(self, path: Path):
        self.path = path
        self._workers: dict[Path, _WorkerFile] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._saved: list[tuple[logging.Logger, list[logging.Handler], bool]] = []

    def __enter__(self) -> DemoLog:
        import ray  # noqa: F401  (its import installs the `ray` logger's handler, replaced below)
        self._file = open(self.path, "a", encoding="utf-8", buffering=1)
        self._handler = logging.StreamHandler(self._file)
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        for logger in (logging.getLogger(), logging.getLogger("ray")):
            self._saved.append((logger, list(logger.handlers), logger.propagate))
            logger.handlers = [self._handler]
            logger.propagate = False
        self._last_resort, logging.lastResort = logging.lastResort, self._handler
        pdserve = logging.getLogger("pdserve")
        self._pdserve_level = pdserve.level
        pdserve.setLevel(logging.INFO)       # the router's lifecycle and per-request lines
        logging.captureWarnings(True)
        return self

    def follow(self, logs_dir: Path) -> None:
        """Copy the worker files of ``logs_dir`` (see `ray_logs_dir`) into the log until `close`."""
        self._logs_dir = logs_dir
        self._thread = threading.Thread(target=self._run, name="pdserve-demo-log", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self._copy_new()

    def _copy_new(self) -> None:
        for path in sorted([*self._logs_dir.glob("worker-*.out"), *self._logs_dir.glob("worker-*.err")]):
            if path not in self._workers:
                self._workers[path] = _WorkerFile(path)
            worker = self._workers[path]
            try:
                with open(path, "rb") as f:
                    f.seek(worker.offset)
                    data = f.read()
            except OSError:
                continue
            worker.offset += len(data)
            *lines, worker.partial = (worker.partial + data).split(b"\n")
            self._write(worker, lines)

    def _write(self, worker: _WorkerFile, lines: list[bytes]) -> None:
        out = []
        for raw in lines:
            line = ANSI.sub("", raw.decode("utf-8", "replace")).rstrip()
            if line.startswith(ACTOR_MARKER):
                worker.actor_name = line[len(ACTOR_MARKER):]
            elif line and not line.startswith(OTHER_MARKERS):
                out.append(f"{worker.prefix} {line}\n")
        if out:
            self._handler.acquire()      # one writer at a time with the log records
            try:
                self._file.writelines(out)
            finally:
                self._handler.release()

    def close(self) -> None:
        """Stop following (after a last copy), put the handlers back, close the file. Idempotent."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._copy_new()
        for logger, handlers, propagate in self._saved:
            logger.handlers, logger.propagate = handlers, propagate
        if self._saved:
            logging.lastResort = self._last_resort
            logging.getLogger("pdserve").setLevel(self._pdserve_level)
            logging.captureWarnings(False)
            self._saved = []
            self._file.close()

    def __exit__(self, *exc) -> None:
        self.close()
