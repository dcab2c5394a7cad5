"""`auto` at N concurrent users, step by step: speculation off and ngram `auto` alternate repeat by repeat (as
`sieve bench spec` runs them), and after each repeat this prints both throughputs, what `auto` drafted and had
accepted, its step-cost model (scale, predicted seconds at 32 / 40 / 64 tokens), the median of measured over
predicted seconds of the steps it ran (by token count), and the median time of its decode-only steps of 28-32 rows
(the host's speed in that repeat). Used in docs/benchmarks.md, issue 15, fifteenth part.

    python scripts/spec_auto_trace.py [repeats] [users] [workload] [bench spec options: --model, --dtype, ...]"""
import argparse
import statistics
import sys
from collections import defaultdict

from sieve import SamplingParams
from sieve.bench.spec import WORKLOADS, _concurrent, _engine, _prompt_ids, add_bench_spec_args

repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 8
users = int(sys.argv[2]) if len(sys.argv) > 2 else 32
workload = sys.argv[3] if len(sys.argv) > 3 else "mixed"
p = argparse.ArgumentParser()
add_bench_spec_args(p)
args = p.parse_args(["--workload", workload, "--users", str(users), "--requests-per-user", "2", "--max-tokens", "128", *sys.argv[4:]])
off = _engine(args, None, users)
auto = _engine(args, {"method": "ngram", "num_speculative_tokens": "auto"}, users)
prompts = _prompt_ids(off, WORKLOADS[workload](users))
sp = auto.llm_engine.speculator
steps = []  # (tokens, seconds, predicted seconds) of each step auto ran
observe = sp.observe_step


def traced(num_tokens, seconds, keys=0):
    steps.append((num_tokens, seconds, sp.cost.predict(num_tokens, keys) if sp.cost.ready else None))
    observe(num_tokens, seconds, keys)


sp.observe_step = traced
for llm in (off, auto):
    llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0))
for r in range(repeats):
    a = _concurrent(off, prompts, users, args)
    drafted0, accepted0 = sp.stats.num_draft_tokens, sp.stats.num_accepted_tokens
    steps.clear()
    b = _concurrent(auto, prompts, users, args)
    err = defaultdict(list)
    for n, s, pred in steps:
        if pred:
            err["<=32" if n <= 32 else "33-48" if n <= 48 else "49-96" if n <= 96 else ">96"].append(s / pred)
    c = sp.cost
    print(f"repeat {r}: off {a['tok_s']:.1f} auto {b['tok_s']:.1f} ratio {b['tok_s'] / a['tok_s']:.2f} | steps {len(steps)} "
          f"drafted {sp.stats.num_draft_tokens - drafted0} accepted {sp.stats.num_accepted_tokens - accepted0} | scale {c.scale:.3f} "
          f"pred32 {c.predict(32) * 1e3:.1f}ms pred40 {c.predict(40) * 1e3:.1f} pred64 {c.predict(64) * 1e3:.1f} | "
          + " ".join(f"{k}: n={len(v)} act/pred={statistics.median(v):.2f}" for k, v in sorted(err.items())), flush=True)
    decode = [s for n, s, _ in steps if users - 4 <= n <= users]
    if decode:
        print(f"   decode-only steps of {users - 4}-{users} rows median ms {statistics.median(decode) * 1e3:.1f} n {len(decode)}", flush=True)
