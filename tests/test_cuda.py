"""Quantized weights on CUDA (run where a GPU is lent; skipped elsewhere): the Triton kernel against the
dequantized reference for every layout and batch size, and a GGUF model end to end on the GPU against
the same model on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


def _q8_0(w):
    from sieve.quant.formats import ChannelScaledWeight

    n, k = w.shape
    s = (w.view(n, k // 32, 32).abs().amax(-1) / 127).half()
    return ChannelScaledWeight(torch.round(w.view(n, k // 32, 32) / s.float()[..., None]).clamp(-127, 127).to(torch.int8).view(n, k), s)


def _q4_0(w):
    from sieve.quant.formats import Int4Weight, quantize_int4

    q = quantize_int4(w, 32)
    return Int4Weight(q.packed, q.scale, None, 32, q.k)


@cuda
@pytest.mark.parametrize("fmt", ["int8", "q8_0", "int4 g128", "int4 g32", "q4_0"])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 100, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_kernel_matches_the_dequantized_weight(fmt, rows, dtype):
    from sieve.quant.formats import quantize_int4, quantize_int8
    from sieve.quant.kernels import make_kernel
    from sieve.quant.triton_kernels import TritonKernel

    torch.manual_seed(0)
    n, k = 200, 320  # rows of W not a multiple of any tile
    quant = {"int8": quantize_int8, "q8_0": _q8_0, "int4 g128": lambda w: quantize_int4(w, 128),
             "int4 g32": lambda w: quantize_int4(w, 32), "q4_0": _q4_0}[fmt]
    qw = quant(torch.randn(n, k) * 0.05).to(torch.device("cuda"))
    bias = torch.randn(n, device="cuda").to(dtype)
    kern = make_kernel(qw, dtype, bias)
    assert isinstance(kern, TritonKernel) and not kern.widens
    x = torch.randn(rows, k, device="cuda").to(dtype)
    got = kern(x).float()
    want = F.linear(x.float(), qw.dequantize().float(), bias.float())
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


@cuda
@pytest.mark.parametrize("fmt", ["q8_0", "int4 g32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_kernel_gives_a_row_the_same_bits_at_every_row_count(fmt, dtype):
    """A row alone and the same row among 3, 16, 17, 100 or 2,048 others: the same bits. Above 16 rows the kernel
    took a larger tile, whose tensor-core instructions sum a row's products in another order, so speculation's
    verification steps of 17 or more rows were not lossless in bfloat16."""
    from sieve.quant.formats import quantize_int4
    from sieve.quant.kernels import make_kernel

    torch.manual_seed(0)
    n, k = 200, 320
    qw = ({"q8_0": _q8_0, "int4 g32": lambda w: quantize_int4(w, 32)}[fmt])(torch.randn(n, k) * 0.05).to(torch.device("cuda"))
    kern = make_kernel(qw, dtype, torch.randn(n, device="cuda").to(dtype))
    x = torch.randn(2048, k, device="cuda").to(dtype)
    alone = torch.cat([kern(x[i:i + 1]) for i in range(0, 2048, 97)])
    for rows in (3, 16, 17, 100, 2048):
        got = kern(x[:rows])
        for i in range(0, rows, 97):
            assert torch.equal(got[i], alone[i // 97]), (rows, i)


@cuda
def test_gguf_model_on_the_gpu_matches_the_cpu(checkpoints, tmp_path):
    from sieve import LLM, SamplingParams
    from sieve.bench.gguf_export import export_gguf

    path = export_gguf(checkpoints["qwen2"], tmp_path / "q.gguf", "q4_1", log=lambda s: None)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": [5, 99, 1234, 7, 300]}, {"prompt_token_ids": list(range(40, 90))}]
    gpu = LLM(str(path), device="cuda", dtype="bfloat16", num_gpu_blocks_override=64)
    names = {m.kernel_name() for m in gpu.llm_engine.runner.model.modules() if hasattr(m, "kernel_name")}
    assert all("Triton" in n for n in names), names
    cpu = LLM(str(path), device="cpu", dtype="float32", num_gpu_blocks_override=64)
    for a, b in zip(gpu.generate(prompts, params), cpu.generate(prompts, params)):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        assert ta[0] == tb[0]
        assert a.outputs[0].logprobs[0][ta[0]].logprob == pytest.approx(b.outputs[0].logprobs[0][tb[0]].logprob, abs=0.1)


@cuda
@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3},
                                  {"method": "suffix", "num_speculative_tokens": "auto"}])
def test_speculative_decoding_on_the_gpu_gives_the_plain_tokens(llama_engine_factory, spec):
    """Verification rows on CUDA (the Triton decode attention, cuBLAS linears), float32: greedy tokens equal the plain
    engine's on the same device, 33 requests at once and one alone, and the KV pool comes back whole."""
    from test_spec import assert_pool_clean, grounded_workload

    prompts, params = grounded_workload(33)
    plain = llama_engine_factory(device="cuda")
    reference = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    llm = llama_engine_factory(device="cuda", speculative_config=spec)
    engine = llm.llm_engine
    assert engine.runner.device.type == "cuda"
    assert llm.generate([prompts[1]], [params[1]])[0].outputs[0].token_ids == reference[1]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == reference
    stats = engine.speculator.stats
    assert stats.num_accepted_tokens > 0 and stats.num_drafts > 0  # drafts were verified and kept
    assert_pool_clean(engine)


