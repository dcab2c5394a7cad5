"""LoRA adapters (sieve/lora) against PEFT on the same adapter: identical greedy tokens and logprobs within 1e-3 in
float32 (every target module, rsLoRA, alpha and rank patterns; every family's sites: mixture-of-experts attention and
shared experts, latent attention with kv_b_proj absorbed, Mamba-2's projections, the head and the embeddings), and over the default model's quantized weights within the
default path's tolerance; a batch mixing adapters and the base model equals each request alone; the prefix cache never
crosses adapters; --max-loras and --max-cpu-loras hold; a bad adapter is refused by name and changes nothing."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from reference import DEFAULT_PATH_TOL, assert_matches, assert_matches_forward_pass, greedy_reference, reference_model
from sieve import LLM, LoRARequest, SamplingParams
from sieve.lora import LoRAError
from test_hybrid import bamba
from test_mla import mla_checkpoints
from test_moe import moe_checkpoints

FAMILY_FIXTURES = (bamba, mla_checkpoints, moe_checkpoints)  # the families' checkpoints, fixtures here too

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[1, 5, 9, 200, 31, 7, 8, 100], [17, 3, 3, 950, 12, 44, 600, 2000, 77, 5, 8]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)


def make_adapter(base, folder, seed: int, scale: float = 3.0, **config):
    """A PEFT adapter over `base` (its B's random, not zero, times `scale` so that it matters), saved to `folder`;
    `base` is left as it was."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, lora_dropout=0.0, **config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    model.save_pretrained(folder, save_embedding_layers=False)  # (the LoRA matrices alone, not the base's embeddings)
    model.unload()
    return str(folder)


ADAPTERS = {  # name -> LoraConfig
    "all": dict(r=8, lora_alpha=16, target_modules=ALL),
    "attention-rslora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], use_rslora=True),
    "mlp-r16": dict(r=16, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "patterns": dict(r=8, lora_alpha=16, target_modules=ALL, rank_pattern={"v_proj": 2}, alpha_pattern={"q_proj": 4}),
}


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    base = copy.deepcopy(reference_model(llama_dir))
    return {name: make_adapter(base, root / name, seed, **cfg) for seed, (name, cfg) in enumerate(ADAPTERS.items())}


def peft_model(base_path, adapter: str):
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(reference_model(base_path)), adapter).eval()


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), dtype="float32", device="cpu", num_gpu_blocks_override=256, enable_lora=True, max_loras=4,
               max_lora_rank=16)


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_each_adapter_equals_peft(llm, llama_dir, adapters, name):
    ref_tokens, ref_logprobs = greedy_reference(llama_dir, PROMPTS, 12, model=peft_model(llama_dir, adapters[name]))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, lora_request=LoRARequest(name, 1, adapters[name]))
    assert_matches(outs, ref_tokens, ref_logprobs, f"LoRA {name}")
    base = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert [o.outputs[0].token_ids for o in base] != [o.outputs[0].token_ids for o in outs], "the adapter changes nothing"


