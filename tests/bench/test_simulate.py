"""The simulator: its virtual clock, its timed engine and transport, and that it runs the real control plane."""
from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time

import pytest

from bench.serving.local_actors import start_local_cluster
from bench.serving.workloads import make_conversations, make_workload
from bench.simulate import cli
from bench.simulate.clock import SimulationStalled, run_virtual
from bench.simulate.measured import MeasuredModel
from bench.simulate.run import simulate
from bench.simulate.sim_cluster import build_cluster, context_of
from bench.simulate.sim_engine import SimEngine
from bench.simulate.sim_transport import SimNetwork, SimReceiver, SimSender
from bench.simulate.step_time import Chunk, StepTimeModel
from decode_worker.worker import DecodeWorker
from deploy.config import load_config
from engine.performance import MeasuredPerformance as Profile
from engine.args import EngineArgs
from engine.model.config import ModelConfig
from engine.model.presets import resolve_model
from engine.sampling.params import SamplingParams
from engine.scheduling.scheduler import Scheduler
from kv_transfer import KVPiece, TransferStatus
from kv_transfer.transports.fake import SimpleBlockPool
from prefill_worker.worker import PrefillWorker
from router.backend import GenerationInput
from router.dispatcher import Dispatcher
from router.routing import RoutingSettings
from router.timing import STAGE_NAMES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class LinearModel(StepTimeModel):
    """5 ms a step + 0.2 ms a token computed + 0.1 ms a sequence; 1 ms + 1 GB/s on the link."""

    name = "linear"
    num_layers = 4

    def __init__(self, kv_bytes_per_token: int = 4096):
        self.kv_bytes_per_token = kv_bytes_per_token

    def step_s(self, chunks):
        return 0.005 + 2e-4 * sum(c.new_tokens for c in chunks) + 1e-4 * len(chunks)

    def link_s(self, wire_bytes):
        return 1e-3 + wire_bytes / 1e9


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config(None, {"model.name": "tiny"})
    return cfg, ModelConfig.from_dir(resolve_model("tiny"))


def test_virtual_clock_jumps_and_orders_timers():
    order = []

    async def main():
        t0, wall = time.monotonic(), time.perf_counter()
        loop = asyncio.get_running_loop()
        loop.call_later(3.0, order.append, "b")
        loop.call_later(1.0, order.append, "a")
        await asyncio.sleep(3600)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.sleep(10), 2)
        return time.monotonic() - t0, time.perf_counter() - wall
    virtual_s, wall_s = run_virtual(main())
    assert virtual_s == pytest.approx(3602.0)
    assert wall_s < 1.0
    assert order == ["a", "b"]


def test_a_wait_nothing_can_end_is_reported():
    async def main():
        await asyncio.get_running_loop().create_future()
    with pytest.raises(SimulationStalled):
        run_virtual(main())


def test_measured_model_prices_decode_rows_and_prefill_chunks():
    costs = {"num_layers": 2, "hidden_size": 64, "attn_dim": 64, "layer_params": 100_000, "head_params": 10_000,
             "weight_bytes": 400_000, "kv_bytes_per_token": 512, "dtype_bytes": 4}
    profile = Profile({"prefill": {"engine": {"costs": costs}, "points": [
        {"prompt_len": 128, "batch": 1, "seconds": 0.01}, {"prompt_len": 512, "batch": 1, "seconds": 0.05}]},
        "decode": {"engine": {"costs": costs}, "points": [
            {"batch": 1, "context": 128, "seconds": 0.002, "bytes_per_s": 1e9},
            {"batch": 8, "context": 128, "seconds": 0.004, "bytes_per_s": 1e9}]},
        "transfer": {"wire_bytes": 1e6, "seconds": 0.01}})
    m = MeasuredModel(profile)
    assert m.step_s([Chunk(1, 128)] * 8) == pytest.approx(0.004)
    assert m.step_s([Chunk(128, 128)]) == pytest.approx(profile.prefill_seconds(128))
    chunk = profile.prefill_seconds(512) - profile.prefill_seconds(128)
    assert m.step_s([Chunk(384, 512), Chunk(1, 128)]) == pytest.approx(chunk + 0.002)
    assert m.link_s(2e6) == pytest.approx(0.02)
    assert (m.kv_bytes_per_token, m.num_layers) == (512, 2)


