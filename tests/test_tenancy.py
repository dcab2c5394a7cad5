"""Scarcity scheduling in the engine (sieve/tenancy.py): a tier's guaranteed share of the running slots under
contention from a higher tier, taken back from a borrower at the next step; fair shares between the tenants of one
tier; and nothing lost to the preemptions that take slots back. Counted in steps, so no machine's speed matters."""

from __future__ import annotations

import pytest

from sieve import EngineConfig, LLMEngine, SamplingParams
from sieve.config import ConfigError

LONG = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def engine_with(llama_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=512, max_model_len=256,
                                  **kw))


FIRST_TOKENS: dict[str, int] = {}  # request id -> its prompt's first token, distinct per id, the same in every run


def add(engine, rid, tenant, tier, priority, params=LONG, length=12):
    """A prompt of its own for `rid` (no two ids share a first token, so none hits another's prefix cache; not
    `hash(rid)`, which Python salts per process and which made two ids collide in one run in fifty)."""
    first = FIRST_TOKENS.setdefault(rid, 5 + len(FIRST_TOKENS))
    engine.add_request(rid, {"prompt_token_ids": [first + i for i in range(length)]}, params, priority,
                       tenant=tenant, tier=tier)


def watch(engine, record) -> None:
    """Call `record(out)` with each step's SchedulerOutput as it is scheduled."""
    schedule = engine.scheduler.schedule

    def recorded():
        out = schedule()
        record(out)
        return out

    engine.scheduler.schedule = recorded


def finish(engine, outputs: dict | None = None) -> dict:
    """Step until nothing is left; each finished request's tokens by id (into `outputs`, where given)."""
    outputs = {} if outputs is None else outputs
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    return outputs


def assert_as_alone(llama_dir, outputs: dict, requests, **kw) -> None:
    """Each (id, priority, prompt length) of `requests`, run alone, gives the tokens `outputs` holds for it."""
    for rid, priority, length in requests:
        alone = engine_with(llama_dir, **kw)
        add(alone, rid, None, None, priority, length=length)
        assert finish(alone)[rid] == outputs[rid], rid


def running_by_tier(engine) -> dict[str, int]:
    counts: dict[str, int] = {}
    for s in engine.scheduler.running:
        counts[s.request.tier] = counts.get(s.request.tier, 0) + 1
    return counts


@pytest.mark.parametrize("shares", [None, {"gold": 0.25, "free": 0.5}])
def test_a_lower_tier_keeps_its_guaranteed_slots_under_a_higher_tiers_flood(llama_dir, shares):
    """Four slots; gold (priority 0) floods with 10 requests, free (priority 1) has 4. Priority alone starves free
    while gold waits; with free's share of 0.5 it holds 2 slots at every step it has work waiting or running, and
    gold keeps the rest."""
    engine = engine_with(llama_dir, max_num_seqs=4, tier_shares=shares)
    for i in range(10):
        add(engine, f"g{i}", "g", "gold", 0)
    for i in range(4):
        add(engine, f"f{i}", "f", "free", 1)
    seen = []

    def recorded(out):  # who runs each step, as scheduled
        free_left = sum(1 for r in engine.requests.values() if r.tier == "free" and not r.finished)
        gold_waiting = sum(1 for s in engine.scheduler.waiting if s.request.tier == "gold")
        seen.append((running_by_tier(engine), free_left, gold_waiting))

    watch(engine, recorded)
    outputs = finish(engine)
    contended = [(run, free_left) for run, free_left, gold_waiting in seen if gold_waiting]
    assert len(contended) > 20
    if shares is None:
        assert all(run.get("free", 0) == 0 for run, _ in contended)  # starved while gold waits
    else:
        # at most one step to take a slot back (the borrower is preempted, the slot taken at the next step)
        short = [run for (run, free_left), nxt in zip(contended, contended[1:])
                 if run.get("free", 0) < min(2, free_left) and nxt[0].get("free", 0) < min(2, nxt[1])]
        assert not short, short
        assert all(run.get("gold", 0) >= 1 for run, _ in contended), [c for c in contended if c[0].get("gold", 0) < 1]
    # whatever the order and the preemptions, each request's tokens are its own alone
    assert_as_alone(llama_dir, outputs, [("g3", 0, 12), ("f2", 0, 12)], max_num_seqs=4)


