"""Automatic prefix caching: shared prompt blocks are computed once and outputs do not change at all."""

from __future__ import annotations

import copy
import random
import time

import pytest

from sieve.block_manager import BlockManager
from sieve.outputs import RequestMetrics
from sieve.sampling_params import SamplingParams
from sieve.sequence import Request, Sequence


def make_seq(tokens, order=0):
    req = Request(f"r{order}", None, list(tokens), SamplingParams(), 0, RequestMetrics(arrival_time=time.monotonic()))
    seq = Sequence(request=req, index=0, arrival_order=order, token_ids=list(tokens), seed=None)
    req.seqs.append(seq)
    return seq


def run_prefill(bm: BlockManager, seq: Sequence) -> int:
    """What the scheduler does for a sequence's whole prefill in one step."""
    hit = bm.take_cached_prefix(seq)
    assert bm.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)
    return hit


def test_blocks_are_shared_only_when_the_whole_prefix_matches():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    a = make_seq(range(10))  # blocks [0-3] [4-7] + 2 tokens
    assert run_prefill(bm, a) == 0 and bm.num_cached_blocks == 2  # only full blocks enter the cache
    b = make_seq(list(range(8)) + [99, 98, 97])
    assert run_prefill(bm, b) == 8 and b.block_table[:2] == a.block_table[:2]
    assert [bm.ref_counts[x] for x in a.block_table[:2]] == [2, 2]
    c = make_seq([0, 1, 2, 3, 7, 7, 7, 7, 8])  # first block matches, second differs
    assert run_prefill(bm, c) == 4
    d = make_seq([5, 1, 2, 3, 4, 5, 6, 7, 8])  # second block equals a's, but the prefix before it does not
    assert run_prefill(bm, d) == 0


def test_a_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    run_prefill(bm, make_seq(range(8)))
    again = make_seq(range(8))
    assert bm.take_cached_prefix(again) == 4  # the last block is recomputed, so logits exist to sample
    assert again.num_computed_tokens == 4 and again.num_tokens - again.num_computed_tokens == 4


def test_finished_blocks_stay_cached_and_are_evicted_lru_only_when_needed():
    bm = BlockManager(6, 4, enable_prefix_caching=True)
    a, b = make_seq(range(8), 0), make_seq(range(100, 108), 1)
    run_prefill(bm, a)
    run_prefill(bm, b)
    bm.free(a)
    bm.free(b)  # freed last: b's blocks are the most recently used
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 4 and len(bm.free_blocks) == 2
    c = make_seq(range(200, 216), 2)  # needs 4 blocks: 2 never-cached ones first, then a's (oldest)
    run_prefill(bm, c)
    assert bm.num_evictions == 2
    bm.free(c)
    assert run_prefill(bm, make_seq(range(100, 109), 3)) == 8  # b survived
    assert bm.cached_prefix_blocks(make_seq(range(9), 4)) == []  # a was evicted


def test_truncate_drops_rolled_back_blocks_from_the_cache():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    seq = make_seq(range(12))
    run_prefill(bm, seq)
    assert bm.num_cached_blocks == 3
    bm.truncate(seq, 5)
    assert len(seq.block_table) == 2 and bm.num_cached_blocks == 1 and seq.num_registered_blocks == 1


def test_namespace_keys_the_cache():
    one = BlockManager(4, 4, True, namespace="model-a|bf16|kv:bf16")
    two = BlockManager(4, 4, True, namespace="model-a|bf16|kv:fp8")
    s1, s2 = make_seq(range(8)), make_seq(range(8))
    one._hashes(s1, 2)
    two._hashes(s2, 2)
    assert s1.block_hashes[0] != s2.block_hashes[0]


# ---- the engine, cache on against cache off -------------------------------------------------------

def mixed_workload(seed: int = 0):
    """Heavy sharing: 3 system prompts (of lengths that end mid-block) and one prompt repeated whole,
    short distinct tails; greedy and seeded sampling; some n=2."""
    rng = random.Random(seed)
    systems = [[rng.randrange(10, 4000) for _ in range(n)] for n in (45, 70, 33)]
    prompts, params = [], []
    for i in range(24):
        if i % 6 == 5:
            prompt = systems[0] + [7, 7, 7]  # the very same prompt again
        else:
            prompt = systems[i % 3] + [rng.randrange(10, 4000) for _ in range(rng.randint(1, 20))]
        prompts.append({"prompt_token_ids": prompt})
        sampled = i % 2 == 1
        params.append(SamplingParams(max_tokens=rng.randint(8, 24), temperature=0.8 if sampled else 0.0,
                                     seed=1000 + i if sampled else None, ignore_eos=True, n=2 if i % 8 == 3 else 1))
    return prompts, params


