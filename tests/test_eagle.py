"""EAGLE: `sieve distill --method eagle` trains a one-layer draft model on the target's own features and answers;
served through `speculative_config`, it drafts from the hidden states of every row the target computed, and the
output is exactly the output without speculation (greedy and seeded, among other requests, with chunked prefill,
prefix-cache hits and preemption). The proposer's drafts are what the training-time unrolling simulates."""

from __future__ import annotations

import argparse
import json
import random
from types import SimpleNamespace

import pytest
import torch

from sieve import SamplingParams
from sieve.config import ConfigError
from sieve.train.distill import add_distill_args, eagle_batch_loss, eagle_loss, pack_answers, run_distill
from sieve.spec_decode.eagle import EagleLayer, EagleProposer, unroll_mask

from test_medusa import STORIES, distill_args, stories, workload
from test_spec import assert_pool_clean, count_chosen_branches, fixed_step_cost, ids


class FakeSeq(SimpleNamespace):
    """A stand-in for a Sequence: its fields, and a Sequence's identity (proposers keep state keyed by the sequence)."""

    __hash__ = object.__hash__
    __eq__ = object.__eq__


@pytest.fixture(scope="module")
def eagle(tmp_path_factory):
    out = tmp_path_factory.mktemp("eagle")
    report = run_distill(distill_args(STORIES, out, method="eagle", depth=3, batch_tokens=512))
    return out, report


def test_distill_trains_an_eagle_layer_and_reports_simulated_acceptance(eagle):
    out, report = eagle
    config = json.loads((out / "config.json").read_text())
    assert config["method"] == "eagle" and config["depth"] == 3 and config["num_kv_heads"] >= 1
    assert (out / "eagle.safetensors").exists()
    first, last = report["history"][0], report["history"][-1]
    assert len(report["history"]) == 4 and last["loss"] < first["loss"]  # it learns
    assert last["chain_acceptance"][0] > first["chain_acceptance"][0] - 0.02 and last["head_accuracy"][0] > 0.4
    sim = config["simulated_mean_acceptance_length"]
    assert 1.3 < sim["1"] <= sim["2"] <= sim["3"] <= 4.0  # later draft tokens add acceptance: the unrolling works


def test_eagle_greedy_and_seeded_output_equal_no_speculation(eagle):
    out, _ = eagle
    plain = stories()
    spec = stories(max_num_batched_tokens=32,  # chunked prefill: a prompt's features arrive over several steps
                   speculative_config={"method": "eagle", "model": str(out), "num_speculative_tokens": 3})
    prompts, params = workload(33)
    assert ids(spec.generate(prompts, params)) == ids(plain.generate(prompts, params))
    stats = spec.llm_engine.speculator.stats
    assert stats.num_drafts > 50 and stats.num_accepted_tokens > 0.4 * stats.num_drafts  # the layer guesses right
    assert stats.accepted_per_pos[2] > 0  # third drafts accepted: drafting on its own features works when served
    sampled = [SamplingParams(max_tokens=p.max_tokens, temperature=0.9, seed=i, ignore_eos=True) for i, p in enumerate(params)]
    assert ids(spec.generate(prompts, sampled)) == ids(plain.generate(prompts, sampled))
    assert not spec.llm_engine.speculator.proposer.states  # every finished sequence's draft context was dropped
    assert_pool_clean(spec.llm_engine)


def test_eagle_with_prefix_hits_preemption_forks_and_auto_depth(eagle):
    """A pool of 12 blocks preempts (a recomputed sequence re-enters positions its draft cache holds); repeated
    prompts hit the prefix cache (no features before the hit: the draft context starts after it); n = 2 forks."""
    out, _ = eagle
    prompts, params = workload(10)
    prompts = prompts + prompts[:4]
    params = params + params[:4]
    forked = SamplingParams(max_tokens=30, temperature=0.8, seed=7, n=2, ignore_eos=True)
    for config in ({"num_speculative_tokens": 3}, {"num_speculative_tokens": "auto"}):
        plain = stories(num_gpu_blocks_override=12, max_num_seqs=4)
        spec = stories(num_gpu_blocks_override=12, max_num_seqs=4,
                       speculative_config={"method": "eagle", "model": str(out), **config})
        assert ids(spec.generate(prompts, params)) == ids(plain.generate(prompts, params))
        fork_spec = [c.token_ids for c in spec.generate(prompts[:2], forked)[0].outputs]
        assert fork_spec == [c.token_ids for c in plain.generate(prompts[:2], forked)[0].outputs]
        engine = spec.llm_engine
        assert engine.scheduler.num_preemptions > 0 and engine.block_manager.num_hit_tokens > 0
        assert_pool_clean(engine)


