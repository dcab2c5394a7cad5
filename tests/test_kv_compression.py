"""KV compression (sieve/kv_compression): the positions each press keeps are kvpress's on transformers; attention over
a compacted sequence is attention with the dropped positions masked; compressed and uncompressed requests leave
each other alone (batching, chunking, preemption, speculation); the prefix cache never serves a compressed sequence's
blocks as exact; bad fields are 400s."""

from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import SHARED
from sieve import LLM, SamplingParams
import sieve.kv_compression.compact as compact

STORIES = SHARED / "models" / "stories260K"


def record_kept(monkeypatch) -> list:
    """Every press's choice from now on: per attention layer, [KVH, n_kept] positions."""
    seen = []
    choose = compact.kept_positions

    def recorded(runner, seq, spec, *profile):
        kept = choose(runner, seq, spec, *profile)
        seen.append(kept)
        return kept

    monkeypatch.setattr(compact, "kept_positions", recorded)
    return seen


@pytest.fixture(scope="module")
def stories_llm():
    return LLM(str(STORIES), dtype="float32", device="cpu", num_gpu_blocks_override=256)


@pytest.fixture(scope="module")
def hf_stories():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32, attn_implementation="sdpa").eval()


def story_prompt(n: int, seed: int = 0) -> list[int]:
    """`n` tokens of real text (TinyStories), so attention has structure to press."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(STORIES / "tokenizer.json"))
    text = (SHARED / "data" / "tinystories_valid_sample.txt").read_text()
    start = random.Random(seed).randrange(0, len(text) // 2)
    return [1] + tok(text[start: start + 20 * n])["input_ids"][: n - 1]


def kvpress_kept(model, press, ids: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The positions kvpress's `press` keeps per layer, [KVH, n_kept] ascending, and its scores [KVH, T]: its own
    `compress` called on each layer's prompt K/V after that layer's attention (what its forward hook does;
    transformers 5 renamed the hook's cache argument), the kept keys located among the full ones."""
    from transformers import DynamicCache

    cache, kept, scores = DynamicCache(), {}, {}

    def hook(module, args, kwargs, output):
        layer = cache.layers[module.layer_idx]
        kw = dict(kwargs, past_key_values=cache)
        k2, _ = press.compress(module, kwargs["hidden_states"], layer.keys, layer.values, output[1], kw)
        scores[module.layer_idx] = press.score(module, kwargs["hidden_states"], layer.keys, layer.values, output[1], kw)[0]
        dist = torch.cdist(k2[0], layer.keys[0], compute_mode="donot_use_mm_for_euclid_dist")  # [KVH, kept, T]
        assert dist.min(-1).values.max() < 1e-5, "every key kvpress keeps is one of the prompt's"
        kept[module.layer_idx] = dist.argmin(-1).sort(-1).values
        return output

    hooks = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]), past_key_values=cache)
    finally:
        for h in hooks:
            h.remove()
    return [kept[i] for i in range(len(kept))], [scores[i] for i in range(len(kept))]


@pytest.mark.parametrize("ratio", [0.5, 0.75])
@pytest.mark.parametrize("press", ["knorm", "streaming_llm", "snapkv", "expected_attention"])
def test_press_keeps_what_kvpress_keeps(stories_llm, hf_stories, monkeypatch, press, ratio):
    """The same positions, per layer and KV head, but for ties: a key norm is the same at every position of a repeated
    token in layer 0 (rotation keeps norms), and there the float rounding of two implementations picks. A position
    kept by one and not the other must score within 1e-4 of the cutoff in kvpress's own scores (two float32
    implementations differ by ~1e-6)."""
    import kvpress

    ref_press = {"knorm": kvpress.KnormPress, "streaming_llm": kvpress.StreamingLLMPress, "snapkv": kvpress.SnapKVPress,
                 "expected_attention": kvpress.ExpectedAttentionPress}[press](compression_ratio=ratio)
    for layer in hf_stories.model.layers:  # (what kvpress's pipeline gives the attention modules it presses)
        layer.self_attn.rotary_emb = hf_stories.model.rotary_emb
    ids = story_prompt(300)
    seen = record_kept(monkeypatch)
    out = stories_llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=2,
                                                                         kv_compression={"press": press, "ratio": ratio}))[0]
    n_kept = int(300 * (1 - ratio))
    assert out.kv_kept_tokens == n_kept
    ours, (ref, ref_scores) = seen[0], kvpress_kept(hf_stories, ref_press, ids)
    assert len(ours) == len(ref) == 5
    assert_same_kept(ours, ref, ref_scores, n_kept)
    if press != "streaming_llm":  # (a scoring press keeps per head: the heads do differ)
        assert any(not torch.equal(k[0], k[1]) for k in ours)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_expected_attention_keeps_what_kvpress_keeps_with_llama3_rope_and_qk_norm(checkpoints, monkeypatch, arch):
    """Expected attention's statistics are of the queries before rotation (after Qwen3's q_norm), rotated by the
    model's own frequencies (Llama 3.1's scaled ones): kvpress's positions on random Llama and Qwen3 checkpoints."""
    import kvpress
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoints[arch], dtype=torch.float32, attn_implementation="sdpa").eval()
    for layer in hf.model.layers:
        layer.self_attn.rotary_emb = hf.model.rotary_emb
    ids = [random.Random(arch).randrange(3, 4096) for _ in range(200)]
    seen = record_kept(monkeypatch)
    llm = LLM(str(checkpoints[arch]), dtype="float32", device="cpu", num_gpu_blocks_override=64)
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=2,
                                                            kv_compression={"press": "expected_attention", "ratio": 0.5}))
    ref, ref_scores = kvpress_kept(hf, kvpress.ExpectedAttentionPress(compression_ratio=0.5), ids)
    assert_same_kept(seen[0], ref, ref_scores, 100)