@cuda
def test_draft_trees_on_the_gpu_give_the_plain_tokens(llama_engine_factory):
    """Draft trees of 3 chains on CUDA (the branches' block copies before the step, their rows in the Triton decode
    attention, the kept chain's blocks adopted): greedy tokens equal the plain engine's, and the pool comes back whole."""
    from test_spec import TreeOracle, assert_pool_clean, count_chosen_branches, grounded_workload

    prompts, params = grounded_workload(33)
    plain = llama_engine_factory(device="cuda")
    reference = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    llm = llama_engine_factory(device="cuda", block_size=4, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    engine = llm.llm_engine
    engine.speculator.proposer = TreeOracle({(tuple(p["prompt_token_ids"]), 0): r for p, r in zip(prompts, reference)})
    engine.speculator.branches = 3
    chosen = count_chosen_branches(engine)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == reference
    assert chosen.count(1) + chosen.count(2) > 10
    assert_pool_clean(engine)


@cuda
def test_triton_decode_attention_on_the_gpu_is_the_reference_and_each_row_its_own():
    from test_attention_triton import check_paged_decode

    check_paged_decode("cuda")


@cuda
@pytest.mark.parametrize("crowd", [False, True])
@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3},
                                  {"method": "ngram", "num_speculative_tokens": 6, "num_branches": 4}], ids=["k3", "k6-tree4"])
def test_bfloat16_gguf_speculation_on_the_gpu_gives_the_plain_tokens(checkpoints, tmp_path, crowd, spec):
    """The H200 benchmark's case (a GGUF int4 file, bfloat16 activations, Triton linears): a drafted sequence's rows
    are computed as each would be alone, so its greedy tokens equal speculation off's, one request at a time and
    4 at once. k = 6 with 4 branches verifies 28 rows a sequence, 112 a step in the crowd: above the 16 rows that
    once took another tile shape."""
    from sieve import LLM
    from sieve.bench.gguf_export import export_gguf
    from test_spec import grounded_workload

    path = export_gguf(checkpoints["llama"], tmp_path / "l.gguf", "q4_1", log=lambda s: None)
    prompts, params = grounded_workload(17)
    engines = [LLM(str(path), device="cuda", dtype="bfloat16", num_gpu_blocks_override=512, speculative_config=s)
               for s in (None, spec)]

    def run(llm):
        if crowd:
            return [o.outputs[0].token_ids for o in llm.generate(prompts[:4], params[:4])]
        return [llm.generate([p], [sp])[0].outputs[0].token_ids for p, sp in zip(prompts, params)]

    assert run(engines[1]) == run(engines[0])
    assert engines[1].llm_engine.speculator.stats.num_accepted_tokens > 0