FAMILIES = {  # (the test module's checkpoint fixture, its name there, PEFT's target_modules, sites the adapter must hold)
    # attention only, on every layer of a mixture-of-experts model
    "mixtral": ("moe_checkpoints", "mixtral", ["q_proj", "k_proj", "v_proj", "o_proj"], ["self_attn"]),
    # attention, the shared expert of layer 0's experts and the dense MLP of layer 1
    "qwen2_moe": ("moe_checkpoints", "qwen2_moe", ALL, ["shared_expert.gate_proj", "1.mlp.down_proj"]),
    # latent attention's every projection (kv_b_proj absorbed), q through its low-rank pair or direct. (PEFT on
    # transformers 5 puts a DeepSeek adapter's gate/up/down_proj on its routed experts, which are refused below.)
    "deepseek-v3": ("mla_checkpoints", "v3", ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
                    ["q_b_proj", "kv_b_proj"]),
    "deepseek-v3-plain": ("mla_checkpoints", "v3-plain", ["q_proj", "kv_b_proj", "o_proj"], ["q_proj", "kv_b_proj"]),
    # a hybrid: Mamba-2's in_proj and out_proj, the attention layer, every layer's MLP
    "bamba": ("bamba", None, ["in_proj", "out_proj", *ALL], ["mamba.in_proj", "mamba.out_proj", "self_attn.q_proj"]),
    # the model's own: the head and the embeddings (an untied head; a tied one, Qwen2's)
    "llama-head": ("checkpoints", "llama", ["lm_head", "embed_tokens", "v_proj"], ["lm_head", "embed_tokens.lora_embedding"]),
    "qwen2-tied-head": ("checkpoints", "qwen2", ["lm_head", "embed_tokens"], ["lm_head", "embed_tokens.lora_embedding"]),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_s_linears_take_an_adapter_as_peft_does(request, tmp_path, family):
    """Each family's sites (sieve/lora/sites.py) against transformers + PEFT on the same adapter, float32: identical
    greedy tokens, logprobs within 1e-3; the adapter changes the answer, and a batch mixing it with the base model
    equals each alone."""
    fixture, name, targets, sites = FAMILIES[family]
    path = request.getfixturevalue(fixture)
    path = path[name] if name else path
    base = copy.deepcopy(reference_model(path))
    folder = make_adapter(base, tmp_path / family, 5, r=8, lora_alpha=16, target_modules=targets)
    keys = list(load_file(f"{folder}/adapter_model.safetensors"))
    assert all(any(site in k for k in keys) for site in sites), keys
    prompts = [[(5 + 37 * i) % 4000 + 3 for i in range(n)] for n in (6, 19)]
    ref_tokens, ref_logprobs = greedy_reference(path, prompts, 12, model=peft_model(path, folder))
    llm = LLM(str(path), dtype="float32", device="cpu", num_gpu_blocks_override=128, block_size=4, skip_tokenizer_init=True,
              enable_lora=True, max_lora_rank=8)
    lora = LoRARequest(family, 1, folder)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=lora)
    assert_matches(outs, ref_tokens, ref_logprobs, f"LoRA on {family}")
    base_outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in base_outs] != [o.outputs[0].token_ids for o in outs], "the adapter changes nothing"
    mixed = llm.generate([{"prompt_token_ids": p} for p in prompts * 2], GREEDY, lora_request=[lora, lora, None, None])
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in outs + base_outs]
    # the prompt's logprobs (the head's other caller) against PEFT's forward pass, beside the base model's prompt
    scored = llm.generate([{"prompt_token_ids": p} for p in prompts * 2], SamplingParams(max_tokens=1, prompt_logprobs=0),
                          lora_request=[lora, lora, None, None])
    ref = peft_model(path, folder)
    for p, out in zip(prompts, scored):
        with torch.no_grad():
            want = torch.log_softmax(ref(torch.tensor([p])).logits[0].float(), dim=-1)
        got = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], p[1:])]
        assert got == pytest.approx([want[i, t].item() for i, t in enumerate(p[1:])], abs=1e-3)


def test_routed_experts_are_refused_by_name(request, tmp_path):
    """PEFT puts DeepSeek's gate/up/down_proj targets on its routed experts (3-D parameters in transformers 5): no
    linear sieve runs LoRA on, so the adapter is refused, naming why."""
    from sieve.lora.manager import LoRAManager

    path = request.getfixturevalue("mla_checkpoints")["v3"]
    folder = make_adapter(copy.deepcopy(reference_model(path)), tmp_path / "experts", 1, r=4, target_modules=["gate_proj", "up_proj"])
    llm = LLM(str(path), dtype="float32", device="cpu", num_gpu_blocks_override=64, skip_tokenizer_init=True, enable_lora=True)
    manager = llm.llm_engine.lora
    assert isinstance(manager, LoRAManager)
    with pytest.raises(LoRAError, match="mlp.experts.*shared expert only"):
        manager.read("experts", folder)


def test_a_mixed_batch_equals_each_request_alone(llm, adapters):
    """Four adapters and the base model in the same steps (one prompt each), prefills and decodes, against each alone."""
    names = [None, *ADAPTERS]
    loras = [LoRARequest(n, i, adapters[n]) if n else None for i, n in enumerate(names)]
    prompts = [{"prompt_token_ids": PROMPTS[i % 2] + [i + 3]} for i in range(len(names))]
    together = llm.generate(prompts, GREEDY, lora_request=loras)
    for prompt, lora, out in zip(prompts, loras, together):
        alone = llm.generate(prompt, GREEDY, lora_request=lora)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        for a, b in zip(out.outputs[0].logprobs, alone.outputs[0].logprobs):
            assert {t: v.logprob for t, v in a.items()} == pytest.approx({t: v.logprob for t, v in b.items()}, abs=1e-5)


