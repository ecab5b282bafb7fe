"""Quality gates of the trained `pydoc` model: held-out bits per byte (engine vs HF) and KV codecs.

1. Held-out bits per byte of the committed weights, scored by our engine's model and by HF
   transformers on the same directory (every held-out token, fresh context per 512-token
   window); they must agree to 1e-3. Needs the corpus (`apt-get download`, see bench.train);
   `--no-bpb` skips it.
2. KV codecs on the fixed held-out passages (`heldout_passages.json`): each passage's first
   `prompt_len` tokens (or, `--varied-prompts`, 17-128 tokens, most ending inside a block) are
   prefilled on a prefill engine; the prompt KV goes through each codec's encode → decode (the
   bytes the wire carries) into a decode engine, which
   (a) greedy-decodes 64 tokens after adopting it (prefix agreement, identical sequences, and
       forks vs codec `none`, with `none`'s top-1 - top-2 margin at each fork), and
   (b) scores the rest of the passage teacher-forced on top of that received KV (perplexity and
       bits per byte; only the prompt KV differs between codecs).
   A codec passes the gate (`KV_GATE`) when it forks greedy paths only where `none`'s margin was
   below 0.1 nats and keeps bits per byte within 0.5 % of `none`'s. `fp8` (e4m3, one scale per
   block × layer × K/V × kv-head) and `int8` (one scale per token × layer × K/V × kv-head) by
   default; `fp8_tensor` (one scale per shipped tensor) on request; `fp8_cache` / `int8_cache` (a KV
   cache stored fp8 / int8 on both engines, `kv_cache.dtype`: quantized where it is written, shipped as
   stored, and the continuation's own KV quantized too) on request.
3. Weight-only quantization (`--weights int8,int4`): an engine per quantization on the same
   weights; held-out bits per byte of the fixed passages (each a fresh context: prefill, the
   dense path) with the per-passage worst change, and greedy agreement of 64 tokens after each
   passage's 128-token prompt, decoded in batches of 8 (the packed kernels), against the
   unquantized engine: prefix agreement, identical sequences, and the unquantized engine's top-1 -
   top-2 margin where a sequence first forks. With the corpus (step 1), the whole held-out split's
   bits per byte per quantization too. Targets: within 1% for int8, 5% for int4.

    python -m bench.trained_quality [--model pydoc] [--passages 64] [--no-bpb] [--no-kv] [--weights int8,int4]
                                    [--kv-codecs fp8,int8] [--varied-prompts] [--no-bf16-ref] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import math
import secrets
import sys
import time

import torch

from bench.engine.quantization import HEAD, scheme_of
from bench.kv_quality import _drain
from deploy.config.kv_transfer import KVTransferSection
from engine import Engine, EngineArgs, SamplingParams
from engine.model.attention import build_metadata
from engine.model.presets import resolve_model
from bench.train.passages import load_passages
from kv_transfer import codec_compiled, get_codec
from kv_transfer.codec import cache_dtype_of
from kv_transfer import FakeHub, KVPiece, TransferResult, TransferStatus, layout_of, make_receiver, make_sender

PROMPT_TOKENS = 128
CONTINUATION_TOKENS = 64
KV_GATE = {"max_margin_at_fork": 0.1, "bpb_rel_diff": 0.005}   # a KV codec's gate (kv_codec_quality)
VARIED_PROMPTS = (17, 128)      # shortest and longest prompt of the varied-length gate
KV_CODECS = ("fp8", "int8")
WEIGHT_TARGETS = {"int8": 0.01, "int4": 0.05}     # held-out bits per byte, relative to unquantized
GREEDY_BATCH = 8


def engine_nll(engine: Engine, windows: list[list[int]]) -> tuple[float, int]:
    """Summed next-token NLL (nats) and token count of `windows`, each a fresh context, by the
    engine's own model (paged KV, prefill attention)."""
    total, count = 0.0, 0
    bs = engine.block_size
    for w in windows:
        n = len(w) - 1
        blocks = engine.block_manager.allocate((n + bs - 1) // bs)
        meta = build_metadata([(0, n, blocks)], bs, engine.device)
        logits = engine.model(torch.tensor(w[:-1]), torch.arange(n), engine.kv_cache, meta, None)
        total += torch.nn.functional.cross_entropy(logits.float(), torch.tensor(w[1:]), reduction="sum").item()
        count += n
        engine.block_manager.free(blocks)
    return total, count


def hf_nll(model_dir: str, windows: list[list[int]]) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    from bench.train.trainer import nll_sum
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return nll_sum(model, windows), sum(len(w) - 1 for w in windows)


def heldout_windows_and_bytes(model_dir: str, cache: str | None = None) -> tuple[list[list[int]], int]:
    """The held-out split as the trainer scores it (fresh-context windows) and its size in bytes."""
    import os

    from tokenizers import Tokenizer

    from bench.train.corpus import load_corpus
    from bench.train.trainer import Recipe, encode_documents, heldout_windows
    corpus = load_corpus(cache or os.path.join(os.path.expanduser("~"), ".cache", "pdserve", "corpus"))
    with open(os.path.join(model_dir, "training.json"), encoding="utf-8") as f:
        record = json.load(f)
    if corpus.sha256 != record["corpus"]["sha256"]:
        print(f"warning: corpus sha256 {corpus.sha256[:16]}… differs from the recorded "
              f"{record['corpus']['sha256'][:16]}…", file=sys.stderr)
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    seq_len = record["recipe"].get("seq_len", Recipe.seq_len)
    return heldout_windows(encode_documents(tok, corpus.heldout), seq_len), corpus.num_heldout_bytes


def heldout_bits_per_byte(model_dir: str, engine: Engine, cache: str | None = None) -> dict:
    """Bits per byte over the whole held-out split, engine vs HF (same windows, same weights)."""
    windows, nbytes = heldout_windows_and_bytes(model_dir, cache)
    t0 = time.perf_counter()
    e_nll, n = engine_nll(engine, windows)
    t1 = time.perf_counter()
    h_nll, _ = hf_nll(model_dir, windows)
    t2 = time.perf_counter()
    e_bpb, h_bpb = e_nll / math.log(2) / nbytes, h_nll / math.log(2) / nbytes
    return {"tokens": n, "bytes": nbytes, "engine_bits_per_byte": e_bpb, "hf_bits_per_byte": h_bpb,
            "abs_diff": abs(e_bpb - h_bpb), "engine_s": t1 - t0, "hf_s": t2 - t1}


class KVLink:
    """The prefill engine's cache → a real KV transport → the decode engine's cache, for one codec.

    The sender encodes the prompt's blocks into wire chunks (header, payload, checksum); the
    receiver authenticates them, reserves blocks from the decode engine's block manager and
    decodes into its cache: the path a decode actor's KV takes in the cluster, both ends in
    this process so the decode engine's model can score what arrived.
    """

    def __init__(self, prefill: Engine, decode: Engine, codec: str, transport: str = "grpc") -> None:
        token = secrets.token_hex(16)
        hub = {"hub": FakeHub()} if transport == "fake" else {}
        self.prefill, self.codec = prefill, codec
        self.receiver = make_receiver(transport, layout_of(decode.kv_cache, decode.fingerprint, decode.kv_format),
                                      decode.kv_cache, decode.block_manager, codec=codec, token=token, **hub)
        self.sender = make_sender(transport, layout_of(prefill.kv_cache, prefill.fingerprint, prefill.kv_format),
                                  codec=codec, token=token, **hub)

    def ship(self, request_id: str, block_ids: list[int], num_tokens: int, first_token_id: int) -> TransferResult:
        """Send the prompt's blocks; returns the DONE result (its dst_block_ids now belong to the caller)."""
        piece = KVPiece(request_id, self.prefill.kv_cache, block_ids, num_tokens=num_tokens,
                        first_token_id=first_token_id, deadline_s=120.0)
        handle = self.sender.send(piece, self.receiver.endpoint)
        if handle.wait(120.0) is not TransferStatus.DONE:
            raise RuntimeError(f"{self.codec} transfer of {request_id} did not finish: {handle}")
        result = self.receiver.wait(handle.transfer_id, 120.0)
        if result is None or result.status is not TransferStatus.DONE:
            raise RuntimeError(f"{self.codec} transfer of {request_id} was not received: {result}")
        return result

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


def _continuation_nll(decode: Engine, prompt_blocks: list[int], prompt_len: int, continuation: list[int]) -> float:
    """Teacher-forced NLL of continuation[1:] given the received prompt KV + continuation[:-1].

    The forward writes only positions >= prompt_len (fresh blocks, or the unused tail of the
    last prompt block, which the greedy run overwrites before it reads it)."""
    bs = decode.block_size
    m = len(continuation) - 1
    need = (prompt_len + m + bs - 1) // bs - (prompt_len + bs - 1) // bs
    extra = decode.block_manager.allocate(need)
    blocks = prompt_blocks[:(prompt_len + bs - 1) // bs] + extra
    meta = build_metadata([(prompt_len, m, blocks)], bs, decode.device, kv_format=decode.kv_format)
    positions = torch.arange(prompt_len, prompt_len + m)
    logits = decode.model(torch.tensor(continuation[:-1]), positions, decode.kv_cache, meta, None)
    nll = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(continuation[1:]), reduction="sum").item()
    decode.block_manager.free(extra)
    return nll


def _greedy_after_adopt(decode: Engine, rid: str, prompt: list[int], result: TransferResult,
                        params: SamplingParams) -> tuple[list[int], list[float]]:
    """Adopt the received blocks as a decode actor does; greedy tokens and each step's top-1 - top-2
    logprob margin (the first token was drawn on the prefill side: margin inf)."""
    decode.expect_kv(rid, prompt, params, rid, float("inf"))
    outs = decode.adopt(rid, [result.first_token_id], list(result.dst_block_ids))
    outs += _drain(decode)
    tokens = [t for o in outs for t in o.new_token_ids]
    margins = [math.inf] + [lp.top[0].logprob - lp.top[1].logprob for o in outs[1:] for lp in o.logprobs]
    return tokens, margins


def varied_prompt_lens(num: int, shortest: int = VARIED_PROMPTS[0], longest: int = VARIED_PROMPTS[1]) -> list[int]:
    """`num` distinct prompt lengths in [shortest, longest], spread by a stride prime to the block size,
    so most prompts end inside a block (a partial last block) and a few on its boundary."""
    span = longest - shortest + 1
    stride = next(k for k in range(41, 41 + span) if math.gcd(k, span) == 1)
    return [shortest + (i * stride) % span for i in range(num)]


def kv_codec_quality(model: str = "pydoc", num_passages: int = 64, codecs: tuple[str, ...] = ("fp8", "fp8_tensor"),
                     dtype: str = "float32", attention: str = "auto", prompt_len: int = PROMPT_TOKENS,
                     max_tokens: int = CONTINUATION_TOKENS, transport: str = "grpc",
                     bf16_reference: bool = True, varied: bool = False) -> dict:
    """Greedy agreement, forks and teacher-forced continuation perplexity and bits per byte, each codec
    vs `none`, every prompt's KV shipped prefill engine → `transport` → decode engine.

    `varied`: passage i's prompt is `varied_prompt_lens(num_passages)[i]` tokens instead of `prompt_len`.
    `bf16_reference` adds a row that is no codec: the `none` KV rounded to bfloat16 in the decode
    cache (what a bf16 deployment holds), to show how often a harmless rounding flips greedy paths.
    Each codec's `gate` (KV_GATE): every greedy fork where codec none's top-1 - top-2 margin was below
    `max_margin_at_fork`, and continuation bits per byte within `bpb_rel_diff` of none's."""
    model_dir = resolve_model(model)
    passages = load_passages(model_dir)[:num_passages]
    prompt_lens = varied_prompt_lens(len(passages)) if varied else [prompt_len] * len(passages)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    names = ("none", *codecs, *(("bf16_ref",) if bf16_reference else ()))
    # a pair of engines per KV cache dtype: `fp8_cache` / `int8_cache` store the KV quantized where it is
    # written (prefill and decode alike) and ship it as stored; the others a model-dtype cache
    kinds = list(dict.fromkeys(cache_dtype_of(n) for n in ("none", *codecs)))
    pairs = {k: tuple(Engine(EngineArgs(model_dir, dtype=dtype, num_blocks=256, enable_prefix_cache=False,
                                        attention=attention, kv_cache_dtype=k)) for _ in range(2)) for k in kinds}
    prefill, decode = pairs["auto"]
    links = {c: KVLink(*pairs[cache_dtype_of(c)], c, transport) for c in ("none", *codecs)}
    # The receivers start compiling fp8 kernels on a background thread; torch.compile's tracing
    # patches torch.nn.Module.__call__ process-wide, so no model may run until it is done.
    codec_compiled.wait_ready()
    nll = {c: [] for c in names}
    greedy = {c: [] for c in names}
    wire_bytes = dict.fromkeys(names, 0)
    margins: list[list[float]] = []
    try:
        for i, (passage, plen) in enumerate(zip(passages, prompt_lens)):
            prompt, continuation = passage[:plen], passage[plen:]
            rid = f"p{i}"
            outs = {}
            for kind, (p_engine, _) in pairs.items():
                p_engine.add_request(prompt, params, request_id=rid, prefill_only=True)
                outs[kind] = next(o for o in _drain(p_engine) if o.request_id == rid)
            for name in names:
                kind = cache_dtype_of("none" if name == "bf16_ref" else name)
                out, d_engine = outs[kind], pairs[kind][1]
                result = links["none" if name == "bf16_ref" else name].ship(f"{rid}-{name}", out.block_ids,
                                                                              len(prompt), out.new_token_ids[0])
                wire_bytes[name] += result.nbytes
                if name == "bf16_ref":
                    ids = torch.tensor(result.dst_block_ids)
                    decode.kv_cache[:, ids] = decode.kv_cache[:, ids].to(torch.bfloat16).to(decode.kv_cache.dtype)
                nll[name].append(_continuation_nll(d_engine, result.dst_block_ids, plen, continuation))
                tokens, step_margins = _greedy_after_adopt(d_engine, f"{rid}-{name}", prompt, result, params)
                greedy[name].append(tokens)
                if name == "none":
                    margins.append(step_margins)
            for p_engine, _ in pairs.values():
                p_engine.release(rid)
            if (i + 1) % 8 == 0 or i + 1 == len(passages):
                print(f"kv quality: {i + 1}/{len(passages)} passages", file=sys.stderr, flush=True)
    finally:
        for link in links.values():
            link.close()
    for engines in pairs.values():
        for engine in engines:
            engine.block_manager.check_no_leaks()
    num_scored = [len(p) - plen - 1 for p, plen in zip(passages, prompt_lens)]
    scored = sum(num_scored)
    # bytes of the scored tokens (continuation[1:]), the same for every codec
    scored_bytes = sum(len(decode.tokenizer.decode(p[plen + 1:]).encode()) for p, plen in zip(passages, prompt_lens))
    ref_ppl = math.exp(sum(nll["none"]) / scored)
    ref_bpb = sum(nll["none"]) / math.log(2) / scored_bytes
    token_shape = (decode.kv_cache.shape[0], 1, *decode.kv_cache.shape[2:])     # one block, every layer
    block_size = decode.kv_cache.shape[4]

    def bytes_per_token(name: str) -> float:
        return get_codec(name).payload_nbytes(token_shape, decode.kv_cache.dtype) / block_size

    result = {"passages": len(passages), "prompt_tokens": prompt_len if not varied else None,
              "prompt_lens": prompt_lens, "scored_tokens_per_passage": scored // max(1, len(passages)),
              "scored_tokens": scored, "scored_bytes": scored_bytes, "greedy_tokens": max_tokens,
              "transport": transport, "dtype": str(decode.kv_cache.dtype).removeprefix("torch."),
              "block_size": block_size,
              "gate": dict(KV_GATE),
              "none": {"ppl": ref_ppl, "bits_per_byte": ref_bpb, "wire_bytes": wire_bytes["none"],
                       "bytes_per_token": bytes_per_token("none")}}
    for name in names[1:]:
        ppl = math.exp(sum(nll[name]) / scored)
        bpb = sum(nll[name]) / math.log(2) / scored_bytes
        per_passage = [abs(math.exp((a - b) / n) - 1) for a, b, n in zip(nll[name], nll["none"], num_scored)]
        prefix = [next((k for k, (a, b) in enumerate(zip(x, y)) if a != b), len(y))
                  for x, y in zip(greedy[name], greedy["none"])]
        # where a sequence first differs, how sure was codec `none` of its token (top-1 - top-2, nats)
        forks = [m[k] for k, m, y in zip(prefix, margins, greedy["none"]) if k < len(y)]
        row = result[name] = {
            "ppl": ppl, "ppl_rel_diff": abs(ppl / ref_ppl - 1), "ppl_rel_diff_max_passage": max(per_passage),
            "bits_per_byte": bpb, "bpb_rel_diff": bpb / ref_bpb - 1,
            "greedy_prefix_agreement": sum(prefix) / sum(len(y) for y in greedy["none"]),
            "identical_sequences": sum(x == y for x, y in zip(greedy[name], greedy["none"])) / len(passages),
            "num_forks": len(forks), "margins_at_forks": sorted(forks, reverse=True),
            "max_margin_at_fork": max(forks, default=0.0), "wire_bytes": wire_bytes[name],
        }
        if name != "bf16_ref":
            row["bytes_per_token"] = bytes_per_token(name)
            row["gate_pass"] = (row["max_margin_at_fork"] < KV_GATE["max_margin_at_fork"]
                                and abs(row["bpb_rel_diff"]) <= KV_GATE["bpb_rel_diff"])
    return result


def print_kv_quality(q: dict) -> None:
    """The codecs side by side: bytes per token on the wire, fidelity, and the gate (KV_GATE)."""
    lens = q["prompt_lens"]
    inside = sum(n % q["block_size"] != 0 for n in lens)
    prompts = f"{q['prompt_tokens']}-token prompts" if q["prompt_tokens"] else \
        f"prompts of {min(lens)}-{max(lens)} tokens ({inside} of {len(lens)} end inside a block)"
    print(f"{q['passages']} held-out passages, KV ({q['dtype']}) shipped prefill engine -> {q['transport']} -> "
          f"decode engine: {prompts}; the rest of each passage ({q['scored_tokens']} tokens, {q['scored_bytes']} "
          f"bytes) scored teacher-forced on the received KV; {q['greedy_tokens']} greedy tokens")
    names = [n for n, r in q.items() if isinstance(r, dict) and "ppl" in r]
    head = ["KV", "bytes/token", "payload MB", "bits/byte", "vs none", "ppl", "max/passage", "greedy prefix",
            "identical", "forks", "max margin at fork", "gate"]
    rows = []
    for name in names:
        r = q[name]
        bpt = f"{r['bytes_per_token']:.0f}" if "bytes_per_token" in r else "(none)"
        mb = f"{r['wire_bytes'] / 1e6:.2f}" if name != "bf16_ref" else "(none)"
        if name == "none":
            rows.append([name, bpt, mb, f"{r['bits_per_byte']:.5f}", "", f"{r['ppl']:.4f}", "", "1.000", "1.000",
                         "0", "", ""])
            continue
        gate = "" if "gate_pass" not in r else ("pass" if r["gate_pass"] else "FAIL")
        rows.append([name, bpt, mb, f"{r['bits_per_byte']:.5f}", f"{r['bpb_rel_diff']:+.3%}", f"{r['ppl']:.4f}",
                     f"{r['ppl_rel_diff_max_passage']:.3%}", f"{r['greedy_prefix_agreement']:.3f}",
                     f"{r['identical_sequences']:.3f}", str(r["num_forks"]), f"{r['max_margin_at_fork']:.4f}", gate])
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    for row in [head, *rows]:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    for name in names[1:]:
        if q[name]["num_forks"]:
            print(f"{name} margins at its forks (nats): "
                  + ", ".join(f"{m:.3f}" for m in q[name]["margins_at_forks"]))
    print(f"(gate: every greedy fork where codec none's top-1 - top-2 logprob was below "
          f"{q['gate']['max_margin_at_fork']} nats, and bits per byte within {q['gate']['bpb_rel_diff']:.1%} of "
          f"none's; bf16_ref: the none KV rounded to bfloat16 in the decode cache, no codec)")


def _greedy(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list:
    """Greedy completions with top-2 logprobs, decoded GREEDY_BATCH sequences at a time."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    out = []
    for start in range(0, len(prompts), GREEDY_BATCH):
        out += engine.generate(prompts[start:start + GREEDY_BATCH], params)
    return out


def weight_quality(model: str = "pydoc", quantizations: tuple[str, ...] = ("int8", "int4"), num_passages: int = 64,
                   group_size: int = 128, dtype: str = "float32", prompt_len: int = PROMPT_TOKENS,
                   max_tokens: int = CONTINUATION_TOKENS, greedy: bool = True, windows=None,
                   heldout_bytes: int | None = None) -> dict:
    """Each weight quantization against the unquantized engine on the held-out passages (module
    docstring, part 3); `windows` + `heldout_bytes` (the held-out split, `heldout_bits_per_byte`'s
    windows) add whole-split bits per byte."""
    model_dir = resolve_model(model)
    passages = load_passages(model_dir)[:num_passages]
    result: dict = {"passages": len(passages), "group_size": group_size, "dtype": dtype}
    reference: dict | None = None
    for name in ("none", *quantizations):
        engine = Engine(EngineArgs(model_dir, dtype=dtype, num_blocks=64 + GREEDY_BATCH * 20, enable_prefix_cache=False,
                                   attention="eager", quantization=scheme_of(name),
                                   quantization_group_size=group_size, quantize_lm_head=name.endswith(HEAD)))
        nbytes = [len(engine.tokenizer.decode(p[1:]).encode()) for p in passages]     # the scored tokens' bytes
        nll = [engine_nll(engine, [p])[0] for p in passages]
        row = {"bits_per_byte": sum(nll) / math.log(2) / sum(nbytes), "nll": nll,
               "plan": str(engine.model.quant) if engine.model.quant is not None else None}
        if windows is not None:
            split_nll, _ = engine_nll(engine, windows)
            row["heldout_bits_per_byte"] = split_nll / math.log(2) / heldout_bytes
        if greedy:
            row["greedy"] = _greedy(engine, [p[:prompt_len] for p in passages], max_tokens)
        engine.block_manager.check_no_leaks()
        if reference is None:
            reference = result["none"] = row
            continue
        ref_bpb = reference["bits_per_byte"]
        row["bpb_rel_diff"] = row["bits_per_byte"] / ref_bpb - 1
        row["bpb_rel_diff_max_passage"] = max(a / b - 1 for a, b in zip(nll, reference["nll"]))
        if windows is not None:
            row["heldout_rel_diff"] = row["heldout_bits_per_byte"] / reference["heldout_bits_per_byte"] - 1
        if greedy:
            ours, theirs = [c.token_ids for c in row["greedy"]], [c.token_ids for c in reference["greedy"]]
            prefix = [next((k for k, (a, b) in enumerate(zip(x, y)) if a != b), len(y)) for x, y in zip(ours, theirs)]
            forks = [c.logprobs[k].top[0].logprob - c.logprobs[k].top[1].logprob
                     for k, c, y in zip(prefix, reference["greedy"], theirs) if k < len(y)]
            row.update(greedy_prefix_agreement=sum(prefix) / sum(map(len, theirs)),
                       identical_sequences=sum(x == y for x, y in zip(ours, theirs)) / len(passages),
                       max_margin_at_fork=max(forks, default=0.0))
        row["target"] = WEIGHT_TARGETS.get(scheme_of(name))
        row["pass"] = row["target"] is None or abs(row["bpb_rel_diff"]) <= row["target"]
        result[name] = row
    for row in (result[n] for n in ("none", *quantizations)):
        row.pop("greedy", None)
        row.pop("nll")
    return result


def print_weight_quality(q: dict) -> None:
    print(f"weight-only quantization ({q['dtype']}, int4 group {q['group_size']}): {q['passages']} held-out passages "
          f"scored as fresh contexts; greedy {CONTINUATION_TOKENS} tokens after each {PROMPT_TOKENS}-token prompt, "
          f"batches of {GREEDY_BATCH}")
    split = "heldout_bits_per_byte" in q["none"]
    head = ["weights", "bits/byte", "vs none", "max/passage"] + (["split b/B", "vs none"] if split else []) + \
        ["greedy prefix", "identical", "max margin at fork", "target"]
    rows = []
    for name, r in q.items():
        if not isinstance(r, dict):
            continue
        base = name == "none"

        def rel(key: str) -> str:
            return "" if base else f"{r[key]:+.3%}"
        row = [name, f"{r['bits_per_byte']:.5f}", rel("bpb_rel_diff"), rel("bpb_rel_diff_max_passage")]
        if split:
            row += [f"{r['heldout_bits_per_byte']:.5f}", rel("heldout_rel_diff")]
        if base:
            row += ["1.000", "1.000", "", ""]
        else:
            goal = f"<= {r['target']:.0%} {'met' if r['pass'] else 'NOT met'}" if r["target"] else ""
            row += [f"{r.get('greedy_prefix_agreement', math.nan):.3f}",
                    f"{r.get('identical_sequences', math.nan):.3f}", f"{r.get('max_margin_at_fork', 0.0):.4f}", goal]
        rows.append(row)
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    for row in [head, *rows]:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    print("(margin at fork: the unquantized engine's top-1 - top-2 logprob, nats, where a greedy sequence first "
          "differs)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.trained_quality", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="pydoc")
    ap.add_argument("--passages", type=int, default=64)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--transport", default="grpc", choices=("grpc", "fake"),
                    help="KV transport between the prefill and the decode engine (default grpc on loopback)")
    ap.add_argument("--no-bpb", action="store_true", help="skip held-out bits per byte (needs the corpus)")
    ap.add_argument("--no-kv", action="store_true", help="skip the KV codec measures")
    ap.add_argument("--kv-codecs", default=",".join(KV_CODECS),
                    help=f"KV codecs to compare with codec none (default {','.join(KV_CODECS)}; also fp8_tensor)")
    ap.add_argument("--varied-prompts", action="store_true",
                    help=f"prompts of {VARIED_PROMPTS[0]}-{VARIED_PROMPTS[1]} tokens, most ending inside a block "
                    f"(default: {PROMPT_TOKENS} tokens each)")
    ap.add_argument("--no-bf16-ref", action="store_true", help="skip the none-KV-rounded-to-bf16 row")
    ap.add_argument("--weights", default="int8,int4",
                    help="weight quantizations to compare with unquantized weights, e.g. int8,int4,int4+head "
                    "(+head: the LM head too; '' skips them)")
    ap.add_argument("--group-size", type=int, default=128, help="int4 group size (32, 64, 128)")
    ap.add_argument("--cache", help="corpus cache directory (default ~/.cache/pdserve/corpus)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    result: dict = {}
    ok = True
    model_dir = resolve_model(args.model)
    if not args.no_bpb:
        engine = Engine(EngineArgs(model_dir, dtype="float32", num_blocks=64, enable_prefix_cache=False,
                                   attention="eager"))
        bpb = result["bits_per_byte"] = heldout_bits_per_byte(model_dir, engine, args.cache)
        ok = bpb["abs_diff"] < 1e-3
        print(f"held-out bits/byte over {bpb['tokens']} tokens / {bpb['bytes']} bytes: engine "
              f"{bpb['engine_bits_per_byte']:.5f}, HF transformers {bpb['hf_bits_per_byte']:.5f}, "
              f"|diff| {bpb['abs_diff']:.1e} ({'ok' if ok else 'FAIL'} at 1e-3)\n")
    weights = tuple(w for w in args.weights.split(",") if w)
    if weights:
        split = {}
        if not args.no_bpb:
            split = dict(zip(("windows", "heldout_bytes"), heldout_windows_and_bytes(model_dir, args.cache)))
        q = result["weights"] = weight_quality(args.model, weights, args.passages, args.group_size, **split)
        print_weight_quality(q)
        print()
        ok = ok and all(q[w]["pass"] for w in weights)
    if not args.no_kv:
        codecs = tuple(c for c in args.kv_codecs.split(",") if c)
        q = result["kv"] = kv_codec_quality(args.model, args.passages, codecs, attention=args.attention,
                                            transport=args.transport, bf16_reference=not args.no_bf16_ref,
                                            varied=args.varied_prompts)
        print_kv_quality(q)
        default = KVTransferSection().compression
        for name in codecs:
            print(f"{name}: gate {'passed' if q[name]['gate_pass'] else 'FAILED'}"
                  + (" (the default kv_transfer.compression)" if name == default else ""))
        ok = ok and (default not in codecs or q[default]["gate_pass"])
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