@pytest.mark.parametrize("fair", [False, True])
def test_tenants_of_one_tier_share_it_fairly(llama_dir, fair):
    """Two slots; tenant A queues 10 requests, then tenant B 3, all of one tier and priority. By arrival B waits for
    all of A's; by least service (weighted tokens) B's go next as slots free, so all of them start before A's sixth
    (equal service: two of A's, two of B's, two of A's, then B's last beside A's fifth)."""
    engine = engine_with(llama_dir, max_num_seqs=2, tier_shares={} if fair else None)
    for i in range(10):
        add(engine, f"a{i}", "A", "std", 0)
    for i in range(3):
        add(engine, f"b{i}", "B", "std", 0)
    started = []
    while engine.has_unfinished():
        engine.step()
        for s in engine.scheduler.running:
            if s.request.request_id not in started:
                started.append(s.request.request_id)
    assert sorted(started) == sorted([f"a{i}" for i in range(10)] + [f"b{i}" for i in range(3)])
    if fair:
        assert max(started.index(f"b{i}") for i in range(3)) < started.index("a5"), started
    else:
        assert min(started.index(f"b{i}") for i in range(3)) > started.index("a8"), started


def test_a_tenant_back_from_idle_banks_no_credit(llama_dir):
    """A tenant served nothing while others worked starts at the least counter of those active, not at zero."""
    from sieve.tenancy import TierPolicy

    engine = engine_with(llama_dir, max_num_seqs=2, tier_shares={})
    policy: TierPolicy = engine.scheduler.tiers
    add(engine, "a0", "A", "std", 0)
    for _ in range(5):
        engine.step()
    assert policy.served["A"] > 0
    add(engine, "b0", "B", "std", 0)
    assert policy.served["B"] == policy.served["A"]


def test_bad_tier_shares_are_refused():
    for shares in ({"a": 0.7, "b": 0.4}, {"a": -0.1}, {"a": True}, ["a"]):
        with pytest.raises(ConfigError, match="tier_shares"):
            EngineConfig(model="x", tier_shares=shares).validate()


def test_a_bad_background_slowdown_is_refused():
    for value in (-0.1, "fast", True, None):
        with pytest.raises(ConfigError, match="background_slowdown"):
            EngineConfig(model="x", background_slowdown=value).validate()


def test_a_waiting_higher_priority_displaces_a_running_lower_one(llama_dir):
    """Slots full (max_num_seqs 2) with priority-5 requests: a priority-0 request starts at the next step, the
    latest lower one preempted (by recompute: its tokens are what they are alone); one of equal priority waits."""
    engine = engine_with(llama_dir, max_num_seqs=2)
    for i in range(2):
        add(engine, f"low{i}", None, None, 5)
    for _ in range(3):
        engine.step()
    add(engine, "same", None, None, 5)
    engine.step()
    assert {s.request.request_id for s in engine.scheduler.running} == {"low0", "low1"}  # equal priority: it waits
    add(engine, "urgent", None, None, 0)
    engine.step()
    assert "urgent" in {s.request.request_id for s in engine.scheduler.running}
    assert engine.scheduler.num_preemptions == 1
    assert_as_alone(llama_dir, finish(engine), [("low0", 5, 12), ("low1", 5, 12)], max_num_seqs=2)


def test_a_displaced_request_keeps_its_kv_and_its_place(llama_dir):
    """Displaced for a higher priority where blocks allow, a request keeps its KV: its full blocks stay in the prefix
    cache, and it resumes from them, computing again only its partial last block (fewer than block_size tokens), not
    its 12-token prompt and the tokens it had generated. And it keeps its place: back in the queue, it goes before a
    request of its priority that arrived after it."""
    engine = engine_with(llama_dir, max_num_seqs=1, block_size=4)
    computed: dict[str, int] = {}
    watch(engine, lambda out: [computed.__setitem__(s.seq.request.request_id, computed.get(s.seq.request.request_id, 0)
                                                    + s.num_new_tokens) for s in out.scheduled])
    add(engine, "low", None, None, 5)
    for _ in range(7):  # its prompt, then 6 tokens: 18 tokens in context, 4 full blocks and 2 in a partial one
        engine.step()
    add(engine, "later", None, None, 5)
    add(engine, "urgent", None, None, 0)
    outputs = finish(engine)
    assert engine.scheduler.num_preemptions == 1 and list(outputs) == ["urgent", "low", "later"]
    alone = 12 + LONG.max_tokens - 1  # its prompt, then a row for each token but the last
    assert 0 < computed["low"] - alone < 4, computed
    assert computed["later"] == computed["urgent"] == alone
    assert_as_alone(llama_dir, outputs, [("low", 5, 12)], max_num_seqs=1)


