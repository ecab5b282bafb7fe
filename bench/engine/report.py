"""Tables for `bench.engine`: the measured figures beside their peers, and the targets PASS/MISS."""
from __future__ import annotations

# (name, figure, goal text, passes?) — the engine's targets.
TARGETS = [
    ("prefill 512: time vs HF", lambda r: r["prefill"]["512"]["ratio"], "<= 1.10x HF", lambda v: v <= 1.10),
    ("prefill 2048: time vs HF", lambda r: r["prefill"]["2048"]["ratio"], "<= 1.10x HF", lambda v: v <= 1.10),
    ("prefill 2048: of matmul peak",
     lambda r: r["prefill"]["2048"]["ours_flop_per_s"] / r["machine"]["matmul"]["flop_per_s"], ">= 80%",
     lambda v: v >= 0.80),
    ("decode batch 1: of memcpy bandwidth",
     lambda r: r["decode"]["1"]["ours_bytes_per_s"] / r["machine"]["memcpy"]["bytes_per_s"], ">= 50%",
     lambda v: v >= 0.50),
    ("decode batch 1: step vs HF", lambda r: r["decode"]["1"]["ratio"], "<= 1.10x HF", lambda v: v <= 1.10),
    ("decode batch 32: step vs HF", lambda r: r["decode"]["32"]["ratio"], "<= 1.10x HF", lambda v: v <= 1.10),
    ("workload: throughput vs HF static", lambda r: r["workload"]["speedup"], ">= 2.00x HF", lambda v: v >= 2.0),
]


def check_targets(result: dict) -> list[dict]:
    out = []
    for name, figure, goal, ok in TARGETS:
        try:
            value = figure(result)
        except KeyError:                      # a part not measured (e.g. other prefill lengths)
            continue
        out.append({"target": name, "value": value, "goal": goal, "pass": bool(ok(value))})
    return out


def _fmt_target(t: dict) -> str:
    return f"{t['value']:.0%}" if "%" in t["goal"] else f"{t['value']:.2f}x"


def rows(result: dict) -> tuple[list[str], list[list[str]]]:
    """The measurement table: one row per figure, ours beside HF and the machine limit."""
    m = result["machine"]
    peak, bw = m["matmul"]["flop_per_s"], m["memcpy"]["bytes_per_s"]
    head = ["figure", "ours", "HF", "ours/HF time", "ours of limit"]
    body = [["machine: matmul peak (GEMM %d²)" % m["matmul"]["size"], f"{peak / 1e9:.0f} GFLOP/s", "", "", ""],
            ["machine: memcpy (bytes copied/s, %d MiB)" % (m["memcpy"]["bytes"] >> 20), f"{bw / 1e9:.1f} GB/s",
             "", "", "read+write %.1f GB/s" % (2 * bw / 1e9)]]
    for seq_len, p in result["prefill"].items():
        body.append([f"prefill {p['tokens']} tok: tok/s (ms)",
                     f"{p['ours_tokens_per_s']:.0f} ({p['ours_s'] * 1e3:.0f})",
                     f"{p['hf_tokens_per_s']:.0f} ({p['hf_s'] * 1e3:.0f})", f"{p['ratio']:.2f}x",
                     f"{p['ours_flop_per_s'] / 1e9:.0f} GFLOP/s = {p['ours_flop_per_s'] / peak:.0%}"])
    for batch, d in result["decode"].items():
        body.append([f"decode batch {batch}, ctx {result['decode'][batch]['context']:.0f}: ms/step",
                     f"{d['ours_s'] * 1e3:.1f}", f"{d['hf_s'] * 1e3:.1f}", f"{d['ratio']:.2f}x",
                     f"{d['ours_bytes_per_s'] / 1e9:.1f} GB/s = {d['ours_bytes_per_s'] / bw:.0%}"
                     f" (HF {d['hf_bytes_per_s'] / bw:.0%})"])
    w = result["workload"]
    body.append([f"workload {w['num_requests']} req: useful tok/s (s)",
                 f"{w['ours_tokens_per_s']:.1f} ({w['ours_s']:.1f})", f"{w['hf_tokens_per_s']:.1f} ({w['hf_s']:.1f})",
                 f"{w['ours_s'] / w['hf_s']:.2f}x", ""])
    return head, body


def table(head: list[str], body: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in body])


def target_rows(result: dict) -> tuple[list[str], list[list[str]]]:
    return (["target", "measured", "goal", "result"],
            [[t["target"], _fmt_target(t), t["goal"], "PASS" if t["pass"] else "MISS"] for t in result["targets"]])


def _title(result: dict) -> str:
    w = result["workload"]
    return (f"pdserve engine vs Hugging Face: model {result['model']}, {result['dtype']}, "
            f"{result['torch_threads']} torch threads, {result.get('attention', 'eager')} decode attention, "
            f"{result.get('weight_layout', 'row-major')} weights, torch {result['torch_version']}, "
            f"load average {result['load_average_start']:.1f} -> {result['load_average_end']:.1f}"
            + (" (quick)" if result["quick"] else "")
            + f"\nworkload: {w['num_requests']} requests, prompts {w['prompt_lens'][0]}-{w['prompt_lens'][1]} tok, "
              f"outputs {w['output_lens'][0]}-{w['output_lens'][1]} tok, {w['useful_tokens']} useful tokens; "
              f"{w['identical_outputs']}/{w['num_requests']} outputs token-identical to HF")


def render_text(result: dict) -> str:
    return "\n\n".join([_title(result), table(*rows(result)), table(*target_rows(result))])


def markdown_table(head: list[str], body: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in body])


def render_markdown(result: dict) -> str:
    return "\n\n".join([_title(result).replace("\n", "  \n"), markdown_table(*rows(result)),
                        markdown_table(*target_rows(result))]) + "\n"
