"""`make gpu-check` (``python -m bench.gpu_check``): one prepared run on one CUDA GPU, one summary table.

Run it on a machine with a GPU, and copy the table into docs/benchmarks/. It checks, each figure beside
its peer:

- engine vs HF transformers on the GPU in bfloat16: logits at every prompt position within the
  bf16 tolerance, and greedy tokens equal wherever HF's own top-2 logit gap is clear (a random-weight
  model has many near-ties, where bf16 rounding may pick either token: those steps are not compared);
- a 1P+1D cluster on this one GPU (half a GPU per actor, KV budget from the device) over grpc with
  codec none (tokens equal to a colocated cluster's, exactly) and fp8 (agreement reported);
  float32, so the comparison tests the KV path, not bf16's batch-shape rounding;
- KV transfer GPU→GPU through the grpc transport vs a device-to-device copy of the same bytes, and through
  the nixl transport (one-sided READ between the registered device caches; skipped without the library);
- the engine's decode step bytes/s vs the device's memory bandwidth, and its prefill FLOP/s vs the
  device's bf16 matmul peak (both measured here; the datasheet figure too for GPUs it knows);
- the flex paged attention kernel and the decode CUDA graphs vs the eager path: tokens equal and
  logprobs in float32, then decode step and prefill times side by side;
- int8 / int4 weight-only projections: each path (tinygemm int4, the dequantize + GEMM path) against
  its dequantized weight in float32, then the ~1B model's decode step at batch 1 and 64 beside bf16;
- the fp8 / int8 KV cache: decode attention over it against its dequantized copy in float32, then the
  ~1B model's decode step at DECODE_POINT and its block count beside the bf16 cache;
- the KV host tier (kv_cache.tiers): blocks evicted from the device cache offloaded to pinned host memory and
  onboarded back bit for bit, tokens equal to the first run; onboarding bytes/s beside a pinned host→device copy;
- tensor parallelism: 2 ranks against 1 in float32 (greedy tokens equal, logits within 1e-3); on two GPUs
  over NCCL, on one GPU both ranks share it over gloo;
- the CUDA tests (tests/gpu) through pytest.

Without CUDA it prints ``gpu-check skipped: no CUDA device`` and exits 0. ``--json PATH`` also
writes every figure as JSON. Each check runs under what is left of ``--budget-s`` (default 480 s)
and a failing check is a row, not the end of the run; the exit status is 1 when any check failed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1 << 30
MIB = 1 << 20
SKIP_LINE = "gpu-check skipped: no CUDA device"
LOGIT_RTOL = 0.03            # bf16: max |engine − HF| over max |HF logit|
DEVICE = "cuda"              # the checks' device; tests/bench runs them on "cpu" at toy sizes
GAP_MARGIN = 0.25            # a greedy step is compared when HF's top-2 gap is above this (logits)

# bf16 dense tensor-core FLOP/s and memory bytes/s from the vendors' datasheets (SXM parts).
DATASHEET = {
    "H200": (989e12, 4.8e12),
    "H100 80GB HBM3": (989e12, 3.35e12),
    "A100-SXM4-80GB": (312e12, 2.039e12),
    "A100-SXM4-40GB": (312e12, 1.555e12),
    "L40S": (362e12, 0.864e12),
}

DECODE_POINT = (64, 1024)    # (batch, context) of the decode figure
PREFILL_POINT = (4, 2048)    # (prompts, tokens each) of the prefill figure
TRANSFER_MIB = 256           # KV bytes per transfer

# A Llama-style model of about 1B parameters (random weights) for the speed figures: big enough that
# decode reads weights rather than waiting on kernel launches.
PERF_ARCH = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False)


@dataclass
class Row:
    check: str
    status: str                  # ok | FAIL | info | skipped | error
    figure: str
    peer: str = ""
    data: dict = field(default_factory=dict)


# ------------------------------------------------------------------ pure helpers (unit-tested on CPU)

def clear_prefix(gaps: list[float], margin: float = GAP_MARGIN) -> int:
    """How many leading greedy steps have a top-2 gap above `margin` (compared token for token)."""
    for i, gap in enumerate(gaps):
        if not gap > margin:
            return i
    return len(gaps)


def greedy_agreement(ours: list[list[int]], theirs: list[list[int]], gaps: list[list[float]],
                     margin: float = GAP_MARGIN) -> dict:
    """Compare two greedy runs on each sequence's clear prefix (see clear_prefix)."""
    compared = mismatched = 0
    first_mismatch = None
    for i, (a, b, g) in enumerate(zip(ours, theirs, gaps)):
        n = clear_prefix(g, margin)
        compared += n
        bad = next((k for k in range(n) if a[k] != b[k]), None)
        if bad is not None:
            mismatched += 1
            first_mismatch = first_mismatch or {"prompt": i, "step": bad, "ours": a[bad], "hf": b[bad]}
    return {"prompts": len(ours), "clear_tokens": compared, "total_tokens": sum(map(len, theirs)),
            "mismatched_prompts": mismatched, "first_mismatch": first_mismatch}


