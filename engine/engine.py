"""The colocated engine: one scheduler, prefill + decode, continuous batching.

A step is three calls: schedule → run → postprocess. The same class serves the
workers: a prefill actor adds requests with ``prefill_only=True`` and ships the
KV blocks of each ``prefilled`` output; a decode actor ``adopt``s blocks written
by the KV receiver and continues decoding.

n > 1 (``params.num_sequences`` sequences): the prompt is prefilled once, by
sequence 0. At the step its prompt completes, every sequence's first token is
drawn from that one logits row (sequence i with ``child_seed(seed, i)``); then
the request forks: sequence i > 0 shares the prompt's full blocks (a reference
each) and gets its own copy of the partial last block, and decodes on its own
(preempted and recomputed alone). A prefill-only request does not fork: each
sequence's first token goes out with the prompt's blocks, and the decode side's
``adopt`` forks. ``requests[request_id]`` is sequence 0 until every sequence ended.

Structured output (``params.structured``): the spec is validated when the request comes in
(``add_request`` / ``expect_kv`` raise ValueError naming the problem) and compiled on a background
thread; the scheduler holds the request until its grammar is ready. Every sequence has its own
matcher, which consumes the sequence's output tokens it has not seen before each mask: a request
adopted, forked or resumed elsewhere (migration) replays the tokens drawn before; a preempted one
keeps its output, and with it its matcher (engine/sampling/grammar.py).

Speculative decoding (``args.speculative``, engine/spec): before each step the speculator proposes
tokens for the decoding sequences; the step computes them after each one's last token, and the
sequence keeps the accepted prefix plus the target's own next token (its output is then several
tokens in one `RequestOutput`); the scheduler rolls the rejected tokens' KV back.
"""
from __future__ import annotations

import logging
import os
import random
import time
import uuid
from concurrent import futures

import torch

from engine.args import EngineArgs
from engine.kv_cache import memory_budget
from engine.kv_cache.block_manager import BlockManager, prompt_block_hashes
from engine.kv_cache.events import KVEventLog
from engine.kv_cache.kv_format import KVFormat
from engine.kv_cache.prompt_kv import Roundtrip, roundtrip_prompt_blocks, zero_prompt_tails
from engine.kv_cache.tiers import KVTiers, Onboarding
from engine.model import attention_compiled, attention_flex, kernel_choice
from engine.model.config import ModelConfig
from engine.model.loader import fingerprint, load_model
from engine.output.processor import OutputProcessor, merge_outputs
from engine.parallel.tensor_parallel import TensorParallel
from engine.runner.decode_graphs import DecodeGraphs
from engine.runner.layer_hook import LayerHook
from engine.runner.model_runner import ModelRunner
from engine.sampling.generation_config import GenerationConfig
from engine.sampling.grammar import GrammarCompiler, SequenceGrammar
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import child_seed, sample, token_logprobs
from engine.scheduling.request import Completion, Request, RequestOutput, RequestStatus
from engine.scheduling.scheduler import Scheduler
from engine.spec.draft import DraftModel
from engine.spec.speculator import Speculator
from engine.spec.verify import accept

log = logging.getLogger(__name__)
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
GRAMMAR_WAIT_S = 0.005      # an idle step with grammars compiling waits this long for one (never longer)
PREFETCH_WAIT_S = 0.5       # expect_kv waits this long for tier blocks loading since the router asked (then reads)


ATTENTION_MODES = ("compiled", "eager", "flex", "flex-eager")


def pick_attention(attention: str, device: torch.device) -> str:
    """`auto`: $PDSERVE_ATTENTION when set, else `compiled` on CPU and `flex` on CUDA."""
    if attention == "auto":
        attention = os.environ.get(ATTENTION_ENV) or ("compiled" if device.type == "cpu" else "flex")
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of auto, {', '.join(ATTENTION_MODES)}; got {attention!r}")
    return attention


class CachedPrefixLost(ValueError):
    """The prefix blocks a request was told to take from the cache are no longer all cached."""


