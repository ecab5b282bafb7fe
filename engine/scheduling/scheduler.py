"""Continuous-batching scheduler with chunked prefill and preemption by recompute.

Every step shares one token budget (`max_num_batched_tokens`). Running requests
go first, in arrival order: a decoding request needs one token, a request still
prefilling takes its next chunk. Waiting requests then join while budget, batch
slots and KV blocks allow. When a running request cannot get a block, the most
recently arrived running request is preempted: its blocks are freed and it goes
back to the front of the queue, to be recomputed from prompt + output so far.

A request with structured output joins its queue only once its grammar is compiled (until then it
waits in `compiling`): no step samples it before its mask can be computed. Prompts behind it go on.

Speculative decoding (engine/spec): a decoding request may carry proposed tokens
(`spec_token_ids`); it then computes 1 + k tokens (the last sampled one and the
proposals), as many proposals as the budget and its chunk take. `commit` counts only
the sampled token as computed; `settle` adds the proposals the engine accepted and
frees the blocks that held nothing else (rejected tokens' KV is rolled back).

With a sliding window (Mistral), a query at position p reads only keys in
(p - window, p]. After each step, a running sequence drops its reference on the
blocks wholly before its next query's window (their table entries become
FREED). Ref counts decide what returns to the pool: a block another sequence
still holds stays, and a hashed block stays findable in the prefix cache until
it is reused. Prefill-only sequences keep every block: they are shipped whole
and the decode side releases what lies outside the window after adoption.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from engine.kv_cache.block_manager import FREED, BlockManager, hash_block, prompt_block_hashes
from engine.scheduling.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int,
                 max_num_seqs: int, chunk_size: int | None, sliding_window: int | None = None):
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}")
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.chunk_size = chunk_size            # None: prompts are never split
        self.sliding_window = sliding_window    # None: every query reads its whole context
        self.waiting: deque[Request] = deque()
        self.adopted: deque[Request] = deque()  # KV already in their blocks, waiting for a batch slot
        self.running: list[Request] = []
        # Grammar still compiling: each request with the queue it joins once the grammar is ready.
        self.compiling: list[tuple[Request, deque[Request]]] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self._enqueue(req, self.waiting)

    def add_running(self, req: Request) -> None:
        """A request whose KV already sits in its blocks (adopted from a prefill actor): it joins the
        batch, ahead of waiting prompts, as soon as the batch has a slot (`max_num_seqs`)."""
        req.status = RequestStatus.WAITING
        self._enqueue(req, self.adopted)

    def _enqueue(self, req: Request, queue: deque[Request]) -> None:
        if req.grammar_ready:
            queue.append(req)
        else:
            self.compiling.append((req, queue))

    def _promote_compiled(self) -> None:
        """Requests whose grammar is now compiled join their queues, in the order they came."""
        still = []
        for req, queue in self.compiling:
            if req.grammar_ready:
                queue.append(req)
            else:
                still.append((req, queue))
        self.compiling = still

    def has_work(self) -> bool:
        return bool(self.waiting or self.adopted or self.running or self.compiling)

    @property
    def num_queued(self) -> int:
        """Requests waiting for a batch slot (prompts to prefill and adopted ones, grammars compiling)."""
        return len(self.waiting) + len(self.adopted) + len(self.compiling)

    def _blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    @staticmethod
    def _remaining(req: Request, num_computed: int) -> int:
        """Tokens left to compute in one run: a prompt_kv_lossy request computes its prompt apart from
        its output tokens (engine/kv_cache/prompt_kv.py)."""
        if req.prompt_kv_lossy and num_computed < req.num_prompt_tokens:
            return req.num_prompt_tokens - num_computed
        return req.num_tokens + len(req.spec_token_ids) - num_computed

    def _size_chunk(self, remaining: int, budget: int, first: bool) -> int:
        if self.chunk_size is not None:
            return min(remaining, self.chunk_size, budget)
        # No chunking: the whole remainder, or nothing; an oversize prompt runs alone.
        return remaining if remaining <= budget or first else 0

    def schedule(self) -> list[ScheduledRequest]:
        with self.block_manager.lock:      # a KV receiver may reserve blocks concurrently
            return self._schedule()

    def _schedule(self) -> list[ScheduledRequest]:
        if self.compiling:
            self._promote_compiled()
        budget = self.max_num_batched_tokens
        out: list[ScheduledRequest] = []
        preempted = False
        while self.adopted and len(self.running) < self.max_num_seqs:
            req = self.adopted.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            remaining = self._remaining(req, req.num_computed_tokens)
            if req.spec_token_ids:      # the sampled token and as many proposals as budget and chunk take
                num_new = min(remaining, budget, self.chunk_size or remaining)
                del req.spec_token_ids[num_new - 1:]
            else:
                num_new = self._size_chunk(remaining, budget, not out)
            if num_new == 0:
                i += 1
                continue
            while not self._grow(req, req.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                out.append(ScheduledRequest(req, num_new))
                budget -= num_new
                i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            req = self.waiting[0]
            if not self._admit(req, budget, not out):
                break
            self.waiting.popleft()
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            num_new = self._size_chunk(self._remaining(req, req.num_computed_tokens), budget, not out)
            out.append(ScheduledRequest(req, num_new))
            budget -= num_new
        return out

    def _grow(self, req: Request, num_tokens: int) -> bool:
        extra = self._blocks_for(num_tokens) - len(req.block_table)
        if extra <= 0:
            return True
        ids = self.block_manager.allocate(extra)
        if ids is None:
            return False
        req.block_table.extend(ids)
        return True

    def _admit(self, req: Request, budget: int, first: bool) -> bool:
        """Take prefix-cache hits and blocks for the first chunk; False (nothing changed) if short."""
        bm = self.block_manager
        hashes = prompt_block_hashes(req.all_token_ids, self.block_size)
        max_hit_blocks = (req.num_tokens - 1) // self.block_size   # leave >= 1 token to compute
        if req.owes_prompt_logprobs:       # every prompt position's logits are needed: no cache hits
            max_hit_blocks = 0
        if req.prompt_kv_lossy:            # its prompt is recomputed from exact KV, as the prefill side did
            max_hit_blocks = 0
        hits = bm.match_prefix(hashes[:max_hit_blocks])
        num_computed = len(hits) * self.block_size
        num_new = self._size_chunk(self._remaining(req, num_computed), budget, first)
        if num_new == 0:
            return False
        need = self._blocks_for(num_computed + num_new) - len(hits)
        free_after_touch = bm.num_free_blocks - sum(1 for b in hits if bm.blocks[b].ref_count == 0)
        if need > free_after_touch:
            return False
        bm.touch(hits)
        req.block_table = hits + bm.allocate(need)
        req.block_hashes = hashes[:len(hits)]
        req.num_computed_tokens = num_computed
        if req.num_cached_tokens == 0 and not req.output_token_ids:
            req.num_cached_tokens = num_computed
        return True

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req.block_table)
        req.block_table = []
        req.spec_token_ids = []
        req.block_hashes = []
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def remove(self, req: Request) -> None:
        """Drop a request from the queues (finished, aborted or handed off)."""
        for queue in (self.running, self.waiting, self.adopted):
            if req in queue:
                queue.remove(req)
                return
        self.compiling = [(r, q) for r, q in self.compiling if r is not req]

    def commit(self, scheduled: list[ScheduledRequest]) -> None:
        """After the model ran: advance computed counts and cache newly full blocks."""
        for s in scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens - len(req.spec_token_ids)   # proposals: see `settle`
            self._register_full_blocks(req)
            if self.sliding_window is not None and not req.prefill_only:
                self._release_outside_window(req)

    def settle(self, req: Request, num_accepted: int) -> None:
        """After verifying `req`'s proposals: the first `num_accepted` are in its output now and their
        KV stays; the rest is rolled back. Blocks past the computed tokens go back to the pool (they
        were taken this step and never hashed); full blocks of accepted tokens join the prefix cache."""
        assert num_accepted <= len(req.spec_token_ids)
        req.num_computed_tokens += num_accepted
        req.spec_token_ids = []
        req.spec_draft_probs = None
        keep = self._blocks_for(req.num_computed_tokens)
        if len(req.block_table) > keep:
            self.block_manager.free(req.block_table[keep:])
            del req.block_table[keep:]
        self._register_full_blocks(req)
        if self.sliding_window is not None:
            self._release_outside_window(req)

    def _register_full_blocks(self, req: Request) -> None:
        """Hash the request's newly full computed blocks into the prefix cache (chained)."""
        full = req.num_computed_tokens // self.block_size
        parent = req.block_hashes[-1] if req.block_hashes else None
        for b in range(len(req.block_hashes), full):
            parent = hash_block(parent, req.token_ids(b * self.block_size, (b + 1) * self.block_size))
            req.block_hashes.append(parent)
            self.block_manager.register(req.block_table[b], parent)

    def _release_outside_window(self, req: Request) -> None:
        """Free the blocks no later query of `req` reads: its next query sits at position
        num_computed_tokens and reads keys from num_computed_tokens - window + 1 on."""
        num_outside = max(req.num_computed_tokens - self.sliding_window + 1, 0) // self.block_size
        table = req.block_table
        first = num_outside
        while first > 0 and table[first - 1] != FREED:   # the released entries are a prefix of the table
            first -= 1
        if first == num_outside:
            return
        self.block_manager.free(table[first:num_outside])
        table[first:num_outside] = [FREED] * (num_outside - first)
