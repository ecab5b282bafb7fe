"""Per-token postprocessing: append, detokenize, check EOS / stop token ids / max_tokens / stop strings.

Stopping: an EOS id (unless ignore_eos) or one of stop_token_ids ends a sequence
with "stop" and `matched_stop` = that id; the token stays in the output ids. A
stop token's text follows skip_special_tokens; an EOS's text is left out unless
include_stop_str_in_output. A stop string ends it with `matched_stop` = the string,
cut from the text unless include_stop_str_in_output. Until the sequence has
min_tokens output tokens none of these ends it (max_tokens still does).
"""
from __future__ import annotations

import time
from collections.abc import Collection

from engine.scheduling.request import Request, RequestOutput, RequestStatus
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from proto.pdserve.v1 import generation_pb2 as pb


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Collection[int]):
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)

    def attach(self, req: Request, num_emitted_chars: int = 0) -> None:
        """Give `req` its detokenizer. A migrated request (output tokens already set) gets the
        detokenizer state and text its first actor had, by replaying those tokens, and resumes
        streaming after the `num_emitted_chars` characters the client already has."""
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.params.skip_special_tokens)
        for token in req.output_token_ids:
            req.text += req.detokenizer.push(token)
        req.num_emitted_chars = min(num_emitted_chars, len(req.text))

    def process(self, req: Request, token: int, logprob: pb.TokenLogprob | None = None) -> RequestOutput:
        """Append one sampled token (and its logprob, when computed); returns the step's output for the sequence."""
        p = req.params
        output = req.output_token_ids
        output.append(token)
        num_output = len(output)
        if logprob is not None:
            req.cumulative_logprob += logprob.logprob
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        may_stop = num_output >= p.min_tokens
        is_stop_id = may_stop and token in p.stop_token_ids
        is_eos = may_stop and not is_stop_id and token in self.eos and not p.ignore_eos
        detokenizer = req.detokenizer
        if is_eos or is_stop_id:
            req.status = RequestStatus.FINISHED_STOPPED
            req.matched_stop = token
            keep_text = is_stop_id or p.include_stop_str_in_output
            delta = (detokenizer.push(token) if keep_text else "") + detokenizer.flush()
        else:
            delta = detokenizer.push(token)
        finished = req.status.finished
        if num_output >= p.max_tokens and not finished:
            req.status = RequestStatus.FINISHED_LENGTH
            finished = True
            delta += detokenizer.flush()
        if delta:
            req.text += delta
            if p.stop and may_stop:
                self._check_stop(req, len(delta))
                finished = req.status.finished
        # Hold back a possible stop-string prefix until the request finishes.
        hold = max(map(len, p.stop)) - 1 if p.stop and not finished else 0
        end = max(len(req.text) - hold, req.num_emitted_chars)
        text_delta = req.text[req.num_emitted_chars:end]
        req.num_emitted_chars = end
        finish = req.status.value if finished else None
        # (positional, in RequestOutput's field order: one is built per sequence per step)
        return RequestOutput(req.request_id, [token], text_delta, finish, req.num_prompt_tokens,
                             req.num_cached_tokens, num_output, False, [], req.first_scheduled_time, req.index,
                             None if logprob is None else [logprob],
                             None, req.matched_stop if finish == "stop" else None,
                             req.num_spec_proposed, req.num_spec_accepted)

    @staticmethod
    def _check_stop(req: Request, delta_len: int) -> None:
        """Search only the tail that the new text can complete: never the whole output."""
        best, matched = -1, None
        for stop in req.params.stop:
            start = max(0, len(req.text) - delta_len - len(stop) + 1)
            at = req.text.find(stop, start)
            if at != -1 and (best == -1 or at < best):
                best, matched = at, stop
        if best != -1:
            keep = best + len(matched) if req.params.include_stop_str_in_output else best
            req.text = req.text[:keep]
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = "stop_string"
            req.matched_stop = matched


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """One output for the tokens a sequence took in one step (speculative decoding takes several), in order."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    last.new_token_ids = [t for out in outputs for t in out.new_token_ids]
    last.text_delta = "".join(out.text_delta for out in outputs)
    if last.logprobs is not None:
        last.logprobs = [lp for out in outputs for lp in out.logprobs or ()]
    last.first_scheduled_time = outputs[0].first_scheduled_time
    return last
