"""SLO pacing (sieve/pacing.py): the step's token budget and admission keep running decodes within the TPOT
objective while prompts proceed. Step costs are injected, so that what is chosen does not depend on this machine."""

import time
from types import SimpleNamespace

import pytest

from sieve import SamplingParams
from sieve.pacing import STEP_SHARE, SloPacer
from sieve.step_cost import StepCostModel


def linear_cost(fixed: float, per_token: float) -> StepCostModel:
    """A step cost of `fixed` + `per_token` x tokens that steps do not move."""
    cost = StepCostModel()
    cost.observe(1, fixed + per_token)
    cost.observe(256, fixed + 256 * per_token)
    cost.observe = lambda *args: None
    return cost


def decoding(n: int, context: int = 20, drafts: int = 0):
    return [SimpleNamespace(num_tokens=context, num_computed_tokens=context - 1, request=SimpleNamespace(priority=0),
                            draft_state=SimpleNamespace(token_ids=[7] * drafts)) for _ in range(n)]


def test_the_budget_is_what_fits_in_the_share_of_the_objective():
    """Hand arithmetic: 9.9 ms + 0.2 ms a token, a 100 ms objective of which a step may take 90 ms: 400 tokens. With
    8 decodes (2 of them drafting 3 tokens) the step takes 400; with none, the configured budget; where the
    decodes alone pass the share, them and one minimal chunk."""
    assert STEP_SHARE == 0.9
    pacer = SloPacer(linear_cost(0.0099, 0.0002), 0.100, max_budget=2048, min_chunk=16)
    assert pacer.token_budget(decoding(8)) == 400
    assert pacer.token_budget(decoding(6) + decoding(2, drafts=3)) == 400
    assert pacer.token_budget([]) == 2048
    prefilling = [SimpleNamespace(num_tokens=500, num_computed_tokens=100, request=SimpleNamespace(priority=0), draft_state=SimpleNamespace(token_ids=[]))]
    assert pacer.token_budget(prefilling) == 2048  # no decode: no TPOT at stake
    assert pacer.token_budget(decoding(450)) == 466
    assert SloPacer(linear_cost(0.0099, 0.0002), 0.100, max_budget=256, min_chunk=16).token_budget(decoding(8)) == 256
    assert SloPacer(StepCostModel(), 0.100, 2048, 16).token_budget(decoding(8)) == 2048  # nothing measured yet

    # Attention: 1 us a key. 8 decodes at 1000 tokens of context attend to 8000 keys: 8 ms less for tokens.
    cost = linear_cost(0.0099, 0.0002)
    cost.observe_keys(1, 1000, 0.001)
    assert SloPacer(cost, 0.100, 2048, 16).token_budget(decoding(8, context=1000)) == 360

    # Admission: with 64 running, a 65th decoding beside a 16-token chunk is predicted at 9.9 ms + 1 ms x 81 > 90 ms.
    steep = SloPacer(linear_cost(0.0099, 0.001), 0.100, 2048, 16)
    new = decoding(1)[0]
    assert steep.admits(decoding(63), new) and not steep.admits(decoding(64), new)
    assert steep.admits([], new)  # alone it always runs


def test_a_step_of_background_work_alone_is_half_an_interactive_one():
    """Hand arithmetic as above: background decodes alone (the Batch API's, nothing interactive running) fit their step
    in half the share, 45 ms: 175 tokens, so that an interactive request arriving waits at most that long for it to
    end; one interactive decode among them and the step is the interactive one's again (400)."""
    from sieve.pacing import BACKGROUND_STEP_SHARE
    from sieve.tenancy import BACKGROUND

    assert BACKGROUND_STEP_SHARE == 0.5
    pacer = SloPacer(linear_cost(0.0099, 0.0002), 0.100, max_budget=2048, min_chunk=16)
    batch = decoding(8)
    for s in batch:
        s.request = SimpleNamespace(priority=BACKGROUND)
    assert pacer.token_budget(batch) == 175
    assert pacer.token_budget(batch + decoding(1)) == 400


