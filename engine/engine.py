"""The colocated engine: one scheduler, prefill + decode, continuous batching.

A step is three calls: schedule → run → postprocess. The same class serves the
workers: a prefill actor adds requests with ``prefill_only=True`` and ships the
KV blocks of each ``prefilled`` output; a decode actor ``adopt``s blocks written
by the KV receiver and continues decoding.
"""
from __future__ import annotations

import os
import random
import uuid

import torch

from engine import attention_compiled
from engine.block_manager import BlockManager, prompt_block_hashes
from engine.config import ModelConfig
from engine.loader import fingerprint, load_model
from engine.model_runner import ModelRunner
from engine.output import OutputProcessor
from engine.presets import resolve_model
from engine.request import Completion, Request, RequestOutput, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.tokenizer import Tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


ATTENTION_ENV = "PDSERVE_ATTENTION"


def pick_attention(attention: str, device: torch.device) -> str:
    """`auto`: $PDSERVE_ATTENTION when set, else `compiled` on CPU and `eager` elsewhere."""
    if attention == "auto":
        attention = os.environ.get(ATTENTION_ENV) or ("compiled" if device.type == "cpu" else "eager")
    if attention not in ("compiled", "eager"):
        raise ValueError(f"attention must be one of auto, compiled, eager; got {attention!r}")
    return attention


