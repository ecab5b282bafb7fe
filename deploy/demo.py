"""`pdserve demo`: the embedded cluster, a handful of concurrent requests, what happened to each.

The tour, top to bottom: one line per start-up phase; each prompt with its completion as text; a
table of each request's stages (the router's per-request timeline, router/timing.py, grouped into
`TTFT_PARTS`) and its legend; TTFT and TPOT, p50 and max. What the cluster logs besides —
its actors' output, the router's and Ray's log records — goes to a log file whose path it prints
(deploy/demo_log.py); ``verbose`` streams all of it to the terminal instead, as Ray forwards it.
No colour codes: the tour reads the same on a terminal, in a pipe and in a CI log.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import sys
import textwrap
import time
from dataclasses import dataclass

from deploy.config import PDServeConfig
from engine.latency import time_per_output_token
from proto.pdserve.v1 import generation_pb2 as pb

# The default model (`pydoc`) was trained on the Python 3.11 documentation: prompts in its register.
PROMPTS = [
    "The list type is a mutable sequence, so",
    "To read a file line by line, open it with",
    "A dictionary maps keys to values;",
    "The os.path module implements",
    "Exceptions raised in a generator are",
    "When the interpreter starts, it",
]
FIRST_SEED = 7

# The timeline's stages (router/timing.py STAGES) as the table's columns: together they are the TTFT.
TTFT_PARTS = (
    ("queue", ("router_queue_s", "prefill_queue_s")),
    ("prefill", ("prefill_compute_s", "sampling_s")),
    ("KV", ("kv_encode_s", "kv_send_s", "kv_receive_s", "adopt_s")),
    ("other", ("intake_s", "dispatch_s", "first_event_s", "transit_s", "unaccounted_s")),
)
HEADER = ("req", "in", "out", *(name for name, _ in TTFT_PARTS), "TTFT", "dec-q", "TPOT", "E2E")
# What each column holds, one line of text (render_legend wraps it to the terminal).
LEGEND = ("legend: times in ms; TTFT = time to first token = queue + prefill + KV + other; queue = wait for "
          "admission and a prefill slot; prefill = prompt pass; KV = KV-cache handoff; other = RPC hops; dec-q = "
          "wait for a decode batch; TPOT = time per output token after the first; E2E = whole request; in/out = "
          "prompt/generated tokens")
GUTTER = "    | "
MAX_WIDTH = 100


@dataclass(frozen=True, slots=True)
class Completion:
    """One demo request as the client saw it: its prompt, the text streamed back, the last message's figures."""

    prompt: str
    text: str
    usage: pb.Usage
    timing: pb.Timing


@dataclass(frozen=True, slots=True)
class StageRow:
    """One request's row of the stage table, in seconds; ``parts_s`` follows TTFT_PARTS (None: no timeline)."""

    num_prompt_tokens: int
    num_output_tokens: int
    parts_s: tuple[float, ...] | None
    ttft_s: float
    decode_queue_s: float
    tpot_s: float
    e2e_s: float

    @classmethod
    def of(cls, usage: pb.Usage, timing: pb.Timing) -> StageRow:
        parts = None
        if timing.HasField("timeline"):
            parts = tuple(sum(getattr(timing.timeline, stage) for stage in stages) for _, stages in TTFT_PARTS)
        return cls(usage.prompt_tokens, usage.completion_tokens, parts, timing.ttft_s, timing.decode_queue_s,
                   time_per_output_token(timing.ttft_s, timing.e2e_s, usage.completion_tokens), timing.e2e_s)

    def cells(self, index: int) -> tuple[str, ...]:
        parts = [f"{s * 1e3:.1f}" for s in self.parts_s] if self.parts_s is not None else ["-"] * len(TTFT_PARTS)
        return (f"[{index}]", str(self.num_prompt_tokens), str(self.num_output_tokens), *parts,
                *(f"{s * 1e3:.1f}" for s in (self.ttft_s, self.decode_queue_s, self.tpot_s, self.e2e_s)))


def printable(text: str) -> str:
    """``text`` safe for a terminal: tabs expanded, any other control character (an escape that would
    recolour it, a carriage return) shown as ``\\xNN``; newlines stay newlines."""
    return "".join(c if c.isprintable() or c == "\n" else f"\\x{ord(c):02x}" for c in text.expandtabs(4))


def render_completion(index: int, prompt: str, text: str, width: int = MAX_WIDTH) -> str:
    """The prompt on one line, then the generated text as text: each of its lines behind a gutter,
    long ones wrapped at ``width`` with their indentation kept."""
    lines = printable(text).rstrip().split("\n")
    out = [f"[{index}] {printable(prompt)}"]
    for line in lines:
        line = line.rstrip()
        body = line.lstrip()
        indent = line[:len(line) - len(body)]
        wrapped = textwrap.wrap(body, max(width - len(GUTTER), 20), initial_indent=indent, subsequent_indent=indent,
                                break_on_hyphens=False) or [""]
        out.extend(f"{GUTTER}{part}".rstrip() for part in wrapped)
    return "\n".join(out)


