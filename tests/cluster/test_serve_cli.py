"""`pdserve serve` as a user runs it: ready line, a completion, every listener on 127.0.0.1, clean SIGTERM."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import re

import pytest

from engine.parallel.group import free_port
from router.client import generate


def _tree(pid: int) -> set[int]:
    """pid and all its descendants, from /proc."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                pass
    tree, grew = {pid}, True
    while grew:
        new = {p for p, pp in parent.items() if pp in tree} - tree
        tree |= new
        grew = bool(new)
    return tree


def _listeners(pids: set[int]) -> list[tuple[int, str]]:
    """(pid, local address) of every TCP listening socket those processes hold (`ss -ltnp`)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        local = line.split()[3]
        for pid in map(int, re.findall(r"pid=(\d+)", line)):
            if pid in pids:
                found.append((pid, local))
    return found


@pytest.mark.timeout(180)
def test_serve_listens_on_loopback_only_and_drains(tiny_model_dir, tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "serve", "--model", tiny_model_dir,
                             "--port", str(port), "--set", "kv_cache.num_blocks=256"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        end = time.monotonic() + 120
        while "pdserve ready" not in (tmp_path / "serve.log").read_text() and time.monotonic() < end:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            time.sleep(0.5)
        out = list(generate(f"127.0.0.1:{port}", "hello", max_tokens=5, temperature=0.0, timeout=60))
        assert out[-1].usage.completion_tokens == 5
        listeners = _listeners(_tree(proc.pid))
        loopback = ("127.0.0.1:", "[::ffff:127.0.0.1]:")          # the second: IPv4-mapped, same address
        assert listeners and all(addr.startswith(loopback) for _, addr in listeners), listeners
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        text = (tmp_path / "serve.log").read_text()
        assert text.count("pdserve ready") == 1 and "drained=True" in text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
