"""`sieve distill`: train speculative heads by self-distillation on the target's own generations.

1. Prompts made here, none of them the benchmark's: open instructions written from templates and topics,
   passages of wikitext-2 (../shared/data) to summarise or continue, functions of Python's standard library
   to explain.
2. The target answers them (its own tokens are the labels: the heads learn what this model writes, not what a
   dataset says), and one prefill pass over prompt + answer gives its last hidden state at every position.
3. Plain PyTorch trains the heads on (hidden state at t, token t + 1 + k) pairs, a held-out tenth of the
   answers measuring them: per-head top-1 accuracy, and the simulated acceptance the engine should see under
   greedy verification (head k counts only if heads 1..k-1 were right), reported as a mean acceptance length.
   `sieve bench spec` then reports the acceptance actually served, next to the simulated one.

Medusa heads are built (sieve/spec/medusa.py), independent (Medusa-1) or sequential (Hydra, the default);
EAGLE heads and small draft models are not yet.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import math
import random
import time
from collections import Counter

import torch

log = logging.getLogger("sieve")

TEMPLATES = [
    "Explain {t} in simple terms.", "What are the main advantages and disadvantages of {t}?", "Write a short story about {t}.",
    "Give me five facts about {t}.", "How would you teach a beginner about {t}?", "Write a friendly email inviting a colleague to talk about {t}.",
    "What is the history of {t}?", "Describe {t} to someone who has never seen it.", "List some common mistakes people make with {t}.",
    "Write a limerick about {t}.", "Compare {t} with something similar and explain the differences.", "Why do people care about {t}?",
    "Tell me a fun fact about {t} and explain it.", "Write a short dialogue between two friends about {t}.",
    "What questions do children often ask about {t}? Answer two of them.", "Summarise what an encyclopedia would say about {t}.",
    "Give step-by-step advice for someone starting with {t}.", "What would the world be like without {t}?",
    "Write a product description related to {t}.", "Explain {t} using an analogy.",
]
TOPICS = [
    "photosynthesis", "the water cycle", "volcanoes", "the moon", "bicycles", "coffee", "chess", "the internet", "gardening",
    "electric cars", "the Roman Empire", "honey bees", "rainbows", "cooking pasta", "public libraries", "jazz music", "sleep",
    "recycling", "the human heart", "airplanes", "friendship", "saving money", "deserts", "penguins", "solar panels",
    "the printing press", "yoga", "earthquakes", "chocolate", "trains",
]
PASSAGE_TASKS = ["Summarise this passage in two sentences.\n\n{p}", "Continue this text for a paragraph.\n\n{p}",
                 "What is this passage about? Answer briefly.\n\n{p}"]
CODE_TASK = "Explain what this Python function does, step by step.\n\n```python\n{c}\n```"


def distill_messages(n: int, seed: int = 0) -> list[list[dict]]:
    """`n` chat prompts of three kinds (instructions, passages, code), shuffled; none is the benchmark's."""
    from sieve.bench.spec import CHAT_PROMPTS, _passages

    rng = random.Random(seed)
    texts = [t.format(t=topic) for t in TEMPLATES for topic in TOPICS]
    rng.shuffle(texts)
    n_instr = max(1, n * 3 // 4)
    prompts = texts[:n_instr]
    passages = _passages(max(8, n // 8), min_words=60, max_words=140)
    rest = n - len(prompts)
    funcs = _stdlib_functions(rest // 2 + 1)
    for i in range(rest):
        if i % 2 == 0 and passages:
            prompts.append(PASSAGE_TASKS[i % len(PASSAGE_TASKS)].format(p=passages[(i // 2) % len(passages)]))
        else:
            prompts.append(CODE_TASK.format(c=funcs[(i // 2) % len(funcs)]))
    assert not set(prompts) & set(CHAT_PROMPTS), "distillation prompts must not be the benchmark's"
    rng.shuffle(prompts)
    return [[{"role": "user", "content": p}] for p in prompts[:n]]


def _stdlib_functions(n: int) -> list[str]:
    import calendar
    import colorsys
    import fnmatch
    import posixpath
    import statistics
    import string

    picks = [posixpath.splitext, fnmatch.translate, colorsys.rgb_to_hsv, statistics.median, string.capwords,
             calendar.monthrange, colorsys.hsv_to_rgb]
    sources = []
    for f in picks:
        try:
            sources.append(inspect.getsource(f)[:1200])
        except (OSError, TypeError):  # a build without the stdlib's sources
            continue
    return sources[: max(1, n)] or ["def add(a, b):\n    return a + b\n"]


def collect(llm, messages: list[list[dict]], max_tokens: int, temperature: float, seed: int) -> list[tuple[list[int], int]]:
    """The target's answers: (prompt + answer token ids, prompt length) per prompt."""
    from sieve.sampling_params import SamplingParams

    tok = llm.get_tokenizer()
    if tok is not None and getattr(tok, "chat_template", None):
        prompts = [{"prompt_token_ids": tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]}
                   for m in messages]
    else:  # no chat template (a base model): the raw text
        prompts = [m[0]["content"] for m in messages]
    limit = llm.llm_engine.config.max_model_len - max_tokens  # prompts too long for this model's context are left out
    encoded = [p if isinstance(p, dict) else {"prompt_token_ids": tok.encode(p)} for p in prompts]
    prompts = [p for p in encoded if len(p["prompt_token_ids"]) <= limit]
    if not prompts:
        raise ValueError(f"no distillation prompt fits in {limit} tokens (the context minus --max-tokens)")
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed))
    return [(list(o.prompt_token_ids) + list(o.outputs[0].token_ids), len(o.prompt_token_ids)) for o in outs]


def examples(engine, seqs: list[tuple[list[int], int]], num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden [N, H], inputs [N, K], labels [N, K]) over every answer position t: the target's last hidden state
    at t, the tokens t + 1 .. t + K (what each head follows; sequential heads read them), and the tokens
    t + 2 .. t + 1 + K each head guesses (-1 past the end)."""
    hs, inputs, labels = [], [], []
    for ids, p in seqs:
        if len(ids) - p < 2:
            continue
        h = engine.hidden_states(ids)
        positions = range(p - 1, len(ids) - 2)
        hs.append(h[p - 1: len(ids) - 2].float())
        at = lambda i: ids[i] if i < len(ids) else -1  # noqa: E731
        inputs.append(torch.tensor([[max(0, at(t + k)) for k in range(1, num_heads + 1)] for t in positions], dtype=torch.int64))
        labels.append(torch.tensor([[at(t + 1 + k) for k in range(1, num_heads + 1)] for t in positions], dtype=torch.int64))
    return torch.cat(hs), torch.cat(inputs), torch.cat(labels)


def embedding_table(engine) -> torch.Tensor:
    """The target's input embeddings [vocab, H] (float32), however they are stored."""
    with torch.inference_mode():
        return engine.runner.model.embed(torch.arange(engine.arch.vocab_size, device=engine.device)).float().cpu()


def lm_head_rows(engine, token_ids: list[int]) -> torch.Tensor:
    """The target's LM-head rows for `token_ids` [V', H] (float32), however the head is stored (quantized, tied)."""
    H = engine.arch.hidden_size
    with torch.inference_mode():
        eye = torch.eye(H, dtype=engine.dtype, device=engine.device)
        cols = engine.runner.model.compute_logits(eye)[:, token_ids]  # [H, V']: logits of unit vectors are weights
    return cols.t().float().cpu().contiguous()


def measure(heads, hidden: torch.Tensor, inputs: torch.Tensor, labels: torch.Tensor, table: torch.Tensor | None,
            batch: int = 4096) -> dict:
    """Per-head top-1 accuracy and the greedy chain acceptance (head k counts when heads 1..k are all right: then
    every token a sequential head followed was right too, so feeding it the true tokens is what serving does)."""
    K = heads.num_heads
    right = torch.zeros(K)
    chain = torch.zeros(K)
    with torch.inference_mode():
        for s in range(0, len(hidden), batch):
            emb = table[inputs[s: s + batch]] if heads.sequential else None
            guess = heads.draft_vocab[heads(hidden[s: s + batch], emb).argmax(dim=-1)]  # [B, K]
            ok = guess == labels[s: s + batch]
            right += ok.float().sum(0)
            chain += ok.int().cumprod(dim=1).float().sum(0)
    n = max(1, len(hidden))
    acc, chained = (right / n).tolist(), (chain / n).tolist()
    return {"head_accuracy": acc, "chain_acceptance": chained,
            "simulated_mean_acceptance_length": {str(k): 1 + sum(chained[:k]) for k in range(1, K + 1)}}


def train_medusa(engine, train: tuple, held: tuple, num_heads: int, draft_vocab_size: int, epochs: int, lr: float,
                 batch: int, seed: int, sequential: bool = True) -> tuple:
    from sieve.spec.medusa import MedusaHeads

    torch.manual_seed(seed)
    hidden, inputs, labels = train
    table = embedding_table(engine) if sequential else None
    counts = Counter(labels[:, 0][labels[:, 0] >= 0].tolist())
    vocab = [t for t, _ in counts.most_common(draft_vocab_size)]
    for t in engine.eos_token_ids:  # the end is always draftable
        if t not in vocab and t < engine.arch.vocab_size:
            vocab.append(t)
    covered = sum(counts[t] for t in vocab) / max(1, sum(counts.values()))
    heads = MedusaHeads(engine.arch.hidden_size, num_heads, vocab, sequential)
    with torch.no_grad():
        heads.proj.weight.copy_(lm_head_rows(engine, vocab))
    # labels as positions in the draft vocabulary (-100: outside it, or past the answer's end: no loss)
    index = torch.full((engine.arch.vocab_size + 1,), -100, dtype=torch.int64)
    index[torch.tensor(vocab)] = torch.arange(len(vocab))
    target = index[labels.clamp_min(-1)]  # -1 maps to the last slot, -100
    opt = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    steps = epochs * math.ceil(len(hidden) / batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=max(1, steps), pct_start=0.1)
    history = []
    step = 0
    for epoch in range(epochs):
        order = torch.randperm(len(hidden))
        total, seen = 0.0, 0
        for s in range(0, len(hidden), batch):
            idx = order[s: s + batch]
            logits = heads(hidden[idx], table[inputs[idx]] if sequential else None)  # [B, K, V']
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target[idx].reshape(-1), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            total += loss.item() * len(idx)
            seen += len(idx)
        held_m = measure(heads.eval(), *held, table)
        heads.train()
        history.append({"epoch": epoch + 1, "loss": total / max(1, seen), **held_m})
        log.info("epoch %d: loss %.3f, held-out head accuracy %s, simulated mean acceptance length %s", epoch + 1,
                 total / max(1, seen), [round(a, 3) for a in held_m["head_accuracy"]],
                 {k: round(v, 2) for k, v in held_m["simulated_mean_acceptance_length"].items()})
    return heads.eval(), history, covered


def run_distill(args: argparse.Namespace) -> dict:
    from sieve.config import ConfigError
    from sieve.llm import LLM

    if args.method != "medusa":
        raise ConfigError(f"sieve distill --method {args.method}: not built yet (medusa is)")
    started = time.perf_counter()
    llm = LLM(args.target, dtype=args.dtype, max_num_seqs=64, kv_cache_memory_gb=args.kv_cache_memory_gb, seed=args.seed)
    engine = llm.llm_engine
    messages = distill_messages(args.prompts, args.seed)
    seqs = collect(llm, messages, args.max_tokens, args.temperature, args.seed)
    generated = time.perf_counter()
    rng = random.Random(args.seed)
    rng.shuffle(seqs)
    n_held = max(1, len(seqs) // 10)
    held = examples(engine, seqs[:n_held], args.num_heads)
    train = examples(engine, seqs[n_held:], args.num_heads)
    print(f"distill: {len(seqs)} answers from {engine.model_name} ({sum(len(i) - p for i, p in seqs)} tokens, "
          f"{generated - started:.0f} s); training on {len(train[0])} positions, {len(held[0])} held out", flush=True)
    heads, history, covered = train_medusa(engine, train, held, args.num_heads, args.draft_vocab, args.epochs, args.lr,
                                           args.batch_size, args.seed, not args.independent_heads)
    final = history[-1]
    meta = {"target": str(args.target), "head_type": "medusa" if args.independent_heads else "hydra", "target_vocab_size": engine.arch.vocab_size, "draft_vocab_coverage": covered,
            "train_positions": len(train[0]), "held_out_positions": len(held[0]), "epochs": args.epochs,
            "head_accuracy": final["head_accuracy"], "chain_acceptance": final["chain_acceptance"],
            "simulated_mean_acceptance_length": final["simulated_mean_acceptance_length"],
            "temperature": args.temperature, "max_tokens": args.max_tokens, "prompts": len(messages)}
    heads.save(args.out, meta)
    seconds = time.perf_counter() - started
    print(f"draft vocabulary: {len(heads.draft_vocab)} tokens covering {100 * covered:.1f}% of the answers' tokens")
    print("held-out head accuracy: " + ", ".join(f"head {k + 1} {a:.3f}" for k, a in enumerate(final["head_accuracy"])))
    print("simulated mean acceptance length (greedy): "
          + ", ".join(f"k={k} {v:.2f}" for k, v in final["simulated_mean_acceptance_length"].items()))
    print(f"saved to {args.out} in {seconds:.0f} s: serve with --speculative-config "
          f"'{json.dumps({'method': 'medusa', 'model': str(args.out), 'num_speculative_tokens': args.num_heads})}'")
    return {**meta, "history": history, "seconds": seconds, "out": str(args.out)}


def add_distill_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="the target model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--method", default="medusa", choices=["medusa", "eagle", "draft"])
    p.add_argument("--out", required=True, help="folder the heads are saved to")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-heads", type=int, default=3)
    p.add_argument("--independent-heads", action="store_true",
                   help="Medusa-1's independent heads (default: Hydra's sequential heads, each also reading the token before "
                        "the one it guesses)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="tokens the heads can draft (the most frequent in the answers)")
    p.add_argument("--prompts", type=int, default=240)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="how the target answers (0: its greedy answers)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