@pytest.mark.parametrize("shares", [None, {"gold": 0.25, "free": 0.25}])
def test_a_waiting_higher_priority_prompt_goes_before_a_running_lower_prompts_chunks(llama_dir, shares):
    """Steps of 32 tokens; a free (priority 1) 200-token prompt is being computed in chunks when a gold (priority 0)
    40-token prompt arrives. The gold prompt's chunks take the step first, so its first token comes after two steps,
    not after the free prompt's remaining five; with free's share of 0.25 the free prompt keeps 8 tokens of every
    step meanwhile (its guaranteed share of the step's budget), without one it waits. Tokens are each request's own."""
    engine = engine_with(llama_dir, max_num_batched_tokens=32, tier_shares=shares)
    add(engine, "long", "f", "free", 1, length=200)
    engine.step()
    add(engine, "urgent", "g", "gold", 0, length=40)
    steps, chunks = 0, []
    watch(engine, lambda out: chunks.append({i.seq.request.request_id: i.num_new_tokens for i in out.scheduled}))
    first_token = False
    while not first_token and steps < 10:
        steps += 1
        first_token = any(out.request_id == "urgent" and out.outputs[0].token_ids for out in engine.step())
    assert first_token and steps == 2, chunks
    held = 0 if shares is None else 8
    assert chunks[0] == ({"urgent": 32 - held, "long": held} if held else {"urgent": 32})
    assert_as_alone(llama_dir, finish(engine), [("long", 0, 200), ("urgent", 0, 40)], max_num_batched_tokens=32)


def test_a_higher_priority_the_pacer_refuses_displaces_a_lower_one(llama_dir):
    """Under a TPOT objective with an injected step cost (9.9 ms + 4 ms a token: four decodes beside a minimal chunk
    fit in the 90 ms a step may take, five do not) four priority-5 requests decode. A priority-0 request starts at
    the next step, the latest lower one preempted; one of priority 5 waits until one finishes."""
    from tests.test_pacing import linear_cost

    engine = engine_with(llama_dir, max_num_seqs=16, slo_tpot_ms=100)
    engine.scheduler.pacer.cost = linear_cost(0.0099, 0.004)
    for i in range(4):
        add(engine, f"low{i}", None, None, 5)
    for _ in range(3):
        engine.step()
    add(engine, "same", None, None, 5)
    engine.step()
    assert {s.request.request_id for s in engine.scheduler.running} == {f"low{i}" for i in range(4)}
    add(engine, "urgent", None, None, 0)
    engine.step()
    running = {s.request.request_id for s in engine.scheduler.running}
    assert "urgent" in running and len(running) == 4 and engine.scheduler.num_preemptions == 1


def test_a_paced_engine_knows_its_step_cost_before_the_first_request(llama_dir):
    """A TPOT objective calibrates the step-cost model at load (every small row count, and the keys' part): learnt
    from the first requests alone, their warm-up reads as the machine's speed, and a row count the pacer then never
    admits is never measured again."""
    engine = engine_with(llama_dir, slo_tpot_ms=100)
    cost = engine.scheduler.pacer.cost
    assert cost.ready and len(cost.buckets) >= 32 and engine.num_steps == 0
    assert cost.predict(1) <= cost.predict(16) <= cost.predict(256)


def test_background_work_slows_a_step_with_others_in_it_by_at_most_its_share(llama_dir):
    """An injected step cost of 20 ms + 0.5 ms a token: background rows may make a step with f other tokens at most
    a tenth slower, so they take at most 4 + f / 10 tokens of it (hand arithmetic), and none where an interactive
    prompt's chunk runs. Four interactive requests run beside six background ones: every step with interactive tokens
    keeps to that, the background still progresses in them, and takes whole steps once the interactive ones are done;
    each request's tokens are its own alone."""
    from sieve.tenancy import BACKGROUND
    from tests.test_pacing import linear_cost

    engine = engine_with(llama_dir, max_num_seqs=16, slo_tpot_ms=100)
    engine.scheduler.pacer.cost = linear_cost(0.02, 0.0005)
    for i in range(4):
        add(engine, f"fg{i}", None, None, 0)
    for i in range(6):
        add(engine, f"bg{i}", None, None, BACKGROUND)
    steps = []

    def recorded(out):
        fg = sum(i.num_rows for i in out.scheduled if i.seq.request.priority < BACKGROUND)
        prompt = any(not i.is_decode for i in out.scheduled if i.seq.request.priority < BACKGROUND)
        steps.append((fg, out.num_batched_tokens - fg, prompt))

    watch(engine, recorded)
    outputs = finish(engine)
    shared = [(fg, bg) for fg, bg, _ in steps if fg]
    assert all(bg <= 4 + fg / 10 for fg, bg in shared), shared
    assert sum(bg for _, bg in shared) > 0 and max(bg for fg, bg, _ in steps if not fg) >= 6
    # none beside an interactive prompt's chunk: its step's time is a time to first token
    assert all(bg == 0 for fg, bg, prompt in steps if prompt) and any(prompt for *_, prompt in steps)
    assert_as_alone(llama_dir, outputs, [("bg5", 0, 12)], max_num_seqs=16)
