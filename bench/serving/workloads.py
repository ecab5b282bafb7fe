"""Serving workloads: lists of `RequestSpec` (prompt + output length), deterministic per seed.

    chat           short prompts, long outputs
    rag            long prompts, short outputs
    mixed          both, interleaved: long prompts arrive while chat requests decode
    shared-prefix  one long common system prompt + a short unique question each
    multi-turn     conversations (`make_conversations`): each turn's prompt is the previous turn's
                   prompt + its answer + a new user message; run by `bench.serving.multi_turn`
    phases         chat, then rag, then chat (a third each): the load shifts twice (role flips)
    structured     short prompts, every output held to a JSON schema (`STRUCTURED_SCHEMA`); run by
                   `bench.serving.structured_cost`: TPOT with and without the grammar mask, side by side
    FILE.jsonl     a trace, one object a line: {"prompt": str} or {"prompt_len": int}, plus "output_len"
                   (whole numbers, 1..MAX_TRACE_TOKENS); repeated or cut to the number of requests

Prompts are token ids (exact lengths, any tokenizer) drawn from ids 2..999, which every
preset's vocabulary holds; JSONL prompts may be text. `scale` multiplies every length,
so one definition serves a GPU and a 2-core laptop.
"""
from __future__ import annotations

import json
import math
import os
import random
import statistics
import sys
from dataclasses import dataclass

from engine.sampling.structured import StructuredOutput

WORKLOADS = ("chat", "rag", "mixed", "shared-prefix", "phases", "structured")
TOKEN_ID_RANGE = (2, 1000)
# The longest prompt or output a workload may ask for, in tokens: far above any model's context, low enough
# that a typo (1e9) is refused with a message instead of building a token list that exhausts memory.
MAX_TRACE_TOKENS = 10_000_000
TRACE_SUFFIX = ".jsonl"     # matched case-insensitively

# (prompt_min, prompt_max, output_min, output_max) before scaling
SHAPES = {
    "chat": (64, 256, 128, 384),
    "rag": (1024, 2048, 16, 64),
    "shared-prefix": (32, 128, 64, 192),   # unique part; the common prefix is SHARED_PREFIX_LEN
    "structured": (32, 128, 128, 128),
}
SHARED_PREFIX_LEN = 1024
MIXED_RAG_FRACTION = 0.3
MULTI_TURN = "multi-turn"
# (system prompt + first user message, each later user message, each answer): (min, max) before scaling
CONVERSATION_SHAPE = ((512, 1024), (32, 128), (64, 192))
STRUCTURED = "structured"
# An array of at least 256 records (nested object, bounded integer and number, enum array, bounded string):
# no output within its length completes it, so every step of a constrained request computes a live mask
# (a complete grammar would leave only EOS, which the benchmark's ignore_eos then draws again and again).
STRUCTURED_SCHEMA = {
    "type": "array", "minItems": 256, "items": {
        "type": "object", "additionalProperties": False, "required": ["id", "name", "tags", "score"],
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 100000},
                       "name": {"type": "string", "maxLength": 24},
                       "tags": {"type": "array", "maxItems": 3,
                                "items": {"enum": ["red", "green", "blue", "urgent", "later"]}},
                       "score": {"type": "number", "minimum": 0, "maximum": 1}}}}


@dataclass(slots=True)
class RequestSpec:
    """One request of a workload: token ids (or text), how many tokens to generate, and the grammar the
    output must match (None: free text)."""

    prompt_token_ids: list[int] | None
    output_len: int
    prompt: str | None = None
    kind: str = ""
    structured: StructuredOutput | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids) if self.prompt_token_ids is not None else len(self.prompt or "")


def _scaled(lo: int, hi: int, scale: float) -> tuple[int, int]:
    lo, hi = max(1, round(lo * scale)), max(1, round(hi * scale))
    if hi > MAX_TRACE_TOKENS:
        raise ValueError(f"--scale {scale}: lengths up to {hi:,} tokens, above the limit of {MAX_TRACE_TOKENS:,}")
    return lo, hi


_TOKEN_IDS = list(range(*TOKEN_ID_RANGE))   # one int object per id, shared by every prompt (8 bytes a token, not 36)


def _tokens(rng: random.Random, n: int) -> list[int]:
    """``n`` ids, each ``rng.randrange(*TOKEN_ID_RANGE)``: the same draws (``randrange`` takes k random bits
    and redraws while they reach the width), without its argument checks per id."""
    width = len(_TOKEN_IDS)
    bits, getrandbits, ids_of = width.bit_length(), rng.getrandbits, _TOKEN_IDS
    ids = []
    for _ in range(n):
        r = getrandbits(bits)
        while r >= width:
            r = getrandbits(bits)
        ids.append(ids_of[r])
    return ids


