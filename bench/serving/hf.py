"""Peer baseline: Hugging Face transformers `generate` with static batching, on the same weights.

Requests are taken in workload order in batches of ``batch_size``, left-padded; each batch
decodes greedily until its longest output is done (static batching: finished rows keep
burning steps), by the engine benchmark's HF peer (`bench.engine.peers.hf_static_batches`).
Throughput counts only each request's own output tokens, like the served
runs, so the figures are comparable. It times one short batch with 1 torch thread and with the
served actors' total, then runs the workload with the faster (on a loaded machine extra
threads can lose badly to oversubscription).
"""
from __future__ import annotations

import sys
import time


def hf_static_batching(cfg, specs: list, batch_size: int = 8) -> dict:
    """Offline throughput of HF generate over ``specs`` (token-id prompts), at the faster thread count."""
    import torch
    from transformers import AutoModelForCausalLM

    from bench.engine.peers import hf_static_batches
    from engine.engine import pick_dtype
    from engine.model.presets import resolve_model
    model_dir = resolve_model(cfg.model.name)
    total = sum(p.resources.threads() * p.bounds()[0] for _, p in cfg.pools.items())
    dtype = pick_dtype(cfg.model.dtype, torch.device("cpu"))          # HF runs on the CPU: auto = float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    prompts = [s.prompt_token_ids for s in specs if s.prompt_token_ids is not None]
    outputs = [s.output_len for s in specs if s.prompt_token_ids is not None]
    saved = torch.get_num_threads()
    warmup = {}
    try:
        for threads in sorted({1, max(1, total)}):      # time one short batch per thread count
            torch.set_num_threads(threads)
            hf_static_batches(model, prompts[:batch_size], [2] * min(batch_size, len(prompts)), batch_size)
            start = time.monotonic()
            hf_static_batches(model, prompts[:batch_size], [4] * min(batch_size, len(prompts)), batch_size)
            warmup[threads] = time.monotonic() - start
        threads = min(warmup, key=warmup.get)
        torch.set_num_threads(threads)
        start = time.monotonic()
        hf_static_batches(model, prompts, outputs, batch_size)
        duration = time.monotonic() - start
        print(f"hf-static: {threads} thread(s) {duration:.1f}s", file=sys.stderr, flush=True)
    finally:
        torch.set_num_threads(saved)
    timings = {threads: duration}
    return {"variant": "hf-static", "completed": len(prompts), "failed": 0, "duration_s": duration,
            "batch_size": batch_size, "torch_threads": threads, "seconds_by_threads": timings,
            "warmup_seconds_by_threads": warmup,
            "request_throughput_rps": len(prompts) / duration, "throughput_tokens_s": sum(outputs) / duration}