@cuda
@pytest.mark.parametrize("aux", [None, "1,3"], ids=["eagle", "eagle3"])
def test_eagle_distillation_trains_on_the_gpu_where_the_target_runs(tmp_path, monkeypatch, aux):
    """`sieve distill --method eagle` with the target on CUDA trains the layer there too (every loss computed on the
    GPU), learns as on the CPU (the bounds of test_eagle's CPU run), and saves a layer that serves losslessly; with
    `--aux-hidden-layers`, EAGLE-3's fused features come from the GPU's layer loop, in training and served."""
    from sieve import LLM, SamplingParams
    from sieve.train import distill
    from test_medusa import STORIES, distill_args, workload

    devices = set()
    loss = distill.eagle_batch_loss  # what training calls for every pass (one answer or a padded pack of them)

    def recording(layer, seqs, *args, **kwargs):
        devices.update((layer.fc.weight.device.type, seq[2].device.type) for seq in seqs)
        return loss(layer, seqs, *args, **kwargs)

    monkeypatch.setattr(distill, "eagle_batch_loss", recording)
    report = distill.run_distill(distill_args(STORIES, tmp_path, method="eagle", depth=3, batch_tokens=512,
                                              aux_hidden_layers=aux))
    assert devices == {("cuda", "cuda")}
    first, last = report["history"][0], report["history"][-1]
    assert last["loss"] < first["loss"] and last["head_accuracy"][0] > 0.4
    assert 1.3 < report["simulated_mean_acceptance_length"]["3"] <= 4.0
    prompts, params = workload(8)
    plain = LLM(str(STORIES), device="cuda", dtype="float32", kv_cache_memory_gb=0.25)
    spec = LLM(str(STORIES), device="cuda", dtype="float32", kv_cache_memory_gb=0.25,
               speculative_config={"method": "eagle3" if aux else "eagle", "model": str(tmp_path), "num_speculative_tokens": 3})
    assert spec.llm_engine.runner.aux_hidden_layers == ((1, 3) if aux else ())
    ids = lambda outs: [o.outputs[0].token_ids for o in outs]  # noqa: E731
    assert ids(spec.generate(prompts, params)) == ids(plain.generate(prompts, params))
    assert spec.llm_engine.speculator.stats.num_accepted_tokens > 0


@cuda
@pytest.mark.parametrize("case", ["float32", "bfloat16 q8_0", "float32 ngram", "bfloat16 q8_0 ngram"])
def test_captured_decode_steps_give_the_eager_tokens(checkpoints, tmp_path, case, caplog):
    """CUDA graphs (sieve/decode_graph.py), captured at start-up per bucket, against --enforce-eager: nine requests of
    different lengths, so the decode steps hold 9, 8, ... 1 rows (with ngram drafts, 1 + k each) in buckets 1 to 64,
    padded; greedy and seeded tokens equal. bfloat16 on a GGUF Q8_0 file: its Triton linears give a row the same bits
    at every row count, as the Triton decode attention does."""
    import logging

    from sieve import LLM, SamplingParams
    from sieve.bench.gguf_export import export_gguf
    from test_decode_graph import PROMPTS

    dtype = case.split()[0]
    path = export_gguf(checkpoints["llama"], tmp_path / "q.gguf", "q8_0", log=lambda s: None) if "q8_0" in case else checkpoints["llama"]
    kw = dict(device="cuda", dtype=dtype, num_gpu_blocks_override=256, max_num_seqs=16)
    if "ngram" in case:
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    runs = []
    for eager in (True, False):
        with caplog.at_level(logging.INFO, logger="sieve"):
            llm = LLM(str(path), enforce_eager=eager, **kw)
        static = llm.llm_engine.runner.static_decode
        assert (static is None) == eager
        runs.append([[o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
                     for params in (SamplingParams(max_tokens=24, temperature=0),
                                    SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=11))])
    assert set(static.graphs) == set(static.sizes) and static.steps > 20 and static.padded_rows > 0
    assert "CUDA graphs:" in caplog.text and "memory pool took" in caplog.text
    assert runs[1] == runs[0]


@cuda
def test_fused_pointwise_kernels_on_the_gpu():
    from test_pointwise_triton import check_all

    check_all("cuda")


@cuda
def test_multi_lora_kernels_on_the_gpu():
    from test_lora_triton import check_lora_slots

    check_lora_slots("cuda")