def _shaped(rng: random.Random, shape: str, scale: float, kind: str | None = None) -> RequestSpec:
    p_lo, p_hi = _scaled(*SHAPES[shape][:2], scale)
    o_lo, o_hi = _scaled(*SHAPES[shape][2:], scale)
    return RequestSpec(_tokens(rng, rng.randint(p_lo, p_hi)), rng.randint(o_lo, o_hi), kind=kind or shape)


def make_workload(name: str, num_requests: int, seed: int = 0, scale: float = 1.0,
                  prompt_len: int | None = None, output_len: int | None = None) -> list[RequestSpec]:
    """Build ``num_requests`` requests of workload ``name`` (or read a JSONL file).

    Args:
        name: one of `WORKLOADS`, or a path ending in ``.jsonl`` (any case).
        seed: the same seed gives the same prompts and lengths.
        scale: multiplies every prompt and output length.
        prompt_len, output_len: fix every request's prompt / output length (sweeps).
    """
    if num_requests < 1:
        raise ValueError(f"--num-requests must be at least 1, got {num_requests}")
    if not 0 < scale < math.inf:
        raise ValueError(f"--scale must be a finite number above 0, got {scale}")
    for flag, length in (("--prompt-len", prompt_len), ("--output-len", output_len)):
        _check_override(flag, length)
    rng = random.Random(f"{name}-{seed}")
    if is_trace_file(name):
        specs = read_jsonl(name, rng)
        if len(specs) != num_requests:
            n = f"{len(specs)} request{'s' if len(specs) > 1 else ''}"
            how = (f"{n}, repeated to {num_requests}" if len(specs) < num_requests
                   else f"first {num_requests} of {len(specs)} requests used")
            print(f"workload {name}: {how}", file=sys.stderr)
        specs = [specs[i % len(specs)] for i in range(num_requests)]
    elif name in ("chat", "rag"):
        specs = [_shaped(rng, name, scale) for _ in range(num_requests)]
    elif name == STRUCTURED:
        spec = StructuredOutput(json_schema=json.dumps(STRUCTURED_SCHEMA))
        specs = [_shaped(rng, name, scale) for _ in range(num_requests)]
        for s in specs:
            s.structured = spec
    elif name == "mixed":
        specs = [_shaped(rng, "rag" if rng.random() < MIXED_RAG_FRACTION else "chat", scale)
                 for _ in range(num_requests)]
    elif name == "phases":
        third = max(num_requests // 3, 1)
        shapes = ["chat"] * third + ["rag"] * third + ["chat"] * (num_requests - 2 * third)
        specs = [_shaped(rng, shape, scale) for shape in shapes]
    elif name == "shared-prefix":
        prefix = _tokens(rng, _scaled(SHARED_PREFIX_LEN, SHARED_PREFIX_LEN, scale)[0])
        specs = []
        for _ in range(num_requests):
            spec = _shaped(rng, "shared-prefix", scale)
            spec.prompt_token_ids = prefix + spec.prompt_token_ids
            specs.append(spec)
    else:
        raise ValueError(_unknown_workload(name))
    for spec in specs:
        if prompt_len is not None:
            spec.prompt_token_ids, spec.prompt = _tokens(rng, prompt_len), None
        if output_len is not None:
            spec.output_len = output_len
    return specs


def is_trace_file(name: str) -> bool:
    """Whether ``--workload name`` names a trace file (``.jsonl``, any case) rather than a built-in workload."""
    return name.lower().endswith(TRACE_SUFFIX)


def _unknown_workload(name: str) -> str:
    """The message for a ``--workload`` that is neither a built-in workload nor a ``.jsonl`` file."""
    if os.sep in name or "/" in name or (os.altsep and os.altsep in name) or os.path.splitext(name)[1]:
        fmt = "trace files are JSON Lines (FILE.jsonl), one request per line"
        if not os.path.exists(name):
            return f"--workload {name}: no such file; {fmt}"
        return f"--workload {name}: not a .jsonl file; {fmt}"
    names = ", ".join((*WORKLOADS[:4], MULTI_TURN, *WORKLOADS[4:]))
    return f"unknown workload {name!r}: use one of {names}, or a trace file FILE.jsonl"


def _check_override(flag: str, length: int | None) -> None:
    if length is not None and length < 1:
        raise ValueError(f"{flag} must be at least 1, got {length}")
    if length is not None and length > MAX_TRACE_TOKENS:
        raise ValueError(f"{flag} must be at most {MAX_TRACE_TOKENS:,} tokens, got {length:,}")


@dataclass(slots=True)
class Conversation:
    """A chat of ``len(output_lens)`` turns. Turn 0's prompt is ``first_prompt``; turn k's is turn k-1's
    prompt + its answer + ``user_messages[k - 1]`` (the answers are only known as the turns run)."""

    first_prompt: list[int]
    user_messages: list[list[int]]
    output_lens: list[int]

    @property
    def num_turns(self) -> int:
        return len(self.output_lens)


def make_conversations(num_conversations: int, num_turns: int, seed: int = 0, scale: float = 1.0,
                       output_len: int | None = None) -> list[Conversation]:
    """``num_conversations`` conversations of ``num_turns`` turns (`CONVERSATION_SHAPE` × ``scale``)."""
    if num_turns < 1:
        raise ValueError(f"--num-turns must be at least 1, got {num_turns}")
    _check_override("--output-len", output_len)
    rng = random.Random(f"{MULTI_TURN}-{seed}")
    first, user, answer = (_scaled(*shape, scale) for shape in CONVERSATION_SHAPE)
    return [Conversation(_tokens(rng, rng.randint(*first)),
                         [_tokens(rng, rng.randint(*user)) for _ in range(num_turns - 1)],
                         [output_len or rng.randint(*answer) for _ in range(num_turns)])
            for _ in range(num_conversations)]


def read_jsonl(path: str, rng: random.Random) -> list[RequestSpec]:
    """Requests from a JSONL file; raises ValueError naming the file, and the bad line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except FileNotFoundError:
        raise ValueError(f"--workload {path}: cannot read it: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--workload {path}: cannot read it ({e})") from None
    specs = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{where}: not valid JSON ({e}); trace files are JSON Lines, one request a line") \
                from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: not a JSON object; each line is one request, e.g. "
                             '{"prompt_len": 512, "output_len": 128}')
        if "output_len" not in row or ("prompt" not in row and "prompt_len" not in row):
            raise ValueError(f"{where}: need prompt or prompt_len, and output_len (got keys {sorted(row)})")
        output_len = _trace_length(row, "output_len", where)
        if "prompt" in row:
            spec = RequestSpec(None, output_len, prompt=str(row["prompt"]), kind="file")
            if not spec.prompt:
                raise ValueError(f"{where}: prompt is empty")
        else:
            spec = RequestSpec(_tokens(rng, _trace_length(row, "prompt_len", where)), output_len, kind="file")
        specs.append(spec)
    if not specs:
        raise ValueError(f"{path}: no requests")
    return specs


def _trace_length(row: dict, key: str, where: str) -> int:
    """``row[key]`` as a token count: a whole number from 1 to `MAX_TRACE_TOKENS` (5.0 passes as 5; 2.7,
    true, inf and NaN are refused), else ValueError naming ``where`` (file:line) and the key."""
    value = row[key]
    if isinstance(value, str):          # "5": a number written as a string
        try:
            value = int(value.strip())
        except ValueError:
            raise ValueError(f"{where}: {key} must be a whole number of tokens, got {row[key]!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: {key} must be a whole number of tokens, got {json.dumps(value)}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: {key} must be a finite whole number of tokens, got {value}")
        if not value.is_integer():
            raise ValueError(f"{where}: {key} must be a whole number of tokens, got {value}")
        value = int(value)
    if value < 1:
        raise ValueError(f"{where}: {key} must be at least 1, got {value}")
    if value > MAX_TRACE_TOKENS:
        raise ValueError(f"{where}: {key} is {value:,} tokens, above the limit of {MAX_TRACE_TOKENS:,}")
    return value


def length_stats(values: list[int]) -> dict[str, float]:
    """min / mean / p50 / p90 / max of a list of lengths."""
    s = sorted(values)
    return {"min": s[0], "mean": round(statistics.fmean(s), 1), "p50": s[len(s) // 2],
            "p90": s[min(len(s) - 1, int(0.9 * len(s)))], "max": s[-1]}


def describe(specs: list[RequestSpec]) -> dict[str, dict[str, float]]:
    """The input and output length distributions of a workload (reported with every run)."""
    return {"input_len": length_stats([s.prompt_len for s in specs]),
            "output_len": length_stats([s.output_len for s in specs])}
