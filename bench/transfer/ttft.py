"""Low-load TTFT of the KV handoff: colocated vs disaggregated, with and without layer-wise streaming.

    python -m bench.transfer.ttft [--model small] [--lengths 512,2048,4094] [--reps 3]
                                  [--links loopback,10gbit,1gbit] [--transport tcp] [--codec none] [--json FILE]

One request at a time. The colocated engine (a `ColocatedWorker`) and the prefill engine (a
`PrefillWorker`) run in this process with the same engine settings (chunked prefill, 512-token
chunks, no prefix cache); a `DecodeWorker` with the transport's receiver runs in a second process
(in the second network namespace for a shaped link, see `netns.py`). TTFT is measured from the
job's submission to the first token event the serving worker emits (the colocated worker; for
disaggregation the decode worker, after every layer arrived and was checked, in the other process:
both read CLOCK_MONOTONIC). Router, Ray and HTTP are not in the path: the gap between the columns is
the handoff alone. Per length and variant the median of `--reps` (variants interleaved per rep, after a
warm-up of each). On a loaded box the prefill's own time varies far more than the handoff costs, so
beside the TTFTs the table splits each disaggregated request at the prefill side's first token: the
prefill compute before it, and the handoff after it (→ the decode worker's first token event, both
CLOCK_MONOTONIC). The target: the layer-wise handoff ≤ one layer's share of the transfer + 5 ms, the
transfer being the whole-prompt send's time (first token → receiver's ack) without layer-wise streaming.
Codec none also checks the decode side's tokens equal the colocated engine's.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time

import torch

from bench.transfer import netns

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKEN = "bench-ttft-token"
CHUNK_TOKENS = 512
MAX_TOKENS = 2
VARIANTS = ("colocated", "disaggregated", "layerwise")


def _engine(model: str, num_blocks: int):
    from engine import Engine, EngineArgs
    return Engine(EngineArgs(model, dtype="float32", num_blocks=num_blocks, chunk_size=CHUNK_TOKENS,
                             max_num_batched_tokens=CHUNK_TOKENS, enable_prefix_cache=False, attention="eager"))


def _params():
    from engine import SamplingParams
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


# ---- the decode process -------------------------------------------------------------------------
def decode_peer(model: str, transport: str, codec: str, host: str, num_blocks: int) -> None:
    """Serve a DecodeWorker; stdin: one JSON job a line; stdout: READY, then per request its first-token
    time and its tokens."""
    from decode_worker.worker import DecodeWorker
    from kv_transfer import layout_of, make_receiver
    from proto.pdserve.v1 import worker_pb2 as wpb

    engine = _engine(model, num_blocks)
    layout = layout_of(engine.kv_cache, engine.fingerprint)
    extra = {"host": host} if transport in ("grpc", "tcp", "torch") else {}
    worker = DecodeWorker(engine, lambda on_complete: make_receiver(
        transport, layout, engine.kv_cache, engine.block_manager, on_complete, codec=codec, token=TOKEN, **extra))
    worker.start()
    out_lock = threading.Lock()

    def say(message: dict) -> None:
        with out_lock:
            print(json.dumps(message), flush=True)

    say({"ready": worker.endpoint})
    for line in sys.stdin:
        job = json.loads(line)
        tokens: list[int] = []

        def emit(event, rid=job["request_id"], tokens=tokens) -> None:
            if not tokens:
                say({"first": rid, "t": time.monotonic()})
            tokens.extend(event.token_ids)
            if event.finish_reason or event.error.code:
                say({"done": rid, "tokens": tokens, "error": event.error.message})
        worker.submit(wpb.DecodeJob(request_id=job["request_id"], prompt_token_ids=job["prompt"],
                                    params=_params().to_proto(), transfer_id=job["transfer_id"],
                                    kv_timeout_s=120.0), emit)
        say({"registered": job["request_id"]})
    worker.stop()


class _Peer:
    """The decode process and its replies, read on a thread."""

    def __init__(self, prefix: list[str], args: list[str], env: dict):
        self.process = subprocess.Popen(prefix + [sys.executable, "-m", "bench.transfer.ttft", *args], cwd=ROOT,
                                        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.replies: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True).start()
        self.endpoint = self.expect("ready", timeout=300)["ready"]

    def _read(self) -> None:
        for line in self.process.stdout:
            self.replies.put(json.loads(line))
        self.replies.put({"eof": True})

    def expect(self, key: str, timeout: float = 120.0) -> dict:
        reply = self.replies.get(timeout=timeout)
        if key not in reply:
            raise RuntimeError(f"decode peer said {reply}, expected {key!r}")
        return reply

    def send(self, message: dict) -> None:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()


# ---- the prefill / colocated process ------------------------------------------------------------
def measure(model: str, transport: str, codec: str, lengths: list[int], reps: int, peer_prefix: list[str],
            host: str, device: str) -> list[dict]:
    from decode_worker.colocated import ColocatedWorker
    from kv_transfer import layout_of, make_sender
    from prefill_worker.worker import PrefillWorker
    from proto.pdserve.v1 import worker_pb2 as wpb

    num_blocks = max(lengths) // 16 + 8
    env = dict(os.environ, GLOO_SOCKET_IFNAME=device, PYTHONPATH=ROOT)
    peer = _Peer(peer_prefix, ["decode-peer", "--model", model, "--transport", transport, "--codec", codec,
                               "--host", host, "--num-blocks", str(num_blocks)], env)
    colocated = ColocatedWorker(_engine(model, num_blocks))
    p_engine = _engine(model, num_blocks)
    prefill = PrefillWorker(p_engine, make_sender(transport, layout_of(p_engine.kv_cache, p_engine.fingerprint),
                                                  codec=codec, token=TOKEN), layerwise=True)
    colocated.start()
    prefill.start()
    num_layers = p_engine.config.num_hidden_layers
    counter = iter(range(1 << 30))
    handoff: dict[bool, list[float]] = {}    # layerwise -> first token sampled (prefill) → first event (decode)
    compute: dict[bool, list[float]] = {}    # layerwise -> prefill compute (scheduled → first token sampled)

    def run_colocated(prompt: list[int]) -> tuple[float, list[int], float]:
        first, done, tokens = [], threading.Event(), []

        def emit(event) -> None:
            first or first.append(time.monotonic())
            tokens.extend(event.token_ids)
            if event.finish_reason or event.error.code:
                done.set()
        start = time.monotonic()
        colocated.submit(wpb.DecodeJob(request_id=f"c{next(counter)}", prompt_token_ids=prompt,
                                       params=_params().to_proto()), emit)
        assert done.wait(300), "colocated request did not finish"
        return first[0] - start, tokens, 0.0

    def run_disaggregated(prompt: list[int], layerwise: bool) -> tuple[float, list[int], float]:
        rid, results = f"d{next(counter)}", queue.SimpleQueue()
        transfer_id = f"t-{rid}"
        peer.send({"request_id": rid, "prompt": prompt, "transfer_id": transfer_id})
        peer.expect("registered")
        prefill.layerwise = layerwise            # read as the next job is admitted
        start = time.monotonic()
        prefill.submit(wpb.PrefillJob(request_id=rid, prompt_token_ids=prompt, params=_params().to_proto(),
                                      kv_endpoint=peer.endpoint, transfer_id=transfer_id, transfer_deadline_s=120.0),
                       results.put)
        first = peer.expect("first", timeout=300)
        done = peer.expect("done", timeout=300)
        result = results.get(timeout=60)
        if result.status != wpb.PREFILL_STATUS_SENT or done["error"]:
            raise RuntimeError(f"disaggregated request failed: {result.error or done['error']}")
        sampled = start + result.queue_s + result.prefill_s      # the prefill side's first token
        handoff[layerwise].append(first["t"] - sampled)
        compute[layerwise].append(result.prefill_s)
        return first["t"] - start, done["tokens"], result.transfer_s

    rows = []
    try:
        generator = torch.Generator().manual_seed(0)
        for length in lengths:
            warm = torch.randint(2, 1000, (length,), generator=generator).tolist()
            handoff, compute = {False: [], True: []}, {False: [], True: []}
            run_colocated(warm)
            run_disaggregated(warm, False)
            run_disaggregated(warm, True)
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            transfer_s, exact = [], True
            handoff, compute = {False: [], True: []}, {False: [], True: []}
            for rep in range(reps):
                prompt = torch.randint(2, 1000, (length,), generator=generator).tolist()
                order = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]
                outputs = {}
                for variant in order:
                    if variant == "colocated":
                        ttft, outputs[variant], _ = run_colocated(prompt)
                    else:
                        ttft, outputs[variant], sent = run_disaggregated(prompt, variant == "layerwise")
                        if variant == "disaggregated":
                            transfer_s.append(sent)
                    times[variant].append(ttft)
                exact &= codec != "none" or len({tuple(t) for t in outputs.values()}) == 1
            row = {"length": length, **{v: statistics.median(t) for v, t in times.items()},
                   "transfer_s": statistics.median(transfer_s), "num_layers": num_layers,
                   "kv_bytes": length * p_engine.config.kv_bytes_per_token(4), "tokens_equal": exact,
                   "handoff_s": statistics.median(handoff[False]),
                   "handoff_layerwise_s": statistics.median(handoff[True]),
                   "prefill_s": statistics.median(compute[False]),
                   "prefill_layerwise_s": statistics.median(compute[True])}
            row["target_s"] = row["transfer_s"] / num_layers + 0.005
            rows.append(row)
            print(f"  {length} tokens: colocated {row['colocated'] * 1e3:.0f} ms, disaggregated "
                  f"{row['disaggregated'] * 1e3:.0f} ms, layer-wise {row['layerwise'] * 1e3:.0f} ms", file=sys.stderr)
    finally:
        prefill.stop()
        colocated.stop()
        peer.close()
    return rows


def print_table(records: list[dict]) -> None:
    """TTFT medians; the prefill's compute (scheduled → first token); the handoff (first token sampled on
    the prefill side → first token event on the decode side), its target and whether it is met."""
    print(f"{'link':<9} {'tokens':>6} {'KV MiB':>6} | {'TTFT colo':>9} {'disagg':>7} {'l-wise':>7} | "
          f"{'prefill':>7} {'l-wise':>7} | {'handoff':>7} {'l-wise':>7} {'xfer':>6} {'target':>6} {'met':>3} "
          f"{'exact':>5}")
    for r in records:
        ms = {key: f"{r[key] * 1e3:.0f}ms" for key in ("colocated", "disaggregated", "layerwise", "prefill_s",
                                                        "prefill_layerwise_s", "transfer_s", "target_s")}
        handoff = {key: f"{r[key] * 1e3:.1f}ms" for key in ("handoff_s", "handoff_layerwise_s")}
        met = "yes" if r["handoff_layerwise_s"] <= r["target_s"] else "no"
        print(f"{r['link']:<9} {r['length']:>6} {r['kv_bytes'] / (1 << 20):>6.1f} | {ms['colocated']:>9} "
              f"{ms['disaggregated']:>7} {ms['layerwise']:>7} | {ms['prefill_s']:>7} {ms['prefill_layerwise_s']:>7} | "
              f"{handoff['handoff_s']:>7} {handoff['handoff_layerwise_s']:>7} {ms['transfer_s']:>6} "
              f"{ms['target_s']:>6} {met:>3} {'yes' if r['tokens_equal'] else 'NO':>5}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.transfer.ttft", description=__doc__.split("\n\n")[0])
    parser.add_argument("role", nargs="?", default="driver", choices=["driver", "decode-peer", "inner"])
    parser.add_argument("--model", default="small")
    parser.add_argument("--lengths", default="512,2048,4094", help="prompt tokens (prompt + 2 <= the context)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--links", default="loopback,10gbit,1gbit")
    parser.add_argument("--transport", default="tcp")
    parser.add_argument("--codec", default="none")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--num-blocks", type=int, default=0)
    parser.add_argument("--link", default="loopback")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.role == "decode-peer":
        decode_peer(args.model, args.transport, args.codec, args.host, args.num_blocks)
        return 0
    if args.role == "inner":                 # inside the first namespace of a shaped link
        link = netns.ShapedLink.__new__(netns.ShapedLink)
        rows = measure(args.model, args.transport, args.codec, lengths, args.reps, link.exec_prefix("b"),
                       link.address("b"), link.device("a"))
        print(json.dumps(rows), flush=True)
        return 0
    records = []
    links = args.links.split(",")
    if "loopback" in links:
        print("loopback ...", file=sys.stderr)
        records += [{"link": "loopback", **row} for row in measure(args.model, args.transport, args.codec, lengths,
                                                                    args.reps, [], "127.0.0.1", "lo")]
    shaped = [name for name in links if name in ("10gbit", "1gbit")]
    reason = netns.available() if shaped else None
    if reason:
        print(reason, file=sys.stderr)
    elif shaped:
        with netns.ShapedLink() as link:
            for name in shaped:
                link.set_rate(name)
                print(f"{name} ...", file=sys.stderr)
                inner = link.exec_prefix("a") + [sys.executable, "-m", "bench.transfer.ttft", "inner",
                                                 "--model", args.model, "--lengths", args.lengths,
                                                 "--reps", str(args.reps), "--transport", args.transport,
                                                 "--codec", args.codec]
                out = subprocess.run(inner, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                                     text=True, timeout=1200)
                if out.returncode != 0:
                    print(f"{name}: failed: {out.stderr.strip()[-500:]}", file=sys.stderr)
                    continue
                records += [{"link": name, **row} for row in json.loads(out.stdout.strip().splitlines()[-1])]
    print(f"model {args.model}, transport {args.transport}, codec {args.codec}, one request at a time, "
          f"{MAX_TOKENS} output tokens, median of {args.reps}")
    print_table(records)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(records, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