def test_transfer_reserves_blocks_then_delivers_and_cancel_frees_them():
    class Actor:
        busy_until, step_s = 0.0, 0.0

    async def main():
        pool, done = SimpleBlockPool(8), []
        net = SimNetwork()
        rx = SimReceiver(net, pool, done.append)
        tx = SimSender(net, Actor(), LinearModel(), kv_bytes_per_block=1 << 20, ratio=0.5, layerwise=False)
        t0 = time.monotonic()
        h = tx.send(KVPiece("r1", None, [0, 1, 2], transfer_id="t1", num_tokens=40, first_token_id=7), rx.endpoint)
        ended = []
        h.add_done_callback(lambda _: ended.append(time.monotonic()))
        await asyncio.sleep(1e-6)
        assert pool.num_used == 3 and rx.status("t1") is TransferStatus.TRANSFERRING
        while not h.done():
            await asyncio.sleep(1e-4)
        assert h.status is TransferStatus.DONE
        assert ended[0] - t0 == pytest.approx(1e-3 + 1.5 * (1 << 20) / 1e9, rel=1e-3)
        (result,) = rx.poll()
        assert (result.request_id, result.num_tokens, result.first_token_id) == ("r1", 40, 7)
        assert len(result.dst_block_ids) == 3 and pool.num_used == 3          # the decode worker owns them now
        pool.free(result.dst_block_ids)
        h2 = tx.send(KVPiece("r2", None, [0] * 9, transfer_id="t2"), rx.endpoint)      # more than the pool
        while not h2.done():
            await asyncio.sleep(1e-4)
        assert h2.status is TransferStatus.FAILED and "room" in h2.error and pool.num_used == 0
        h3 = tx.send(KVPiece("r3", None, [0, 1], transfer_id="t3"), rx.endpoint)
        await asyncio.sleep(1e-6)
        assert pool.num_used == 2
        assert rx.cancel(transfer_id="t3") == ["t3"] and pool.num_used == 0
        while not h3.done():
            await asyncio.sleep(1e-4)
        assert h3.status is TransferStatus.FAILED
    run_virtual(main())


def test_transfers_through_one_link_take_turns():
    """A link carries one transfer's bytes at a time: two prompts sent at once from one prefill actor, or to
    one decode actor, arrive one link time apart; two pairs of actors do not slow each other."""
    class Actor:
        busy_until, step_s = 0.0, 0.0

    one = 1e-3 + 2 * (1 << 20) / 1e9                    # LinearModel: 1 ms + 2 MiB at 1 GB/s

    async def ends(pairs: list[tuple[int, int]]) -> list[float]:
        net, t0 = SimNetwork(), time.monotonic()
        rxs = [SimReceiver(net, SimpleBlockPool(8), lambda _: None) for _ in range(2)]
        txs = [SimSender(net, Actor(), LinearModel(), kv_bytes_per_block=1 << 20, ratio=1.0, layerwise=False)
               for _ in range(2)]
        handles = [txs[s].send(KVPiece(f"r{i}", None, [0, 1], transfer_id=f"t{i}"), rxs[r].endpoint)
                   for i, (s, r) in enumerate(pairs)]
        done = {}
        for i, h in enumerate(handles):
            h.add_done_callback(lambda _, i=i: done.setdefault(i, time.monotonic() - t0))
        while len(done) < len(handles):
            await asyncio.sleep(1e-4)
        assert all(h.status is TransferStatus.DONE for h in handles)
        return [done[i] for i in range(len(handles))]

    bytes_s = one - 1e-3
    assert run_virtual(ends([(0, 0), (0, 1)])) == pytest.approx([one, one + bytes_s], rel=1e-6)   # one sender
    assert run_virtual(ends([(0, 0), (1, 0)])) == pytest.approx([one, one + bytes_s], rel=1e-6)   # one receiver
    assert run_virtual(ends([(0, 0), (1, 1)])) == pytest.approx([one, one], rel=1e-6)             # two links


def _run(cfg, shape, specs, mode="disaggregated", rate=20.0, seed=0):
    return simulate(cfg, LinearModel(shape.kv_bytes_per_token(4)), shape, specs, rate=rate, mode=mode, seed=seed,
                    slo_ttft_s=1.0, slo_tpot_s=0.05)


