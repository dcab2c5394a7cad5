"""A/B of the step-cost model's monotone fit: the weighted monotone fit (sieve/spec/controller.py) against the
running maximum it replaced, ngram `auto` at N users, interleaved repeat by repeat with off and a fixed k = 6; per
repeat, what each `auto` drafted and had accepted and its measured over predicted step time by step size. Used in
docs/benchmarks.md, issue 15, sixteenth part (on an H200).

    python scripts/spec_cost_fit_ab.py users repeats workload [bench spec options: --model, --dtype, ...]"""
import argparse
import statistics
import sys
import types
from collections import defaultdict

from sieve import SamplingParams
from sieve.bench.spec import WORKLOADS, _concurrent, _engine, _prompt_ids, add_bench_spec_args

users, repeats, workload = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
p = argparse.ArgumentParser(); add_bench_spec_args(p)
args = p.parse_args(["--workload", workload, "--users", str(users), "--requests-per-user", "2", "--max-tokens", "128", *sys.argv[4:]])


def old_predict(self, num_tokens, keys=0.0):
    if self._curve is None:
        pts = sorted(self.buckets.values())
        xs, ys = [q[0] for q in pts], []
        for q in pts:
            ys.append(max(q[1], ys[-1]) if ys else q[1])
        self._curve = xs, ys
    return self.scale * (self._shape(num_tokens) + self.per_key * keys)


engines = {"off": _engine(args, None, users), "k6": _engine(args, {"method": "ngram", "num_speculative_tokens": 6}, users),
           "auto_new": _engine(args, {"method": "ngram", "num_speculative_tokens": "auto"}, users),
           "auto_old": _engine(args, {"method": "ngram", "num_speculative_tokens": "auto"}, users)}
old = engines["auto_old"].llm_engine.speculator.cost
old.predict = types.MethodType(old_predict, old)
old._curve = None
traces = {}
for name in ("auto_new", "auto_old"):
    sp = engines[name].llm_engine.speculator
    c = sp.cost
    print(name, "per_key us/1000 keys %.3f" % (c.per_key * c.scale * 1e9), "calibrated ms:",
          " ".join(f"{n}:{c.predict(n) * 1e3:.1f}" for n in (1, 4, 8, 12, 16, 17, 20, 24, 28, 32, 40, 48, 64, 96, 128)), flush=True)
    print("  raw buckets", " ".join(f"{int(v[0])}:{v[1] * c.scale * 1e3:.1f}" for _, v in sorted(c.buckets.items())), flush=True)
    steps = traces[name] = []

    def traced(n, s, keys=0, sp=sp, steps=steps, f=sp.observe_step):
        steps.append((n, s, sp.cost.predict(n, keys) if sp.cost.ready else None))
        f(n, s, keys)
    sp.observe_step = traced
prompts = _prompt_ids(engines["off"], WORKLOADS[workload](users))
for llm in engines.values():
    llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0))
res = defaultdict(list)
for r in range(repeats):
    line = []
    for name, llm in engines.items():
        sp = llm.llm_engine.speculator
        d0 = (sp.stats.num_draft_tokens, sp.stats.num_accepted_tokens) if sp else (0, 0)
        if name in traces:
            traces[name].clear()
        t = _concurrent(llm, prompts, users, args)["tok_s"]
        res[name].append(t)
        extra = f" drafted {sp.stats.num_draft_tokens - d0[0]} acc {sp.stats.num_accepted_tokens - d0[1]}" if sp else ""
        if name in traces:
            err = defaultdict(list)
            for n, s, pred in traces[name]:
                if pred:
                    err["<=8" if n <= users // 4 * 4 and n <= 8 else "<=32" if n <= 32 else "33-64" if n <= 64 else "65-128" if n <= 128 else ">128"].append((s, pred))
            extra += " | " + " ".join(f"{k}: n={len(v)} act {statistics.median(a for a, _ in v) * 1e3:.1f}ms act/pred {statistics.median(a / b for a, b in v):.2f}" for k, v in sorted(err.items()))
        line.append(f"{name} {t:.1f}{extra}")
    print(f"repeat {r}: " + " || ".join(line), flush=True)
base = res["off"]
for name, v in res.items():
    print(f"{name}: median {statistics.median(v):.1f} tok/s, paired {statistics.median(a / b for a, b in zip(v, base)):.2f}x off")
for name in traces:
    c = engines[name].llm_engine.speculator.cost
    print(name, "after:", " ".join(f"{n}:{c.predict(n) * 1e3:.1f}" for n in (8, 16, 32, 40, 48, 64, 96, 128, 192)))
