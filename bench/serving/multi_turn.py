"""Multi-turn chat: KV wire bytes and TTFT per turn (``python -m bench.serving --workload multi-turn``).

Each conversation's turns go in order, and each turn's prompt is the previous prompt + the answer
the server streamed + a new user message (`workloads.make_conversations`). Conversations run one
after another, one request in flight, so the router's counters scraped around a turn (KV bytes
shipped, wire bytes, prefix-cache hit tokens) are that turn's alone. Per turn index, over the
conversations: prompt tokens, the full prompt's KV (every block a transfer of the whole prompt
ships, in the model dtype), what was shipped and what the wire carried (and their share of the
full KV), ``cached_tokens`` as the API reports it, and TTFT. With decode-side prefix reuse a turn
ships only the blocks the decode actor lacks: the new user message and the previous answer's
last partial block.
"""
from __future__ import annotations

import asyncio
import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from bench.serving.cluster import Target
from bench.serving.metrics import counter_delta, percentile, scrape
from bench.serving.workloads import Conversation, make_conversations


@dataclass(slots=True)
class TurnRecord:
    conversation: int
    turn: int
    prompt_len: int
    full_kv_bytes: int            # the whole prompt's KV blocks, model dtype
    ok: bool = False
    error: str = ""
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    num_output_tokens: int = 0
    cached_prompt_tokens: int = 0
    kv_bytes: float = math.nan    # shipped (router counter delta), model dtype
    wire_bytes: float = math.nan  # ... after the codec
    prefill_s: float = 0.0        # the server's breakdown of its TTFT (last message's timing)
    kv_transfer_s: float = 0.0


def kv_block_bytes(cfg) -> tuple[int, int]:
    """(block size, bytes of one KV block of every layer) of the deployment's model and KV dtype."""
    from engine.model.config import ModelConfig
    from engine.engine import pick_dtype
    from engine.model.presets import resolve_model
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    itemsize = pick_dtype(cfg.model.dtype, device).itemsize
    block_size = cfg.kv_cache.block_size
    return block_size, ModelConfig.from_dir(resolve_model(cfg.model.name)).kv_bytes_per_token(itemsize) * block_size


