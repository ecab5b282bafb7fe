"""The chaos run's requests and their reference outputs.

Every request samples with its own seed (a few are greedy), some end at a stop
string, and each has a deadline. A few are client drills: `cancel` requests are
closed by the client at a random point (a time after sending, or after some
messages), `deadline` requests carry a deadline short enough to expire mid-stream.

The reference is the colocated `engine.Engine` run undisturbed on the same
prompts and parameters: seeded draws are per position, so the cluster owes
exactly these token ids and this text to every request that completes. A stop
string is cut from the middle of the request's own unstopped reference text, so
it ends the request part-way (at its first occurrence, which the second
reference pass finds).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from engine import Engine, EngineArgs, SamplingParams

KINDS = ("normal", "cancel", "deadline")


@dataclass(slots=True)
class ChaosRequest:
    """One request of the run and what the undisturbed run answers to it."""

    index: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kind: str = "normal"                    # normal | cancel | deadline (the client's own drills)
    deadline_s: float = 60.0                # every request has one
    cancel_after_s: float | None = None     # cancel requests: close the call this long after sending ...
    cancel_after_messages: int | None = None    # ... or after this many response messages
    ref_token_ids: tuple[int, ...] = ()
    ref_text: str = ""
    ref_finish_reason: str = ""

    def sampling(self) -> dict:
        """The request's sampling fields as `router.client.build_request` keywords."""
        p = self.params
        return dict(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                    seed=p.seed, stop=list(p.stop) or None, ignore_eos=p.ignore_eos or None)


@dataclass(slots=True)
class WorkloadSettings:
    num_requests: int = 2000
    seed: int = 0
    min_prompt_tokens: int = 8
    max_prompt_tokens: int = 320
    min_output_tokens: int = 8
    max_output_tokens: int = 48
    vocab_low: int = 2                      # prompt token ids in [vocab_low, vocab_high)
    vocab_high: int = 1000
    greedy_fraction: float = 0.15
    stop_fraction: float = 0.4
    cancel_fraction: float = 0.06
    deadline_fraction: float = 0.05
    safety_deadline_s: float = 60.0         # the deadline of every request that is not a deadline drill
    short_deadline_s: tuple[float, float] = (0.05, 1.0)   # the first deadline drill gets the shortest
    cancel_after_s: tuple[float, float] = (0.0, 0.6)


def make_requests(s: WorkloadSettings) -> list[ChaosRequest]:
    """The run's requests, without references yet (`add_references` fills them)."""
    rng = random.Random(s.seed)
    requests = []
    for i in range(s.num_requests):
        length = rng.randint(s.min_prompt_tokens, s.max_prompt_tokens)
        prompt = [rng.randrange(s.vocab_low, s.vocab_high) for _ in range(length)]
        greedy = rng.random() < s.greedy_fraction
        params = SamplingParams(max_tokens=rng.randint(s.min_output_tokens, s.max_output_tokens),
                                temperature=0.0 if greedy else rng.choice((0.7, 1.0)),
                                top_p=rng.choice((1.0, 0.9)), top_k=rng.choice((0, 40)),
                                seed=rng.randrange(1 << 31))
        req = ChaosRequest(i, f"chaos-{s.seed}-{i:05d}", prompt, params, deadline_s=s.safety_deadline_s)
        draw = rng.random()
        if draw < s.cancel_fraction:
            req.kind = "cancel"
            if rng.random() < 0.5:
                req.cancel_after_s = rng.uniform(*s.cancel_after_s)     # queued, prefilling or transferring
            else:
                req.cancel_after_messages = rng.randrange(0, max(1, params.max_tokens // 2))   # mid-stream
        elif draw < s.cancel_fraction + s.deadline_fraction:
            req.kind = "deadline"        # the longest output: the deadline expires before it ends
            first = not any(r.kind == "deadline" for r in requests)
            req.deadline_s = s.short_deadline_s[0] if first else rng.uniform(*s.short_deadline_s)
            req.params.max_tokens = s.max_output_tokens
        requests.append(req)
    return requests


def add_references(requests: list[ChaosRequest], model_dir: str, stop_fraction: float, seed: int = 0,
                   batch: int = 64, progress=None) -> None:
    """Run every request undisturbed on the colocated engine; requests drawn for a stop string get
    one cut from their own reference text, and are run again with it."""
    engine = Engine(EngineArgs(model_dir, dtype="float32", attention="eager", num_blocks=4096))
    _reference_pass(engine, requests, batch, progress, "reference")
    rng = random.Random(seed + 1)
    stopped = []
    for req in requests:
        stop = _stop_string(req.ref_text, rng) if rng.random() < stop_fraction else None
        if stop is not None:
            req.params.stop = (stop,)
            stopped.append(req)
    _reference_pass(engine, stopped, batch, progress, "reference with stop strings")


def _reference_pass(engine: Engine, requests: list[ChaosRequest], batch: int, progress, what: str) -> None:
    for start in range(0, len(requests), batch):
        part = requests[start:start + batch]
        done = engine.generate([r.prompt_token_ids for r in part], [r.params for r in part])
        for req, completion in zip(part, done):
            req.ref_token_ids, req.ref_text = tuple(completion.token_ids), completion.text
            req.ref_finish_reason = completion.finish_reason
        if progress is not None:
            progress(f"{what}: {min(start + batch, len(requests))}/{len(requests)} requests")


def _stop_string(text: str, rng: random.Random) -> str | None:
    """2-4 characters from the middle half of `text`, or None when it is too short or odd."""
    if len(text) < 8:
        return None
    at = rng.randint(len(text) // 4, 3 * len(text) // 4)
    stop = text[at:at + rng.randint(2, 4)]
    if len(stop) < 2 or not stop.strip() or "\ufffd" in stop:
        return None
    return stop
