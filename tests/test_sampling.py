"""Every sampling option has the effect it claims; seeds reproduce; stops end text correctly."""

from __future__ import annotations

import collections

import pytest
import torch

from sieve import SamplingParams
from sieve.sampler import SamplingMetadata, sample

PROMPT = {"prompt_token_ids": [11, 12, 13, 14, 15]}


def one(llm, **kw):
    return llm.generate([PROMPT], SamplingParams(**kw))[0].outputs[0]


# ---- the sampler on synthetic logits ----------------------------------------------------------
def meta_for(B, V, **over):
    m = dict(
        temperature=torch.ones(B), greedy=torch.zeros(B, dtype=torch.bool), top_k=None, top_p=None, min_p=None,
        presence=None, frequency=None, repetition=None, output_ids=None, prompt_ids=None,
        banned=[[] for _ in range(B)], bias=None, seeds=[None] * B, num_logprobs=-1,
    )
    m.update(over)
    return SamplingMetadata(**m)


def draw(logits_row, n=400, **over):
    counts = collections.Counter()
    for i in range(n):
        m = meta_for(1, logits_row.numel(), seeds=[i], **over)
        counts[sample(logits_row[None].clone(), m).token_ids.item()] += 1
    return counts


LOGITS = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0])  # probs ~ .45 .27 .17 .06 .02 .01


def test_top_k_keeps_only_k_tokens():
    assert set(draw(LOGITS, top_k=torch.tensor([2]))) == {0, 1}


def test_top_p_keeps_the_smallest_nucleus():
    assert set(draw(LOGITS, top_p=torch.tensor([0.6]))) == {0, 1}  # .45 < .6 <= .45 + .27


def test_top_k_and_top_p_from_the_largest_logits_are_the_full_sorts():
    """The candidates' path (a row's 256 largest logits, then 2,048) keeps what a sort of the whole vocabulary keeps,
    row by row: top-p alone, top-k alone, both, top-k past the first candidates, neither (every logit kept) beside
    limited rows, and a flat row whose nucleus reaches past 2,048 (the full sort's, for that row alone)."""
    from sieve.sampler import nucleus, nucleus_by_full_sort, nucleus_from_candidates

    g = torch.Generator().manual_seed(0)
    V = 5000
    logits = torch.randn(6, V, generator=g) * 4
    logits[5] *= 0.02  # flat: its nucleus at 0.99 holds most of the vocabulary
    top_k, top_p = torch.tensor([V, 50, 40, 1000, V, V]), torch.tensor([0.9, 1.0, 0.5, 0.8, 1.0, 0.99])
    full = nucleus_by_full_sort(logits, top_k, top_p)
    for i in (0, 2, 3):  # the cut is no near-tie: no token's mass before it lies within 1e-5 of top-p (a premise that
        # holds on every CPU, whose exp and sums round a little otherwise)
        sorted_logits = logits[i].sort(descending=True).values
        sorted_logits[int(top_k[i]):] = float("-inf")
        p = sorted_logits.softmax(-1)
        assert ((p.cumsum(-1) - p) - top_p[i]).abs().min() > 1e-5
    kept, covered = nucleus_from_candidates(logits, top_k, top_p, 256)
    assert covered.tolist() == [True, True, True, False, True, False]  # top-k 1,000: past the first candidates
    both = [0, 1, 2, 4]
    assert torch.equal(kept[both], full[both])
    assert torch.isfinite(kept[4]).all() and 1 < int(torch.isfinite(kept[0]).sum()) < 256
    assert nucleus_from_candidates(logits, top_k, top_p, 2048)[1].tolist() == [True] * 5 + [False]
    assert 2048 < int(torch.isfinite(full[5]).sum()) < V
    got = nucleus(logits, top_k, top_p)
    assert torch.equal(got, full)
    for i in range(6):  # a row alone: the same set
        assert torch.equal(nucleus(logits[i:i + 1], top_k[i:i + 1], top_p[i:i + 1])[0], got[i])


def test_min_p_drops_tokens_below_fraction_of_the_best():
    assert set(draw(LOGITS, min_p=torch.tensor([0.3]))) == {0, 1, 2}  # .17 / .45 > .3 > .06 / .45


def test_temperature_sharpens_and_flattens():
    cold = draw(LOGITS, temperature=torch.tensor([0.2]))
    hot = draw(LOGITS, temperature=torch.tensor([5.0]))
    assert cold[0] > 340 and len(hot) == 6 and hot[0] < 150  # p0: .92 at T=.2, .45 at T=1, ~.2 at T=5


def test_sampling_follows_the_distribution():
    counts = draw(LOGITS, n=2000)
    probs = LOGITS.softmax(-1)
    for t in range(3):
        assert counts[t] / 2000 == pytest.approx(probs[t].item(), abs=0.04)