@pytest.mark.parametrize("press", ["snapkv", "expected_attention"])
def test_a_press_over_a_lora_adapter_keeps_what_kvpress_keeps_over_peft(hf_stories, monkeypatch, tmp_path, press):
    """A request with an adapter is pressed on the queries its adapter computes: the positions kvpress keeps on the
    PEFT model of the same adapter (which differ from the base model's: a press that read the base model's queries
    would fail here)."""
    import copy

    import kvpress
    from peft import PeftModel

    from sieve import LoRARequest
    from test_lora import make_adapter

    folder = make_adapter(copy.deepcopy(hf_stories), tmp_path / "a", 5, scale=6.0, r=8, lora_alpha=16,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    tuned = PeftModel.from_pretrained(copy.deepcopy(hf_stories), folder).eval().base_model.model
    ref_press = {"snapkv": kvpress.SnapKVPress, "expected_attention": kvpress.ExpectedAttentionPress}[press]
    ids = story_prompt(300, seed=3)
    refs = {}
    for name, model in (("adapter", tuned), ("base", hf_stories)):
        for layer in model.model.layers:
            layer.self_attn.rotary_emb = model.model.rotary_emb
        refs[name] = kvpress_kept(model, ref_press(compression_ratio=0.5), ids)
    assert any(not torch.equal(a, b) for a, b in zip(refs["adapter"][0], refs["base"][0]))  # the adapter changes the choice
    llm = LLM(str(STORIES), dtype="float32", device="cpu", num_gpu_blocks_override=256, enable_lora=True, max_lora_rank=8)
    seen = record_kept(monkeypatch)
    lora, prompt = LoRARequest("a", 1, folder), [{"prompt_token_ids": ids}]
    pressed = SamplingParams(temperature=0, max_tokens=2, kv_compression={"press": press, "ratio": 0.5})
    assert llm.generate(prompt, pressed, lora_request=lora)[0].kv_kept_tokens == 150
    # again over the prompt's blocks the first left in the adapter's prefix cache: the press's pass over cached
    # positions (expected attention's query statistics) runs the adapter too
    again = llm.generate(prompt, pressed, lora_request=lora)[0]
    assert again.num_cached_tokens > 0 and again.kv_kept_tokens == 150
    for kept in seen:
        assert_same_kept(kept, *refs["adapter"], 150)


def assert_same_kept(ours: list, ref: list, ref_scores: list, n_kept: int) -> None:
    ties = exact = 0
    for layer, (a, b, s) in enumerate(zip(ours, ref, ref_scores)):
        for head in range(a.shape[0]):
            differ = set(a[head].tolist()) ^ set(b[head].tolist())
            cutoff = s[head].topk(n_kept).values[-1]
            for p in differ:
                assert abs(s[head, p] - cutoff) <= 1e-4 * max(1.0, abs(cutoff)), \
                    f"layer {layer} head {head}: position {p} (score {s[head, p]:.6g}, cutoff {cutoff:.6g}) is no tie"
            ties += len(differ) // 2
            exact += not differ
    assert ties <= 0.01 * n_kept * a.shape[0] * len(ours)
    assert exact >= 0.9 * a.shape[0] * len(ours)


def record_query_moments(monkeypatch) -> list:
    """Every expected-attention score from now on: per attention layer, the (mean, covariance) it scored against."""
    from sieve.kv_compression.expected_attention import ExpectedAttentionPress

    seen, score = [], ExpectedAttentionPress.score

    def recorded(self, kv):
        seen.append((kv.query_mean.clone(), kv.query_cov.clone()))
        return score(self, kv)

    monkeypatch.setattr(ExpectedAttentionPress, "score", recorded)
    return seen


def reference_query_moments(model, ids: list[int], n_sink: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the mean [H, D] and covariance [H, D, D] of transformers' queries before rotation at positions
    n_sink .. T - 1 (q_proj of each attention module's input), centred and divided by their count."""
    inputs = {}
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, kw, out, i=i: inputs.__setitem__(i, kw["hidden_states"]),
                                                   with_kwargs=True) for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    out = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        with torch.no_grad():
                q = attn.q_proj(inputs[i][0, n_sink:]).view(len(ids) - n_sink, -1, attn.head_dim).transpose(0, 1).double()
        mean = q.mean(dim=1)
        c = q - mean[:, None]
        out.append((mean, c.transpose(1, 2) @ c / q.shape[1]))
    return out


@pytest.mark.parametrize("how", ["one-prefill", "chunked", "prefix-hit", "preempted"])
def test_expected_attention_gathers_the_prompts_query_statistics_during_its_prefill(hf_stories, monkeypatch, how):
    """Its statistics are counted while the prompt's own prefill runs (no second pass), in one chunk or many, across a
    preemption (recomputed positions not counted twice); positions taken from the prefix cache run through a pass
    that writes nothing. Each way: transformers' query mean and covariance within 1e-5."""
    ids = story_prompt(300, seed=5)
    options = {"chunked": dict(max_num_batched_tokens=48), "preempted": dict(num_gpu_blocks_override=30, block_size=16,
                                                                                max_num_batched_tokens=64)}
    llm = LLM(str(STORIES), dtype="float32", device="cpu", **{"num_gpu_blocks_override": 256, **options.get(how, {})})
    runner, passes = llm.llm_engine.runner, []
    tap = runner.tap_queries
    monkeypatch.setattr(runner, "tap_queries", lambda toks, a, b, *rest: passes.append((a, b)) or tap(toks, a, b, *rest))
    press = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                           kv_compression={"press": "expected_attention", "ratio": 0.5})
    if how == "prefix-hit":
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1))
    seen = record_query_moments(monkeypatch)
    if how == "preempted":  # two earlier requests crowd the pool (30 blocks of 16; the long prompt needs 19 alone)
        scheduler, pressed_preempted = llm.llm_engine.scheduler, []
        preempt = scheduler._preempt

        def recorded(seq, out):
            if seq.params.kv_compression is not None:
                pressed_preempted.append((seq.num_computed_tokens, seq.kv_compressed))
            preempt(seq, out)

        monkeypatch.setattr(scheduler, "_preempt", recorded)
        crowd = [{"prompt_token_ids": story_prompt(120, seed=s)} for s in (6, 7)]
        outs = llm.generate(crowd + [{"prompt_token_ids": ids}],
                            [SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)] * 2 + [press])
        assert pressed_preempted, "the pressed request must have been preempted"
        out = outs[-1]
    else:
        out = llm.generate([{"prompt_token_ids": ids}], press)[0]
        assert passes == ([(4, 288)] if how == "prefix-hit" else []), "only cached positions run again (18 blocks of 16)"
    assert out.kv_kept_tokens == 150
    ref = reference_query_moments(hf_stories, ids)
    ours = seen[-len(ref):]
    for (mean, cov), (ref_mean, ref_cov) in zip(ours, ref):  # (float32 sums: relative to the largest entry)
        assert (mean.double() - ref_mean).abs().max() < 1e-5 * ref_mean.abs().max()
        assert (cov.double() - ref_cov).abs().max() < 1e-5 * ref_cov.abs().max()


