"""Multi-turn chat: KV wire bytes and TTFT per turn (``python -m bench.serving --workload multi-turn``).

Each conversation's turns go in order, and each turn's prompt is the previous prompt + the answer
the server streamed + a new user message (`workloads.make_conversations`). Conversations run one
after another, one request in flight, so the router's counters scraped around a turn (KV bytes
shipped, wire bytes, prefix-cache hit tokens) are that turn's alone. Per turn index, over the
conversations: prompt tokens, the tokens recomputed (prompt less ``cached_tokens`` as the API
reports it) and the cached share, the full prompt's KV (every block a transfer of the whole prompt
ships, in the model dtype), what was shipped and what the wire carried (and their share of the
full KV), and TTFT p50 / p90. With decode-side prefix reuse a turn ships only the blocks the decode
actor lacks: the new user message and the previous answer's last partial block.

``--interleave`` runs turn k of every conversation before turn k + 1 of any (still one request in
flight): with more conversations than the paged caches hold, a conversation's prefix has been
evicted by the time its next turn comes. ``--tiers none,host,disk`` then runs the same workload
on a fresh cluster per tier setting (kv_cache.tiers: none, a host tier, a disk tier), side by side;
each run also reports the tiers' offload and onboard bytes/s over its measured part (GetStats).
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


TIER_KINDS = ("none", "host", "disk")


def tier_overrides(kind: str, capacity_gib: float, directory: str) -> list[str]:
    """The `--set` items of a tier variant (`TIER_KINDS`)."""
    if kind not in TIER_KINDS:
        raise ValueError(f"--tiers: unknown tier {kind!r} (allowed: {', '.join(TIER_KINDS)})")
    if kind == "none":
        return ["kv_cache.tiers=[]"]
    where = f", path: {directory}" if kind == "disk" else ""
    return [f"kv_cache.tiers=[{{kind: {kind}, capacity_gib: {capacity_gib}{where}}}]"]


@dataclass(slots=True)
class ConversationState:
    conv: Conversation
    index: int
    prompt: list[int]
    answer: list[int]
    failed: bool = False


async def run_turn(client, target: Target, st: ConversationState, k: int, tag: str, block: tuple[int, int],
                   timeout: float) -> TurnRecord:
    """Send turn `k` of a conversation (its earlier turns ran); a failed turn ends the conversation."""
    block_size, block_bytes = block
    if k:
        st.prompt = st.prompt + st.answer + st.conv.user_messages[k - 1]
    prompt, index, output_len = st.prompt, st.index, st.conv.output_lens[k]
    r = TurnRecord(index, k, len(prompt), -(-len(prompt) // block_size) * block_bytes)
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
        st.failed = True
        return r
    st.answer = answer
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
    return r


async def run_conversations(client, target: Target, conversations: list[Conversation], tag: str,
                            block: tuple[int, int], timeout: float, interleave: bool = False,
                            first_index: int = 0) -> list[TurnRecord]:
    """Every turn of every conversation, one request in flight: conversation after conversation, or
    (`interleave`) turn k of each before turn k + 1 of any."""
    states = [ConversationState(c, first_index + i, list(c.first_prompt), []) for i, c in enumerate(conversations)]
    records = []
    if interleave:
        for k in range(max((len(c.output_lens) for c in conversations), default=0)):
            for st in states:
                if not st.failed and k < len(st.conv.output_lens):
                    records.append(await run_turn(client, target, st, k, tag, block, timeout))
        return records
    for st in states:
        for k in range(len(st.conv.output_lens)):
            records.append(await run_turn(client, target, st, k, tag, block, timeout))
            if st.failed:
                break
    return records


async def tier_totals(client) -> dict[str, float]:
    """Offload and onboard bytes over every actor's tiers (GetStats), and the tier kinds seen."""
    stats = await client.get_stats(timeout=10)
    tiers = [t for a in stats.actors for t in a.kv_tiers]
    return {"offload_bytes": float(sum(t.offload_bytes for t in tiers)),
            "onboard_bytes": float(sum(t.onboard_bytes for t in tiers)),
            "dropped_offloads": float(sum(t.num_dropped_offloads for t in tiers)),
            "kinds": sorted({t.kind for t in tiers})}


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
        prompt_total = sum(r.prompt_len for r in ok)
        cached_total = sum(r.cached_prompt_tokens for r in ok)
        rows.append({"turn": k + 1, "conversations": len(ok),
                     "prompt_tokens": statistics.fmean(r.prompt_len for r in ok),
                     "cached_tokens": statistics.fmean(r.cached_prompt_tokens for r in ok),
                     "recomputed_tokens": (prompt_total - cached_total) / len(ok),
                     "cached_share": cached_total / prompt_total, "full_kv_bytes": full,
                     "kv_bytes": kv, "wire_bytes": wire, "kv_share": kv / full, "wire_share": wire / full,
                     "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
                     "ttft_mean_s": statistics.fmean(ttfts),
                     "prefill_mean_s": statistics.fmean(r.prefill_s for r in ok),
                     "kv_transfer_mean_s": statistics.fmean(r.kv_transfer_s for r in ok)})
    return rows


