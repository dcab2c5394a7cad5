"""`sieve distill --kv fp8`: fine-tune a model so that it tolerates an FP8 KV cache.

An FP8 (e4m3) KV cache halves the bytes every decode step reads per token of context, and costs quality
because every cached key and value is rounded to 3 mantissa bits. Instead of only measuring that cost,
this teaches the model to live with it (the step from 28 to 70 users in the ladder behind this project):

1. The model answers prompts (chat prompts through its template, or passages of `--data` to continue when it has
   no template): its own generations are the training text, so it keeps writing what it wrote.
2. Per-layer K and V scales are fixed from the unquantized model's keys and values on that text
   (amax x 2 / 448, the margin sieve's engine calibrates with), and saved in the checkpoint as vLLM's
   `k_scale` / `v_scale`, so serving rounds exactly as training did.
3. A student copy runs with fake-quantized K/V: every key (after rotary) and value is rounded through
   float8_e4m3fn at those scales before attention, the gradient passing straight through the rounding. The loss
   is KL(teacher || student) of the next-token distributions at every position, the teacher being the untouched
   model. Full fine-tuning, plain PyTorch (AdamW), on transformers' implementation of the architecture.
4. The student is saved as a Hugging Face checkpoint that `sieve serve --model OUT --kv-cache-dtype fp8` serves;
   KL and top-1 agreement against the unquantized model with an FP8 KV cache, before and after, are measured
   by sieve's own engine (`sieve.evaluate`) on text held out from training.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sieve.data import shared_data

log = logging.getLogger("sieve")

FP8_MAX = 448.0
FP8_MARGIN = 2.0  # as QuantizedKVCacheLayer.FP8_MARGIN: values up to twice the calibration amax stay in range
ATTENTION = "sieve_fp8_kv"


def fake_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x rounded as the FP8 KV cache stores and reads it back (x = q * scale), with a straight-through gradient."""
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale
    return x + (q.to(x.dtype) - x).detach()


def _attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention with the module's K/V fake-quantized (or their amax recorded, to calibrate)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    mode = getattr(module, "sieve_kv", None)
    if mode == "calibrate":
        amax = module.sieve_kv_amax
        amax[0] = max(amax[0], key.detach().abs().max().item())
        amax[1] = max(amax[1], value.detach().abs().max().item())
    elif isinstance(mode, tuple):
        key, value = fake_fp8(key, mode[0]), fake_fp8(value, mode[1])
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _attention_modules(model) -> list:
    layers = model.model.layers
    return [layer.self_attn for layer in layers]


def set_kv_mode(model, mode) -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)
    model.set_attn_implementation(ATTENTION)
    for attn in _attention_modules(model):
        if mode == "calibrate":
            attn.sieve_kv, attn.sieve_kv_amax = "calibrate", [0.0, 0.0]
        else:
            attn.sieve_kv = mode[attn.layer_idx] if mode is not None else None


def load_hf_model(target: str, dtype: torch.dtype):
    """transformers' model for a sieve model argument: a Hugging Face folder, or a GGUF file (dequantized)."""
    from transformers import AutoModelForCausalLM

    from sieve.models.loader import resolve_model_path

    path = resolve_model_path(target)
    if path.is_file() and path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() and not (path / "config.json").exists() else []
    if ggufs:
        return AutoModelForCausalLM.from_pretrained(str(path), gguf_file=ggufs[0].name, dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)


def split_text(data: Path, held_out_fraction: float, out_dir: Path) -> tuple[str, Path]:
    """The text's first part (prompts are taken from it) and a file holding the rest (scored, never trained on)."""
    text = data.read_text()
    cut = int(len(text) * (1 - held_out_fraction))
    cut = text.rfind("\n", 0, cut) + 1 or cut
    held = out_dir / f"held-out-{data.stem}.txt"
    held.write_text(text[cut:])
    return text[:cut], held


def own_generations(engine_llm, tokenizer, train_text: str, n: int, prompt_tokens: int, max_tokens: int,
                    seed: int, temperature: float = 1.0) -> list[list[int]]:
    """Token ids of prompt + the model's own answer (sampled at `temperature`, each with its own seed), `n` of them."""
    from sieve.sampling_params import SamplingParams

    if getattr(tokenizer, "chat_template", None):
        from sieve.train.distill import distill_messages

        prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in distill_messages(n, seed)]
        prompt_ids = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    else:  # no template: passages of the training text, continued
        ids = tokenizer(train_text, add_special_tokens=True).input_ids
        rng = random.Random(seed)
        starts = [rng.randrange(0, max(1, len(ids) - prompt_tokens)) for _ in range(n)]
        prompt_ids = [ids[s : s + prompt_tokens] for s in starts]
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed * 100003 + i) for i in range(len(prompt_ids))]
    outs = engine_llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    return [p + list(o.outputs[0].token_ids) for p, o in zip(prompt_ids, outs)]