def test_expected_attention_in_the_native_layer_loop(monkeypatch):
    """In bfloat16 the C++ layer loop runs the steps and hands the tapped rows' queries over: every step of a prompt
    being gathered stays in the C++ loop, so a plain request beside it gets the bits it gets beside the same prompt
    uncompressed (the same steps, but for the press); the statistics are the PyTorch loop's within bf16 rounding."""
    ids, other = story_prompt(300, seed=8), {"prompt_token_ids": story_prompt(200, seed=9)}
    press = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                           kv_compression={"press": "expected_attention", "ratio": 0.5})
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)

    def run(native: bool, first: SamplingParams):
        llm = LLM(str(STORIES), dtype="bfloat16", device="cpu", num_gpu_blocks_override=128)
        model, calls = llm.llm_engine.runner.model, {"all": 0, "native": 0}
        assert model.native is not None
        if not native:
            model.native = None
        forward, forward_native = model.forward, model._forward_native
        monkeypatch.setattr(model, "forward", lambda *a, **k: calls.__setitem__("all", calls["all"] + 1) or forward(*a, **k))
        monkeypatch.setattr(model, "_forward_native",
                            lambda *a, **k: calls.__setitem__("native", calls["native"] + 1) or forward_native(*a, **k))
        out = llm.generate([{"prompt_token_ids": ids}, other], [first, plain])[1].outputs[0]
        return out, calls

    seen = record_query_moments(monkeypatch)
    beside_press, calls = run(True, press)
    assert calls["native"] == calls["all"] > 10, "every step ran in the C++ loop"
    native_moments = list(seen)
    seen.clear()
    beside_plain, _ = run(True, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert beside_press.token_ids == beside_plain.token_ids
    assert [{t: lp.logprob for t, lp in d.items()} for d in beside_press.logprobs] == \
           [{t: lp.logprob for t, lp in d.items()} for d in beside_plain.logprobs]
    run(False, press)
    assert len(native_moments) == len(seen) == 5
    for (m1, c1), (m2, c2) in zip(native_moments, seen):
        assert (m1 - m2).abs().max() < 2e-2 * m2.abs().max()
        assert (c1 - c2).abs().max() < 2e-2 * c2.abs().max()


@pytest.mark.parametrize("spec", [{"press": "snapkv", "ratio": 0.6}, {"press": "snapkv", "ratio": 0.6, "budgets": "entropy"},
                                  {"press": "knorm", "ratio": 0.75, "budgets": "entropy"}], ids=["snapkv", "snapkv-entropy",
                                                                                               "knorm-entropy"])
def test_attention_over_compacted_sequence_is_attention_with_dropped_positions_masked(stories_llm, monkeypatch, spec):
    """Each decode step after the press against transformers (float32) with, per layer and KV head, the dropped prompt
    positions masked out of every later query's attention: every logit within 1e-5. With entropy budgets each layer
    keeps its own count (whole blocks, the same total), packed across the pool's layer planes."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    ids = story_prompt(200, seed=1)
    seen = record_kept(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=5, ignore_eos=True, kv_compression=spec)
    held = []
    step = stories_llm.llm_engine.step

    def watch():
        held.extend(len(s.block_table) for s in stories_llm.llm_engine.scheduler.running if s.kv_compressed)
        return step()

    monkeypatch.setattr(stories_llm.llm_engine, "step", watch)
    out = stories_llm.generate([{"prompt_token_ids": ids}], params)[0]
    kept, T = seen[0], len(ids)
    counts = [k.shape[1] for k in kept]
    if "budgets" in spec:  # layers keep different counts, in whole blocks, the uniform total; the blocks held are that
        assert len(set(counts)) > 1 and all(c % 16 == 0 for c in counts)
        assert sum(counts) == len(counts) * int(T * (1 - spec["ratio"])) // 16 * 16
        packed = -(-sum(counts) // (16 * len(counts)))  # the layers' mean in blocks, not the largest layer's count
        assert packed < max(counts) // 16 and set(held) == {packed + 1}  # (and one block for the 12 tokens after)
        assert out.kv_kept_tokens == sum(counts) // len(counts)
    AttentionInterface.register("sieve_kept_only", kept_only_attention(dict(enumerate(kept)), T))
    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32, attn_implementation="sieve_kept_only").eval()
    tokens = ids + out.outputs[0].token_ids
    with torch.no_grad():
        from transformers import DynamicCache

        cache = DynamicCache()
        logits = [model(torch.tensor([ids]), past_key_values=cache).logits[0, -1]]
        for t in tokens[T:-1]:
            logits.append(model(torch.tensor([[t]]), past_key_values=cache).logits[0, -1])
    ref = torch.log_softmax(torch.stack(logits), dim=-1)
    for i, (token, lps) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        assert ref[i].max() - ref[i, token] < 1e-5  # the token sieve chose is the reference's top (up to ties)
        for tid, lp in lps.items():
            assert abs(lp.logprob - ref[i, tid].item()) < 1e-5, f"step {i}, token {tid}"
    # and the mask mattered: without it the answer's logprobs differ
    full = torch.log_softmax(hf_logits_unmasked(tokens, T), dim=-1)
    assert (full - ref).abs().max() > 1e-3


def kept_only_attention(kept_by_layer: dict, T: int):
    """A transformers attention function (float32, eager): causal, within a sliding layer's window (keys p - W < k
    <= p), and for queries after the `T`-token prompt, of its positions only those `kept_by_layer[layer]` ([KVH, n])
    keeps for each KV head (every position in a layer not in it)."""

    def masked(module, q, k, v, attention_mask, scaling, dropout=0.0, sliding_window=None, **kwargs):
        H, KVH, n, L = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
        k, v = k.repeat_interleave(H // KVH, dim=1), v.repeat_interleave(H // KVH, dim=1)
        logits = torch.matmul(q, k.transpose(2, 3)) * scaling  # [1, H, n, L]
        q_pos, k_pos = torch.arange(L - n, L)[:, None], torch.arange(L)[None, :]
        visible = (k_pos <= q_pos).expand(H, n, L).clone()
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        if n < L and module.layer_idx in kept_by_layer:  # after the prompt: its kept positions, then every later one
            allowed = torch.zeros(KVH, L, dtype=torch.bool)
            allowed[:, T:] = True
            allowed.scatter_(1, kept_by_layer[module.layer_idx].cpu(), True)
            visible &= allowed.repeat_interleave(H // KVH, dim=0)[:, None, :]
        probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
        return torch.matmul(probs, v).transpose(1, 2), None

    return masked


def hf_logits_unmasked(tokens: list[int], T: int) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, T - 1: len(tokens) - 1]


def mixed_workload(n: int, seed: int = 0, budgets: bool = True) -> tuple[list, list]:
    """`n` prompts of random ids with every press in turn (and none); `budgets`: entropy budgets among them."""
    rng = random.Random(seed)
    presses = [None, {"press": "snapkv", "ratio": 0.5}, {"press": "knorm", "ratio": 0.75},
               {"press": "streaming_llm", "ratio": 0.5}, {"press": "chunkkv", "ratio": 0.5},
               {"press": "expected_attention", "ratio": 0.6}]
    prompts, params = [], []
    for i in range(n):
        prompts.append({"prompt_token_ids": [rng.randrange(3, 4096) for _ in range(rng.randint(70, 160))]})
        sampling = dict(temperature=0) if i % 2 == 0 else dict(temperature=0.9, seed=100 + i)
        press = presses[i % len(presses)]
        if budgets and i >= len(presses) and press and press["press"] in ("snapkv", "knorm"):  # the second round's
            press = {**press, "budgets": "entropy"}
        params.append(SamplingParams(max_tokens=rng.randint(5, 25), ignore_eos=True, kv_compression=press, **sampling))
    return prompts, params


@pytest.fixture(scope="module")
def mixed_alone(llama_llm):
    prompts, params = mixed_workload(12)
    return [llama_llm.generate([p], [sp])[0].outputs[0].token_ids for p, sp in zip(prompts, params)]


@pytest.mark.parametrize("options", [
    dict(),  # all in one batch
    dict(max_num_batched_tokens=24),  # every prompt chunked, decodes beside them
    dict(num_gpu_blocks_override=13, block_size=16),  # preempted and pressed again; compacted in place when short
], ids=["batch", "chunked", "preempt"])
def test_compressed_and_plain_requests_leave_each_other_unchanged(llama_engine_factory, mixed_alone, options):
    llm = llama_engine_factory(**options)
    prompts, params = mixed_workload(12)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == mixed_alone
    for o, sp in zip(outs, params):
        assert (o.kv_kept_tokens is None) == (sp.kv_compression is None)
    engine = llm.llm_engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    if "num_gpu_blocks_override" in options:
        assert engine.scheduler.num_preemptions > 0
    stats = engine.stats().kv_compression
    assert stats.requests == 10 and stats.dropped_tokens > 0 and stats.skipped == 0


def test_a_sequence_with_entropy_budgets_preempted_after_its_press_recomputes_its_tokens(llama_engine_factory, monkeypatch):
    """Entropy budgets beside plain requests in a pool too small for them all: a budgeted sequence preempted after its
    press computes its prompt and presses it again, then recomputes its later tokens as a prefill chunk over each
    layer's own kept blocks (per-layer views of the step); every request's tokens as alone, every block back."""
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 4096) for _ in range(n)]} for n in (90, 150, 120, 140)]
    presses = (None, {"press": "snapkv", "ratio": 0.5, "budgets": "entropy"}, None,
               {"press": "knorm", "ratio": 0.75, "budgets": "entropy"})
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, kv_compression=c) for c in presses]
    alone = [llama_engine_factory().generate([p], [sp])[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    llm = llama_engine_factory(num_gpu_blocks_override=16, block_size=16)
    runner, chunks = llm.llm_engine.runner, []
    views = runner._layer_views

    def seen(meta, writes, decodes, prefills):
        chunks.extend(h for _, _, _, h in prefills if h.kv_cells is not None)
        return views(meta, writes, decodes, prefills)

    monkeypatch.setattr(runner, "_layer_views", seen)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == alone
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions > 0 and chunks
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("budgets", ["uniform", "entropy"])
@pytest.mark.parametrize("branches", [1, 3], ids=["chain", "tree"])
def test_compression_changes_the_output_and_speculation_does_not(stories_llm, budgets, branches):
    """The press is not a no-op (a 4x press changes a long greedy story), and n-gram speculation on a compressed
    sequence verifies against the compacted cache (with entropy budgets, each layer's own blocks; a draft tree's forks
    share them): the same tokens as without it."""
    prompt = {"prompt_token_ids": story_prompt(250, seed=2)}
    plain = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    pressed = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True,
                             kv_compression={"press": "snapkv", "ratio": 0.75, "budgets": budgets})
    a, b = (stories_llm.generate([prompt], sp)[0].outputs[0].token_ids for sp in (plain, pressed))
    assert a != b
    spec = LLM(str(STORIES), dtype="float32", device="cpu", num_gpu_blocks_override=256,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                                   "num_branches": branches})
    out = spec.generate([prompt], pressed)[0]
    assert out.outputs[0].token_ids == b
    assert spec.llm_engine.stats().spec_decode.num_accepted_tokens > 0, "drafts must have been verified"


def test_compressed_blocks_never_enter_the_exact_prefix_cache(llama_engine_factory, monkeypatch):
    llm = llama_engine_factory()
    engine = llm.llm_engine
    rng = random.Random(3)
    prompt = [rng.randrange(3, 4096) for _ in range(130)]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = llm.generate([{"prompt_token_ids": prompt}], sp)[0]
    tables = []
    commit = engine.block_manager.commit

    def watched(seq):
        commit(seq)
        if seq.kv_dropped:
            tables.append(list(seq.block_table))

    monkeypatch.setattr(engine.block_manager, "commit", watched)
    # a prompt the plain request's blocks hold (its prompt and 30 of its tokens) compressed: they are a hit (the press
    # scores the exact prompt), and what the compressed sequence writes after its press is never cached
    pressed_params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, kv_compression={"press": "knorm", "ratio": 0.5})
    pressed = llm.generate([{"prompt_token_ids": prompt + plain.outputs[0].token_ids[:30]}], pressed_params)[0]
    assert pressed.num_cached_tokens == 144  # its prompt's full blocks before its last token (9 x 16)
    cached = set(engine.block_manager.cached.values())
    assert tables and not any(b in cached for t in tables for b in t), "a compacted block entered the prefix cache"
    # and a plain request afterwards is what it is on a fresh engine
    again = llm.generate([{"prompt_token_ids": prompt + plain.outputs[0].token_ids[:30]}], sp)[0]
    fresh = llama_engine_factory().generate([{"prompt_token_ids": prompt + plain.outputs[0].token_ids[:30]}], sp)[0]
    assert again.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_a_compressed_request_reentering_takes_no_exact_block_past_its_prompt(llama_engine_factory):
    """After preemption a compressed sequence recomputes its prompt, presses it again and recomputes its later
    tokens over the kept positions: a cached exact block of those later tokens (here from a plain request that
    generated the same tokens) would be the uncompressed KV."""
    llm = llama_engine_factory()
    engine = llm.llm_engine
    rng = random.Random(11)
    prompt = [rng.randrange(3, 4096) for _ in range(64)]
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, kv_compression={"press": "streaming_llm", "ratio": 0.5})
    ref = llm.generate([{"prompt_token_ids": prompt}], sp)[0].outputs[0].token_ids
    plain = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt + ref[:40]}], plain)  # exact blocks of the prompt and 40 of its tokens
    engine.add_request("c", {"prompt_token_ids": prompt}, sp)
    seq = engine.requests["c"].seqs[0]
    while seq.num_output_tokens < 20:
        engine.step()
    engine.scheduler.remove(seq)  # (what preemption does to its blocks) and queue it again
    seq.num_preemptions += 1
    engine.scheduler.add(seq)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    assert outs[0].outputs[0].token_ids == ref
    assert outs[0].kv_kept_tokens == 32 and seq.num_preemptions == 1


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_quantized_kv_cache_compacts_codes_and_scales(llama_engine_factory, kv):
    """A quantized cache moves its codes (and int8's per-slot scales) with them: the same tokens in a batch as alone."""
    llm = llama_engine_factory(kv_cache_dtype=kv)
    prompts, params = mixed_workload(5, seed=4)
    alone = [llm.generate([p], [sp])[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == alone


@pytest.mark.parametrize("kv", ["auto", "int8", "fp8"])
def test_entropy_budgets_move_each_layers_kept_kv_into_its_cells(monkeypatch, kv):
    """Right after the press, each layer's table over the flattened pool (its own plane, then the planes it
    borrows) reads back exactly the K/V (codes and int8's scales) of the positions it kept, in order."""
    llm = LLM(str(STORIES), dtype="float32", device="cpu", num_gpu_blocks_override=256, kv_cache_dtype=kv)
    runner = llm.llm_engine.runner
    seen, read, checked = record_kept(monkeypatch), {}, []
    prompt_kv, compress = runner.prompt_kv, compact.compress_sequence

    def reading(layer, table, T):
        read[layer] = prompt_kv(layer, table, T)
        return read[layer]

    def compressing(runner_, blocks, seq, spec, *profile):
        done = compress(runner_, blocks, seq, spec, *profile)
        cells, plane = seq.kv_cells, runner.kv_pools[0].shape[2]
        for a, (layer, kept) in enumerate(zip(runner.attention_layers, seen[-1])):
            table = torch.tensor(cells.table(a, seq.block_table, plane)[: len(cells.cells[a])])
            k, v = runner.caches[layer].flat.read_kv(table, torch.float32)
            heads = torch.arange(kept.shape[0])[:, None]
            for got, want in ((k, read[layer][0]), (v, read[layer][1])):
                assert torch.equal(got[: kept.shape[1]].transpose(0, 1), want[heads, kept]), (kv, a)
            checked.append(len(cells.cells[a]))
        return done

    monkeypatch.setattr(runner, "prompt_kv", reading)
    monkeypatch.setattr(compact, "compress_sequence", compressing)
    params = SamplingParams(max_tokens=3, temperature=0, kv_compression={"press": "snapkv", "ratio": 0.6, "budgets": "entropy"})
    llm.generate([{"prompt_token_ids": story_prompt(200, seed=1)}], params)
    assert len(checked) == 5 and max(checked) > -(-sum(checked) // 5)  # a layer keeps more blocks than the sequence holds


def test_bad_kv_compression_is_refused():
    for bad in ({"press": "nope", "ratio": 0.5}, {"press": "snapkv", "ratio": 0}, {"press": "snapkv", "ratio": 1.0},
                {"press": "snapkv", "ratio": "half"}, {"press": "snapkv"}, {"press": "snapkv", "ratio": 0.5, "window": 3},
                "snapkv", "snapkv:x", 5, "snapkv:0.5:h2o", {"press": "snapkv", "ratio": 0.5, "budgets": "pyramid"},
                {"press": "snapkv", "ratio": 0.5, "budgets": 1}, {"press": "chunkkv", "ratio": 0.5, "budgets": "entropy"}):
        with pytest.raises(ValueError, match="kv_compression"):
            SamplingParams(kv_compression=bad)
    assert str(SamplingParams(kv_compression="knorm:0.75:entropy").kv_compression) == "knorm:0.75:entropy"
    with pytest.raises(ValueError, match="n = 1"):
        SamplingParams(n=2, kv_compression={"press": "snapkv", "ratio": 0.5})
    assert str(SamplingParams(kv_compression="snapkv:0.5").kv_compression) == "snapkv:0.5"


def test_server_field_usage_metrics_and_400s(llama_dir):
    import openai
    import httpx

    from live_server import API_KEY, MODEL, start_server
    from sieve import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=256, max_model_len=512,
                                    kv_compression="streaming_llm:0.5"))
    url, stop = start_server(engine)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY)
        prompt = list(range(10, 110))
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_body={"kv_compression": {"press": "knorm", "ratio": 0.75}})
        assert r.usage.prompt_tokens_details.kv_kept_tokens == 25
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)  # the server's default
        assert r.usage.prompt_tokens_details.kv_kept_tokens == 50
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello " * 40}], max_tokens=3,
                                              extra_body={"kv_compression": {"press": "snapkv", "ratio": 0.5}}, stream=True,
                                              stream_options={"include_usage": True})
        usage = [c.usage for c in chat if c.usage is not None][0]
        assert usage.prompt_tokens_details.kv_kept_tokens == usage.prompt_tokens // 2
        for bad, match in (({"press": "h2o", "ratio": 0.5}, "unknown press"), ({"press": "knorm", "ratio": 1.5}, r"\(0, 1\)"),
                           ({"press": "knorm", "ratio": 0}, r"\(0, 1\)"), ({"press": "knorm"}, "takes"),
                           ({"press": "knorm", "ratio": 0.5, "budgets": "layers"}, "budgets")):
            with pytest.raises(openai.BadRequestError, match=match) as e:
                client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"kv_compression": bad})
            assert e.value.body["param"] == "kv_compression"
        metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
        assert "sieve:kv_compression_requests_total" in metrics
        dropped = [line for line in metrics.splitlines() if line.startswith("sieve:kv_compression_dropped_tokens_total")]
        assert dropped and float(dropped[0].split()[-1]) >= 75 + 50
    finally:
        stop()


