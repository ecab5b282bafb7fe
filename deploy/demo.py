"""`pdserve demo`: the embedded cluster, a handful of concurrent requests, a timing summary."""
from __future__ import annotations

import asyncio
import statistics
import time

from deploy.config import PDServeConfig
from engine.latency import time_per_output_token

# The default model (`pydoc`) was trained on the Python 3.11 documentation: prompts in its register.
PROMPTS = [
    "The list type is a mutable sequence, so",
    "To read a file line by line, open it with",
    "A dictionary maps keys to values;",
    "The os.path module implements",
    "Exceptions raised in a generator are",
    "When the interpreter starts, it",
]


async def _one(client, prompt: str, max_tokens: int, seed: int):
    text, first, t0, last = [], None, time.monotonic(), None
    # temperature, top_p, top_k and repetition_penalty: the model's generation_config.json defaults
    async for msg in client.generate(prompt, max_tokens=max_tokens, seed=seed, ignore_eos=True):
        if first is None and msg.token_ids:
            first = time.monotonic() - t0
        text.append(msg.text)
        last = msg
    return prompt, "".join(text), last, time.monotonic() - t0


def run_demo(cfg: PDServeConfig, max_tokens: int = 32) -> int:
    from deploy.running import start_cluster
    from router.client import AsyncGenerationClient

    async def main() -> int:
        print(f"starting the embedded cluster (model {cfg.model.name}, {cfg.pools.prefill.bounds()[0]} prefill "
              f"+ {cfg.pools.decode.bounds()[0]} decode actors, KV over {cfg.kv_transfer.transport}/"
              f"{cfg.kv_transfer.compression}) ...", flush=True)
        cluster = await start_cluster(cfg, port=0)
        try:
            await cluster.server.wait_ready(120)
            print(f"serving on {cluster.address}; sending {len(PROMPTS)} concurrent requests\n", flush=True)
            token = cfg.security.token.get_secret_value() if cfg.security.token else None
            async with AsyncGenerationClient(cluster.address, token=token) as client:
                results = await asyncio.gather(*(_one(client, p, max_tokens, 7 + i) for i, p in enumerate(PROMPTS)))
            ttfts, tpots = [], []
            for prompt, text, last, e2e in results:
                t, u = last.timing, last.usage
                tpot = time_per_output_token(t.ttft_s, t.e2e_s, u.completion_tokens)
                ttfts.append(t.ttft_s)
                tpots.append(tpot)
                print(f"> {prompt}\n  {text!r}")
                print(f"  {u.prompt_tokens} prompt + {u.completion_tokens} tokens | queue {t.queue_s * 1e3:.0f} ms, "
                      f"prefill {t.prefill_s * 1e3:.0f} ms, KV transfer {t.kv_transfer_s * 1e3:.1f} ms, decode "
                      f"queue {t.decode_queue_s * 1e3:.1f} ms, TTFT {t.ttft_s * 1e3:.0f} ms, TPOT "
                      f"{tpot * 1e3:.1f} ms\n")
            print(f"TTFT p50 {statistics.median(ttfts) * 1e3:.0f} ms, max {max(ttfts) * 1e3:.0f} ms | "
                  f"TPOT p50 {statistics.median(tpots) * 1e3:.1f} ms, max {max(tpots) * 1e3:.1f} ms")
            return 0
        finally:
            await cluster.stop()
            print("cluster stopped")
    return asyncio.run(main())
