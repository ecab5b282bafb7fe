"""Layer-wise streaming: a prefill worker sends each layer's final blocks while prefill runs.

Real transports, chunked and batched prefill: the decode side's tokens equal the colocated
engine's, the blocks it adopts hold the prefill cache's bytes, the pieces go out in the
order the layers finish, and a failure or an abort mid-stream frees every block on both sides.
"""
from __future__ import annotations

import os
import threading

import pytest
import torch

from decode_worker.worker import DecodeWorker
from engine import Engine, EngineArgs, SamplingParams
from kv_transfer import FakeHub, make_receiver, make_sender
from kv_transfer.wire import split_frame
from prefill_worker.worker import PrefillWorker
from proto.pdserve.v1 import worker_pb2 as wpb
from worker_support import Collector, decode_job, layout_of_engine, prefill_job, wait_blocks_returned, wait_for

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
TOKEN = "layerwise-test-token"
CHUNK = 32          # prompt tokens per step and request: prompts over 32 tokens prefill in chunks


class Spy:
    """Records every send() piece as (request_id, layers, blocks, carries the handoff)."""

    def __init__(self, sender):
        self.sender, self.pieces, self.lock = sender, [], threading.Lock()
        clean = sender.send

        def send(piece, dest):
            with self.lock:
                self.pieces.append((piece.request_id, piece.layers, piece.blocks, bool(piece.handoff)))
            return clean(piece, dest)
        sender.send = send

    def of(self, request_id):
        with self.lock:
            return [piece[1:] for piece in self.pieces if piece[0] == request_id]


class Rig:
    """A started prefill + decode worker pair over one transport, the adopted and released blocks' bytes."""

    def __init__(self, kind: str, model_dir: str, codec: str = "none", layerwise: bool = True, num_blocks: int = 128):
        self.hub = FakeHub()
        hub = {"hub": self.hub} if kind == "fake" else {}
        p_engine = Engine(EngineArgs(model_dir, dtype="float32", num_blocks=num_blocks, chunk_size=CHUNK,
                                     max_num_batched_tokens=3 * CHUNK))
        d_engine = Engine(EngineArgs(model_dir, dtype="float32", num_blocks=num_blocks))
        layout = layout_of_engine(p_engine)
        sender = make_sender(kind, layout, codec=codec, token=TOKEN, **hub)
        self.spy = Spy(sender)
        self.prefill = PrefillWorker(p_engine, sender, layerwise=layerwise)
        self.decode = DecodeWorker(d_engine, lambda on_complete: make_receiver(
            kind, layout, d_engine.kv_cache, d_engine.block_manager, codec=codec, token=TOKEN,
            on_complete=on_complete, **hub))
        self.sent: dict[str, torch.Tensor] = {}        # request_id -> prefill cache rows of its blocks at release
        self.adopted: dict[str, torch.Tensor] = {}     # request_id -> decode cache rows of its blocks at adoption
        release, adopt = p_engine.release, d_engine.adopt

        def released(request_id):
            req = p_engine.requests.get(request_id)
            if req is not None:
                self.sent[request_id] = p_engine.kv_cache[:, req.block_table].clone()
            release(request_id)

        def adopted(request_id, first_token_ids, block_ids, *args, **kwargs):
            self.adopted[request_id] = d_engine.kv_cache[:, block_ids].clone()
            return adopt(request_id, first_token_ids, block_ids, *args, **kwargs)
        p_engine.release, d_engine.adopt = released, adopted
        self.prefill.start()
        self.decode.start()
        sender.handshake(self.decode.endpoint)          # warm: ray's first contact takes seconds

    def run(self, prompts, params, timeout: float = 60.0):
        collector, results = Collector(expected=len(prompts)), {}
        for i, (prompt, prm) in enumerate(zip(prompts, params)):
            job = prefill_job(f"r{i}", prompt, prm, self.decode.endpoint)
            self.decode.submit(decode_job(f"r{i}", prompt, prm, transfer_id=job.transfer_id), collector.sink(f"r{i}"))
            self.prefill.submit(job, lambda r: results.__setitem__(r.request_id, r))
        assert collector.done.wait(timeout)
        assert wait_for(lambda: len(results) == len(prompts), 10)
        return collector, results

    def close(self):
        self.prefill.stop()
        self.decode.stop()