def test_models_a_press_cannot_serve_are_refused_by_name(checkpoints):
    from sieve import EngineConfig, LLMEngine
    from sieve.config import ConfigError
    from sieve.engine import RequestError

    # (a model with some full-attention layers is pressed there: test_a_press_on_gemma3_compresses_its_global_layers)
    sliding = dict(model=str(checkpoints["mistral"]), dtype="float32", num_gpu_blocks_override=64, hf_overrides={"sliding_window": 32})
    with pytest.raises(ConfigError, match="every attention layer slides"):
        LLMEngine(EngineConfig(**sliding, kv_compression="knorm:0.5"))
    engine = LLMEngine(EngineConfig(**sliding))
    with pytest.raises(RequestError, match="kv_compression: every attention layer slides"):
        engine.add_request("r", {"prompt_token_ids": [5] * 40}, SamplingParams(kv_compression="knorm:0.5"))
    with pytest.raises(ConfigError, match="unknown press"):
        EngineConfig(model=str(checkpoints["llama"]), kv_compression="h2o:0.5").validate()


def test_a_pool_too_short_for_a_fresh_copy_keeps_the_start_of_the_cached_prompt():
    """With no free block the compacted copy goes to the sequence's own last blocks: the prompt's leading blocks stay
    cached (a chained hash finds nothing past a missing first block), for the next turn of the same conversation."""
    from sieve.block_manager import BlockManager
    from sieve.outputs import RequestMetrics
    from sieve.sequence import Request, Sequence

    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    params = SamplingParams(kv_compression="knorm:0.5")
    req = Request("r", None, list(range(3, 33)), params, 0, RequestMetrics(arrival_time=0.0))
    seq = Sequence(req, 0, 0, list(range(3, 33)), None)
    assert bm.allocate(seq, 30) and bm.num_free_blocks == 0
    seq.num_computed_tokens = 30
    bm.commit(seq)
    hashes = bm.prompt_hashes(list(range(3, 33)))
    old, new = bm.compact(seq, 15)
    assert new == old[-4:] and seq.block_table == new
    assert all(bm.cached_block(h) == b for h, b in zip(hashes[:3], old[:3])), "the prompt's first blocks left the cache"
    assert not any(b in bm.cached.values() for b in new)
    assert bm.num_free_blocks == 4  # the first four: cached, unreferenced


