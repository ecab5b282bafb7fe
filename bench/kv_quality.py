"""What lossy KV codecs (fp8, int8) cost in accuracy: greedy agreement and first-step logits error vs `none`.

For each prompt: prefill once, ship the KV through each codec in-process
(encode → decode, exactly what the wire does), adopt it on a decode engine,
and compare the first decode step's logits and the whole greedy continuation.

    python -m bench.kv_quality [--model small] [--requests 32] [--max-tokens 32] [--codecs fp8,int8,fp8_tensor]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from engine import Engine, EngineArgs, SamplingParams
from engine.model.attention import build_metadata
from kv_transfer.codec import get_codec


def _roundtrip(codec_name: str, x: torch.Tensor) -> torch.Tensor:
    codec = get_codec(codec_name)
    out = torch.empty(codec.payload_nbytes(tuple(x.shape), x.dtype), dtype=torch.uint8)
    codec.encode(x.contiguous(), out)
    return codec.decode(out, tuple(x.shape), x.dtype).clone()


def _first_step_logits(engine: Engine, prompt: list[int], first: int, blocks: list[int]) -> torch.Tensor:
    n = len(prompt)
    meta = build_metadata([(n, 1, blocks)], engine.block_size, engine.device)
    return engine.model(torch.tensor([first]), torch.tensor([n]), engine.kv_cache, meta, torch.tensor([0]))[0]


def measure(model: str = "tiny", num_requests: int = 32, max_tokens: int = 32, dtype: str = "float32",
            codecs: tuple[str, ...] = ("fp8", "fp8_tensor"), seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    prefill = Engine(EngineArgs(model, dtype=dtype, num_blocks=2048, enable_prefix_cache=False))
    decode = Engine(EngineArgs(model, dtype=dtype, num_blocks=2048, enable_prefix_cache=False))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    stats = {c: {"same_tokens": 0, "same_sequences": 0, "rel_l2": [], "max_abs": []} for c in codecs}
    total_tokens = 0
    for i in range(num_requests):
        length = int(torch.randint(16, 400, (1,), generator=g))
        prompt = torch.randint(2, prefill.vocab_size, (length,), generator=g).tolist()
        rid = f"q{i}"
        prefill.add_request(prompt, params, request_id=rid, prefill_only=True)
        out = next(o for o in _drain(prefill) if o.request_id == rid)
        src = prefill.kv_cache[:, out.block_ids]
        runs = {}
        for codec in ("none", *codecs):
            # room for the prompt and the first token's KV (one more block at a block boundary)
            blocks = decode.block_manager.allocate(len(prompt) // decode.block_size + 1)
            decode.kv_cache[:, blocks[:len(out.block_ids)]] = _roundtrip(codec, src)
            logits = _first_step_logits(decode, prompt, out.new_token_ids[0], blocks)
            decode.expect_kv(f"{rid}-{codec}", prompt, params, f"{rid}-{codec}", float("inf"))
            decode.adopt(f"{rid}-{codec}", [out.new_token_ids[0]], blocks)
            tokens = out.new_token_ids + [t for o in _drain(decode) for t in o.new_token_ids]
            runs[codec] = (logits, tokens)
        prefill.release(rid)
        ref_logits, ref_tokens = runs["none"]
        total_tokens += len(ref_tokens)
        for codec in codecs:
            logits, tokens = runs[codec]
            s = stats[codec]
            s["rel_l2"].append(float((logits - ref_logits).norm() / ref_logits.norm()))
            s["max_abs"].append(float((logits - ref_logits).abs().max()))
            prefix = next((k for k, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(ref_tokens))
            s["same_tokens"] += prefix
            s["same_sequences"] += tokens == ref_tokens
    prefill.block_manager.check_no_leaks()
    decode.block_manager.check_no_leaks()
    return {c: {"greedy_prefix_agreement": s["same_tokens"] / total_tokens,
                "identical_sequences": s["same_sequences"] / num_requests,
                "first_step_logits_rel_l2_mean": sum(s["rel_l2"]) / num_requests,
                "first_step_logits_max_abs": max(s["max_abs"])} for c, s in stats.items()}


def _drain(engine: Engine):
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    return outs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench kv_quality", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--codecs", default="fp8,int8,fp8_tensor", help="lossy codecs to compare with none")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    result = measure(args.model, args.requests, args.max_tokens, args.dtype,
                     tuple(c for c in args.codecs.split(",") if c))
    print(f"{'codec':<12} {'greedy prefix agreement':>24} {'identical seqs':>15} {'logits rel L2':>14} "
          f"{'max |dlogit|':>13}")
    for codec, r in result.items():
        print(f"{codec:<12} {r['greedy_prefix_agreement']:>24.3f} {r['identical_sequences']:>15.3f} "
              f"{r['first_step_logits_rel_l2_mean']:>14.2e} {r['first_step_logits_max_abs']:>13.2e}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
