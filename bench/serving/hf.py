"""Peer baseline: Hugging Face transformers `generate` with static batching, on the same weights.

Requests are taken in workload order in batches of ``batch_size``, left-padded; each batch
decodes greedily until its longest output is done (static batching: finished rows keep
burning steps). Throughput counts only each request's own output tokens, like the served
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

    from engine.engine import pick_dtype
    from engine.presets import resolve_model
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
            _run(model, prompts[:batch_size], [2] * min(batch_size, len(prompts)), batch_size)
            start = time.monotonic()
            _run(model, prompts[:batch_size], [4] * min(batch_size, len(prompts)), batch_size)
            warmup[threads] = time.monotonic() - start
        threads = min(warmup, key=warmup.get)
        torch.set_num_threads(threads)
        start = time.monotonic()
        _run(model, prompts, outputs, batch_size)
        duration = time.monotonic() - start
        print(f"hf-static: {threads} thread(s) {duration:.1f}s", file=sys.stderr, flush=True)
    finally:
        torch.set_num_threads(saved)
    timings = {threads: duration}
    return {"variant": "hf-static", "completed": len(prompts), "failed": 0, "duration_s": duration,
            "batch_size": batch_size, "torch_threads": threads, "seconds_by_threads": timings,
            "warmup_seconds_by_threads": warmup,
            "request_throughput_rps": len(prompts) / duration, "throughput_tokens_s": sum(outputs) / duration}


def _run(model, prompts: list[list[int]], outputs: list[int], batch_size: int) -> None:
    import torch
    from transformers import GenerationConfig
    with torch.inference_mode():
        for b in range(0, len(prompts), batch_size):
            batch, lens = prompts[b:b + batch_size], outputs[b:b + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)       # left-padded
            mask = torch.zeros_like(ids)
            for row, p in enumerate(batch):
                ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            steps = max(lens)
            config = GenerationConfig(max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)
            model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