@pytest.fixture
def rigs(tiny_model_dir):
    made = []

    def make(kind, **kwargs):
        if kind == "ray":
            import ray
            if not ray.is_initialized():
                ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
        made.append(Rig(kind, tiny_model_dir, **kwargs))
        return made[-1]
    yield make
    for rig in made:
        rig.close()


def _prompts():
    """A chunked 150-token prompt, and three short ones batched beside it (one block, a partial one)."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, 1000, (n,), generator=g).tolist() for n in (150, 20, 16, 45)]
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] * len(prompts)
    return prompts, params


@pytest.mark.parametrize("kind", ["fake", "tcp", "grpc", "torch", "ray"])
def test_streamed_layer_by_layer_equals_colocated(rigs, kind, reference):
    rig = rigs(kind)
    prompts, params = _prompts()
    if kind == "ray":            # the slowest case here: the chunked prompt and one batched beside it
        prompts, params = prompts[:2], params[:2]
    collector, results = rig.run(prompts, params)
    assert [collector.tokens(f"r{i}") for i in range(len(prompts))] == reference(prompts, params)
    assert all(r.status == wpb.PREFILL_STATUS_SENT for r in results.values())
    for i, prompt in enumerate(prompts):
        pieces, num_blocks = rig.spy.of(f"r{i}"), -(-len(prompt) // 16)
        # streamed during prefill; only the last layer's last block waited for the handoff
        assert len(pieces) > 1 and [p for p in pieces if p[2]] == [((3, 4), (num_blocks - 1, num_blocks), True)]
        # bit for bit: what the decode side adopted is what the prefill cache held
        assert torch.equal(rig.adopted[f"r{i}"].view(torch.uint8), rig.sent[f"r{i}"].view(torch.uint8))
        r = results[f"r{i}"]
        assert r.kv_bytes == rig.sent[f"r{i}"].numel() * 4 and r.wire_bytes >= r.kv_bytes     # headers on top
        # the timeline stamps every chunk from the first token (those streamed before it negative, when
        # the sender's threads got to them in time); the handoff's chunk goes after it
        chunk_s = list(r.stages.kv_chunk_s)
        assert r.stages.kv_chunks == len(chunk_s) >= len(pieces) and max(chunk_s) >= 0
    wait_blocks_returned(rig.prefill.engine, rig.decode.engine)


def test_fp8_stream_decodes_close_to_the_prefill_cache(rigs):
    rig = rigs("tcp", codec="fp8")
    prompts, params = _prompts()
    rig.run(prompts, params)
    for i in range(len(prompts)):
        sent, got = rig.sent[f"r{i}"], rig.adopted[f"r{i}"]
        assert (got - sent).norm() / sent.norm() < 0.05
    wait_blocks_returned(rig.prefill.engine, rig.decode.engine)


def test_pieces_go_out_layer_by_layer_as_chunks_complete(rigs):
    """40 tokens in chunks of 32 (blocks of 16): block 0 and 1 are final after chunk 1, the tail block 2
    after chunk 2; the last layer's tail goes with the handoff."""
    rig = rigs("fake")
    rig.run([list(range(100, 140))], [SamplingParams(max_tokens=2, temperature=0.0)])
    assert rig.spy.of("r0") == ([((layer, layer + 1), (0, 2), False) for layer in range(4)]
                                + [((layer, layer + 1), (2, 3), False) for layer in range(3)]
                                + [((3, 4), (2, 3), True)])
    wait_blocks_returned(rig.prefill.engine, rig.decode.engine)


def test_layerwise_off_sends_once_after_sampling(rigs, reference):
    rig = rigs("fake", layerwise=False)
    prompts, params = _prompts()
    collector, _ = rig.run(prompts, params)
    assert [collector.tokens(f"r{i}") for i in range(len(prompts))] == reference(prompts, params)
    assert all(rig.spy.of(f"r{i}") == [(None, None, True)] for i in range(len(prompts)))
    wait_blocks_returned(rig.prefill.engine, rig.decode.engine)