@cuda
def test_multi_lora_on_the_gpu_equals_peft_and_each_request_alone(llama_dir, tmp_path_factory):
    """Adapters on CUDA through the slots' Triton kernels (sieve/lora/slots.py): each equals PEFT's greedy tokens and
    logprobs (float32), and four adapters with the base model in the same steps equal each request alone."""
    import copy

    from reference import assert_matches, greedy_reference, reference_model
    from sieve import LLM, LoRARequest
    from test_lora import ADAPTERS, GREEDY, PROMPTS, make_adapter, peft_model

    root = tmp_path_factory.mktemp("gpu-adapters")
    base = copy.deepcopy(reference_model(llama_dir))
    adapters = {name: make_adapter(base, root / name, seed, **cfg) for seed, (name, cfg) in enumerate(ADAPTERS.items())}
    llm = LLM(str(llama_dir), dtype="float32", device="cuda", num_gpu_blocks_override=256, enable_lora=True, max_loras=4,
              max_lora_rank=16)
    assert llm.llm_engine.runner.lora_slots is not None
    for name, path in adapters.items():
        ref_tokens, ref_logprobs = greedy_reference(llama_dir, PROMPTS, 12, model=peft_model(llama_dir, path))
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, lora_request=LoRARequest(name, 1, path))
        assert_matches(outs, ref_tokens, ref_logprobs, f"LoRA {name} on CUDA")
    names = [None, *ADAPTERS]
    loras = [LoRARequest(n, i, adapters[n]) if n else None for i, n in enumerate(names)]
    prompts = [{"prompt_token_ids": PROMPTS[i % 2] + [i + 3]} for i in range(len(names))]
    together = llm.generate(prompts, GREEDY, lora_request=loras)
    for prompt, lora, out in zip(prompts, loras, together):
        assert out.outputs[0].token_ids == llm.generate(prompt, GREEDY, lora_request=lora)[0].outputs[0].token_ids
    assert llm.llm_engine.runner.lora_slots.num_loads >= 4