class Engine:
    """Args:
        model: a preset name (`tiny`, `small`) or a Hugging Face model directory.
        dtype: `auto` (bf16 on CUDA, float32 on CPU), `float32` or `bfloat16`.
        block_size: tokens per KV block.
        num_blocks: KV blocks in the pool (default: from `kv_cache_gib`).
        max_num_batched_tokens: per-step token budget shared by prefill chunks and decodes.
        chunk_size: most prompt tokens one request computes per step; None disables chunking.
        max_num_seqs: most requests in the running batch.
        enable_prefix_cache: reuse full blocks of earlier prompts.
        max_model_len: context limit (default: the model's max_position_embeddings).
        attention: decode attention; `compiled` reads K/V through the block table in one
            Inductor kernel (compiled at start-up, a few seconds, cached on disk), `eager`
            gathers the blocks and runs bmm; `auto` = compiled on CPU (eager if it cannot
            compile), eager on CUDA, or $PDSERVE_ATTENTION.
    """

    def __init__(self, model: str = "tiny", *, dtype: str | torch.dtype = "auto", device: str | None = None,
                 block_size: int = 16, num_blocks: int | None = None, kv_cache_gib: float = 1.0,
                 max_num_batched_tokens: int = 2048, chunk_size: int | None = 512, max_num_seqs: int = 64,
                 enable_prefix_cache: bool = True, max_model_len: int | None = None, attention: str = "auto"):
        requested = attention
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = pick_dtype(dtype, self.device)
        attention = pick_attention(attention, self.device)
        self.model_dir = resolve_model(model)
        self.config = ModelConfig.from_dir(self.model_dir)
        cfg = self.config
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.tokenizer = Tokenizer(self.model_dir, cfg.eos_token_ids, cfg.bos_token_id)
        self.vocab_size = cfg.vocab_size
        self.model = load_model(self.model_dir, cfg, self.device, self.dtype, self.max_model_len)
        self.fingerprint = fingerprint(self.model_dir, cfg)
        self.block_size = block_size
        if num_blocks is None:
            per_block = cfg.kv_bytes_per_token(self.dtype.itemsize) * block_size
            num_blocks = max(int(kv_cache_gib * (1 << 30)) // per_block, 1)
        # kv_cache: [num_layers, num_blocks, 2, num_kv_heads, block_size, head_dim]
        self.kv_cache = torch.zeros(cfg.num_hidden_layers, num_blocks, 2, cfg.num_key_value_heads,
                                    block_size, cfg.head_dim, dtype=self.dtype, device=self.device)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_cache)
        self.scheduler = Scheduler(self.block_manager, max_num_batched_tokens, max_num_seqs, chunk_size)
        kernel = None
        if attention == "compiled":
            kernel = attention_compiled.build(self.kv_cache[0], cfg.num_attention_heads)
        if kernel is None and requested == "compiled":
            raise RuntimeError("attention='compiled' was asked for but the kernel cannot be compiled here "
                               "(see the log); use attention='eager'")
        self.attention = "compiled" if kernel is not None else "eager"
        self.runner = ModelRunner(self.model, self.kv_cache, block_size, self.device, kernel)
        self.output = OutputProcessor(self.tokenizer, cfg.eos_token_ids)
        self.requests: dict[str, Request] = {}

    # ---- requests in ----------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field when the request cannot be served."""
        params.validate()
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias)):
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"max_tokens: prompt ({len(prompt_token_ids)} tokens) + max_tokens "
                             f"({params.max_tokens}) = {total} exceeds the context length {self.max_model_len}")

    def _new_request(self, request_id: str | None, prompt, params: SamplingParams, prefill_only: bool,
                     resume_output_ids: list[int] = (), resume_text_chars: int = 0) -> Request:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate(ids, params)
        if len(resume_output_ids) >= params.max_tokens:
            raise ValueError(f"resume_output_ids: {len(resume_output_ids)} tokens already reach max_tokens")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        req = Request(request_id, ids, params, seed, prefill_only=prefill_only)
        req.output_token_ids = list(resume_output_ids)
        self.output.attach(req, resume_text_chars)
        return req

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, prefill_only: bool = False,
                    resume_output_ids: list[int] = (), resume_text_chars: int = 0) -> str:
        """Queue a request. `resume_output_ids`: tokens it already produced elsewhere (migration):
        they are recomputed like after a preemption and generation continues after them, with the
        same seeded draws and penalties as if it had never moved. `resume_text_chars`: how much of
        their text the client already has; the rest (held back for stop strings, or half a UTF-8
        character) is streamed from here, and stop strings are matched across the seam."""
        req = self._new_request(request_id, prompt, params or SamplingParams(), prefill_only, resume_output_ids,
                                resume_text_chars)
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        return req.request_id

    def expect_kv(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, transfer_id: str,
                  deadline: float) -> Request:
        """Decode side: register a request whose prompt KV is on its way here (WAITING_FOR_KV).

        The request is validated now, so a bad one fails before any KV arrives; it joins the
        batch at `adopt` and can be aborted while it waits (it holds no blocks yet).
        """
        req = self._new_request(request_id, prompt_token_ids, params, False)
        req.status = RequestStatus.WAITING_FOR_KV
        req.kv_transfer_id, req.kv_deadline = transfer_id, deadline
        self.requests[req.request_id] = req
        return req

    def adopt(self, request_id: str, first_token_id: int, block_ids: list[int],
              num_cached_tokens: int = 0) -> RequestOutput:
        """Continue a WAITING_FOR_KV request whose prompt KV now sits in `block_ids` (from this pool).

        The blocks become the request's (freed when it ends). Returns the output for
        `first_token_id`, which may already finish the request (EOS, max_tokens == 1).
        Raises ValueError (and takes no blocks) when the blocks cannot hold the prompt.
        """
        req = self.requests[request_id]
        assert req.status is RequestStatus.WAITING_FOR_KV, req.status
        need = (len(req.prompt_token_ids) + self.block_size - 1) // self.block_size
        if len(block_ids) < need:
            raise ValueError(f"block_ids: {len(block_ids)} blocks cannot hold {req.num_prompt_tokens} tokens")
        req.block_table = list(block_ids)
        req.num_computed_tokens = len(req.prompt_token_ids)
        req.num_cached_tokens = num_cached_tokens
        hashes = prompt_block_hashes(req.prompt_token_ids, self.block_size)
        req.block_hashes = hashes
        for block_id, h in zip(block_ids, hashes):
            self.block_manager.register(block_id, h)
        out = self.output.process(req, first_token_id)     # counts the first token; may finish at once
        if req.status.finished:
            self._finish(req)
        else:
            self.scheduler.add_running(req)
        return out

    # ---- the step -------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        sampled, tokens = self.runner.run(batch)
        self.scheduler.commit(batch)
        outputs = []
        for req, token in zip(sampled, tokens):
            out = self.output.process(req, token)
            if req.prefill_only and not req.status.finished:
                req.status = RequestStatus.PREFILLED
                self.scheduler.remove(req)
                out.prefilled = True
                out.block_ids = list(req.block_table)
            elif req.status.finished:
                self._finish(req)
            outputs.append(out)
        return outputs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- requests out ---------------------------------------------------
    def _finish(self, req: Request) -> None:
        self.scheduler.remove(req)
        if req.block_table:
            self.block_manager.free(req.block_table)
            req.block_table = []
        self.requests.pop(req.request_id, None)

    def release(self, request_id: str) -> None:
        """Prefill side: the KV was shipped (or the transfer failed); free the blocks (kept cached)."""
        req = self.requests.get(request_id)
        if req is not None:
            self._finish(req)

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        req.status = RequestStatus.FINISHED_ABORTED
        self._finish(req)
        return RequestOutput(request_id, [], "", "abort", req.num_prompt_tokens, req.num_cached_tokens,
                             len(req.output_token_ids))

    def generate(self, inputs: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[Completion]:
        """Run every input to completion; results in input order."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(inputs)
        ids = [self.add_request(inp, p) for inp, p in zip(inputs, params_list)]
        reqs = {i: self.requests[i] for i in ids}
        texts = {i: [] for i in ids}
        reasons: dict[str, str] = {}
        while len(reasons) < len(ids):
            for out in self.step():
                texts[out.request_id].append(out.text_delta)
                if out.finish_reason:
                    reasons[out.request_id] = out.finish_reason
        return [Completion(i, reqs[i].prompt_token_ids, reqs[i].output_token_ids, "".join(texts[i]),
                           reasons[i], reqs[i].num_cached_tokens) for i in ids]
