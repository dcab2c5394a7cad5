"""Evaluation clients get true numbers: loglikelihood and rolling-loglikelihood scoring through the server
(`echo` + `logprobs`, as lm-evaluation-harness's `local-completions` sends it), with the harness's own
arithmetic, against transformers on the same trained checkpoint in float32."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest
import torch

from live_server import API_KEY, start_server
from reference import CLEAR, TOL

STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"

# (context, continuations): the harness's multiple-choice shape. The scores decide, not what is "right".
QUESTIONS = [
    ("Once upon a time, there was a little girl named", [" Lily", " Tom", " dog", " the"]),
    ("Tom liked to play with his", [" ball", " mom", " sky", " happy"]),
    ("One day, Lily went to the park. She saw a big", [" tree", " dog", " ran", " blue"]),
    ("The sun was shining and the birds were", [" singing", " sad", " table", " Lily"]),
    ("Mom said, \"Be careful!\" Lily", [" said", " was", " nodded", " ball"]),
]
TEXT = ("Once upon a time, there was a little boy named Tim. Tim had a big red ball. He liked to play with it every day. "
        "One day, Tim went to the park with his mom. He saw a girl named Sue. Sue was sad because she had no toys. "
        "Tim wanted to help her. He gave Sue his big red ball. Sue smiled and said, \"Thank you, Tim!\" "
        "They played together all day. They were happy. At the end of the day, Sue gave the ball back to Tim. "
        "Tim learned that sharing is good. The next day, Tim and Sue played again in the park with the ball.")
MAX_LEN = 64  # rolling windows of 64 tokens, so the text needs several


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sieve import EngineConfig, LLMEngine

    if not STORIES.exists():
        pytest.fail(f"{STORIES} is missing: ../shared holds the trained checkpoint this test uses")
    engine = LLMEngine(EngineConfig(model=str(STORIES), dtype="float32", device="cpu", num_gpu_blocks_override=128))
    url, stop = start_server(engine, served_model_name="stories")
    tok = AutoTokenizer.from_pretrained(STORIES)
    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
    yield url, tok, model, engine
    stop()


# ---- lm-evaluation-harness's arithmetic (lm_eval/models/api_models.py, lm_eval/utils.py) ----------------
def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """TemplateLM._encode_pair: trailing spaces move to the continuation; the continuation's tokens are
    what the whole string has beyond the context's."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
    whole = tok.encode(context + continuation)  # the harness's encode adds the BOS as this tokenizer does
    ctx = tok.encode(context)
    return ctx, whole[len(ctx):]


def rolling_windows(tokens: list[int], prefix_token: int, max_seq_len: int, context_len: int = 1):
    """lm_eval.utils.get_rolling_token_windows followed by make_disjoint_window."""
    pred_len = max_seq_len - context_len + 1
    predicted = 0
    first_seq_len = min(max_seq_len, len(tokens))
    windows = [([prefix_token] + tokens[: first_seq_len - 1], tokens[:first_seq_len])]
    predicted += first_seq_len
    while predicted < len(tokens):
        window_pred_len = min(len(tokens) - predicted, pred_len)
        window_end = predicted + window_pred_len
        windows.append((tokens[window_end - max_seq_len - 1 : window_end - 1], tokens[window_end - window_pred_len : window_end]))
        predicted += window_pred_len
    return [(a[: len(a) - (len(b) - 1)], b) for a, b in windows]


