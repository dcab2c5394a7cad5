"""Lossless engine features change nothing: batching, chunked prefill, token budgets, preemption.

And the KV block pool's accounting is exact, and the scheduler's limits hold every step.
"""

from __future__ import annotations

import random

import pytest

from sieve import SamplingParams


def workload(n: int, seed: int = 0, vocab: int = 4096, max_prompt: int = 120):
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(1, max_prompt))]} for _ in range(n)]
    params = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            params.append(SamplingParams(max_tokens=rng.randint(4, 40), temperature=0, ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(max_tokens=rng.randint(4, 40), temperature=0.9, top_p=0.9, seed=1000 + i, ignore_eos=True))
        else:
            params.append(SamplingParams(max_tokens=rng.randint(4, 40), temperature=1.2, top_k=50, seed=2000 + i, ignore_eos=True))
    return prompts, params


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(llama_llm):
    """Each request of the workload run alone, one at a time."""
    prompts, params = workload(33)
    return [llama_llm.generate([p], [sp])[0].outputs[0].token_ids for p, sp in zip(prompts, params)]


def test_greedy_and_seeded_requests_are_batch_invariant(llama_llm, reference):
    prompts, params = workload(33)
    together = tokens(llama_llm.generate(prompts, params))  # 33 requests of mixed lengths at once
    assert together == reference
    # the greedy request 0 and seeded request 1 also alone inside a different crowd
    crowd_prompts, crowd_params = workload(32, seed=99)
    mixed = tokens(llama_llm.generate([prompts[0], prompts[1]] + crowd_prompts, [params[0], params[1]] + crowd_params))
    assert mixed[:2] == reference[:2]


@pytest.mark.parametrize(
    "options",
    [
        dict(enable_chunked_prefill=False, max_num_batched_tokens=1024),
        dict(max_num_batched_tokens=7),  # tiny budget: every prompt is chunked, decodes share the budget
        dict(max_num_batched_tokens=4096),
        dict(max_num_seqs=3),
        dict(num_gpu_blocks_override=12, block_size=16),  # 192 tokens for 33 requests: constant preemption
        dict(block_size=1, max_num_batched_tokens=33),
    ],
    ids=["no-chunking", "budget-7", "budget-4096", "max-seqs-3", "preempt", "block-1"],
)
def test_scheduling_options_do_not_change_outputs(llama_engine_factory, reference, options):
    llm = llama_engine_factory(**options)
    engine = llm.llm_engine
    seen_limits = []
    schedule = engine.scheduler.schedule

    def checked_schedule():
        out = schedule()
        seen_limits.append((len(out.scheduled), out.num_batched_tokens, len(engine.scheduler.running)))
        return out

    engine.scheduler.schedule = checked_schedule
    prompts, params = workload(33)
    assert tokens(llm.generate(prompts, params)) == reference
    cfg = engine.config
    assert all(n <= cfg.max_num_seqs and t <= cfg.max_num_batched_tokens and r <= cfg.max_num_seqs for n, t, r in seen_limits)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    if "num_gpu_blocks_override" in options:
        assert engine.scheduler.num_preemptions > 0, "the preemption case must actually preempt"
    if options.get("max_num_batched_tokens") == 7:
        assert max(t for _, t, _ in seen_limits) == 7


def test_chunked_prefill_runs_alongside_decodes(llama_engine_factory):
    llm = llama_engine_factory(max_num_batched_tokens=16)
    engine = llm.llm_engine
    engine.add_request("short", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    engine.step()  # prefill of the short request; it now decodes
    engine.add_request("long", {"prompt_token_ids": list(range(10, 110))}, SamplingParams(max_tokens=2, ignore_eos=True))
    steps_with_both = 0
    while engine.has_unfinished():
        sched_running = {s.request.request_id: s.num_computed_tokens for s in engine.scheduler.running}
        outs = engine.step()
        if "long" in sched_running and sched_running["long"] < 100 and any(o.request_id == "short" for o in outs):
            steps_with_both += 1
    assert steps_with_both >= 5, "the short request should keep decoding while the long prompt is prefilled in chunks"


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_block_accounting_after_finish_abort_and_preemption(llama_engine_factory, prefix_caching):
    llm = llama_engine_factory(num_gpu_blocks_override=20, block_size=4, max_num_batched_tokens=32,
                               enable_prefix_caching=prefix_caching)
    engine = llm.llm_engine
    bm = engine.block_manager
    prompts, params = workload(12, seed=5, max_prompt=30)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    aborted = set()
    step = 0
    while engine.has_unfinished():
        engine.step()
        step += 1
        # invariant every step: a block is free, cached-unreferenced, or counted once per table listing it
        held = [b for s in engine.scheduler.running + engine.scheduler.waiting for b in s.block_table]
        assert all(bm.ref_counts[b] == held.count(b) for b in set(held))
        assert len(set(held)) + bm.num_free_blocks == bm.num_blocks
        if not prefix_caching:
            assert len(held) == len(set(held)), "a block is in two tables"
        if step in (3, 6, 9):  # abort a running and a waiting request
            for queue in (engine.scheduler.running, engine.scheduler.waiting):
                if queue:
                    rid = queue[-1].request.request_id
                    out = engine.abort(rid)
                    assert out.finished and out.outputs[0].finish_reason == "abort"
                    aborted.add(rid)
    assert aborted and engine.scheduler.num_preemptions > 0
    assert bm.num_free_blocks == bm.num_blocks and sum(bm.ref_counts) == 0
    assert sorted([*bm.free_blocks, *bm.evictable]) == list(range(bm.num_blocks))
    assert engine.abort("r0") is None  # unknown or finished: nothing to do


def test_priority_orders_service(llama_engine_factory):
    llm = llama_engine_factory(max_num_seqs=1)
    prompts, _ = workload(3)
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine = llm.llm_engine
    for i, pr in zip(range(3), [5, 0, 2]):
        engine.add_request(f"p{pr}", prompts[i], sp, priority=pr)
    order = []
    while engine.has_unfinished():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["p0", "p2", "p5"]


def test_preempted_sequence_keeps_its_tokens(llama_engine_factory):
    llm = llama_engine_factory(num_gpu_blocks_override=6, block_size=4, max_num_seqs=4)
    engine = llm.llm_engine
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    for i in range(3):  # r0 has the lowest priority (largest value) though it arrived first
        engine.add_request(f"r{i}", {"prompt_token_ids": [10 + i] * 4}, sp, priority=5 if i == 0 else 0)
    seqs = {rid: req.seqs[0] for rid, req in engine.requests.items()}
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    assert engine.scheduler.num_preemptions > 0
    assert seqs["r0"].num_preemptions > 0 and seqs["r1"].num_preemptions == 0, "the lowest priority goes first"
    alone = llama_engine_factory()
    for i in range(3):
        ref = alone.generate([{"prompt_token_ids": [10 + i] * 4}], sp)[0]
        assert outs[f"r{i}"].outputs[0].token_ids == ref.outputs[0].token_ids


@pytest.mark.parametrize("kv", ["auto", "int8"])
@pytest.mark.parametrize("prompt_len", [37, 32])  # a partial last block (copied for each fork), and none
def test_n_choices_fork_after_one_prefill(llama_engine_factory, kv, prompt_len):
    prompt = {"prompt_token_ids": workload(1, seed=9, max_prompt=200)[0][0]["prompt_token_ids"][:prompt_len]}
    assert len(prompt["prompt_token_ids"]) == prompt_len
    sp = SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=21, ignore_eos=True)
    llm = llama_engine_factory(kv_cache_dtype=kv, block_size=8)
    engine, bm = llm.llm_engine, llm.llm_engine.block_manager
    computed = []
    real = engine.runner.execute
    engine.runner.execute = lambda sched: (computed.append(sched.num_batched_tokens), real(sched))[1]
    forked = llm.generate(prompt, sp)[0]
    assert sum(computed) == prompt_len + 4 * 5  # the prompt once, then 5 decodes per choice
    assert bm.num_free_blocks == bm.num_blocks and sum(bm.ref_counts) == 0
    # the same request where no choice can fork (one sequence at a time): each computes the prompt itself
    alone = llama_engine_factory(kv_cache_dtype=kv, block_size=8, max_num_seqs=1, enable_prefix_caching=False)
    unforked = alone.generate(prompt, sp)[0]
    assert [c.token_ids for c in forked.outputs] == [c.token_ids for c in unforked.outputs]
    assert len({tuple(c.token_ids) for c in forked.outputs}) > 1  # sampled choices do differ


def test_choice_seeds_never_collide_with_other_requests(llama_llm):
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}

    def choices(seed, n):
        return [c.token_ids for c in llama_llm.generate(prompt, SamplingParams(n=n, max_tokens=12, temperature=1.0, seed=seed,
                                                                                ignore_eos=True))[0].outputs]

    three = choices(100, 3)
    assert choices(100, 3) == three  # reproducible
    assert choices(100, 1) == three[:1]  # choice 0 is the same whatever n is
    assert three[1] != choices(101, 1)[0] and three[2] != choices(102, 1)[0]  # choice i of s is not choice 0 of s + i
    assert len({tuple(c) for c in three}) == 3


def test_cpu_kv_pool_takes_memory_only_as_its_blocks_are_used(demo_dir):
    """A 2 GiB KV budget on the CPU: the pool is ready without the process taking the memory (the kernel zeroes a
    page when a block first writes it; torch.zeros wrote all of it before the engine started, 6-12 s for the
    default 6.6 GB pool on a 2-core host), it reads as zeros, and requests run on it as on a small pool."""
    from sieve import LLM

    def rss_bytes() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    before = rss_bytes()
    big = LLM(str(demo_dir), kv_cache_memory_gb=2, max_num_seqs=4096, skip_tokenizer_init=True)  # no cap below 2 GiB
    grown = rss_bytes() - before
    pool = big.llm_engine.runner.kv_pool
    assert pool.numel() * pool.element_size() > 1.5 * 2**30 and grown < 0.5 * 2**30, (pool.shape, grown)
    assert not pool[:, :, -1].any()
    prompts = [{"prompt_token_ids": [5 + i, 17, 300, 42] * (3 + i)} for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    small = LLM(str(demo_dir), num_gpu_blocks_override=64, skip_tokenizer_init=True)
    assert [o.outputs[0].token_ids for o in big.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in small.generate(prompts, params)]