def test_eagle_draft_tree_is_lossless_and_keeps_its_other_chains(eagle):
    """num_branches = 3: the layer's three likeliest first tokens, each continued as its own chain, verified in one
    pass (a chain other than the first attends to its own entries of the draft cache, not the others'). Greedy output equals the plain engine's (chunked prefill, a pool small enough to preempt, prefix hits);
    sampled requests draft one chain; the other chains are kept where the first is wrong, so more first drafts are
    accepted than by the chain alone."""
    out, _ = eagle
    prompts, params = workload(10)
    prompts, params = prompts + prompts[:4], params + params[:4]
    plain = stories(num_gpu_blocks_override=48, block_size=4, max_num_seqs=4)
    reference = ids(plain.generate(prompts, params))
    accepted_first, accepted = {}, {}
    for branches in (1, 3):
        spec = stories(num_gpu_blocks_override=48, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                       speculative_config={"method": "eagle", "model": str(out), "num_speculative_tokens": 3,
                                           "num_branches": branches})
        engine = spec.llm_engine
        chosen = count_chosen_branches(engine)
        assert ids(spec.generate(prompts, params)) == reference
        stats = engine.speculator.stats
        accepted_first[branches] = stats.accepted_per_pos[0] / stats.num_drafts
        accepted[branches] = stats.num_accepted_tokens / stats.num_drafts
        if branches == 3:
            assert engine.scheduler.num_preemptions > 0 and engine.block_manager.num_hit_tokens > 0
            assert len(chosen) > 50 and chosen.count(0) > 0
            assert chosen.count(1) + chosen.count(2) > 10  # a second or third chain matched, and was adopted
            assert stats.num_draft_tokens > 4 * stats.num_drafts  # the other chains' tokens count as drafted (one: at most 3)
            sampled = [SamplingParams(max_tokens=p.max_tokens, temperature=0.9, seed=i, ignore_eos=True)
                       for i, p in enumerate(params[:6])]
            before = len(chosen)
            assert ids(spec.generate(prompts[:6], sampled)) == ids(plain.generate(prompts[:6], sampled))
            assert len(chosen) == before  # sampled requests verify one chain
        else:
            assert not chosen
        assert_pool_clean(engine)
    assert accepted_first[3] > accepted_first[1] + 0.05  # (0.49 against 0.41 here)
    assert accepted[3] > accepted[1] + 0.05  # accepted tokens per draft (0.88 against 0.74 here)


def test_eagle_draft_tree_wider_than_eight_chains_is_lossless(eagle):
    """num_branches = 24, past the old cap of 8 (on a GPU a verified row is nearly free, and 16-32 chains accept more
    than 8): greedy output equals the plain engine's where the pool and the token budget cannot give every sequence all
    its chains each step (the scheduler drops those that do not fit, and gives their blocks back); a chain past the
    eighth is verified and adopted."""
    out, _ = eagle
    prompts, params = workload(10)
    plain = stories(num_gpu_blocks_override=64, block_size=4, max_num_seqs=4)
    spec = stories(num_gpu_blocks_override=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=128,
                   speculative_config={"method": "eagle", "model": str(out), "num_speculative_tokens": 3, "num_branches": 24})
    engine = spec.llm_engine
    chosen = count_chosen_branches(engine)
    widths, real = [], engine.scheduler.postprocess

    def postprocess(sched_out):
        widths.extend(1 + len(item.branches) for item in sched_out.scheduled if item.draft)
        real(sched_out)

    engine.scheduler.postprocess = postprocess
    reservations, reserve = [], engine.block_manager.fork

    def fork(*args):
        reservations.append(reserve(*args))
        return reservations[-1]

    engine.block_manager.fork = fork
    assert ids(spec.generate(prompts, params)) == ids(plain.generate(prompts, params))
    assert max(widths) > 8 and min(widths) < 24  # trees wider than the old cap, and some cut to what fits
    assert None in reservations  # the pool ran short for some chains (160 of 1,219 here)
    assert max(chosen) >= 8  # a chain the old cap left out was the one kept
    assert_pool_clean(engine)


@pytest.mark.parametrize("per_row", [0.0, 0.01], ids=["rows-free", "rows-cost"])
def test_auto_chooses_how_wide_each_draft_tree_is(eagle, per_row):
    """"auto" with num_branches = 8: each step, each greedy sequence's tree width (1 to 8) is chosen with its depth, from
    what further chains were measured to add and what their rows cost (the proposer's time is left out here). Where a
    row is free (a GPU's launch-bound decode, at the limit) it verifies trees, as wide as the step's token budget leaves
    room for, and learns from them what chains past the first add; where a row costs 10 ms, as much as the step's fixed
    part (on this project's CPUs a row costs a third of a one-row step), it verifies hardly any. Greedy output equals
    the plain engine's either way, among sampled requests (which draft one chain), with chunked prefill; the pool ends
    clean."""
    out, _ = eagle
    prompts, params = workload(10)
    params[1] = params[7] = SamplingParams(max_tokens=30, temperature=0.8, seed=3, ignore_eos=True)
    plain = stories(num_gpu_blocks_override=96, block_size=4, max_num_seqs=4)
    spec = stories(num_gpu_blocks_override=96, block_size=4, max_num_seqs=4, max_num_batched_tokens=96,
                   speculative_config={"method": "eagle", "model": str(out), "num_speculative_tokens": "auto",
                                       "max_num_speculative_tokens": 3, "num_branches": 8})
    engine = spec.llm_engine
    speculator = engine.speculator
    speculator.cost = speculator.controller.cost = fixed_step_cost(0.010 + per_row, 0.010 + 256 * per_row)
    speculator.clock = lambda: 0.0  # and a proposer that costs nothing: neither may depend on this machine's timings
    widths, real = [], engine.scheduler.postprocess

    def postprocess(sched_out):
        widths.extend(1 + len(item.branches) for item in sched_out.scheduled if item.draft)
        real(sched_out)

    engine.scheduler.postprocess = postprocess
    assert ids(spec.generate(prompts, params)) == ids(plain.generate(prompts, params))
    controller = speculator.controller
    trees = sum(w > 1 for w in widths)
    stats = speculator.stats
    assert stats.num_drafts == len(widths) and stats.num_chains == sum(widths)  # (the benchmark's chains a draft)
    print(f"{len(widths)} drafts verified, {trees} of them trees, widths {sorted(set(widths))}")
    if per_row == 0:
        assert trees > len(widths) // 2 and len(set(widths)) > 2  # mostly trees, and not one width throughout
        assert controller.chain_norm[1] > 0 and controller.chain_gain[1] > 0  # chain 2 was measured, and added tokens
        assert stats.num_draft_tokens > stats.num_drafts * 3  # further chains' tokens drafted
    else:
        # Drafts, and hardly a tree: only beside a prefill chunk, whose rows make a few more look cheap (none of 18
        # drafts here; with free rows 143 of 187 were trees).
        assert widths and trees <= len(widths) // 20
    assert_pool_clean(engine)


