"""DeepSeek-V2 and V3: multi-head latent attention (the cache holds each token's latent and shared rope key, attention
runs absorbed) and their routers (V3: sigmoid scores, correction bias, group-limited top-k by the two best per
group, renormalised and scaled; V2: softmax scores, greedy or group-limited by the best per group, scaled; both
with ungated shared experts and dense first layers). Against transformers in float32 on small random checkpoints the tests write:
identical greedy tokens and logprobs within 1e-3, through chunked prefill; batch invariance under preemption
and prefix caching; KV bytes per token and parameters equal to the planner's."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from sieve import LLM, SamplingParams

from conftest import _widen_init
from reference import assert_matches, greedy_reference
from test_models import NEW_TOKENS

BASE = dict(vocab_size=4096, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
            kv_lora_rank=32, qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=16, max_position_embeddings=1024,
            tie_word_embeddings=False, bos_token_id=0, eos_token_id=None, rms_norm_eps=1e-5)  # no EOS: the reference may pick any token
MODELS = {
    # V2: softmax routing limited to the group (of 4) with the best expert, weights scaled and not renormalised (with
    # top-2 of 8 experts, two eligible groups by their best would always hold the best two: one group makes it bite)
    "v2": dict(q_lora_rank=None, n_group=4, topk_group=1, topk_method="group_limited_greedy", n_shared_experts=1,
               routed_scaling_factor=1.5),
    # q through a low-rank pair with its own norm, interleaved rope, 4 groups of which 2 are eligible, a shared expert
    "v3": dict(q_lora_rank=48, rope_interleave=True, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5),
    # q_proj direct, rope in halves, no groups, weights not renormalised, two shared experts
    "v3-plain": dict(q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1, n_shared_experts=2, norm_topk_prob=False,
                     routed_scaling_factor=1.0),
}
PROMPTS = [[(5 + 37 * i) % 4000 + 3 for i in range(n)] for n in (3, 20, 41, 57)]


@pytest.fixture(scope="module")
def mla_checkpoints(tmp_path_factory):
    import transformers

    out = {}
    for seed, (name, extra) in enumerate(MODELS.items()):
        path = tmp_path_factory.mktemp(name)
        torch.manual_seed(seed)
        version = "V2" if name == "v2" else "V3"
        cfg = getattr(transformers, f"Deepseek{version}Config")(**BASE, **extra)
        model = getattr(transformers, f"Deepseek{version}ForCausalLM")(cfg).to(torch.float32)
        _widen_init(model, seed)
        with torch.no_grad():
            for layer in model.model.layers[BASE["first_k_dense_replace"]:]:
                if version == "V3":
                    layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)  # the bias chooses: make it matter
                else:  # a softmax router over 8 experts: sharpen it so the groups decide
                    layer.mlp.gate.weight.mul_(4.0)
        model.save_pretrained(path, safe_serialization=True)
        out[name] = path
    return out


def engine(path, **kw):
    kw.setdefault("num_gpu_blocks_override", 128)
    kw.setdefault("block_size", 4)
    return LLM(str(path), dtype="float32", device="cpu", skip_tokenizer_init=True, **kw)


def run(llm, prompts, **params):
    params = SamplingParams(**{"max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, **params})
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_tokens_and_logprobs_match_transformers(name, mla_checkpoints):
    path = mla_checkpoints[name]
    llm = engine(path, max_num_batched_tokens=16)  # prompts prefill in chunks
    arch = llm.llm_engine.arch
    assert arch.is_mla and arch.num_kv_heads == 1 and arch.head_dim == 32 + 16 and arch.sparse_layers == (1, 2)
    outs = run(llm, PROMPTS, logprobs=5)
    ref_tokens, ref_logprobs = greedy_reference(path, PROMPTS, NEW_TOKENS)
    assert len(set().union(*(o.outputs[0].token_ids for o in outs))) > 20, "checkpoint too degenerate to compare"
    assert_matches(outs, ref_tokens, ref_logprobs, name)


@pytest.mark.parametrize("name", ["v2", "v3"])
def test_group_limited_routing_decides_the_experts(name, mla_checkpoints):
    """The checkpoint's groups (and V3's correction bias) matter: routed over all experts, the same weights answer
    differently (so the parity above cannot pass with plain top-k)."""
    path = mla_checkpoints[name]
    grouped = [o.outputs[0].token_ids for o in run(engine(path), PROMPTS)]
    plain = [o.outputs[0].token_ids for o in run(engine(path, hf_overrides={"n_group": 1, "topk_group": 1}), PROMPTS)]
    assert grouped != plain
    moe = engine(path).llm_engine.runner.model.layers[1].moe
    assert moe.n_group == 4 and moe.scaling == (2.5 if name == "v3" else 1.5)
    assert (moe.score_bias.abs().sum() > 0) if name == "v3" else (moe.score_bias is None and not moe.norm_topk_prob)


def test_cache_holds_the_latent_only_and_agrees_with_the_planner(mla_checkpoints):
    from sieve.plan.shape import shape_from_config

    path = mla_checkpoints["v3"]
    shape = shape_from_config(json.loads((path / "config.json").read_text()))
    runner = engine(path).llm_engine.runner
    assert tuple(runner.kv_pool.shape) == (1, 3, 128, 4, 1, 32 + 16)  # one tensor per token and layer: latent | rope key
    assert runner.block_bytes // 4 == 2 * shape.kv_bytes_per_token("bf16") == 3 * 48 * 4  # float32: twice the planner's bf16
    model = runner.model
    loaded = sum(p.numel() for n, p in model.named_parameters() if "rotary" not in n)
    assert loaded == pytest.approx(shape.total_params, rel=1e-6)


def test_batch_invariance_preemption_prefix_cache_and_forks(mla_checkpoints):
    path = mla_checkpoints["v3"]
    alone = [run(engine(path), [p], logprobs=2)[0].outputs[0] for p in PROMPTS]
    crowd = PROMPTS + [p[: 9 + i] + [7, 8, 9] for i, p in enumerate(PROMPTS * 3)]
    tight = engine(path, num_gpu_blocks_override=40, max_num_batched_tokens=12, max_num_seqs=6)
    first = run(tight, crowd, logprobs=2)
    again = run(tight, crowd, logprobs=2)  # prefix-cache hits
    assert tight.llm_engine.scheduler.num_preemptions > 0 and tight.llm_engine.block_manager.num_hit_tokens > 0
    for i, ref in enumerate(alone):
        for outs in (first, again):
            got = outs[i].outputs[0]
            assert got.token_ids == ref.token_ids
            for a, b in zip(got.logprobs, ref.logprobs):
                for t, e in b.items():
                    assert a[t].logprob == pytest.approx(e.logprob, abs=1e-4)
    forked = tight.generate([{"prompt_token_ids": PROMPTS[2]}], SamplingParams(n=2, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    assert [c.token_ids for c in forked[0].outputs] == [alone[2].token_ids] * 2
    blocks = tight.llm_engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks


def test_speculative_decoding_over_latent_attention_is_lossless(mla_checkpoints):
    """Drafts verified as rows over the latent cache: the checkpoint drafting for itself (every draft accepted) and
    the other V3 checkpoint drafting (mostly rejected, rolled back) give the tokens of no speculation."""
    path = mla_checkpoints["v3"]
    plain = [o.outputs[0].token_ids for o in run(engine(path), PROMPTS)]
    for draft in (path, mla_checkpoints["v3-plain"]):
        llm = engine(path, speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
        assert [o.outputs[0].token_ids for o in run(llm, PROMPTS)] == plain
        stats = llm.llm_engine.speculator.stats
        assert stats.num_draft_tokens > 0
        assert (stats.num_accepted_tokens == stats.num_draft_tokens) == (draft == path)


def test_quantized_kv_cache_is_refused_for_latent_attention(mla_checkpoints):
    from sieve.config import ConfigError

    with pytest.raises(ConfigError, match="latent attention"):
        engine(mla_checkpoints["v3"], kv_cache_dtype="fp8")


def test_kv_compression_is_refused_for_latent_attention(mla_checkpoints):
    from sieve.config import ConfigError

    with pytest.raises(ConfigError, match="kv_compression: not built for multi-head latent attention"):
        engine(mla_checkpoints["v3"], kv_compression="knorm:0.5")


def test_unsupported_deepseek_routing_is_refused(mla_checkpoints, tmp_path):
    from sieve.models.arch import UnsupportedModelError

    path = tmp_path / "v3-greedy"
    shutil.copytree(mla_checkpoints["v3"], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["scoring_func"] = "softmax"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="DeepSeek routing"):
        engine(path)


def test_the_kv_tiers_hold_latent_blocks(mla_checkpoints, tmp_path):
    """An MLA pool's blocks (the compressed latent and the rotary key) written down, evicted, loaded back: the same
    tokens as an engine without tiers."""
    path = mla_checkpoints["v3"]
    prompt, others = PROMPTS[-1], [[(11 + 53 * i + 7 * k) % 4000 + 3 for i in range(57)] for k in range(3)]
    ref = run(engine(path), [prompt])[0].outputs[0].token_ids
    llm = engine(path, num_gpu_blocks_override=24, kv_cache_disk=str(tmp_path / "kv"))
    tiers = llm.llm_engine.kv_tiers
    tiers.recompute_s_per_block = float("inf")  # a tiny model recomputes as fast as the disk reads: price it as a real one
    assert run(llm, [prompt])[0].outputs[0].token_ids == ref
    for other in others:  # more than the pool holds: the prompt's blocks leave it
        assert tiers.flush()
        run(llm, [other])
    assert tiers.flush()
    again = run(llm, [prompt])[0]
    assert again.kv_tier_tokens["disk"] == 4 * ((len(prompt) - 1) // 4) and again.outputs[0].token_ids == ref
