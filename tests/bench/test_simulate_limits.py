"""`pdserve simulate`'s limits: hardware files that would break a run or the host, and a sweep's workers
ending with the command."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from bench.simulate import cli
from bench.simulate.hardware import HARDWARE_DIR, MAX_MEMORY_BYTES, Hardware
from bench.simulate.models import model_config
from bench.simulate.roofline import RooflineModel
from bench.simulate.sim_engine import SimEngine
from bench.simulate.step_time import StepTimeModel
from engine.args import EngineArgs
from engine.model.config import ModelConfig
from engine.model.presets import resolve_model
from engine.sampling.params import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H100_TEXT = open(os.path.join(HARDWARE_DIR, "H100-SXM.yaml"), encoding="utf-8").read()
LLAMA_8B = model_config("llama-3-8b")
ZERO_BLOCKS_MEMORY = "18956247218"     # llama-3-8b on an H100-SXM: 100 kB left after the weights, a block is 2 MiB


def _hardware(tmp_path, memory: str) -> str:
    assert "memory_bytes: 80.0e+9\n" in H100_TEXT
    path = tmp_path / "gpu.yaml"
    path.write_text(H100_TEXT.replace("memory_bytes: 80.0e+9\n", f"memory_bytes: {memory}\n"))
    return str(path)


def _simulate(path: str, capsys) -> tuple[int, str]:
    code = cli.main(["--hardware", path, "--model", "llama-3-8b", "--num-requests", "3"])
    return code, capsys.readouterr().err


# -- memory_bytes: a sanity bound, and a stand-in cache that costs nothing per block ----------------

@pytest.mark.parametrize("memory", ["1.0e+300", "80.0e+12"])
def test_memory_bytes_above_the_bound_is_refused_naming_the_file_key_and_bound(tmp_path, capsys, memory):
    path = _hardware(tmp_path, memory)
    with pytest.raises(ValueError, match=rf"{path}: key 'memory_bytes' is .* above the sanity bound of 1e\+13"):
        Hardware.load(path)
    code, err = _simulate(path, capsys)
    assert code == 2
    assert path in err and "memory_bytes" in err and "1e+13" in err and "Traceback" not in err


@pytest.mark.parametrize("line, said", [
    ("memory_bytes_per_s: 1e-300", "key 'memory_bytes_per_s' is 1e-300, below the least a device has (1e+09)"),
    ("inter_node_link_bytes_per_s: 1", "key 'inter_node_link_bytes_per_s' is 1, below the least"),
    ("link_latency_s: 3600", "key 'link_latency_s' is 3600, above the most a device has (1)"),
    ("compute_efficiency: 1e-9", "key 'compute_efficiency' is 1e-09, below the least"),
    ("memory_bytes: 80.0e+9\nmemory_bytes: 1e9", ":10: not valid YAML (key 'memory_bytes' given twice)"),
])
def test_a_figure_no_device_has_or_a_key_given_twice_is_refused(tmp_path, capsys, line, said):
    """Figures that would price a step at years (a run that never ends) or at nothing, and a repeated key whose
    last value would silently win."""
    key = line.split(":")[0]
    text = "".join(line.replace("\\n", "\n") + "\n" if row.startswith(key + ":") else row
                   for row in H100_TEXT.splitlines(keepends=True))
    path = tmp_path / "gpu.yaml"
    path.write_text(text)
    code, err = _simulate(str(path), capsys)
    assert code == 2 and said in err and "Traceback" not in err
    with pytest.raises(ValueError, match="peak_flops.bf16"):
        Hardware.from_dict({**_fields(Hardware.load("H100-SXM")), "peak_flops": {"bf16": 1e-300}})


def test_yaml_merge_keys_load_and_an_unhashable_key_is_an_error(tmp_path, capsys):
    merged = tmp_path / "merged.yaml"
    merged.write_text(H100_TEXT.replace("peak_flops:\n", "peak_flops:\n  <<: {bf16: 1.0e+15}\n", 1))
    assert Hardware.load(str(merged)).flops("bf16") == 989.4e12        # the explicit key overrides the merged one
    odd = tmp_path / "odd.yaml"
    odd.write_text(H100_TEXT + "? [a, b]\n: 1\n")
    code, err = _simulate(str(odd), capsys)
    assert code == 2 and "not valid YAML (found an unhashable key (list))" in err and "Traceback" not in err


def test_memory_bytes_up_to_the_bound_loads():
    fields = _fields(Hardware.load("H100-SXM"))
    assert Hardware.from_dict({**fields, "memory_bytes": MAX_MEMORY_BYTES}).memory_bytes == MAX_MEMORY_BYTES
    with pytest.raises(ValueError, match="memory_bytes"):
        Hardware.from_dict({**fields, "memory_bytes": MAX_MEMORY_BYTES * 1.01})


class StepModel(StepTimeModel):
    name = "step"
    num_layers = 2
    kv_bytes_per_token = 4096

    def step_s(self, chunks):
        return 0.010 + 1e-4 * sum(c.new_tokens for c in chunks)

    def link_s(self, wire_bytes):
        return 1e-3 + wire_bytes / 1e9


def test_the_stand_in_cache_has_the_pools_shape_and_costs_no_memory_per_block():
    """The pool's blocks are the cache's dim 1, one block's bytes behind them all; an engine runs on it,
    forked sequences (a copied partial block) included."""
    tiny = ModelConfig.from_dir(resolve_model("tiny"))
    args = EngineArgs(num_blocks=200_000, block_size=16, max_num_seqs=64, max_num_batched_tokens=2048,
                      chunk_size=512)
    engine = SimEngine(args, tiny, StepModel())
    assert tuple(engine.kv_cache.shape) == (1, 200_000, 2, 1, 16, 1)
    assert engine.kv_cache.untyped_storage().nbytes() <= 2 * 16
    assert engine.block_manager.num_blocks == 200_000
    prompts = [[3 + (7 * i + j) % 200 for j in range(21 + i)] for i in range(3)]
    params = [SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0, seed=i, n=2) for i in range(3)]
    completions = engine.generate(prompts, params)
    assert len(completions) == 6 and all(len(c.token_ids) == 8 for c in completions)


# -- a pool of no KV block: refused before it runs --------------------------------------------------

def test_memory_that_leaves_no_kv_block_is_refused_naming_memory_weights_and_block(tmp_path, capsys):
    path = _hardware(tmp_path, ZERO_BLOCKS_MEMORY)
    model = RooflineModel(Hardware.load(path), LLAMA_8B, model_name="llama-3-8b")
    block_bytes = 16 * LLAMA_8B.kv_bytes_per_token(2)
    with pytest.raises(ValueError, match=rf"memory_bytes {ZERO_BLOCKS_MEMORY} leaves no room for a KV block"):
        model.kv_blocks(16)
    code, err = _simulate(path, capsys)
    assert code == 2
    assert f"memory_bytes {ZERO_BLOCKS_MEMORY}" in err and "the weights (16060522496 bytes per GPU)" in err
    assert f"one KV block (16 tokens) needs {block_bytes} bytes" in err


def test_a_pool_of_a_few_blocks_still_runs():
    """A few blocks is a real (small) pool: requests too long for it fail as the router fails them."""
    hw = Hardware.load("H100-SXM")
    model = RooflineModel(hw, LLAMA_8B, model_name="llama-3-8b")
    block_bytes = 16 * model.kv_bytes_per_token
    memory = (model.resident_weight_bytes + model.activation_reserve_bytes + 3.5 * block_bytes) / 0.9
    few = RooflineModel(Hardware.from_dict({**_fields(hw), "memory_bytes": memory}), LLAMA_8B)
    assert few.kv_blocks(16) == 3


def _fields(hw: Hardware) -> dict:
    raw = {f: getattr(hw, f) for f in hw.__dataclass_fields__ if f not in ("peak_flops", "sources")}
    raw["peak_flops"] = {d: v for d in ("bf16", "fp16", "fp8", "int8", "fp32")
                         if (v := getattr(hw.peak_flops, d)) is not None}
    return raw


# -- a file that is not UTF-8 ----------------------------------------------------------------------

def test_a_hardware_file_that_is_not_utf8_is_an_error_naming_the_file(tmp_path, capsys):
    path = tmp_path / "gpu.yaml"
    path.write_bytes(b"\xff\xfe" + H100_TEXT.encode("utf-16-le"))
    with pytest.raises(ValueError, match=rf"{path}: not UTF-8 text"):
        Hardware.load(str(path))
    code, err = _simulate(str(path), capsys)
    assert code == 2 and f"error: {path}: not UTF-8 text" in err


# -- a sweep's workers end with the command ---------------------------------------------------------

def _children(pid: int) -> dict[int, int]:
    """{pid: parent pid} of every live process below `pid` (from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _stat(int(entry))
        if stat is not None:
            parents[int(entry)] = int(stat[1])
    below, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in below:
                below[child] = ppid
                frontier.append(child)
    return below


def _stat(pid: int) -> list[str] | None:
    """(state, ppid, ...) of a process, None when it is gone (a zombie counts as gone: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_to_the_command_ends_its_sweep_workers_and_forkserver():
    command = [sys.executable, "-m", "bench.simulate", "--hardware", "H100-SXM", "--model", "llama-3-8b",
               "--num-requests", "50", "--rate", "0.001", "--compare", "colocated,disaggregated", "--jobs", "2"]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 12
        while time.monotonic() < deadline:
            children = _children(proc.pid)
            workers = [pid for pid, ppid in children.items() if ppid != proc.pid]    # the fork server's
            if len(workers) >= 2:
                break
            assert proc.poll() is None, "the sweep ended before its workers started"
            time.sleep(0.05)
        else:
            pytest.fail(f"no 2 workers within 12 s (processes below the command: {children})")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == -signal.SIGTERM
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_stat(pid) is not None for pid in children):
            time.sleep(0.05)
        left = [pid for pid in children if _stat(pid) is not None]
        assert not left, f"still running after the command ended: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in children:           # (only those this test started, should any be left)
            if _stat(pid) is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