def _random_layer(path, H: int = 32, V: int = 50, aux: tuple[int, ...] = ()):
    """A small EAGLE layer with random weights (not the near-identity start) saved at `path`, for a target of hidden
    size H and vocabulary V drafting its even ids (with `aux`, fusing those layers' features, EAGLE-3's, through a
    random projection); and an embedding table for that target."""
    layer = EagleLayer(H, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48, rope_theta=10000.0,
                       rms_norm_eps=1e-6, draft_vocab=list(range(0, V, 2)), aux_hidden_layers=aux)
    for lin in (layer.fc, layer.qkv, layer.o, layer.gate_up, layer.down, layer.head) + ((layer.fuse,) if aux else ()):
        torch.nn.init.normal_(lin.weight, std=0.3)
    if aux:
        layer.aux_scale.uniform_(0.5, 2.0)
    layer.save(path, {})
    return H, V, torch.randn(V, H)


@pytest.mark.parametrize("aux", [(), (0, 2)], ids=["eagle", "fused"])
def test_served_drafts_are_what_training_unrolls(tmp_path, aux):
    """The proposer (features entered in pieces, rejected rows replaced, a draft cache grown) drafts exactly the
    tokens the unrolled training pass predicts for the same context and the same tokens: simulated acceptance is the
    served one. With fused inner layers (EAGLE-3), each row handed over carries them after the last hidden state, and
    the drafts depend on them."""
    torch.manual_seed(0)
    H, V, table = _random_layer(tmp_path, aux=aux)
    proposer = EagleProposer(str(tmp_path), H, V, torch.device("cpu"), torch.float64, embed=lambda t: table[t])
    assert proposer.aux_hidden_layers == aux
    W = H * (1 + len(aux))
    feats = torch.randn(40, W, dtype=torch.float64)
    tokens = torch.randint(0, V, (40,)).tolist()
    seq = FakeSeq(token_ids=tokens[:21], num_computed_tokens=20)
    proposer.observe_hidden(seq, 0, feats[:12])  # a prefill chunk
    proposer.observe_hidden(seq, 12, torch.randn(9, W, dtype=torch.float64))  # rows of a step whose drafts lost...
    proposer.observe_hidden(seq, 12, feats[12:20])  # ...replaced from position 12
    for n in (20, 23):
        seq.token_ids, seq.num_computed_tokens = tokens[: n + 1], n
        if n == 23:
            proposer.observe_hidden(seq, 20, feats[20:24])  # 3 committed, 1 rejected row
        draft = proposer.propose([seq], [4])[0].token_ids
        assert len(draft) == 4
        # the unrolled pass fed the same tokens (the drafts after the committed ones) and the real features
        path = torch.tensor(tokens[: n + 1] + draft)
        T = len(path) - 1
        with torch.inference_mode():
            outs = proposer.layer.unrolled(table[path[1:]].double(), torch.cat([feats[:n], feats[:T - n]]), 4)
            sim = [proposer.layer.draft_vocab[proposer.layer.logits(outs[s][n - 1 + s]).argmax()].item() for s in range(4)]
        assert draft == sim
        if n == 20:  # the drafts depend on the features entered (so a wrong row entered would show)
            others = [torch.randn(T, W, dtype=torch.float64)]
            if aux:  # and on the inner layers' part alone
                others.append(torch.cat([feats[:T, :H], torch.randn(T, W - H, dtype=torch.float64)], dim=1))
            for other in others:
                with torch.inference_mode():
                    outs = proposer.layer.unrolled(table[path[1:]].double(), other, 4)
                    assert [proposer.layer.draft_vocab[proposer.layer.logits(outs[s][n - 1 + s]).argmax()].item()
                            for s in range(4)] != sim
    proposer.finish(seq)
    assert not proposer.states


