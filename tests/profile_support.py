"""A synthetic profile with exact numbers, shared by the planner, profiler and `pdserve plan` tests."""
from __future__ import annotations

from engine.cost_model import ModelCosts

COSTS = ModelCosts(num_layers=4, hidden_size=256, attn_dim=256, layer_params=2_000_000, head_params=250_000,
                   weight_bytes=9_000_000, kv_bytes_per_token=4096, dtype_bytes=4)


def synthetic(flops_per_s: float = 1e10, step=lambda b, c: 0.01 + 0.001 * b + 1e-6 * b * c) -> dict:
    """Prefill at a constant FLOP/s; decode step time linear in batch (exact under interpolation)."""
    engine = {"costs": COSTS.to_dict()}
    prefill = [{"prompt_len": s, "seconds": COSTS.prefill_flops(s) / flops_per_s, "flops": COSTS.prefill_flops(s),
                "flops_per_s": flops_per_s} for s in (128, 512, 2048)]
    decode = [{"batch": b, "context": c, "seconds": step(b, c), "bytes": COSTS.decode_bytes(b, c),
               "bytes_per_s": COSTS.decode_bytes(b, c) / step(b, c)}
              for c in (128, 1024, 2048) for b in (1, 4, 16, 64, 256)]
    return {"version": 1, "source": "synthetic", "prefill": {"engine": engine, "points": prefill},
            "decode": {"engine": engine, "points": decode}}


def with_degree(profile: dict, degree: int, pools: tuple[str, ...] = ("prefill", "decode"),
                flops_per_s: float = 1e10, step=lambda b, c: 0.01 + 0.001 * b + 1e-6 * b * c) -> dict:
    """`profile` with `pools` also measured at tensor-parallel `degree` (the `"degrees"` section that
    `pdserve profile --tp` writes), at `flops_per_s` and `step`."""
    measured = synthetic(flops_per_s, step)
    degrees = dict(profile.get("degrees") or {})
    degrees[str(degree)] = {pool: measured[pool] for pool in pools}
    return {**profile, "degrees": degrees}


def with_speculation(profile: dict, step, method: str = "ngram", num_tokens: int = 4,
                     acceptance: float | None = None) -> dict:
    """`profile` with the speculative section `pdserve profile` writes with `speculative.method` on: its decode
    points again at `num_tokens` proposals per sequence, timed by `step(b, c)`, and the acceptance measured
    on held-out text (None: the model has none)."""
    points = [{**p, "seconds": step(p["batch"], p["context"]), "num_tokens": num_tokens}
              for p in profile["decode"]["points"]]
    measured = None if acceptance is None else {"ratio": acceptance, "num_tokens": num_tokens, "proposed": 1000,
                                                "accepted": round(1000 * acceptance), "prompts": 8,
                                                "temperature": 0.0}
    return {**profile, "speculative": {"method": method, "num_tokens": num_tokens, "adaptive": True,
                                       "points": points, "acceptance": measured}}