# ---- models with sliding-window layers: the full-attention layers are pressed, the windows kept whole ----------------
@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory, demo_dir):
    """A random Gemma 3 (tests/test_sliding_window.py's): layers 0, 1 and 3 slide (window 8), layer 2 is global."""
    import test_sliding_window

    return test_sliding_window.sliding_checkpoints.__wrapped__(tmp_path_factory, demo_dir)["gemma3"]


def gemma3_masked_reference(path, kept_by_layer: dict, ids: list[int], tokens: list[int]) -> torch.Tensor:
    """Transformers' logprobs (float32) for the prompt's last position and each of `tokens` but the last, where every
    later query's attention in layer l leaves out the prompt positions not in `kept_by_layer[l]` (per KV head); the
    sliding layers keep their window (keys p - W < k <= p)."""
    from transformers import AttentionInterface, AutoModelForCausalLM, DynamicCache

    AttentionInterface.register("sieve_gemma3_kept_only", kept_only_attention(kept_by_layer, len(ids)))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sieve_gemma3_kept_only").eval()
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        logits = [model(torch.tensor([ids]), past_key_values=cache).logits[0, -1]]
        for t in tokens[:-1]:
            logits.append(model(torch.tensor([[t]]), past_key_values=cache).logits[0, -1])
    return torch.log_softmax(torch.stack(logits), dim=-1)


