"""transformers in float32 as the reference for greedy answers, and the rule that keeps a test off near-ties.

A greedy token is decided by its margin over the runner-up. sieve's paths agree with the reference within a
tolerance, not bit for bit: 1e-3 in logprob for the float32 parity tests, about 1e-2 for the default path, whose
kernels round their inputs to bf16 on CPUs that have bf16 instructions. A position whose reference margin is inside
that tolerance may go either way, and which way depends on the CPU. On a Zen 4 host the default model answered
"La femme de France" where the reference's "The" led "La" by 0.002. So every test here follows two rules:

- Parity (sieve against transformers token by token) compares tokens up to the first position whose reference
  top-2 margin is below twice the logprob tolerance (each of the two logprobs may move by the tolerance). At that
  position sieve may take either of the near-tied tokens; logprobs are compared up to and including it, since the
  context is still the same. A comparison that near-ties cut short of most tokens fails: it would test little.
- A test that asserts a decision of a real model (a word in its greedy answer, which continuation scores best) first
  checks on the reference that the decision is clear: that it leads by CLEAR times the tolerance of the path under
  test (0.05 for float32 paths, 0.5 for the default path).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

TOL = 1e-3  # logprob tolerance of the float32 parity tests
DEFAULT_PATH_TOL = 1e-2  # the default path (Q4_1 kernels, inputs rounded to bf16): 0.007 from the reference on Zen 4
CLEAR = 50  # an asserted decision leads by this many tolerances on the reference
# A question the default model (SmolLM2-135M-Instruct) answers "The capital of France is Paris." on the reference with
# every token 1.2 nats or more ahead, with or without the system prompt "You are a concise assistant." (without this
# question's first three words its first token "The" led "L" by 0.08, and "La" by 0.002 under that system prompt).
CAPITAL_QUESTION = "In one sentence: what is the capital of France?"


def reference_model(path):
    """transformers' float32 model of a checkpoint folder or a GGUF file (its own GGUF loader). The last two are kept
    for the session, keyed by the file's time as well: SmolLM2's file takes 14 s to load, and several tests ask it."""
    p = Path(path)
    return _load(str(p), (p if p.suffix == ".gguf" else p / "config.json").stat().st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _load(path: str, stamp: int):
    from transformers import AutoModelForCausalLM

    p = Path(path)
    if p.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32).eval()


def greedy_reference(path, prompt_ids: list[list[int]], n: int, model=None) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The reference's own greedy generation, one prompt at a time: its tokens, and each step's log-softmax. `model`:
    another reference than the checkpoint's own (a PEFT model over it)."""
    model = model if model is not None else reference_model(str(path))
    tokens, logprobs = [], []
    for ids in prompt_ids:
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        tokens.append(out.sequences[0, len(ids):].tolist())
        logprobs.append(torch.stack([torch.log_softmax(step[0].float(), -1) for step in out.logits]))
    return tokens, logprobs


def top2_margins(logprobs: torch.Tensor) -> torch.Tensor:
    """[steps, vocab] logprobs -> [steps]: how far each step's best token leads the second."""
    top = logprobs.float().topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def comparable_steps(ref_logprobs: torch.Tensor, tol: float = TOL) -> int:
    """How many leading greedy tokens a parity test may compare: up to the first near-tie (margin under 2 * tol)."""
    near = (top2_margins(ref_logprobs) < 2 * tol).nonzero()
    return int(near[0, 0]) if len(near) else len(ref_logprobs)


def assert_logprobs_close(step_logprobs, ref_logprobs: torch.Tensor, what: str, tol: float = TOL) -> None:
    """sieve's logprobs entries ({token: Logprob} per step) against the reference's rows, step for step."""
    for step, lp in enumerate(step_logprobs):
        for token_id, entry in lp.items():
            assert entry.logprob == pytest.approx(ref_logprobs[step, token_id].item(), abs=tol), f"{what}: step {step}"


def assert_matches(outs, ref_tokens, ref_logprobs, what: str, tol: float = TOL) -> None:
    """sieve's greedy outputs against the reference's own greedy generation: identical tokens up to the reference's
    first near-tie, logprobs within `tol` up to and including it."""
    compared = total = 0
    for out, ref, ref_lp in zip(outs, ref_tokens, ref_logprobs, strict=True):
        got = out.outputs[0].token_ids
        k = comparable_steps(ref_lp, tol)
        assert got[:k] == ref[:k], f"{what}: greedy tokens differ from transformers before its first near-tie (step {k})"
        if k < len(ref):  # a near-tie: either of the tied tokens is right
            assert ref_lp[k].max() - ref_lp[k, got[k]] < 2 * tol, f"{what}: step {k} took a token outside the near-tie"
        assert_logprobs_close(out.outputs[0].logprobs[: k + 1], ref_lp, what, tol)
        compared, total = compared + min(k + 1, len(ref)), total + len(ref)
    assert compared >= total / 2, f"{what}: near-ties left {compared} of {total} tokens to compare; choose other prompts"


def assert_matches_forward_pass(path, prompts: list[list[int]], outs, tol: float = TOL, model=None) -> None:
    """transformers' forward pass over each prompt and sieve's own tokens, as reference (its `generate` on GGUF models
    gave other logprobs than its own forward pass). Fed sieve's tokens, every position stays comparable: sieve's token
    must be the reference's argmax, or within the near-tie of it, and logprobs within `tol` at every step. `model`:
    another reference than the checkpoint's own (a PEFT model over it)."""
    model = model if model is not None else reference_model(str(path))
    for ids, out in zip(prompts, outs, strict=True):
        got = out.outputs[0].token_ids
        with torch.no_grad():
            ref_lp = torch.log_softmax(model(torch.tensor([ids + got])).logits[0, len(ids) - 1 : -1].float(), -1)
        behind = ref_lp.max(-1).values - ref_lp.gather(1, torch.tensor(got)[:, None])[:, 0]
        assert (behind < 2 * tol).all(), f"sieve's tokens trail the reference's best by {behind.max().item():.4f}"
        assert (top2_margins(ref_lp) >= 2 * tol).float().mean() >= 0.5, "mostly near-ties: choose other prompts"
        assert_logprobs_close(out.outputs[0].logprobs, ref_lp, str(path), tol)


def chat_ids(tokenizer, question: str, system: str | None = None) -> list[int]:
    """A one-turn chat prompt as the server's chat template encodes it."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]


def clear_greedy_answer(path, prompt_ids: list[int], tokenizer, word: str, tol: float = DEFAULT_PATH_TOL,
                        max_tokens: int = 40) -> str:
    """The reference's greedy answer to `prompt_ids`, up to the token that completes `word`. Asserts that the word
    comes and that every token up to it leads its runner-up by CLEAR * tol, so that an answer asserted to contain
    the word does not ride a near-tie on any CPU. Returns the text."""
    model, ids, margins = reference_model(str(path)), list(prompt_ids), []
    with torch.no_grad():
        for _ in range(max_tokens):
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            top = lp.topk(2)
            ids.append(int(top.indices[0]))
            margins.append(round(float(top.values[0] - top.values[1]), 3))
            text = tokenizer.decode(ids[len(prompt_ids):])
            if word in text:
                break
    assert word in text, f"the reference does not answer {word!r}: {text!r}"
    assert min(margins) >= CLEAR * tol, f"the reference's answer {text!r} rides a near-tie (margins {margins})"
    return text