def test_a_draw_never_takes_a_zero_weight_and_a_seeded_row_is_its_own():
    """Inverting the cumulative weights at one uniform: zero weights (before, between and after the others) are never
    drawn, the frequencies follow the weights, and a seeded row draws the same token alone or among others."""
    from sieve.sampler import draw as draw_rows

    w = torch.tensor([[0.0, 0.5, 0.0, 0.0, 0.3, 0.2, 0.0]])
    g = torch.Generator().manual_seed(0)
    got = collections.Counter(int(t) for t in draw_rows(w.expand(3000, -1), [None] * 3000, g))
    assert set(got) == {1, 4, 5}
    for t, p in ((1, 0.5), (4, 0.3), (5, 0.2)):
        assert got[t] / 3000 == pytest.approx(p, abs=0.03)
    rows = torch.rand(5, 40, generator=g)
    seeds = [11, None, 12, 13, None]
    together = draw_rows(rows, seeds, g)
    for i, seed in enumerate(seeds):
        if seed is not None:
            assert int(draw_rows(rows[i:i + 1], [seed], g)[0]) == int(together[i])


def test_penalties_arithmetic():
    V = 6
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0, 0.0, 0.0]])
    out_ids = torch.tensor([[0, 0, 1, V]])  # token 0 twice, token 1 once (V = padding)
    m = meta_for(1, V, greedy=torch.ones(1, dtype=torch.bool), output_ids=out_ids,
                 frequency=torch.tensor([0.5]), presence=torch.tensor([0.25]))
    x = logits.clone()
    sample(x, m)
    assert x.tolist() == [[2.0 - 1.0 - 0.25, -2.0 - 0.5 - 0.25, 1.0, 1.0, 0.0, 0.0]]
    m = meta_for(1, V, greedy=torch.ones(1, dtype=torch.bool), output_ids=out_ids,
                 repetition=torch.tensor([2.0]), prompt_ids=torch.tensor([[2, V]]))
    x = logits.clone()
    sample(x, m)
    assert x.tolist() == [[1.0, -4.0, 0.5, 1.0, 0.0, 0.0]]  # seen: 0, 1 (output), 2 (prompt)


# ---- through the engine ---------------------------------------------------------------------------
def test_logit_bias_adds_to_the_logits_of_its_row_only():
    logits = torch.stack([LOGITS, LOGITS])
    bias = (torch.tensor([0, 0]), torch.tensor([4, 0]), torch.tensor([10.0, -100.0]))
    m = meta_for(2, 6, temperature=torch.zeros(2), greedy=torch.ones(2, dtype=torch.bool), bias=bias, num_logprobs=2)
    out = sample(logits.clone(), m)
    assert out.token_ids.tolist() == [4, 0]  # row 0: token 4 lifted from 0.0 to 10.0 (token 0 pushed down); row 1 untouched
    # the reported logprobs are the model's, before the bias (as OpenAI and vLLM report them)
    assert out.logprobs[0].item() == pytest.approx(torch.log_softmax(LOGITS, -1)[4].item())
    counts = draw(LOGITS, n=300, bias=(torch.tensor([0]), torch.tensor([0]), torch.tensor([-100.0])))
    assert counts[0] == 0 and sum(counts.values()) == 300  # -100 bans a token in sampling too


def test_logit_bias_through_the_engine(llama_llm):
    plain = one(llama_llm, max_tokens=8, temperature=0, ignore_eos=True).token_ids
    forced = one(llama_llm, max_tokens=8, temperature=0, ignore_eos=True, logit_bias={77: 100.0}).token_ids
    assert plain != [77] * 8 and forced == [77] * 8
    banned = one(llama_llm, max_tokens=8, temperature=0, ignore_eos=True, logit_bias={plain[0]: -100.0}).token_ids
    assert banned[0] != plain[0]
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: float("nan")})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(ValueError, match="out of range"):
        llama_llm.generate([PROMPT], SamplingParams(max_tokens=2, logit_bias={10**9: 1.0}))
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        for value in (float("nan"), float("inf"), float("-inf")):
            with pytest.raises(ValueError, match=name):
                SamplingParams(**{name: value})
    assert one(llama_llm, max_tokens=8, temperature=0, ignore_eos=True).token_ids == plain  # recovers after the bad request


def test_greedy_ignores_seed_and_top_k_1_is_greedy(llama_llm):
    greedy = one(llama_llm, max_tokens=12, temperature=0, ignore_eos=True).token_ids
    assert one(llama_llm, max_tokens=12, temperature=0, seed=7, ignore_eos=True).token_ids == greedy
    assert one(llama_llm, max_tokens=12, temperature=1.0, top_k=1, seed=3, ignore_eos=True).token_ids == greedy
    assert one(llama_llm, max_tokens=12, temperature=1.0, min_p=1.0, seed=3, ignore_eos=True).token_ids == greedy


