"""Parity with Hugging Face `transformers` for every architecture sieve claims (float32)."""

from __future__ import annotations

import json

import pytest
import torch

from sieve import LLM, SamplingParams
from sieve.models.arch import UnsupportedModelError

from conftest import ARCHS, make_checkpoint
from reference import assert_matches, greedy_reference

PROMPTS = [
    "def main():\n    return 1",
    "import os",
    "class Foo(object):\n    '''A docstring that is a little longer than the others, to vary length.'''\n    x = [1, 2, 3]",
    "x",
]
NEW_TOKENS = 32


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_tokens_and_logprobs_match_transformers(arch, checkpoints):
    path = checkpoints[arch]
    llm = LLM(str(path), dtype="float32", device="cpu", num_gpu_blocks_override=256, max_num_batched_tokens=64)
    tok = llm.get_tokenizer()
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    assert len({len(p) for p in prompt_ids}) == len(PROMPTS), "prompts should differ in length"
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params)  # all batched together
    ref_tokens, ref_logprobs = greedy_reference(path, prompt_ids, NEW_TOKENS)
    distinct = set().union(*(o.outputs[0].token_ids for o in outs))
    assert len(distinct) > 20, "checkpoint too degenerate for a meaningful comparison"
    assert_matches(outs, ref_tokens, ref_logprobs, arch)


def test_sharded_checkpoint_and_dtype_override(tmp_path, demo_dir, checkpoints):
    sharded = make_checkpoint(tmp_path / "sharded", "qwen2", demo_dir, seed=list(ARCHS).index("qwen2"), max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    a = LLM(str(sharded), dtype="float32", num_gpu_blocks_override=64).generate(["import os"], params)
    b = LLM(str(checkpoints["qwen2"]), dtype="float32", num_gpu_blocks_override=64).generate(["import os"], params)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids  # same weights, split or not

    bf16 = LLM(str(sharded), dtype="bfloat16", num_gpu_blocks_override=64)
    assert bf16.llm_engine.runner.model.embed_tokens.weight.dtype == torch.bfloat16
    assert bf16.llm_engine.runner.kv_pool.dtype == torch.bfloat16
    out = bf16.generate(["import os"], params)[0].outputs[0]
    assert len(out.token_ids) == 16
    # bf16 should mostly agree with fp32 on the first greedy tokens of a random model
    assert out.token_ids[:2] == a[0].outputs[0].token_ids[:2]


def test_checkpoint_torch_dtype_is_honoured(tmp_path, demo_dir):
    path = make_checkpoint(tmp_path / "m", "llama", demo_dir)
    cfg = json.loads((path / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(path), num_gpu_blocks_override=16)  # dtype='auto'
    assert llm.llm_engine.dtype == torch.bfloat16


def test_unsupported_architecture_is_a_clear_error(tmp_path, checkpoints):
    import shutil

    path = tmp_path / "gpt2ish"
    shutil.copytree(checkpoints["llama"], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(str(path))


def test_missing_model_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a folder holding a checkpoint nor a GGUF file"):
        LLM(str(tmp_path / "nope"))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_decode_weight_bytes_counts_every_weight_a_step_reads(arch, checkpoints):
    from sieve.bench.bandwidth import decode_weight_bytes

    llm = LLM(str(checkpoints[arch]), dtype="bfloat16", num_gpu_blocks_override=16)
    model = llm.llm_engine.runner.model
    read = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if not ("embed_tokens" in n and not model.arch.tie_word_embeddings))
    assert decode_weight_bytes(model.arch, 2) == read


def test_unreachable_hub_id_is_a_clear_error(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at call time
    with pytest.raises(FileNotFoundError, match="locally or download it from the hub"):
        LLM("some-org/some-model-that-is-not-cached")
