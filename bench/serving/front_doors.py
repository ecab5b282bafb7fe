"""What the HTTP front door costs over gRPC, apart from the model: both doors of one router over a
paced synthetic backend, the same requests through each.

The router runs in a process of its own (as deployed) over `PacedBackend`: the first token of a
request comes ``--first-token-ms`` after it arrives, then one token every ``--token-ms`` (a model
that does nothing, so the figures are the front doors' alone). This process is the load
generator: ``--concurrency`` clients each send ``--requests`` requests, alternating gRPC
(`GrpcLoadClient`) and OpenAI HTTP (`OpenAILoadClient`, aiohttp as vLLM's benchmark), so both
doors see the same load at the same moments. Printed side by side: TTFT, time per output token
and inter-token latency, and the difference HTTP − gRPC::

    python -m bench.serving.front_doors [--concurrency 1,16] [--requests 200] [--output-len 64]

The serving benchmark's ``--api grpc,openai`` measures the same difference on a real model
(`bench.serving`); this one isolates it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import time

from bench.serving.clients import GrpcLoadClient, OpenAILoadClient
from bench.serving.workloads import RequestSpec
from proto.pdserve.v1 import generation_pb2 as pb
from router import ActorStats, Backend, GenerationChunk, GenerationInput, Timing, Usage

VOCAB = 256


class ByteTokenizer:
    """Token id = byte; enough for the front doors (the backend sends each chunk's text)."""

    vocab_size = VOCAB
    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")


class PacedBackend(Backend):
    """First token ``first_token_s`` after the request, then one every ``token_s``; text ``"a"``."""

    def __init__(self, first_token_s: float, token_s: float) -> None:
        self.tokenizer = ByteTokenizer()
        self.max_model_len = 1 << 16
        self.generation_defaults = {}
        self.first_token_s = first_token_s
        self.token_s = token_s

    async def generate(self, inp: GenerationInput):
        n = inp.params.max_tokens
        start = time.monotonic()
        for i in range(n):
            due = start + self.first_token_s + i * self.token_s
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            last = i == n - 1
            yield GenerationChunk([97], "a", pb.FINISH_REASON_LENGTH if last else None,
                                  usage=Usage(len(inp.prompt_token_ids), n, 0) if last else None,
                                  timing=Timing() if last else None)

    async def stats(self) -> list[ActorStats]:
        return []

    async def ready(self) -> bool:
        return True


def _serve(first_token_s: float, token_s: float, ports: multiprocessing.Queue, stop: multiprocessing.Event) -> None:
    from router import start_server

    async def main() -> None:
        server = await start_server(PacedBackend(first_token_s, token_s), port=0, http_port=0, max_queue=4096,
                                    model_name="paced", ready_poll_s=0.05)
        await server.wait_ready(10)
        ports.put((server.address, server.http_url))
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await server.stop(0)

    asyncio.run(main())


async def _one(client, spec: RequestSpec, request_id: str) -> tuple[float, float, list[float]]:
    start = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    tokens = 0
    async for piece in client.stream(spec, request_id, 60.0):
        if not piece.num_tokens:
            continue
        now = time.perf_counter()
        if first is None:
            first = now
        else:
            gaps.append(now - last)
        last = now
        tokens += piece.num_tokens
    if first is None or tokens != spec.output_len:
        raise RuntimeError(f"{request_id}: {tokens} of {spec.output_len} tokens")
    return first - start, (last - first) / max(1, tokens - 1), gaps


async def measure(address: str, http_url: str, concurrency: int, requests: int, prompt_len: int,
                  output_len: int) -> dict[str, dict[str, float]]:
    """``requests`` per door, ``concurrency`` clients at once, each alternating the two doors."""
    grpc_client = GrpcLoadClient(address)
    http_client = await OpenAILoadClient.for_server(http_url)
    doors = {"grpc": grpc_client, "openai": http_client}
    results: dict[str, list] = {"grpc": [], "openai": []}
    spec = RequestSpec(list(range(1, prompt_len + 1)), output_len)
    per_worker = max(1, requests // concurrency)

    async def worker(w: int) -> None:
        for i in range(2 * per_worker + 2):
            name = ("grpc", "openai")[(i + w) % 2]
            result = await _one(doors[name], spec, f"w{w}-{i}")
            if i >= 2:                                   # the first of each door warms its connection
                results[name].append(result)

    try:
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    finally:
        await grpc_client.close()
        await http_client.close()
    out = {}
    for name, rows in results.items():
        gaps = [g for r in rows for g in r[2]]
        out[name] = {"requests": len(rows),
                     "ttft_p50_ms": 1e3 * statistics.median(r[0] for r in rows),
                     "ttft_mean_ms": 1e3 * statistics.fmean(r[0] for r in rows),
                     "tpot_p50_ms": 1e3 * statistics.median(r[1] for r in rows),
                     "tpot_mean_ms": 1e3 * statistics.fmean(r[1] for r in rows),
                     "itl_p50_ms": 1e3 * statistics.median(gaps),
                     "itl_p99_ms": 1e3 * statistics.quantiles(gaps, n=100)[98]}
    return out


def _table(concurrency: int, result: dict[str, dict[str, float]], first_token_ms: float, token_ms: float) -> str:
    g, h = result["grpc"], result["openai"]
    lines = [f"concurrency {concurrency}, {g['requests']} requests per door; backend: first token "
             f"{first_token_ms:g} ms, then one every {token_ms:g} ms",
             f"{'metric':<16}{'grpc':>10}{'openai':>10}{'openai-grpc':>13}{'':>9}"]
    for key, label in (("ttft_p50_ms", "TTFT p50"), ("ttft_mean_ms", "TTFT mean"), ("tpot_p50_ms", "TPOT p50"),
                       ("tpot_mean_ms", "TPOT mean"), ("itl_p50_ms", "ITL p50"), ("itl_p99_ms", "ITL p99")):
        diff = h[key] - g[key]
        lines.append(f"{label + ' (ms)':<16}{g[key]:>10.2f}{h[key]:>10.2f}{diff:>+13.2f}{diff / g[key]:>+9.1%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serving.front_doors", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,16", help="comma-separated concurrent clients, one run each")
    p.add_argument("--requests", type=int, default=200, help="requests per door per run")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--first-token-ms", type=float, default=20.0)
    p.add_argument("--token-ms", type=float, default=10.0)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    ctx = multiprocessing.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=_serve, args=(args.first_token_ms / 1e3, args.token_ms / 1e3, ports, stop),
                         daemon=True)
    server.start()
    records = {}
    try:
        address, http_url = ports.get(timeout=60)
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            print(f"concurrency {concurrency}: {args.requests} requests per door ...", file=sys.stderr, flush=True)
            result = asyncio.run(measure(address, http_url + "/v1", concurrency, args.requests, args.prompt_len,
                                         args.output_len))
            records[str(concurrency)] = result
            print(_table(concurrency, result, args.first_token_ms, args.token_ms) + "\n", flush=True)
    finally:
        stop.set()
        server.join(10)
        if server.is_alive():
            server.kill()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "cpu_count": os.cpu_count(), "runs": records}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
