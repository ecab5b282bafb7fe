"""Engine benchmark: our engine beside Hugging Face and the machine's own limits, in one run.

    python -m bench.engine [--model small] [--dtype float32|bfloat16] [--quick] [--json FILE] [--markdown FILE]
    python -m bench.engine --quantization none,int8,int4 [...]     # weight-only quantization side by side
    python -m bench.engine --kv-cache-dtype auto,fp8,int8 --decode-context 1024   # KV cache dtypes side by side

Three parts, each on the same weights and dtype as HF (see `bench/engine/peers.py`
for the peers and exactly what each limit counts; `engine/cost_model.py` for the counts):

1. prefill: one prompt of 512 and of 2048 tokens through `Engine.generate`
   (max_tokens=1: schedule, model, sample) against HF's forward with cache;
   achieved FLOP/s = prefill FLOPs(S) / time over measured matmul FLOP/s.
2. decode: B sequences of a fixed 256-token context; mean `Engine.step()` time
   against HF's one-token forward through its cache (+ argmax); achieved bytes/s =
   decode bytes(B, C) (weights + KV read per step) / step time over measured memcpy bytes/s.
3. serving workload: requests of varied prompt and output length (fixed seed);
   HF `generate` in static batches of 16 vs our `Engine.generate` with continuous
   batching; useful output tokens/s (each request's own tokens only).

Ours and HF alternate repetition by repetition (A/B, then B/A) and each figure is
the median, so machine noise hits both sides alike. Progress goes to stderr.

`--quantization` runs instead one engine per weight quantization, side by side, without HF
(bench/engine/quantization.py); `--tp 1,2` one engine per tensor-parallel degree on the same cores
(bench/engine/tensor_parallel.py).
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
import dataclasses
from dataclasses import dataclass

import torch

from bench.engine import peers
from bench.engine.ours import OursDecoder, greedy, load_average, ours_prefill, random_prompt
from bench.engine.report import check_targets, render_markdown, render_text
from engine import Engine, EngineArgs
from engine.model.config import ModelConfig
from engine.engine import pick_dtype
from engine.model.linear import INPUT_MAJOR, ONEDNN_PACKED, ROW_MAJOR
from engine.model.presets import resolve_model
from engine.profile import engine_costs

DTYPES = ("float32", "bfloat16")
WEIGHT_LAYOUTS = (ROW_MAJOR, INPUT_MAJOR, ONEDNN_PACKED)


@dataclass(slots=True)
class Plan:
    prefill_lens: tuple[int, ...] = (512, 2048)
    prefill_repeats: int = 5
    decode_batches: tuple[int, ...] = (1, 8, 32)
    decode_context: int = 256
    decode_steps: int = 16
    decode_repeats: int = 5
    num_requests: int = 64
    output_lens: tuple[int, int] = (16, 512)
    prompt_lens: tuple[int, int] = (16, 256)
    hf_batch_size: int = 16
    gemm_size: int = 4096
    memcpy_bytes: int = 512 << 20
    seed: int = 0

    @classmethod
    def quick(cls) -> "Plan":
        return cls(prefill_repeats=3, decode_steps=6, decode_repeats=3, num_requests=32,
                   output_lens=(16, 96), prompt_lens=(16, 128), gemm_size=2048, memcpy_bytes=128 << 20)


class Progress:
    def __init__(self, stream=sys.stderr):
        self.start, self.stream = time.perf_counter(), stream

    def __call__(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.start:6.1f}s] {msg}", file=self.stream, flush=True)


# ---- the three parts ---------------------------------------------------------
def bench_prefill(plan: Plan, engine: Engine, hf, cfg: ModelConfig, rng, log) -> dict:
    results = {}
    for nominal in plan.prefill_lens:
        seq_len = min(nominal, engine.max_model_len - 1)         # the tiny preset's context is 2048
        ours_prefill(engine, random_prompt(rng, seq_len, cfg.vocab_size))       # warm-up both
        peers.hf_prefill(hf, random_prompt(rng, seq_len, cfg.vocab_size))
        ours, theirs = [], []
        for rep in range(plan.prefill_repeats):
            prompt = random_prompt(rng, seq_len, cfg.vocab_size)
            pair = [lambda: ours.append(ours_prefill(engine, prompt)),
                    lambda: theirs.append(peers.hf_prefill(hf, prompt))]
            for run in (pair if rep % 2 == 0 else pair[::-1]):
                run()
            log(f"prefill {seq_len}: rep {rep + 1}/{plan.prefill_repeats} ours {ours[-1]:.3f}s HF {theirs[-1]:.3f}s")
        t_ours, t_hf = statistics.median(ours), statistics.median(theirs)
        flops = engine_costs(engine).prefill_flops(seq_len)
        results[str(nominal)] = {
            "tokens": seq_len, "ours_s": t_ours, "hf_s": t_hf, "ratio": t_ours / t_hf,
            "ours_tokens_per_s": seq_len / t_ours, "hf_tokens_per_s": seq_len / t_hf,
            "flops": flops, "ours_flop_per_s": flops / t_ours, "hf_flop_per_s": flops / t_hf,
            "ours_s_all": ours, "hf_s_all": theirs}
    return results


def bench_decode(plan: Plan, engine: Engine, hf, cfg: ModelConfig, rng, log) -> dict:
    """Each side prefills the batch once; then blocks of steps alternate ours/HF (A/B, B/A, ...)."""
    results = {}
    for batch in plan.decode_batches:
        prompts = [random_prompt(rng, plan.decode_context, cfg.vocab_size) for _ in range(batch)]
        total_steps = (plan.decode_repeats + 1) * plan.decode_steps
        ours_side = OursDecoder(engine, prompts, total_steps + 4)
        hf_side = peers.HFDecoder(hf, prompts)
        ours_side.steps(2)                                      # warm-up
        hf_side.steps(2)
        ours, theirs = [], []
        for rep in range(plan.decode_repeats):
            pair = [lambda: ours.append(ours_side.steps(plan.decode_steps)),
                    lambda: theirs.append(hf_side.steps(plan.decode_steps))]
            for run in (pair if rep % 2 == 0 else pair[::-1]):
                run()
            log(f"decode batch {batch}: rep {rep + 1}/{plan.decode_repeats} "
                f"ours {ours[-1] * 1e3:.1f}ms HF {theirs[-1] * 1e3:.1f}ms per step")
        ours_side.close()
        hf_side = None                                          # free HF's cache before the next batch
        t_ours, t_hf = statistics.median(ours), statistics.median(theirs)
        # context: prompt + first token + warm-up, then the timed steps (mean over them)
        context = plan.decode_context + 3 + plan.decode_steps * plan.decode_repeats / 2
        step_bytes = engine_costs(engine).decode_bytes(batch, context)
        results[str(batch)] = {
            "ours_s": t_ours, "hf_s": t_hf, "ratio": t_ours / t_hf, "context": context,
            "step_bytes": step_bytes, "ours_bytes_per_s": step_bytes / t_ours, "hf_bytes_per_s": step_bytes / t_hf,
            "ours_tokens_per_s": batch / t_ours, "hf_tokens_per_s": batch / t_hf,
            "ours_s_all": ours, "hf_s_all": theirs}
    return results


def bench_workload(plan: Plan, model: str, dtype: str, hf, cfg: ModelConfig, rng, log, attention: str = "auto",
                   weight_layout: str = "auto") -> dict:
    prompts = [random_prompt(rng, rng.randint(*plan.prompt_lens), cfg.vocab_size) for _ in range(plan.num_requests)]
    lens = [rng.randint(*plan.output_lens) for _ in range(plan.num_requests)]
    useful = sum(lens)
    max_len = max(map(len, prompts)) + max(lens)
    engine = Engine(EngineArgs(model, dtype=dtype, num_blocks=plan.num_requests * (-(-max_len // 16) + 1),
                               max_num_batched_tokens=2048, chunk_size=512, max_num_seqs=64, attention=attention,
                               weight_layout=weight_layout))
    engine.generate([prompts[0][:16]], greedy(4))                              # warm-up
    log(f"workload: {plan.num_requests} requests, {useful} useful output tokens; ours (continuous batching)")
    start = time.perf_counter()
    completions = engine.generate(prompts, [greedy(n) for n in lens])
    t_ours = time.perf_counter() - start
    log(f"workload: ours {t_ours:.1f}s; HF static batches of {plan.hf_batch_size}")
    t_hf, hf_outputs = peers.hf_static_batches(hf, prompts, lens, plan.hf_batch_size, progress=log)
    steps = sum(max(lens[b:b + plan.hf_batch_size]) for b in range(0, len(lens), plan.hf_batch_size))
    same = sum(c.token_ids == h for c, h in zip(completions, hf_outputs))
    del engine
    gc.collect()
    return {"num_requests": plan.num_requests, "useful_tokens": useful,
            "hf_generated_tokens": steps * plan.hf_batch_size,
            "ours_s": t_ours, "hf_s": t_hf, "ours_tokens_per_s": useful / t_ours, "hf_tokens_per_s": useful / t_hf,
            "speedup": t_hf / t_ours, "identical_outputs": same,
            "output_lens": list(plan.output_lens), "prompt_lens": list(plan.prompt_lens)}


# ---- driver ----------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small", help="preset name or HF model directory (default: small)")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--quick", action="store_true", help="fewer repeats, a smaller workload (under 2 minutes)")
    p.add_argument("--json", help="write every figure to this JSON file")
    p.add_argument("--markdown", help="write the tables as Markdown to this file")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    p.add_argument("--attention", default="auto", choices=["auto", "compiled", "eager", "flex"],
                   help="our engine's decode attention (default: the engine's own choice)")
    p.add_argument("--weight-layout", default="auto", choices=["auto", *WEIGHT_LAYOUTS],
                   help="our engine's projection weight layout (default: the one measured fastest here)")
    p.add_argument("--quantization", default="",
                   help="compare weight quantizations instead of HF, e.g. none,int8,int4 "
                   "(bench/engine/quantization.py)")
    p.add_argument("--group-size", type=int, default=128, help="int4 group size with --quantization (32, 64, 128)")
    p.add_argument("--kv-cache-dtype", default="",
                   help="compare KV cache dtypes instead of HF, e.g. auto,fp8,int8 (with --quantization's engines)")
    p.add_argument("--decode-context", type=int, help="tokens of context per decode sequence (default 256)")
    p.add_argument("--tp", default="",
                   help="compare tensor-parallel degrees instead of HF, e.g. 1,2: degree d runs d gloo ranks of "
                   "threads/d torch threads each (bench/engine/tensor_parallel.py)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    plan = Plan.quick() if args.quick else Plan()
    if args.decode_context:
        plan = dataclasses.replace(plan, decode_context=args.decode_context)
    log = Progress()
    if args.tp:
        from bench.engine import tensor_parallel
        result = tensor_parallel.run(args, plan, log)
        print(tensor_parallel.render_text(result))
        _write(args, result, tensor_parallel.render_markdown(result))
        return 0
    if args.quantization or args.kv_cache_dtype:
        from bench.engine import quantization
        result = quantization.run(args, plan, log)
        print(quantization.render_text(result))
        _write(args, result, quantization.render_markdown(result))
        return 0
    dtype = pick_dtype(args.dtype, torch.device("cpu"))
    model_dir = resolve_model(args.model)
    cfg = ModelConfig.from_dir(model_dir)
    rng = random.Random(plan.seed)
    load_start = load_average()
    log(f"model {args.model} ({model_dir}), {args.dtype}, {torch.get_num_threads()} torch threads, "
        f"attention {args.attention}, load average {load_start:.2f}")

    log(f"machine limits: {plan.gemm_size}² GEMM, {plan.memcpy_bytes >> 20} MiB copy")
    machine = {"matmul": peers.matmul_flops(dtype, plan.gemm_size, 5),
               "memcpy": peers.memcpy_bandwidth(plan.memcpy_bytes, 5)}
    log(f"matmul {machine['matmul']['flop_per_s'] / 1e9:.0f} GFLOP/s, "
        f"memcpy {machine['memcpy']['bytes_per_s'] / 1e9:.1f} GB/s; loading HF and our engine")
    hf = peers.load_hf(model_dir, dtype)
    blocks_per_seq = -(-(plan.decode_context + (plan.decode_repeats + 1) * plan.decode_steps + 24) // 16)
    engine = Engine(EngineArgs(args.model, dtype=args.dtype, num_blocks=max(plan.decode_batches) * blocks_per_seq
                               + max(plan.prefill_lens) // 16 + 8, max_num_batched_tokens=max(4096, *plan.prefill_lens),
                               chunk_size=None, max_num_seqs=max(64, *plan.decode_batches), attention=args.attention,
                               weight_layout=args.weight_layout))
    engine_attention, weight_layout = engine.attention, engine.model.weight_layout
    log(f"our engine: attention {engine_attention}, weights {weight_layout}")
    prefill = bench_prefill(plan, engine, hf, cfg, rng, log)
    decode = bench_decode(plan, engine, hf, cfg, rng, log)
    del engine
    gc.collect()
    workload = bench_workload(plan, args.model, args.dtype, hf, cfg, rng, log, args.attention, weight_layout)

    result = {"model": args.model, "dtype": args.dtype, "quick": args.quick, "torch_threads": torch.get_num_threads(),
              "attention": engine_attention, "weight_layout": weight_layout,
              "torch_version": torch.__version__, "load_average_start": load_start, "load_average_end": load_average(),
              "machine": machine, "prefill": prefill, "decode": decode, "workload": workload}
    result["targets"] = check_targets(result)
    print(render_text(result))
    _write(args, result, render_markdown(result))
    return 0


def _write(args: argparse.Namespace, result: dict, markdown: str) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown)

