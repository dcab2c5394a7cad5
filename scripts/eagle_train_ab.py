"""A/B of EAGLE training settings on one fixed split (issue 15, seventeenth part of docs/benchmarks.md).

The 1,600 mixed prompts of `sieve distill --prompt-source mixed`, their answers read from --answers, held out by family
as `sieve distill` does; features extracted once for --train answers and every other held-out answer (kept in
--features for the next run), then each variant trained from the same seed for --epochs, printing held-out accuracy
per epoch. A variant is JSON: {"loss": "hard"|"soft", "reg": feature-loss weight, "lr": ..., "bt": batch tokens,
"pack": answers a padded pass holds, in positions (--pack-tokens; 0: one answer a pass)}.

    python scripts/eagle_train_ab.py --answers bench-out/smollm2-answers-mixed1600.json --train 400 --epochs 3 \
        --variants '{"loss":"hard"};{"loss":"soft"};{"loss":"soft","reg":0.1}'
"""

import argparse
import json
import os
import random
import time

import torch

from sieve.llm import LLM
from sieve.spec import distill as D

ap = argparse.ArgumentParser()
ap.add_argument("--answers", required=True)
ap.add_argument("--prompts", type=int, default=1600)
ap.add_argument("--train", type=int, default=400)
ap.add_argument("--epochs", type=int, default=3)
ap.add_argument("--variants", required=True)
ap.add_argument("--features", default="/tmp/eagle-ab-features.pt")
a = ap.parse_args()

llm = LLM(None, max_num_seqs=64, kv_cache_memory_gb=1.0, seed=0)
eng = llm.llm_engine
t = time.perf_counter()
messages = D.prompt_messages(llm, "mixed", a.prompts, 0)
seqs, kept = D.answers(llm, messages, argparse.Namespace(max_tokens=192, temperature=0.0, seed=0, prompt_source="mixed",
                                                         answers=a.answers))
families = [D.prompt_family(messages[i][0]["content"]) for i in kept]
held_idx, train_idx, how = D.held_out_split(families, 0.1, 0, "family")
random.Random(0).shuffle(train_idx)
if os.path.exists(a.features):
    held, train = torch.load(a.features)
else:
    held = D.eagle_examples(eng, [seqs[i] for i in held_idx[::2]])
    train = D.eagle_examples(eng, [seqs[i] for i in train_idx[: a.train]])
    torch.save((held, train), a.features)
print(f"{len(train)} answers trained ({sum(len(s[0]) - 1 for s in train)} positions), {len(held)} held out by {how}; "
      f"{time.perf_counter() - t:.0f} s", flush=True)
for v in a.variants.split(";"):
    kw = json.loads(v)
    t0 = time.perf_counter()
    layer, hist, _ = D.train_eagle(eng, train, held, 3, 4096, a.epochs, kw.get("lr", 1e-3), kw.get("bt", 256), 0,
                                   kw.get("loss", "hard"), kw.get("reg", D.REG_WEIGHT), kw.get("pack", 0))
    print("VARIANT", v, f"{time.perf_counter() - t0:.0f}s", "token 1 per epoch", [round(h["head_accuracy"][0], 3) for h in hist],
          "final", [round(x, 3) for x in hist[-1]["head_accuracy"]], hist[-1]["simulated_mean_acceptance_length"], flush=True)
