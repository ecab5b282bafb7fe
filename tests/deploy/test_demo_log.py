"""`DemoLog`: Ray worker files and this process's log records land in one file, prefixed, uncoloured,
and the logging set-up is put back on close (no Ray: the worker files are written here)."""
from __future__ import annotations

import logging

from deploy.demo_log import DemoLog
from worker_support import wait_for


def _text(path) -> str:
    return path.read_text() if path.exists() else ""


def test_worker_lines_and_log_records_go_to_the_file(tmp_path):
    logs_dir, path = tmp_path / "logs", tmp_path / "demo.log"
    logs_dir.mkdir()
    worker = logs_dir / "worker-4213abcd-01000000-12091.err"
    worker.write_bytes(b":job_id:01000000\n:actor_name:PrefillActor\n\x1b[36mprefill actor ready\x1b[0m\nhalf a ")
    (logs_dir / "worker-624fc9f8-ffffffff-11955.out").write_bytes(b":job_id:ffffffff\nidle worker line\n")
    root_handlers = list(logging.getLogger().handlers)
    last_resort = logging.lastResort

    with DemoLog(path) as log:
        log.follow(logs_dir)
        assert wait_for(lambda: "(PrefillActor pid=12091) prefill actor ready\n" in _text(path))
        with worker.open("ab") as f:
            f.write(b"line\n")
        assert wait_for(lambda: "(PrefillActor pid=12091) half a line\n" in _text(path))
        logging.getLogger("pdserve.router").info("request_finished request_id=r1")
        ray_logger = logging.getLogger("ray")
        saved, ray_logger.handlers = ray_logger.handlers, []        # as ray.init(configure_logging=False) leaves it
        ray_logger.warning("Token authentication is enabled for this Ray cluster.")
        ray_logger.handlers = saved

    text = path.read_text()
    assert "(pid=11955) idle worker line\n" in text
    assert "INFO pdserve.router: request_finished request_id=r1\n" in text
    assert "WARNING ray: Token authentication is enabled for this Ray cluster.\n" in text
    assert "\x1b" not in text and ":job_id:" not in text and ":actor_name:" not in text
    assert logging.getLogger().handlers == root_handlers and logging.lastResort is last_resort