def prefix_agreement(got: list[list[int]], expected: list[list[int]]) -> float:
    """Share of expected tokens before each sequence's first difference."""
    agree = sum(next((k for k, (a, b) in enumerate(zip(g, e)) if a != b), min(len(g), len(e)))
                for g, e in zip(got, expected))
    return agree / max(sum(map(len, expected)), 1)


def datasheet(device_name: str) -> tuple[float, float] | None:
    """(bf16 FLOP/s, bytes/s) for a GPU this file knows by its torch device name, else None."""
    for key, figures in DATASHEET.items():
        if key in device_name:
            return figures
    return None


def format_table(rows: list[Row]) -> str:
    head = ("check", "status", "figure", "peer")
    cells = [head] + [(r.check, r.status, r.figure, r.peer) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(4)).rstrip() for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


# ------------------------------------------------------------------ the checks (CUDA)

def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _release() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def _device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE


def _best_time(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        best = min(best, time.perf_counter() - t0)
    return best


def copy_seconds(src: torch.Tensor) -> float:
    """Best time of a device-to-device copy of `src` (cudaMemcpy through torch)."""
    dst = torch.empty_like(src)
    return _best_time(lambda: dst.copy_(src))


def device_peaks() -> dict:
    """Measured on this GPU: device-to-device copy bytes/s (read + write) and a bf16 GEMM's FLOP/s."""
    copy_s = copy_seconds(torch.empty(1 * GIB, dtype=torch.uint8, device=DEVICE))
    n = 8192
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    mm_s = _best_time(lambda: a @ b, reps=10)
    return {"copy_bytes_per_s": 2 * GIB / copy_s, "memcpy_gb_per_s": gbps(GIB, copy_s),
            "matmul_flops_per_s": 2 * n ** 3 / mm_s}


def check_engine_vs_hf(model_dir: str, prompts: int, new_tokens: int) -> list[Row]:
    import transformers

    from engine import Engine, EngineArgs, SamplingParams
    engine = Engine(EngineArgs(model_dir, dtype="bfloat16", device=DEVICE, num_blocks=1024, block_size=16))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(DEVICE).eval()
    g = torch.Generator().manual_seed(5)
    batch = [torch.randint(2, engine.vocab_size, (int(n),), generator=g).tolist()
             for n in torch.randint(8, 400, (prompts,), generator=g)]
    worst = 0.0
    for ids in batch[:8]:                                  # logits at every position
        blocks = engine.block_manager.allocate(-(-len(ids) // 16))
        ours = engine.runner.score(ids, blocks).float()
        engine.block_manager.free(blocks)
        with torch.no_grad():
            theirs = hf(torch.tensor([ids], device=DEVICE)).logits[0].float()
        worst = max(worst, float((ours - theirs).abs().max() / theirs.abs().max()))
    hf_tokens, hf_gaps = [], []
    for ids in batch:                                      # HF greedy, with its top-2 gap at each step
        seq, gaps = list(ids), []
        with torch.no_grad():
            for _ in range(new_tokens):
                logits = hf(torch.tensor([seq], device=DEVICE)).logits[0, -1].float()
                top = torch.topk(logits, 2)
                gaps.append(float(top.values[0] - top.values[1]))
                seq.append(int(top.indices[0]))
        hf_tokens.append(seq[len(ids):])
        hf_gaps.append(gaps)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ours = [c.token_ids for c in engine.generate(batch, params)]
    agreement = greedy_agreement(ours, hf_tokens, hf_gaps)
    del engine, hf
    _release()
    logits_ok = worst <= LOGIT_RTOL
    greedy_ok = agreement["mismatched_prompts"] == 0 and agreement["clear_tokens"] > 0
    return [
        Row("engine vs HF logits (bf16)", "ok" if logits_ok else "FAIL", f"max |diff| / max |logit| = {worst:.4f}",
            f"tolerance {LOGIT_RTOL}", {"max_rel_diff": worst}),
        Row("engine vs HF greedy (bf16)", "ok" if greedy_ok else "FAIL",
            f"{agreement['clear_tokens']} clear tokens, {agreement['mismatched_prompts']} prompts differ",
            f"of {agreement['total_tokens']} tokens; gap > {GAP_MARGIN}", agreement),
    ]


def _cluster_tokens(model_dir: str, mode: str, codec: str, prompts, params) -> tuple[list[list[int]], dict]:
    import grpc

    from deploy.config import load_config
    from deploy.running import start_cluster
    from proto.pdserve.v1 import generation_pb2 as pb
    from proto.pdserve.v1 import generation_pb2_grpc as pb_grpc
    cfg = load_config(None, {
        "model.name": model_dir, "model.dtype": "float32",
        "pools.prefill.count": 1, "pools.decode.count": 1,
        "pools.prefill.resources.num_gpus": 0.5, "pools.decode.resources.num_gpus": 0.5,
        "kv_cache.memory_fraction": 0.3, "kv_transfer.transport": "grpc", "kv_transfer.compression": codec})

    async def main():
        cluster = await start_cluster(cfg, port=0, mode=mode)
        try:
            await cluster.server.wait_ready(120)
            async with grpc.aio.insecure_channel(cluster.address) as channel:
                stub = pb_grpc.GenerationServiceStub(channel)

                async def one(i, p, prm):
                    sampling = pb.SamplingParams(max_tokens=prm.max_tokens, temperature=0.0, ignore_eos=True)
                    req = pb.GenerateRequest(request_id=f"r{i}", token_ids=pb.TokenIds(ids=p), sampling=sampling)
                    return [t async for m in stub.Generate(req) for t in m.token_ids]
                tokens = await asyncio.gather(*(one(i, p, prm) for i, (p, prm) in enumerate(zip(prompts, params))))
                stats = await stub.GetStats(pb.GetStatsRequest())
            return tokens, {"kv_blocks_total": [a.kv_blocks_total for a in stats.actors]}
        finally:
            await cluster.stop()
    return asyncio.run(main())


def check_cluster(model_dir: str, n: int) -> list[Row]:
    from deploy.launcher import init_ray
    from engine import SamplingParams
    init_ray(num_cpus=8)
    g = torch.Generator().manual_seed(11)
    lengths = torch.randint(1, 500, (n,), generator=g).tolist()
    prompts = [torch.randint(2, 1000, (k,), generator=g).tolist() for k in lengths]
    params = [SamplingParams(max_tokens=4 + (i * 5) % 24, temperature=0.0, ignore_eos=True) for i in range(n)]
    reference, ref_info = _cluster_tokens(model_dir, "colocated", "none", prompts, params)
    rows = []
    for codec in ("none", "fp8"):
        got, info = _cluster_tokens(model_dir, "disaggregated", codec, prompts, params)
        agree = prefix_agreement(got, reference)
        if codec == "none":
            status = "ok" if got == reference else "FAIL"
        else:
            status = "info" if [len(t) for t in got] == [len(t) for t in reference] else "FAIL"
        rows.append(Row(f"1P+1D grpc {codec} vs colocated (fp32)", status, f"{agree:.3f} of tokens agree",
                        f"{n} requests; KV blocks per actor {info['kv_blocks_total']}",
                        {"agreement": agree, "exact": got == reference, **info, "colocated": ref_info}))
    return rows


def _transfer_setup(payload_mib: int):
    """A bf16 cache of about `payload_mib` on the device, the blocks to send (block 0 left out), their bytes
    and the device's copy rate over the whole cache."""
    from kv_transfer import KVLayout
    layout = KVLayout(num_layers=16, num_kv_heads=8, block_size=16, head_dim=128, dtype=torch.bfloat16,
                      model_fingerprint="gpu-check")
    blocks = max(1, payload_mib * MIB // layout.block_nbytes)
    src = torch.randn(layout.cache_shape(blocks + 1), device=DEVICE).to(torch.bfloat16)
    copy_rate = gbps(src.numel() * src.element_size(), copy_seconds(src))   # the whole cache, contiguous
    return layout, src, list(range(1, blocks + 1)), blocks * layout.block_nbytes, copy_rate


def _timed_sends(transport: str, layout, src: torch.Tensor, ids: list[int], codec: str,
                 receiver_kw: dict, sender_args: tuple = (), sender_kw: dict | None = None):
    """Four sends of `ids` from `src` into a fresh cache over `transport` (the first warms up): the fastest
    of the other three in seconds, and that cache (the last send's blocks 0..n-1)."""
    from kv_transfer import KVPiece, SimpleBlockPool, TransferStatus, make_receiver, make_sender
    pool = SimpleBlockPool(len(ids) + 1)
    dst = torch.zeros_like(src)
    receiver = make_receiver(transport, layout, dst, pool, lambda r: pool.free(r.dst_block_ids)
                             if r.status == TransferStatus.DONE else None, codec=codec, token="gpu-check",
                             **receiver_kw)
    sender = make_sender(transport, layout, *sender_args, codec=codec, token="gpu-check", **(sender_kw or {}))
    try:
        times = []
        for rep in range(4):
            handle = sender.send(KVPiece(f"r{rep}", src, ids, deadline_s=120), receiver.endpoint)
            if handle.wait(120) != TransferStatus.DONE:
                raise RuntimeError(f"transfer failed: {handle}")
            times.append(handle.elapsed_s)
    finally:
        sender.close()
        receiver.close()
    return min(times[1:]), dst


def check_transfer(payload_mib: int) -> list[Row]:
    layout, src, ids, nbytes, copy_rate = _transfer_setup(payload_mib)
    rows = []
    for codec in ("none", "fp8", "int8"):
        seconds, _ = _timed_sends("grpc", layout, src, ids, codec, {})
        rate = gbps(nbytes, seconds)
        rows.append(Row(f"KV transfer GPU→GPU grpc {codec}", "info", f"{rate:.2f} GB/s ({nbytes / MIB:.0f} MiB)",
                        f"device copy {copy_rate:.1f} GB/s",
                        {"gb_per_s": rate, "copy_gb_per_s": copy_rate, "bytes": nbytes}))
    return rows


def check_nixl_transfer(payload_mib: int, ucx_tls: str = "tcp,cuda_copy,cuda_ipc") -> list[Row]:
    """nixl device to device: both caches registered as device memory, the decode side READs (codec none:
    cache cells straight into cache cells; fp8: device staging slots). One row per codec, or one skipped."""
    from kv_transfer.transports.nixl.agent import available
    reason = available()
    if reason is not None:
        return [Row("KV transfer GPU→GPU nixl", "skipped", reason[:200])]
    layout, src, ids, nbytes, copy_rate = _transfer_setup(payload_mib)
    rows = []
    for codec in ("none", "fp8"):
        seconds, dst = _timed_sends("nixl", layout, src, ids, codec, {"ucx_tls": ucx_tls}, (src.device,),
                                    {"kv_cache": src, "ucx_tls": ucx_tls})
        exact = codec != "none" or torch.equal(dst[:, :len(ids)], src[:, 1:])
        rate = gbps(nbytes, seconds)
        rows.append(Row(f"KV transfer GPU→GPU nixl {codec}", "info" if exact else "FAIL",
                        f"{rate:.2f} GB/s ({nbytes / MIB:.0f} MiB)",
                        f"device copy {copy_rate:.1f} GB/s, UCX_TLS {ucx_tls}",
                        {"gb_per_s": rate, "copy_gb_per_s": copy_rate, "bytes": nbytes, "exact": exact}))
    return rows


def check_speed(model_dir: str, peaks: dict) -> list[Row]:
    from engine import Engine, EngineArgs
    from engine.profile import measure_decode, measure_prefill
    (batch, context), (prompts, prompt_len) = DECODE_POINT, PREFILL_POINT
    engine = Engine(EngineArgs(model_dir, dtype="bfloat16", device=DEVICE, kv_memory_fraction=0.5, block_size=16,
                               max_num_batched_tokens=prompts * prompt_len, max_num_seqs=max(batch, prompts),
                               attention="eager"))
    sheet = datasheet(_device_name())
    rows = [Row("KV budget from the device", "info", f"{engine.block_manager.num_blocks} blocks",
                "memory_fraction 0.5", asdict(engine.kv_budget) if engine.kv_budget else {})]
    decode = measure_decode(engine, batch=batch, context=context, repeats=5)
    if decode is None:
        raise RuntimeError(f"decode point {DECODE_POINT} does not fit the KV cache "
                           f"({engine.block_manager.num_blocks} blocks)")
    bandwidth = peaks["copy_bytes_per_s"]
    peer = f"device copy {bandwidth / 1e9:.0f} GB/s" + (f", datasheet {sheet[1] / 1e9:.0f} GB/s" if sheet else "")
    rows.append(Row(f"decode step bytes/s ({batch} × {context} ctx)", "info",
                    f"{decode['bytes_per_s'] / 1e9:.0f} GB/s ({decode['bytes_per_s'] / bandwidth:.0%} of copy)",
                    peer, decode))
    prefill = measure_prefill(engine, prompt_len, batch=prompts, repeats=2)
    if prefill is None:
        raise RuntimeError(f"prefill point {PREFILL_POINT} does not fit the KV cache or the context")
    flops = peaks["matmul_flops_per_s"]
    peer = f"bf16 GEMM {flops / 1e12:.0f} TFLOP/s" + (f", datasheet {sheet[0] / 1e12:.0f}" if sheet else "")
    rate = prefill["flops_per_s"]
    rows.append(Row(f"prefill FLOP/s ({prompts} × {prompt_len})", "info",
                    f"{rate / 1e12:.1f} TFLOP/s ({rate / flops:.0%} of GEMM)", peer, prefill))
    del engine
    _release()
    return rows


FLEX_MODE = "flex"          # the paged kernel under test; tests/bench runs "flex-eager" on CPU
FLEX_NUM_BLOCKS = 512       # KV pool of the exactness runs (flex-eager's reference math scores every row)
FLEX_PROMPT_LENS = (90, 5, 60, 33, 130, 17)    # + two prompts sharing a 64-token prefix
FLEX_NEW_TOKENS = 16
FLEX_REPEATS = 5            # timed decode steps (best of)


def check_flex(model_dir: str, perf_model_dir: str) -> list[Row]:
    """The flex paged kernel (and decode CUDA graphs) vs the eager path: exactness in float32 on chunked,
    prefix-cached, mixed batches; then decode step and prefill times of the ~1B model in bf16."""
    from engine import Engine, EngineArgs, SamplingParams
    from engine.profile import measure_decode, measure_prefill
    g = torch.Generator().manual_seed(9)
    base = torch.randint(2, 200, (64,), generator=g).tolist()
    prompts = [torch.randint(2, 200, (int(n),), generator=g).tolist() for n in FLEX_PROMPT_LENS]
    num_fresh = len(prompts)
    prompts += [base + [7, 8, 9], base + list(range(10, 30))]
    params = SamplingParams(max_tokens=FLEX_NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = {}
    for mode, graphs in (("eager", False), (FLEX_MODE, False), (FLEX_MODE, True)):
        engine = Engine(EngineArgs(model_dir, dtype="float32", device=DEVICE, num_blocks=FLEX_NUM_BLOCKS, block_size=16,
                                   chunk_size=48,
                                   max_num_batched_tokens=128, max_num_seqs=16, attention=mode, cuda_graphs=graphs))
        done = engine.generate(prompts[:num_fresh], params) + engine.generate(prompts[num_fresh:], params)
        outs[mode, graphs] = ([c.token_ids for c in done], [lp.logprob for c in done for lp in c.logprobs],
                              engine.attention, engine.runner.graphs is not None)
        del engine
    rows = []
    for key, label in (((FLEX_MODE, False), "flex paged attention"), ((FLEX_MODE, True), "flex + decode graphs")):
        tokens, lps, used, graphs = outs[key]
        diff = float((torch.tensor(lps) - torch.tensor(outs["eager", False][1])).abs().max())
        same = tokens == outs["eager", False][0]
        status = "ok" if same and diff < 1e-3 and used == FLEX_MODE and graphs == key[1] else "FAIL"
        rows.append(Row(f"{label} vs eager (fp32)", status, f"tokens {'equal' if same else 'DIFFER'}, "
                        f"max |logprob diff| {diff:.1e}", f"attention={used}, graphs={graphs}",
                        {"tokens_equal": same, "max_logprob_diff": diff, "attention": used, "graphs": graphs}))
    (batch, context), (num_prompts, prompt_len) = DECODE_POINT, PREFILL_POINT
    times = {}
    for mode, graphs in (("eager", False), (FLEX_MODE, False), (FLEX_MODE, True)):
        sizing = {"kv_memory_fraction": 0.5} if DEVICE == "cuda" else {"num_blocks": FLEX_NUM_BLOCKS}
        engine = Engine(EngineArgs(perf_model_dir, dtype="bfloat16", device=DEVICE, block_size=16, **sizing,
                                   max_num_batched_tokens=num_prompts * prompt_len, max_num_seqs=max(batch,
                                   num_prompts),
                                   attention=mode, cuda_graphs=graphs))
        decode = measure_decode(engine, batch=batch, context=context, repeats=FLEX_REPEATS)
        prefill = measure_prefill(engine, prompt_len, batch=num_prompts, repeats=1) if not graphs else None
        times[mode, graphs] = (decode and decode["seconds"], prefill and prefill["seconds"])
        del engine
        _release()
    eager_decode, eager_prefill = times["eager", False]
    for key, label in (((FLEX_MODE, False), "flex"), ((FLEX_MODE, True), "flex + graphs")):
        decode_s, _ = times[key]
        rows.append(Row(f"decode step {label} ({batch} × {context} ctx)", "info", f"{decode_s * 1e3:.2f} ms",
                        f"eager gather {eager_decode * 1e3:.2f} ms", {"seconds": decode_s, "eager": eager_decode}))
    prefill_s = times[FLEX_MODE, False][1]
    rows.append(Row(f"prefill flex ({num_prompts} × {prompt_len})", "info", f"{prefill_s * 1e3:.1f} ms",
                    f"eager SDPA loop {eager_prefill * 1e3:.1f} ms", {"seconds": prefill_s, "eager": eager_prefill}))
    return rows


QUANT_ROWS = (1, 4, 64)      # rows of the projection products checked (decode steps; a prefill chunk)
QUANT_RTOL = 0.02            # max |ours - reference| over max |reference|: bf16 activations and scales


def check_quantized(perf_model_dir: str) -> list[Row]:
    """int8 / int4 weight-only projections on the device: each product (the plan sends few rows to the
    packed kernel, many to dequantize + GEMM) against x @ W.T in float32 with W the dequantized
    weight; then the ~1B model's decode step at batch 1 and at DECODE_POINT beside the bf16 weights."""
    from engine import Engine, EngineArgs
    from engine.model import kernel_choice
    from engine.model.config import ModelConfig
    from engine.model.quantization import quantize
    from engine.model.quantized_linear import QuantizedLinear
    from engine.profile import measure_decode
    cfg = ModelConfig.from_dir(perf_model_dir)
    device = torch.device(DEVICE)
    g = torch.Generator().manual_seed(11)
    n, k = 2 * cfg.intermediate_size, cfg.hidden_size          # the gate/up projection's shape
    weight = torch.randn(n, k, generator=g) * 0.02
    rows = []
    for scheme in ("int8", "int4"):
        plan = kernel_choice.quantized_plan(cfg, scheme, 128, torch.bfloat16, device)
        q = quantize(weight, scheme, 128)
        module = QuantizedLinear(k, n, False, plan).to(device)
        module.set_weight(q, device)
        reference = q.dequantize().to(device)
        errors = {}
        for m in QUANT_ROWS:
            x = torch.randn(m, k, generator=g).to(device)
            expected = x @ reference.t()
            with torch.inference_mode():
                got = module(x.to(torch.bfloat16)).float()
            errors[m] = float((got - expected).abs().max() / expected.abs().max())
        worst = max(errors.values())
        rows.append(Row(f"{scheme} projection vs dequantized (bf16)", "ok" if worst <= QUANT_RTOL else "FAIL",
                        ", ".join(f"{m} rows {e:.1e}" for m, e in errors.items()), f"{plan}",
                        {"rel_err": errors, "plan": str(plan)}))
    (batch, context) = DECODE_POINT
    times = {}
    for scheme in ("none", "int8", "int4"):
        sizing = {"kv_memory_fraction": 0.5} if DEVICE == "cuda" else {"num_blocks": FLEX_NUM_BLOCKS}
        engine = Engine(EngineArgs(perf_model_dir, dtype="bfloat16", device=DEVICE, block_size=16, **sizing,
                                   max_num_seqs=batch, attention="eager", quantization=scheme))
        times[scheme] = {b: (measure_decode(engine, batch=b, context=context, repeats=5) or {}).get("seconds")
                         for b in (1, batch)}
        del engine
        _release()
    base = times["none"]
    for scheme in ("int8", "int4"):
        for b in (1, batch):
            ours, peer = times[scheme][b], base[b]
            figure = f"{ours * 1e3:.2f} ms ({ours / peer:.2f}x)" if ours and peer else "did not fit"
            rows.append(Row(f"decode step {scheme} weights ({b} × {context} ctx)", "info", figure,
                            f"bf16 weights {peer * 1e3:.2f} ms" if peer else "", {"seconds": ours, "bf16": peer}))
    return rows


def check_kv_cache_dtype(perf_model_dir: str) -> list[Row]:
    """The fp8 / int8 KV cache on the device: decode attention over the quantized cache (the gather path that
    dequantizes what it reads, and the compiled kernel that dequantizes in its loops, Triton on CUDA) against the
    same attention over its dequantized copy in float32; then the ~1B
    model's decode step at DECODE_POINT and the blocks its budget holds, beside the bf16 cache."""
    from engine import Engine, EngineArgs
    from engine.kv_cache.kv_format import KVFormat
    from engine.model import attention_compiled, kernel_choice
    from engine.model.attention import decode_attention, gather_kv
    from engine.profile import measure_decode
    device = torch.device(DEVICE)
    g = torch.Generator().manual_seed(12)
    heads, kv_heads, block, dim, seqs, width = 16, 4, 16, 128, 8, 16
    rows = []
    for kind in ("fp8", "int8"):
        fmt = KVFormat(kind, 1, kv_heads, block, dim, torch.bfloat16)
        cache = fmt.allocate(seqs * width, device)[0]
        kv = torch.randn(seqs * width * block, 2, kv_heads, dim, generator=g).to(device, torch.bfloat16)
        slots = torch.arange(seqs * width * block, device=device)
        fmt.write(cache, kv[:, 0], kv[:, 1], slots // block, slots % block)
        tables = torch.arange(seqs * width, device=device).view(seqs, width)
        bias = torch.zeros(seqs, width * block, device=device)
        q = torch.randn(seqs, heads, dim, generator=g).to(device)
        reference = KVFormat(kind, 1, kv_heads, block, dim, torch.float32).blocks(cache[None], tables.reshape(-1))[0]
        with torch.inference_mode():
            got = decode_attention(q.to(torch.bfloat16), gather_kv(cache, tables, fmt), bias, dim ** -0.5).float()
            want = decode_attention(q, reference.view(seqs, width, 2, kv_heads, block, dim).permute(2, 3, 0, 1, 4, 5)
                                    .reshape(2, kv_heads, seqs, width * block, dim), bias, dim ** -0.5)
        err = float((got - want).abs().max() / want.abs().max())
        rows.append(Row(f"{kind} KV cache attention vs dequantized", "ok" if err <= QUANT_RTOL else "FAIL",
                        f"{err:.1e}", "bf16 query, float32 reference", {"rel_err": err}))
        kernel = attention_compiled.build(cache, heads, fmt)    # what the engine decodes a quantized cache with
        if kernel is None:
            rows.append(Row(f"{kind} KV cache compiled decode kernel", "FAIL", "not built",
                            "Inductor could not build it here (the log says why): the engine decodes eagerly", {}))
            continue
        with torch.inference_mode():
            got = kernel(q.to(torch.bfloat16), cache, tables, bias, dim ** -0.5).float()
        err = float((got - want).abs().max() / want.abs().max())
        wins = kernel_choice.compiled_decode_wins(kernel, cache, heads)
        rows.append(Row(f"{kind} KV cache compiled decode kernel vs dequantized", "ok" if err <= QUANT_RTOL else "FAIL",
                        f"{err:.1e}", f"{'faster' if wins else 'slower'} than the gather path at batch 16 × 256 ctx",
                        {"rel_err": err, "compiled_wins": wins}))
    (batch, context) = DECODE_POINT
    figures = {}
    for kind in ("auto", "fp8", "int8"):
        sizing = {"kv_memory_fraction": 0.5} if DEVICE == "cuda" else {"num_blocks": FLEX_NUM_BLOCKS}
        engine = Engine(EngineArgs(perf_model_dir, dtype="bfloat16", device=DEVICE, block_size=16, **sizing,
                                   max_num_seqs=batch, kv_cache_dtype=kind))
        point = measure_decode(engine, batch=batch, context=context, repeats=5) or {}
        figures[kind] = {"seconds": point.get("seconds"), "blocks": engine.block_manager.num_blocks,
                         "attention": engine.attention}
        del engine
        _release()
    base = figures["auto"]
    for kind in ("fp8", "int8"):
        ours = figures[kind]
        step = (f"{ours['seconds'] * 1e3:.2f} ms ({ours['seconds'] / base['seconds']:.2f}x)"
                if ours["seconds"] and base["seconds"] else "did not fit")
        rows.append(Row(f"decode step {kind} KV cache ({batch} × {context} ctx)", "info",
                        f"{step}, {ours['blocks']} blocks ({ours['blocks'] / base['blocks']:.2f}x), "
                        f"attention {ours['attention']}",
                        f"bf16 cache {base['seconds'] * 1e3:.2f} ms, {base['blocks']} blocks" if base["seconds"] else
                        f"bf16 cache {base['blocks']} blocks", {**ours, "bf16": base}))
    return rows


def check_kv_tiers(model_dir: str) -> list[Row]:
    """The host tier on the device: a prompt's blocks evicted from the device cache come back from pinned host
    memory bit for bit, its tokens equal to the first run; then the measured onboarding bytes/s beside a
    pinned host→device copy of the same bytes."""
    from engine import Engine, EngineArgs, SamplingParams
    from engine.kv_cache.block_manager import prompt_block_hashes
    from engine.kv_cache.tiers import TierSpec
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(31)
    prompt, *fillers = [torch.randint(2, 1000, (150,), generator=g).tolist() for _ in range(5)]
    engine = Engine(EngineArgs(model_dir, dtype="float32", device=DEVICE, num_blocks=24, block_size=16,
                               attention="eager", kv_tiers=(TierSpec("host", GIB),)))
    bm, hashes = engine.block_manager, prompt_block_hashes(prompt, 16)[:9]
    first = engine.generate([prompt], params)[0]
    before = engine.kv_cache[:, bm.match_prefix(hashes)].cpu()
    for filler in fillers:
        engine.generate([filler], params)
    drained = engine.kv_tiers.offload.drain(60)
    evicted = drained and not bm.match_prefix(hashes)
    host = engine.kv_tiers.tiers[0]
    pinned = DEVICE != "cuda" or all(host.get(h).is_pinned() for h in hashes if h in host)
    again = engine.generate([prompt], params)[0]
    ids = bm.match_prefix(hashes)
    exact = len(ids) == len(hashes) and torch.equal(engine.kv_cache[:, ids].cpu(), before)
    ok = evicted and pinned and exact and again.num_cached_tokens == 9 * 16 and again.token_ids == first.token_ids
    stats = engine.kv_tiers.stats()[0]
    rows = [Row("KV host tier: offload → evict → onboard", "ok" if ok else "FAIL",
                f"{again.num_cached_tokens} cached tokens, blocks {'bit-exact' if exact else 'DIFFER'}, "
                f"pinned {pinned}, tokens {'equal' if again.token_ids == first.token_ids else 'DIFFER'}",
                "the first (uncached) run", {"evicted": evicted, "stats": stats})]
    src = torch.empty(64 * MIB, dtype=torch.uint8).pin_memory() if DEVICE == "cuda" else torch.empty(64 * MIB,
                                                                                                     dtype=torch.uint8)
    dst = torch.empty(64 * MIB, dtype=torch.uint8, device=DEVICE)
    copy_s = _best_time(lambda: dst.copy_(src, non_blocking=True))
    rows.append(Row("KV host tier onboarding", "info", f"{stats['onboard_bytes_per_s'] / 1e9:.2f} GB/s "
                    f"({stats['onboard_s_per_block'] * 1e6:.0f} us a block of {engine.kv_bytes_per_block} B)",
                    f"pinned host→device copy {gbps(64 * MIB, copy_s):.1f} GB/s"))
    del engine
    _release()
    return rows


def check_tensor_parallel(model_dir: str, new_tokens: int = 16) -> list[Row]:
    """Tensor parallelism on the device, float32: greedy tokens and logits of 2 ranks against 1. With two
    GPUs the ranks are cuda:0 and cuda:1 over NCCL; with one, both ranks share it over gloo (NCCL takes one
    device per rank): the sharded weights, per-rank caches and attention kernels still run on the GPU."""
    import dataclasses
    import multiprocessing

    from engine import Engine, EngineArgs, SamplingParams
    from engine.local_ranks import follow_rank
    from engine.parallel.group import free_port
    two = DEVICE == "cuda" and torch.cuda.device_count() >= 2
    device = f"{DEVICE}:0" if DEVICE == "cuda" else DEVICE
    base = EngineArgs(model_dir, dtype="float32", device=device, num_blocks=512, block_size=16)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 250, (int(n),), generator=g).tolist() for n in (9, 70, 200)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    def run(engine):
        blocks = engine.block_manager.allocate(-(-len(prompts[-1]) // 16))
        logits = engine.runner.score(prompts[-1], blocks).float().cpu()
        engine.block_manager.free(blocks)
        return [c.token_ids for c in engine.generate(prompts, params)], logits

    one = Engine(base)
    want_tokens, want_logits = run(one)
    del one
    _release()
    tp = dataclasses.replace(base, tensor_parallel=2, tensor_parallel_address=f"127.0.0.1:{free_port()}",
                             tensor_parallel_backend="nccl" if two else "gloo")
    follower = multiprocessing.get_context("spawn").Process(target=follow_rank, daemon=True, args=(
        dataclasses.replace(tp, tensor_parallel_rank=1, device=f"{DEVICE}:1" if two else device),))
    follower.start()
    engine = Engine(tp)
    try:
        t0 = time.perf_counter()
        tokens, logits = run(engine)
        seconds = time.perf_counter() - t0
    finally:
        engine.close()
        follower.join(60)
    diff = float((logits - want_logits).abs().max())
    same = sum(a == b for a, b in zip(tokens, want_tokens))
    how = "2 GPUs, NCCL" if two else "1 GPU shared by both ranks, gloo"
    ok = same == len(prompts) and diff <= 1e-3
    del engine
    _release()
    return [Row(f"tensor parallel 2 vs 1 rank ({how})", "ok" if ok else "FAIL",
                f"{same}/{len(prompts)} greedy outputs equal, max |logit diff| {diff:.1e}",
                "float32, tolerance 1e-3",
                {"equal_outputs": same, "max_logit_diff": diff, "two_gpus": two, "seconds": round(seconds, 2)})]


def check_gpu_tests(timeout_s: float) -> list[Row]:
    if not os.path.isdir(os.path.join(ROOT, "tests", "gpu")):
        return [Row("tests/gpu", "skipped", "no tests/gpu folder")]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"], cwd=ROOT,
                          capture_output=True, text=True, timeout=max(timeout_s, 1))
    last = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    return [Row("tests/gpu (pytest)", "ok" if proc.returncode == 0 else "FAIL", last, "",
                {"returncode": proc.returncode, "tail": proc.stdout[-4000:] + proc.stderr[-2000:]})]


def perf_model_dir() -> str:
    from engine.model.presets import cache_root, hf_config, write_model_dir
    path = os.path.join(cache_root(), "models", "gpu-check-1b")
    if not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        write_model_dir(path, hf_config(PERF_ARCH, torch_dtype="bfloat16"), seed=3, tokenizer_vocab=300)
    return path


# ------------------------------------------------------------------ driver

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small", help="model for the exactness checks (preset or HF directory)")
    p.add_argument("--perf-model", default=None,
                   help="model for the speed figures (default: a random ~1B Llama written to the cache)")
    p.add_argument("--json", metavar="PATH", help="also write every figure as JSON ('-' for stdout)")
    p.add_argument("--budget-s", type=float, default=480.0, help="skip the checks left after this many seconds")
    p.add_argument("--prompts", type=int, default=24, help="prompts for engine vs HF")
    return p


def run_checks(args) -> tuple[list[Row], dict]:
    from engine.model.presets import resolve_model
    start = time.monotonic()
    model_dir = resolve_model(args.model)
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "model": model_dir}
    rows: list[Row] = []
    peaks: dict = {}

    def left() -> float:
        return args.budget_s - (time.monotonic() - start)

    steps = [
        ("device peaks", lambda: peaks.update(device_peaks()) or []),
        ("engine vs HF", lambda: check_engine_vs_hf(model_dir, args.prompts, 16)),
        ("speed", lambda: check_speed(args.perf_model or perf_model_dir(), peaks)),
        ("flex kernel", lambda: check_flex(model_dir, args.perf_model or perf_model_dir())),
        ("quantized weights", lambda: check_quantized(args.perf_model or perf_model_dir())),
        ("quantized KV cache", lambda: check_kv_cache_dtype(args.perf_model or perf_model_dir())),
        ("KV tiers", lambda: check_kv_tiers(model_dir)),
        ("tensor parallel", lambda: check_tensor_parallel(model_dir)),
        ("KV transfer", lambda: check_transfer(TRANSFER_MIB)),
        ("KV transfer nixl", lambda: check_nixl_transfer(TRANSFER_MIB)),
        ("1P+1D cluster", lambda: check_cluster(model_dir, 16)),
        ("tests/gpu", lambda: check_gpu_tests(left())),
    ]
    for name, step in steps:
        if left() <= 0:
            rows.append(Row(name, "skipped", f"time budget {args.budget_s:.0f} s spent"))
            continue
        t0 = time.monotonic()
        try:
            new = step()
        except Exception as e:               # one failed check is a row; the others still run
            new = [Row(name, "error", f"{type(e).__name__}: {e}"[:200])]
        for row in new:
            row.data.setdefault("seconds", round(time.monotonic() - t0, 1))
        rows.extend(new)
    info.update(peaks)
    info["seconds"] = round(time.monotonic() - start, 1)
    return rows, info


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print(SKIP_LINE)
        if args.json:
            _write_json(args.json, {"skipped": "no CUDA device"})
        return 0
    rows, info = run_checks(args)
    print(f"gpu-check on {info['device']} (torch {info['torch']}, CUDA {info['cuda']}), {info['seconds']} s")
    print(format_table(rows))
    if args.json:
        _write_json(args.json, {"info": info, "rows": [asdict(r) for r in rows]})
    return 1 if any(r.status in ("FAIL", "error") for r in rows) else 0


def _write_json(path: str, payload: dict) -> None:
    text = json.dumps(payload, indent=2, default=str)
    if path == "-":
        print(text)
    else:  # `make gpu-check` writes build/gpu-check.json: a fresh checkout has no build/ yet
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