@pytest.mark.parametrize("press", ["snapkv", "expected_attention"])
def test_a_press_on_gemma3_compresses_its_global_layers(gemma3_dir, monkeypatch, press):
    """On a model with sliding-window layers the press compresses the full-attention layers only; the windows stay
    whole and keep their slots at positions. Each decode step after the press against transformers (float32) with
    the dropped prompt positions masked out of the global layer and the sliding layers' own window: every logprob
    within 1e-4. Prefill in chunks shorter than SnapKV's window of queries (its last chunk's window blocks must still
    be there for the press's pass)."""
    from test_sliding_window import engine

    rng = random.Random(5)
    ids = [rng.randrange(3, 4096) for _ in range(150)]
    seen = record_kept(monkeypatch)
    llm = engine(gemma3_dir, max_num_batched_tokens=20)
    assert llm.llm_engine.runner.attention_layers == [2]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=5, ignore_eos=True,
                            kv_compression={"press": press, "ratio": 0.6})
    out = llm.generate([{"prompt_token_ids": ids}], params)[0]
    assert out.kv_kept_tokens == 60 and len(seen) == 1 and len(seen[0]) == 1
    window = llm.llm_engine.block_manager.window
    assert window.num_window_freed > 0, "the sliding layers' pool gave blocks back as usual"
    tokens = out.outputs[0].token_ids
    ref = gemma3_masked_reference(gemma3_dir, {2: seen[0][0]}, ids, tokens)
    for i, (token, lps) in enumerate(zip(tokens, out.outputs[0].logprobs)):
        assert ref[i].max() - ref[i, token] < 1e-4
        for tid, lp in lps.items():
            assert abs(lp.logprob - ref[i, tid].item()) < 1e-4, f"step {i}, token {tid}"
    # the mask mattered: transformers without it (the windows alone) differs
    plain = gemma3_masked_reference(gemma3_dir, {}, ids, tokens)
    assert (plain - ref).abs().max() > 1e-3