def chunks_of_a_long_prompt(engine, short: int, long_prompt: list[int]) -> list[int]:
    """Tokens of `long_prompt` computed in each step, started while `short` sequences decode."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for i in range(short):
        engine.add_request(f"s{i}", {"prompt_token_ids": list(range(10 + i, 30 + i))}, params)
    engine.step()  # every short prompt in one step: nothing decodes yet
    engine.add_request("long", {"prompt_token_ids": long_prompt}, params)
    seq = engine.requests["long"].seqs[0]
    chunks = []
    while seq.num_computed_tokens < len(long_prompt):
        before = seq.num_computed_tokens
        engine.step()
        chunks.append(seq.num_computed_tokens - before)
    while engine.has_unfinished():
        engine.step()
    return chunks


def test_a_long_prompt_joins_decodes_in_chunks_that_keep_their_tpot(llama_engine_factory):
    """Mixed load: 8 sequences decode when a 900-token prompt arrives. Under a 100 ms TPOT objective and a step cost
    of 9.9 ms + 0.2 ms a token, the prompt runs in chunks of 392 tokens beside the 8 decodes (400 tokens, 90 ms
    predicted), and the decodes run every step. With the fixed budget of 2048 the whole prompt joins one step,
    predicted at 0.19 s: every decoding user's TPOT that step is past the objective."""
    long_prompt = [(7 * i) % 4000 + 5 for i in range(900)]
    paced = llama_engine_factory(slo_tpot_ms=100).llm_engine
    paced.scheduler.pacer.cost = linear_cost(0.0099, 0.0002)
    assert chunks_of_a_long_prompt(paced, 8, long_prompt) == [392, 392, 116]
    fixed = llama_engine_factory().llm_engine
    assert fixed.scheduler.pacer is None
    assert chunks_of_a_long_prompt(fixed, 8, long_prompt) == [900]


def test_decodes_keep_their_row_when_a_chunk_comes_first_in_order(llama_engine_factory):
    """A prefill that is earlier in the order of service (a higher priority) never takes the rows of the decodes
    after it: with a budget of 64 tokens, 8 decodes and a long prompt of priority -1, each step carries the 8
    decodes and a 56-token chunk."""
    engine = llama_engine_factory(max_num_batched_tokens=64).llm_engine
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    for i in range(8):
        engine.add_request(f"s{i}", {"prompt_token_ids": [5 + i] * 6}, params)
    engine.step()
    engine.add_request("long", {"prompt_token_ids": list(range(5, 300))}, params, priority=-1)
    long_seq = engine.requests["long"].seqs[0]
    shorts = [engine.requests[f"s{i}"].seqs[0] for i in range(8)]
    for _ in range(3):
        before = [s.num_tokens for s in shorts]
        engine.step()
        assert [s.num_tokens for s in shorts] == [b + 1 for b in before]
    assert long_seq.num_computed_tokens == 3 * 56


def test_admission_waits_while_a_newcomer_would_break_the_objective_and_pacing_is_lossless(llama_engine_factory):
    """80 requests against a step cost of 9.9 ms + 1 ms a token: at most 64 run at once (a 65th decoding beside a
    16-token chunk is predicted past 90 ms); the rest wait and run as others finish. The greedy tokens are those
    of the engine without an objective: pacing changes when tokens are computed, never which."""
    prompts = [{"prompt_token_ids": [(3 * i + j) % 4000 + 5 for j in range(12 + i % 7)]} for i in range(80)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in llama_engine_factory(max_num_seqs=128).generate(prompts, params)]
    llm = llama_engine_factory(max_num_seqs=128, slo_tpot_ms=100)
    engine = llm.llm_engine
    engine.scheduler.pacer.cost = linear_cost(0.0099, 0.001)
    most = []
    schedule = engine.scheduler.schedule

    def watched():
        out = schedule()
        most.append(len(engine.scheduler.running))
        return out

    engine.scheduler.schedule = watched
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == reference
    assert max(most) == 64


