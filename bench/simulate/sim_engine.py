"""The engine a simulated actor runs: the real `Engine` bookkeeping, scheduler and block manager;
the forward pass and the sampler replaced by time.

`SimEngine` is an `Engine` whose runner is a `TimedRunner`: each step the real `Scheduler` builds
the batch exactly as it would (chunks, preemptions, prefix-cache hits), the runner prices it with
the `StepTimeModel` instead of computing it, and `draw` picks each sequence's next token from its
seed and position instead of sampling logits. Everything else — `add_request`, `expect_kv`,
`adopt`, forking of n sequences, stop checks, `release`, `abort`, the prefix cache's events — is
`Engine`'s own code; only the detokenizer is silent (token-id workloads have no text to stream).
The paged cache is a stand-in of the pool's shape [1, num_blocks, 2, 1, block_size, 1] that holds no
memory per block (one block's bytes, repeated by a zero stride): nothing in a simulation reads or writes
KV values (the runner zeroes no tails and copies no blocks, the simulated transport ships no bytes and
its codec is `none`, so no prompt is round-tripped); the transfer's pieces only check block ids against
its shape. Block ids, the block manager and the prefix cache behave as in the real engine;
`kv_bytes_per_block` reports the simulated model's size.

With `args.speculative` on, the engine speculates as a real one does (`Engine.step`'s verifying branch,
the `Speculator` and its `TurnDown`, the scheduler's rollback), with `SimProposer`'s proposals at the
acceptance of `model.speculation` and `accepted_tokens` comparing them with `target_token`
(bench/simulate/sim_spec.py). The turn-down times each step by `time.monotonic()` as in a real engine;
in a simulation that reads the virtual clock, which the runner moves by the step's priced seconds
(the draft's proposing included), so it chooses k by simulated time.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from bench.simulate.sim_spec import SimProposer
from bench.simulate.step_time import Chunk, StepTimeModel
from engine.args import EngineArgs
from engine.engine import Engine
from engine.kv_cache.block_manager import BlockManager
from engine.kv_cache.events import KVEventLog
from engine.kv_cache.kv_format import KVFormat
from engine.model.config import ModelConfig
from engine.output.processor import OutputProcessor
from engine.runner.model_runner import ModelOutput
from engine.scheduling.request import Request
from engine.scheduling.scheduler import ScheduledRequest, Scheduler
from engine.spec.speculator import Speculator

FIRST_TOKEN_ID = 2          # ids 0 and 1 are BOS and EOS in every preset; drawn tokens stay above them


class SimTokenizer:
    """A tokenizer for token-id workloads: ids pass through; text decodes to nothing (no detokenizing cost)."""

    def __init__(self, vocab_size: int, eos_token_id: int = 1):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.eos_token_ids = (eos_token_id,)
        self.bos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [FIRST_TOKEN_ID + b % (self.vocab_size - FIRST_TOKEN_ID) for b in text.encode()]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


class SilentDetokenizer:
    """A simulated sequence's detokenizer: its drawn ids stand for no text, so every delta is empty, at no
    cost (the real one would decode a growing window of ids per token into nothing)."""

    def push(self, token_id: int, final: bool = False) -> str:
        return ""

    def flush(self) -> str:
        return ""


class SimOutputProcessor(OutputProcessor):
    """`OutputProcessor` (append, stop checks, the step's output) with a `SilentDetokenizer` per sequence."""

    def attach(self, req: Request, num_emitted_chars: int = 0) -> None:
        req.detokenizer = SILENT
        req.num_emitted_chars = 0


SILENT = SilentDetokenizer()


class TimedRunner:
    """`ModelRunner.run` without the model: which sequences are due a token, and how long the step takes."""

    def __init__(self, model: StepTimeModel):
        self.model = model
        self.layer_hook = None             # the prefill worker sets it; a timed step has no layers to report
        self.last_step_s = 0.0             # the last step's time (read by the simulated actor, then reset)
        self.last_prefill = False          # ... and whether it held a prompt chunk
        # Told each step's time as soon as it is priced, before the worker acts on the step's output
        # (a KV send then starts from the end of this step, not the previous one).
        self.on_step: Callable[[float], None] | None = None
        self._rows: dict[int, torch.Tensor] = {}    # the logits rows `draw` ignores, by count (a slice each step costs)

    def zero_tail(self, block: int, first_slot: int) -> None:
        """A stand-in cache holds no KV: nothing to zero."""

    def copy_block(self, source: int, destination: int) -> None:
        """... nor to copy (a forked sequence's partial block: the block manager's ids are what count)."""

    def run(self, batch: list[ScheduledRequest]) -> ModelOutput:
        chunks, sampled, rows = [], [], 0
        for s in batch:
            req, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            num_spec = len(req.spec_token_ids)
            chunks.append(Chunk(n, start + n, num_spec))
            if start + n == req.num_tokens + num_spec:
                sampled.append(req)
                rows += 1 + num_spec          # a verifying sequence's 1 + k rows
        self.last_step_s = self.model.step_s(chunks)
        if self.model.shared_host:         # (what the host's sharing prices: a prompt chunk in the step)
            self.last_prefill = any(c.new_tokens - c.proposals > 1 for c in chunks)
        if self.on_step is not None:
            self.on_step(self.last_step_s)
        logits = self._rows.get(rows)
        if logits is None:
            logits = self._rows[rows] = torch.zeros(rows, 1)
        return ModelOutput(sampled, logits)

    def take_step_s(self) -> float:
        step_s, self.last_step_s = self.last_step_s, 0.0
        return step_s


class SimEngine(Engine):
    """An `Engine` over `model`'s time (module docstring). `args` gives the block size, pool size, batch
    limits and speculative decoding as the real actor's `EngineArgs` would; `cfg` is the simulated model's
    shape. With `args.speculative` on, `model.speculation` (`StepTimeModel.with_speculation`) gives the
    acceptance its proposals meet."""

    def __init__(self, args: EngineArgs, cfg: ModelConfig, model: StepTimeModel):
        self.args = args
        self.device = torch.device("cpu")
        self.dtype = torch.uint8
        self.config = cfg
        self.max_model_len = args.context_length(cfg)
        self.tokenizer = SimTokenizer(cfg.vocab_size)
        self.eos_token_ids = self.tokenizer.eos_token_ids
        self.vocab_size = cfg.vocab_size
        self.model = None
        self.fingerprint = f"simulated:{model.name}"
        self.block_size = block_size = args.block_size
        self.kv_budget = None
        num_blocks = args.num_blocks or 1
        # (one block's bytes, expanded: a pool of any size costs no host memory for its cache)
        self.kv_cache = torch.zeros(1, 1, 2, 1, block_size, 1, dtype=torch.uint8).expand(1, num_blocks, 2, 1,
                                                                                         block_size, 1)
        self.kv_format = KVFormat("auto", 1, 1, block_size, 1, self.dtype)     # (the stand-in cache above)
        self._grammars = None
        self.block_manager = BlockManager(num_blocks, block_size, args.enable_prefix_cache)
        self.kv_events = KVEventLog(self.block_manager)
        self.scheduler = Scheduler(self.block_manager, args.max_num_batched_tokens, args.max_num_seqs,
                                   args.chunk_size, cfg.sliding_window)
        self.attention = "simulated"
        self.runner = TimedRunner(model)
        self.output = SimOutputProcessor(self.tokenizer, self.eos_token_ids)
        self.requests = {}
        self._kv_bytes_per_block = model.kv_bytes_per_token * block_size
        self.speculator = None
        if args.speculative.enabled:
            if model.speculation is None:
                raise ValueError(f"speculative.method {args.speculative.method}: the simulated actor's time model "
                                 "has no acceptance rate (StepTimeModel.with_speculation)")
            proposer = SimProposer(model.speculation.alpha, self.target_token, self.wrong_token)
            self.speculator = Speculator(args.speculative, proposer=proposer)

    @property
    def kv_bytes_per_block(self) -> int:
        return self._kv_bytes_per_block

    def target_token(self, seq: Request, position: int) -> int:
        """The simulated model's token at output `position` of `seq`: from its seed and the position, never
        EOS. Outputs are reproducible, and a later turn's prompt that repeats them hits the prefix cache
        as a real conversation would."""
        return FIRST_TOKEN_ID + (seq.seed + 7919 * position) % (self.vocab_size - FIRST_TOKEN_ID)

    def wrong_token(self, token: int) -> int:
        """A token other than `token` (never EOS): what a proposal the target rejects proposes."""
        return FIRST_TOKEN_ID + (token - FIRST_TOKEN_ID + 1) % (self.vocab_size - FIRST_TOKEN_ID)

    def draw(self, logits, seqs: list[Request]) -> tuple[list[int], list]:
        """Each sequence's `target_token` at its next position."""
        return [self.target_token(seq, len(seq.output_token_ids)) for seq in seqs], [None] * len(seqs)

    def accepted_tokens(self, logits, req: Request) -> list[int]:
        """The proposals that are the target's tokens, up to the first that is not, then the target's own
        token at the next position (its token in place of the rejected one, or one more after all k)."""
        first = len(req.output_token_ids)
        tokens = []
        for position, proposal in enumerate(req.spec_token_ids, first):
            tokens.append(self.target_token(req, position))
            if tokens[-1] != proposal:
                return tokens
        tokens.append(self.target_token(req, first + len(req.spec_token_ids)))
        return tokens