def generate(llm, prompts, params):
    """Submit in waves so later requests find earlier ones' blocks, and check the write invariant
    every step: a block being written is held by one sequence only and is not in the cache."""
    engine = llm.llm_engine
    bm, execute = engine.block_manager, engine.runner.execute

    def checked(sched):
        for s in sched.scheduled:
            first = s.seq.num_computed_tokens // bm.block_size
            last = (s.seq.num_computed_tokens + s.num_new_tokens - 1) // bm.block_size
            for block in s.seq.block_table[first : last + 1]:
                assert bm.ref_counts[block] == 1 and bm.block_hash[block] is None
        return execute(sched)

    engine.runner.execute = checked
    outs = {}
    for wave in range(0, len(prompts), 6):
        for i in range(wave, min(wave + 6, len(prompts))):
            engine.add_request(str(i), prompts[i], copy.deepcopy(params[i]))
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out
    return [outs[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def workload():
    return mixed_workload()


@pytest.mark.parametrize("blocks,budget", [(512, 2048), (20, 24)])  # plenty of room; tight memory + tiny budget
def test_outputs_identical_with_cache_on_and_off(llama_engine_factory, workload, blocks, budget):
    prompts, params = workload
    base = generate(llama_engine_factory(enable_prefix_caching=False, num_gpu_blocks_override=blocks,
                                         max_num_batched_tokens=budget), prompts, params)
    llm = llama_engine_factory(enable_prefix_caching=True, num_gpu_blocks_override=blocks, max_num_batched_tokens=budget)
    cached = generate(llm, prompts, params)
    for a, b in zip(base, cached):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    engine, bm = llm.llm_engine, llm.llm_engine.block_manager
    assert bm.num_hit_tokens > 0 and sum(o.num_cached_tokens for o in cached) > 0
    assert all(o.num_cached_tokens == 0 for o in base)
    # accounting: free + cached-unreferenced = all blocks, and nothing is referenced any more
    assert len(bm.free_blocks) + len(bm.evictable) == bm.num_blocks and sum(bm.ref_counts) == 0
    assert all(bm.block_hash[b] is not None for b in bm.evictable)
    if blocks == 20:
        assert engine.scheduler.num_preemptions > 0  # memory pressure really happened
        assert bm.num_evictions > 0  # and cached blocks were evicted to make room


def test_repeated_prompt_reports_cached_tokens(llama_engine_factory):
    llm = llama_engine_factory(enable_prefix_caching=True)
    prompt = {"prompt_token_ids": list(range(100, 150))}  # 50 tokens: 3 full blocks of 16
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    first = llm.generate([prompt], p)[0]
    second = llm.generate([prompt], p)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 48
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


def test_lpm_admits_longest_cached_prefix_first_with_a_starvation_guard(llama_engine_factory):
    llm = llama_engine_factory(enable_prefix_caching=True, scheduling_policy="lpm", lpm_min_waiting=2,
                               max_num_seqs=1, lpm_max_wait_s=60.0)
    engine = llm.llm_engine
    shared = list(range(200, 264))  # 4 full blocks
    llm.generate([{"prompt_token_ids": shared + [1]}], SamplingParams(max_tokens=2, temperature=0))
    p = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    engine.add_request("cold", {"prompt_token_ids": list(range(300, 340))}, copy.deepcopy(p))
    engine.add_request("warm", {"prompt_token_ids": shared + [2, 3]}, copy.deepcopy(p))
    first = engine.scheduler.schedule().scheduled[0].seq.request.request_id
    assert first == "warm"  # arrived later, but its 64-token prefix is cached
    while engine.has_unfinished():
        engine.step()

    engine.scheduler.config.lpm_max_wait_s = 0.0  # everyone counts as starved: oldest first
    engine.add_request("cold2", {"prompt_token_ids": list(range(400, 440))}, copy.deepcopy(p))
    engine.add_request("warm2", {"prompt_token_ids": shared + [4, 5]}, copy.deepcopy(p))
    time.sleep(0.01)
    assert engine.scheduler.schedule().scheduled[0].seq.request.request_id == "cold2"
    while engine.has_unfinished():
        engine.step()


def test_lpm_needs_prefix_caching():
    from sieve.config import EngineConfig

    with pytest.raises(ValueError, match="prefix caching"):
        EngineConfig(scheduling_policy="lpm", enable_prefix_caching=False).validate()
    with pytest.raises(ValueError, match="fcfs"):
        EngineConfig(scheduling_policy="sjf").validate()


def test_server_reports_cached_tokens_and_hit_rate(llama_dir):
    """Over HTTP with the openai client: the second request with the same long prefix says how many
    of its prompt tokens came from the cache (streamed and not), and /metrics counts the hits."""
    import httpx
    import openai

    from live_server import API_KEY, MODEL, metrics_page, start_server
    from sieve import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=128, max_model_len=512))
    url, stop = start_server(engine)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY)
        system = "def long_function(argument):\n    return argument * 2\n" * 8
        first = client.completions.create(model=MODEL, prompt=system + "# first", max_tokens=4, temperature=0)
        second = client.completions.create(model=MODEL, prompt=system + "# second", max_tokens=4, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= 16 and cached % 16 == 0 and cached < second.usage.prompt_tokens
        stream = client.completions.create(model=MODEL, prompt=system + "# third", max_tokens=4, temperature=0,
                                           stream=True, stream_options={"include_usage": True})
        usage = [c.usage for c in stream if c.usage is not None][-1]
        assert usage.prompt_tokens_details.cached_tokens == cached
        page = metrics_page(url)
        hits = next(float(l.split()[-1]) for l in page.splitlines() if l.startswith("sieve:prefix_cache_hits_total"))
        rate = next(float(l.split()[-1]) for l in page.splitlines() if l.startswith("sieve:prefix_cache_hit_rate"))
        assert hits == 2 * cached and 0 < rate < 1
    finally:
        stop()