def test_a_prompt_the_free_blocks_cannot_hold_waits_instead_of_preempting_those_running(llama_engine_factory):
    """40 blocks of 16 tokens; two users decode 40 tokens after 200-token prompts when a 300-token prompt arrives, and
    steps take 64 tokens. Admitted on its first chunk's blocks, the newcomer takes later chunks' blocks from those
    running, who are preempted and compute their whole context again; under an objective it waits until the
    free blocks hold its prompt and a block for everyone. The tokens are the same either way."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [[(5 * i + j) % 4000 + 5 for j in range(200)] for i in range(2)] + [[(3 * j) % 4000 + 5 for j in range(300)]]

    def run(**kw):
        engine = llama_engine_factory(num_gpu_blocks_override=40, max_num_batched_tokens=64, enable_prefix_caching=False,
                                      **kw).llm_engine
        if engine.scheduler.pacer is not None:
            engine.scheduler.pacer.cost = linear_cost(0.001, 0.00001)  # fast: only memory decides
        for i in range(2):
            engine.add_request(f"r{i}", {"prompt_token_ids": prompts[i]}, params)
        while engine.requests["r1"].seqs[0].num_output_tokens < 2:
            engine.step()
        engine.add_request("new", {"prompt_token_ids": prompts[2]}, params)
        tokens = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
        return engine.scheduler.num_preemptions, tokens

    preempted, unpaced = run()
    assert preempted > 0
    preempted, paced = run(slo_tpot_ms=100)
    assert preempted == 0 and paced == unpaced


@pytest.mark.parametrize("value", [0, -5, "fast", True])
def test_the_objective_must_be_a_positive_number(llama_engine_factory, value):
    from sieve.config import ConfigError

    with pytest.raises(ConfigError, match="slo_tpot_ms"):
        llama_engine_factory(slo_tpot_ms=value)


def test_slo_reject_refuses_a_request_once_its_ttft_can_no_longer_be_met(llama_engine_factory):
    """--slo-reject: a request still waiting for its first step past its TTFT objective is finished with
    "slo_unmet" and a retry hint; one that has started is never refused; without the flag it waits its turn. The
    wait is set back by hand (its arrival one second earlier), so that no timing of this machine decides it."""
    from sieve.config import ConfigError

    with pytest.raises(ConfigError, match="slo_ttft_ms"):
        llama_engine_factory(slo_reject=True)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for reject in (True, False):
        engine = llama_engine_factory(max_num_seqs=1, slo_ttft_ms=500, slo_reject=reject).llm_engine
        engine.add_request("running", {"prompt_token_ids": [5, 6, 7]}, params)
        engine.step()
        engine.add_request("late", {"prompt_token_ids": [8, 9, 10]}, params)
        engine.add_request("fresh", {"prompt_token_ids": [11, 12]}, params)
        for rid in ("running", "late"):
            engine.requests[rid].metrics.arrival_time -= 1.0
        outputs = {o.request_id: o for o in engine.step()}
        if reject:
            late = outputs["late"]
            assert late.finished and late.outputs[0].finish_reason == "slo_unmet" and late.outputs[0].token_ids == []
            assert late.retry_after_s == 0.5 and "late" not in engine.requests
        else:
            assert "late" not in outputs and "late" in engine.requests
        assert not outputs["running"].finished and "fresh" in engine.requests  # started, or still within its objective
        while engine.has_unfinished():
            engine.step()


def test_the_server_answers_429_with_retry_after_when_the_ttft_objective_is_missed(llama_dir):
    """Served with --slo-reject and one sequence at a time, steps slowed to at least 50 ms each: while one request
    runs 40 tokens (over 2 s), a second cannot start within its 300 ms objective and the openai client gets a 429
    with Retry-After, not a late answer; the first completes."""
    import concurrent.futures

    import openai
    from live_server import API_KEY, MODEL, start_server
    from sieve import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=64, max_model_len=256,
                                    max_num_seqs=1, slo_ttft_ms=300, slo_reject=True))
    url, stop = start_server(engine)
    try:
        stop.app.state.sieve.aengine.step_delay = 0.05
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(client.completions.create, model=MODEL, prompt="one two", max_tokens=40, temperature=0,
                                extra_body={"ignore_eos": True})
            while not engine.num_running:
                time.sleep(0.01)
            with pytest.raises(openai.RateLimitError) as e:
                client.completions.create(model=MODEL, prompt="three four", max_tokens=5)
            assert e.value.response.headers["Retry-After"] == "1"
            body = e.value.response.json()["error"]
            assert body["code"] == "slo_unmet" and "300 ms" in body["message"]
            assert first.result(timeout=60).choices[0].finish_reason == "length"
    finally:
        stop()
