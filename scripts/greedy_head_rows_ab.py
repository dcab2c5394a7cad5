"""The Q8_0 greedy head at any row count against the head capped at 8 rows (steps of more rows then compute every
logit, as before issue 15's twenty-first part), in one process: engines of 8 and 32 users, speculation off and ngram
k = 1, the two alternated round by round, medians and paired ratios (docs/benchmarks.md).

    python scripts/greedy_head_rows_ab.py [rounds]
"""

from __future__ import annotations

import statistics
import sys
import time

from sieve import LLM, SamplingParams
from sieve.bench.spec import grounded_messages
from sieve.layers.greedy_head import GreedyHeadQ8

orig = GreedyHeadQ8.__call__
cap = {"on": False}


def capped(self, hidden):
    if cap["on"] and hidden.shape[0] > 8:
        return None  # the caller computes the logits
    return orig(self, hidden)


def main() -> None:
    GreedyHeadQ8.__call__ = capped
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    engines = {"off": LLM(None, dtype="float32"), "ngram k=1": LLM(None, dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 1})}
    tok = engines["off"].get_tokenizer()
    msgs = grounded_messages(32)
    prompts = [{"prompt_token_ids": tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]} for m in msgs]
    params = SamplingParams(max_tokens=64, temperature=0)
    res, toks = {}, {}
    for r in range(rounds + 1):
        for users in (8, 32):
            for name, llm in engines.items():
                for c in (True, False):
                    cap["on"] = c
                    t0 = time.perf_counter()
                    outs = llm.generate(prompts[:users], params, use_tqdm=False)
                    dt = time.perf_counter() - t0
                    made = sum(len(o.outputs[0].token_ids) for o in outs)
                    if r:
                        res.setdefault((users, name, c), []).append(made / dt)
                    toks[(users, name, c)] = [o.outputs[0].token_ids for o in outs]
    for users in (8, 32):
        for name in engines:
            a, b = res[(users, name, True)], res[(users, name, False)]
            paired = statistics.median(y / x for x, y in zip(a, b))
            same = toks[(users, name, True)] == toks[(users, name, False)] == toks[(users, "off", False)]
            print(f"{users} users {name:10s}: capped at 8 rows {statistics.median(a):6.1f} tok/s, any rows {statistics.median(b):6.1f} tok/s "
                  f"({statistics.median(b) / statistics.median(a):.3f}x, paired {paired:.3f}x; rounds {', '.join(f'{y / x:.2f}' for x, y in zip(a, b))})"
                  f"  tokens {'identical' if same else 'DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
