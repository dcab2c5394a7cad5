"""`sieve distill --kv fp8`: KV-aware distillation lowers the FP8-KV-cache KL against the unquantized model on
held-out text (stories260K, a tiny trained model), and its checkpoint carries the scales it trained with."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from tests.conftest import SHARED

STORIES = SHARED / "models" / "stories260K"


def test_fake_fp8_rounds_like_the_cache_and_passes_gradients():
    from sieve.train.kv_distill import fake_fp8

    x = torch.randn(64, requires_grad=True)
    scale = torch.tensor(0.01)
    y = fake_fp8(x, scale)
    want = (x.detach() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    assert torch.equal(y.detach(), want) and not torch.equal(y.detach(), x.detach())
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones(64))  # straight through the rounding


def test_a_padded_batch_gives_each_sequences_own_loss_and_gradients():
    """Training takes a batch of sequences of different lengths in one pass, padded on the right: its loss and
    gradients are those of one sequence at a time (padding on the left would change both)."""
    import random

    from sieve.train.kv_distill import set_kv_mode, batch_kl_loss, calibrate_scales, kl_loss, load_hf_model

    teacher, student = load_hf_model(str(STORIES), torch.float32).eval(), load_hf_model(str(STORIES), torch.float32)
    rng = random.Random(0)
    batch = [[rng.randrange(1, 500) for _ in range(n)] for n in (150, 37, 96, 120)]
    set_kv_mode(student, calibrate_scales(student, batch))
    set_kv_mode(teacher, None)
    batch_kl_loss(teacher, student, batch).backward()
    padded = {n: p.grad.clone() for n, p in student.named_parameters()}
    loss_padded = batch_kl_loss(teacher, student, batch).item()
    student.zero_grad()
    loss = 0.0
    for ids in batch:
        x = torch.tensor([ids])
        one = kl_loss(teacher(x).logits[0].detach(), student(x).logits[0]) / len(batch)
        one.backward()
        loss += one.item()
    assert loss_padded == pytest.approx(loss, rel=1e-5) and loss > 1e-3
    for n, p in student.named_parameters():
        torch.testing.assert_close(padded[n], p.grad, rtol=1e-4, atol=1e-7, msg=n)


def test_distill_kv_fp8_lowers_kl_on_held_out_text(tmp_path):
    out = tmp_path / "distilled"
    cmd = [sys.executable, "-m", "sieve.cli", "distill", "--kv", "fp8", "--target", str(STORIES), "--out", str(out),
           "--data", str(SHARED / "data" / "tinystories_valid_sample.txt"), "--prompts", "128", "--max-tokens", "96",
           "--steps", "100", "--kv-lr", "1e-4", "--kv-batch", "8", "--eval-windows", "8", "--kv-cache-memory-gb", "0.25",
           "--output-json", str(tmp_path / "r.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "r.json").read_text())
    before, after = r["before"], r["after"]
    assert before["kl_divergence"] > 0.005  # an FP8 KV cache costs this model something measurable
    assert after["kl_divergence"] < 0.97 * before["kl_divergence"], r
    assert after["tokens_scored"] == before["tokens_scored"] > 1000
    assert r["last_loss"] < r["first_loss"]
    # the checkpoint carries per-layer K/V scales, which the engine then uses instead of calibrating
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    layers = json.loads((out / "config.json").read_text())["num_hidden_layers"]
    assert {f"model.layers.{i}.self_attn.{k}_scale" for i in range(layers) for k in "kv"} <= names
    from sieve.llm import LLM
    from sieve.sampling_params import SamplingParams

    llm = LLM(str(out), dtype="float32", kv_cache_dtype="fp8", kv_cache_memory_gb=0.05)
    runner = llm.llm_engine.runner
    assert not runner.kv_needs_calibration
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert runner.caches[0].k_scale.item() == pytest.approx(f.get_tensor("model.layers.0.self_attn.k_scale").item())
    text = llm.generate("Once upon a time", SamplingParams(max_tokens=16, temperature=0))[0].outputs[0].text
    assert len(text) > 0


def test_distill_kv_bad_input(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sieve.cli", "distill", "--kv", "fp8", "--target", str(STORIES), "--out",
                           str(tmp_path / "o"), "--data", str(tmp_path / "missing.txt")], capture_output=True, text=True)
    assert proc.returncode == 2 and "missing.txt" in proc.stderr and "Traceback" not in proc.stderr
