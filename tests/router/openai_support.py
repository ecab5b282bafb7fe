"""A fake language model for the front-door tests: n / best_of sequences, logprobs, stops.

`ScriptedBackend` answers sequence ``i`` of every request with ``REPLIES[i % len(REPLIES)]``
(one byte token per chunk, the sequences' chunks interleaved round-robin), then EOS. Each
sequence's tokens have logprob ``SEQ_LOGPROBS[i]``, so their cumulative logprobs rank them
(best_of tests know the answer). It honours max_tokens, EOS (unless ignore_eos), stop strings
(cut unless include_stop_str_in_output) and stop_token_ids, and reports matched_stop.
"""
from __future__ import annotations

import asyncio
import threading

from proto.pdserve.v1 import generation_pb2 as pb
from router import ActorStats, Backend, BackendError, GenerationChunk, GenerationInput, Timing, Usage

BOS, EOS = 256, 257
REPLIES = ("Hello there!", "General Kenobi", "You are a bold one", "Kill him!")
SEQ_LOGPROBS = (-0.5, -0.1, -0.9, -0.2)     # per token; sequence 1 is the likeliest, then 3, 0, 2


class SpecialByteTokenizer:
    """Token id = UTF-8 byte (0..255); 256 = ``<s>`` (BOS, added by encode), 257 = ``</s>`` (EOS)."""

    vocab_size = 258
    eos_token_id = EOS
    SPECIAL = {BOS: "<s>", EOS: "</s>"}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = []
        rest = text
        while rest:                      # "<s>" / "</s>" in text are the special tokens, as in HF tokenizers
            for token_id, special in self.SPECIAL.items():
                if rest.startswith(special):
                    ids.append(token_id)
                    rest = rest[len(special):]
                    break
            else:
                ids.extend(rest[0].encode("utf-8"))
                rest = rest[1:]
        return [BOS] + ids if add_special_tokens else ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        out, pending = [], bytearray()
        for t in token_ids:
            if t < 256:
                pending.append(t)
                continue
            out.append(pending.decode("utf-8", errors="replace"))
            pending = bytearray()
            if not skip_special_tokens:
                out.append(self.SPECIAL[t])
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)


def _logprob(token_id: int, logprob: float, k: int) -> pb.TokenLogprob:
    top = [pb.TopLogprob(token_id=token_id, logprob=logprob)]
    top += [pb.TopLogprob(token_id=(token_id + j) % 256, logprob=logprob - j) for j in range(1, k)]
    return pb.TokenLogprob(token_id=token_id, logprob=logprob, top=top[:k])