def test_the_prefix_cache_never_crosses_adapters(llm, adapters):
    prompt = {"prompt_token_ids": list(range(100, 180))}
    one = SamplingParams(temperature=0, max_tokens=1)
    first = LoRARequest("all", 1, adapters["all"])
    assert llm.generate(prompt, one, lora_request=first)[0].num_cached_tokens == 0
    assert llm.generate(prompt, one, lora_request=first)[0].num_cached_tokens > 0  # its own blocks
    assert llm.generate(prompt, one, lora_request=LoRARequest("mlp-r16", 2, adapters["mlp-r16"]))[0].num_cached_tokens == 0
    assert llm.generate(prompt, one)[0].num_cached_tokens == 0  # nor the base model's


def test_adapters_over_quantized_weights_equal_peft_over_them(tmp_path):
    """The default model's Q4_1 weights with an adapter: its low-rank product (bf16 weights, float32 sums) added to the
    quantized kernels' output, against PEFT over transformers' dequantized model. The tolerance is three times the
    default path's: its own (inputs rounded to bf16, 0.007 on Zen 4), and the adapter's bf16 weights (a random adapter
    of a fine-tune's size moved logprobs up to 0.014 on the Intel AMX host; a three times larger one, 0.09)."""
    from sieve.models.default import default_model_path

    path = default_model_path()
    base = copy.deepcopy(reference_model(path))
    folder = make_adapter(base, tmp_path / "smol", 7, scale=0.3, r=8, lora_alpha=16, target_modules=ALL)
    llm = LLM(str(path), kv_cache_memory_gb=0.2, max_model_len=512, enable_lora=True)
    tok = llm.get_tokenizer()
    prompts = [tok.encode("The best way to learn a language is"), tok.encode("Once upon a time, in a small village,")]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=16, logprobs=1),
                        lora_request=LoRARequest("smol", 1, folder))
    assert_matches_forward_pass(path, prompts, outs, 3 * DEFAULT_PATH_TOL, model=peft_model(path, folder))
    base_outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=16))
    assert [o.outputs[0].token_ids for o in base_outs] != [o.outputs[0].token_ids for o in outs], "the adapter changes nothing"
    native = llm.llm_engine.lora.get("smol").native
    assert native is not None or llm.llm_engine.runner.model.native is None  # the C++ layer loop ran it where there is one


def test_max_loras_holds_adapters_back_and_max_cpu_loras_reloads(llama_dir, adapters, monkeypatch):
    from sieve.lora import LoRABatch

    llm = LLM(str(llama_dir), dtype="float32", device="cpu", num_gpu_blocks_override=256, enable_lora=True, max_loras=2,
              max_cpu_loras=2)
    seen = []
    of = LoRABatch.of
    monkeypatch.setattr(LoRABatch, "of", staticmethod(lambda spans, device: (seen.append({a.name for a, *_ in spans}), of(spans, device))[1]))
    names = list(ADAPTERS)
    loras = [LoRARequest(n, i, adapters[n]) for i, n in enumerate(names)] * 2
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}] * len(loras), GREEDY, lora_request=loras)
    assert max(len(s) for s in seen) == 2 and set().union(*seen) == set(names)  # never three adapters in a step
    assert [o.outputs[0].token_ids for o in outs[:4]] == [o.outputs[0].token_ids for o in outs[4:]]
    manager = llm.llm_engine.lora
    assert len(manager.loaded) == 2 and manager.num_loads > len(names)  # dropped past 2 in memory, read again when asked


def test_metrics_name_the_adapters_of_running_and_waiting_requests(llama_dir, adapters):
    """vLLM's lora_requests_info: with max_loras 2 and three adapters asked for, two run and one waits, and the
    scrape says which (labels), with max_lora; the adapters registered and in memory are gauges. Once all are done,
    none is running or waiting."""
    from prometheus_client import CollectorRegistry, generate_latest

    from sieve import EngineConfig, LLMEngine
    from sieve.server.metrics import EngineCollector

    names = list(ADAPTERS)[:3]
    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=256, max_model_len=256,
                                    enable_lora=True, max_loras=2, max_cpu_loras=4, lora_modules={n: adapters[n] for n in names}))
    for i, n in enumerate(names):
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, lora_request=LoRARequest(n, i + 1, adapters[n]))
        engine.add_request(f"r{i}", {"prompt_token_ids": PROMPTS[0]}, params)
    engine.step()
    s = engine.stats().lora
    assert len(s.running) == 2 and len(s.waiting) == 1 and set(s.running) | set(s.waiting) == set(names)
    assert s.max_loras == 2 and s.registered == 3 and s.in_memory == 3
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, "m"))
    text = generate_latest(registry).decode()
    assert f'running_lora_adapters="{",".join(s.running)}"' in text and f'waiting_lora_adapters="{s.waiting[0]}"' in text
    assert 'max_lora="2"' in text and 'sieve:lora_adapters_registered{model_name="m"} 3.0' in text
    while engine.has_unfinished():
        engine.step()
    done = engine.stats().lora
    assert done.running == () and done.waiting == ()
    engine.shutdown()


