"""How an actor died, in one log line: what Ray knows of its death and the last lines it wrote.

    report = death_report(actor_id_hex, pid)   # sync (GCS and local files): run it off the event loop

Ray knows a death's kind (its actor table's death cause: killed by `ray.kill`, out of memory by Ray's
memory monitor, a constructor that raised, a worker process that went away) but not a signal or an
exit code: the raylet reaps its workers. What the process wrote last tells the rest: actors run with
`faulthandler` on, so a native crash (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) leaves a "Fatal Python
error" traceback, and a Python exception its traceback. A process that went away with neither was
killed outright: SIGKILL from a person, a supervisor or the kernel's OOM killer (`dmesg` tells which).
A restarted actor's death cause is gone from Ray's table by the time it answers again; its last lines
are still in the old process's log file.
"""
from __future__ import annotations

import re
from pathlib import Path

TAIL_LINES = 6
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def death_report(actor_id: str, pid: int, logs_dir: str | None = None) -> str:
    """``"<what happened>; ray: <its death cause>; last lines: <…> | <…>"``; parts Ray or the log lack are
    left out."""
    logs_dir = logs_dir or _local_logs_dir()
    if logs_dir and pid and _running(pid):    # on this node, and still there: nothing to ask Ray or the log
        return f"its process {pid} is alive but does not answer (hung, or too busy to)"
    cause = ray_death_cause(actor_id)
    tail = log_tail(pid, logs_dir)
    parts = [verdict(cause, tail)]
    if cause:
        parts.append(f"ray: {cause}")
    if tail:
        parts.append("last lines: " + " | ".join(tail))
    elif pid:
        parts.append(f"no log lines of pid {pid} on this node")
    return "; ".join(parts)


def verdict(cause: str, tail: list[str]) -> str:
    """The kind of death, from Ray's cause and the log's last lines."""
    text = " ".join(tail)
    if "Fatal Python error" in text:
        return "crashed in native code (see the fatal error below)"
    if "RAY_KILL" in cause or "ray.kill" in cause:
        return "killed by ray.kill (retired by the cluster, or by hand)"
    if "OUT_OF_MEMORY" in cause or "memory monitor" in cause:
        return "killed for memory by Ray's memory monitor"
    if "Traceback" in text or "constructor raised" in cause:
        return "crashed with a Python exception"
    if "INTENDED" in cause:
        return "exited on purpose"
    return ("went away without a word: killed outright (SIGKILL, by a person, a supervisor or the "
            "kernel's OOM killer) or its node went down")


def ray_death_cause(actor_id: str) -> str:
    """Ray's death cause for a dead actor, short ("" while it lives or restarts, or when Ray has none)."""
    try:
        import ray
        entry = ray._private.state.actors(actor_id)
    except Exception:  # noqa: BLE001 — a report never fails; Ray's internals may move
        return ""
    cause = entry.get("DeathCause") if isinstance(entry, dict) else None
    context = cause.WhichOneof("context") if cause is not None and hasattr(cause, "WhichOneof") else None
    if context is None:
        return ""
    detail = getattr(cause, context)
    if context == "creation_task_failure_context":
        formatted = getattr(detail, "formatted_exception_string", "") or str(detail)
        last = [line for line in formatted.splitlines() if line.strip()][-1:] or [""]
        return f"its constructor raised: {_short(last[0])}"       # the exception's own line
    reason = ""
    if hasattr(detail, "reason"):
        try:
            reason = type(detail).Reason.Name(detail.reason) if hasattr(type(detail), "Reason") else str(detail.reason)
        except Exception:  # noqa: BLE001
            reason = str(detail.reason)
    message = getattr(detail, "error_message", "")
    exit_type = re.search(r"Worker exit type: (\w+)", message)
    summary = " ".join(x for x in (reason, exit_type.group(1) if exit_type else "") if x)
    if context == "oom_context":
        return f"OUT_OF_MEMORY {_short(message)}"
    return summary or _short(message)


def log_tail(pid: int, logs_dir: str | None, lines: int = TAIL_LINES) -> list[str]:
    """The last non-empty lines the worker process ``pid`` wrote (stderr's, else stdout's), colour codes gone."""
    if not pid or not logs_dir:
        return []
    for suffix in ("err", "out"):
        for path in sorted(Path(logs_dir).glob(f"worker-*-{pid}.{suffix}")):
            try:
                text = path.read_bytes()[-64 * 1024:].decode(errors="replace")
            except OSError:
                continue
            kept = [_ANSI.sub("", line).strip() for line in text.splitlines()]
            kept = [line for line in kept if line and not line.startswith((":job_id:", ":actor_name:", ":task_name:",
                                                                           "Extension modules:"))]
            fatal = [i for i, line in enumerate(kept) if line.startswith("Fatal Python error")]
            if fatal:               # faulthandler's report: the error and the innermost frames of its thread
                kept = kept[fatal[-1]:fatal[-1] + lines]
            if kept:
                return [_short(line, 200) for line in kept[-lines:]]
    return []


def _running(pid: int) -> bool:
    """Whether process ``pid`` of this node exists and has not exited (a zombie waits for its reaper)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def _local_logs_dir() -> str | None:
    try:
        import ray
        return ray._private.worker._global_node.get_logs_dir_path()
    except Exception:  # noqa: BLE001 — not the node that started Ray, or Ray is gone
        return None


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"