def test_a_failed_middle_layer_fails_the_transfer_and_frees_both_sides(rigs):
    rig = rigs("fake")
    middle = rig.prefill.engine.config.num_hidden_layers // 2

    def corrupt_the_middle_layer(frame):
        header, _ = split_frame(frame)
        return frame[:-3] + b"xyz" if header.layer_start == middle else frame
    rig.hub.tamper = corrupt_the_middle_layer
    hook = rig.prefill.engine.layer_hook

    def await_the_verdict(done):         # a network that answers before the next layer: the test is of the
        hook(done)                       # worker's reaction, not of how fast a loaded host delivers it
        stream = rig.prefill._streaming.get("r0")
        if stream is not None and any(layers == (middle, middle + 1) for layers, _, _ in rig.spy.of("r0")):
            assert wait_for(lambda: stream.failed() is not None, 30)
    rig.prefill.engine.layer_hook = await_the_verdict
    prompts, params = _prompts()
    collector, results = rig.run(prompts, params)
    for i in range(len(prompts)):
        error = collector.events[f"r{i}"][-1].error
        assert error.code == 14 and error.retryable and "checksum" in error.message   # UNAVAILABLE
        r = results[f"r{i}"]
        assert r.status == wpb.PREFILL_STATUS_FAILED and r.retryable
        assert r.failed_side == wpb.TRANSFER_SIDE_RECEIVER
    # the 150-token prompt stopped at its failed first chunk: no piece of a later chunk went out
    assert all(blocks[1] <= 2 for _, blocks, _ in rig.spy.of("r0"))
    wait_blocks_returned(rig.prefill.engine, rig.decode.engine)


def test_an_abort_mid_stream_frees_both_sides(rigs):
    rig = rigs("fake")
    results, collector = [], Collector()
    prompt, params = list(range(3, 250)), SamplingParams(max_tokens=4, temperature=0.0)
    hook = rig.prefill.engine.layer_hook

    def abort_at_the_first_layer(done):
        hook(done)
        if done.layer == 0 and not results and rig.spy.of("gone"):   # its first piece is out: abort
            rig.prefill.abort("gone")        # runs before the next step, mid-prefill
    rig.prefill.engine.layer_hook = abort_at_the_first_layer
    job = prefill_job("gone", prompt, params, rig.decode.endpoint)
    rig.decode.submit(decode_job("gone", prompt, params, transfer_id=job.transfer_id), collector.sink("gone"))
    rig.prefill.submit(job, results.append)
    assert wait_for(lambda: results, 30)
    assert results[0].status == wpb.PREFILL_STATUS_ABORTED
    assert rig.decode.receiver.num_active == 1       # the decode side holds the blocks of the first chunk
    rig.decode.abort("gone")                         # the router aborts both sides
    assert all(blocks[1] <= 2 for _, blocks, _ in rig.spy.of("gone"))    # only its first chunk went out
    wait_blocks_returned(rig.prefill.engine, rig.decode.engine)


def test_a_stream_whose_first_token_ends_it_is_freed_on_arrival(rigs):
    """Streamed before the prefill knew: the transfer completes with a handoff that says so, and the
    decode side frees it at once though no decode job waits for it."""
    rig = rigs("fake")
    engine = rig.prefill.engine
    prompt = list(range(40, 90))
    [first] = Engine(EngineArgs(engine.model_dir, dtype="float32", num_blocks=16)).generate(
        [prompt], SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids
    params = SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=(first,))
    results = []
    rig.prefill.submit(prefill_job("eos", prompt, params, rig.decode.endpoint), results.append)
    assert wait_for(lambda: results, 30)
    assert results[0].status == wpb.PREFILL_STATUS_FINISHED and len(rig.spy.of("eos")) > 1
    wait_blocks_returned(engine, rig.decode.engine)