@pytest.mark.parametrize("breakage, message", [
    ("rank", "rank 8, over"),
    ("missing", "no adapter_model.safetensors"),
    ("module", "no 'self_attn.lm_head'"),
    ("shape", "do not fit"),
    ("layer", "layer 7"),
    ("dora", "DoRA"),
    ("half", "lora_A missing"),
])
def test_a_bad_adapter_is_refused_by_name_and_changes_nothing(llm, adapters, tmp_path, breakage, message):
    import shutil

    folder = tmp_path / breakage
    shutil.copytree(adapters["all"], folder)
    tensors, config = load_file(folder / "adapter_model.safetensors"), json.loads((folder / "adapter_config.json").read_text())
    key = next(k for k in tensors if "q_proj.lora_A" in k)
    if breakage == "missing":
        (folder / "adapter_model.safetensors").unlink()
    elif breakage == "module":
        tensors[key.replace("self_attn.q_proj", "self_attn.lm_head")] = tensors[key].clone()
    elif breakage == "shape":
        tensors[key] = torch.zeros(8, 17)
    elif breakage == "layer":
        tensors[key.replace("layers.0.", "layers.7.")] = tensors[key].clone()
    elif breakage == "dora":
        config["use_dora"] = True
    elif breakage == "half":
        del tensors[key]
    if breakage != "missing":
        save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps(config))
    manager, before = llm.llm_engine.lora, llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY)[0].outputs[0].token_ids
    with pytest.raises(LoRAError, match=message):
        manager.read(breakage, str(folder)) if breakage != "rank" else type(manager)(
            llm.llm_engine.arch, torch.float32, torch.device("cpu"), max_lora_rank=4).read(breakage, str(folder))
    assert breakage not in manager.names
    assert llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY)[0].outputs[0].token_ids == before


@pytest.fixture(scope="module")
def lora_server(llama_dir, adapters):
    from live_server import start_server
    from sieve import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=256, max_model_len=256,
                                    enable_lora=True, max_loras=4, max_cpu_loras=4, max_lora_rank=16,
                                    lora_modules={"all": adapters["all"]}))
    root = str(__import__("pathlib").Path(adapters["all"]).parent)
    url, stop = start_server(engine, lora_dir=root)
    yield url, engine, root
    stop()


def test_the_request_model_names_the_adapter(lora_server, llm, adapters):
    import anthropic
    import openai

    from live_server import API_KEY, MODEL

    url = lora_server[0]
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {MODEL, "all"} and models["all"].parent == MODEL
    kw = dict(prompt=PROMPTS[0], max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    served = client.completions.create(model="all", **kw).choices[0].text
    offline = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                           lora_request=LoRARequest("all", 1, adapters["all"]))[0].outputs[0].text
    assert served == offline != client.completions.create(model=MODEL, **kw).choices[0].text
    chat = client.chat.completions.create(model="all", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == MODEL and chat.usage.completion_tokens >= 1
    m = anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0).messages.create(
        model="all", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert m.usage.output_tokens >= 1
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", **kw)


def test_loading_is_confined_to_the_lora_dir_and_refuses_bad_adapters(lora_server, adapters, tmp_path):
    import httpx

    from live_server import API_KEY

    url, engine, root = lora_server
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def load(name, path):
        return httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, headers=headers)

    for path in ("/etc", "../", str(tmp_path)):
        r = load("x", path)
        assert r.status_code == 400 and "--lora-dir" in r.json()["error"]["message"], r.text
    r = load("big", "mlp-r16")  # rank 16 over a --max-lora-rank 16 server: loads; the same name twice does not
    assert r.status_code == 200 and "added" in r.text
    assert load("big", "mlp-r16").status_code == 400
    r = load("nothing", "missing-folder")
    assert r.status_code == 400 and "no such adapter folder" in r.json()["error"]["message"]
    assert root not in r.text  # the server's own paths stay its own
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "big"}, headers=headers).status_code == 200
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "big"}, headers=headers).status_code == 404
    r = httpx.post(url + "/v1/completions", json={"model": "big", "prompt": "x", "max_tokens": 2}, headers=headers)
    assert r.status_code == 404


