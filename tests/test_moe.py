"""Mixture-of-experts models (Mixtral; Qwen2-MoE with a shared expert and a dense layer; Qwen3-MoE with q/k norms):
identical greedy tokens and logprobs within 1e-3 of transformers in float32, batch invariance, chunked prefill
and preemption, and experts that quantize like any other linear."""

from __future__ import annotations

import pytest
import torch

from sieve import LLM, SamplingParams

from conftest import BASE, _widen_init
from reference import assert_matches, greedy_reference
from test_models import NEW_TOKENS, PROMPTS

MOE = {
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False,
                                                             sliding_window=None)),
    # a shared expert behind a sigmoid gate, top-k weights not renormalised, layer 1 dense (mlp_only_layers)
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                                                 shared_expert_intermediate_size=96, norm_topk_prob=False,
                                                                 mlp_only_layers=[1], tie_word_embeddings=True)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                                                 norm_topk_prob=True, head_dim=32, tie_word_embeddings=True)),
}


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory, demo_dir):
    import shutil

    import transformers

    out = {}
    for seed, (name, (cls_name, cfg_name, extra)) in enumerate(MOE.items()):
        path = tmp_path_factory.mktemp(name)
        cfg = getattr(transformers, cfg_name)(**BASE, **extra)
        torch.manual_seed(seed)
        model = getattr(transformers, cls_name)(cfg).to(torch.float32)
        _widen_init(model, seed)
        model.save_pretrained(path, safe_serialization=True)
        for f in demo_dir.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f, path / f.name)
        out[name] = path
    return out


def engine(path, **kw):
    kw.setdefault("num_gpu_blocks_override", 256)
    return LLM(str(path), dtype="float32", device="cpu", **kw)


@pytest.mark.parametrize("name", list(MOE))
def test_moe_greedy_tokens_and_logprobs_match_transformers(name, moe_checkpoints):
    path = moe_checkpoints[name]
    llm = engine(path, max_num_batched_tokens=64)
    arch = llm.llm_engine.arch
    assert arch.is_moe and arch.num_experts == 8 and arch.num_experts_per_tok == 2
    if name == "qwen2_moe":
        assert arch.sparse_layers == (0,) and arch.shared_expert_intermediate_size == 96
    tok = llm.get_tokenizer()
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params)  # batched, prefill chunked at 64
    ref_tokens, ref_logprobs = greedy_reference(path, prompt_ids, NEW_TOKENS)
    assert len(set().union(*(o.outputs[0].token_ids for o in outs))) > 20, "checkpoint too degenerate to compare"
    assert_matches(outs, ref_tokens, ref_logprobs, name)


def test_moe_is_batch_invariant_and_survives_preemption(moe_checkpoints):
    path = moe_checkpoints["mixtral"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = [engine(path).generate([p], params)[0].outputs[0].token_ids for p in PROMPTS]
    crowd = [f"{p} {i}" for i, p in enumerate(PROMPTS * 6)]
    tight = engine(path, num_gpu_blocks_override=12, max_num_batched_tokens=32)  # preempts, chunks prefill
    outs = tight.generate(PROMPTS + crowd, params)
    assert [o.outputs[0].token_ids for o in outs[: len(PROMPTS)]] == alone
    assert tight.llm_engine.scheduler.num_preemptions > 0


def test_experts_quantize_like_any_linear(moe_checkpoints):
    from sieve.layers.linear import Linear

    path = moe_checkpoints["qwen2_moe"]
    llm = engine(path, quantization="int8")
    moe = llm.llm_engine.runner.model.layers[0].moe
    kinds = {m.kernel_name() for m in moe.experts.modules() if isinstance(m, Linear)}
    assert kinds and all("int8" in k for k in kinds), kinds
    assert moe.router.dtype == torch.float32  # the router is never quantized
    ref = engine(path).generate(PROMPTS[:2], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    out = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids[:2] for o in out] == [o.outputs[0].token_ids[:2] for o in ref]


@pytest.mark.parametrize("name", list(MOE))
def test_engine_kv_bytes_and_parameters_match_the_planner(name, moe_checkpoints):
    """What `sieve plan` computes from the config is what the engine allocates and loads: KV bytes per token and
    total parameters (experts, router, shared expert and its gate included)."""
    import json

    from sieve.plan.shape import shape_from_config

    path = moe_checkpoints[name]
    shape = shape_from_config(json.loads((path / "config.json").read_text()))
    llm = engine(path)
    runner = llm.llm_engine.runner
    assert runner.block_bytes // runner.block_size == shape.kv_bytes_per_token("bf16") * 2  # float32 KV: twice bf16
    model = runner.model
    loaded = sum(p.numel() for n, p in model.named_parameters() if "rotary" not in n and not (
        model.arch.tie_word_embeddings and n == "lm_head.weight"))
    assert loaded == pytest.approx(shape.total_params, rel=1e-6)
