"""Prompt logprobs (vLLM's `prompt_logprobs`, OpenAI's `echo` + `logprobs`): every prompt token after the
first is scored by the logits of the position before it, whatever path computed the prompt's K/V
(one pass, chunks, a prefix-cache hit, a preemption in the middle of the prefill)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from sieve import SamplingParams


PROMPT = [random.Random(7).randrange(3, 4096) for _ in range(150)]


@pytest.fixture(scope="module")
def hf_logprobs(llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)  # [T, V]


def check_against(lps, reference: torch.Tensor, n_top: int) -> None:
    assert lps[0] is None and len(lps) == len(PROMPT)
    for pos, (tok, entry) in enumerate(zip(PROMPT[1:], lps[1:])):
        row = reference[pos]
        assert math.isclose(entry[tok].logprob, row[tok].item(), rel_tol=0, abs_tol=1e-4)
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1
        top = row.topk(n_top).indices.tolist()
        assert [t for t, v in sorted(entry.items(), key=lambda kv: kv[1].rank) if v.rank <= n_top] == top
        assert len(entry) in (n_top, n_top + 1)  # the top-N, plus the prompt token when it is not among them


def test_prompt_logprobs_match_transformers(llama_llm, hf_logprobs):
    out = llama_llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))[0]
    check_against(out.prompt_logprobs, hf_logprobs, 3)
    # the first generated token is what the last prompt position's logits rank first
    assert out.outputs[0].token_ids[0] == int(hf_logprobs[-1].argmax())


@pytest.mark.parametrize("path", ["chunked", "prefix-cached", "preempted"])
def test_prompt_logprobs_are_the_same_on_every_prefill_path(llama_engine_factory, hf_logprobs, path):
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2, ignore_eos=True)
    if path == "chunked":  # 150 prompt tokens in chunks of 32, each reading the earlier ones from the cache
        llm = llama_engine_factory(max_num_batched_tokens=32)
        out = llm.generate({"prompt_token_ids": PROMPT}, params)[0]
    elif path == "prefix-cached":  # the whole prompt is cached first, by a request that asks for no logprobs
        llm = llama_engine_factory()
        warm = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1))[0]
        again = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1))[0]
        assert warm.num_cached_tokens == 0 and again.num_cached_tokens == 144  # the cache does serve this prompt
        out = llm.generate({"prompt_token_ids": PROMPT}, params)[0]
    else:  # a pool so small that a long-running request and this prompt cannot both stay: preemption mid-prefill
        llm = llama_engine_factory(num_gpu_blocks_override=12, max_num_batched_tokens=48)
        engine = llm.llm_engine
        engine.add_request("first", {"prompt_token_ids": PROMPT[:40]}, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
        engine.add_request("second", {"prompt_token_ids": PROMPT}, params)
        before = engine.scheduler.num_preemptions
        done = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o
        assert engine.scheduler.num_preemptions > before
        out = done["second"]
    check_against(out.prompt_logprobs, hf_logprobs, 2)


def test_sibling_choices_share_one_set_of_prompt_logprobs(llama_llm, hf_logprobs):
    out = llama_llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(n=3, max_tokens=3, temperature=1.0, seed=5,
                                                                           prompt_logprobs=0))[0]
    assert len(out.outputs) == 3
    lps = out.prompt_logprobs
    assert lps[0] is None and len(lps) == len(PROMPT)
    assert all(set(d) == {t} for d, t in zip(lps[1:], PROMPT[1:]))  # prompt_logprobs=0: the prompt token alone
    assert all(abs(d[t].logprob - hf_logprobs[i, t].item()) < 1e-4 for i, (d, t) in enumerate(zip(lps[1:], PROMPT[1:])))


def test_bad_logprob_requests_are_refused_and_the_llm_recovers(llama_llm):
    prompt = {"prompt_token_ids": PROMPT[:10]}
    for bad in (dict(logprobs=21), dict(prompt_logprobs=10**6), dict(stop_token_ids=[10**7])):
        with pytest.raises(ValueError, match="logprobs|stop_token_ids"):
            llama_llm.generate(prompt, SamplingParams(max_tokens=2, **bad))
    for bad in (dict(prompt_logprobs=-1), dict(stop_token_ids=[-1]), dict(logprobs=True)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert not llama_llm.llm_engine.has_unfinished()
    out = llama_llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3


def test_a_failed_step_leaves_the_llm_usable(llama_engine_factory, monkeypatch):
    llm = llama_engine_factory()
    runner = llm.llm_engine.runner
    real = runner.execute
    calls = {"n": 0}

    def flaky(sched):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        return real(sched)

    monkeypatch.setattr(runner, "execute", flaky)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([{"prompt_token_ids": PROMPT[:20]}] * 3, SamplingParams(max_tokens=5, ignore_eos=True))
    assert not llm.llm_engine.has_unfinished() and not llm.llm_engine.requests
    assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_blocks
    outs = llm.generate([{"prompt_token_ids": PROMPT[:20]}] * 2, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]


def test_max_tokens_0_scores_the_prompt_only(llama_llm, hf_logprobs):
    out = llama_llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(n=2, max_tokens=0, prompt_logprobs=1))[0]
    assert [c.token_ids for c in out.outputs] == [[], []] and {c.finish_reason for c in out.outputs} == {"length"}
    check_against(out.prompt_logprobs, hf_logprobs, 1)
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        SamplingParams(max_tokens=0)
    bm = llama_llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