def test_seed_reproduces_and_different_seeds_differ(llama_llm):
    a = one(llama_llm, max_tokens=24, temperature=1.0, seed=42, ignore_eos=True).token_ids
    b = one(llama_llm, max_tokens=24, temperature=1.0, seed=42, ignore_eos=True).token_ids
    c = one(llama_llm, max_tokens=24, temperature=1.0, seed=43, ignore_eos=True).token_ids
    assert a == b and a != c


def test_n_choices_are_distinct_and_seeded(llama_llm):
    sp = SamplingParams(n=3, max_tokens=16, temperature=1.0, seed=5, ignore_eos=True)
    out = llama_llm.generate([PROMPT], sp)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3
    again = llama_llm.generate([PROMPT], sp)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]


def test_frequency_and_presence_penalties_reduce_repetition(llama_llm):
    plain = one(llama_llm, max_tokens=64, temperature=0, ignore_eos=True).token_ids
    penalised = one(llama_llm, max_tokens=64, temperature=0, frequency_penalty=2.0, presence_penalty=2.0, ignore_eos=True).token_ids
    rep = one(llama_llm, max_tokens=64, temperature=0, repetition_penalty=3.0, ignore_eos=True).token_ids
    assert len(set(penalised)) > len(set(plain))
    assert len(set(rep)) > len(set(plain))


def test_max_tokens_and_length_finish(llama_llm):
    out = one(llama_llm, max_tokens=7, temperature=0, ignore_eos=True)
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_stop_token_ids_and_eos_and_min_tokens(llama_llm):
    greedy = one(llama_llm, max_tokens=20, temperature=0, ignore_eos=True).token_ids
    stop_at = greedy[5]
    first = greedy.index(stop_at)
    out = one(llama_llm, max_tokens=20, temperature=0, stop_token_ids=[stop_at])
    assert out.token_ids == greedy[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_at
    # min_tokens bans the stop token until reached
    out = one(llama_llm, max_tokens=20, temperature=0, stop_token_ids=[stop_at], min_tokens=first + 2)
    assert len(out.token_ids) > first + 1 and stop_at not in out.token_ids[: first + 2]


def test_eos_ends_unless_ignored_and_min_tokens_bans_it(llama_llm, llama_dir, tmp_path):
    import json
    import shutil

    from sieve import LLM

    greedy = one(llama_llm, max_tokens=20, temperature=0, ignore_eos=True).token_ids
    eos = greedy[4]
    first = greedy.index(eos)
    path = tmp_path / "eos-model"
    shutil.copytree(llama_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["eos_token_id"] = eos
    (path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(path), dtype="float32", num_gpu_blocks_override=64)
    out = one(llm, max_tokens=20, temperature=0)
    assert out.token_ids == greedy[: first + 1] and out.finish_reason == "stop" and out.stop_reason == eos
    assert one(llm, max_tokens=20, temperature=0, ignore_eos=True).token_ids == greedy
    banned = one(llm, max_tokens=20, temperature=0, min_tokens=first + 3)
    assert eos not in banned.token_ids[: first + 3] and len(banned.token_ids) >= first + 3


def test_stop_strings_are_cut_and_span_tokens(llama_llm):
    tok = llama_llm.get_tokenizer()
    full = one(llama_llm, max_tokens=30, temperature=0, ignore_eos=True)
    # pick a stop string that straddles the boundary between two generated tokens
    pieces = [tok.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
    k = next(i for i in range(3, len(pieces)) if len(pieces[i - 1]) >= 2 and len(pieces[i]) - len(pieces[i - 1]) >= 2)
    boundary = len(pieces[k - 1])
    stop = full.text[boundary - 1 : boundary + 1]
    assert stop not in full.text[: boundary - 1] + full.text[boundary - 1 : boundary]  # only at the boundary
    out = one(llama_llm, max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
    cut = full.text.index(stop)
    assert out.text == full.text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) == k + 1  # generation stopped at the token completing the stop string
    inc = one(llama_llm, max_tokens=30, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert inc.text == full.text[: cut + len(stop)]


def test_logprobs_hold_top_n_and_the_chosen_token(llama_llm):
    out = one(llama_llm, max_tokens=6, temperature=1.0, seed=1, logprobs=3, ignore_eos=True)
    assert len(out.logprobs) == 6
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and 3 <= len(lp) <= 4
        ranked = sorted((e.rank, e.logprob) for e in lp.values())
        assert [lp_ for _, lp_ in ranked] == sorted((lp_ for _, lp_ in ranked), reverse=True)
        assert all(e.logprob <= 0 for e in lp.values())
    assert out.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)))
    greedy = one(llama_llm, max_tokens=4, temperature=0, logprobs=0, ignore_eos=True)
    assert all(len(lp) == 1 and lp[t].rank == 1 for t, lp in zip(greedy.token_ids, greedy.logprobs))
