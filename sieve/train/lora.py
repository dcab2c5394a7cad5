"""`sieve finetune --lora`: a LoRA adapter trained on the user's own JSONL, written in PEFT's format (so that sieve,
vLLM and PEFT all load it), in plain PyTorch over transformers' model of the checkpoint (a GGUF file is dequantized).

Each line is `{"prompt": ..., "completion": ...}` (plain text, the loss on the completion's tokens) or
`{"messages": [...]}` (through the chat template, the loss on the last assistant turn). The base weights stay frozen;
each targeted linear gets `W x + (alpha / r) B A x` with A drawn as PEFT draws it and B zero, so training starts at the
base model. AdamW, the learning rate warmed up then decayed, `--epochs` passes in a shuffled order.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from torch import nn

from sieve.train.common import warmup_decay

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_finetune_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora", action="store_true", required=True, help="train a LoRA adapter (the one method here)")
    p.add_argument("--model", default=None, help="a Hugging Face folder or GGUF file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--data", required=True, help="JSONL: {prompt, completion} or {messages} per line")
    p.add_argument("--out", required=True, help="the adapter's folder (adapter_config.json, adapter_model.safetensors)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--targets", default=",".join(TARGETS), help="the linears to adapt (PEFT's names)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-len", type=int, default=512, help="longest example, in tokens (longer ones are cut)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)


class LoRALinear(nn.Module):
    """A frozen linear and its trainable low-rank update, named as PEFT names them (lora_A, lora_B)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base, self.scaling = base, alpha / rank
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # (PEFT's draw; B starts at zero)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scaling


def attach(model: nn.Module, targets: list[str], rank: int, alpha: float) -> dict[str, LoRALinear]:
    """Wrap every targeted linear of the decoder layers; the wrappers by their module path."""
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = {}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and isinstance(child, nn.Linear) and ".layers." in f".{name}.":
                layer = LoRALinear(child, rank, alpha)
                setattr(module, child_name, layer)
                wrapped[f"{name}.{child_name}"] = layer
    missing = set(targets) - {path.rsplit(".", 1)[1] for path in wrapped}
    if missing:
        raise ValueError(f"the model has no linear named {', '.join(sorted(missing))} in its layers")
    return wrapped


def examples(path: str, tokenizer, max_len: int) -> list[tuple[list[int], int]]:
    """(token ids, where the loss starts) per line; a line that is neither shape is a ValueError naming it."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        if isinstance(item, dict) and isinstance(item.get("prompt"), str) and isinstance(item.get("completion"), str):
            prompt = tokenizer.encode(item["prompt"])
            ids = prompt + tokenizer.encode(item["completion"], add_special_tokens=False)
            if tokenizer.eos_token_id is not None:
                ids.append(tokenizer.eos_token_id)
        elif isinstance(item, dict) and isinstance(item.get("messages"), list) and item["messages"] \
                and item["messages"][-1].get("role") == "assistant":
            prompt = tokenizer.apply_chat_template(item["messages"][:-1], add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"]
            ids = tokenizer.apply_chat_template(item["messages"], tokenize=True, return_dict=True)["input_ids"]
        else:
            raise ValueError(f"{path}:{n}: expected {{\"prompt\", \"completion\"}} or {{\"messages\": [..., assistant]}}")
        if len(prompt) >= min(len(ids), max_len):
            raise ValueError(f"{path}:{n}: nothing to learn within --max-len {max_len} tokens")
        out.append((ids[:max_len], len(prompt)))
    if not out:
        raise ValueError(f"{path}: no examples")
    return out


def loss_of(model, ids: list[int], start: int) -> torch.Tensor:
    """Mean cross-entropy of tokens start.. given those before them."""
    logits = model(torch.tensor([ids])).logits[0, start - 1: -1].float()
    return nn.functional.cross_entropy(logits, torch.tensor(ids[start:]))


def save_peft(wrapped: dict[str, LoRALinear], out: str, rank: int, alpha: float, targets: list[str], base: str) -> None:
    from safetensors.torch import save_file

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path, layer in wrapped.items():
        key = f"base_model.model.{path}"
        tensors[f"{key}.lora_A.weight"] = layer.lora_A.weight.detach().contiguous()
        tensors[f"{key}.lora_B.weight"] = layer.lora_B.weight.detach().contiguous()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "target_modules": targets,
        "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "base_model_name_or_path": base}, indent=2))


def load_base(model: str | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sieve.models.default import default_model_path

    path = Path(model) if model else default_model_path()
    if path.suffix == ".gguf":
        kw = dict(gguf_file=path.name)
        folder = str(path.parent)
    else:
        kw, folder = {}, str(path)
    return str(path), AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw), AutoTokenizer.from_pretrained(folder, **kw)


def run_finetune(args) -> dict:
    torch.manual_seed(args.seed)
    base, model, tokenizer = load_base(args.model)
    targets = [t for t in args.targets.split(",") if t]
    data = examples(args.data, tokenizer, args.max_len)
    wrapped = attach(model, targets, args.rank, args.alpha)
    params = [p for layer in wrapped.values() for p in (layer.lora_A.weight, layer.lora_B.weight)]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    steps = args.epochs * len(data)
    sched = warmup_decay(opt, steps)
    with torch.no_grad():
        before = sum(loss_of(model, ids, start).item() for ids, start in data) / len(data)
    order, started = random.Random(args.seed), time.perf_counter()
    for epoch in range(args.epochs):
        for i in order.sample(range(len(data)), len(data)):
            loss = loss_of(model, *data[i])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        print(f"epoch {epoch + 1}: last loss {loss.item():.4f}", flush=True)
    with torch.no_grad():
        after = sum(loss_of(model, ids, start).item() for ids, start in data) / len(data)
    save_peft(wrapped, args.out, args.rank, args.alpha, targets, base)
    result = {"model": base, "examples": len(data), "steps": steps, "rank": args.rank, "alpha": args.alpha,
              "targets": targets, "loss_before": round(before, 4), "loss_after": round(after, 4),
              "seconds": round(time.perf_counter() - started, 1), "adapter": args.out}
    print(f"loss on the training examples {before:.4f} -> {after:.4f}; adapter written to {args.out}")
    return result
