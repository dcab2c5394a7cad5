"""What the engine sees of speculative decoding: after each step, `prepare` gives every sequence that decodes
next a draft (or none); after verification, `record` counts what was accepted; `finish` when a sequence leaves.

Drafts ride in the ordinary batch: the scheduler budgets 1 + k tokens for a drafting sequence and reserves
their KV slots, the runner verifies every sequence in one target pass (sieve/spec_decode/rejection.py), and the
scheduler rolls back the slots of rejected tokens (they never enter the prefix cache).
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

from sieve.sequence import Sequence
from sieve.spec_decode.config import SpeculativeConfig
from sieve.spec_decode.controller import DepthController, DraftCostModel
from sieve.spec_decode.proposer import Proposer
from sieve.spec_decode.rejection import accepted_prefix
from sieve.step_cost import StepCostModel

if TYPE_CHECKING:
    import torch


log = logging.getLogger("sieve")
PROBE_SHARE = 0.01  # at most this share of the time goes to probing a proposer that costs something to ask
MAX_PROBE_INTERVAL = 256  # steps: a sequence's evidence is never older
# "auto" that drafts nothing for this many steps in a row, with sequences to draft for, says so in the log: on this
# machine and load its premise (drafts accepted often enough for their rows' cost) does not hold, and it stays off
# until it does (it keeps measuring acceptance, and says so again when it drafts)
ASIDE_STEPS = 200


def build_proposer(config: SpeculativeConfig, **context) -> Proposer:
    """The proposer of `config.method`. `context`: what model-based proposers need (the target engine's pieces)."""
    if config.method == "ngram":
        from sieve.spec_decode.ngram import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        from sieve.spec_decode.suffix import SuffixProposer

        return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_min_token_prob)
    if config.method in ("eagle", "eagle3"):
        from sieve.spec_decode.eagle import EagleProposer

        proposer = EagleProposer(config.model, context["hidden_size"], context["vocab_size"], context["device"],
                                 context["dtype"], context["embed"])
        if config.method == "eagle3" and not proposer.aux_hidden_layers:  # (an "eagle" config serves either kind)
            raise ValueError(f"method 'eagle3': the EAGLE layer at {config.model} fuses no inner layers of the target; "
                             f"train one with `sieve distill --method eagle --aux-hidden-layers eagle3`, or serve it as 'eagle'")
        return proposer
    if config.method == "medusa":
        from sieve.spec_decode.medusa import MedusaProposer

        proposer = MedusaProposer(config.model, context["hidden_size"], context["vocab_size"], context["device"], context["dtype"],
                                  context.get("embed"))
        if not config.auto and config.max_k > proposer.max_k:
            raise ValueError(f"num_speculative_tokens = {config.max_k}, but the Medusa heads at {config.model} are "
                             f"{proposer.max_k} heads (one draft token each)")
        return proposer
    assert config.method == "draft_model", config.method  # SpeculativeConfig.validate refuses the rest
    from sieve.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(context["make_engine"](config.model, config.quantization))