def server_loglikelihoods(url: str, requests: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    """TemplateAPI._loglikelihood_tokens + LocalCompletionsAPI.parse_logprobs: one batched request, token
    lists in, echo with logprobs=1 and max_tokens=1, the sum of token_logprobs[ctxlen:-1]."""
    prompts, ctxlens = [], []
    for ctx, cont in requests:
        inp = (ctx + cont)[-(MAX_LEN + 1):]
        ctxlens.append(len(ctx) - max(0, len(ctx) + len(cont) - (MAX_LEN + 1)))
        prompts.append(inp)
    r = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120,
                   json={"model": "stories", "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1,
                         "seed": 1234, "echo": True})
    assert r.status_code == 200, r.text
    out = []
    for choice, ctxlen, inp in zip(sorted(r.json()["choices"], key=lambda c: c["index"]), ctxlens, prompts):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(inp) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        token_logprobs, top = lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1]
        greedy = all(t == max(tp.values()) for t, tp in zip(token_logprobs, top))
        out.append((sum(token_logprobs), greedy))
    return out


def hf_loglikelihood(model, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    score, greedy, _ = hf_scored(model, ctx, cont)
    return score, greedy


def hf_scored(model, ctx: list[int], cont: list[int]) -> tuple[float, bool, float]:
    """The continuation's summed logprob, whether it is the greedy one, and how far that verdict is from flipping:
    the least lead of a continuation token over the best other token if greedy, else the most any trails."""
    inp = (ctx + cont)[-(MAX_LEN + 1):]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([inp[:-1]])).logits[0].double(), dim=-1)
    rows = logprobs[len(inp) - 1 - len(cont):]
    ids = torch.tensor(cont)[:, None]
    picked = rows.gather(1, ids).squeeze(1)
    lead = picked - rows.scatter(1, ids, float("-inf")).max(dim=-1).values
    greedy = bool((lead > 0).all())
    return picked.sum().item(), greedy, (lead.min() if greedy else -lead.min()).item()


def test_multiple_choice_scores_match_transformers(setup):
    url, tok, model, _ = setup
    requests = [encode_pair(tok, ctx, c) for ctx, conts in QUESTIONS for c in conts]
    got = server_loglikelihoods(url, requests)
    scored = [hf_scored(model, ctx, cont) for ctx, cont in requests]
    want = [(score, greedy) for score, greedy, _ in scored]
    # the verdicts asserted below are clear on the reference, so they do not ride a near-tie on any CPU
    assert min(margin for _, _, margin in scored) >= CLEAR * TOL
    for i in range(len(QUESTIONS)):
        best, second = sorted(score for score, _ in want[4 * i: 4 * i + 4])[-2:][::-1]
        assert best - second >= CLEAR * TOL
    for (g, g_greedy), (w, w_greedy) in zip(got, want):
        assert math.isclose(g, w, rel_tol=1e-4, abs_tol=1e-5), (g, w)
        assert g_greedy == w_greedy
    picks = lambda scores: [max(range(4), key=lambda j: scores[4 * i + j][0]) for i in range(len(QUESTIONS))]  # noqa: E731
    assert picks(got) == picks(want)
    assert any(g for _, g in got)  # the greedy check sees both outcomes, so it is tested
    assert not all(g for _, g in got)


def test_rolling_loglikelihood_perplexity_matches_transformers(setup):
    url, tok, model, engine = setup
    tokens = tok.encode(TEXT, add_special_tokens=False)
    windows = rolling_windows(tokens, tok.bos_token_id, MAX_LEN)
    assert len(windows) >= 3
    got = sum(lp for lp, _ in server_loglikelihoods(url, windows))
    want = sum(hf_loglikelihood(model, ctx, cont)[0] for ctx, cont in windows)
    ppl_got, ppl_want = math.exp(-got / len(tokens)), math.exp(-want / len(tokens))
    assert 1.5 < ppl_want < 100  # a trained model on its kind of text: a real perplexity, not 1.0
    assert math.isclose(ppl_got, ppl_want, rel_tol=1e-4)
    # scored again, now with every window's blocks in the prefix cache: the same numbers
    hits = engine.block_manager.num_hit_tokens
    assert math.isclose(sum(lp for lp, _ in server_loglikelihoods(url, windows)), got, rel_tol=1e-6)
    assert engine.block_manager.num_cached_blocks > 0 and engine.block_manager.num_hit_tokens == hits