async def measure(target: Target, args, conversations: list[Conversation], block: tuple[int, int],
                  tier: str | None = None) -> dict[str, dict]:
    """Warm up with one unrelated conversation, then run every conversation against ``target``; `tier`
    names the run's tier variant (its label is then ``<target>/<tier>``)."""
    from router.client import AsyncGenerationClient
    label = target.label if tier is None else f"{target.label}/{tier}"
    client = AsyncGenerationClient(target.address, token=target.token)
    try:
        if args.num_warmup:
            warm = make_conversations(1, 2, args.seed + 10_000, args.scale, args.output_len)
            await run_conversations(client, target, warm, f"{label}-warmup", block, args.timeout)
        before, started = await tier_totals(client), time.perf_counter()
        records = await run_conversations(client, target, conversations, label, block, args.timeout,
                                          getattr(args, "interleave", False))
        seconds, after = time.perf_counter() - started, await tier_totals(client)
    finally:
        await client.close()
    failed = [r for r in records if not r.ok]
    tiers = {"kinds": after["kinds"], "seconds": seconds,
             **{f"{key}_per_s": (after[key] - before[key]) / seconds
                for key in ("offload_bytes", "onboard_bytes")},
             "dropped_offloads": after["dropped_offloads"] - before["dropped_offloads"]}
    return {label: {"turns": summarize_turns(records), "failed": len(failed), "tiers": tiers,
                    "errors": [r.error for r in failed][:5], "records": [asdict(r) for r in records]}}


def turn_table(runs: dict[str, dict]) -> str:
    """Per run, one line per turn: prompt, cached_tokens, recomputed tokens and the cached share, full KV,
    shipped and wire bytes (share), TTFT p50 / p90 / mean (and the server's prefill and KV-transfer
    stages of it); then, per run with tiers, the tiers' bytes/s, and from turn 2 the figures beside the
    first run's (the baseline)."""
    head = (f"{'run':<26} {'turn':>4} {'prompt':>7} {'cached':>7} {'recomp':>7} {'cached%':>7} {'full KV KiB':>11} "
            f"{'shipped KiB':>11} {'wire KiB':>9} {'wire/full':>9} {'TTFT p50 ms':>11} {'TTFT p90 ms':>11} "
            f"{'TTFT mean ms':>12} {'prefill ms':>10} {'KV xfer ms':>10}")
    lines = [head]
    for name, run in runs.items():
        for row in run["turns"]:
            share = "–" if math.isnan(row["wire_share"]) else f"{100 * row['wire_share']:.1f}%"
            shipped = "–" if math.isnan(row["kv_bytes"]) else f"{row['kv_bytes'] / 1024:.1f}"
            wire = "–" if math.isnan(row["wire_bytes"]) else f"{row['wire_bytes'] / 1024:.1f}"
            lines.append(f"{name:<26} {row['turn']:>4} {row['prompt_tokens']:>7.0f} {row['cached_tokens']:>7.0f} "
                         f"{row['recomputed_tokens']:>7.0f} {100 * row['cached_share']:>6.1f}% "
                         f"{row['full_kv_bytes'] / 1024:>11.1f} {shipped:>11} {wire:>9} {share:>9} "
                         f"{1e3 * row['ttft_p50_s']:>11.1f} {1e3 * row['ttft_p90_s']:>11.1f} "
                         f"{1e3 * row['ttft_mean_s']:>12.1f} "
                         f"{1e3 * row['prefill_mean_s']:>10.1f} {1e3 * row['kv_transfer_mean_s']:>10.1f}")
    for name, run in runs.items():
        t = run.get("tiers") or {}
        if t.get("kinds"):
            lines.append(f"{name}: tiers {'+'.join(t['kinds'])}: offload {t['offload_bytes_per_s'] / 2**20:.2f} MiB/s, "
                         f"onboard {t['onboard_bytes_per_s'] / 2**20:.2f} MiB/s, "
                         f"{t['dropped_offloads']:.0f} offloads dropped")
    later = {name: later_turns(run.get("records", [])) for name, run in runs.items()}
    if len(later) > 1 and all(later.values()):
        base_name, base = next(iter(later.items()))
        for name, fig in later.items():
            lines.append(f"turns 2+ {name}: cached {100 * fig['cached_share']:.1f}% of prompt tokens "
                         f"({base_name}: {100 * base['cached_share']:.1f}%), TTFT p50 {1e3 * fig['ttft_p50_s']:.1f} ms "
                         f"= {fig['ttft_p50_s'] / base['ttft_p50_s']:.2f}x {base_name}'s")
    return "\n".join(lines)


def later_turns(records: list[dict]) -> dict | None:
    """Cached share and TTFT p50 over every turn after the first (None when there is none)."""
    ok = [r for r in records if r["ok"] and r["turn"] > 0]
    if not ok:
        return None
    return {"cached_share": sum(r["cached_prompt_tokens"] for r in ok) / sum(r["prompt_len"] for r in ok),
            "ttft_p50_s": percentile([r["ttft_s"] for r in ok], 50)}
