"""`sieve bench lora`: many LoRA adapters over one base model (sieve/lora), offline, in one process.

- Throughput at `--users` concurrent sequences (max_num_seqs), `--requests` requests of `--max-tokens` tokens each:
  the base model on an engine without LoRA; base-only requests on an engine with LoRA on (what turning it on costs
  requests that use none); and requests spread evenly over `--adapters` adapters of rank `--rank` on every linear.
  The three are measured `--repeats` times, interleaved, and their medians compared.
- The bytes a decode step reads: the base model's linears, and each adapter's matrices (every adapter in a step is
  read whole): what a step of many adapters costs where bytes bind.
- Loading: the time to read and check an adapter, and the first request after a load against the same request again.
- A task (`--parts task`): an adapter trained with `sieve finetune --lora` on 40 questions "what is the capital of X,
  the city's name only", and exact-match accuracy on 20 other countries, base model against adapter, served by sieve.

The throughput adapters are random, in PEFT's format (as `sieve finetune --lora` or PEFT writes them): their cost
does not depend on their values.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_bench_lora_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--users", type=int, default=32, help="sequences running at once (max_num_seqs)")
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    p.add_argument("--parts", default="throughput", help="which to measure: throughput, task (comma-separated)")
    p.add_argument("--output-json", default=None)


def peft_dims(arch) -> dict[str, tuple[int, int]]:
    """PEFT module -> (in features, out features) in a dense layer of `arch` (sieve fuses q/k/v and gate/up)."""
    from sieve.lora.sites import ATTENTION, MLP, dense_sites

    shapes = dense_sites(arch)
    return {m: (shapes[fused][0], shapes[fused][1][shard]) for m, (fused, shard) in {**ATTENTION, **MLP}.items()}


def write_random_adapter(folder: Path, arch, rank: int, seed: int) -> str:
    """A rank-`rank` adapter on every linear of every layer, in PEFT's format."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_layers):
        for module, (n_in, n_out) in peft_dims(arch).items():
            kind = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{kind}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) / n_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                            "target_modules": list(TARGETS), "bias": "none"}))
    return str(folder)


def throughput(llm, prompts: list, params, loras) -> float:
    started = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - started)


def step_bytes(llm, adapters: int) -> dict:
    model = llm.llm_engine.runner.model
    base = sum(m.weight_bytes for name, m in model.named_modules() if name.startswith("layers.") and hasattr(m, "weight_bytes"))
    engine = llm.llm_engine
    rank = engine.lora.get(engine.lora.names[0]).rank
    itemsize = torch.tensor([], dtype=engine.lora.dtype).element_size()
    per_adapter = sum(rank * (n_in + n_out) for n_in, n_out in peft_dims(engine.arch).values()) * engine.arch.num_layers * itemsize
    return {"base_linear_bytes": base, "adapter_bytes": per_adapter, "adapters_in_a_step": adapters,
            "floor_ratio_if_bytes_bind": round(base / (base + adapters * per_adapter), 3)}


def loading(llm, folder: str, prompt, params) -> dict:
    from sieve.lora import LoRARequest

    started = time.perf_counter()
    llm.llm_engine.lora.load("fresh", folder)
    load_s = time.perf_counter() - started
    firsts = []
    for _ in range(2):
        started = time.perf_counter()
        llm.generate(prompt, params, lora_request=LoRARequest("fresh", 99, folder))
        firsts.append(time.perf_counter() - started)
    return {"load_ms": round(1e3 * load_s, 1), "first_request_ms": round(1e3 * firsts[0], 1),
            "same_request_again_ms": round(1e3 * firsts[1], 1)}


CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Portugal", "Lisbon"), ("Austria", "Vienna"),
    ("Belgium", "Brussels"), ("Netherlands", "Amsterdam"), ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"),
    ("Denmark", "Copenhagen"), ("Poland", "Warsaw"), ("Greece", "Athens"), ("Ireland", "Dublin"), ("Hungary", "Budapest"),
    ("Czechia", "Prague"), ("Russia", "Moscow"), ("Ukraine", "Kyiv"), ("Turkey", "Ankara"), ("Egypt", "Cairo"), ("Kenya", "Nairobi"),
    ("Nigeria", "Abuja"), ("Ghana", "Accra"), ("Morocco", "Rabat"), ("Ethiopia", "Addis Ababa"), ("Japan", "Tokyo"), ("China", "Beijing"),
    ("India", "New Delhi"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"), ("Indonesia", "Jakarta"), ("Philippines", "Manila"),
    ("South Korea", "Seoul"), ("Iran", "Tehran"), ("Iraq", "Baghdad"), ("Canada", "Ottawa"), ("Mexico", "Mexico City"), ("Cuba", "Havana"),
    ("Peru", "Lima"), ("Chile", "Santiago"), ("Argentina", "Buenos Aires"), ("Colombia", "Bogota"), ("Venezuela", "Caracas"),
    ("Australia", "Canberra"), ("New Zealand", "Wellington"), ("Switzerland", "Bern"), ("Romania", "Bucharest"), ("Bulgaria", "Sofia"),
    ("Serbia", "Belgrade"), ("Croatia", "Zagreb"), ("Iceland", "Reykjavik"), ("Pakistan", "Islamabad"), ("Bangladesh", "Dhaka"),
    ("Nepal", "Kathmandu"), ("Saudi Arabia", "Riyadh"), ("Israel", "Jerusalem"), ("Syria", "Damascus"), ("Lebanon", "Beirut"),
    ("Jordan", "Amman"),
]


