"""Weight formats against bf16 where arithmetic binds (issue 63's CUDA figure: FP8 W8A8 through `_scaled_mm`, and int8
W8A8 through `torch._int_mm`): the prefill of `--prefill-prompts` prompts of `--prompt-len` tokens in one step, and
a decode step of `--decode-batch` sequences. It runs on a CPU alike (there fp8 is weight-only).

python scripts/quant_steps.py --model PATH [--device cuda] [--formats bf16,fp8,w8a8] [--prefill-prompts 8]
                              [--prompt-len 512] [--decode-batch 64] [--repeats 5] [--output-json F]

Each format loads in turn (bf16 first, the reference). Prefill: the prompts submitted together and stepped once
(the step computes them all: max_num_batched_tokens is their sum), `--repeats` times, the median step; decode: the
median step of the batch at `--prompt-len` tokens of context (scripts/decode_steps.py's measure). Each step returns
its tokens to the host, so the device is synchronised.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_steps import _release, median_decode_step  # noqa: E402


def prefill_step(llm, prompts: int, prompt_len: int, repeats: int) -> float:
    """Seconds of the median step that computes `prompts` prompts of `prompt_len` tokens at once."""
    from sieve import SamplingParams

    engine, times = llm.llm_engine, []
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    for r in range(repeats + 1):  # the first is a warm-up
        for i in range(prompts):
            engine.add_request(f"p{r}-{i}", {"prompt_token_ids": [5 + (7 * i + 13 * r + j) % 1000 for j in range(prompt_len)]},
                               params)
        t = time.perf_counter()
        engine.step()
        if r:
            times.append(time.perf_counter() - t)
        while engine.has_unfinished():
            engine.step()
    return statistics.median(times)


def main() -> None:
    from sieve import LLM

    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="auto")
    p.add_argument("--formats", default="bf16,fp8,w8a8")
    p.add_argument("--prefill-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output-json", default=None)
    a = p.parse_args()
    rows, device, kernels = {}, None, {}
    for fmt in a.formats.split(","):
        options = {} if fmt == "bf16" else {"quantization": fmt}
        llm = LLM(a.model, dtype="bfloat16", device=a.device, skip_tokenizer_init=True, enable_prefix_caching=False,
                  max_num_seqs=max(a.decode_batch, a.prefill_prompts), max_model_len=a.prompt_len + 64,
                  max_num_batched_tokens=max(a.prefill_prompts * a.prompt_len, a.decode_batch), **options)
        engine = llm.llm_engine
        device = str(engine.runner.device)
        kernels[fmt] = sorted({m.kernel_name() for m in engine.runner.model.modules() if hasattr(m, "kernel_name")})
        prefill = prefill_step(llm, a.prefill_prompts, a.prompt_len, a.repeats)
        decode = median_decode_step(llm, a.decode_batch, a.prompt_len, 32)
        rows[fmt] = {"prefill_step_ms": round(prefill * 1e3, 3),
                     "prefill_tokens_per_s": round(a.prefill_prompts * a.prompt_len / prefill, 1),
                     "decode_step_ms": round(decode * 1e3, 3), "decode_tokens_per_s": round(a.decode_batch / decode, 1)}
        del llm, engine
        _release(device)
    ref = rows.get("bf16")
    for fmt, r in rows.items():
        if ref is not None:
            r["prefill_ratio"] = round(r["prefill_tokens_per_s"] / ref["prefill_tokens_per_s"], 3)
            r["decode_ratio"] = round(r["decode_tokens_per_s"] / ref["decode_tokens_per_s"], 3)
        print(f"{fmt}: prefill {a.prefill_prompts} x {a.prompt_len} tokens {r['prefill_step_ms']:.2f} ms "
              f"({r.get('prefill_ratio', 1):.2f}x bf16); decode step at {a.decode_batch} sequences "
              f"{r['decode_step_ms']:.2f} ms ({r.get('decode_ratio', 1):.2f}x); kernels {kernels[fmt]}", flush=True)
    result = {"model": a.model, "device": device, "formats": rows, "kernels": kernels,
              "settings": {k: getattr(a, k) for k in ("prefill_prompts", "prompt_len", "decode_batch", "repeats")}}
    if device and device.startswith("cuda"):
        import torch

        result["device_name"] = torch.cuda.get_device_name()
    if a.output_json:
        Path(a.output_json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
