"""Measure what an engine achieves on this hardware: prefill FLOP/s and decode bytes/s.

Drives the engine's own steps (scheduler → runner → sampler → output) on its own
paged cache, so batching, chunking and per-step overheads are those of serving:
prefill of fresh random prompts (one, or as many as a saturated step takes), decode
steps of adopted sequences holding a given context. Everything is aborted and its
blocks freed afterwards. The engine must be idle; call it on the engine's loop thread
(the engine is not thread-safe) — the actors post it there with `EngineLoop.call`.

An engine with speculative decoding (engine/spec) measures plain decode steps with its
proposals held off, and speculative steps with exactly k proposals per sequence (the
draft's own proposing included; n-gram proposals, a few dict reads, stand in as k
random tokens, since random contexts repeat nothing); and the acceptance rate of its
method at k on the model's held-out text, where the model directory has some
(`heldout_passages.json`, written beside the committed models by their training recipe).
Its speculative counters are left as they were.

FLOPs and bytes of each point are counted by `engine.cost_model` (the seeds' ledger).
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator

import torch

from engine.cost_model import ModelCosts
from engine.model.kernel_choice import settle
from engine.sampling.params import SamplingParams
from engine.spec.turn_down import TurnDown

HELDOUT_FILE = "heldout_passages.json"     # {"passages": [{"token_ids": [...]}, ...]}
ACCEPTANCE_PROMPTS = 8
ACCEPTANCE_PROMPT_TOKENS = 128
ACCEPTANCE_MAX_TOKENS = 32


def engine_costs(engine) -> ModelCosts:
    return ModelCosts.of(engine.config, engine.dtype.itemsize, engine.model.quantized_weights(),
                         engine.kv_format.bytes_per_token)


def describe(engine) -> dict:
    """What a profile was measured on (saved beside the points)."""
    spec = engine.speculator.config if engine.speculator is not None else None
    return {"speculative": {"method": spec.method, "num_tokens": spec.k, "adaptive": spec.adaptive} if spec else None,
            "model_dir": engine.model_dir, "fingerprint": engine.fingerprint, "dtype": str(engine.dtype),
            "quantization": engine.model.quantization, "kv_cache_dtype": engine.kv_format.kind,
            "device": str(engine.device), "torch_threads": torch.get_num_threads(),
            "block_size": engine.block_size, "kv_blocks": engine.block_manager.num_blocks,
            "chunk_size": engine.scheduler.chunk_size if hasattr(engine.scheduler, "chunk_size") else None,
            "costs": engine_costs(engine).to_dict()}


def _random_ids(engine, n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(2, engine.vocab_size, (n,), generator=gen).tolist()


def _check_idle(engine) -> None:
    if engine.requests or engine.has_unfinished():
        raise RuntimeError("engine is busy: profile an idle engine (its steps would mix with live requests)")


class _RandomProposals:
    """Stands in for a sequence's n-gram index while measuring: always `num_tokens` random tokens."""

    def __init__(self, vocab_size: int, gen: torch.Generator):
        self.vocab_size, self.gen = vocab_size, gen

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        return torch.randint(2, self.vocab_size, (max(num_tokens, 0),), generator=self.gen).tolist()


@contextlib.contextmanager
def proposals(engine, num_tokens: int) -> Iterator[None]:
    """Every decoding sequence proposes `num_tokens` tokens per step (0: none) inside, whatever the
    turn-down would pick; the speculator's counters are as before afterwards."""
    spec = engine.speculator
    if spec is None:
        if num_tokens:
            raise ValueError("speculative steps need an engine with speculative decoding (speculative.method)")
        yield
        return
    saved = spec.turn_down, spec.num_proposed, spec.num_accepted, spec.num_steps_off
    spec.turn_down = TurnDown(num_tokens, adaptive=False)
    try:
        yield
    finally:
        spec.turn_down, spec.num_proposed, spec.num_accepted, spec.num_steps_off = saved