@pytest.mark.parametrize("options", [
    dict(num_gpu_blocks_override=512),  # all in one batch
    dict(num_gpu_blocks_override=512, max_num_batched_tokens=24),  # chunked, decodes beside them
    dict(num_gpu_blocks_override=13, block_size=16),  # preempted and pressed again
], ids=["batch", "chunked", "preempt"])
def test_gemma3_compressed_and_plain_requests_leave_each_other_unchanged(gemma3_dir, options):
    """Every press beside plain requests on the Gemma 3 checkpoint, twice (the second time plain prompts hit the
    prefix cache, and expected attention's requests take no hit: the window layers gave back the blocks its pass over a
    cached prefix would read): each request's tokens as alone, and every block back."""
    from sieve import LLM

    prompts, params = mixed_workload(12, budgets=False)
    alone = [LLM(str(gemma3_dir), dtype="float32", device="cpu").generate([p], [sp])[0].outputs[0].token_ids
             for p, sp in zip(prompts[:6], params[:6])]
    llm = LLM(str(gemma3_dir), dtype="float32", device="cpu", **options)
    for _ in range(2):
        outs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs[:6]] == alone
        assert all((o.kv_kept_tokens is None) == (sp.kv_compression is None) for o, sp in zip(outs, params))
    engine = llm.llm_engine
    blocks = engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks and blocks.window.num_free_blocks == blocks.window.num_blocks
    if options["num_gpu_blocks_override"] < 100:  # a pool this short keeps nothing cached for the second run
        assert engine.scheduler.num_preemptions > 0
    else:
        assert blocks.num_hit_tokens > 0
    assert engine.stats().kv_compression.requests == 20