def test_prompt_logprobs_field_on_completions_and_chat(setup):
    url, tok, model, _ = setup
    h = {"Authorization": f"Bearer {API_KEY}"}
    ids = tok.encode("Once upon a time, there was a little girl")
    r = httpx.post(url + "/v1/completions", headers=h, json={"prompt": ids, "max_tokens": 2, "prompt_logprobs": 2, "temperature": 0}).json()
    plp = r["choices"][0]["prompt_logprobs"]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)
    assert plp[0] is None and len(plp) == len(ids)
    for pos, (t, entry) in enumerate(zip(ids[1:], plp[1:])):
        assert abs(entry[str(t)]["logprob"] - ref[pos, t].item()) < 1e-4
        assert entry[str(t)]["rank"] == int((ref[pos] > ref[pos, t]).sum()) + 1
        assert {int(k) for k, v in entry.items() if v["rank"] <= 2} == set(ref[pos].topk(2).indices.tolist())
    assert r["choices"][0]["logprobs"] is None  # no echo: the generated tokens' logprobs were not asked for
    chat = httpx.post(url + "/v1/chat/completions", headers=h, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0})
    assert chat.status_code == 400 and "chat template" in chat.json()["error"]["message"]  # this checkpoint has none
    # streamed echo: the opening chunk carries the prompt's logprobs, the rest the generated tokens'
    with httpx.stream("POST", url + "/v1/completions", headers=h, json={"prompt": ids, "max_tokens": 3, "echo": True, "logprobs": 0,
                                                                         "temperature": 0, "stream": True}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    import json

    chunks = [json.loads(e) for e in events[:-1]]
    opening = chunks[0]["choices"][0]["logprobs"]
    assert opening["token_logprobs"][0] is None and len(opening["token_logprobs"]) == len(ids)
    assert abs(opening["token_logprobs"][-1] - ref[-2, ids[-1]].item()) < 1e-4
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks[1:]) == 3
    too_many = httpx.post(url + "/v1/completions", headers=h, json={"prompt": ids, "prompt_logprobs": 21})
    assert too_many.status_code == 400 and "max-logprobs" in too_many.json()["error"]["message"]


def test_echo_with_max_tokens_0_scores_the_prompt_alone(setup):
    """OpenAI's legacy prompt-only scoring: echo + logprobs + max_tokens 0 returns the prompt scored and
    generates nothing; max_tokens 0 without asking for the prompt's logprobs stays a 400."""
    url, tok, _, engine = setup
    h = {"Authorization": f"Bearer {API_KEY}"}
    ids = tok.encode("Once upon a time, there was a little girl")
    body = {"prompt": ids, "echo": True, "logprobs": 2, "temperature": 0}
    zero = httpx.post(url + "/v1/completions", headers=h, json={**body, "max_tokens": 0}).json()
    one = httpx.post(url + "/v1/completions", headers=h, json={**body, "max_tokens": 1}).json()
    z, o = zero["choices"][0], one["choices"][0]
    assert z["finish_reason"] == "length" and zero["usage"]["completion_tokens"] == 0 and z["text"] == tok.decode(ids)
    assert z["logprobs"]["token_logprobs"] == o["logprobs"]["token_logprobs"][:-1] and len(z["logprobs"]["tokens"]) == len(ids)
    assert z["logprobs"]["top_logprobs"] == o["logprobs"]["top_logprobs"][:-1]
    with httpx.stream("POST", url + "/v1/completions", headers=h, json={**body, "max_tokens": 0, "stream": True}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    import json

    assert events[-1] == "[DONE]" and json.loads(events[0])["choices"][0]["logprobs"]["token_logprobs"] == z["logprobs"]["token_logprobs"]
    refused = httpx.post(url + "/v1/completions", headers=h, json={"prompt": ids, "max_tokens": 0})
    assert refused.status_code == 400 and "max_tokens" in refused.json()["error"]["message"]
    assert not engine.has_unfinished()