def _timings(run):
    return [(r.request_id, r.ok, r.num_output_tokens, round(r.ttft_s, 9), round(r.e2e_s, 9), len(r.itl_s))
            for r in run.records]


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_the_first_token_waits_for_the_prefill_step_that_makes_it(tiny, mode):
    """Requests one at a time: TTFT covers the whole prefill step (a KV send starts when the step that
    produced it ends, not at its start), and disaggregated adds the link's share past the overlap and
    nothing more: the idle decode actor adopts the KV and sends the first token before its next forward
    pass, not after it."""
    cfg, shape = tiny
    specs = make_workload("chat", 6, seed=3, scale=1.0, prompt_len=200, output_len=4)
    run = _run(cfg, shape, specs, mode, rate=0.5)
    model = LinearModel(shape.kv_bytes_per_token(4))
    prefill_s = model.step_s([Chunk(200, 200)])
    assert all(r.ok for r in run.records) and len(run.records) == 6
    link = model.link_s(-(-200 // 16) * 16 * model.kv_bytes_per_token * 0.25)      # fp8 on float32: ~1/4
    expected = prefill_s + (link / model.num_layers if mode == "disaggregated" else 0.0)
    assert [r.ttft_s for r in run.records] == pytest.approx([expected] * 6, rel=1e-4)


def test_the_report_counts_the_kv_moved_as_a_routers_metrics_do(tiny):
    """The dispatcher's per-request counters (the router's /metrics that `pdserve bench serve` reads) are in
    the simulated report: every prompt's KV blocks shipped once, at the codec's wire ratio; none colocated."""
    cfg, shape = tiny
    specs = make_workload("chat", 6, seed=3, scale=1.0, prompt_len=200, output_len=4)
    kv_per_prompt = -(-200 // 16) * 16 * LinearModel(shape.kv_bytes_per_token(4)).kv_bytes_per_token
    run = _run(cfg, shape, specs, "disaggregated", rate=0.5).summary
    assert run["kv_bytes"] == 6 * kv_per_prompt
    assert run["kv_wire_bytes"] == pytest.approx(0.25 * run["kv_bytes"], rel=0.05)      # fp8 on float32
    assert run["local_prefills"] == run["transfer_failures"] == 0
    colocated = _run(cfg, shape, specs, "colocated", rate=0.5).summary
    assert colocated["kv_bytes"] == colocated["kv_wire_bytes"] == 0


def test_the_timeline_books_the_prefill_step_as_compute(tiny):
    """A simulated step's time passes after it runs; the engine's stamps still read its end, so each
    request's timeline puts the prefill step under prefill_compute, not under the KV send after it."""
    cfg, shape = tiny
    specs = make_workload("chat", 4, seed=3, scale=1.0, prompt_len=200, output_len=4)
    run = _run(cfg, shape, specs, "disaggregated", rate=0.5)
    prefill_s = LinearModel(shape.kv_bytes_per_token(4)).step_s([Chunk(200, 200)])
    for r in run.records:
        assert r.timeline["prefill_compute_s"] == pytest.approx(prefill_s, abs=1e-6)
        assert r.timeline["kv_encode_s"] < 1e-6
        assert sum(r.timeline[name] for name in STAGE_NAMES) == pytest.approx(r.ttft_s, abs=1e-6)


def test_a_send_that_shares_the_prefill_cores_lengthens_its_step(tiny):
    """With a send cost on the prefill actor (`send_busy_s`: a CPU host's encode and socket work), the step
    that ships a prompt's KV lasts that much longer: the timeline books it as the KV encode after the
    prefill's compute, the first token comes that much later, and the prefill actor is busy for it (the
    next prompt waits)."""
    cfg, shape = tiny

    class Sharing(LinearModel):
        def send_busy_s(self, wire_bytes):
            return wire_bytes * 1e-7              # 0.1 s a wire MB

    specs = make_workload("chat", 4, seed=3, scale=1.0, prompt_len=200, output_len=4)
    plain = _run(cfg, shape, specs, "disaggregated", rate=0.5)
    model = Sharing(shape.kv_bytes_per_token(4))
    shared = simulate(cfg, model, shape, specs, rate=0.5, mode="disaggregated", slo_ttft_s=1.0, slo_tpot_s=0.05)
    busy = model.send_busy_s(-(-200 // 16) * 16 * model.kv_bytes_per_token * 0.25)     # fp8 on float32: ~1/4
    prefill_s = model.step_s([Chunk(200, 200)])
    for a, b in zip(plain.records, shared.records):
        assert a.timeline["prefill_compute_s"] == pytest.approx(prefill_s) == b.timeline["prefill_compute_s"]
        assert b.timeline["kv_encode_s"] - a.timeline["kv_encode_s"] == pytest.approx(busy, rel=0.02)
        assert b.ttft_s - a.ttft_s == pytest.approx(busy, rel=0.02)
    busy_s = {a["actor_id"]: a["busy"] * shared.duration_s - p["busy"] * plain.duration_s
              for a, p in zip(shared.actors, plain.actors)}
    assert busy_s["prefill-0"] == pytest.approx(4 * busy, rel=0.02) and busy_s["decode-0"] == pytest.approx(0, abs=1e-3)
    burst = simulate(cfg, model, shape, specs, rate=math.inf, mode="disaggregated", slo_ttft_s=1.0, slo_tpot_s=0.05)
    last = max(r.ttft_s for r in burst.records)        # all at once: the prompts queue behind each other's sends
    assert last >= max(r.ttft_s for r in _run(cfg, shape, specs, "disaggregated", rate=math.inf).records) + busy


class SharedLinear(LinearModel):
    """LinearModel with every actor on one host: a step with a prompt chunk takes 1.5× beside each actor in a
    step, a decode step 1.25× beside each actor in a step with a prompt chunk."""

    shared_host = True
    factors = {True: 1.5, False: 1.25}

    def shared_factor(self, prefill):
        return self.factors[prefill]


def test_a_shared_host_prices_a_step_by_what_the_other_actors_are_in(tiny):
    """On a shared host a step with a prompt chunk is slowed by every other actor in a step, a decode step
    only by those in a step with a prompt chunk (decode loops side by side do not slow each other), by
    1 + k·(factor − 1) for k such actors; with none, not at all."""
    cfg, shape = tiny

    async def main():
        cluster = build_cluster(cfg, SharedLinear(shape.kv_bytes_per_token(4)), shape, "disaggregated",
                                counts={"prefill": 1, "decode": 2})
        now = asyncio.get_running_loop().time()
        prefill, first, second = cluster.actors
        out = [prefill._shared(now, True)]                     # nobody else in a step
        first.busy_until, first.step_prefill = now + 1.0, False
        out.append(prefill._shared(now, True))                 # one decoding beside it
        second.busy_until, second.step_prefill = now + 1.0, False
        out.append(prefill._shared(now, True))                 # two
        prefill.busy_until = now + 1.0
        out.append(first._shared(now, False))                  # a decode step beside the prefill step ...
        prefill.step_prefill = False
        out.append(first._shared(now, False))                  # ... beside decode steps only
        return out
    assert run_virtual(main()) == pytest.approx([1.0, 1.5, 2.0, 1.25, 1.0])


def test_on_a_shared_host_overlapping_steps_take_longer(tiny):
    """The same trace with every actor on one host: where the prefill and decode steps overlap, both take
    longer (TTFT and TPOT rise); with factors of 1 the run is the plain one, token for token."""
    cfg, shape = tiny
    specs = make_workload("chat", 12, seed=3, scale=1.0, prompt_len=200, output_len=24)
    plain = _run(cfg, shape, specs, "disaggregated", rate=20.0)

    class Unshared(SharedLinear):
        factors = {True: 1.0, False: 1.0}

    def run(model):
        return simulate(cfg, model, shape, specs, rate=20.0, mode="disaggregated", slo_ttft_s=1.0, slo_tpot_s=0.05)
    kv = shape.kv_bytes_per_token(4)
    assert _timings(run(Unshared(kv))) == _timings(plain)
    shared = run(SharedLinear(kv))
    assert all(r.ok for r in shared.records)

    def mean(run, figure):
        return sum(figure(r) for r in run.records) / len(run.records)
    assert mean(shared, lambda r: r.ttft_s) > mean(plain, lambda r: r.ttft_s)
    assert mean(shared, lambda r: sum(r.itl_s)) > mean(plain, lambda r: sum(r.itl_s))
    prefill_s = LinearModel(kv).step_s([Chunk(200, 200)])
    computes = [r.timeline["prefill_compute_s"] for r in shared.records]
    assert min(computes) >= prefill_s - 1e-9 and max(computes) > prefill_s * 1.4     # some beside a decode step


def test_shared_host_needs_a_calibrated_measured_profile(tiny, tmp_path, capsys):
    """`--shared-host` prices sharing from the profile's `shared_prefill` / `shared_decode`: a profile without
    them, or a roofline GPU, is refused naming what to run."""
    costs = {"num_layers": 2, "hidden_size": 64, "attn_dim": 64, "layer_params": 100_000, "head_params": 10_000,
             "weight_bytes": 400_000, "kv_bytes_per_token": 512, "dtype_bytes": 4}
    data = {"prefill": {"engine": {"costs": costs}, "points": [{"prompt_len": 128, "batch": 1, "seconds": 0.01}]},
            "decode": {"engine": {"costs": costs}, "points": [
                {"batch": 1, "context": 128, "seconds": 0.002, "bytes_per_s": 1e9}]}}
    with pytest.raises(ValueError, match="plan_check --phases light,shared --calibrate"):
        MeasuredModel(Profile(data)).with_shared_host()
    calibrated = MeasuredModel(Profile({**data, "calibration": {"shared_prefill": 1.3, "shared_decode": 1.4}}))
    assert (calibrated.shared_factor(True), calibrated.shared_factor(False)) == (1.0, 1.0)    # separate hosts
    shared = calibrated.with_shared_host()
    assert shared.shared_host and (shared.shared_factor(True), shared.shared_factor(False)) == (1.3, 1.4)
    assert "shared host" in shared.name and not calibrated.shared_host
    assert cli.main(["--hardware", "H100-SXM", "--model", "llama-3-8b", "--shared-host"]) == 2
    assert "--shared-host" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_same_seed_same_run(tiny, mode):
    cfg, shape = tiny
    specs = make_workload("mixed", 30, seed=1, scale=0.25)
    a, b = _run(cfg, shape, specs, mode), _run(cfg, shape, specs, mode)
    assert all(r.ok for r in a.records)
    assert all(r.num_output_tokens == s.output_len for r, s in zip(a.records, specs))
    assert _timings(a) == _timings(b)
    assert _timings(a) != _timings(_run(cfg, shape, specs, mode, seed=2))      # other arrivals, other times


def test_a_run_leaves_the_garbage_collector_as_it_found_it(tiny, monkeypatch):
    """A run freezes what exists at its start and collects the young generation less often; both are undone
    when it ends, also when it fails."""
    import gc

    from bench.simulate import run as sim_run
    cfg, shape = tiny
    before = gc.get_threshold()
    seen = []

    async def load_under_a_frozen_collector(*args, **kwargs):
        seen.append((gc.get_freeze_count(), gc.get_threshold()))
        raise RuntimeError("the load generator failed")

    _run(cfg, shape, make_workload("chat", 3, seed=1, scale=0.1))
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    monkeypatch.setattr(sim_run, "run_load", load_under_a_frozen_collector)
    with pytest.raises(RuntimeError, match="load generator failed"):
        _run(cfg, shape, make_workload("chat", 3, seed=1, scale=0.1))
    assert seen[0][0] > 0 and seen[0][1][0] == sim_run.GC_YOUNG_THRESHOLD
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_same_seed_same_run_across_processes():
    """Hash randomization (set and dict orders of other processes) does not move a simulated figure."""
    code = ("import json, sys; from bench.simulate import cli; sys.exit(cli.main(['--hardware', 'H100-SXM', "
            "'--model', 'llama-2-7b', '--workload', 'mixed', '--num-requests', '24', '--rate', '8', "
            "'--compare', 'colocated,auto', '--json', sys.argv[1]]))")
    outs = []
    for i, hash_seed in enumerate(("1", "2")):
        path = f"/tmp/pdserve-sim-determinism-{os.getpid()}-{i}.json"
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        subprocess.run([sys.executable, "-c", code, path], check=True, cwd=ROOT, env=env, capture_output=True)
        with open(path) as f:
            outs.append(json.load(f)["runs"])
        os.unlink(path)
    assert outs[0] == outs[1]


def test_real_workers_and_scheduler_run_inside(tiny):
    """No fork: the simulated actors are pdserve's own workers over the engine's own Scheduler."""
    cfg, shape = tiny

    async def main():
        cluster = build_cluster(cfg, LinearModel(), shape, "disaggregated")
        return cluster
    cluster = run_virtual(main())
    kinds = {type(a.worker) for a in cluster.actors}
    assert kinds == {PrefillWorker, DecodeWorker}
    assert all(type(a.engine.scheduler) is Scheduler and isinstance(a.engine, SimEngine) for a in cluster.actors)
    assert type(cluster.dispatcher) is Dispatcher


def test_every_block_is_returned_and_outputs_complete(tiny):
    cfg, shape = tiny
    convs = make_conversations(6, 3, seed=0, scale=0.1)
    holder = {}

    import bench.simulate.run as run_module
    real_build = run_module.build_cluster

    def keep(*args, **kwargs):
        holder["cluster"] = c = real_build(*args, **kwargs)
        return c
    run_module.build_cluster = keep
    try:
        run = _run(cfg, shape, convs, rate=2.0)
    finally:
        run_module.build_cluster = real_build
    assert len(run.records) == 18 and all(r.ok for r in run.records)
    later = [r for r in run.records if r.kind != "turn-0"]
    assert sum(r.cached_prompt_tokens for r in later) > 0             # later turns hit their earlier turns' blocks
    for actor in holder["cluster"].actors:
        bm = actor.engine.block_manager
        assert bm.num_used_blocks == 0, actor.actor_id
        assert not actor.engine.requests


def _shared_prefix_trace(n: int) -> list[list[int]]:
    fams = [[3 + (i * 7) % 900 for i in range(64)], [5 + (i * 11) % 900 for i in range(64)]]
    return [fams[(i // 2) % 2] + [10 + i, 20 + i, 30 + i] for i in range(n)]


LOADS = [(0, 0, 0), (0, 40, 3), (1, 20, 1), (0, 10, 6), (1, 50, 2)]   # (decode actor, blocks, requests)


async def _placements(dispatcher, views, trace, settle) -> list[str]:
    """The decode actor each request of `trace` (sent one at a time) ran on."""
    chosen: list[str] = []                  # one stream a request: nothing fails here, nothing is retried
    for view in views:
        opened = view.client.open_stream

        def record(job, opened=opened, actor_id=view.actor_id):
            chosen.append(actor_id)
            return opened(job)
        view.client.open_stream = record
    for i, prompt in enumerate(trace):
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        loaded = views[LOADS[i % len(LOADS)][0]]         # a fixed load: blocks held by others, a running batch
        loaded.reserved_blocks += LOADS[i % len(LOADS)][1]
        loaded.running += LOADS[i % len(LOADS)][2]
        async for _ in dispatcher.generate(GenerationInput(f"q{i}", prompt, params, None)):
            pass
        loaded.reserved_blocks -= LOADS[i % len(LOADS)][1]
        loaded.running -= LOADS[i % len(LOADS)][2]
        await settle()
        await dispatcher.kv_poller.sync_all()
    assert len(chosen) == len(trace)
    return chosen


def test_placements_equal_the_real_clusters_on_the_same_trace(tiny):
    """Where timing does not matter (one request at a time, the cache index synced), the simulated router
    places every request on the same decode actor as the router over real engines."""
    trace = _shared_prefix_trace(8)
    cfg = load_config(None, {"model.name": "tiny", "pools.decode.count": 2, "pools.prefill.count": 1,
                             "kv_cache.num_blocks": 64, "kv_cache.block_size": 16})
    shape = ModelConfig.from_dir(resolve_model("tiny"))

    async def real():
        cluster = start_local_cluster("tiny", 1, 2, 64, 64, 16)
        d = Dispatcher(cluster.pools, tokenizer=None, max_model_len=1024, block_size=16, routing=RoutingSettings())

        async def settle():
            deadline = time.monotonic() + 5
            while any(w.engine.block_manager.num_used_blocks for w in cluster.workers) and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
        try:
            return await _placements(d, cluster.pools.decode, trace, settle)
        finally:
            cluster.stop()

    async def simulated():
        cluster = build_cluster(cfg, LinearModel(), shape, "disaggregated")
        cluster.start()

        async def settle():
            await asyncio.sleep(0.1)
        try:
            return await _placements(cluster.dispatcher, cluster.dispatcher.pools.decode, trace, settle)
        finally:
            cluster.stop()
    expected = asyncio.run(real())
    assert len(set(expected)) == 2                 # the trace does exercise the choice
    assert run_virtual(simulated()) == expected


def test_cli_reports_and_refuses_bad_input(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert cli.main(["--hardware", "H100-SXM", "--model", "llama-3-8b", "--workload", "rag", "--num-requests", "20",
                     "--rate", "4", "--compare", "colocated-chunked,disaggregated", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "TTFT p50 (ms)" in printed and "disaggregated / colocated-chunked" in printed
    result = json.loads(out.read_text())
    assert result["runs"]["disaggregated"]["completed"] == 20
    assert result["time_model"].startswith("roofline: H100-SXM")
    assert cli.main(["--hardware", "no-such-gpu"]) == 2
    assert "no-such-gpu" in capsys.readouterr().err
    assert cli.main(["--profile", str(tmp_path / "missing.json")]) == 2
    assert cli.main(["--hardware", "H100-SXM", "--compare", "colocated,bogus"]) == 2
    assert "bogus" in capsys.readouterr().err


@pytest.mark.parametrize("flags, named", [
    (["--num-requests", "0"], "--num-requests"), (["--rate", "nan"], "--rate"), (["--rate", "-1"], "--rate"),
    (["--scale", "0"], "--scale"), (["--prompt-len", "0"], "--prompt-len"), (["--timeout", "-1"], "--timeout"),
    (["--slo-ttft-ms", "-5"], "--slo-ttft-ms"), (["--burstiness", "0"], "--burstiness"),
    (["--devices", "0", "--sweep", "split"], "--devices"), (["--json", "/no/such/dir/out.json"], "--json"),
    (["--actor-start-s", "-1"], "--actor-start-s"), (["--top", "-1"], "--top")])
def test_a_bad_flag_is_refused_before_anything_runs_naming_it(flags, named, capsys):
    with pytest.raises(SystemExit) as refused:
        cli.main(["--hardware", "H100-SXM", "--model", "llama-3-8b", *flags])
    assert refused.value.code == 2
    assert f"argument {named}" in capsys.readouterr().err


def test_a_bad_workload_file_or_sweep_value_is_an_error_naming_it(tmp_path, capsys):
    base = ["--hardware", "H100-SXM", "--model", "llama-3-8b", "--num-requests", "2"]
    missing = tmp_path / "missing.jsonl"
    assert cli.main([*base, "--workload", str(missing)]) == 2
    assert f"workload {missing}: cannot read it" in capsys.readouterr().err
    assert cli.main([*base, "--sweep", "rate", "--sweep-values", "2,fast"]) == 2
    assert "--sweep-values: 'fast' is not a number" in capsys.readouterr().err
    assert cli.main(["--hardware", "H100-SXM", "--model", str(tmp_path), "--num-requests", "2"]) == 2
    assert "model directory has no config.json" in capsys.readouterr().err
    assert cli.main([*base, "--sweep", "rate", "--sweep-values", "inf"]) == 2
    assert "--sweep-values: must be a finite number above 0" in capsys.readouterr().err
    assert cli.main([*base, "--sweep", "split", "--devices", str(cli.MAX_SPLIT_DEVICES + 1)]) == 2
    assert "--sweep split takes 2 to" in capsys.readouterr().err
    assert cli.main([*base, "--compare", " , "]) == 2
    assert "--compare: no variant" in capsys.readouterr().err


def test_split_sweep_names_a_best_split_and_the_plan(capsys):
    assert cli.main(["--hardware", "A100-80GB", "--model", "llama-2-7b", "--workload", "rag", "--num-requests",
                     "30", "--sweep", "split", "--devices", "3", "--sweep-values", "2,8"]) == 0
    printed = capsys.readouterr().out
    assert "1P2D" in printed and "2P1D" in printed and "colocated" in printed
    assert "best:" in printed and "pdserve plan --devices 3 --tp 1:" in printed


def test_ratio_sweep_rows_and_a_pair_past_the_context_is_refused(tmp_path, capsys):
    """Each pair's row holds both variants' max rates, marked as lower bounds when every rate held; a
    pair longer than the model's context (llama-2-7b: 4096) is a clear error, not a crash."""
    out = tmp_path / "ratio.json"
    assert cli.main(["--hardware", "H100-SXM", "--model", "llama-2-7b", "--num-requests", "16", "--sweep", "ratio",
                     "--sweep-values", "200:20,1500:20", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["prompt_len"], r["output_len"]) for r in rows] == [(200, 20), (1500, 20)]
    for r in rows:
        assert r["colocated-chunked"] > 0 and r["disaggregated"] > 0
        assert r["gain"] == pytest.approx(r["disaggregated"] / r["colocated-chunked"])
        assert set(r["bounded"]) == {"colocated-chunked", "disaggregated"}
    printed = capsys.readouterr().out
    assert "1500:20" in printed and "disagg./coloc." in printed
    for r in rows:      # a ratio over a lower bound is an upper bound, and the other way round
        coloc, disagg = r["bounded"]["colocated-chunked"], r["bounded"]["disaggregated"]
        mark = "" if coloc and disagg else "?" if not (coloc or disagg) else "≤" if disagg else "≥"
        line = next(x for x in printed.splitlines() if x.strip().startswith(f"{r['prompt_len']}:{r['output_len']}"))
        assert line.rstrip().endswith(f" {mark}{r['gain']:.2f}×")
    assert cli.main(["--hardware", "H100-SXM", "--model", "llama-2-7b", "--sweep", "ratio",
                     "--sweep-values", "4000:200"]) == 2
    assert "4000:200 needs 4200 tokens, more than the model's context of 4096" in capsys.readouterr().err
    assert cli.main(["--hardware", "H100-SXM", "--sweep", "ratio", "--sweep-values", "2000-200"]) == 2
    assert "'2000-200' is not PROMPT:OUTPUT" in capsys.readouterr().err


def test_a_sweep_flags_held_points_that_measured_a_burst(tmp_path, capsys):
    """40 requests offered at 400 req/s all fit the decode actor's batch and meet loose SLOs, but the run
    completes far fewer per second than offered: a burst, flagged; at 5 req/s the run keeps up: not flagged."""
    out = tmp_path / "sweep.json"
    assert cli.main(["--hardware", "H100-SXM", "--model", "llama-3-8b", "--workload", "chat", "--num-requests", "40",
                     "--sweep", "rate", "--compare", "disaggregated", "--sweep-values", "5,400",
                     "--slo-ttft-ms", "5000", "--slo-tpot-ms", "200", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    points = {p["x"]: p for p in result["points"]["disaggregated"]}
    assert all(p["slo_attainment"] >= 0.9 for p in points.values())
    assert [(b["label"], b["rate_rps"]) for b in result["bursts"]] == [("disaggregated", 400)]
    assert result["bursts"][0]["completed_rps"] == pytest.approx(points[400]["request_throughput_rps"])
    assert points[400]["request_throughput_rps"] < 200
    assert points[5]["request_throughput_rps"] >= 2.5
    assert "measure a burst" in capsys.readouterr().out


def test_kv_tiers_are_refused_naming_the_key(capsys):
    """The simulated engines have no tiers below the paged cache: a config with them is refused, not run
    without them."""
    rc = cli.main(["--hardware", "H100-SXM", "--model", "llama-3-8b", "--num-requests", "4", "--rate", "1",
                   "--set", "kv_cache.tiers=[{kind: host, capacity_gib: 1}]"])
    assert rc == 2
    assert "kv_cache.tiers: the simulator does not model KV tiers" in capsys.readouterr().err


def test_a_workload_file_runs_as_its_rows_and_a_text_prompt_is_refused(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt_len": 40, "output_len": 3}\n{"prompt_len": 90, "output_len": 5}\n')
    out = tmp_path / "out.json"
    assert cli.main(["--hardware", "H100-SXM", "--model", "llama-3-8b", "--workload", str(rows),
                     "--num-requests", "5", "--rate", "20", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["runs"]["disaggregated"]["completed"] == 5
    assert result["lengths"]["input_len"]["min"] == 40 and result["lengths"]["input_len"]["max"] == 90
    assert result["lengths"]["output_len"]["max"] == 5
    text = tmp_path / "text.jsonl"
    text.write_text('{"prompt": "hello there", "output_len": 3}\n')
    assert cli.main(["--hardware", "H100-SXM", "--model", "llama-3-8b", "--workload", str(text)]) == 2
    assert 'give "prompt_len" instead of "prompt"' in capsys.readouterr().err


def test_multi_turn_conversations_run_in_order_and_reuse_their_prefix(tmp_path):
    out = tmp_path / "out.json"
    assert cli.main(["--hardware", "H100-SXM", "--model", "llama-3-8b", "--workload", "multi-turn",
                     "--num-requests", "4", "--num-turns", "3", "--rate", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["lengths"] == {"conversations": 4, "turns": 12}
    run = result["runs"]["disaggregated"]
    assert run["completed"] == 12 and run["failed"] == 0
    assert run["prefix_hit_rate"] > 0.3           # each later turn's prompt is the last prompt + answer + more


def test_a_rate_sweep_writes_its_plot(tmp_path):
    plots = tmp_path / "plots"
    out = tmp_path / "out.json"
    assert cli.main(["--hardware", "H100-SXM", "--model", "llama-3-8b", "--workload", "chat", "--num-requests",
                     "20", "--sweep", "rate", "--sweep-values", "2,8", "--plot", str(plots), "--json", str(out)]) == 0
    path = json.loads(out.read_text())["plot"]
    assert path.startswith(str(plots)) and open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("max_model_len", [None, 100_000])
def test_the_simulated_routers_context_is_the_engines_with_yarn(max_model_len):
    """A yarn model serves original context x factor (ModelConfig.context_limit): the simulated router bounds
    requests by the context the (simulated) engines take, not by max_position_embeddings alone."""
    shape = ModelConfig.from_dict({
        "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 32768,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}})
    cfg = load_config(None, {"model.name": "tiny", "model.max_model_len": max_model_len})
    engine_context = EngineArgs(model="tiny", max_model_len=max_model_len).context_length(shape)
    assert context_of(cfg, shape) == engine_context == (max_model_len or 131072)
