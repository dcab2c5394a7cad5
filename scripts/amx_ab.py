"""Batch-1 decode with int4 on the AMX split (tiles from `ops.int4_amx_rows()` rows, FMAs in the tiles' order below:
the default where the CPU has AMX-BF16) against the FMA form (SIEVE_INT4_AMX=0), interleaved in one process (the
switch is read per call, so one engine serves both): speculation off and ngram at each depth k, each round measuring
every combination once, medians over rounds (docs/benchmarks.md, issue 15, nineteenth and twenty-second parts). Needs
a CPU with AMX-BF16.

    python scripts/amx_ab.py [rounds] [prompts] [k,k,...]
"""

from __future__ import annotations

import statistics
import sys
import time

from sieve import LLM, SamplingParams
from sieve.bench.spec import grounded_messages
from sieve.kernels import cpu_ops


def main() -> None:
    args = sys.argv[1:] + ["5", "4", "6"][len(sys.argv[1:]):]
    rounds, n, ks = int(args[0]), int(args[1]), [int(k) for k in args[2].split(",")]
    ops = cpu_ops()
    ops.set_int4_amx(True)  # fails closed where the CPU has no AMX
    engines = {"off": LLM(None, dtype="float32")}
    for k in ks:
        engines[f"ngram k={k}"] = LLM(None, dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": k})
    tok = engines["off"].get_tokenizer()
    prompts = [{"prompt_token_ids": tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]}
               for m in grounded_messages(n)]
    params = SamplingParams(max_tokens=128, temperature=0)
    times: dict[tuple[str, bool], list[float]] = {}
    tokens: dict[tuple[str, bool], list] = {}
    for r in range(rounds + 1):  # round 0 warms up
        for name, llm in engines.items():
            for amx in (False, True):
                ops.set_int4_amx(amx)
                t0, made, outs = time.perf_counter(), 0, []
                for p in prompts:  # batch 1: one request at a time
                    o = llm.generate([p], params, use_tqdm=False)[0].outputs[0]
                    made += len(o.token_ids)
                    outs.append(o.token_ids)
                if r:
                    times.setdefault((name, amx), []).append(made / (time.perf_counter() - t0))
                tokens[(name, amx)] = outs
    base = statistics.median(times[("off", False)])
    form = {False: "FMA form", True: f"AMX split ({ops.int4_amx_rows()})"}
    for (name, amx), v in times.items():
        same = tokens[(name, amx)] == tokens[("off", amx)]
        print(f"{name:12s} {form[amx]:16s}: {statistics.median(v):6.1f} tok/s (runs {', '.join(f'{x:.1f}' for x in v)})"
              f"  {statistics.median(v) / base:.2f}x off on the FMA form"
              + ("" if name == "off" else f", {statistics.median(v) / statistics.median(times[('off', amx)]):.2f}x off on the same form, "
                 + ("tokens identical" if same else "TOKENS DIFFER")))


if __name__ == "__main__":
    main()
