"""What `bench.engine` measures ours against: the machine's own limits and Hugging Face.

Machine limits (same process, same dtype, same thread count as the engine):

- matmul FLOP/s: `torch.mm` on an N×N square GEMM, 2·N³ FLOPs per call; the best
  of a few calls (a limit is the best the machine can do).
- memcpy bytes/s: `dst.copy_(src)` on a large tensor, counting the bytes read
  plus the bytes written (2 × size per copy: the STREAM "copy" convention), so
  it compares with the bytes a decode step must read.

The Hugging Face side runs `AutoModelForCausalLM` on the same directory and
dtype: a prefill is one forward with its KV cache built (`logits_to_keep=1`,
like our prefill, which computes only the last row's logits); a decode step is
one forward of one token per sequence through its `DynamicCache` plus an argmax;
the serving workload is `generate` in static, left-padded batches.
"""
from __future__ import annotations

import statistics
import time

import torch


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ---- machine limits --------------------------------------------------------
def matmul_flops(dtype: torch.dtype, size: int, repeats: int) -> dict:
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    c = torch.empty(size, size, dtype=dtype)
    torch.mm(a, b, out=c)                        # warm-up (oneDNN/MKL picks its kernel)
    times = [timed(lambda: torch.mm(a, b, out=c)) for _ in range(repeats)]
    flops = 2.0 * size ** 3
    return {"size": size, "flop_per_s": flops / min(times), "flop_per_s_median": flops / statistics.median(times)}


def memcpy_bandwidth(num_bytes: int, repeats: int) -> dict:
    """A large tensor copy: `bytes_per_s` counts the bytes copied (memcpy's usual figure, as
    `mbw` reports it); `traffic_bytes_per_s` counts what the memory moved (read + write, 2x)."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)                               # warm-up: pages faulted in
    times = [timed(lambda: dst.copy_(src)) for _ in range(repeats)]
    copied = float(src.numel() * src.element_size())
    return {"bytes": int(copied), "bytes_per_s": copied / min(times),
            "bytes_per_s_median": copied / statistics.median(times),
            "traffic_bytes_per_s": 2.0 * copied / min(times)}


# ---- Hugging Face ----------------------------------------------------------
def load_hf(model_dir: str, dtype: torch.dtype):
    import transformers
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.eval()


def _cache_of(out):
    return out.cache if hasattr(out, "cache") else out.past_key_values


def _forward(model, input_ids, cache=None, **kw):
    try:
        return model(input_ids=input_ids, cache=cache, use_cache=True, **kw)
    except TypeError:                                       # transformers < 5
        return model(input_ids=input_ids, past_key_values=cache, use_cache=True, **kw)


@torch.inference_mode()
def hf_prefill(model, prompt: list[int]) -> float:
    ids = torch.tensor([prompt], dtype=torch.long)
    return timed(lambda: _forward(model, ids, logits_to_keep=1))


class HFDecoder:
    """A batch of equal-length prompts (no padding) prefilled once; `steps(n)` times n one-token forwards."""

    @torch.inference_mode()
    def __init__(self, model, prompts: list[list[int]]):
        self.model = model
        out = _forward(model, torch.tensor(prompts, dtype=torch.long), logits_to_keep=1)
        self.cache, self.next = _cache_of(out), out.logits[:, -1].argmax(-1, keepdim=True)

    @torch.inference_mode()
    def steps(self, num_steps: int) -> float:
        start = time.perf_counter()
        for _ in range(num_steps):
            out = _forward(self.model, self.next, self.cache)
            self.cache, self.next = _cache_of(out), out.logits[:, -1].argmax(-1, keepdim=True)
        return (time.perf_counter() - start) / num_steps


@torch.inference_mode()
def hf_static_batches(model, prompts: list[list[int]], output_lens: list[int], batch_size: int,
                      pad_id: int = 0, progress=None) -> tuple[float, list[list[int]]]:
    """HF `generate`, greedy, in static left-padded batches; each batch runs to its longest output.

    Returns (seconds, each request's first `output_lens[i]` generated tokens).
    """
    from transformers import GenerationConfig
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        batch, lens = prompts[b:b + batch_size], output_lens[b:b + batch_size]
        width, max_new = max(map(len, batch)), max(lens)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        config = GenerationConfig(max_new_tokens=max_new, do_sample=False,
                                  eos_token_id=None, pad_token_id=pad_id)
        gen = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        assert gen.shape[1] == width + max_new, "HF stopped early"
        outputs.extend(gen[i, width:width + n].tolist() for i, n in enumerate(lens))
        if progress:
            progress(f"HF batch {b // batch_size + 1}/{-(-len(prompts) // batch_size)} "
                     f"({max_new} steps) done at {time.perf_counter() - start:.1f}s")
    return time.perf_counter() - start, outputs
