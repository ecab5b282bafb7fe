"""Fault injection on a 2P2D cluster: each fault with 32 requests in flight.

For every fault: no request hangs, every request ends with the reference
output or a clear status, the affected ones complete (a healthy actor of the
same role exists), every pool returns to zero used blocks, and the service
serves new requests afterwards. A kill waits until the victim has requests in
flight (the router's own view of it), never for a fixed time. The per-fault
counts are printed when the module's cluster stops (they go in docs/benchmarks/serving.md).
"""
from __future__ import annotations

import json
import os
import random
import signal
import threading
import time

import grpc
import jsonschema
import pytest
import ray

from engine import SamplingParams
from engine.sampling.structured import StructuredOutput
from proto.pdserve.v1 import generation_pb2 as pb
from router.client import generate

from cluster_helpers import ClusterThread, cluster_config, prompts_and_params, wait_blocks_free

N = 32
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def cluster(ray_local, tiny_model_dir):
    cfg = cluster_config(tiny_model_dir, "grpc", "none", 2, 2, max_queue=256)
    c = ClusterThread(cfg)
    c.cluster.backend.routing.transfer_deadline_s = 2.0
    c.cluster.backend.routing.stream_idle_s = 5.0
    c.cluster.manager.interval_s = 0.3
    yield c
    c.stop()
    for fault, line in REPORT.items():
        print(f"{fault}: {line}")


@pytest.fixture(scope="module")
def workload(reference):
    prompts, _ = prompts_and_params(N, seed=31, max_len=300)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return prompts, reference(prompts, [params] * N)


def _fire(cluster, prompts, cancel_at: dict[int, int] | None = None, timeout: float = 60.0):
    """Run every prompt concurrently; returns {i: (tokens, status_code or None)}."""
    results = {}

    def run(i):
        tokens, code = [], None
        call = generate(cluster.address, token_ids=prompts[i], max_tokens=MAX_TOKENS, temperature=0.0,
                        ignore_eos=True, timeout=timeout)
        try:
            for n, msg in enumerate(call):
                tokens += msg.token_ids
                if cancel_at and cancel_at.get(i) == n:
                    call.close()
                    code = "CANCELLED"
                    break
        except grpc.RpcError as e:
            code = e.code().name
        results[i] = (tokens, code)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    return threads, results


def _join(threads, limit: float = 90.0):
    end = time.monotonic() + limit
    for t in threads:
        t.join(max(end - time.monotonic(), 0))
    assert not any(t.is_alive() for t in threads), "a request hung"


def _settle(cluster):
    """Every actor healthy again, zero blocks used, and a fresh request served."""
    backend = cluster.cluster.backend
    end = time.monotonic() + 90
    views = [*backend.pools.prefill, *backend.pools.decode]
    while time.monotonic() < end:
        try:                                   # every actor answers (restarted ones included) ...
            ray.get([v.client.handle.info.remote() for v in views], timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            time.sleep(0.5)
            continue
        if all(v.healthy for v in views):      # ... and the router has them back in rotation
            break
        time.sleep(0.2)
    stats = wait_blocks_free(cluster.address, timeout=20)
    assert all(a.kv_blocks_used == 0 for a in stats.actors), stats
    # the router holds a token-stream channel only for endpoints actors serve now
    streams = cluster.cluster.factory.streams
    live = {v.client.stream_endpoint for v in backend.pools.decode}
    assert set(streams._stubs) <= live, (set(streams._stubs), live)
    assert list(generate(cluster.address, "after the fault", max_tokens=4, temperature=0.0))[-1].finish_reason


def _pid(handle) -> int:
    return ray.get(handle.info.remote(), timeout=30)["pid"]


def _running_on(view) -> int:
    return ray.get(view.client.handle.stats.remote(), timeout=10)["running_requests"]


def _wait_in_flight(busy, what: str, timeout: float = 60.0) -> None:
    """Wait until `busy()` holds: the victim has work in flight."""
    end = time.monotonic() + timeout
    while not busy():
        assert time.monotonic() < end, f"{what} never had requests in flight"
        time.sleep(0.005)


def _check_all_complete(results, expected, report, fault):
    ok = sum(1 for i, (tokens, code) in results.items() if code is None and tokens == expected[i])
    report[fault] = f"{ok}/{len(results)} completed with the reference output"
    bad = {i: (code, len(tokens)) for i, (tokens, code) in results.items() if code is not None or tokens != expected[i]}
    assert ok >= 0.99 * len(results), f"{fault}: {bad}"


REPORT: dict[str, str] = {}


def test_kill_decode_actor_mid_stream(cluster, workload, caplog):
    prompts, expected = workload
    victim = cluster.cluster.backend.pools.decode[0]
    pid = _pid(victim.client.handle)
    threads, results = _fire(cluster, prompts)
    # mid-stream: the actor itself reports requests in its running (decoding) batch
    _wait_in_flight(lambda: _running_on(victim) >= 2, "decode-0")
    with caplog.at_level("WARNING", logger="pdserve.deploy.pool_manager"):
        os.kill(pid, signal.SIGKILL)
        _join(threads)
        _check_all_complete(results, expected, REPORT, "kill -9 decode actor mid-stream")
        _settle(cluster)
    # the pool manager said how it died: no exit, no traceback, so killed outright
    said = [r.getMessage() for r in caplog.records if "is not answering" in r.getMessage()]
    assert any(victim.actor_id in line and "killed outright (SIGKILL" in line for line in said), said


JSON_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "tag"],
               "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                              "tag": {"enum": ["red", "green", "blue"]}}}


