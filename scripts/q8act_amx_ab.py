"""Int8 activations with the AMX-INT8 tiles (the default where the CPU has them: calls of 10 rows and more) against
vpdpbusd alone, interleaved in one process (the inner kernel is read per call, so one engine serves both): 8 and 32
concurrent requests, speculation off and ngram k = 3, each round measuring every combination once, medians over rounds
(docs/benchmarks.md, issue 15, twentieth part). The two give the same bits, so the tokens must be identical.

    python scripts/q8act_amx_ab.py [rounds] [max_tokens]
"""

from __future__ import annotations

import statistics
import sys
import time

from sieve import LLM, SamplingParams
from sieve.bench.spec import grounded_messages
from sieve.kernels import cpu_ops


def main() -> None:
    rounds, max_tokens = (int(a) for a in (sys.argv[1:] + ["5", "64"][len(sys.argv[1:]):]))
    ops = cpu_ops()
    ops.set_q8act_kernel("amx-int8")  # fails closed where the CPU has no AMX-INT8
    kw = dict(dtype="float32", activation_quantization="int8")
    engines = {"off": LLM(None, **kw), "ngram k=3": LLM(None, speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **kw)}
    tok = engines["off"].get_tokenizer()
    prompts = [{"prompt_token_ids": tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]}
               for m in grounded_messages(32)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    times: dict[tuple, list[float]] = {}
    tokens: dict[tuple, list] = {}
    for r in range(rounds + 1):  # round 0 warms up
        for users in (8, 32):
            for name, llm in engines.items():
                for kernel in ("avx512-vnni", "amx-int8"):
                    ops.set_q8act_kernel(kernel)
                    t0 = time.perf_counter()
                    outs = [o.outputs[0].token_ids for o in llm.generate(prompts[:users], params, use_tqdm=False)]
                    if r:
                        times.setdefault((users, name, kernel), []).append(sum(map(len, outs)) / (time.perf_counter() - t0))
                    tokens[(users, name, kernel)] = outs
    for (users, name, kernel), v in times.items():
        base = statistics.median(times[(users, name, "avx512-vnni")])
        same = tokens[(users, name, kernel)] == tokens[(users, name, "avx512-vnni")] == tokens[(users, "off", "avx512-vnni")]
        print(f"{users:2d} users, {name:10s} {kernel:12s}: {statistics.median(v):6.1f} tok/s (runs {', '.join(f'{x:.1f}' for x in v)})"
              f"  {statistics.median(v) / base:.2f}x vpdpbusd alone, " + ("tokens identical" if same else "TOKENS DIFFER"), flush=True)


if __name__ == "__main__":
    main()