class Engine:
    """The colocated engine, built from one `EngineArgs` (see there for every setting)."""

    def __init__(self, args: EngineArgs | None = None):
        args = args or EngineArgs()
        if args.torch_threads:
            torch.set_num_threads(args.torch_threads)
        self.args = args
        block_size, num_blocks = args.block_size, args.num_blocks
        max_num_batched_tokens, max_num_seqs = args.max_num_batched_tokens, args.max_num_seqs
        chunk_size = args.chunk_size
        requested = args.attention
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = pick_dtype(args.dtype, self.device)
        attention = pick_attention(requested, self.device)
        self.model_dir = args.model_dir()
        self.config = ModelConfig.from_dir(self.model_dir)
        cfg = self.config
        self.max_model_len = args.context_length(cfg)
        self.generation_config = GenerationConfig.from_dir(self.model_dir)
        self.tokenizer = args.load_tokenizer(cfg, self.generation_config)
        self.eos_token_ids = self.tokenizer.eos_token_ids
        self.vocab_size = cfg.vocab_size
        # this process's rank of the actor's tensor-parallel group (degree 1: the whole model, no group)
        self.tp = TensorParallel(cfg, args.tensor_parallel, args.tensor_parallel_rank, args.tensor_parallel_address,
                                 self.device, args.tensor_parallel_timeout_s, args.quantization,
                                 args.tensor_parallel_backend)
        shard = self.tp.shard
        self.model = load_model(self.model_dir, cfg, self.device, self.dtype, self.max_model_len,
                                args.quantization, args.quantization_group_size,
                                quantize_lm_head=args.quantize_lm_head, shard=shard, reduce=self.tp.group.all_reduce)
        self.config = self.model.cfg       # as loaded (a tied head stored different from the embedding: untied)
        self.quantization = self.model.quantization       # none | int8 | int4 (a quantized checkpoint: int4)
        # Of the directory's weights, not of how they are stored: a decode actor running int4 and a
        # prefill actor running unquantized share it, and the KV handshake admits them (docs/engine.md).
        self.fingerprint = fingerprint(self.model_dir, cfg)
        self.block_size = block_size
        # how the cache stores K/V: the model dtype, or fp8 / int8 cells with scales (engine/kv_cache/kv_format.py)
        self.kv_format = KVFormat(args.kv_cache_dtype, cfg.num_hidden_layers, shard.num_kv_heads, block_size,
                                  cfg.head_dim, self.dtype)
        self.kv_budget: memory_budget.KVBudget | None = None    # the device's budget table (CUDA only)
        if args.kv_memory_fraction is not None and self.device.type == "cuda":
            self.kv_budget = memory_budget.measure_kv_budget(
                self.model, cfg, device=self.device, dtype=self.dtype, block_size=block_size,
                fraction=args.kv_memory_fraction, max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs, chunk_size=chunk_size, max_model_len=self.max_model_len,
                bytes_per_block=self.kv_format.bytes_per_block)
            num_blocks = self.kv_budget.num_blocks
        elif num_blocks is None:
            num_blocks = max(int(args.kv_cache_gib * (1 << 30)) // self.kv_format.bytes_per_block, 1)
        # kv_cache: [num_layers, num_blocks, 2, num_kv_heads, block_size, head_dim] (fp8 / int8: byte cells)
        self.kv_cache = self.kv_format.allocate(num_blocks, self.device)
        if self.kv_format.quantized and attention.startswith("flex"):
            if requested != "auto":
                raise ValueError(f"attention={requested!r} does not read a kv_cache_dtype "
                                 f"{self.kv_format.kind!r} cache; use 'eager' or 'compiled'")
            # flex reads K/V in place and cannot dequantize them: the compiled decode kernel does, in the loops
            # that load each row (Inductor: C++ on CPU, Triton on CUDA); eager where it cannot be built or is slower
            attention = "compiled"
        graphs = args.cuda_graphs and attention.startswith("flex") and num_blocks > 8
        # with decode graphs the pool's last block is the padded entries' scratch, never handed out
        self.block_manager = BlockManager(num_blocks - graphs, block_size, args.enable_prefix_cache)
        self.kv_events = KVEventLog(self.block_manager)     # the prefix cache's events, pulled by the router
        if args.kv_tiers and args.tensor_parallel > 1:
            raise ValueError(f"kv_tiers: tiers below the paged cache hold one rank's KV heads; they are not "
                             f"available with tensor_parallel {args.tensor_parallel}")
        if args.kv_tiers:      # tiers below the paged cache: offload on eviction, onboard before scheduling
            self.kv_tiers = KVTiers(args.kv_tiers, self.kv_cache, f"{self.fingerprint}:{self.kv_format.kind}",
                                    self.kv_events, args.kv_offload_queue_blocks)
            self.kv_events.tiers = self.kv_tiers
            self.kv_tiers.announce()
            self.block_manager.evict_sink = self.kv_tiers.evicted
            self.onboarding = Onboarding(self.kv_tiers, self.block_manager, self.kv_cache)
        self.scheduler = Scheduler(self.block_manager, max_num_batched_tokens, max_num_seqs, chunk_size,
                                   cfg.sliding_window)
        kernel = flex = None
        if attention == "compiled":
            kernel = attention_compiled.build(self.kv_cache[0], shard.num_heads, self.kv_format)
            if kernel is not None and requested == "auto" and not os.environ.get(ATTENTION_ENV) and \
                    not kernel_choice.compiled_decode_wins(kernel, self.kv_cache[0], shard.num_heads):
                kernel = None              # the gather + bmm path measured faster on this machine
        elif attention.startswith("flex"):
            flex = attention_flex.build(self.kv_cache, shard.num_heads, cfg.sliding_window,
                                        compile=attention == "flex", max_model_len=self.max_model_len)
        if kernel is None and flex is None and requested != "auto" and attention != "eager":
            raise RuntimeError(f"attention={attention!r} was asked for but the kernel cannot be built here "
                               "(see the log); use attention='eager'")
        self.attention = "compiled" if kernel is not None else attention if flex is not None else "eager"
        self.runner = ModelRunner(self.model, self.kv_cache, block_size, self.device, kernel, flex, args.weight_layout,
                                  self.kv_format)
        if args.cuda_graphs and shard.size > 1:
            log.warning("cuda_graphs is not used under tensor parallelism (the ranks run each step's plan eagerly)")
        elif args.cuda_graphs and not (graphs and flex is not None):
            log.warning("cuda_graphs needs the flex attention kernel (and a pool above 8 blocks); decoding without")
        elif args.cuda_graphs:
            self.runner.graphs = DecodeGraphs(self.model, self.kv_cache, flex, max_num_seqs, cfg.sliding_window,
                                              num_blocks - 1, capture=self.device.type == "cuda")
            self.runner.graphs.capture_all()
        if shard.size > 1 and shard.rank == 0:
            self.runner.channel = self.tp.channel        # the other ranks run each model call as planned here
        self.output = OutputProcessor(self.tokenizer, self.eos_token_ids)
        if args.speculative.enabled and self.kv_format.kind == "fp8":
            # an fp8 block's scale follows every row written to it, rejected proposals included
            raise ValueError("speculative.method: cannot run with kv_cache_dtype fp8 (use int8 or auto)")
        self.speculator = None
        if args.speculative.enabled:
            spec = args.speculative
            spec.validate()
            draft = None
            if spec.method == "draft":
                from engine.model.presets import resolve_model
                draft = DraftModel(resolve_model(spec.draft_model), self.model_dir, self.vocab_size, self.device,
                                   self.dtype, block_size, num_blocks, self.max_model_len)
            self.speculator = Speculator(spec, draft)
        self.requests: dict[str, Request] = {}
        self._grammars: GrammarCompiler | None = None     # made by the first request with structured output

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
                     resume_output_ids: list[int] = (), resume_text_chars: int = 0,
                     prompt_kv_lossy: bool = False) -> Request:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate(ids, params)
        if len(resume_output_ids) >= params.max_tokens:
            raise ValueError(f"resume_output_ids: {len(resume_output_ids)} tokens already reach max_tokens")
        if resume_output_ids and params.num_sequences > 1:
            raise ValueError("resume_output_ids: a request with n > 1 (or best_of) cannot resume mid-stream")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        grammar = None
        if params.structured is not None:        # validated here (ValueError), compiled off this thread
            grammar = SequenceGrammar(self.grammars, self.grammars.compile(params.structured))
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        req = Request(request_id, ids, params, seed, prefill_only=prefill_only, grammar=grammar)
        req.output_token_ids = list(resume_output_ids)
        req.prompt_kv_lossy = prompt_kv_lossy and self.prompt_kv_roundtrip is not None
        self.output.attach(req, resume_text_chars)
        return req

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, prefill_only: bool = False,
                    resume_output_ids: list[int] = (), resume_text_chars: int = 0,
                    prompt_kv_lossy: bool = False) -> str:
        """Queue a request. `resume_output_ids`: tokens it already produced elsewhere (migration):
        they are recomputed like after a preemption and generation continues after them, with the
        same seeded draws and penalties as if it had never moved. `resume_text_chars`: how much of
        their text the client already has; the rest (held back for stop strings, or half a UTF-8
        character) is streamed from here, and stop strings are matched across the seam.
        `prompt_kv_lossy`: the decode actor it resumes from held its prompt KV as the transfer codec
        delivered it; with `prompt_kv_roundtrip` set, the recomputed prompt goes through the codec too."""
        req = self._new_request(request_id, prompt, params or SamplingParams(), prefill_only, resume_output_ids,
                                resume_text_chars, prompt_kv_lossy)
        self.requests[req.request_id] = req
        if self.onboarding is None or not self.onboarding.start(req):    # else: scheduled once onboarded
            self.scheduler.add(req)
        return req.request_id

    def expect_kv(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, transfer_id: str,
                  deadline: float, num_cached_blocks: int = 0) -> Request:
        """Decode side: register a request whose prompt KV is on its way here (WAITING_FOR_KV).

        The request is validated now, so a bad one fails before any KV arrives; it joins the
        batch at `adopt` and can be aborted while it waits. `num_cached_blocks`: leading prompt
        blocks it takes from this pool's prefix cache now (a reference each, held in its block
        table until it ends: the transfer ships only the rest), those in a tier below it loaded
        first (prefetched since `cached_prefix_blocks`, else read here). Raises ValueError (and takes
        nothing) when that many are not cached, or when they would leave no block to ship.
        """
        req = self._new_request(request_id, prompt_token_ids, params, False)
        if num_cached_blocks:
            most = (req.num_prompt_tokens - 1) // self.block_size
            if num_cached_blocks > most:
                raise ValueError(f"num_cached_blocks: {num_cached_blocks} > {most}, the most a prompt of "
                                 f"{req.num_prompt_tokens} tokens may skip (its last token's block is shipped)")
            hashes = prompt_block_hashes(req.prompt_token_ids, self.block_size)[:num_cached_blocks]
            if self.onboarding is not None:           # blocks a tier holds: loading since the router asked
                self.onboarding.await_prefetch(hashes, PREFETCH_WAIT_S)
            req.block_table = self.pin_prefix(hashes)
            if len(req.block_table) < num_cached_blocks and self.onboarding is not None:    # from a tier
                req.block_table += self.onboarding.pin(hashes[len(req.block_table):])
            if len(req.block_table) < num_cached_blocks:
                self.block_manager.free(req.block_table)
                raise CachedPrefixLost(f"{len(req.block_table)} of the {num_cached_blocks} prompt blocks the "
                                       "router counted on are cached here now (evicted since)")
            req.block_hashes = hashes
        req.status = RequestStatus.WAITING_FOR_KV
        req.kv_transfer_id, req.kv_deadline = transfer_id, deadline
        self.requests[req.request_id] = req
        return req

    def cached_prefix_blocks(self, hashes: list[bytes]) -> int:
        """How many leading blocks of `hashes` (chained prompt block hashes) this pool's prefix cache holds,
        or can onboard from a tier below it (those start loading into the paged cache now: the request
        that follows pins them)."""
        if self.onboarding is not None:
            return self.onboarding.prefetch(hashes)
        with self.block_manager.lock:
            return len(self.block_manager.match_prefix(hashes))

    def pin_prefix(self, hashes: list[bytes]) -> list[int]:
        """Take a reference on the cached blocks of the longest cached prefix of `hashes`; their ids."""
        bm = self.block_manager
        with bm.lock:            # a KV receiver may allocate (evict) from its own threads meanwhile
            ids = bm.match_prefix(hashes)
            bm.touch(ids)
            return ids

    def adopt(self, request_id: str, first_token_ids: list[int], block_ids: list[int],
              num_cached_tokens: int = 0, first_logprobs: list | None = None) -> list[RequestOutput]:
        """Continue a WAITING_FOR_KV request whose prompt KV now sits in `block_ids` (from this pool).

        Args:
            first_token_ids: each sequence's first token as the prefill side drew it, in index
                order (params.num_sequences of them).
            block_ids: the prompt's blocks, after those `expect_kv` pinned from the prefix cache;
                together they become sequence 0's (freed when it ends). With n > 1 every other
                sequence shares the full ones and gets a copy of the partial one.
            first_logprobs: per sequence, the first token's `TokenLogprob` (or None), attached
                to its output as given (not recomputed).
        Returns one output per sequence, in index order; a sequence may finish at its first
        token (EOS, max_tokens == 1). Raises ValueError (and takes no blocks) when the blocks
        cannot hold the prompt or the first tokens do not fit the request.
        """
        req = self.requests[request_id]
        assert req.status is RequestStatus.WAITING_FOR_KV, req.status
        k = req.params.num_sequences
        if len(first_token_ids) != k:
            raise ValueError(f"first_token_ids: {len(first_token_ids)} tokens for {k} sequences")
        bad = next((t for t in first_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"first_token_ids: token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        if first_logprobs is not None and len(first_logprobs) != k:
            raise ValueError(f"first_logprobs: {len(first_logprobs)} entries for {k} sequences")
        need = (len(req.prompt_token_ids) + self.block_size - 1) // self.block_size
        pinned = req.block_table
        if len(pinned) + len(block_ids) < need:
            raise ValueError(f"block_ids: {len(block_ids)} blocks after {len(pinned)} cached ones cannot hold "
                             f"{req.num_prompt_tokens} tokens")
        req.block_table = pinned + list(block_ids)
        req.num_computed_tokens = len(req.prompt_token_ids)
        req.prompt_kv_lossy = self.prompt_kv_roundtrip is not None    # a recompute (preemption) matches it
        req.num_cached_tokens = num_cached_tokens
        hashes = prompt_block_hashes(req.prompt_token_ids, self.block_size)
        req.block_hashes = hashes
        for block_id, h in zip(req.block_table, hashes):     # findable by a later prompt (decode-side reuse)
            self.block_manager.register(block_id, h)
        seqs = [req] + self._spawn(req)
        logprobs = first_logprobs or [None] * k
        outs = [self.output.process(s, t, lp) for s, t, lp in zip(seqs, first_token_ids, logprobs)]
        if not req.status.finished:
            self.scheduler.add_running(req)
        self._fork(req, [s for s in seqs[1:] if not s.status.finished])
        for s in seqs:
            if s.status.finished:
                self._finish(s)
        return outs

    # ---- the step -------------------------------------------------------
    @property
    def layer_hook(self) -> LayerHook | None:
        """Called per layer of every step that computes prompt tokens, as that layer's blocks become
        final (engine/runner/layer_hook.py); None (the default) costs the layer loop nothing."""
        return self.runner.layer_hook

    @layer_hook.setter
    def layer_hook(self, hook: LayerHook | None) -> None:
        self.runner.layer_hook = hook

    last_run_done: float = 0.0      # time.monotonic() when the last step's forward pass ended (request timelines)
    # Set by a decode worker whose KV arrives through a lossy codec: rewrites blocks as the codec
    # delivers them; requests with prompt_kv_lossy recompute their prompt through it (engine/kv_cache/prompt_kv.py).
    prompt_kv_roundtrip: Roundtrip | None = None
    # With kv_cache.tiers (engine/kv_cache/tiers): the tiers below the paged cache, and the requests
    # waiting for their prefix to be loaded back from them.
    kv_tiers: KVTiers | None = None
    onboarding: Onboarding | None = None
    # With speculative decoding (engine/spec): who proposes the tokens each step verifies.
    speculator: Speculator | None = None

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler for this engine's tokenizer (engine/sampling/grammar.py)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer.to_json(), max(self.vocab_size, self.tokenizer.vocab_size),
                                             self.eos_token_ids)
        return self._grammars

    def step(self) -> list[RequestOutput]:
        if self.onboarding is not None and self.onboarding.num_pending:
            for req in self.onboarding.ready():      # their tier blocks are in the paged cache now
                self.scheduler.add(req)
        started = time.monotonic()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.compiling:       # only grammars to wait for: wait a little rather than spin
                futures.wait([req.grammar.future for req, _ in self.scheduler.compiling], timeout=GRAMMAR_WAIT_S,
                             return_when=futures.FIRST_COMPLETED)
            elif self.onboarding is not None:  # only tier reads to wait for: the same
                self.onboarding.wait(GRAMMAR_WAIT_S)
            return []
        if not self.kv_format.quantized:      # (quantized blocks take their scales from the rows written)
            zero_prompt_tails(batch, self.runner.zero_tail, self.block_size)
        decode_only = self.speculator is not None and all(
            s.request.num_computed_tokens == s.request.num_tokens - 1 for s in batch)
        run = self.runner.run(batch)
        self.last_run_done = time.monotonic()
        if self.prompt_kv_roundtrip is not None:
            roundtrip_prompt_blocks(batch, self.prompt_kv_roundtrip, self.block_size, self.device)
        self.scheduler.commit(batch)
        for req, start, logits in run.prompt_logits:
            self._score_prompt(req, start, logits)
        # Sequences to sample: each one due a token, and a forking request's new sequences on its row;
        # sequences with proposals verify them on their 1 + k rows.
        seqs, rows, forking, verifying = [], [], [], []
        row = 0
        for req in run.sampled:
            if req.spec_token_ids:
                verifying.append((req, run.logits[row:row + 1 + len(req.spec_token_ids)]))
                row += 1 + len(req.spec_token_ids)
                continue
            seqs.append(req)
            rows.append(row)
            if not req.sequences and req.parent is None and (req.params.n > 1 or req.params.best_of):
                children = self._spawn(req)
                forking.append(req)
                seqs.extend(children)
                rows.extend([row] * len(children))
            row += 1
        outputs = [self._verify(req, logits) for req, logits in verifying]
        if not seqs:
            tokens, logprobs = [], []
        elif rows == list(range(run.logits.shape[0])):
            tokens, logprobs = self.draw(run.logits, seqs)
        else:
            tokens, logprobs = self.draw(run.logits[rows], seqs)
        for seq, token, logprob in zip(seqs, tokens, logprobs):
            owed = seq.params.prompt_logprobs is not None and seq.owes_prompt_logprobs
            out = self.output.process(seq, token, logprob)
            if owed:
                out.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, []
            outputs.append(out)
        for req in run.sampled:
            if req.prefill_only:
                self._prefilled(req, outputs)
            elif req in forking:
                self._fork(req, [s for s in req.sequences[1:] if not s.status.finished])
                for s in req.sequences:
                    if s.status.finished:
                        self._finish(s)
            elif req.status.finished:
                self._finish(req)
        if decode_only:    # the step's whole time: propose .. tokens out
            self.speculator.turn_down.observe_step(sum(len(out.new_token_ids) for out in outputs),
                                                   time.monotonic() - started)
        return outputs

    def _verify(self, req: Request, logits) -> RequestOutput:
        """`req`'s tokens from its 1 + k rows (engine/spec/verify.py), processed in order until one ends
        it; then the KV of the proposals it did not keep is rolled back."""
        num_proposed = len(req.spec_token_ids)
        tokens = self.accepted_tokens(logits, req)
        logprobs = self._logprobs(logits[:len(tokens)], [req] * len(tokens), tokens)
        self.speculator.verified(req, num_proposed, len(tokens) - 1)
        outs = []
        for token, logprob in zip(tokens, logprobs):
            outs.append(self.output.process(req, token, logprob))
            if req.status.finished:
                break
        self.scheduler.settle(req, len(outs) - 1)
        return merge_outputs(outs)

    def accepted_tokens(self, logits, req: Request) -> list[int]:
        """The tokens `req` keeps from its 1 + k verification rows `logits`: the proposals the target accepts,
        then its own next token (engine/spec/verify.py). Like `draw`, the one place the step reads tokens
        off logits for a verifying sequence."""
        return accept(logits, req, self.output.eos)

    def draw(self, logits, seqs: list[Request]) -> tuple[list[int], list]:
        """Each sequence's next token from its logits row (the sampler's fixed order), and its
        `TokenLogprob` where the request asks for one (None elsewhere)."""
        tokens = sample(logits, seqs, self.output.eos)
        return tokens, self._logprobs(logits, seqs, tokens)

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block of the paged cache over every layer (K and V): what a transfer of it moves."""
        return self.kv_cache[:, 0].numel() * self.kv_cache.element_size()

    def tier_stats(self) -> list[dict]:
        """Each tier below the paged cache, top first (`KVTiers.stats`); [] without tiers."""
        return self.kv_tiers.stats() if self.kv_tiers is not None else []

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or (self.onboarding is not None and self.onboarding.num_pending > 0)

    def follow(self) -> None:
        """Tensor-parallel rank > 0: run rank 0's step plans on this rank's shard until rank 0 closes."""
        self.tp.follow(self.runner)

    def close(self) -> None:
        """Tensor-parallel rank 0: release the other ranks from `follow` (a no-op at degree 1)."""
        self.tp.close()

    def _score_prompt(self, req: Request, start: int, logits) -> None:
        """Prompt logprobs of a chunk: logits [n, V] of positions start.. score prompt[start + 1..]."""
        del req.prompt_logprobs[start:]          # a recomputed prompt (preemption) starts over
        end = min(start + logits.shape[0], req.num_prompt_tokens - 1)
        if end > start:
            targets = req.prompt_token_ids[start + 1:end + 1]
            k = req.params.prompt_logprobs
            req.prompt_logprobs.extend(token_logprobs(logits[:end - start], targets, [k] * len(targets)))

    @staticmethod
    def _logprobs(logits, seqs: list[Request], tokens: list[int]) -> list:
        """The sampled tokens' TokenLogprobs, computed in one batch for the sequences that need them."""
        # = params.needs_logprobs, spelled out: this runs for every sequence every step.
        rows = [i for i, s in enumerate(seqs)
                if s.params.logprobs is not None or (s.params.best_of is not None and s.params.best_of > s.params.n)]
        out = [None] * len(seqs)
        if rows:
            lps = token_logprobs(logits[rows], [tokens[i] for i in rows], [seqs[i].params.logprobs or 0 for i in rows])
            for i, lp in zip(rows, lps):
                out[i] = lp
        return out

    def _prefilled(self, req: Request, outputs: list[RequestOutput]) -> None:
        """Prefill side: sequences that go on hold the prompt's blocks until `release`."""
        live = [s for s in (req.sequences or [req]) if not s.status.finished]
        if not live:
            self._finish(req)
            return
        req.status = RequestStatus.PREFILLED
        self.scheduler.remove(req)
        for out in outputs:
            if out.request_id == req.request_id and out.finish_reason is None:
                out.prefilled = True
                out.block_ids = list(req.block_table)

    # ---- n sequences ------------------------------------------------------
    def _spawn(self, root: Request) -> list[Request]:
        """Sequences 1.. of `root` (no blocks yet), each with its own seed and detokenizer."""
        k = root.params.num_sequences
        if k == 1:
            return []
        children = []
        for i in range(1, k):
            child = Request(root.request_id, root.prompt_token_ids, root.params, child_seed(root.seed, i),
                            prefill_only=root.prefill_only, prompt_kv_lossy=root.prompt_kv_lossy,
                            arrival_time=root.arrival_time,
                            num_cached_tokens=root.num_cached_tokens, first_scheduled_time=root.first_scheduled_time,
                            index=i, parent=root, grammar=root.grammar.fork() if root.grammar is not None else None)
            self.output.attach(child)
            children.append(child)
        root.sequences = [root] + children
        return children

    def _fork(self, root: Request, children: list[Request]) -> None:
        """Give each child the prompt's KV: root's full prompt blocks shared (a reference each) and
        a fresh copy of its partial last block (every layer). A child that finds no free block
        for its copy waits to recompute its prompt, like a preempted sequence."""
        bm, num_prompt = self.block_manager, root.num_prompt_tokens
        num_full = num_prompt // self.block_size
        shared = root.block_table[:num_full]
        partial = root.block_table[num_full] if num_prompt % self.block_size else None
        for child in children:
            copy = [] if partial is None else bm.allocate(1)
            if copy is None:
                self.scheduler.add(child)
                continue
            if copy:
                self.runner.copy_block(partial, copy[0])    # [L, 2, Hkv, bs, D]
            bm.share(shared)
            child.block_table = shared + copy
            child.block_hashes = root.block_hashes[:num_full]
            child.num_computed_tokens = num_prompt
            self.scheduler.add_running(child)

    # ---- requests out ---------------------------------------------------
    def _finish(self, seq: Request) -> None:
        """A sequence ended: its blocks go back; the request leaves once all its sequences ended."""
        self.scheduler.remove(seq)
        if self.speculator is not None:
            self.speculator.release(seq)
        if seq.block_table:
            self.block_manager.free(seq.block_table)
            seq.block_table = []
        root = seq.root
        if all(s.status.finished for s in (root.sequences or [root])):
            self.requests.pop(root.request_id, None)

    def _drop(self, root: Request) -> None:
        """Every sequence of the request out of the queues, its blocks back, the request gone."""
        if self.onboarding is not None:
            self.onboarding.cancel(root)
        for seq in root.sequences or [root]:
            self.scheduler.remove(seq)
            if self.speculator is not None:
                self.speculator.release(seq)
            if seq.block_table:
                self.block_manager.free(seq.block_table)
                seq.block_table = []
        self.requests.pop(root.request_id, None)

    def release(self, request_id: str) -> None:
        """Prefill side: the KV was shipped (or the transfer failed); free the blocks (kept cached)."""
        req = self.requests.get(request_id)
        if req is not None:
            self._drop(req)

    def abort(self, request_id: str) -> RequestOutput | None:
        """End every sequence of the request; the output counts the tokens all of them produced."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        seqs = req.sequences or [req]
        for seq in seqs:
            if not seq.status.finished:
                seq.status = RequestStatus.FINISHED_ABORTED
        self._drop(req)
        return RequestOutput(request_id, [], "", "abort", req.num_prompt_tokens, req.num_cached_tokens,
                             sum(len(s.output_token_ids) for s in seqs))

    def generate(self, inputs: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[Completion]:
        """Run every input to completion. Returns, in input order, each input's num_sequences
        completions in index order (one per input when n == 1 and best_of is unset); best_of
        sequences are not ranked here."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(inputs)
        ids = [self.add_request(inp, p) for inp, p in zip(inputs, params_list)]
        roots = {i: self.requests[i] for i in ids}
        num_sequences = sum(r.params.num_sequences for r in roots.values())
        texts: dict[tuple[str, int], list[str]] = {}
        logprobs: dict[tuple[str, int], list] = {}
        prompt_logprobs: dict[str, list] = {}
        ends: dict[tuple[str, int], RequestOutput] = {}
        while len(ends) < num_sequences:
            for out in self.step():
                key = (out.request_id, out.index)
                texts.setdefault(key, []).append(out.text_delta)
                if out.logprobs is not None:
                    logprobs.setdefault(key, []).extend(out.logprobs)
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.request_id] = out.prompt_logprobs
                if out.finish_reason:
                    ends[key] = out
        completions = []
        for i in ids:
            for seq in roots[i].sequences or [roots[i]]:
                key = (i, seq.index)
                completions.append(Completion(
                    i, seq.prompt_token_ids, seq.output_token_ids, "".join(texts[key]), ends[key].finish_reason,
                    seq.num_cached_tokens, index=seq.index, logprobs=logprobs.get(key),
                    prompt_logprobs=prompt_logprobs.get(i) if seq.index == 0 else None,
                    matched_stop=ends[key].matched_stop, cumulative_logprob=seq.cumulative_logprob))
        return completions