def render_table(rows: list[StageRow]) -> str:
    """The header and one right-aligned row per request."""
    cells = [HEADER, *(row.cells(i) for i, row in enumerate(rows, 1))]
    widths = [max(len(r[col]) for r in cells) for col in range(len(HEADER))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in cells)


def render_summary(rows: list[StageRow]) -> str:
    ttfts, tpots = [r.ttft_s for r in rows], [r.tpot_s for r in rows]
    return (f"TTFT p50 {statistics.median(ttfts) * 1e3:.0f} ms, max {max(ttfts) * 1e3:.0f} ms | "
            f"TPOT p50 {statistics.median(tpots) * 1e3:.1f} ms, max {max(tpots) * 1e3:.1f} ms")


def render_legend(width: int = MAX_WIDTH) -> str:
    """LEGEND wrapped at ``width``, never between a term and its ``=``."""
    glued = LEGEND.replace(" = ", "\xa0=\xa0")        # textwrap breaks at ASCII whitespace only
    return textwrap.fill(glued, width, subsequent_indent=" " * len("legend: "), break_on_hyphens=False,
                         break_long_words=False).replace("\xa0", " ")


def render_report(completions: list[Completion], width: int = MAX_WIDTH) -> str:
    """Everything the demo prints about its requests: completions, stage table, legend, summary."""
    rows = [StageRow.of(c.usage, c.timing) for c in completions]
    texts = "\n\n".join(render_completion(i, c.prompt, c.text, width) for i, c in enumerate(completions, 1))
    return f"{texts}\n\n{render_table(rows)}\n{render_legend(width)}\n\n{render_summary(rows)}"


async def _one(client, prompt: str, max_tokens: int, seed: int) -> Completion:
    text, last = [], None
    # temperature, top_p, top_k and repetition_penalty: the model's generation_config.json defaults
    async for msg in client.generate(prompt, max_tokens=max_tokens, seed=seed, ignore_eos=True):
        text.append(msg.text)
        last = msg
    return Completion(prompt, "".join(text), last.usage, last.timing)


def _say(line: str) -> None:
    print(line, flush=True)


def run_demo(cfg: PDServeConfig, max_tokens: int = 32, verbose: bool = False) -> int:
    """Start the cluster ``cfg`` describes, send PROMPTS at once, print the tour, stop. Returns 0.

    ``verbose``: the actors' output and every log record stream to the terminal (Ray forwards them)
    instead of going to the log file.
    """
    from deploy.demo_log import DemoLog, default_path, ray_logs_dir
    from deploy.launcher import init_ray_for
    from deploy.running import start_cluster
    from router.client import AsyncGenerationClient

    num_prefill, num_decode = cfg.pools.prefill.bounds()[0], cfg.pools.decode.bounds()[0]
    width = min(shutil.get_terminal_size((MAX_WIDTH, 24)).columns, MAX_WIDTH)
    if not sys.stdout.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")       # what Ray forwards (verbose), uncoloured

    async def main(log: DemoLog | None) -> int:
        _say(f"- starting Ray ({f'joining {cfg.ray.address}' if cfg.ray.address else 'a local instance on 127.0.0.1'})"
             " ...")
        init_ray_for(cfg, log_to_driver=verbose)     # start_cluster's own call then finds Ray started
        if log is not None:
            log.follow(ray_logs_dir())
        _say(f"- starting {num_prefill} prefill + {num_decode} decode actors and the router (loading the model; "
             "a first start also compiles kernels) ...")
        started = time.monotonic()
        cluster = await start_cluster(cfg, port=0)
        try:
            await cluster.server.wait_ready(120)
            _say(f"- model ready in {time.monotonic() - started:.1f} s; the router serves gRPC on {cluster.address}")
            _say(f"- sending {len(PROMPTS)} requests at once, {max_tokens} tokens each ...\n")
            token = cfg.security.token.get_secret_value() if cfg.security.token else None
            async with AsyncGenerationClient(cluster.address, token=token) as client:
                completions = await asyncio.gather(*(_one(client, p, max_tokens, FIRST_SEED + i)
                                                     for i, p in enumerate(PROMPTS)))
            _say(render_report(list(completions), width) + "\n")
            return 0
        finally:
            await cluster.stop()
            _say("cluster stopped")

    _say(f"pdserve demo: model {cfg.model.name}, {num_prefill} prefill + {num_decode} decode actors, "
         f"KV cache over {cfg.kv_transfer.transport}/{cfg.kv_transfer.compression}")
    if verbose:
        return asyncio.run(main(None))
    with DemoLog(default_path()) as log:
        _say(f"- logs of the actors, the router and Ray: {log.path} (pdserve demo --verbose prints them here)")
        return asyncio.run(main(log))