def test_kill_decode_actor_mid_constrained_stream(cluster):
    """Constrained requests migrate with their grammar: the new decode actor replays the tokens drawn before
    the kill through its matcher, so every stream (greedy or seeded) is the one the cluster gives without
    the fault, and every document still validates."""
    spec = StructuredOutput(json_schema=json.dumps(JSON_SCHEMA)).to_proto()
    prompts, _ = prompts_and_params(8, seed=43, max_len=200)
    sampling = [dict(temperature=0.0) if i % 2 else dict(temperature=0.8, seed=i) for i in range(len(prompts))]

    def fire():
        results: dict[int, tuple[list[int], str, str | None]] = {}

        def run(i):
            tokens, text, code = [], "", None
            try:
                for msg in generate(cluster.address, token_ids=prompts[i], max_tokens=160, structured=spec,
                                    timeout=60, **sampling[i]):
                    tokens += msg.token_ids
                    text += msg.text
                    if msg.finish_reason not in (pb.FINISH_REASON_UNSPECIFIED, pb.FINISH_REASON_STOP):
                        code = pb.FinishReason.Name(msg.finish_reason)
            except grpc.RpcError as e:
                code = e.code().name
            results[i] = (tokens, text, code)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        return threads, results

    threads, reference = fire()
    _join(threads)
    assert all(code is None for _, _, code in reference.values()), reference
    pids = {view.actor_id: _pid(view.client.handle) for view in cluster.cluster.backend.pools.decode}
    threads, results = fire()
    busy = []       # the decode actor that has two of them in its running batch first is the victim
    _wait_in_flight(lambda: busy.extend(v for v in cluster.cluster.backend.pools.decode if _running_on(v) >= 2)
                    or busy, "a decode actor")
    os.kill(pids[busy[0].actor_id], signal.SIGKILL)
    _join(threads)
    assert {i: r[2] for i, r in results.items() if r[2]} == {}
    assert {i: r[0] for i, r in results.items()} == {i: r[0] for i, r in reference.items()}
    for _, text, _ in results.values():
        jsonschema.validate(json.loads(text), JSON_SCHEMA)
    REPORT["kill -9 decode actor mid constrained stream"] = f"{len(results)}/{len(results)} equal and valid"
    _settle(cluster)


def test_kill_prefill_actor_mid_batch(cluster, workload):
    prompts, expected = workload
    victim = cluster.cluster.backend.pools.prefill[0]
    pid = _pid(victim.client.handle)
    threads, results = _fire(cluster, prompts)
    _wait_in_flight(lambda: victim.queued_tokens > 0, "prefill-0")      # prompts queued or computing there
    os.kill(pid, signal.SIGKILL)
    _join(threads)
    _check_all_complete(results, expected, REPORT, "kill -9 prefill actor mid-batch")
    _settle(cluster)


@pytest.mark.parametrize("fault", ["stall", "corrupt"])
def test_stalled_or_corrupted_transfer(cluster, workload, fault):
    prompts, expected = workload
    bad = cluster.cluster.backend.pools.prefill[0]
    ray.get(bad.client.handle.set_fault.remote(fault, 3.0))
    try:
        threads, results = _fire(cluster, prompts)
        _join(threads)
    finally:
        ray.get(bad.client.handle.set_fault.remote(None))
    _check_all_complete(results, expected, REPORT, f"{fault} KV transfer")
    _settle(cluster)


def test_receiver_disappears_mid_transfer(cluster, workload):
    prompts, expected = workload
    victim = cluster.cluster.backend.pools.decode[1]
    slow = cluster.cluster.backend.pools.prefill[1]
    pid = _pid(victim.client.handle)
    ray.get(slow.client.handle.set_fault.remote("stall", 0.3))       # keep transfers in flight for a while
    try:
        threads, results = _fire(cluster, prompts)
        _wait_in_flight(lambda: victim.running >= 2, "decode-1")       # requests reserved there, KV arriving
        os.kill(pid, signal.SIGKILL)
        _join(threads)
    finally:
        ray.get(slow.client.handle.set_fault.remote(None))
    _check_all_complete(results, expected, REPORT, "receiver killed mid-transfer")
    _settle(cluster)


def test_client_cancels_at_random_points(cluster, workload):
    prompts, expected = workload
    rng = random.Random(5)
    cancel_at = {i: rng.randrange(0, 20) for i in range(N) if i % 2}
    threads, results = _fire(cluster, prompts, cancel_at)
    _join(threads)
    for i, (tokens, code) in results.items():
        if i in cancel_at:
            assert tokens == expected[i][:len(tokens)]
        else:
            assert code is None and tokens == expected[i]
    REPORT["client cancels at random points"] = f"{N - len(cancel_at)}/{N - len(cancel_at)} uncancelled completed"
    _settle(cluster)