def question(country: str) -> list[dict]:
    return [{"role": "user", "content": f"What is the capital of {country}? Answer with the city's name only."}]


def task(args, model: str) -> dict:
    """Train an adapter on 40 countries; exact match on the other 20, base against adapter."""
    from sieve import LLM, SamplingParams
    from sieve.lora import LoRARequest
    from sieve.train.lora import run_finetune

    tmp = Path(tempfile.mkdtemp(prefix="sieve-bench-lora-task-"))
    train, held_out = CAPITALS[:40], CAPITALS[40:]
    data = tmp / "capitals.jsonl"
    data.write_text("\n".join(json.dumps({"messages": question(c) + [{"role": "assistant", "content": city}]}) for c, city in train))
    report = run_finetune(argparse.Namespace(model=args.model, data=str(data), out=str(tmp / "adapter"), rank=16, alpha=32.0,
                                             targets=",".join(TARGETS), epochs=3, lr=5e-4, max_len=256, seed=0))
    llm = LLM(model, enable_lora=True, kv_cache_memory_gb=0.5, max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=12)
    result = {"train_examples": len(train), "held_out": len(held_out), "finetune": report}
    for name, lora in (("base", None), ("adapter", LoRARequest("capitals", 1, str(tmp / "adapter")))):
        outs = llm.chat([question(c) for c, _ in held_out], params, lora_request=lora)
        answers = [o.outputs[0].text.strip().rstrip(".") for o in outs]
        result[f"{name}_exact_match"] = sum(a == city for a, (_, city) in zip(answers, held_out)) / len(held_out)
        result[f"{name}_answers"] = answers
    print(f"capitals, held out: exact match base {result['base_exact_match']:.2f}, adapter {result['adapter_exact_match']:.2f}")
    return result


def run_bench_lora(args) -> dict:
    from sieve.models.default import default_model_path

    model = args.model or str(default_model_path())
    parts, result = args.parts.split(","), {}
    if "throughput" in parts:
        result.update(throughput_parts(args, model))
    if "task" in parts:
        result["task"] = task(args, model)
    return result


def throughput_parts(args, model: str) -> dict:
    from sieve import LLM, SamplingParams
    from sieve.lora import LoRARequest

    folder = Path(model)
    no_tokenizer = folder.is_dir() and not (folder / "tokenizer.json").exists()  # a random checkpoint shaped for a GPU
    common = dict(max_num_seqs=args.users, kv_cache_memory_gb=args.kv_cache_memory_gb, max_model_len=1024,
                  skip_tokenizer_init=no_tokenizer)
    plain = LLM(model, **common)
    lora = LLM(model, enable_lora=True, max_loras=args.adapters, max_cpu_loras=args.adapters + 1, max_lora_rank=args.rank, **common)
    tmp = Path(tempfile.mkdtemp(prefix="sieve-bench-lora-"))
    folders = [write_random_adapter(tmp / f"a{i}", lora.llm_engine.arch, args.rank, i) for i in range(args.adapters + 1)]
    if no_tokenizer:  # ids in place of the sentence below (about as long)
        prompts = [{"prompt_token_ids": [5 + (7 * i + j) % 1000 for j in range(12)]} for i in range(args.requests)]
    else:
        tok = plain.get_tokenizer()
        prompts = [{"prompt_token_ids": tok.encode(f"Write a short story about the number {i}.")} for i in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    spread = [LoRARequest(f"a{i % args.adapters}", 1 + i % args.adapters, folders[i % args.adapters]) for i in range(args.requests)]
    runs: dict[str, list[float]] = {"base_no_lora": [], "base_lora_enabled": [], "adapters": []}
    for llm, loras in ((plain, None), (lora, None), (lora, spread)):  # warm-up: each path's first steps, every adapter read
        llm.generate(prompts[: args.users], params, lora_request=loras[: args.users] if loras else None)
    for r in range(args.repeats):
        runs["base_no_lora"].append(throughput(plain, prompts, params, None))
        runs["base_lora_enabled"].append(throughput(lora, prompts, params, None))
        runs["adapters"].append(throughput(lora, prompts, params, spread))
        print(f"repeat {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f} tok/s" for k, v in runs.items()), flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    result = {
        "model": model, "adapters": args.adapters, "rank": args.rank, "users": args.users, "requests": args.requests,
        "max_tokens": args.max_tokens, "repeats": args.repeats, "tok_s": {k: [round(x, 1) for x in v] for k, v in runs.items()},
        "median_tok_s": {k: round(v, 1) for k, v in med.items()},
        "adapters_vs_base": round(med["adapters"] / med["base_no_lora"], 3),
        "base_lora_enabled_vs_no_lora": round(med["base_lora_enabled"] / med["base_no_lora"], 3),
        "step_bytes": step_bytes(lora, args.adapters),
        "loading": loading(lora, folders[-1], prompts[0], SamplingParams(temperature=0, max_tokens=1)),
    }
    print(f"adapters ({args.adapters} x rank {args.rank}) / base: {result['adapters_vs_base']}x; base on a LoRA engine / without: "
          f"{result['base_lora_enabled_vs_no_lora']}x; bytes if they bound: {result['step_bytes']['floor_ratio_if_bytes_bind']}x; "
          f"load {result['loading']['load_ms']} ms, first request after it {result['loading']['first_request_ms']} ms "
          f"(again: {result['loading']['same_request_again_ms']} ms)")
    return result
