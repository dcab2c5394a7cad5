"""Iteration-level scheduling: which sequences run in the next step, and how many tokens each.

One token budget per step is shared by decodes and prefill chunks (as in vLLM v1), so chunked
prefill falls out of it: a long prompt takes whatever budget is left and continues next step. Running decodes
come first: a prefill chunk takes the budget only beyond one row for each of them (stall-free, as in
Sarathi-Serve). Under a TPOT objective the budget itself, and whether a waiting request may join, come from the
SLO pacer (sieve/pacing.py); otherwise the budget is max_num_batched_tokens.
Order of service is (priority, arrival); with tenants' tiers (sieve/tenancy.py) a tier owed running slots goes
first and takes one back from a borrower, and the tenants of one priority are served by least service so far. A
waiting request goes before running prompts' chunks of a lower priority, and displaces a running request of a lower
priority where slots, blocks or the pacer leave no room for it. When
blocks run out the sequence with the largest key
(lowest priority, latest arrival) is preempted by recompute and goes back to the waiting queue,
keeping its generated tokens so that it resumes exactly where it stopped.

With prefix caching, a sequence (re)entering the batch first takes the blocks of its longest cached
prefix and computes only the rest; after each step its newly full blocks enter the cache. With KV tiers below the
pool (sieve/kv_tiers) those blocks are also written down, and a preempted sequence re-entering first has the ones
the pool evicted meanwhile put back from a tier (`restore_kv`): recompute is only the fallback.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from sieve.block_manager import BlockFork, BlockManager
from sieve.config import EngineConfig
from sieve.pacing import SloPacer
from sieve.sequence import Sequence, SequenceStatus
from sieve.step_cost import decode_keys
from sieve.tenancy import BACKGROUND, TierPolicy


@dataclass
class DraftBranch:
    """Another chain of a draft tree, verified beside the sequence's own: rows of the sequence's last token and
    `draft` after it, written to a copy-on-write fork of the sequence's blocks (`fork`: the sequence's full blocks,
    then blocks of its own, the first a copy of its partial last block). If it is the chain verification keeps, the
    sequence adopts the fork; otherwise it is released."""

    draft: list[int]
    fork: BlockFork
    kv_cells: object = None  # its sequence's per-layer budgets (sieve/kv_compression/cells.py): the fork shares those blocks

    @property
    def block_table(self) -> list[int]:
        return self.fork.table

    @property
    def num_rows(self) -> int:
        return 1 + len(self.draft)


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed for it this step, drafts included (1 + k for a decode with k drafts)
    # Speculative decoding: tokens drafted after the sequence's end, computed and verified this step. Their rows
    # follow the sequence's last token; how many were accepted (`num_accepted`) is known after sampling.
    draft: list[int] = field(default_factory=list)
    draft_probs: Any = None
    num_accepted: int = 0
    # Sibling choices forked from `seq` at the end of its prompt: they take its K/V and sample their first
    # token from the same logits (n > 1 prefills the prompt once); each adopts its BlockFork after the step.
    forks: list[Sequence] = field(default_factory=list)
    choice_forks: list[BlockFork] = field(default_factory=list)
    # A draft tree's other chains (rows after the sequence's own), and which chain verification kept (0: the
    # sequence's own draft, b: branches[b - 1]), set by the model runner.
    branches: list[DraftBranch] = field(default_factory=list)
    chosen_branch: int = 0
    chain_accepted: list[int] = field(default_factory=list)  # each chain's accepted prefix, by the model runner

    @property
    def num_rows(self) -> int:
        """Rows of the step's flattened batch: the sequence's own tokens and drafts, and its other chains'."""
        return self.num_new_tokens + sum(b.num_rows for b in self.branches)

    @property
    def num_real_tokens(self) -> int:
        """Tokens of the sequence itself computed this step (without the drafts)."""
        return self.num_new_tokens - len(self.draft)

    @property
    def samples(self) -> bool:
        """True if this step reaches the end of the sequence, so a token is sampled (1 + k with k drafts)."""
        return self.seq.num_computed_tokens + self.num_real_tokens == self.seq.num_tokens

    @property
    def is_decode(self) -> bool:
        """Computes only the sequence's last token (and its drafts): every row attends through the block table."""
        return self.num_real_tokens == 1 and self.samples


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # (KV-cache group, source, destination) block copies, done after the step's writes
    block_copies: list[tuple[int, int, int]] = field(default_factory=list)
    # ... and before them: draft branches' copies of their sequence's partial last block
    branch_copies: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_rows for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, pacer: SloPacer | None = None,
                 tiers: TierPolicy | None = None):
        self.config = config
        self.blocks = block_manager
        self.pacer = pacer
        self.tiers = tiers  # tenants' tiers: guaranteed slots and fair shares (sieve/tenancy.py), or None
        self.waiting: list[Sequence] = []  # kept sorted by schedule_key
        self.running: list[Sequence] = []  # kept sorted by schedule_key
        self.num_preemptions = 0
        # where a preempted sequence's KV may be found again beyond the pool, put back into the prefix cache as it
        # re-enters: the engine's KV tiers (sieve/kv_tiers), or None
        self.restore_kv: Callable[[Sequence], None] | None = None

    # ---- queue changes -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if self.tiers is not None and seq.num_preemptions == 0:
            self.tiers.arrive(seq, self.running + self.waiting)
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.schedule_key)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ------------------------------------------------------------------------
    def token_budget(self) -> int:
        """Tokens the next step may compute: the SLO pacer's choice, or max_num_batched_tokens."""
        return self.pacer.token_budget(self.running) if self.pacer is not None else self.config.max_num_batched_tokens

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        step_budget = budget = self.token_budget()
        # 0. A tier owed running slots takes one back from a borrower (admitted at the next step)
        victim = self.tiers.take_back(self.waiting, self.running) if self.tiers is not None else None
        if victim is not None:
            self._preempt(victim, out)
        # Background work shares a step with others only as far as the pacer lets it (sieve/tenancy.py)
        shared = self.pacer is not None and any(s.request.priority < BACKGROUND for s in self.running + self.waiting[:1])
        deferred: list[Sequence] = []  # prompts' chunks of a priority below one waiting
        background: list[Sequence] = []  # background sequences, in a step shared with others

        # 1. Running sequences, in order of service: decodes (with their drafts) and unfinished prefill chunks.
        budget = self._continue_running(out, budget, deferred, background if shared else None)

        # 2. Waiting sequences, while there is budget, room and no one was just preempted: first those of a priority
        # above a deferred chunk's (less the tokens the deferred chunks' tiers are guaranteed), then the deferred
        # chunks, then the rest; background work last, within what it may add to the step.
        if deferred:
            held = self.tiers.held_tokens(deferred, step_budget) if self.tiers is not None else 0
            held = min(held, budget)
            budget = held + self._admit_waiting(out, budget - held, deferred[0].request.priority)
            budget = self._continue_deferred(deferred, out, budget)
        if shared:
            budget = self._admit_waiting(out, budget, BACKGROUND)
            # (none beside an interactive prompt's chunk: its time is a time to first token)
            prompts = any(not item.is_decode for item in out.scheduled)
            room = 0 if prompts else min(budget, self.pacer.background_allowance(out.num_batched_tokens, decode_keys(out),
                                                                                 self.config.background_slowdown))
            left = self._admit_waiting(out, self._continue_deferred(background, out, room))
            budget -= room - left
        else:
            budget = self._admit_waiting(out, budget)

        if self.tiers is not None:  # each tenant's service, for fair shares within a tier
            for item in out.scheduled:
                self.tiers.count(item.seq, 0 if item.is_decode else item.num_new_tokens, 1 if item.is_decode else 0)

        # 3. Choices waiting for their first sibling's prompt: forked as that prompt's last chunk is scheduled.
        for item in out.scheduled:
            if item.seq.request.unforked and item.samples:
                self._fork(item, out)

        # 4. Draft trees' other chains, last: from the budget and the blocks nobody else needs this step.
        budget = step_budget - out.num_batched_tokens
        for item in out.scheduled:
            if item.draft and item.seq.draft_state.alternatives and budget > 1:
                budget -= self._branch(item, out, budget)
        return out

    def _continue_running(self, out: SchedulerOutput, budget: int, deferred: list[Sequence],
                          background: list[Sequence] | None) -> int:
        """Schedule the running sequences in order of service; the budget left. A chunk leaves one row for every
        decode not yet scheduled (`reserve`); drafts leave it too. Set aside rather than scheduled: a prompt's chunk
        of a priority below one waiting (into `deferred`, until that waiting request has had its turn), and, where
        `background` is a list, every background sequence (into it). When blocks run out the sequence with the
        largest key is preempted."""
        urgent = self.waiting[0].request.priority if self.waiting else None  # (waiting is sorted by priority first)
        reserve = sum(1 for s in self.running if s.num_tokens - s.num_computed_tokens == 1
                      and (background is None or s.request.priority < BACKGROUND))
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = self._to_compute(seq)
            decode = seq.num_tokens - seq.num_computed_tokens == 1
            if background is not None and seq.request.priority >= BACKGROUND:
                background.append(seq)
                i += 1
                continue
            if not decode and urgent is not None and seq.request.priority > urgent:
                deferred.append(seq)
                i += 1
                continue
            num_new = 1 if decode else min(remaining, budget - reserve)
            if num_new < 1 or (not self.config.enable_chunked_prefill and num_new < remaining):
                i += 1
                continue
            # Drafts are optional: trimmed to the budget and the context, and dropped before anyone is preempted.
            k = max(0, min(len(seq.draft_state.token_ids), budget - reserve, self.config.max_model_len - seq.num_tokens)) if decode else 0
            while not self.blocks.allocate(seq, seq.num_computed_tokens + num_new + k):
                if k:
                    k = 0
                    continue
                victim = self.running[-1]
                reserve -= victim is not seq and victim.num_tokens - victim.num_computed_tokens == 1
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                reserve -= decode
                item = ScheduledSeq(seq, num_new + k)
                if k:
                    item.draft = seq.draft_state.token_ids[:k]
                    item.draft_probs = seq.draft_state.probs[:k] if seq.draft_state.probs is not None else None
                out.scheduled.append(item)
                budget -= item.num_new_tokens
                i += 1
                continue
            break  # `seq` itself was preempted: nothing after it can run either
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int, below: int | None = None) -> int:
        """Admit waiting sequences (only those of a priority better than `below`, where given) while there is
        budget, room and no one was just preempted for want of blocks; the budget left. A waiting sequence of a higher
        priority than one running displaces it where slots or blocks are short (the lowest first, preempted by
        recompute), so a batch request never holds up an interactive one."""
        short_of_blocks = bool(out.preempted)
        while self.waiting and budget > 0 and not short_of_blocks:
            # the waiting queue is sorted by priority first: those better than `below` are a prefix of it
            n = len(self.waiting) if below is None else bisect.bisect_left(self.waiting, below, key=lambda s: s.request.priority)
            if n == 0:
                break
            idx = self.tiers.pick(self.waiting[:n] if below is not None else self.waiting, self.running) if self.tiers is not None else self._next_waiting(n)
            idx = self._within_max_loras(idx, n)
            if idx is None:
                break
            seq = self.waiting[idx]
            if len(self.running) >= self.config.max_num_seqs and not self._displace(seq, out):
                break
            if self.pacer is not None and not self.pacer.admits(self.running, seq):
                if self._displace(seq, out):
                    continue  # a lower priority's row given up for it
                break  # it would push those running past their TPOT objective: it waits
            if seq.num_preemptions and self.restore_kv is not None and not seq.params.whole_prompt:
                self.restore_kv(seq)  # its blocks the pool evicted since, back from a tier where that beats recomputing
            # prompt logprobs (and mean pooling) need every prompt position's hidden state: nothing from the cache
            cached = 0 if seq.params.whole_prompt else self.blocks.take_cached_prefix(seq)
            remaining = self._to_compute(seq)
            num_new = min(remaining, budget)
            no_room = self.pacer is not None and self.running and not self.pacer.leaves_room(
                seq, self.blocks.num_free_blocks * self.config.block_size, len(self.running), self.config.block_size)
            whole = self.config.enable_chunked_prefill or num_new == remaining
            if no_room or not whole or not self.blocks.allocate(seq, seq.num_computed_tokens + num_new):
                self.blocks.free(seq)  # give the shared prefix back; it is taken again next time
                if whole and self._displace(seq, out):
                    continue  # room made by a lower priority: try again
                break
            self.blocks.count_query(seq.num_tokens, cached)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = min(cached, seq.num_prompt_tokens)
            self.waiting.pop(idx)
            seq.status = SequenceStatus.RUNNING
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = time.monotonic()
            bisect.insort(self.running, seq, key=lambda s: s.schedule_key)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return budget

    def _continue_deferred(self, deferred: list[Sequence], out: SchedulerOutput, budget: int) -> int:
        """The sequences set aside in step 1 (prompts' chunks; background decodes too, without drafts), in order of
        service, from the budget left (none preempts for blocks: one that finds none waits for the next step); the
        budget left."""
        for seq in deferred:
            if budget <= 0:
                break
            remaining = self._to_compute(seq)
            num_new = min(remaining, budget)
            if seq.status is not SequenceStatus.RUNNING or (not self.config.enable_chunked_prefill and num_new < remaining):
                continue  # (displaced meanwhile by a waiting request of a higher priority)
            if self.blocks.allocate(seq, seq.num_computed_tokens + num_new):
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
        return budget

    @staticmethod
    def _to_compute(seq: Sequence) -> int:
        """Tokens `seq` has left to compute before its next stop: its end, or with KV compression pending (a sequence
        re-entering after preemption) the end of its prompt, where the press runs before its later tokens are computed
        again over the kept positions."""
        if seq.press_pending and seq.num_computed_tokens < seq.num_prompt_tokens:
            return seq.num_prompt_tokens - seq.num_computed_tokens
        return seq.num_tokens - seq.num_computed_tokens

    def _branch(self, item: ScheduledSeq, out: SchedulerOutput, budget: int) -> int:
        """Reserve `item`'s other draft chains (each as long as its own draft, at most); the rows they take."""
        seq, k, taken = item.seq, len(item.draft), 0
        seen = {tuple(item.draft)}
        for alt in seq.draft_state.alternatives:
            alt = alt[:k]
            if not alt or tuple(alt) in seen:  # (a chain cut to the same tokens as another adds nothing)
                continue
            if 1 + len(alt) > budget - taken:
                break
            fork = self.blocks.fork(seq, seq.num_computed_tokens, seq.num_computed_tokens + 1 + len(alt))
            if fork is None:
                break
            seen.add(tuple(alt))
            item.branches.append(DraftBranch(alt, fork, seq.kv_cells))
            out.branch_copies += fork.copies
            taken += 1 + len(alt)
        return taken

    def discard_forks(self, out: SchedulerOutput) -> None:
        """Give back every fork of a step that did not run to its end (it failed): draft branches' and forked choices'."""
        for item in out.scheduled:
            for f in [b.fork for b in item.branches] + item.choice_forks:
                self.blocks.release(f)
            item.branches, item.choice_forks = [], []

    def _fork(self, item: ScheduledSeq, out: SchedulerOutput) -> None:
        parent, unforked = item.seq, item.seq.request.unforked
        end = parent.num_computed_tokens + item.num_real_tokens
        while unforked and len(self.running) < self.config.max_num_seqs:
            fork = self.blocks.fork(parent, end, end)
            if fork is None:
                break
            child = unforked.pop(0)
            out.block_copies += fork.copies
            item.choice_forks.append(fork)
            child.num_cached_tokens = parent.num_cached_tokens
            child.status = SequenceStatus.RUNNING
            bisect.insort(self.running, child, key=lambda s: s.schedule_key)
            item.forks.append(child)
        for child in unforked:  # no room to fork now: they queue and compute their prompt themselves
            self.add(child)
        unforked.clear()

    def _within_max_loras(self, idx: int, n: int) -> int | None:
        """`idx`, unless its sequence's LoRA adapter would make one adapter too many in a step (max_loras): then the
        first of the first `n` waiting sequences whose adapter fits (or that runs the base model), or None."""
        if not self.config.enable_lora:
            return idx
        running = {s.request.lora.fingerprint for s in self.running if s.request.lora is not None}
        if len(running) < self.config.max_loras:
            return idx

        def fits(seq: Sequence) -> bool:
            return seq.request.lora is None or seq.request.lora.fingerprint in running

        if fits(self.waiting[idx]):
            return idx
        return next((i for i, s in enumerate(self.waiting[:n]) if fits(s)), None)

    def _next_waiting(self, n: int) -> int:
        """Index among the first `n` in `waiting` of the sequence to admit next under the configured policy."""
        cfg = self.config
        if cfg.scheduling_policy != "lpm" or n < cfg.lpm_min_waiting:
            return 0
        window = self.waiting[:min(n, 256)]  # bound the cost of a very long queue
        now = time.monotonic()
        starved = [i for i, s in enumerate(window) if now - s.request.metrics.arrival_time > cfg.lpm_max_wait_s]
        if starved:
            return min(starved, key=lambda i: window[i].arrival_order)
        # Priority still comes first; among equals, the longest cached prefix, then arrival.
        return min(range(len(window)), key=lambda i: (window[i].request.priority,
                                                      -len(self.blocks.cached_prefix_blocks(window[i])),
                                                      window[i].arrival_order))

    def _displace(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Preempt the running sequence of the lowest priority for `seq` where that priority is strictly lower (and,
        with tiers, its tier keeps its guarantee); False when there is none."""
        victim = self.running[-1] if self.running else None
        if victim is None or victim.request.priority <= seq.request.priority or \
                (self.tiers is not None and not self.tiers.may_lose(victim, self.running)):
            return False
        self._preempt(victim, out)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute-preemption: drop the KV, keep the tokens, queue again."""
        self.running.remove(seq)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        self.blocks.free(seq)
        seq.draft_state.clear()
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)
        out.preempted.append(seq)

    def postprocess(self, out: SchedulerOutput) -> None:
        """After the model ran and its tokens were appended: advance each scheduled sequence's computed-token
        count by its own tokens and the drafts it accepted (`num_accepted`, now part of its tokens), and give
        back the blocks that only rejected drafts reached. Only then are full blocks entered in the prefix
        cache, so a rejected draft never is."""
        for s in out.scheduled:
            for b, branch in enumerate(s.branches, start=1):
                if b == s.chosen_branch:  # its blocks now hold the sequence's tokens from its last partial block on
                    self.blocks.adopt(s.seq, branch.fork)
                else:
                    self.blocks.release(branch.fork)
            s.seq.num_computed_tokens += s.num_real_tokens + s.num_accepted
            if s.draft:
                self.blocks.truncate(s.seq, s.seq.num_tokens)
            self.blocks.commit(s.seq)
            for child, fork in zip(s.forks, s.choice_forks):
                self.blocks.adopt(child, fork)