class SpecStats:
    """Counters named after vLLM's spec-decode metrics."""

    def __init__(self, max_k: int):
        self.num_drafts = 0  # verifications of a non-empty draft
        self.num_draft_tokens = 0
        self.num_chains = 0  # chains verified: 1 a draft, and a draft tree's further ones
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * max_k
        self.num_steps_aside = 0  # times "auto" stepped aside (drafted nothing for ASIDE_STEPS steps in a row)


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int, max_num_batched_tokens: int,
                 tpot_slo_s: float | None = None, cost: StepCostModel | None = None):
        """`cost`: the engine's step-cost model (it feeds it every step); a fresh one where none is given."""
        self.config, self.proposer = config, proposer
        self.max_model_len, self.budget = max_model_len, max_num_batched_tokens
        self.cost = cost if cost is not None else StepCostModel()
        self.controller = DepthController(config, self.cost, tpot_slo_s)
        self.stats = SpecStats(config.max_k)
        self.branches = config.num_branches  # chains per draft tree (1: a chain)
        # "auto" with a proposer that costs nothing to ask: draft full depth every step (a probe), verify the
        # chosen prefix, and learn acceptance from the whole probe once the tokens it guessed are known.
        self.probing = config.auto and proposer.free
        self.probes: dict[Sequence, tuple[int, list[int]]] = {}  # seq -> (index of the first guessed token, guess)
        # "auto" with a proposer that costs something to ask: its cost per drafted token enters the choice of
        # depth, and a sequence given k = 0 is probed (drafted for, not verified) once its evidence is older than
        # an interval that keeps probing under `probe_share` of the time (and at most MAX_PROBE_INTERVAL steps), so
        # acceptance that rises is seen.
        self.draft_cost = DraftCostModel()  # calls that draft for verification
        self.probe_cost = DraftCostModel()  # calls that only probe: they also catch up a context idle since the last one
        self.chain_cost = DraftCostModel()  # per token of a tree's further chains: a call's time beyond its first chains'
        self.probe_share = PROBE_SHARE
        self.num_prepares = 0
        self.evidence: dict[Sequence, int] = {}  # seq -> the prepare at which it last drafted or was probed
        self.clock = time.perf_counter
        self.idle_steps = 0  # "auto": steps in a row it chose to draft nothing
        self.aside = False  # ... past ASIDE_STEPS: it said so, and says so again when it drafts

    def prepare(self, running: list[Sequence], extra_tokens: int = 0) -> None:
        """Draft for every running sequence whose next step is a decode; clear everyone else's draft."""
        ready, caps = [], []
        for seq in running:
            seq.draft_state.clear()
            if seq.num_computed_tokens != seq.num_tokens - 1 or seq.request.unforked:
                continue
            # Drafted tokens must fit in the context, and the step emits at most k + 1 tokens.
            cap = min(self.max_model_len - seq.num_tokens, seq.params.max_tokens - seq.num_output_tokens - 1, self.config.max_k)
            if cap > 0:
                ready.append(seq)
                caps.append(cap)
        if not ready:
            return
        contexts = [s.num_tokens for s in ready]
        # "auto" with num_branches: how wide each sequence's tree is, as well as how deep, is chosen each step.
        tree = self.controller.W > 1
        branchable = [_branchable(s) for s in ready]
        if self.probing:
            self._resolve_probes(ready)
            widest = [self.branches if b else 1 for b in branchable] if tree else None
            drafts = self.proposer.propose(ready, caps, widest) if tree else self.proposer.propose(ready, caps)
            for seq, d in zip(ready, drafts):
                if d.token_ids:
                    self.probes[seq] = (seq.num_tokens, d.token_ids)
            caps = [len(d.token_ids) for d in drafts]  # nothing to verify beyond what was drafted
            if tree:
                ks, widths = self.controller.choose_tree(ready, caps, branchable, extra_tokens, self.budget, contexts=contexts)
            else:
                ks, widths = self.controller.choose(ready, caps, extra_tokens, self.budget, contexts=contexts), [1] * len(ready)
            for seq, k, w, d in zip(ready, ks, widths, drafts):
                seq.draft_state.token_ids = _allowed(seq, d.token_ids[:k])
                if w > 1 and seq.draft_state.token_ids:
                    seq.draft_state.alternatives = [a[:k] for a in d.alternatives[: w - 1] if a]
            self._note_choice(ks)
            return
        auto = self.config.auto
        if auto:
            self.num_prepares += 1
            self._resolve_probes(ready)
        cost = self.draft_cost.per_token or self.probe_cost.per_token or 0.0
        if tree:
            ks, widths = self.controller.choose_tree(ready, caps, branchable, extra_tokens, self.budget, cost, contexts,
                                                     self.chain_cost.per_token or 0.0)
        else:
            ks = self.controller.choose(ready, caps, extra_tokens, self.budget, cost, contexts)
            widths = [self.branches if b else 1 for b in branchable]  # fixed k: every tree as wide as configured
        chosen = [(s, k, w) for s, k, w in zip(ready, ks, widths) if k > 0]
        self._note_choice(ks)
        probed = [(s, k, 1) for s, k in self._due_for_probe(ready, caps, ks, extra_tokens)] if auto else []
        asked = chosen + probed
        if not asked:
            return
        started = self.clock()
        if self.branches > 1:  # a draft tree for the sequences that can verify one (greedy, no grammar)
            drafts = self.proposer.propose([s for s, _, _ in asked], [k for _, k, _ in asked], [w for _, _, w in asked])
        else:
            drafts = self.proposer.propose([s for s, _, _ in asked], [k for _, k, _ in asked])
        if auto:  # only the adaptive depth weighs what drafting costs
            seconds, drafted = self.clock() - started, sum(len(d.token_ids) for d in drafts)
            further = sum(len(a) for d in drafts for a in d.alternatives)
            if further and chosen:  # a tree's further chains: what the call took beyond its first chains' price
                self.chain_cost.observe(further, max(0.0, seconds - (self.draft_cost.per_token or 0.0) * drafted))
            else:
                (self.draft_cost if chosen else self.probe_cost).observe(drafted, seconds)
        for (seq, k, _), d in zip(chosen, drafts):
            seq.draft_state.token_ids = _allowed(seq, d.token_ids[:k])
            drafted = seq.draft_state.token_ids
            seq.draft_state.probs = d.probs[: len(drafted)] if d.probs is not None and drafted else None
            if d.alternatives and seq.draft_state.token_ids and _branchable(seq):
                seq.draft_state.alternatives = [a[:k] for a in d.alternatives if a]
            if auto:  # verification gives evidence from here (a probe still waiting would count it twice)
                self.evidence[seq] = self.num_prepares
                self.probes.pop(seq, None)
        for (seq, _, _), d in zip(probed, drafts[len(chosen):]):
            self.evidence[seq] = self.num_prepares
            if d.token_ids:
                self.probes[seq] = (seq.num_tokens, d.token_ids)

    def _note_choice(self, ks: list[int]) -> None:
        """"auto": log when it steps aside (nothing drafted for ASIDE_STEPS steps in a row) and when it drafts again."""
        if not self.config.auto:
            return
        if any(ks):
            if self.aside:
                log.info("speculative decoding (auto) drafts again: drafts now pay for their rows")
            self.idle_steps, self.aside = 0, False
            return
        self.idle_steps += 1
        if self.idle_steps == ASIDE_STEPS:
            self.aside = True
            self.stats.num_steps_aside += 1
            c = self.controller
            first = (c.global_accepted[0] + 1.0) / (c.global_tried[0] + 2.0)
            log.warning("speculative decoding (auto) steps aside: for %d steps no draft promised more tokens per second "
                        "than its rows cost on this machine%s (first draft token accepted %.0f%% of the time); it drafts "
                        "again when they do", ASIDE_STEPS, " within the TPOT objective" if c.tpot_slo_s else "", 100 * first)

    def _due_for_probe(self, seqs: list[Sequence], caps: list[int], ks: list[int], extra_tokens: int) -> list[tuple[Sequence, int]]:
        """Sequences given k = 0 whose last evidence is older than the probe interval, with how deep to probe each.
        The interval: probing all of them once costs (their probe tokens) x (seconds per drafted token); spread
        over `interval` steps of t(base) seconds, that is at most `probe_share` of the time."""
        idle = [(s, self.controller.probe_depth(s, c)) for s, c, k in zip(seqs, caps, ks) if k == 0]
        if not idle or not self.cost.ready or self.probe_share <= 0:
            return []
        step = self.cost.predict(len(seqs) + extra_tokens, sum(s.num_tokens for s in seqs))
        per_token = self.probe_cost.per_token or self.draft_cost.per_token
        interval = 1 if per_token is None else math.ceil(sum(d for _, d in idle) * per_token / (self.probe_share * step))
        interval = min(interval, MAX_PROBE_INTERVAL)
        due = []
        for seq, depth in idle:
            last = self.evidence.setdefault(seq, self.num_prepares)  # first seen: its evidence is the global rate
            if self.num_prepares - last >= interval:
                due.append((seq, depth))
        return due

    def _resolve_probes(self, seqs: list[Sequence]) -> None:
        """Score each sequence's last probe against the tokens generated since: leading matches, and whether
        the first guess after them is known wrong."""
        for seq in seqs:
            probe = self.probes.pop(seq, None)
            if probe is None:
                continue
            start, guess = probe
            known = seq.token_ids[start : start + len(guess)]
            a = accepted_prefix(known, guess)
            if not self.probing and a == len(known) < len(guess):
                self.probes[seq] = probe  # an unverified probe waits until the tokens that score it are known
                continue
            # positions 0..a-1 right; position a wrong if it is known, else not yet tried
            self.controller.record(seq, a + 1 if a < len(known) else a, a)

    def record(self, seq: Sequence, num_draft: int, num_accepted: int, num_alternative: int = 0,
               chain_accepted: list[int] | None = None) -> None:
        """A draft of `num_draft` tokens (and `num_alternative` more in its tree's other chains) was verified and
        `num_accepted` kept: the first tokens of the chain that matched. `chain_accepted`: a tree's, each chain's
        accepted prefix (what its further chains add is learnt from them; the rates stay the first chain's)."""
        s = self.stats
        s.num_drafts += 1
        s.num_chains += len(chain_accepted) if chain_accepted else 1
        s.num_draft_tokens += num_draft + num_alternative
        s.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            s.accepted_per_pos[j] += 1
        m = seq.request.metrics
        m.spec_num_drafts += 1
        m.spec_num_draft_tokens += num_draft + num_alternative
        m.spec_num_accepted_tokens += num_accepted
        if chain_accepted and len(chain_accepted) > 1:
            self.controller.record_chains(seq, num_draft, chain_accepted)
            num_accepted = chain_accepted[0]
        if not self.probing:
            self.controller.record(seq, num_draft, num_accepted)

    @property
    def needs_hidden(self) -> str | None:
        """Which of the target's last hidden states the proposer drafts from, handed over by the runner each step:
        "last" (Medusa: the row that produced each sequence's last token), "all" (EAGLE: every row computed), None."""
        return self.proposer.needs_hidden

    @property
    def aux_hidden_layers(self) -> tuple[int, ...]:
        """Inner layers whose residual stream the proposer reads beside the last hidden state (EAGLE-3's fused
        features; rows handed over as [rows, (1 + len) * hidden])."""
        return tuple(self.proposer.aux_hidden_layers)

    def observe_hidden(self, hidden: list[tuple[Sequence, int, "torch.Tensor"]]) -> None:
        """(sequence, position of the first row, hidden states [rows, H]) from the step just run."""
        for seq, start, rows in hidden:
            self.proposer.observe_hidden(seq, start, rows)

    def after_step(self, running: list[Sequence], prefill_tokens_next) -> None:
        """After a step (whose time the engine gave the step-cost model): the next step's drafts.
        `prefill_tokens_next()`: the prefill tokens the next step will carry."""
        self.prepare(running, prefill_tokens_next() if self.config.auto else 0)

    def finish(self, seq: Sequence) -> None:
        seq.draft_state.clear()
        self.proposer.finish(seq)
        self.controller.forget(seq)
        self.probes.pop(seq, None)
        self.evidence.pop(seq, None)


def _branchable(seq: Sequence) -> bool:
    """Whether a sequence's draft may be a tree: verification picks the chain that matches the target's greedy token,
    so greedy requests without a grammar (a grammar masks rows as one chain)."""
    return seq.params.greedy and seq.grammar is None


def _allowed(seq: Sequence, draft: list[int]) -> list[int]:
    """The draft up to its first token the sequence's grammar (structured outputs) forbids: that token would be
    rejected, and every row after it wasted."""
    return draft[: seq.grammar.validate(draft)] if seq.grammar is not None and draft else draft