async def run_conversation(client, target: Target, conv: Conversation, index: int, tag: str, block: tuple[int, int],
                           timeout: float) -> list[TurnRecord]:
    """Send the turns of ``conv`` in order; one record per turn (a failed turn ends the conversation)."""
    block_size, block_bytes = block
    records, prompt, answer = [], list(conv.first_prompt), []
    for k, output_len in enumerate(conv.output_lens):
        if k:
            prompt = prompt + answer + conv.user_messages[k - 1]
        r = TurnRecord(index, k, len(prompt), -(-len(prompt) // block_size) * block_bytes)
        records.append(r)
        before = scrape(target.metrics_url, target.token)
        answer, started = [], time.perf_counter()
        try:
            async for msg in client.generate(token_ids=prompt, request_id=f"{tag}-c{index}-t{k}", timeout=timeout,
                                             max_tokens=output_len, temperature=0.0, ignore_eos=True):
                if msg.token_ids and not answer:
                    r.ttft_s = time.perf_counter() - started
                answer.extend(msg.token_ids)
                if msg.finish_reason:
                    r.cached_prompt_tokens = msg.usage.cached_prompt_tokens
                    r.prefill_s, r.kv_transfer_s = msg.timing.prefill_s, msg.timing.kv_transfer_s
        except Exception as e:             # grpc.RpcError and friends: report, stop this conversation
            r.error = f"{type(e).__name__}: {e}"
            return records
        r.e2e_s, r.num_output_tokens, r.ok = time.perf_counter() - started, len(answer), True
        # The prefill result (and its counters) may land just after the last token: until the router has
        # counted the turn's transfer or local prefill, scrape again (at most 2 s).
        after, end = scrape(target.metrics_url, target.token), time.monotonic() + 2.0
        while before is not None and after is not None and time.monotonic() < end and all(
                after[key] == before[key] for key in ("kv_bytes", "local_prefills")):
            await asyncio.sleep(0.01)
            after = scrape(target.metrics_url, target.token)
        delta = counter_delta(before, after)
        r.kv_bytes, r.wire_bytes = delta["kv_bytes"], delta["kv_wire_bytes"]
    return records


def summarize_turns(records: list[TurnRecord]) -> list[dict]:
    """One row per turn index: means over the conversations (TTFT p50 and mean)."""
    rows = []
    for k in sorted({r.turn for r in records}):
        ok = [r for r in records if r.turn == k and r.ok]
        if not ok:
            continue
        full = statistics.fmean(r.full_kv_bytes for r in ok)
        kv, wire = statistics.fmean(r.kv_bytes for r in ok), statistics.fmean(r.wire_bytes for r in ok)
        ttfts = [r.ttft_s for r in ok]
        rows.append({"turn": k + 1, "conversations": len(ok),
                     "prompt_tokens": statistics.fmean(r.prompt_len for r in ok),
                     "cached_tokens": statistics.fmean(r.cached_prompt_tokens for r in ok), "full_kv_bytes": full,
                     "kv_bytes": kv, "wire_bytes": wire, "kv_share": kv / full, "wire_share": wire / full,
                     "ttft_p50_s": percentile(ttfts, 50), "ttft_mean_s": statistics.fmean(ttfts),
                     "prefill_mean_s": statistics.fmean(r.prefill_s for r in ok),
                     "kv_transfer_mean_s": statistics.fmean(r.kv_transfer_s for r in ok)})
    return rows


async def measure(target: Target, args, conversations: list[Conversation], block: tuple[int, int]) -> dict[str, dict]:
    """Warm up with one unrelated conversation, then run every conversation against ``target``."""
    from router.client import AsyncGenerationClient
    client = AsyncGenerationClient(target.address, token=target.token)
    try:
        if args.num_warmup:
            warm = make_conversations(1, 2, args.seed + 10_000, args.scale, args.output_len)[0]
            await run_conversation(client, target, warm, 0, f"{target.label}-warmup", block, args.timeout)
        records = []
        for i, conv in enumerate(conversations):
            records += await run_conversation(client, target, conv, i, target.label, block, args.timeout)
    finally:
        await client.close()
    failed = [r for r in records if not r.ok]
    return {target.label: {"turns": summarize_turns(records), "failed": len(failed),
                           "errors": [r.error for r in failed][:5], "records": [asdict(r) for r in records]}}


def turn_table(runs: dict[str, dict]) -> str:
    """Per run, one line per turn: prompt, cached_tokens, full KV, shipped and wire bytes (share), TTFT
    (and the server's prefill and KV-transfer stages of it)."""
    head = (f"{'run':<22} {'turn':>4} {'prompt':>7} {'cached':>7} {'full KV KiB':>11} {'shipped KiB':>11} "
            f"{'wire KiB':>9} {'wire/full':>9} {'TTFT p50 ms':>11} {'TTFT mean ms':>12} {'prefill ms':>10} "
            f"{'KV xfer ms':>10}")
    lines = [head]
    for name, run in runs.items():
        for row in run["turns"]:
            share = "–" if math.isnan(row["wire_share"]) else f"{100 * row['wire_share']:.1f}%"
            shipped = "–" if math.isnan(row["kv_bytes"]) else f"{row['kv_bytes'] / 1024:.1f}"
            wire = "–" if math.isnan(row["wire_bytes"]) else f"{row['wire_bytes'] / 1024:.1f}"
            lines.append(f"{name:<22} {row['turn']:>4} {row['prompt_tokens']:>7.0f} {row['cached_tokens']:>7.0f} "
                         f"{row['full_kv_bytes'] / 1024:>11.1f} {shipped:>11} {wire:>9} {share:>9} "
                         f"{1e3 * row['ttft_p50_s']:>11.1f} {1e3 * row['ttft_mean_s']:>12.1f} "
                         f"{1e3 * row['prefill_mean_s']:>10.1f} {1e3 * row['kv_transfer_mean_s']:>10.1f}")
    return "\n".join(lines)