class ScriptedBackend(Backend):
    """See the module docstring. ``release`` (cleared) holds requests in flight before their first chunk;
    with ``pause_after`` set, each request stops after that many chunks until ``resume`` is set;
    ``fail_with`` fails them (``fail_after`` chunks in); ``inputs`` records each request's `GenerationInput`;
    ``replies`` (ASCII) replace `REPLIES`."""

    def __init__(self, max_model_len: int = 256, replies: tuple[str, ...] = REPLIES) -> None:
        self.replies = replies
        self.tokenizer = SpecialByteTokenizer()
        self.max_model_len = max_model_len
        self.generation_defaults = {}
        self.is_ready = True
        self.release = threading.Event()
        self.release.set()
        self.fail_with: BackendError | None = None
        self.fail_after = 0
        self.pause_after: int | None = None
        self.resume = threading.Event()
        self.inputs: dict[str, GenerationInput] = {}
        self.active: set[str] = set()
        self.cancelled: list[str] = []

    async def generate(self, inp: GenerationInput):
        self.inputs[inp.request_id] = inp
        self.active.add(inp.request_id)
        try:
            while not self.release.is_set():
                await asyncio.sleep(0.002)
            async for chunk in self._chunks(inp):
                yield chunk
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled.append(inp.request_id)
            raise
        finally:
            self.active.discard(inp.request_id)

    async def _chunks(self, inp: GenerationInput):
        p = inp.params
        num = p.num_sequences
        k = p.logprobs if p.logprobs is not None else (0 if p.needs_logprobs else None)
        scripts = [list(self.replies[i % len(self.replies)].encode()) + [EOS] for i in range(num)]
        texts = [""] * num
        emitted = [0] * num
        pos = [0] * num
        done = [False] * num
        num_tokens = 0
        hold = max((len(s) - 1 for s in p.stop), default=0)
        sent = 0
        first = True
        while not all(done):
            for i in range(num):
                if done[i]:
                    continue
                if self.fail_with is not None and sent >= self.fail_after:
                    raise self.fail_with
                while sent == self.pause_after and not self.resume.is_set():
                    await asyncio.sleep(0.002)
                await asyncio.sleep(0)
                token_id = scripts[i][pos[i]] if pos[i] < len(scripts[i]) else ord(".")
                pos[i] += 1
                num_tokens += 1
                finish, matched = None, None
                if token_id < 256:
                    texts[i] += bytes([token_id]).decode("latin-1")
                if token_id == EOS and not p.ignore_eos:
                    finish, matched = pb.FINISH_REASON_STOP, EOS
                elif token_id in p.stop_token_ids:
                    finish, matched = pb.FINISH_REASON_STOP, token_id
                else:
                    hit = next((s for s in p.stop if s in texts[i]), None)
                    if hit is not None:
                        cut = texts[i].index(hit) + (len(hit) if p.include_stop_str_in_output else 0)
                        texts[i] = texts[i][:cut]
                        finish, matched = pb.FINISH_REASON_STOP, hit
                    elif pos[i] == p.max_tokens:
                        finish = pb.FINISH_REASON_LENGTH
                # hold back what could be the start of a stop string, as an engine does
                end = len(texts[i]) if finish is not None else max(len(texts[i]) - hold, emitted[i])
                delta = texts[i][emitted[i]:end]
                emitted[i] = end
                chunk = GenerationChunk([token_id], delta, finish, index=i, matched_stop=matched)
                if k is not None:
                    chunk.logprobs = [_logprob(token_id, SEQ_LOGPROBS[i % len(SEQ_LOGPROBS)], k)]
                if first and p.prompt_logprobs is not None:
                    chunk.prompt_logprobs = [_logprob(t, -1.0 - j, p.prompt_logprobs)
                                             for j, t in enumerate(inp.prompt_token_ids[1:])]
                first = False
                if finish is not None:
                    done[i] = True
                    if all(done):
                        chunk.usage = Usage(len(inp.prompt_token_ids), num_tokens, 2)
                        chunk.timing = Timing(queue_s=0.001, prefill_s=0.002)
                sent += 1
                yield chunk

    def expected_text(self, i: int, max_tokens: int | None = None) -> str:
        text = self.replies[i % len(self.replies)]
        return text if max_tokens is None else text[:max_tokens]

    async def stats(self) -> list[ActorStats]:
        return [ActorStats("decode-0", pb.ACTOR_ROLE_DECODE, 64, len(self.active), 0, len(self.active))]

    async def ready(self) -> bool:
        return self.is_ready


class EngineCluster:
    """Real engines behind the router: one prefill and one decode worker (the tiny model, float32, the
    in-process fake KV transport; bench/serving/local_actors.py) under the router's own `Dispatcher`, so a
    request served here is prefilled, shipped and decoded as a deployment does it. `serve` starts a router
    on it (gRPC + HTTP on free ports); `stop` checks that every block came back."""

    def __init__(self, model_dir: str, loop_thread, num_blocks: int = 512) -> None:
        from bench.serving.local_actors import start_local_cluster
        from engine import EngineArgs
        from router.dispatcher import Dispatcher
        from router.routing import RoutingSettings
        args = EngineArgs(model_dir)
        self.model_dir = model_dir
        self.loop_thread = loop_thread
        self.tokenizer = args.load_tokenizer()
        self.cluster = start_local_cluster(model_dir, 1, 1, num_blocks, num_blocks, 16)
        self.dispatcher = Dispatcher(self.cluster.pools, self.tokenizer, args.context_length(), 16,
                                     RoutingSettings(max_queue=64, stream_idle_s=30.0))
        self.servers = []

    @property
    def engines(self) -> list:
        return [w.engine for w in self.cluster.workers]

    def serve(self, **kwargs):
        from router import start_server
        server = self.loop_thread.run(start_server(self.dispatcher, port=0, http_port=0, ready_poll_s=0.01,
                                                   **{"model_name": "tiny", "model_dir": self.model_dir, **kwargs}))
        assert self.loop_thread.run(server.wait_ready(10.0))
        self.servers.append(server)
        return server

    def stop(self) -> None:
        from worker_support import wait_blocks_returned
        for server in self.servers:
            self.loop_thread.run(server.stop(0))
            assert server.core.num_in_flight == 0
        try:
            wait_blocks_returned(*self.engines)
            assert not any(e.has_unfinished() for e in self.engines)
        finally:
            self.cluster.stop()
