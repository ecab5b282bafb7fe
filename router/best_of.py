"""best_of selection, shared by both front doors: generate ``best_of`` sequences, return the best ``n``.

With ``best_of > n`` the backend generates ``best_of`` interleaved sequences (each with logprobs,
so that they can be ranked). `select_best` collects them all, ranks them by cumulative logprob
(the sum of the sampled tokens' logprobs), keeps the ``n`` best, renumbers them 0..n-1 (0 = best)
and yields each kept sequence as one merged chunk, after every sequence finished. Nothing is
streamed before that: the ranking needs every sequence's end (as OpenAI: best_of is not streamed).
"""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from proto.pdserve.v1 import generation_pb2 as pb
from router.backend import GenerationChunk, Usage
from router.timing import Timing


def needs_selection(n: int, best_of: int | None) -> bool:
    """True when more sequences are generated than returned."""
    return best_of is not None and best_of > n


@dataclass(slots=True)
class _Sequence:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: int | None = None          # a pb.FinishReason
    matched_stop: str | int | None = None


async def select_best(chunks: AsyncIterator[GenerationChunk], n: int,
                      keep_logprobs: bool) -> AsyncIterator[GenerationChunk]:
    """Collect every sequence of ``chunks``, then yield the ``n`` with the highest cumulative logprob.

    Args:
        chunks: a request's interleaved chunks (every sequence ends with a finish_reason).
        n: how many sequences to return.
        keep_logprobs: False strips the per-token logprobs (the client did not ask for them;
            the engine computed them only for the ranking).

    Yields:
        One chunk per kept sequence, ``index`` 0 (best) .. n-1; ties go to the lower original index.
        The first carries the request's ``prompt_logprobs``, the last its ``usage`` and ``timing``.
    """
    sequences: dict[int, _Sequence] = {}
    prompt_logprobs: list[pb.TokenLogprob] | None = None
    usage: Usage | None = None
    timing: Timing | None = None
    async with contextlib.aclosing(chunks) as stream:
        async for chunk in stream:
            seq = sequences.setdefault(chunk.index, _Sequence(chunk.index))
            seq.token_ids.extend(chunk.token_ids)
            seq.text.append(chunk.text)
            if chunk.logprobs:
                seq.logprobs.extend(chunk.logprobs)
                seq.cumulative_logprob += sum(lp.logprob for lp in chunk.logprobs)
            if chunk.finish_reason is not None:
                seq.finish_reason, seq.matched_stop = chunk.finish_reason, chunk.matched_stop
            if chunk.prompt_logprobs is not None:
                prompt_logprobs = chunk.prompt_logprobs
            usage = chunk.usage or usage
            timing = chunk.timing or timing
    ranked = sorted(sequences.values(), key=lambda s: (-s.cumulative_logprob, s.index))[:n]
    for new_index, seq in enumerate(ranked):
        last = new_index == len(ranked) - 1
        yield GenerationChunk(
            token_ids=seq.token_ids, text="".join(seq.text), finish_reason=seq.finish_reason,
            usage=usage if last else None, timing=timing if last else None, index=new_index,
            logprobs=seq.logprobs if keep_logprobs else None,
            prompt_logprobs=prompt_logprobs if new_index == 0 else None, matched_stop=seq.matched_stop,
        )
