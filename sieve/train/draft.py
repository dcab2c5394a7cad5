"""`sieve distill --method draft`: a small draft model cut from the target and distilled on its own answers.

There is rarely a smaller sibling with the target's tokenizer (SmolLM2-135M has none), so the draft is made from
the target itself: its embeddings, final norm and LM head, and `--draft-layers` of its decoder layers, evenly
spaced from the first to the last (the last shapes what the head reads). Cut that way it guesses badly; trained
on the target's greedy next token at every answer position (the target's own answers from `sieve distill`'s
prompts), with the embeddings and head frozen, it learns to imitate the target with a fraction of its layers.

The result is an ordinary Hugging Face checkpoint folder (config.json, model.safetensors, the tokenizer), served
with `{"method": "draft_model", "model": DIR}`. Training runs transformers' own model class in plain PyTorch.

Greedy acceptance is simulated exactly from teacher-forced agreement: when draft tokens 1..s were right, the
draft's context for token s + 1 is the true one, so draft s + 1 is right iff the draft's argmax at that position
equals the target's token there.
"""

from __future__ import annotations

import json
import logging
import math
import random
from pathlib import Path

import torch

from sieve.train.common import acceptance_summary, warmup_decay

log = logging.getLogger("sieve")

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


def spaced_layers(num_layers: int, keep: int) -> list[int]:
    """`keep` layer indices spread evenly over 0 .. num_layers - 1, first and last included."""
    if keep >= num_layers:
        return list(range(num_layers))
    if keep == 1:
        return [num_layers - 1]
    return sorted({round(i * (num_layers - 1) / (keep - 1)) for i in range(keep)})


def cut_from_target(target: str, keep: int):
    """A transformers model of the target's family with `keep` of its layers (float32), its config and the layers
    kept. The target's weights are dequantized exactly (GGUF codes through `gguf`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from sieve.config import ConfigError
    from sieve.models.loader import open_checkpoint

    ckpt = open_checkpoint(target, dequantize=True)
    cfg = dict(ckpt.config)
    family = cfg.get("model_type")
    if family not in SUPPORTED:
        raise ConfigError(f"sieve distill --method draft: cutting a draft from a {family!r} model is not built "
                          f"(supported: {', '.join(SUPPORTED)})")
    n = int(cfg["num_hidden_layers"])
    layers = spaced_layers(n, keep)
    cfg.update(num_hidden_layers=len(layers), torch_dtype="float32")
    cfg.pop("architectures", None)
    for key in ("rope_scaling",):  # GGUF's rope_freqs form is sieve's own: keep only what transformers reads
        if isinstance(cfg.get(key), dict) and cfg[key].get("rope_type") == "freq_factors":
            raise ConfigError("sieve distill --method draft: GGUF rope_freqs scaling is not converted for transformers")
    config = AutoConfig.for_model(family, **{k: v for k, v in cfg.items() if k != "model_type"})
    state = {}
    for name, value in ckpt.tensors():
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"sieve distill --method draft: {target} keeps {name} quantized; a draft is cut from "
                              "float or GGUF weights")
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            if i not in layers:
                continue
            name = name.replace(f"model.layers.{i}.", f"model.layers.{layers.index(i)}.", 1)
        state[name] = value.float()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ConfigError(f"the draft cut from {target} does not match transformers' {family} model: missing {missing[:4]}, "
                          f"unexpected {unexpected[:4]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model, ckpt, layers


def measure_draft(model, seqs: list[tuple], depth: int) -> dict:
    """Teacher-forced agreement with the target's tokens on held-out answers, and the greedy chain acceptance it
    implies (exact: see the module's docstring)."""
    right, chain, states = torch.zeros(depth), torch.zeros(depth), 0
    with torch.inference_mode():
        for ids, p, _, _ in seqs:
            N = len(ids)
            guess = model(input_ids=ids[None]).logits[0].argmax(dim=-1)  # [N]: the draft's next token after each position
            ok = torch.zeros(N + depth, dtype=torch.bool)
            ok[: N - 1] = guess[: N - 1] == ids[1:]
            ns = torch.arange(p, N - 1)  # committed up to n - 1, token n sampled: draft s + 1 guesses token n + 1 + s
            alive = torch.ones(len(ns), dtype=torch.bool)
            for s in range(depth):
                hit = ok[ns + s]
                right[s] += hit.sum()
                alive &= hit
                chain[s] += alive.sum()
            states += len(ns)
    return acceptance_summary(right, chain, states)


def train_draft(model, train: list[tuple], held: list[tuple], depth: int, epochs: int, lr: float, batch_tokens: int,
                seed: int) -> list[dict]:
    """Cross-entropy on the target's greedy next token at every answer position (and the last prompt one), the
    embeddings and head frozen. Returns the history: loss and held-out measurements per epoch."""
    torch.manual_seed(seed)
    model.get_input_embeddings().weight.requires_grad_(False)
    model.get_output_embeddings().weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    positions = sum(len(s[0]) - s[1] for s in train)
    steps = max(1, epochs * math.ceil(positions / batch_tokens))
    sched = warmup_decay(opt, steps)
    history = [{"epoch": 0, "loss": None, **measure_draft(model.eval(), held, depth)}]
    log.info("the cut draft before training: held-out agreement %s", [round(a, 3) for a in history[0]["head_accuracy"]])
    rng = random.Random(seed)
    for epoch in range(epochs):
        model.train()
        order = list(range(len(train)))
        rng.shuffle(order)
        total, seen, pending = 0.0, 0, 0
        opt.zero_grad(set_to_none=True)
        for k, j in enumerate(order):
            ids, p, _, nxt = train[j]
            hidden = model.model(input_ids=ids[None]).last_hidden_state[0]
            at = torch.arange(p - 1, len(ids))  # where the target wrote (or is about to write) its answer
            loss = torch.nn.functional.cross_entropy(model.lm_head(hidden[at]), nxt[at])
            (loss * len(at) / batch_tokens).backward()
            total += loss.item() * len(at)
            seen += len(at)
            pending += len(at)
            if pending >= batch_tokens or k == len(order) - 1:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                pending = 0
        held_m = measure_draft(model.eval(), held, depth)
        history.append({"epoch": epoch + 1, "loss": total / max(1, seen), **held_m})
        log.info("epoch %d: loss %.3f, held-out agreement %s, simulated mean acceptance length %s", epoch + 1,
                 total / max(1, seen), [round(a, 3) for a in held_m["head_accuracy"]],
                 {k: round(v, 2) for k, v in held_m["simulated_mean_acceptance_length"].items()})
    return history


def save_draft(model, ckpt, out: str | Path, meta: dict) -> None:
    """A Hugging Face checkpoint folder sieve (and transformers) load: config, weights, the target's tokenizer."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    try:
        ckpt.tokenizer().save_pretrained(str(out))
    except Exception as e:  # a target without a tokenizer: the draft engine needs none (it reads token ids)
        log.info("the draft is saved without a tokenizer: %s", e)
    (out / "sieve_distill.json").write_text(json.dumps({"method": "draft", **meta}, indent=1))