@cuda
@pytest.mark.parametrize("rows", [1, 16, 17, 100])
def test_w8a8_on_the_gpu_is_the_integer_arithmetic_exactly(rows):
    """W8A8 on CUDA (torch._int_mm, rows padded): the int32 sums are the exact int64 ones, and the output is the CPU's
    arithmetic to the bit (per-token codes and scales, then (float(sum) x token scale) x channel scale + bias), so a
    row's result is the CPU's and does not depend on the rows beside it."""
    from sieve.quant.formats import quantize
    from sieve.quant.kernels import make_kernel
    from sieve.quant.w8a8 import W8A8Kernel, int8_matmul, quantize_tokens

    g = torch.Generator().manual_seed(rows)
    n, k = 200, 320
    w = quantize(torch.randn(n, k, generator=g), "w8a8")
    bias = torch.randn(n, generator=g)
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4
    x[0, : k // 2] = 0.0
    q, s = quantize_tokens(x)
    acc = q.long() @ w.q.long().t()
    gpu_w = w.to(torch.device("cuda"))
    assert torch.equal(int8_matmul(q.cuda(), gpu_w.q).cpu().long(), acc)
    kernel = make_kernel(gpu_w, torch.float32, bias.cuda())
    assert isinstance(kernel, W8A8Kernel) and "torch._int_mm" in kernel.name
    want = acc.float() * s[:, None] * w.scale[None, :] + bias
    got = kernel(x.cuda()).cpu()
    assert torch.equal(got, want)
    assert torch.equal(kernel(x[-1:].cuda()).cpu(), want[-1:])


@cuda
def test_fp8_w8a8_on_the_gpu_is_its_dequantized_arithmetic():
    """FP8 W8A8 (`_scaled_mm`, an activation scale per row and a weight scale per channel) on GPUs with FP8 tensor
    cores: the e4m3 codes of both operands multiplied and scaled, against the same codes widened to float32."""
    from sieve.quant.formats import quantize
    from sieve.quant.kernels import make_kernel

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("this GPU has no FP8 tensor cores (compute capability 8.9 and later)")
    g = torch.Generator().manual_seed(0)
    n, k = 256, 576
    w = quantize(torch.randn(n, k, generator=g) * 0.05, "fp8").to(torch.device("cuda"))
    bias = torch.randn(n, generator=g).cuda().bfloat16()
    kernel = make_kernel(w, torch.bfloat16, bias)
    assert "_scaled_mm" in kernel.name
    for rows in (1, 64, 512):
        x = (torch.randn(rows, k, generator=g) * 3).cuda().bfloat16()
        a_scale = (x.abs().amax(dim=1, keepdim=True).float() / 448.0).clamp(min=1e-12)
        xq = (x / a_scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        want = (xq * a_scale) @ (w.q.float() * w.scale.float()[:, None]).t() + bias.float()
        got = kernel(x).float()
        assert (got - want).abs().max() <= 1e-2 * want.abs().max(), rows


@cuda
def test_w8a8_engine_on_the_gpu_gives_the_cpus_tokens(llama_dir):
    """`--quantization w8a8` on the GPU (torch._int_mm) against the same on the CPU (sieve's kernels), float32:
    identical greedy tokens up to the CPU's first near-tie, logprobs within 5e-3 (a float32 difference upstream can
    move an activation code by one)."""
    from sieve import LLM, SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5)
    prompts = [{"prompt_token_ids": [5, 99, 1234, 7, 300]}, {"prompt_token_ids": list(range(40, 90))}]
    outs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(str(llama_dir), device=device, dtype="float32", quantization="w8a8", num_gpu_blocks_override=64)
        outs[device] = [o.outputs[0] for o in llm.generate(prompts, params)]
        del llm
    compared = 0
    for cpu, gpu in zip(outs["cpu"], outs["cuda"]):
        for step, (token, lps) in enumerate(zip(cpu.token_ids, cpu.logprobs)):
            top = sorted((lp.logprob for lp in lps.values()), reverse=True)
            assert gpu.token_ids[step] == token, step
            assert gpu.logprobs[step][token].logprob == pytest.approx(lps[token].logprob, abs=5e-3)
            compared += 1
            if top[0] - top[1] < 1e-2:  # a near-tie: the sequences may part after it
                break
    assert compared >= 6


@cuda
def test_kv_compression_on_the_gpu_is_attention_with_dropped_positions_masked(monkeypatch):
    """A press on CUDA (its scores, the compacted copy, the Triton decode attention over the kept slots; with entropy
    budgets each layer's own blocks across the pool's planes): every decode step after it against transformers on the
    CPU with the positions it dropped masked, float32, within 1e-4."""
    from transformers import AttentionInterface, AutoModelForCausalLM, DynamicCache

    from sieve import LLM, SamplingParams
    from test_kv_compression import STORIES, kept_only_attention, record_kept, story_prompt

    ids = story_prompt(200, seed=1)
    seen = record_kept(monkeypatch)
    llm = LLM(str(STORIES), dtype="float32", device="cuda", num_gpu_blocks_override=256)
    for press in ("snapkv", "expected_attention", "snapkv:0.6:entropy"):  # (the last: each layer its own blocks)
        seen.clear()
        params = SamplingParams(temperature=0, max_tokens=12, logprobs=5, ignore_eos=True,
                                kv_compression=press if ":" in press else {"press": press, "ratio": 0.6})
        out = llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0]
        kept, T = [k.cpu() for k in seen[0]], len(ids)
        AttentionInterface.register("sieve_kept_only_gpu", kept_only_attention(dict(enumerate(kept)), T))
        model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32, attn_implementation="sieve_kept_only_gpu").eval()
        cache, tokens = DynamicCache(), ids + out.token_ids
        with torch.no_grad():
            logits = [model(torch.tensor([ids]), past_key_values=cache).logits[0, -1]]
            for t in tokens[T:-1]:
                logits.append(model(torch.tensor([[t]]), past_key_values=cache).logits[0, -1])
        ref = torch.log_softmax(torch.stack(logits), dim=-1)
        for i, (token, lps) in enumerate(zip(out.token_ids, out.logprobs)):
            assert ref[i].max() - ref[i, token] < 1e-4, (press, i)
            for tid, lp in lps.items():
                assert abs(lp.logprob - ref[i, tid].item()) < 1e-4, (press, i, tid)