def test_each_chain_of_a_draft_tree_is_what_training_unrolls_after_its_first_token(tmp_path, monkeypatch):
    """num_branches: chain c begins with the layer's (c + 1)-th likeliest first token and goes on exactly as the
    unrolled pass predicts after that token (so it attends to its own draft entries, never another chain's); the first
    chain is the draft without branches; a sequence asked for one chain beside it drafts as alone. The draft cache's
    unwritten memory is NaN here, as uninitialised memory may be: no chain reads it."""
    from sieve.spec_decode.eagle import SeqState

    reserve = SeqState.reserve

    def poisoned(self, size, like):
        reserve(self, size, like)
        self.k[self.n:], self.v[self.n:] = float("nan"), float("nan")

    monkeypatch.setattr(SeqState, "reserve", poisoned)
    torch.manual_seed(2)
    H, V, table = _random_layer(tmp_path)
    make = lambda: EagleProposer(str(tmp_path), H, V, torch.device("cpu"), torch.float64, embed=lambda t: table[t])
    feats = torch.randn(2, 30, H, dtype=torch.float64)
    tokens = torch.randint(0, V, (2, 30)).tolist()
    n = (20, 14)
    tree, chain, both = make(), make(), make()
    drafts = {}
    for name, proposer, branches in (("tree", tree, [3, 1]), ("chain", chain, None), ("both", both, [3, 3])):
        seqs = [FakeSeq(token_ids=tokens[i][: n[i] + 1], num_computed_tokens=n[i]) for i in range(2)]
        for i, seq in enumerate(seqs):
            proposer.observe_hidden(seq, 0, feats[i, : n[i]])
        drafts[name] = proposer.propose(seqs, [4, 3], branches)
    t, c = drafts["tree"], drafts["chain"]
    assert len(t[0].alternatives) == 2 and not t[1].alternatives
    assert t[0].token_ids == c[0].token_ids and t[1].token_ids == c[1].token_ids
    # Both sequences branching (their rows laid out without index copies), one drafting 4 and one 3: each as alone.
    b = drafts["both"]
    assert (b[0].token_ids, b[0].alternatives) == (t[0].token_ids, t[0].alternatives)
    assert b[1].token_ids == c[1].token_ids and len(b[1].alternatives) == 2 and all(len(a) == 3 for a in b[1].alternatives)
    alone, seq = make(), FakeSeq(token_ids=tokens[1][: n[1] + 1], num_computed_tokens=n[1])
    alone.observe_hidden(seq, 0, feats[1, : n[1]])
    a = alone.propose([seq], [3], [3])[0]
    assert (b[1].token_ids, b[1].alternatives) == (a.token_ids, a.alternatives)
    # Asked for no tokens, a proposer only enters the committed positions.
    idle, seq = make(), FakeSeq(token_ids=tokens[1][: n[1] + 1], num_computed_tokens=n[1])
    idle.observe_hidden(seq, 0, feats[1, : n[1]])
    assert [(d.token_ids, d.alternatives) for d in idle.propose([seq], [0], [3])] == [([], [[], []])]
    assert idle.states[seq].entered == n[1]
    L = tree.layer
    with torch.inference_mode():
        first = L.draft_vocab[L.logits(L.unrolled(table[torch.tensor(tokens[0][1: n[0] + 1])].double(),
                                                  feats[0, : n[0]], 1)[0][-1]).topk(3).indices].tolist()
        chains = [t[0].token_ids, *t[0].alternatives]
        assert [ch[0] for ch in chains] == first
        for ch in chains:
            assert len(ch) == 4
            path = torch.tensor(tokens[0][: n[0] + 1] + ch)
            T = len(path) - 1
            outs = L.unrolled(table[path[1:]].double(), torch.cat([feats[0, : n[0]], feats[0, : T - n[0]]]), 4)
            assert ch[1:] == [L.draft_vocab[L.logits(outs[s][n[0] - 1 + s]).argmax()].item() for s in range(1, 4)]


def test_a_context_left_far_behind_restarts_at_its_last_positions(tmp_path):
    """A sequence not drafted for over MAX_CATCH_UP positions ("auto" chose k = 0) is not caught up position by
    position at its next probe: its context restarts at its last MAX_CATCH_UP positions, and the drafts are then
    exactly those of a proposer that only ever saw those positions, before and after the rows that follow."""
    from sieve.spec_decode.eagle import MAX_CATCH_UP

    torch.manual_seed(1)
    H, V, table = _random_layer(tmp_path)
    make = lambda: EagleProposer(str(tmp_path), H, V, torch.device("cpu"), torch.float64, embed=lambda t: table[t])
    n, end = 30, 30 + MAX_CATCH_UP + 50
    feats = torch.randn(end + 1, H, dtype=torch.float64)
    tokens = torch.randint(0, V, (end + 1,)).tolist()
    behind, fresh = make(), make()
    seq = FakeSeq(token_ids=tokens[: n + 1], num_computed_tokens=n)
    behind.observe_hidden(seq, 0, feats[:n])
    assert len(behind.propose([seq], [2])[0].token_ids) == 2  # the prompt entered whole
    for p in range(n, end):  # one token a step, never asked
        behind.observe_hidden(seq, p, feats[p: p + 1])
    seq.token_ids, seq.num_computed_tokens = tokens[: end + 1], end
    draft = behind.propose([seq], [3])[0].token_ids
    st = behind.states[seq]
    assert (st.base, st.n) == (end - MAX_CATCH_UP, MAX_CATCH_UP)
    other = FakeSeq(token_ids=seq.token_ids, num_computed_tokens=end)
    fresh.observe_hidden(other, end - MAX_CATCH_UP, feats[end - MAX_CATCH_UP: end])
    assert fresh.propose([other], [3])[0].token_ids == draft
    # The restarted context was made inside the proposer's inference-mode pass; the rows the engine hands over next
    # (outside it) enter it all the same. (Before, writing them raised, and the step failed: found with eagle `auto`
    # on open chat.)
    feats2, tokens2 = torch.randn(2, H, dtype=torch.float64), torch.randint(0, V, (2,)).tolist()
    for s in (seq, other):
        s.token_ids, s.num_computed_tokens = s.token_ids + tokens2, end + 2
    behind.observe_hidden(seq, end, feats2)
    fresh.observe_hidden(other, end, feats2)
    assert behind.propose([seq], [3])[0].token_ids == fresh.propose([other], [3])[0].token_ids


