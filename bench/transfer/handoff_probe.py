"""The KV handoff per transport, with and without layer-wise streaming, in one process.

    python -m bench.transfer.handoff_probe [--transports tcp,grpc,torch,ray] [--model small] [--length 1024]
                                           [--reps 3]

A PrefillWorker and a DecodeWorker in this process (so every transport, ray included, runs
without a second process), one request at a time, codec none. Per transport and variant the
median (after one warm-up) of the handoff: the prefill side's first token → the decode worker's
first token event, and the prefill compute before it. Both workers share this process's cores
and GIL, so the figures are a comparison between the variants, not a deployment's latency
(`bench.transfer.ttft` runs the decode side in its own process).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
TOKEN = "bench-handoff-token"


def probe(transport: str, model: str, length: int, reps: int) -> dict[bool, tuple[float, float]]:
    from decode_worker.worker import DecodeWorker
    from engine import Engine, EngineArgs, SamplingParams
    from kv_transfer import layout_of, make_receiver, make_sender
    from prefill_worker.worker import PrefillWorker
    from proto.pdserve.v1 import worker_pb2 as wpb

    def engine() -> Engine:
        return Engine(EngineArgs(model, dtype="float32", num_blocks=length // 16 + 8, enable_prefix_cache=False,
                                 attention="eager"))
    p_engine, d_engine = engine(), engine()
    layout = layout_of(p_engine.kv_cache, p_engine.fingerprint)
    sender = make_sender(transport, layout, codec="none", token=TOKEN)
    prefill = PrefillWorker(p_engine, sender)
    decode = DecodeWorker(d_engine, lambda on_complete: make_receiver(
        transport, layout, d_engine.kv_cache, d_engine.block_manager, on_complete, codec="none", token=TOKEN))
    prefill.start()
    decode.start()
    sender.handshake(decode.endpoint)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True).to_proto()
    generator = torch.Generator().manual_seed(0)
    figures: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    try:
        for rep in range(reps + 1):
            for layerwise in (True, False) if rep % 2 else (False, True):
                rid = f"r{rep}-{layerwise}"
                prompt = torch.randint(2, 1000, (length,), generator=generator).tolist()
                first, done, results = [], threading.Event(), []

                def emit(event, first=first, done=done) -> None:
                    first or first.append(time.monotonic())
                    if event.finish_reason or event.error.code:
                        done.set()
                decode.submit(wpb.DecodeJob(request_id=rid, prompt_token_ids=prompt, params=params,
                                            transfer_id=f"t-{rid}", kv_timeout_s=120), emit)
                prefill.layerwise = layerwise        # read as the job is admitted
                start = time.monotonic()
                prefill.submit(wpb.PrefillJob(request_id=rid, prompt_token_ids=prompt, params=params,
                                              kv_endpoint=decode.endpoint, transfer_id=f"t-{rid}",
                                              transfer_deadline_s=120), results.append)
                if not done.wait(300):
                    raise RuntimeError(f"{transport}: request {rid} did not finish")
                while not results:
                    time.sleep(0.005)
                result = results[0]
                if rep:                              # rep 0 warms both variants up
                    sampled = start + result.queue_s + result.prefill_s
                    figures[layerwise].append((first[0] - sampled, result.prefill_s))
    finally:
        prefill.stop()
        decode.stop()
    return {lw: (statistics.median(h for h, _ in rows), statistics.median(p for _, p in rows))
            for lw, rows in figures.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.transfer.handoff_probe",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--transports", default="tcp,grpc,torch,ray")
    parser.add_argument("--model", default="small")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"model {args.model}, {args.length}-token prompts, codec none, medians of {args.reps}, one process")
    print(f"{'transport':<9} {'handoff whole':>13} {'layer-wise':>10} {'prefill whole':>13} {'layer-wise':>10}")
    for transport in args.transports.split(","):
        if transport == "ray":
            import ray
            if not ray.is_initialized():
                ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
        got = probe(transport, args.model, args.length, args.reps)
        print(f"{transport:<9} {got[False][0] * 1e3:>11.1f}ms {got[True][0] * 1e3:>8.1f}ms "
              f"{got[False][1] * 1e3:>11.0f}ms {got[True][1] * 1e3:>8.0f}ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