def prefill_batch_size(engine, prompt_len: int) -> int:
    """Prompts of `prompt_len` one step takes under saturation (token budget, max_num_seqs)."""
    return max(1, min(engine.scheduler.max_num_batched_tokens // max(prompt_len, 1), engine.scheduler.max_num_seqs))


def measure_prefill(engine, prompt_len: int, batch: int = 1, repeats: int = 1, seed: int = 0) -> dict | None:
    """Prefill `batch` fresh prompts of `prompt_len` tokens through the engine's own steps
    (scheduler → runner → sampler: batched and chunked exactly as served), prefill-only.

    Returns {"prompt_len", "batch", "seconds", "flops", "flops_per_s"} (best of `repeats`,
    seconds for the whole batch), or None when the blocks or the context do not fit.
    """
    _check_idle(engine)
    bs = engine.block_size
    if prompt_len + 1 > engine.max_model_len:
        return None
    if not engine.block_manager.can_allocate(batch * -(-(prompt_len + 1) // bs)):
        return None
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    best = float("inf")
    for _ in range(repeats):
        ids = [engine.add_request(_random_ids(engine, prompt_len, gen), params, prefill_only=True)
               for _ in range(batch)]   # fresh random prompts: no prefix-cache hits
        pending = set(ids)
        settle(engine.device)
        t0 = time.perf_counter()
        try:
            while pending:
                for out in engine.step():
                    pending.discard(out.request_id)
            settle(engine.device)
            best = min(best, time.perf_counter() - t0)
        finally:
            for rid in ids:
                engine.abort(rid)
    flops = batch * engine_costs(engine).prefill_flops(prompt_len)
    return {"prompt_len": prompt_len, "batch": batch, "seconds": best, "flops": flops, "flops_per_s": flops / best}


def measure_decode(engine, batch: int, context: int, repeats: int = 3, seed: int = 0,
                   num_tokens: int = 0) -> dict | None:
    """Time the engine's decode step (scheduler → runner → sampler → output) for `batch`
    running sequences that each hold `context` tokens of KV in their own blocks (adopted,
    as a decode actor adopts shipped KV), each proposing `num_tokens` tokens per step (0: a
    plain step; > 0 needs the engine's speculative decoding).

    Returns {"batch", "context", "seconds", "bytes", "bytes_per_s", "flops"} (best of `repeats`
    steps after the warm-up; + "num_tokens" when > 0, and with speculative decoding
    "num_proposed", the proposals its steps verified), or None when the blocks do not fit.
    """
    _check_idle(engine)
    bs = engine.block_size
    # untimed: the first step (caches, the allocator; the sequences join the batch, so it proposes nothing),
    # and with proposals the first speculative one (a draft catches up on the whole context there)
    warm_up = 2 if num_tokens else 1
    steps = repeats + warm_up
    grows = steps * (num_tokens + 1) + 1         # tokens a sequence may gain over the steps
    if context + grows > engine.max_model_len:
        return None
    if not engine.block_manager.can_allocate(batch * -(-(context + grows) // bs)):
        return None
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=grows + 1, temperature=0.0, ignore_eos=True)
    ids = []
    best = float("inf")
    spec = engine.speculator
    with proposals(engine, num_tokens):
        before = spec.num_proposed if spec is not None else 0
        try:
            for i in range(batch):
                blocks = engine.block_manager.allocate(-(-context // bs))
                rid = f"profile-decode-{i}"
                engine.expect_kv(rid, _random_ids(engine, context, gen), params, rid, float("inf"))
                engine.adopt(rid, [2], blocks)
                ids.append(rid)
                if num_tokens and engine.speculator.draft is None:
                    engine.requests[rid].spec_state = _RandomProposals(engine.vocab_size, gen)
            for i in range(steps):
                settle(engine.device)
                t0 = time.perf_counter()
                engine.step()
                settle(engine.device)
                if i >= warm_up:
                    best = min(best, time.perf_counter() - t0)
        finally:
            for rid in ids:
                engine.abort(rid)
        num_proposed = spec.num_proposed - before if spec is not None else 0
    costs = engine_costs(engine)
    nbytes = costs.decode_bytes(batch, context)
    point = {"batch": batch, "context": context, "seconds": best, "bytes": nbytes, "bytes_per_s": nbytes / best,
             "flops": costs.decode_flops(batch, context)}
    if num_tokens:
        point["num_tokens"] = num_tokens
    if spec is not None:
        point["num_proposed"] = num_proposed
    return point


def heldout_passages(model_dir: str) -> list[list[int]]:
    """The token ids of the model's held-out passages (`HELDOUT_FILE`); FileNotFoundError without the file."""
    with open(os.path.join(model_dir, HELDOUT_FILE), encoding="utf-8") as f:
        return [p["token_ids"] for p in json.load(f)["passages"]]


def heldout_prompts(model_dir: str, num: int = ACCEPTANCE_PROMPTS,
                    length: int = ACCEPTANCE_PROMPT_TOKENS) -> list[list[int]] | None:
    """The first `length` tokens of up to `num` of the model's held-out passages; None without any."""
    if not os.path.isfile(os.path.join(model_dir, HELDOUT_FILE)):
        return None
    return [p[:length] for p in heldout_passages(model_dir)[:num]] or None


def measure_acceptance(engine, prompts: list[list[int]], num_tokens: int,
                       max_tokens: int = ACCEPTANCE_MAX_TOKENS) -> dict:
    """The acceptance rate of the engine's speculative method at `num_tokens` proposals per step: `prompts`
    decoded greedily, batched, to `max_tokens` tokens each. Returns {"ratio", "num_tokens", "proposed",
    "accepted", "prompts", "temperature"}; "ratio" is None when nothing was proposed."""
    _check_idle(engine)
    spec = engine.speculator
    if spec is None:
        raise ValueError("an acceptance rate needs an engine with speculative decoding (speculative.method)")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with proposals(engine, num_tokens):
        before = spec.num_proposed, spec.num_accepted
        ids = [engine.add_request(p, params) for p in prompts]
        try:
            while engine.has_unfinished():
                engine.step()
        finally:
            for rid in ids:
                engine.abort(rid)
        proposed, accepted = spec.num_proposed - before[0], spec.num_accepted - before[1]
    return {"ratio": accepted / proposed if proposed else None, "num_tokens": num_tokens, "proposed": proposed,
            "accepted": accepted, "prompts": len(prompts), "temperature": 0.0}


def run_point(engine, point: dict) -> dict | None:
    """One measurement: {"kind": "prefill", "prompt_len": S, "batch": k | "saturated"},
    {"kind": "decode", "batch": B, "context": C, "num_tokens": k (optional: proposals per sequence)},
    {"kind": "acceptance", "num_tokens": k} (None without held-out text) or {"kind": "describe"};
    optional "repeats"."""
    repeats = point.get("repeats")
    if point["kind"] == "prefill":
        batch = point.get("batch") or 1
        if batch == "saturated":
            batch = prefill_batch_size(engine, point["prompt_len"])
        return measure_prefill(engine, point["prompt_len"], batch, repeats or 1)
    if point["kind"] == "decode":
        return measure_decode(engine, point["batch"], point["context"], repeats or 3,
                              num_tokens=point.get("num_tokens", 0))
    if point["kind"] == "acceptance":
        prompts = heldout_prompts(engine.model_dir)
        return measure_acceptance(engine, prompts, point["num_tokens"]) if prompts else None
    if point["kind"] == "describe":
        return describe(engine)
    raise ValueError(f"kind must be prefill, decode, acceptance or describe; got {point['kind']!r}")
