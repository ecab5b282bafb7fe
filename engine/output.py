"""Per-token postprocessing: append, detokenize, check EOS / max_tokens / stop strings."""
from __future__ import annotations

import time

from engine.request import Request, RequestOutput, RequestStatus
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)

    def attach(self, req: Request, num_emitted_chars: int = 0) -> None:
        """Give `req` its detokenizer. A migrated request (output tokens already set) gets the
        detokenizer state and text its first actor had, by replaying those tokens, and resumes
        streaming after the `num_emitted_chars` characters the client already has."""
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids)
        for token in req.output_token_ids:
            req.text += req.detokenizer.push(token)
        req.num_emitted_chars = min(num_emitted_chars, len(req.text))

    def process(self, req: Request, token: int) -> RequestOutput:
        """Append one sampled token; returns the step's output for the request."""
        p = req.params
        req.output_token_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        is_eos = token in self.eos and not p.ignore_eos
        if is_eos:
            req.status = RequestStatus.FINISHED_STOPPED
            delta = req.detokenizer.flush()
        else:
            delta = req.detokenizer.push(token)
        if len(req.output_token_ids) >= p.max_tokens and not req.status.finished:
            req.status = RequestStatus.FINISHED_LENGTH
            delta += req.detokenizer.flush()
        req.text += delta
        if p.stop and delta:
            self._check_stop(req, len(delta))
        # Hold back a possible stop-string prefix until the request finishes.
        hold = 0 if req.status.finished else max((len(s) for s in p.stop), default=1) - 1
        end = max(len(req.text) - hold, req.num_emitted_chars)
        text_delta = req.text[req.num_emitted_chars:end]
        req.num_emitted_chars = end
        finish = req.status.value if req.status.finished else None
        return RequestOutput(req.request_id, [token], text_delta, finish, req.num_prompt_tokens,
                             req.num_cached_tokens, len(req.output_token_ids),
                             first_scheduled_time=req.first_scheduled_time)

    @staticmethod
    def _check_stop(req: Request, delta_len: int) -> None:
        """Search only the tail that the new text can complete: never the whole output."""
        best = -1
        for stop in req.params.stop:
            start = max(0, len(req.text) - delta_len - len(stop) + 1)
            at = req.text.find(stop, start)
            if at != -1 and (best == -1 or at < best):
                best = at
        if best != -1:
            req.text = req.text[:best]
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = "stop_string"