def test_unroll_mask_is_what_each_draft_token_sees():
    m = unroll_mask(5, 2)
    assert m.shape == (5, 15)
    # level 2 at position 4: target keys 0..2, level 1's key at 3, its own at 4
    assert m[4].nonzero().flatten().tolist() == [0, 1, 2, 5 + 3, 10 + 4]
    assert m[0].nonzero().flatten().tolist() == [10]  # nothing committed before it: only itself (never attended empty)


def test_bad_eagle_layers_are_refused(eagle, tmp_path):
    out, _ = eagle
    with pytest.raises(ValueError, match="holds no EAGLE layer"):
        stories(speculative_config={"method": "eagle", "model": str(tmp_path)})
    with pytest.raises(ValueError, match="hidden size"):
        EagleProposer(str(out), 999, 512, torch.device("cpu"), torch.float32, embed=None)
    with pytest.raises(ValueError, match="vocabulary"):
        EagleProposer(str(out), json.loads((out / "config.json").read_text())["hidden_size"], 8, torch.device("cpu"),
                      torch.float32, embed=None)
    (tmp_path / "config.json").write_text(json.dumps({**json.loads((out / "config.json").read_text())}))
    (tmp_path / "eagle.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="does not load"):
        stories(speculative_config={"method": "eagle", "model": str(tmp_path)})


def test_answers_trained_in_one_padded_pass_are_each_trained_as_alone(tmp_path):
    """`--pack-tokens`: answers of several lengths padded into one pass give each answer's own outputs at its valid
    rows, and a loss (and gradients) equal to the sum of their losses alone, each weighed by its positions, as
    training adds them up; hard and soft token losses, depths 1-3, answers of 1 to 13 positions. The passes hold every
    answer once, within the padded size; a negative size, or the option outside EAGLE's training, is refused."""
    torch.manual_seed(0)
    H, V = 16, 30
    layer = EagleLayer(H, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=24, rope_theta=10000.0,
                       rms_norm_eps=1e-6, draft_vocab=list(range(0, V, 3))).double()
    for lin in (layer.fc, layer.qkv, layer.o, layer.gate_up, layer.down, layer.head):
        torch.nn.init.normal_(lin.weight, std=0.3)
    table, teacher = torch.randn(V, H, dtype=torch.float64), torch.randn(len(layer.draft_vocab), H, dtype=torch.float64)
    index = torch.full((V,), -100, dtype=torch.int64)
    index[layer.draft_vocab] = torch.arange(len(layer.draft_vocab))
    seqs = []
    for n in (2, 9, 14, 5):  # tokens: 1 to 13 positions
        ids, feats = torch.randint(0, V, (n,)), torch.randn(n, H, dtype=torch.float64)
        seqs.append((ids, 1, feats, torch.randint(0, V, (n,))))  # next tokens: some outside the draft vocabulary
    for depth in (1, 2, 3):
        N = max(len(s[0]) for s in seqs)
        emb = torch.stack([torch.cat([table[s[0][1:]], table[:1].expand(N - len(s[0]), H)]) for s in seqs])
        feats = torch.stack([torch.cat([s[2][:-1], torch.zeros(N - len(s[0]), H, dtype=torch.float64)]) for s in seqs])
        padded = layer.unrolled(emb, feats, depth)
        for b, (ids, _, f, _) in enumerate(seqs):
            alone = layer.unrolled(table[ids[1:]], f[:-1], depth)
            for s, (g, h) in enumerate(zip(padded, alone)):
                assert torch.allclose(g[b, s: len(ids) - 1], h[s:], rtol=1e-10, atol=1e-12)
        for soft in (None, teacher):
            layer.zero_grad()
            total, n = eagle_batch_loss(layer, seqs, table, index, depth, soft, reg_weight=0.5)
            total.backward()
            packed = [p.grad.clone() for p in layer.parameters()]
            layer.zero_grad()
            want = sum(eagle_loss(layer, s, table, index, depth, soft, reg_weight=0.5)[0] * (len(s[0]) - 1) for s in seqs)
            want.backward()
            assert n == sum(len(s[0]) - 1 for s in seqs)
            assert torch.allclose(total, want, rtol=1e-10)
            assert all(torch.allclose(a, p.grad, rtol=1e-8, atol=1e-12) for a, p in zip(packed, layer.parameters()))
    many = [(torch.zeros(n, dtype=torch.int64), 0, None, None) for n in random.Random(1).choices(range(3, 200), k=60)]
    for size in (0, 1, 256, 1000):
        passes = pack_answers(many, size, random.Random(2))
        assert sorted(j for p in passes for j in p) == list(range(60))
        assert all(len(p) == 1 or len(p) * max(len(many[j][0]) for j in p) <= size for p in passes)
        assert (len(passes) == 60) == (size < 200)
    assert pack_answers(many, 0, random.Random(3)) != pack_answers(many, 0, random.Random(4))  # a random order
    with pytest.raises(ConfigError, match="--pack-tokens"):
        run_distill(distill_args(STORIES, tmp_path, method="eagle", pack_tokens=-1))
    with pytest.raises(ConfigError, match="train an EAGLE layer"):
        run_distill(distill_args(STORIES, tmp_path, method="medusa", pack_tokens=512))


@pytest.mark.parametrize("aux", [(), (1, 3)], ids=["eagle", "fused"])
def test_soft_token_loss_is_the_cross_entropy_against_the_targets_distribution(tmp_path, aux):
    """`--token-loss soft`: each level's token loss is -sum p log q, p the target's distribution over the draft
    vocabulary (its LM-head rows times its next feature), q the layer's; the hard loss takes the target's greedy
    token alone. The feature regression is added with its weight; a negative weight is refused, and so are
    both options for heads other than EAGLE's. With fused inner layers (EAGLE-3), features carry them after the last
    hidden state: the target's distribution and the regression read the last hidden state alone."""
    torch.manual_seed(0)
    H, V, T = 16, 30, 9
    layer = EagleLayer(H, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=24, rope_theta=10000.0,
                       rms_norm_eps=1e-6, draft_vocab=list(range(0, V, 3)), aux_hidden_layers=aux)
    for lin in (layer.fc, layer.qkv, layer.o, layer.gate_up, layer.down, layer.head) + ((layer.fuse,) if aux else ()):
        torch.nn.init.normal_(lin.weight, std=0.3)
    table, teacher = torch.randn(V, H), torch.randn(len(layer.draft_vocab), H)
    ids, feats = torch.randint(0, V, (T + 1,)), torch.randn(T + 1, H * (1 + len(aux)))
    last = feats[:, :H]
    nxt = layer.draft_vocab[(last @ teacher.t()).argmax(-1)]  # the target's greedy tokens, in the draft vocabulary
    index = torch.full((V,), -100, dtype=torch.int64)
    index[layer.draft_vocab] = torch.arange(len(layer.draft_vocab))
    seq = (ids, 0, feats, nxt)
    for depth in (1, 2):
        soft, n = eagle_loss(layer, seq, table, index, depth, teacher=teacher, reg_weight=0.0)
        hard, _ = eagle_loss(layer, seq, table, index, depth, reg_weight=0.0)
        outs = layer.unrolled(table[ids[1:]], feats[:T], depth)
        want_soft = want_hard = 0.0
        for s, g in enumerate(outs):
            i = torch.arange(s, T)
            q = torch.log_softmax(layer.logits(g[i]), -1)
            want_soft += -(torch.softmax(last[i + 1] @ teacher.t(), -1) * q).sum()
            want_hard += -q.gather(1, index[nxt[i + 1]][:, None]).sum()
        count = sum(T - s for s in range(depth))
        assert n == T
        assert torch.allclose(soft, want_soft / count, rtol=1e-5) and torch.allclose(hard, want_hard / count, rtol=1e-5)
        assert not torch.allclose(soft, hard, rtol=1e-3)
    # the feature regression is added with its weight
    with_reg, _ = eagle_loss(layer, seq, table, index, 1, teacher=teacher, reg_weight=2.0)
    g = layer.unrolled(table[ids[1:]], feats[:T], 1)[0]
    reg = torch.nn.functional.smooth_l1_loss(g, last[1:] / layer.feature_scale, reduction="none").mean(-1).sum() / T
    assert torch.allclose(with_reg, eagle_loss(layer, seq, table, index, 1, teacher=teacher, reg_weight=0.0)[0] + 2 * reg,
                          rtol=1e-5)
    with pytest.raises(ConfigError, match="--feature-loss-weight"):
        run_distill(distill_args(STORIES, tmp_path, method="eagle", feature_loss_weight=-1.0))
    for method in ("medusa", "draft"):  # options of the EAGLE layer's training are not ignored elsewhere
        with pytest.raises(ConfigError, match="train an EAGLE layer"):
            run_distill(distill_args(STORIES, tmp_path, method=method, token_loss="soft"))
        with pytest.raises(ConfigError, match="train an EAGLE layer"):
            run_distill(distill_args(STORIES, tmp_path, method=method, feature_loss_weight=0.5))
    parser = argparse.ArgumentParser()
    add_distill_args(parser)
    assert parser.parse_args(["--out", "x", "--token-loss", "soft"]).token_loss == "soft"
    with pytest.raises(SystemExit):  # a loss it does not know
        parser.parse_args(["--out", "x", "--token-loss", "kl"])


def test_inner_layers_residual_stream_is_handed_over_alike_by_both_layer_loops(checkpoints, tmp_path, monkeypatch):
    """EAGLE-3's fused features: the model hands over the residual stream after the layers asked for, beside the last
    hidden state. The C++ layer loop (a float32 Q4_1 GGUF) gives the same bits as the Python loop, and the stream after
    the last layer, through the final norm, is the last hidden state itself. A layer asked for twice (here layers
    L / 2 and L - 1 of 2 are one) fills both places in both loops: new buffers are NaN here, as uninitialised memory
    may be (before, the Python loop left the first place unwritten, and the test passed when freed memory happened to
    hold the C++ loop's values)."""
    from sieve import LLM
    from sieve.bench.gguf_export import export_gguf

    new_empty = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: new_empty(self, *a, **k).fill_(float("nan")))

    path = export_gguf(checkpoints["llama"], tmp_path / "m.gguf", "q4_1", log=lambda s: None)
    llm = LLM(str(path), dtype="float32", num_gpu_blocks_override=64)
    engine, model = llm.llm_engine, llm.llm_engine.runner.model
    L, H = engine.arch.num_layers, engine.arch.hidden_size
    aux = (0, L // 2, L - 1)
    tokens = list(range(7, 40))
    assert model.native is not None
    native = engine.hidden_states(tokens, aux)
    plain = engine.hidden_states(tokens)
    model.native = None
    python = engine.hidden_states(tokens, aux)
    assert native.shape == (len(tokens), 4 * H)
    assert aux[1] == aux[2] and not native.isnan().any()
    assert torch.equal(native, python)
    assert torch.equal(native[:, :H], plain)  # asking for inner layers changes nothing of the last hidden state
    assert torch.equal(model.norm(native[:, 3 * H:].contiguous()), plain)
    assert not torch.allclose(native[:, H: 2 * H], native[:, 2 * H: 3 * H])  # each layer's own stream


def test_a_resumed_layer_starts_as_the_layer_it_was(tmp_path):
    """`sieve distill --init DIR --aux-hidden-layers ...`: the fused projection a plain layer lacks starts at zero, so
    the layer it resumes drafts exactly as the trained one did on any inner features; a layer fusing other layers, or
    trained for another target, is refused."""
    from sieve.train.distill import resumed_layer

    torch.manual_seed(3)
    H, V, table = _random_layer(tmp_path / "plain")
    arch = SimpleNamespace(hidden_size=H, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48, rope_theta=10000.0,
                           rms_norm_eps=1e-6, vocab_size=V)
    engine = SimpleNamespace(arch=arch)
    feats = torch.randn(20, 3 * H)
    resumed = resumed_layer(engine, str(tmp_path / "plain"), (1, 3), feats, "cpu").eval()
    old, _ = EagleLayer.load(tmp_path / "plain")
    assert resumed.aux_hidden_layers == (1, 3) and not resumed.fuse.weight.any()
    assert torch.allclose(resumed.aux_scale, feats[:, H:].pow(2).mean(0).sqrt())
    with torch.inference_mode():
        emb = table[torch.randint(0, V, (19,))]
        for a, b in zip(resumed.unrolled(emb, feats[:19], 3), old.unrolled(emb, feats[:19, :H], 3)):
            assert torch.equal(a, b)
    _random_layer(tmp_path / "fused", aux=(0, 2))
    with pytest.raises(ConfigError, match="fuses layers"):
        resumed_layer(engine, str(tmp_path / "fused"), (1, 3), feats, "cpu")
    with pytest.raises(ConfigError, match="another target"):
        resumed_layer(SimpleNamespace(arch=SimpleNamespace(**{**vars(arch), "hidden_size": 64})), str(tmp_path / "plain"),
                       (1, 3), feats, "cpu")


def test_eagle3_layer_trained_from_eagle_heads_serves_losslessly(eagle, tmp_path):
    """EAGLE-3's fused features, trained on from the module's EAGLE layer (`--init`): served as method "eagle3", the
    target hands the layers' stream over, the output equals the plain engine's (chunked prefill, sampled requests
    seeded), and the projection learned something. Bad fused layers are refused before any answer is generated, and
    "eagle3" with a layer that fuses none."""
    out, _ = eagle
    fused = tmp_path / "fused"
    report = run_distill(distill_args(STORIES, fused, method="eagle", depth=3, batch_tokens=512, epochs=1,
                                      aux_hidden_layers="1,3", init=str(out), draft_vocab=None))
    config = json.loads((fused / "config.json").read_text())
    assert config["aux_hidden_layers"] == [1, 3] and config["init"] == str(out)
    assert report["draft_vocab_coverage"] > 0 and len(report["history"]) == 1
    layer, _ = EagleLayer.load(fused)
    assert layer.fuse.weight.abs().max() > 1e-3  # trained: it started at zero
    assert report["head_accuracy"][0] > 0.4
    plain = stories()
    spec = stories(max_num_batched_tokens=32,
                   speculative_config={"method": "eagle3", "model": str(fused), "num_speculative_tokens": 3})
    assert spec.llm_engine.runner.aux_hidden_layers == (1, 3)
    prompts, params = workload(12)
    assert ids(spec.generate(prompts, params)) == ids(plain.generate(prompts, params))
    stats = spec.llm_engine.speculator.stats
    assert stats.num_drafts > 20 and stats.num_accepted_tokens > 0.4 * stats.num_drafts
    sampled = [SamplingParams(max_tokens=p.max_tokens, temperature=0.9, seed=i, ignore_eos=True) for i, p in enumerate(params)]
    assert ids(spec.generate(prompts, sampled)) == ids(plain.generate(prompts, sampled))
    assert_pool_clean(spec.llm_engine)
    # refused: layers the target lacks (5 here), words, repeats, the option for other heads, heads fusing other layers
    for bad in ("7", "x", "1,1"):
        with pytest.raises(ConfigError, match="--aux-hidden-layers"):
            run_distill(distill_args(STORIES, tmp_path / "bad", method="eagle", aux_hidden_layers=bad))
    with pytest.raises(ConfigError, match="train an EAGLE layer"):
        run_distill(distill_args(STORIES, tmp_path / "bad", method="medusa", aux_hidden_layers="1"))
    with pytest.raises(ConfigError, match="fuses layers"):
        run_distill(distill_args(STORIES, tmp_path / "bad", method="eagle", aux_hidden_layers="2", init=str(fused)))
    with pytest.raises(ConfigError, match="keeps its draft vocabulary"):  # --draft-vocab is not silently dropped
        run_distill(distill_args(STORIES, tmp_path / "bad", method="eagle", aux_hidden_layers="1,3", init=str(fused),
                                 draft_vocab=len(layer.draft_vocab) + 1))
    with pytest.raises(ConfigError, match="--draft-vocab"):
        run_distill(distill_args(STORIES, tmp_path / "bad", method="eagle", draft_vocab=0))
    with pytest.raises(ValueError, match="fuses no inner layers"):  # vLLM's "eagle3" names a layer that fuses some
        stories(speculative_config={"method": "eagle3", "model": str(out), "num_speculative_tokens": 3})
    cfg = {**config, "aux_hidden_layers": [1, 9]}
    (tmp_path / "far").mkdir()
    (tmp_path / "far" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "far" / "eagle.safetensors").write_bytes((fused / "eagle.safetensors").read_bytes())
    with pytest.raises(ConfigError, match="has 5"):
        stories(speculative_config={"method": "eagle", "model": str(tmp_path / "far"), "num_speculative_tokens": 3})
    (tmp_path / "far" / "config.json").write_text(json.dumps({**config, "aux_hidden_layers": "1,3"}))
    with pytest.raises(ValueError, match="aux_hidden_layers"):
        stories(speculative_config={"method": "eagle", "model": str(tmp_path / "far"), "num_speculative_tokens": 3})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rotation_is_looked_up_with_the_bits_of_the_textbook_form(tmp_path, monkeypatch, dtype):
    """The layer's rotation comes from a table kept per device and dtype, applied as x cos + (halves swapped) signed
    sin: the same bits as computing cos and sin of each position and rotating [x1 cos - x2 sin, x2 cos + x1 sin]
    (what the layer was trained with), however the table grew. A proposer's later passes compute no rotation (cos,
    sin), and on the CPU hand the attention its keys' own heads (the operator takes the groups, no copy repeats them)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(0)
    layer = EagleLayer(64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48, rope_theta=10000.0,
                       rms_norm_eps=1e-6, draft_vocab=list(range(8))).to(dtype)
    pos = torch.tensor([0, 3, 77, 255, 256, 1023, 5000])
    freqs = pos[:, None].to(torch.float32) * layer.inv_freq
    cos, sin = freqs.cos()[:, None, :].to(dtype), freqs.sin()[:, None, :].to(dtype)
    x = torch.randn(len(pos), 6, 16).to(dtype)
    x1, x2 = x.chunk(2, dim=-1)
    textbook = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    small = layer._rotary(pos[:3], 78, dtype)  # a table of 256 rows, grown below
    assert torch.equal(layer._rope(x, *layer._rotary(pos, 5001, dtype)), textbook)
    assert all(torch.equal(a, b[:3]) for a, b in zip(small, layer._rotary(pos, 5001, dtype)))

    H, V, table = _random_layer(tmp_path)  # 4 heads over 2 KV heads
    proposer = EagleProposer(str(tmp_path), H, V, torch.device("cpu"), torch.float32, embed=lambda t: table[t])
    feats, tokens = torch.randn(30, H), torch.randint(0, V, (30,)).tolist()
    seq = FakeSeq(token_ids=tokens[:11], num_computed_tokens=10)
    proposer.observe_hidden(seq, 0, feats[:10])
    proposer.propose([seq], [3], [2])  # the table is made here
    seen = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    seq.token_ids, seq.num_computed_tokens = tokens[:13], 12
    proposer.observe_hidden(seq, 10, feats[10:12])
    sdpa, heads = torch.nn.functional.scaled_dot_product_attention, []

    def attention(q, k, v, **kw):
        heads.append((q.shape[-3], k.shape[-3], v.shape[-3]))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", attention)
    with Count():
        drafts = proposer.propose([seq], [3], [2])
    assert len(drafts[0].token_ids) == 3 and len(drafts[0].alternatives) == 1
    assert "index_select" in seen and not {"cos", "sin"} & set(seen)
    assert heads == [(4, 2, 2)] * 3  # entering the committed positions (token 1), then tokens 2 and 3: 2 key heads as they are

