"""`sieve distill`: train speculative heads by self-distillation on the target's own generations.

1. Prompts made here, none of them the benchmark's: open instructions written from templates and topics,
   passages of wikitext-2 (../shared/data) to summarise or continue, functions of Python's standard library
   to explain.
2. The target answers them (its own tokens are the labels: the heads learn what this model writes, not what a
   dataset says), and one prefill pass over prompt + answer gives its last hidden state at every position.
3. Plain PyTorch trains the heads on (hidden state at t, token t + 1 + k) pairs, a held-out tenth of the
   answers measuring them (whole prompt families by default: `prompt_family`, `held_out_split`): per-head top-1
   accuracy, and the simulated acceptance the engine should see under greedy verification (head k counts only if
   heads 1..k-1 were right), reported as a mean acceptance length.
   `sieve bench spec` then reports the acceptance actually served, next to the simulated one.

`--method draft` (sieve/train/draft.py): a draft model cut from the target's layers, trained on its greedy
tokens. `--method medusa`: Medusa heads (sieve/spec_decode/medusa.py), independent (Medusa-1) or sequential (Hydra, the default),
trained on (hidden state at t, token t + 1 + k) pairs. `--method eagle`: an EAGLE draft layer (sieve/spec_decode/eagle.py)
trained on whole sequences, unrolled `--depth` drafting steps (its own predicted features fed back, as served), on
the target's next feature and its greedy next token at every position.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import inspect
import json
import logging
import math
import random
import re
import time
from collections import Counter

import torch
from torch.nn import functional as F

from sieve.prompts import CHAT_PROMPTS, TEMPLATES, TOPICS, passages
from sieve.train.common import acceptance_summary, warmup_decay

log = logging.getLogger("sieve")

PASSAGE_TASKS = ["Summarise this passage in two sentences.\n\n{p}", "Continue this text for a paragraph.\n\n{p}",
                 "What is this passage about? Answer briefly.\n\n{p}"]
CODE_TASK = "Explain what this Python function does, step by step.\n\n```python\n{c}\n```"


def distill_messages(n: int, seed: int = 0) -> list[list[dict]]:
    """`n` chat prompts of three kinds (instructions, passages, code), shuffled; none is the benchmark's."""
    rng = random.Random(seed)
    texts = [t.format(t=topic) for t in TEMPLATES for topic in TOPICS]
    rng.shuffle(texts)
    n_instr = max(1, n * 3 // 4)
    prompts = texts[:n_instr]
    texts = passages(max(8, n // 8), min_words=60, max_words=140)
    rest = n - len(prompts)
    funcs = _stdlib_functions(rest // 2 + 1)
    for i in range(rest):
        if i % 2 == 0 and texts:
            prompts.append(PASSAGE_TASKS[i % len(PASSAGE_TASKS)].format(p=texts[(i // 2) % len(texts)]))
        else:
            prompts.append(CODE_TASK.format(c=funcs[(i // 2) % len(funcs)]))
    assert not set(prompts) & set(CHAT_PROMPTS), "distillation prompts must not be the benchmark's"
    rng.shuffle(prompts)
    return [[{"role": "user", "content": p}] for p in prompts[:n]]


def magpie_messages(llm, n: int, seed: int = 0, max_tokens: int = 64) -> list[list[dict]]:
    """`n` user questions the target writes itself (Magpie, Xu et al. 2024): the chat template up to the start of a
    user turn (the system turn included), sampled at temperature 1.0 until the turn ends. An instruct model fills it
    with the kinds of request it was tuned on, where the templates above give 20 phrasings. (For SmolLM2's EAGLE layer
    that served open chat no better than the templates: docs/design-notes.md, issue 15, fourteenth part.) Turns cut by
    `max_tokens`, shorter than 3 words, holding one of the tokenizer's special tokens, repeated or equal to a benchmark
    prompt are left out; each request has its own seed, so the list is the same on every run."""
    from sieve.config import ConfigError
    from sieve.sampling_params import SamplingParams

    tok = llm.get_tokenizer()
    if tok is None or not getattr(tok, "chat_template", None):
        raise ConfigError("--prompt-source magpie needs a target with a chat template")
    mark = "\x00sieve-magpie\x00"
    text = tok.apply_chat_template([{"role": "user", "content": mark}], tokenize=False, add_generation_prompt=False)
    if mark not in text:
        raise ConfigError("--prompt-source magpie: the chat template does not place the user's text verbatim")
    prefix = {"prompt_token_ids": tok.encode(text[: text.index(mark)], add_special_tokens=False)}
    banned = {p.strip().lower() for p in CHAT_PROMPTS}
    specials = [t for t in getattr(tok, "all_special_tokens", []) if t] or ["<|"]
    found: list[str] = []
    seen: set[str] = set()
    base = seed * 1_000_003
    for attempt in range(4):  # up to 4 rounds, each sampling 1.5x the questions still missing
        need = n - len(found)
        if need <= 0:
            break
        count = need + need // 2 + 8
        params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.95, seed=base + attempt * 100_003 + i)
                  for i in range(count)]
        for out in llm.generate([prefix] * count, params):
            c = out.outputs[0]
            q = c.text.strip()
            key = " ".join(q.lower().split())
            if (c.finish_reason != "stop" or len(q.split()) < 3 or any(t in q for t in specials) or key in seen
                    or key in banned):
                continue
            seen.add(key)
            found.append(q)
    if len(found) < n:
        log.warning("magpie: %d of %d questions kept", len(found), n)
    return [[{"role": "user", "content": q}] for q in found[:n]]


def prompt_messages(llm, source: str, n: int, seed: int = 0) -> list[list[dict]]:
    """The distillation prompts from `source`: templates (distill_messages), magpie, or mixed (half each)."""
    from sieve.config import ConfigError

    if source == "templates":
        return distill_messages(n, seed)
    if source == "magpie":
        return magpie_messages(llm, n, seed)
    if source == "mixed":
        out = distill_messages(n - n // 2, seed) + magpie_messages(llm, n // 2, seed)
        random.Random(seed).shuffle(out)
        return out
    raise ConfigError(f"--prompt-source {source}: unknown (templates, magpie, mixed)")


@functools.cache
def _template_patterns() -> list[re.Pattern]:
    out = []
    for t in TEMPLATES:
        head, tail = t.split("{t}")
        out.append(re.compile(re.escape(head) + "(.+)" + re.escape(tail), re.DOTALL))
    return out


def prompt_family(text: str) -> str:
    """The family a distillation prompt belongs to: prompts of one family share their wording, and so do their
    answers, in spans a small draft memorises. For a held-out measure that predicts served acceptance, a family
    is held out whole (`held_out_split`). Families: the template of an instruction (whatever its topic), the task of
    a passage, the function of the code task, and otherwise (Magpie's questions, which repeat their openings: "Can
    you provide a") the first three words."""
    for i, rx in enumerate(_template_patterns()):
        if rx.fullmatch(text):
            return f"template {i}"
    for i, task in enumerate(PASSAGE_TASKS):
        if text.startswith(task.split("{p}")[0]):
            return f"passage task {i}"
    head = CODE_TASK.split("{c}")[0]
    if text.startswith(head):
        return "code " + text[len(head):].split("\n", 1)[0]  # its function's first line
    return "opening " + " ".join(re.findall(r"[a-z0-9']+", text.lower())[:3])


def held_out_split(families: list[str], fraction: float = 0.1, seed: int = 0,
                   by: str = "family") -> tuple[list[int], list[int], str]:
    """(held-out indices, training indices, how): about `fraction` of the answers held out, by whole families
    (`by="family"`: no family on both sides; about `fraction` of each kind of family, so the held-out answers mix
    instructions, passages and code as the trained ones do) or by answer (`by="answer"`: near-duplicates of a
    held-out prompt may be trained on, and the held-out measure then overstates what is served: docs/design-notes.md,
    issue 15, fifteenth part). A family split falls back to answers when no whole family fits in half of its kind's answers (fewer
    than two families of a kind, or one that is most of them), and says so in `how`."""
    from sieve.config import ConfigError

    n = len(families)
    if n < 2:
        raise ConfigError(f"distillation needs at least 2 answers to hold some out, got {n}")
    if by not in ("family", "answer"):
        raise ConfigError(f"--held-out-by {by}: unknown (family, answer)")
    rng = random.Random(seed)
    if by == "family":
        members: dict[str, list[int]] = {}
        for i, f in enumerate(families):
            members.setdefault(f, []).append(i)
        kinds: dict[str, list[str]] = {}  # the families of each kind ("template", "code", ...): each kind held out alike
        for f in sorted(members):
            kinds.setdefault(f.split(" ", 1)[0], []).append(f)
        held: list[int] = []
        for groups in kinds.values():
            size = sum(len(members[g]) for g in groups)
            want, took = max(1, round(fraction * size)), 0
            rng.shuffle(groups)
            for g in groups:
                if took >= want:
                    break
                if took + len(members[g]) <= size // 2:
                    took += len(members[g])
                    held += members[g]
        if held and len(members) > 1:
            chosen = set(held)
            return sorted(held), [i for i in range(n) if i not in chosen], "family"
        log.warning("held-out split by family: no family fits in half of its kind's answers; holding out answers instead")
    order = list(range(n))
    rng.shuffle(order)
    want = max(1, round(fraction * n))
    return sorted(order[:want]), sorted(order[want:]), "answer"


def _stdlib_functions(n: int) -> list[str]:
    """Up to `n` distinct functions of Python's standard library (200-1,200 characters of source), in a fixed order;
    none from the modules the benchmark's grounded tasks take theirs from (textwrap, heapq, shlex)."""
    import importlib

    out: list[str] = []
    for name in ("posixpath", "fnmatch", "colorsys", "statistics", "string", "calendar", "bisect", "difflib", "fractions",
                 "ipaddress", "html", "base64", "glob", "urllib.parse", "email.utils", "csv", "json.decoder", "locale",
                 "gettext", "tokenize"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for _, f in sorted(inspect.getmembers(module, inspect.isfunction)):
            if f.__module__ != module.__name__:
                continue
            try:
                src = inspect.getsource(f)
            except (OSError, TypeError):  # a build without the stdlib's sources
                continue
            if 200 <= len(src) <= 1200:
                out.append(src)
            if len(out) >= n:
                return out
    return out or ["def add(a, b):\n    return a + b\n"]


def collect(llm, messages: list[list[dict]], max_tokens: int, temperature: float,
            seed: int) -> tuple[list[tuple[list[int], int]], list[int]]:
    """The target's answers, (prompt + answer token ids, prompt length) per prompt that fits the context, and the
    indices in `messages` of those prompts."""
    from sieve.sampling_params import SamplingParams

    tok = llm.get_tokenizer()
    if tok is not None and getattr(tok, "chat_template", None):
        prompts = [{"prompt_token_ids": tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]}
                   for m in messages]
    else:  # no chat template (a base model): the raw text
        prompts = [m[0]["content"] for m in messages]
    limit = llm.llm_engine.config.max_model_len - max_tokens  # prompts too long for this model's context are left out
    encoded = [p if isinstance(p, dict) else {"prompt_token_ids": tok.encode(p)} for p in prompts]
    kept = [i for i, p in enumerate(encoded) if len(p["prompt_token_ids"]) <= limit]
    if not kept:
        raise ValueError(f"no distillation prompt fits in {limit} tokens (the context minus --max-tokens)")
    outs = llm.generate([encoded[i] for i in kept], SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed))
    return [(list(o.prompt_token_ids) + list(o.outputs[0].token_ids), len(o.prompt_token_ids)) for o in outs], kept


def answers(llm, messages: list[list[dict]], args: argparse.Namespace) -> tuple[list[tuple[list[int], int]], list[int]]:
    """The target's answers and the indices of the prompts they answer (as `collect`); with `--answers FILE`, read
    from it when it holds answers of this target to these prompts with these settings, else generated and written
    there (one generation serves several trainings)."""
    from pathlib import Path

    key = {"target": str(llm.llm_engine.config.model), "prompts": len(messages), "max_tokens": args.max_tokens,
           "temperature": args.temperature, "seed": args.seed, "prompt_source": args.prompt_source,
           "prompts_sha256": hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()}
    path = Path(args.answers) if args.answers else None
    if path is not None and path.exists():
        try:
            saved = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            saved = {}
        kept = saved.get("kept")
        if saved.get("key") == key and kept is not None and len(kept) == len(saved["answers"]):
            print(f"distill: the target's answers read from {path}", flush=True)
            return [(list(ids), int(p)) for ids, p in saved["answers"]], [int(i) for i in kept]
        log.info("%s holds answers of other settings: generating again", path)
    seqs, kept = collect(llm, messages, args.max_tokens, args.temperature, args.seed)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "answers": seqs, "kept": kept}))
    return seqs, kept


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
    return acceptance_summary(right, chain, len(hidden))


def train_medusa(engine, train: tuple, held: tuple, num_heads: int, draft_vocab_size: int, epochs: int, lr: float,
                 batch: int, seed: int, sequential: bool = True) -> tuple:
    from sieve.spec_decode.medusa import MedusaHeads

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
        _end_epoch(history, epoch, total / max(1, seen), measure(heads.eval(), *held, table), "head accuracy")
        heads.train()
    return heads.eval(), history, covered


def _end_epoch(history: list, epoch: int, loss: float, held: dict, what: str) -> None:
    history.append({"epoch": epoch + 1, "loss": loss, **held})
    log.info("epoch %d: loss %.3f, held-out %s %s, simulated mean acceptance length %s", epoch + 1, loss, what,
             [round(a, 3) for a in held["head_accuracy"]], {k: round(v, 2) for k, v in held["simulated_mean_acceptance_length"].items()})


def eagle_examples(engine, seqs: list[tuple[list[int], int]], rows_per_pass: int = 256, features: bool = True,
                   aux_layers: tuple[int, ...] = ()) -> list[tuple]:
    """Per answer: (token ids [N], prompt length, the target's features at every position [N, H] (None without
    `features`; with `aux_layers` [N, (1 + n) H], the residual stream after those layers following the last hidden
    state, as the runner serves them to an EAGLE-3 layer), and its greedy next token after every position [N]: the
    label wherever the text is not its own, as in the prompt). On the CPU; `on_device` moves them to where training
    runs."""
    out, H = [], engine.arch.hidden_size
    for ids, p in seqs:
        if len(ids) - p < 2:
            continue
        h = engine.hidden_states(ids, tuple(aux_layers))
        with torch.inference_mode():
            nxt = torch.cat([engine.runner.model.compute_logits(h[s: s + rows_per_pass, :H]).argmax(dim=-1)
                             for s in range(0, len(h), rows_per_pass)])
        out.append((torch.tensor(ids), p, h.float().cpu().clone() if features else None, nxt.cpu().clone()))
    return out


def on_device(seqs: list[tuple], device: torch.device) -> list[tuple]:
    """`eagle_examples`' tensors on `device` (the target's: training runs where its features were computed)."""
    return [tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in s) for s in seqs]


DRAFT_VOCAB = 8192  # --draft-vocab's default for heads trained afresh
REG_WEIGHT = 1.0  # EAGLE's feature regression beside the token loss (its features are unnormed: it weighs tokens 0.1)


def eagle_loss(layer, seq: tuple, table: torch.Tensor, index: torch.Tensor, depth: int,
               teacher: torch.Tensor | None = None, reg_weight: float = REG_WEIGHT) -> tuple[torch.Tensor, int]:
    """Mean over levels and positions of the token loss and the feature regression (smooth L1 against the target's
    next feature, weighed `reg_weight`); and the sequence's positions. The token loss is the cross-entropy against
    the target's greedy next token (in the draft vocabulary), or with `teacher` (the target's LM-head rows of the
    draft vocabulary [V', H]) against the target's whole distribution there, softmax(teacher @ f): EAGLE's own
    classification loss, which tells the layer how far the runners-up are as well as which token won."""
    total, positions = eagle_batch_loss(layer, [seq], table, index, depth, teacher, reg_weight)
    return total / positions, positions


def eagle_batch_loss(layer, seqs: list[tuple], table: torch.Tensor, index: torch.Tensor, depth: int,
                     teacher: torch.Tensor | None = None, reg_weight: float = REG_WEIGHT) -> tuple[torch.Tensor, int]:
    """`eagle_loss` of several answers in one pass, each padded at its end to the longest: the sum over answers of
    each one's mean loss times its positions (what training adds up per optimiser step), and their positions. A valid
    row reads only valid rows of its own answer (`EagleLayer.unrolled`), so each answer's loss is what it is alone."""
    dev = seqs[0][2].device
    lengths = [len(s[0]) for s in seqs]
    B, N = len(seqs), max(lengths)
    T = N - 1
    ids = torch.zeros(B, N, dtype=torch.int64, device=dev)
    feats = seqs[0][2].new_zeros(B, N, seqs[0][2].shape[-1])
    nxt = torch.zeros(B, N, dtype=torch.int64, device=dev)
    for b, (i, _, f, n) in enumerate(seqs):
        ids[b, : len(i)], feats[b, : len(i)], nxt[b, : len(i)] = i, f, n
    ends = torch.tensor(lengths, device=dev) - 1  # each answer's positions
    outs = layer.unrolled(table[ids[:, 1:]], feats[:, :T], depth)
    if teacher is not None:  # the target's distribution after each position, once for every level
        with torch.no_grad():
            target = torch.softmax(feats[:, 1:, : teacher.shape[1]].to(teacher.dtype) @ teacher.t(), dim=-1)
    acc = torch.promote_types(outs[0].dtype, torch.float32)  # the losses' dtype: float32, or float64 (tests)
    pos = torch.arange(T, device=dev)
    total = torch.zeros(B, dtype=acc, device=dev)
    count = torch.zeros(B, dtype=acc, device=dev)
    for s, g in enumerate(outs):
        bi, ii = ((pos[None, :] >= s) & (pos[None, :] < ends[:, None])).nonzero(as_tuple=True)
        if not len(ii):
            break
        pred = g[bi, ii]
        logits = layer.logits(pred).to(acc)
        if teacher is None:
            ce = F.cross_entropy(logits, index[nxt[bi, ii + 1]], ignore_index=-100, reduction="none")
        else:
            ce = -(target[bi, ii] * torch.log_softmax(logits, dim=-1)).sum(-1)
        reg = F.smooth_l1_loss(pred, layer.scale_features(feats[bi, ii + 1]), reduction="none").mean(-1)
        total = total.index_add(0, bi, (ce + reg_weight * reg).to(acc))
        count = count.index_add(0, bi, torch.ones_like(count[bi]))
    return (total / count.clamp_min(1) * ends).sum(), int(sum(lengths) - B)


def pack_answers(seqs: list[tuple], pack_tokens: int, rng: random.Random) -> list[list[int]]:
    """Indices of `seqs` in training passes: one answer a pass in a random order (pack_tokens 0), or answers of
    similar length together, each pass at most `pack_tokens` padded positions (at least one answer), the passes in a
    random order. A GPU waits on launches with one answer a pass (a ~200-token answer is a few hundred small kernels)."""
    order = list(range(len(seqs)))
    rng.shuffle(order)
    if pack_tokens <= 0:
        return [[j] for j in order]
    order.sort(key=lambda j: len(seqs[j][0]))  # stable: equal lengths stay in their random order
    passes, cur = [], []
    for j in order:
        if cur and (len(cur) + 1) * len(seqs[j][0]) > pack_tokens:
            passes.append(cur)
            cur = []
        cur.append(j)
    passes.append(cur)
    rng.shuffle(passes)
    return passes


def measure_eagle(layer, seqs: list[tuple], table: torch.Tensor, depth: int) -> dict:
    """Served greedy acceptance, simulated: for every state of every held-out answer (the target has committed up
    to some answer token), the layer drafts `depth` tokens the way the proposer does (its own features fed back),
    and draft s counts when drafts 1..s all equal the answer's next tokens."""
    dev = table.device
    right, chain, states = torch.zeros(depth, device=dev), torch.zeros(depth, device=dev), 0
    with torch.inference_mode():
        for ids, p, feats, _ in seqs:
            N = len(ids)
            T = N - 1
            outs = layer.unrolled(table[ids[1:]], feats[:T], depth)
            ns = torch.arange(p, N - 1, device=dev)  # committed up to n - 1, token n sampled: draft s + 1 guesses token n + 1 + s
            alive = torch.ones(len(ns), dtype=torch.bool, device=dev)
            for s, g in enumerate(outs):
                valid = ns + 1 + s <= N - 1
                guess = layer.draft_vocab[layer.logits(g[(ns - 1 + s).clamp(max=T - 1)]).argmax(dim=-1)]
                ok = (guess == ids[(ns + 1 + s).clamp(max=N - 1)]) & valid
                right[s] += ok.sum()
                alive &= ok
                chain[s] += alive.sum()
            states += len(ns)
    return acceptance_summary(right.cpu(), chain.cpu(), states)


def _init_layer(engine, init: str, aux_layers: tuple[int, ...], dev="cpu", draft_vocab: int | None = None) -> "EagleLayer":
    """The trained layer `--init` names, checked against this target, `--aux-hidden-layers` and `--draft-vocab` (which
    it keeps: given, it must be its size)."""
    from sieve.config import ConfigError
    from sieve.spec_decode.eagle import EagleLayer

    try:
        old, config = EagleLayer.load(init, dev, torch.float32)
    except ValueError as e:
        raise ConfigError(f"--init: {e}") from e
    if config["hidden_size"] != engine.arch.hidden_size or max(config["draft_vocab"]) >= engine.arch.vocab_size:
        raise ConfigError(f"--init {init}: the EAGLE layer was trained for another target")
    if old.aux_hidden_layers and tuple(old.aux_hidden_layers) != tuple(aux_layers):
        raise ConfigError(f"--init {init} fuses layers {list(old.aux_hidden_layers)}, not --aux-hidden-layers {list(aux_layers)}")
    if draft_vocab is not None and draft_vocab != len(old.draft_vocab):
        raise ConfigError(f"--init {init} keeps its draft vocabulary of {len(old.draft_vocab)} tokens, not --draft-vocab {draft_vocab}")
    return old


def resumed_layer(engine, init: str, aux_layers: tuple[int, ...], sample: torch.Tensor, dev) -> "EagleLayer":
    """A trained layer to go on from, with `aux_layers` fused: its own weights and scales kept, a fused part it lacks
    starting at zero (scaled from `sample`, the training features), so it starts as the layer it was."""
    from sieve.spec_decode.eagle import EagleLayer

    old = _init_layer(engine, init, aux_layers, dev)
    layer = EagleLayer.for_target(engine.arch, old.draft_vocab.tolist(), aux_layers).to(dev)
    missing, unexpected = layer.load_state_dict(old.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"fuse.weight", "aux_scale"}, (missing, unexpected)
    if missing:
        with torch.no_grad():
            layer.aux_scale.copy_(sample[:, engine.arch.hidden_size:].float().pow(2).mean(0).sqrt().clamp_min(1e-3))
    return layer


def train_eagle(engine, train: list[tuple], held: list[tuple], depth: int, draft_vocab_size: int, epochs: int, lr: float,
                batch_tokens: int, seed: int, token_loss: str = "hard", reg_weight: float = REG_WEIGHT,
                pack_tokens: int = 0, aux_layers: tuple[int, ...] = (), init: str | None = None) -> tuple:
    """Train an EAGLE layer (with `aux_layers`, EAGLE-3's fused features); with `init`, go on from a trained layer's
    weights and draft vocabulary (a fused part it lacks starts at zero: where it started)."""
    from sieve.spec_decode.eagle import EagleLayer

    torch.manual_seed(seed)
    counts = Counter(t for _, p, _, nxt in train for t in nxt[p - 1:].tolist())  # what the target writes in its answers
    dev = engine.device  # where the target ran: the layer trains there, in float32
    train, held = on_device(train, dev), on_device(held, dev)
    table = embedding_table(engine).to(dev)
    sample = torch.cat([f for _, _, f, _ in train[:64]])
    if init is None:
        vocab = [t for t, _ in counts.most_common(draft_vocab_size)]
        for t in engine.eos_token_ids:
            if t not in vocab and t < engine.arch.vocab_size:
                vocab.append(t)
        layer = EagleLayer.for_target(engine.arch, vocab, aux_layers).to(dev)
        layer.calibrate(sample, table)
        with torch.no_grad():
            layer.head.weight.copy_(lm_head_rows(engine, vocab).to(dev))
    else:
        layer = resumed_layer(engine, init, aux_layers, sample, dev)
        vocab = layer.draft_vocab.tolist()
        log.info("from %s: held-out draft accuracy %s", init, measure_eagle(layer.eval(), held, table, depth)["head_accuracy"])
        layer.train()
    covered = sum(counts[t] for t in vocab) / max(1, sum(counts.values()))
    rows = lm_head_rows(engine, vocab).to(dev)
    teacher = rows if token_loss == "soft" else None
    index = torch.full((engine.arch.vocab_size,), -100, dtype=torch.int64, device=dev)
    index[torch.tensor(vocab, device=dev)] = torch.arange(len(vocab), device=dev)
    opt = torch.optim.AdamW(layer.parameters(), lr=lr, weight_decay=0.0)
    positions = sum(len(s[0]) - 1 for s in train)
    # an optimiser step ends once it holds batch_tokens positions, and a pass larger than that is a step of its own
    steps = max(1, epochs * math.ceil(positions / max(batch_tokens, pack_tokens)))
    sched = warmup_decay(opt, steps)
    history, rng = [], random.Random(seed)
    for epoch in range(epochs):
        passes = pack_answers(train, pack_tokens, rng)
        total, seen, pending = 0.0, 0, 0
        opt.zero_grad(set_to_none=True)
        for k, batch in enumerate(passes):
            loss, n = eagle_batch_loss(layer, [train[j] for j in batch], table, index, depth, teacher, reg_weight)
            (loss / batch_tokens).backward()
            total += loss.detach()  # a tensor: no wait for the device each pass
            seen += n
            pending += n
            if pending >= batch_tokens or k == len(passes) - 1:
                torch.nn.utils.clip_grad_norm_(layer.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                pending = 0
        _end_epoch(history, epoch, float(total) / max(1, seen), measure_eagle(layer.eval(), held, table, depth),
                   "draft accuracy")
        layer.train()
    return layer.cpu().eval(), history, covered


def run_distill(args: argparse.Namespace) -> dict:
    from sieve.config import ConfigError
    from sieve.llm import LLM

    if args.method not in ("medusa", "eagle", "draft"):
        raise ConfigError(f"sieve distill --method {args.method}: unknown (medusa, eagle, draft)")
    for flag, value in (("--draft-layers", args.draft_layers), ("--depth", args.depth), ("--batch-tokens", args.batch_tokens),
                        ("--draft-vocab", 1 if args.draft_vocab is None else args.draft_vocab)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if not args.feature_loss_weight >= 0:  # NaN included
        raise ConfigError(f"--feature-loss-weight must be >= 0, got {args.feature_loss_weight}")
    if args.pack_tokens < 0:
        raise ConfigError(f"--pack-tokens must be >= 0, got {args.pack_tokens}")
    if args.method != "eagle" and (args.token_loss != "hard" or args.feature_loss_weight != REG_WEIGHT or args.pack_tokens
                                   or args.aux_hidden_layers or args.init):
        raise ConfigError(f"--token-loss, --feature-loss-weight, --pack-tokens, --aux-hidden-layers and --init train an EAGLE "
                          f"layer, not --method {args.method}")
    started = time.perf_counter()
    llm = LLM(args.target, dtype=args.dtype, max_num_seqs=64, kv_cache_memory_gb=args.kv_cache_memory_gb, seed=args.seed)
    engine = llm.llm_engine
    aux = ()
    if args.method == "eagle":  # refused before the answers are generated, not after
        aux = aux_hidden_layers(args.aux_hidden_layers, engine.arch.num_layers)
        if args.init:
            _init_layer(engine, args.init, aux, draft_vocab=args.draft_vocab)
    draft_vocab = DRAFT_VOCAB if args.draft_vocab is None else args.draft_vocab
    messages = prompt_messages(llm, args.prompt_source, args.prompts, args.seed)
    seqs, kept = answers(llm, messages, args)
    generated = time.perf_counter()
    families = [prompt_family(messages[i][0]["content"]) for i in kept]
    held_idx, train_idx, how = held_out_split(families, 0.1, args.seed, args.held_out_by)
    rng = random.Random(args.seed)
    rng.shuffle(train_idx)
    split = {"held_out_by": how, "held_out_answers": len(held_idx),
             "held_out_families": sorted({families[i] for i in held_idx}) if how == "family" else None}
    print(f"distill: {len(held_idx)} of {len(seqs)} answers held out by {how}"
          + (f" ({len(split['held_out_families'])} of {len(set(families))} families)" if how == "family" else ""), flush=True)
    seqs = [seqs[i] for i in held_idx] + [seqs[i] for i in train_idx]
    n_held = len(held_idx)
    if args.method == "eagle":
        return _finish_eagle(args, engine, seqs, n_held, len(messages), started, generated, split, aux, draft_vocab)
    if args.method == "draft":
        return _finish_draft(args, engine, seqs, n_held, len(messages), started, generated, split)
    held = examples(engine, seqs[:n_held], args.num_heads)
    train = examples(engine, seqs[n_held:], args.num_heads)
    print(f"distill: {len(seqs)} answers from {engine.model_name} ({sum(len(i) - p for i, p in seqs)} tokens, "
          f"{generated - started:.0f} s); training on {len(train[0])} positions, {len(held[0])} held out", flush=True)
    heads, history, covered = train_medusa(engine, train, held, args.num_heads, draft_vocab, args.epochs, args.lr,
                                           args.batch_size, args.seed, not args.independent_heads)
    final = history[-1]
    meta = {"target": str(engine.config.model), "head_type": "medusa" if args.independent_heads else "hydra", "target_vocab_size": engine.arch.vocab_size, "draft_vocab_coverage": covered,
            "train_positions": len(train[0]), "held_out_positions": len(held[0]), "epochs": args.epochs,
            "head_accuracy": final["head_accuracy"], "chain_acceptance": final["chain_acceptance"],
            "simulated_mean_acceptance_length": final["simulated_mean_acceptance_length"],
            "temperature": args.temperature, "max_tokens": args.max_tokens, "prompts": len(messages), **split}
    heads.save(args.out, meta)
    print(f"draft vocabulary: {len(heads.draft_vocab)} tokens covering {100 * covered:.1f}% of the answers' tokens")
    seconds = _report(args, final, started, "head accuracy (token k: head k)",
                      {"method": "medusa", "model": str(args.out), "num_speculative_tokens": args.num_heads})
    return {**meta, "history": history, "seconds": seconds, "out": str(args.out)}


def _report(args, final: dict, started: float, what: str, serve: dict, extra: str = "") -> float:
    """Print what training measured and how to serve the result; the seconds it all took."""
    seconds = time.perf_counter() - started
    print(f"held-out {what}: " + ", ".join(f"token {k + 1} {a:.3f}" for k, a in enumerate(final["head_accuracy"])))
    print("simulated mean acceptance length (greedy): "
          + ", ".join(f"k={k} {v:.2f}" for k, v in final["simulated_mean_acceptance_length"].items()) + extra)
    print(f"saved to {args.out} in {seconds:.0f} s: serve with --speculative-config '{json.dumps(serve)}'")
    return seconds


def aux_hidden_layers(value: str | None, num_layers: int) -> tuple[int, ...]:
    """--aux-hidden-layers: none, layer indices "2,15", or "eagle3": EAGLE-3's low and middle layers and one three
    from the top (2, L // 2, L - 3; the last hidden state is always read as well)."""
    from sieve.config import ConfigError

    if not value:
        return ()
    if value == "eagle3":  # (fewer where those coincide in a shallow model)
        layers = tuple({l: None for l in (2, num_layers // 2, num_layers - 3) if 0 <= l < num_layers})
    else:
        try:
            layers = tuple(int(v) for v in value.split(","))
        except ValueError:
            raise ConfigError(f"--aux-hidden-layers takes layer indices like 2,15 or eagle3, got {value!r}") from None
    if not all(0 <= l < num_layers for l in layers) or len(set(layers)) != len(layers):
        raise ConfigError(f"--aux-hidden-layers {value}: distinct layers of the target's 0 .. {num_layers - 1}")
    return tuple(sorted(layers))


def _finish_eagle(args, engine, seqs, n_held: int, num_prompts: int, started: float, generated: float, split: dict,
                  aux: tuple[int, ...], draft_vocab: int) -> dict:
    held = eagle_examples(engine, seqs[:n_held], aux_layers=aux)
    train = eagle_examples(engine, seqs[n_held:], aux_layers=aux)
    n_train, n_held_pos = sum(len(s[0]) - 1 for s in train), sum(len(s[0]) - s[1] for s in held)
    print(f"distill: {len(seqs)} answers from {engine.model_name} ({sum(len(i) - p for i, p in seqs)} tokens, "
          f"{generated - started:.0f} s); training an EAGLE layer on {n_train} positions ({args.depth} drafting steps "
          f"unrolled), {n_held_pos} answer positions held out", flush=True)
    layer, history, covered = train_eagle(engine, train, held, args.depth, draft_vocab, args.epochs, args.lr,
                                          args.batch_tokens, args.seed, args.token_loss, args.feature_loss_weight,
                                          args.pack_tokens, aux, args.init)
    final = history[-1]
    meta = {"target": str(engine.config.model), "head_type": "eagle", "target_vocab_size": engine.arch.vocab_size,
            "draft_vocab_coverage": covered, "train_positions": n_train, "held_out_positions": n_held_pos,
            "epochs": args.epochs, "init": args.init, "depth": args.depth, "token_loss": args.token_loss,
            "feature_loss_weight": args.feature_loss_weight, "head_accuracy": final["head_accuracy"],
            "chain_acceptance": final["chain_acceptance"],
            "simulated_mean_acceptance_length": final["simulated_mean_acceptance_length"],
            "temperature": args.temperature, "max_tokens": args.max_tokens, "prompts": num_prompts, **split}
    layer.save(args.out, meta)
    print(f"draft vocabulary: {len(layer.draft_vocab)} tokens covering {100 * covered:.1f}% of the answers' tokens")
    seconds = _report(args, final, started, "draft accuracy (own features fed back)",
                      {"method": "eagle3" if aux else "eagle", "model": str(args.out), "num_speculative_tokens": args.depth})
    return {**meta, "history": history, "seconds": seconds, "out": str(args.out)}


def _finish_draft(args, engine, seqs, n_held: int, num_prompts: int, started: float, generated: float, split: dict) -> dict:
    from sieve.train.draft import cut_from_target, save_draft, train_draft

    held = eagle_examples(engine, seqs[:n_held], features=False)
    train = eagle_examples(engine, seqs[n_held:], features=False)
    model, ckpt, layers = cut_from_target(engine.config.model, args.draft_layers)
    n_train, n_held_pos = sum(len(s[0]) - s[1] + 1 for s in train), sum(len(s[0]) - s[1] for s in held)
    params = sum(p.numel() for p in model.parameters())
    print(f"distill: {len(seqs)} answers from {engine.model_name} ({sum(len(i) - p for i, p in seqs)} tokens, "
          f"{generated - started:.0f} s); a draft of {len(layers)} of its {engine.arch.num_layers} layers ({layers}, "
          f"{params / 1e6:.1f}M parameters) trained on {n_train} positions, {n_held_pos} answer positions held out", flush=True)
    history = train_draft(model, train, held, args.depth, args.epochs, args.lr, args.batch_tokens, args.seed)
    final = history[-1]
    meta = {"target": str(engine.config.model), "head_type": "draft", "target_layers": layers, "parameters": params,
            "train_positions": n_train, "held_out_positions": n_held_pos, "epochs": args.epochs,
            "head_accuracy": final["head_accuracy"], "chain_acceptance": final["chain_acceptance"],
            "simulated_mean_acceptance_length": final["simulated_mean_acceptance_length"],
            "before_training": history[0]["simulated_mean_acceptance_length"],
            "temperature": args.temperature, "max_tokens": args.max_tokens, "prompts": num_prompts, **split}
    save_draft(model, ckpt, args.out, meta)
    seconds = _report(args, final, started, "agreement with the target (teacher-forced)",
                      {"method": "draft_model", "model": str(args.out), "num_speculative_tokens": args.depth},
                      f" (cut, untrained: k={args.depth} {history[0]['simulated_mean_acceptance_length'][str(args.depth)]:.2f})")
    return {**meta, "history": history, "seconds": seconds, "out": str(args.out)}


def add_distill_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="the target model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--method", default="medusa", choices=["medusa", "eagle", "draft"])
    p.add_argument("--out", required=True, help="folder the heads are saved to")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-heads", type=int, default=3, help="medusa: heads (one draft token each)")
    p.add_argument("--depth", type=int, default=3, help="eagle: drafting steps unrolled in training (EAGLE-3's training-time "
                   "test); eagle and draft: draft tokens the simulated acceptance is reported for")
    p.add_argument("--draft-layers", type=int, default=4, help="draft: decoder layers of the target the draft keeps (evenly spaced)")
    p.add_argument("--token-loss", default="hard", choices=["hard", "soft"],
                   help="eagle: the draft's token loss: cross-entropy against the target's greedy token (hard) or against its "
                        "distribution over the draft vocabulary (soft, EAGLE's)")
    p.add_argument("--feature-loss-weight", type=float, default=REG_WEIGHT,
                   help="eagle: weight of the regression onto the target's next feature beside the token loss")
    p.add_argument("--aux-hidden-layers", default=None,
                   help="eagle: EAGLE-3's fused features: the target's residual stream after these layers (0-based, e.g. 2,15; "
                        "eagle3: 2, L/2 and L-3) is added to the last hidden state through a learned projection")
    p.add_argument("--init", default=None, help="eagle: go on training these heads (their weights and draft vocabulary; "
                   "a fused projection they lack starts at zero)")
    p.add_argument("--batch-tokens", type=int, default=256, help="eagle and draft: positions per optimiser step (at least one sequence)")
    p.add_argument("--pack-tokens", type=int, default=0,
                   help="eagle: answers of similar length trained in one pass, padded, up to this many positions (0: one "
                        "answer a pass; a GPU wants thousands, with --batch-tokens at least as many)")
    p.add_argument("--independent-heads", action="store_true",
                   help="Medusa-1's independent heads (default: Hydra's sequential heads, each also reading the token before "
                        "the one it guesses)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help=f"tokens the heads can draft (the most frequent in the answers; default {DRAFT_VOCAB}; with --init, "
                        "that of its heads)")
    p.add_argument("--prompts", type=int, default=240)
    p.add_argument("--prompt-source", default="templates", choices=["templates", "magpie", "mixed"],
                   help="templates: instructions from templates x topics, passages and code; magpie: questions the target "
                        "writes itself from its chat template's user turn; mixed: half each")
    p.add_argument("--held-out-by", default="family", choices=["family", "answer"],
                   help="the tenth of the answers that measures the heads: whole prompt families (a template, a task, an "
                        "opening: no near-duplicate of a held-out prompt is trained on) or single answers")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="how the target answers (0: its greedy answers)")
    p.add_argument("--answers", default=None, help="a JSON file the target's answers are kept in and reused from "
                   "(same target, prompts (their text), --max-tokens, --temperature and --seed)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