def test_loading_and_unloading_under_load_loses_no_request(lora_server):
    """Streams for an adapter, for the base model and for an adapter loaded meanwhile run while adapters are loaded and
    unloaded, the streamed one too: every request finishes with all its tokens; then the unloaded name is a 404."""
    import threading

    import httpx
    import openai

    from live_server import API_KEY, MODEL, wait_idle

    url, engine, _ = lora_server
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "rs", "lora_path": "attention-rslora"},
                      headers=headers).status_code == 200
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    counts, errors = {}, []

    def stream(i, model):
        try:
            chunks = client.completions.create(model=model, prompt=PROMPTS[i % 2], max_tokens=40, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
            counts[i] = [c.usage.completion_tokens for c in chunks if c.usage][-1]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(i, m)) for i, m in enumerate(["all", MODEL, "rs"] * 2)]
    for t in threads:
        t.start()
    for name, path in (("p1", "patterns"), ("p2", "mlp-r16")):
        assert httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, headers=headers).status_code == 200
    for name in ("p1", "rs", "p2"):  # "rs" while its streams run
        assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": name}, headers=headers).status_code == 200
    for t in threads:
        t.join(60)
    assert not errors and counts == {i: 40 for i in range(6)}
    r = httpx.post(url + "/v1/completions", json={"model": "rs", "prompt": "x", "max_tokens": 2}, headers=headers)
    assert r.status_code == 404
    wait_idle(engine)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_sieve_finetune_lora_writes_an_adapter_that_learned_its_task(llama_dir, tmp_path):
    """A tiny task (a fixed completion for each of four prompts) on the random checkpoint: the loss falls, the file is
    PEFT's format, and sieve serves the learned completions. (The loss stays above zero: the end-of-text token each
    completion ends with is one whose head row this random checkpoint leaves out of reach.)"""
    import subprocess
    import sys

    tasks = [("Colour of the sky:", " blue blue"), ("Colour of grass:", " green green"), ("Colour of snow:", " white white"),
             ("Colour of coal:", " black black")]
    data = tmp_path / "task.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p, "completion": c}) for p, c in tasks))
    out, report = tmp_path / "adapter", tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "sieve.cli", "finetune", "--lora", "--model", str(llama_dir), "--data", str(data),
                        "--out", str(out), "--rank", "8", "--epochs", "40", "--lr", "0.003", "--output-json", str(report)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    result = json.loads(report.read_text())
    assert result["loss_after"] < 0.25 * result["loss_before"], result
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", num_gpu_blocks_override=64, enable_lora=True)
    tok = llm.get_tokenizer()
    params = [SamplingParams(temperature=0, max_tokens=len(tok.encode(c, add_special_tokens=False))) for _, c in tasks]
    outs = llm.generate([tok.encode(p) for p, _ in tasks], params, lora_request=LoRARequest("task", 1, str(out)))
    assert [o.outputs[0].text for o in outs] == [c for _, c in tasks]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    r = subprocess.run([sys.executable, "-m", "sieve.cli", "finetune", "--lora", "--model", str(llama_dir), "--data", str(bad),
                        "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "bad.jsonl:1" in r.stderr


def test_a_request_naming_no_registered_adapter_reads_no_path(llm, monkeypatch):
    """The server names adapters by name only: an unregistered one (unloaded meanwhile) is refused, never read from
    wherever an empty path would resolve (the working directory)."""
    manager = llm.llm_engine.lora
    monkeypatch.setattr(manager, "read", lambda *a: pytest.fail("an adapter was read"))
    with pytest.raises(LoRAError, match="no adapter named 'gone'"):
        manager.resolve(LoRARequest("gone", 0, ""))
    with pytest.raises(Exception, match="no adapter named 'gone'"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, lora_request=LoRARequest("gone", 0, ""))


def test_bench_lora_runs_on_a_checkpoint_without_a_tokenizer(llama_dir, tmp_path):
    """`sieve bench lora` on a random checkpoint written without a tokenizer (the GPU check's 1B shape): prompts of
    token ids, the three throughputs measured and compared."""
    import argparse
    import shutil

    from sieve.bench.lora import throughput_parts

    model = tmp_path / "bare"
    model.mkdir()
    for f in llama_dir.iterdir():
        if f.is_file() and not f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, model / f.name)
    args = argparse.Namespace(users=2, kv_cache_memory_gb=0.05, adapters=2, rank=4, requests=4, max_tokens=3, repeats=1)
    result = throughput_parts(args, str(model))
    assert set(result["median_tok_s"]) == {"base_no_lora", "base_lora_enabled", "adapters"}
    assert all(v > 0 for v in result["median_tok_s"].values()) and result["adapters_vs_base"] > 0
