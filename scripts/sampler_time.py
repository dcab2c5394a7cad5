"""Top-p sampling's cost on a real model's logits: the sampler's distribution (temperature, top-p) for a batch of rows,
against the sort of every row's whole vocabulary it replaced, and how many tokens the two kept sets differ in.

python scripts/sampler_time.py [--model PATH] [--rows 32] [--settings 0.7:0.9,0.8:0.95,1.0:0.95,1.0:0.99]
python scripts/sampler_time.py --generate [--model PATH]

The rows are the default model's logits at the last positions of a TinyStories passage (../shared/data). With
--generate: output tokens/s of 64 requests of 64 tokens, 32 at once, sampled (temperature 0.8, top-p 0.95) and greedy
(median of 3).
"""

from __future__ import annotations

import argparse
import statistics
import time


def timed(fn, repeats: int) -> tuple[float, object]:
    fn()
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def generate(llm) -> None:
    from sieve import SamplingParams

    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode(f"Write a short story about the number {i}.")} for i in range(64)]
    for name, params in (("sampled, temperature 0.8 top-p 0.95", SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64,
                                                                                ignore_eos=True)),
                         ("greedy", SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))):
        llm.generate(prompts[:32], params)
        rates = []
        for _ in range(3):
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
        print(f"{name}: 64 requests of 64 tokens, 32 at once: {statistics.median(rates):.0f} output tokens/s "
              f"(runs: {', '.join(f'{r:.0f}' for r in rates)})")


def main() -> None:
    import torch

    from sieve import LLM
    from sieve.data import shared_data
    from sieve.models.default import default_model_path
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--settings", default="0.7:0.9,0.8:0.95,1.0:0.95,1.0:0.99", help="temperature:top_p, comma-separated")
    p.add_argument("--generate", action="store_true", help="whole generations instead: sampled against greedy")
    a = p.parse_args()
    llm = LLM(a.model or str(default_model_path()), max_num_seqs=32)
    if a.generate:  # (imports nothing the sampler before these changes lacked: it runs on an older checkout too)
        generate(llm)
        return
    from sieve.sampler import SamplingMetadata, nucleus_by_full_sort, target_probs

    text = (shared_data() / "tinystories_valid_sample.txt").read_text()[:4000]
    ids = llm.get_tokenizer().encode(text)[: a.rows + 224]
    logits = llm.llm_engine.score(ids)[-a.rows:]
    B, V = logits.shape
    for setting in a.settings.split(","):
        temperature, top_p = (float(x) for x in setting.split(":"))
        m = SamplingMetadata(temperature=torch.full((B,), temperature), greedy=torch.zeros(B, dtype=torch.bool), top_k=None,
                             top_p=torch.full((B,), top_p), min_p=None, presence=None, frequency=None, repetition=None,
                             output_ids=None, prompt_ids=None, banned=[[] for _ in range(B)], bias=None, seeds=[None] * B,
                             num_logprobs=-1)
        fast, probs = timed(lambda: target_probs(logits, m), 7)
        full, ref = timed(lambda: nucleus_by_full_sort(logits / temperature, torch.full((B,), V), m.top_p).softmax(-1), 3)
        print(f"temperature {temperature} top_p {top_p}, {B} rows of {V}: {fast * 1e3:.1f} ms against the full sort's "
              f"{full * 1e3:.1f} ms ({full / fast:.1f}x); the kept sets differ in {int(((probs > 0) != (ref > 0)).sum())} tokens")


if __name__ == "__main__":
    main()
