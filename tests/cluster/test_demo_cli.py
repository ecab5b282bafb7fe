"""`pdserve demo` as a user runs it, into a pipe: progress lines, texts as text, the stage table and its
legend, no colour codes, and the actors' output in the log file it names instead of on the terminal."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.demo import HEADER, PROMPTS

NUMBER = re.compile(r"^-?\d+(\.\d+)?$")


@pytest.mark.timeout(300)
def test_demo_prints_a_tour_and_keeps_actor_logs_in_a_file(tiny_model_dir):
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "demo", "--model", tiny_model_dir,
                             "--set", "kv_cache.num_blocks=256"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out + err[-3000:]
    lines = out.split("\n")

    assert "\x1b[" not in out + err
    for phase in ("- starting Ray", "- starting 1 prefill + 1 decode actors", "- model ready in ", "- sending 6"):
        assert any(line.startswith(phase) for line in lines), out
    for actor_line in ("Actor pid=", "kernel_choice", "pdserve.router", "Token authentication"):
        assert actor_line not in out + err, out + err[-3000:]

    assert sum(line.startswith("legend: ") for line in lines) == 1
    joined = " ".join(out.split())
    assert "TTFT = time to first token" in joined and "TPOT = time per output token after the first" in joined
    header = next(i for i, line in enumerate(lines) if line.split() == list(HEADER))
    rows = [line.split() for line in lines[header + 1:header + 1 + len(PROMPTS)]]
    assert [r[0] for r in rows] == [f"[{i}]" for i in range(1, len(PROMPTS) + 1)]
    assert all(len(r) == len(HEADER) and all(NUMBER.match(cell) for cell in r[1:]) for r in rows), rows
    for i, prompt in enumerate(PROMPTS, 1):
        assert f"[{i}] {prompt}" in lines
    assert not re.search(r"""^\s+['"]""", out, re.M), "completions print as text, not as string literals"

    path = Path(re.search(r"^- logs of the actors, the router and Ray: (\S+)", out, re.M).group(1))
    log = path.read_text()
    assert re.search(r"^\(PrefillActor pid=\d+\) .*prefill actor prefill-0 ready", log, re.M), log[-3000:]
    assert re.search(r"^\(DecodeActor pid=\d+\) .*decode actor decode-0 ready", log, re.M), log[-3000:]
    assert "pdserve.router: request_finished" in log and "\x1b[" not in log
    path.unlink()
