"""Medusa heads: `sieve distill` trains them on the target's own answers and saves them; served through
`speculative_config`, they draft from the hidden state each step already computed, and the output is exactly
the output without speculation (greedy, seeded, among other requests, with chunked prefill)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from sieve import SamplingParams
from sieve.train.distill import add_distill_args, run_distill

from conftest import SHARED
from test_spec import assert_pool_clean, count_chosen_branches, ids

STORIES = SHARED / "models" / "stories260K"  # a tiny trained model: its answers are predictable enough to learn
OPENINGS = ["Once upon a time, there was a little girl named Lily.", "Tom and his dog went to the park.",
            "One day, a big bird flew over the house.", "The sun was hot and the children wanted to swim.",
            "Ben had a red ball.", "Mom said, \"Let's bake a cake!\"", "There was a small frog in the pond.",
            "Sue found a shiny key under her bed.", "The old man lived in a tiny house.", "Max liked to draw cats."]


def stories(**kwargs):
    from sieve import LLM

    return LLM(str(STORIES), dtype="float32", device="cpu", **{"num_gpu_blocks_override": 256, **kwargs})


def workload(n: int):
    prompts = [OPENINGS[i % len(OPENINGS)] + " " * (i // len(OPENINGS)) for i in range(n)]
    return prompts, [SamplingParams(max_tokens=24 + (7 * i) % 40, temperature=0, ignore_eos=True) for i in range(n)]


def distill_args(target, out, **overrides) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_distill_args(p)
    args = p.parse_args(["--target", str(target), "--out", str(out), "--prompts", "160", "--max-tokens", "96",
                         "--epochs", "4", "--draft-vocab", "512", "--lr", "3e-3", "--batch-size", "128", "--dtype", "float32",
                         "--kv-cache-memory-gb", "0.25"])
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


@pytest.fixture(scope="module", params=["hydra", "medusa"])
def heads(request, tmp_path_factory):
    """Sequential heads (Hydra, the default) and independent ones (Medusa-1), trained on stories260K's answers."""
    out = tmp_path_factory.mktemp(request.param)
    report = run_distill(distill_args(STORIES, out, independent_heads=request.param == "medusa"))
    assert report["head_type"] == request.param
    return out, report


def test_distill_trains_and_reports_simulated_acceptance(heads):
    out, report = heads
    config = json.loads((out / "config.json").read_text())
    assert config["method"] == "medusa" and config["num_heads"] == 3 and config["hidden_size"] > 0
    assert config["sequential"] == (report["head_type"] == "hydra")
    assert len(report["history"]) == 4
    first, last = report["history"][0], report["history"][-1]
    assert last["loss"] < first["loss"]  # it learns
    assert 0.3 < last["head_accuracy"][0] <= 1  # stories are predictable: the first head is right often
    sim = config["simulated_mean_acceptance_length"]
    assert 1.0 < sim["1"] <= sim["2"] <= sim["3"] <= 4.0


def test_medusa_greedy_and_seeded_output_equal_no_speculation(heads):
    out, _ = heads
    plain = stories()
    spec = stories(max_num_batched_tokens=32,  # chunked prefill in the mix
                   speculative_config={"method": "medusa", "model": str(out), "num_speculative_tokens": 3})
    prompts, params = workload(33)
    assert ids(spec.generate(prompts, params)) == ids(plain.generate(prompts, params))
    stats = spec.llm_engine.speculator.stats
    assert stats.num_drafts > 50 and stats.num_accepted_tokens > 0.3 * stats.num_drafts  # the heads guess right often
    sampled = [SamplingParams(max_tokens=p.max_tokens, temperature=0.9, seed=i, ignore_eos=True) for i, p in enumerate(params)]
    assert ids(spec.generate(prompts, sampled)) == ids(plain.generate(prompts, sampled))
    assert_pool_clean(spec.llm_engine)


def test_medusa_draft_tree_is_lossless(heads):
    """num_branches = 3: the first head's three likeliest tokens, each followed by the later heads' guesses (a
    sequential head's after that chain's own tokens). The first chain is what the heads draft alone; greedy output
    equals the plain engine's, and the other chains are kept where the first is wrong."""
    from sieve.spec_decode.medusa import MedusaHeads

    out, _ = heads
    layer, _ = MedusaHeads.load(out)
    hidden = torch.randn(5, layer.hidden_size)
    last = torch.randn(5, layer.hidden_size)
    embed = torch.nn.Embedding(int(layer.draft_vocab.max()) + 1, layer.hidden_size)
    tree = layer.draft_tree(hidden, 3, 3, last, embed)
    assert tree.shape == (5, 3, 3)
    assert torch.equal(tree[:, 0], layer.draft(hidden, 3, last, embed))
    assert all(len(set(t[:, 0].tolist())) == 3 for t in tree)  # distinct first tokens
    plain = stories()
    spec = stories(speculative_config={"method": "medusa", "model": str(out), "num_speculative_tokens": 3, "num_branches": 3})
    engine = spec.llm_engine
    chosen = count_chosen_branches(engine)
    prompts, params = workload(16)
    assert ids(spec.generate(prompts, params)) == ids(plain.generate(prompts, params))
    assert len(chosen) > 50 and chosen.count(1) + chosen.count(2) > 5
    assert_pool_clean(engine)


def test_medusa_auto_depth_is_lossless(heads):
    out, _ = heads
    plain = stories()
    spec = stories(speculative_config={"method": "medusa", "model": str(out), "num_speculative_tokens": "auto"})
    prompts, params = workload(12)
    assert ids(spec.generate(prompts, params)) == ids(plain.generate(prompts, params))


def test_bad_medusa_configs_are_refused(heads, tmp_path):
    """A missing model, a folder without heads, more tokens than heads, heads of another hidden size; Medusa heads
    given as an EAGLE layer."""
    out, _ = heads
    with pytest.raises(ValueError, match='needs "model"'):
        stories(speculative_config={"method": "medusa"})
    with pytest.raises(ValueError, match="holds no Medusa heads"):
        stories(speculative_config={"method": "medusa", "model": str(tmp_path)})
    with pytest.raises(ValueError, match="3 heads"):
        stories(speculative_config={"method": "medusa", "model": str(out), "num_speculative_tokens": 5})
    from sieve.spec_decode.medusa import MedusaProposer

    with pytest.raises(ValueError, match="hidden size"):
        MedusaProposer(str(out), hidden_size=999, vocab_size=512, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="vocabulary"):
        MedusaProposer(str(out), hidden_size=json.loads((out / "config.json").read_text())["hidden_size"], vocab_size=8,
                       device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="not an EAGLE layer"):
        stories(speculative_config={"method": "eagle", "model": str(out)})