def calibrate_scales(model, seqs: list[list[int]]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    set_kv_mode(model, "calibrate")
    with torch.no_grad():
        for ids in seqs:
            model(torch.tensor([ids]))
    scales = {}
    for attn in _attention_modules(model):
        k, v = attn.sieve_kv_amax
        scales[attn.layer_idx] = (torch.tensor(max(k * FP8_MARGIN / FP8_MAX, 1e-6)), torch.tensor(max(v * FP8_MARGIN / FP8_MAX, 1e-6)))
    return scales


def kl_loss(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher || student)."""
    t = F.log_softmax(teacher_logits.float(), -1)
    s = F.log_softmax(student_logits.float(), -1)
    return (t.exp() * (t - s)).sum(-1).mean()


def batch_kl_loss(teacher, student, batch: list[list[int]]) -> torch.Tensor:
    """The mean over `batch` of each sequence's kl_loss, in one pass of each model. The sequences are padded on
    the right: a causal row never attends to the padding after it. (One sequence a pass, with transformers'
    overhead per call, took 8x the passes: 40 s of 57 for stories260K's 100 steps of 8.)"""
    lens = [len(ids) for ids in batch]
    x = torch.tensor([ids + [0] * (max(lens) - len(ids)) for ids in batch])
    mask = (torch.arange(max(lens)) < torch.tensor(lens)[:, None]).long()
    with torch.no_grad():
        t = teacher(x, attention_mask=mask).logits
    s = student(x, attention_mask=mask).logits
    return sum(kl_loss(t[i, :n], s[i, :n]) for i, n in enumerate(lens)) / len(batch)


def train(student, teacher, seqs: list[list[int]], scales, steps: int, lr: float, batch_size: int, seed: int,
          log_every: int = 10, train_params: str = "all") -> list[float]:
    """`steps` AdamW steps of KL(teacher || student with fake-FP8 K/V) over batches of `seqs`."""
    set_kv_mode(student, scales)
    set_kv_mode(teacher, None)
    student.train()
    if train_params == "attention":  # the projections that make and read K/V; the rest stays as it was
        for name, p in student.named_parameters():
            p.requires_grad_(".self_attn." in name)
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    order: list[int] = []
    losses = []
    for step in range(steps):
        if len(order) < batch_size:
            order += rng.sample(range(len(seqs)), len(seqs))
        batch, order = [seqs[i] for i in order[:batch_size]], order[batch_size:]
        opt.zero_grad(set_to_none=True)
        loss = batch_kl_loss(teacher, student, batch)
        loss.backward()
        total = loss.item()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(total)
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"  step {step + 1}/{steps}: KL {total:.5f}", flush=True)
    student.eval()
    set_kv_mode(student, None)
    return losses


def save_checkpoint(student, tokenizer, scales, out: Path) -> None:
    """A Hugging Face folder sieve serves; the K/V scales go into its weights as `...self_attn.k_scale / v_scale`."""
    from safetensors.torch import load_file, save_file

    student.config._attn_implementation = "sdpa"
    # loaded from a GGUF file, the weights were widened at load: what is saved is a plain float checkpoint
    student.hf_quantizer = None
    student.is_quantized = False
    if hasattr(student.config, "quantization_config"):
        del student.config.quantization_config
    student.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    files = sorted(out.glob("*.safetensors"))
    main = out / "model.safetensors"
    if files != [main]:
        raise RuntimeError(f"expected one model.safetensors in {out}, found {[f.name for f in files]}")
    tensors = load_file(main)
    for layer, (ks, vs) in scales.items():
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = ks.reshape(1).float()
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = vs.reshape(1).float()
    save_file(tensors, main, metadata={"format": "pt"})


def add_kv_distill_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV-aware distillation (--kv fp8)")
    g.add_argument("--kv", default=None, choices=["fp8"],
                   help="fine-tune the target to tolerate this KV-cache format (instead of training speculative heads)")
    g.add_argument("--data", default=None, help="text: prompts come from its first part, quality is scored on the rest "
                                                "(default: ../shared/data/wikitext2_test.txt)")
    g.add_argument("--held-out-fraction", type=float, default=0.3)
    g.add_argument("--steps", type=int, default=100, help="optimizer steps")
    g.add_argument("--prompt-tokens", type=int, default=64, help="passage prompts (models without a chat template)")
    g.add_argument("--kv-lr", type=float, default=5e-5, help="AdamW learning rate of the fine-tuning")
    g.add_argument("--kv-batch", type=int, default=8, help="sequences per optimizer step")
    g.add_argument("--kv-train", default="all", choices=["all", "attention"],
                   help="which weights move: all (full fine-tuning) or the attention projections only")
    g.add_argument("--kv-temperature", type=float, default=1.0,
                   help="how the model writes its training text (sampled answers cover more than greedy ones)")
    g.add_argument("--eval-windows", type=int, default=8, help="windows of 256 tokens scored before and after")


def run_kv_distill(args: argparse.Namespace) -> dict:
    from sieve.config import ConfigError
    from sieve.evaluate import evaluate
    from sieve.llm import LLM

    if args.kv != "fp8":
        raise ConfigError(f"sieve distill --kv {args.kv}: only fp8 is built")
    data = Path(args.data) if args.data else shared_data("wikitext2_test.txt")
    if not data.is_file():
        raise FileNotFoundError(f"--data {data}: no such file")
    if not 0 < args.held_out_fraction < 1:
        raise ConfigError("--held-out-fraction must be in (0, 1)")
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llm = LLM(args.target, dtype="float32", max_num_seqs=64, kv_cache_memory_gb=args.kv_cache_memory_gb, seed=args.seed,
              dequantize=True)
    tokenizer = llm.llm_engine.tokenizer
    target = str(llm.llm_engine.config.model)
    with tempfile.TemporaryDirectory() as tmp:
        train_text, held = split_text(data, args.held_out_fraction, Path(tmp))
        seqs = own_generations(llm, tokenizer, train_text, args.prompts, args.prompt_tokens, args.max_tokens, args.seed,
                               args.kv_temperature)
        del llm
        generated = time.perf_counter()
        # The reference: the unquantized model (GGUF weights widened), float32; the candidate: FP8 KV cache.
        common = dict(window=256, max_windows=args.eval_windows, reference=target, reference_dtype="float32",
                      reference_dequantize=True, kv_cache_dtype="fp8")
        before = evaluate(target, held, dtype="float32", dequantize=True, **common)
        teacher = load_hf_model(target, torch.float32).eval()
        student = load_hf_model(target, torch.float32)
        for p in teacher.parameters():
            p.requires_grad_(False)
        scales = calibrate_scales(teacher, seqs)
        print(f"distill --kv fp8: {len(seqs)} own generations ({sum(map(len, seqs))} tokens, {generated - started:.0f} s); "
              f"{args.steps} steps of {args.kv_batch} sequences, lr {args.kv_lr:g}", flush=True)
        t0 = time.perf_counter()
        losses = train(student, teacher, seqs, scales, args.steps, args.kv_lr, args.kv_batch, args.seed,
                       log_every=max(1, args.steps // 10), train_params=args.kv_train)
        trained = time.perf_counter() - t0
        save_checkpoint(student, tokenizer, scales, out)
        del teacher, student
        after = evaluate(str(out), held, dtype="float32", **common)
    seconds = time.perf_counter() - started
    keys = ("kl_divergence", "top1_agreement", "perplexity", "reference_perplexity", "tokens_scored")
    result = {"target": target, "kv": args.kv, "out": str(out), "data": str(data), "held_out_fraction": args.held_out_fraction,
              "sequences": len(seqs), "train_tokens": sum(map(len, seqs)), "steps": args.steps, "batch_size": args.kv_batch,
              "lr": args.kv_lr, "trained": args.kv_train, "train_seconds": trained, "total_seconds": seconds, "first_loss": losses[0], "last_loss": losses[-1],
              "before": {k: before[k] for k in keys}, "after": {k: after[k] for k in keys}}
    (out / "sieve_kv_distill.json").write_text(json.dumps(result, indent=2))
    b, a = result["before"], result["after"]
    print(f"held-out text, FP8 KV cache against the unquantized model ({a['tokens_scored']} tokens):\n"
          f"  before: KL {b['kl_divergence']:.5f}, top-1 agreement {b['top1_agreement']:.4f}, perplexity {b['perplexity']:.3f}\n"
          f"  after:  KL {a['kl_divergence']:.5f}, top-1 agreement {a['top1_agreement']:.4f}, perplexity {a['perplexity']:.3f}"
          f"  (reference perplexity {a['reference_perplexity']:.3f})\n"
          f"training took {trained:.0f} s, everything {seconds:.0f} s; serve it with "
          f"`sieve serve --model {out} --kv-cache-dtype fp8`")
    if math.isnan(a["kl_divergence"]):
        raise RuntimeError("the distilled model's KL is NaN")
    return result