def test_entropy_budgets_on_a_model_with_sliding_window_layers_are_refused_by_name(gemma3_dir):
    from sieve import EngineConfig, LLMEngine
    from sieve.config import ConfigError
    from sieve.engine import RequestError

    options = dict(model=str(gemma3_dir), dtype="float32", num_gpu_blocks_override=64)
    with pytest.raises(ConfigError, match="entropy budgets are not built for models with sliding-window layers"):
        LLMEngine(EngineConfig(**options, kv_compression="snapkv:0.5:entropy"))
    engine = LLMEngine(EngineConfig(**options))
    with pytest.raises(RequestError, match="entropy budgets"):
        engine.add_request("r", {"prompt_token_ids": [5] * 100}, SamplingParams(kv_compression="snapkv:0.5:entropy"))


def test_entropy_budgets_by_a_calibration_profile(tmp_path, monkeypatch):
    """With `kv_budget_profile` (per-layer entropies on calibration text, scripts/attention_entropy.py's JSON), every
    prompt's layers keep the shares that profile gives, whatever the prompt; a file that is not such a profile, or one
    for another number of layers, is refused by name."""
    from sieve.config import ConfigError
    from sieve.kv_compression.budgets import layer_blocks

    profile = [1.0, 4.0, 1.0, 2.0, 1.0]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"entropy_nats": profile}))
    llm = LLM(str(STORIES), dtype="float32", device="cpu", num_gpu_blocks_override=256, kv_budget_profile=str(path))
    seen = record_kept(monkeypatch)
    params = SamplingParams(max_tokens=2, temperature=0, kv_compression="knorm:0.6:entropy")
    for seed in (1, 2):
        llm.generate([{"prompt_token_ids": story_prompt(200, seed=seed)}], params)
    want = [16 * b for b in layer_blocks(profile, int(200 * 0.4), 200, 16)]
    assert [k.shape[1] for k in seen[0]] == [k.shape[1] for k in seen[1]] == want and len(set(want)) > 1
    for bad, match in ((json.dumps([1.0, 2.0]), "5 attention layers"), ("[1, -2, 3, 4, 5]", "positive"), ("{", "JSON")):
        path.write_text(bad)
        with pytest.raises(ConfigError, match=match):
            LLM(str(STORIES), dtype="float32", device="cpu", num_gpu_blocks_override=64, kv_budget_profile=str(path))


@pytest.mark.parametrize("kv", ["auto", "int8", "fp8"])
def test_entropy_budgets_in_the_native_layer_loop(llama_dir, monkeypatch, kv):
    """In bfloat16 the C++ layer loop runs steps with per-layer budgets too (each layer reads its own tables over the
    pool's planes: LayerReads): decode rows beside plain requests, and a budgeted sequence preempted after its press
    recomputing its tokens as a chunk. Every token and logprob is the PyTorch layer loop's, bit for bit."""
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 4096) for _ in range(n)]} for n in (90, 150, 120, 140)]
    presses = (None, {"press": "snapkv", "ratio": 0.5, "budgets": "entropy"}, None,
               {"press": "knorm", "ratio": 0.75, "budgets": "entropy"})
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2, kv_compression=c) for c in presses]

    def run(native: bool):
        llm = LLM(str(llama_dir), dtype="bfloat16", device="cpu", num_gpu_blocks_override=16, block_size=16, kv_cache_dtype=kv)
        engine, steps = llm.llm_engine, {"budgeted": 0, "chunks": 0}
        model = engine.runner.model
        assert model.native is not None
        if not native:
            model.native = None
        forward_native = model._forward_native

        def counted(x, positions, caches, meta, *rest):
            if meta.layers:
                steps["budgeted"] += 1
                steps["chunks"] += bool(meta.prefills)
            return forward_native(x, positions, caches, meta, *rest)

        monkeypatch.setattr(model, "_forward_native", counted)
        outs = llm.generate(prompts, params)
        assert engine.scheduler.num_preemptions > 0
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs]) for o in outs], steps

    native, steps = run(True)
    assert steps["budgeted"] > 20 and steps["chunks"] > 0, steps
    assert run(False)[0] == native
