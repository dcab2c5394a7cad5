"""A state-space hybrid: Bamba (Mamba-2 mixers with one attention layer, partial rotary). Against transformers in
float32 on small random checkpoints the tests write: identical greedy tokens and logprobs within 1e-3 with the
recurrence prefilled in chunks (scheduler chunks and the mixer's sub-chunks); batch invariance, slot reuse and
preemption (the state is recomputed from the tokens); n > 1 forks (a copy of the state after the prompt);
prefix caching turned off with a log line; speculative decoding refused."""

from __future__ import annotations

import logging

import pytest
import torch

from sieve import LLM, SamplingParams

from conftest import _widen_init
from reference import assert_matches, greedy_reference
from test_models import NEW_TOKENS

CONFIG = dict(vocab_size=4096, hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_state=16, mamba_expand=2,
              mamba_chunk_size=16, mamba_n_groups=2, max_position_embeddings=1024, eos_token_id=None, bos_token_id=0,
              pad_token_id=0, tie_word_embeddings=False)
PROMPTS = [[(5 + 37 * i) % 4000 + 3 for i in range(n)] for n in (1, 20, 41, 300)]


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    import transformers

    path = tmp_path_factory.mktemp("bamba")
    torch.manual_seed(0)
    model = transformers.BambaForCausalLM(transformers.BambaConfig(**CONFIG)).to(torch.float32)
    _widen_init(model, 0)
    with torch.no_grad():  # decays from slow to fast, so the state carries information across a prompt
        for layer in model.model.layers:
            if hasattr(layer, "mamba"):
                layer.mamba.A_log.copy_(torch.log(torch.linspace(0.05, 2.0, 8)))
                layer.mamba.dt_bias.copy_(torch.linspace(-2.0, 0.5, 8))
                layer.mamba.D.copy_(torch.linspace(0.5, 1.5, 8))
    model.save_pretrained(path, safe_serialization=True)
    return path


def engine(path, **kw):
    kw.setdefault("num_gpu_blocks_override", 256)
    kw.setdefault("block_size", 4)
    return LLM(str(path), dtype="float32", device="cpu", skip_tokenizer_init=True, **kw)


def run(llm, prompts, **params):
    params = SamplingParams(**{"max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, **params})
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def test_greedy_tokens_and_logprobs_match_transformers(bamba):
    llm = engine(bamba, max_num_batched_tokens=200)  # the 300-token prompt prefills in two chunks, the first in two sub-chunks
    arch = llm.llm_engine.arch
    assert arch.mamba_layers == (0, 2, 3) and arch.full_layers == (1,) and arch.partial_rotary_factor == 0.5
    runner = llm.llm_engine.runner
    assert runner.kv_pool.shape[1] == 1  # KV for the one attention layer only
    outs = run(llm, PROMPTS, logprobs=5)
    ref_tokens, ref_logprobs = greedy_reference(bamba, PROMPTS, NEW_TOKENS)
    assert len(set().union(*(o.outputs[0].token_ids for o in outs))) > 20, "checkpoint too degenerate to compare"
    assert_matches(outs, ref_tokens, ref_logprobs, "bamba")


def test_state_is_what_matters(bamba):
    """The Mamba layers carry the context: a prompt that differs only in its first token (3 layers of recurrence, the
    attention layer sees it too) changes the answer, and the same prompt after other requests (slots reused) does not."""
    llm = engine(bamba)
    a = run(llm, [PROMPTS[2]])[0].outputs[0].token_ids
    run(llm, PROMPTS[:2] + [PROMPTS[3]])
    again = run(llm, [PROMPTS[2]])[0].outputs[0].token_ids
    assert a == again
    assert run(llm, [[7] + PROMPTS[2][1:]])[0].outputs[0].token_ids != a


def test_batch_invariance_chunking_preemption_and_forks(bamba):
    alone = [run(engine(bamba), [p], logprobs=2)[0].outputs[0] for p in PROMPTS]
    crowd = PROMPTS + [p[: 9 + i] + [7, 8, 9] for i, p in enumerate(PROMPTS * 3)]
    tight = engine(bamba, num_gpu_blocks_override=100, max_num_batched_tokens=12, max_num_seqs=5)  # preempts, chunks by 12
    outs = run(tight, crowd, logprobs=2)
    assert tight.llm_engine.scheduler.num_preemptions > 0
    for i, ref in enumerate(alone):
        got = outs[i].outputs[0]
        assert got.token_ids == ref.token_ids
        for a, b in zip(got.logprobs, ref.logprobs):
            for t, e in b.items():
                assert a[t].logprob == pytest.approx(e.logprob, abs=1e-4)
    forked = tight.generate([{"prompt_token_ids": PROMPTS[2]}], SamplingParams(n=3, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    assert [c.token_ids for c in forked[0].outputs] == [alone[2].token_ids] * 3
    seeded = SamplingParams(n=2, max_tokens=NEW_TOKENS, temperature=1.0, seed=5, ignore_eos=True)
    assert [c.token_ids for c in tight.generate([{"prompt_token_ids": PROMPTS[1]}], seeded)[0].outputs] == \
        [c.token_ids for c in engine(bamba).generate([{"prompt_token_ids": PROMPTS[1]}], seeded)[0].outputs]
    blocks = tight.llm_engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks and len(blocks.free_slots) == blocks.num_slots


def test_prefix_caching_is_off_and_speculation_refused(bamba, caplog):
    from sieve.config import ConfigError

    with caplog.at_level(logging.INFO, logger="sieve"):
        llm = engine(bamba, enable_prefix_caching=True)
    assert "prefix caching is off" in caplog.text and not llm.llm_engine.block_manager.enable_prefix_caching
    with pytest.raises(ConfigError, match="recurrent"):
        engine(bamba, speculative_config={"method": "ngram", "num_speculative_tokens": 3})


def test_state_bytes_and_kv_bytes(bamba):
    arch = engine(bamba).llm_engine.arch
    conv_dim = 128 + 2 * 2 * 16
    assert arch.state_bytes_per_sequence() == 3 * (conv_dim * 3 + 8 * 16 * 16) * 4
    assert arch.kv_bytes_per_token(4) == 2 * 1 * 2 * 16 * 4  # one attention layer, 2 KV heads of 16


def test_planner_agrees_on_kv_state_and_parameters(bamba):
    """`sieve plan` reads the same config: KV bytes per token (the attention layer's only), the state a sequence
    holds, and the parameters the engine loads."""
    import json

    from sieve.plan.shape import shape_from_config

    shape = shape_from_config(json.loads((bamba / "config.json").read_text()))
    runner = engine(bamba).llm_engine.runner
    assert runner.block_bytes // 4 == 2 * shape.kv_bytes_per_token("bf16")  # float32 KV: twice the planner's bf16
    assert shape.state_bytes_per_sequence == runner.arch.state_bytes_per_sequence() > 0
    assert shape.kv_bytes(1000, "bf16") == 1000 * shape.kv_bytes_per_token("bf16") + shape.state_bytes_per_sequence
    loaded = sum(p.numel() for n, p in runner.model.named_parameters() if "rotary" not in n)
    assert loaded == pytest.approx(shape.total_params, rel=1e-6)


def test_the_kv_tiers_refuse_a_recurrent_state_by_name(bamba, tmp_path):
    from sieve.config import ConfigError

    with pytest.raises(ConfigError, match="Mamba-2 layer's state"):
        engine(bamba, kv_cache_disk=str(tmp_path / "kv"))
