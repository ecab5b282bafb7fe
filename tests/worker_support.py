"""Shared helpers of the worker tests: typed jobs, a per-request event collector, and a
prefill + decode worker pair joined by the in-process fake transport (no Ray)."""
from __future__ import annotations

import threading
import time
import uuid

import torch

from decode_worker.worker import DecodeWorker
from engine import Engine, EngineArgs, SamplingParams
from kv_transfer import FakeHub, KVLayout, make_receiver, make_sender
from kv_transfer.codec import stored_codec
from kv_transfer.settings import layout_of
from prefill_worker.worker import PrefillWorker
from proto.pdserve.v1 import worker_pb2 as wpb


def prompts_and_params(n: int, seed: int = 0, max_len: int = 500):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len, (n,), generator=g).tolist()
    prompts = [torch.randint(2, 1000, (length,), generator=g).tolist() for length in lengths]
    params = [SamplingParams(max_tokens=4 + (i * 5) % 24, temperature=0.0, ignore_eos=True) for i in range(n)]
    return prompts, params


def decode_job(request_id: str, prompt: list[int], params: SamplingParams, transfer_id: str = "",
               kv_timeout_s: float = 30.0, resume: list[int] = (), resume_text_chars: int = 0,
               num_cached_blocks: int = 0) -> wpb.DecodeJob:
    return wpb.DecodeJob(request_id=request_id, prompt_token_ids=prompt, params=params.to_proto(),
                         transfer_id=transfer_id, kv_timeout_s=kv_timeout_s, resume_output_ids=resume,
                         resume_text_chars=resume_text_chars, num_cached_blocks=num_cached_blocks)


def prefill_job(request_id: str, prompt: list[int], params: SamplingParams, kv_endpoint: str,
                transfer_id: str | None = None, deadline_s: float = 30.0, skip_blocks: int = 0) -> wpb.PrefillJob:
    return wpb.PrefillJob(request_id=request_id, prompt_token_ids=prompt, params=params.to_proto(),
                          kv_endpoint=kv_endpoint, transfer_id=transfer_id or uuid.uuid4().hex,
                          transfer_deadline_s=deadline_s, skip_blocks=skip_blocks)


class Collector:
    """Gathers each request's streamed `DecodeEvent`s, thread-safe; `done` once `expected` have ended."""

    def __init__(self, expected: int = 1):
        self.lock = threading.Lock()
        self.events: dict[str, list[wpb.DecodeEvent]] = {}
        self.done = threading.Event()
        self.expected = expected

    def sink(self, request_id: str):
        def emit(event: wpb.DecodeEvent) -> None:
            with self.lock:
                self.events.setdefault(request_id, []).append(event)
                ended = sum(1 for evs in self.events.values() if evs[-1].finish_reason or evs[-1].error.code)
                if ended >= self.expected:
                    self.done.set()
        return emit

    def tokens(self, request_id: str) -> list[int]:
        return [t for ev in self.events[request_id] for t in ev.token_ids]

    def text(self, request_id: str) -> str:
        return "".join(ev.text for ev in self.events[request_id])


def layout_of_engine(engine: Engine) -> KVLayout:
    c = engine.config
    return KVLayout(c.num_hidden_layers, c.num_key_value_heads, engine.block_size, c.head_dim,
                    engine.dtype, engine.fingerprint)


def worker_pair(model_dir: str, num_blocks: int = 256, transport: str = "fake", codec: str = "none",
                kv_cache_dtype: str = "auto", **decode_engine) -> tuple[PrefillWorker, DecodeWorker, FakeHub]:
    """Started prefill and decode workers over one transport (the in-process fake by default; grpc, tcp
    and torch listen on 127.0.0.1); stop both when done. `decode_engine`: extra `Engine` arguments of
    the decode side (e.g. max_num_seqs). A `kv_cache_dtype` fp8 / int8 cache on both sides ships its
    blocks as stored (`codec` is then its stored codec)."""
    hub = FakeHub()
    extra = {"hub": hub} if transport == "fake" else {}
    p_engine = Engine(EngineArgs(model_dir, dtype="float32", num_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype))
    d_engine = Engine(EngineArgs(model_dir, dtype="float32", num_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype,
                                 **decode_engine))
    layout = layout_of(p_engine.kv_cache, p_engine.fingerprint, p_engine.kv_format)
    if kv_cache_dtype != "auto":
        codec = stored_codec(kv_cache_dtype)
    prefill = PrefillWorker(p_engine, make_sender(transport, layout, codec=codec, **extra))
    decode = DecodeWorker(d_engine, lambda on_complete: make_receiver(
        transport, layout, d_engine.kv_cache, d_engine.block_manager, codec=codec, on_complete=on_complete,
        **extra))
    prefill.start()
    decode.start()
    return prefill, decode, hub


def wait_blocks_returned(*engines: Engine, timeout: float = 10.0) -> None:
    """Wait until no engine holds a block for a request, then check the pools for leaks."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(e.block_manager.num_used_blocks for e in engines):
        time.sleep(0.02)
    for e in engines:
        e.block_manager.check_no_leaks()


def wait_for(condition, timeout: float = 10.0, interval: float = 0.01) -> bool:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(interval)
    return True
