"""`sieve plan` reproduces public arithmetic from published configs (tests/fixtures/configs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sieve.plan.devices import get_device
from sieve.plan.roofline import Workload, decode_point, ladder, plan
from sieve.plan.shape import shape_from_config

CONFIGS = Path(__file__).parent / "fixtures" / "configs"


def shape(name: str):
    return shape_from_config(json.loads((CONFIGS / f"{name}.json").read_text()), name)


def test_7b_fp16_on_a100_is_about_7ms_a_token_and_about_2ms_in_int4():
    m, a100 = shape("llama-2-7b"), get_device("a100")
    assert m.total_params / 1e9 == pytest.approx(6.74, abs=0.01)
    fp16 = decode_point(m, a100, Workload(weights="fp16", kv="fp16", context=1), 1)
    int4 = decode_point(m, a100, Workload(weights="int4", kv="fp16", context=1), 1)
    assert fp16.step_ms == pytest.approx(7.0, rel=0.1) and fp16.bound == "bandwidth"  # 13.2 GB / 2.04 TB/s
    assert int4.step_ms == pytest.approx(2.0, abs=0.25)
    # INT4 with scales and zero points: a bit over a quarter of the FP16 linear bytes, plus the 16-bit head
    assert m.weight_bytes("int4") / m.weight_bytes("fp16") == pytest.approx(0.29, abs=0.02)


def test_h100_sxm_bf16_ridge_is_about_295_flop_per_byte():
    p = plan(shape("llama-2-7b"), get_device("h100-sxm"), Workload())
    assert p.ridge_flop_per_byte == pytest.approx(295, abs=1)


def test_qwen3_8b_kv_per_token_is_about_2_6x_qwen2_5_7b():
    q3, q25 = shape("qwen3-8b"), shape("qwen2.5-7b")
    assert q3.kv_bytes_per_token("bf16") == 2 * 36 * 8 * 128 * 2  # 147,456 B
    assert q25.kv_bytes_per_token("bf16") == 2 * 28 * 4 * 128 * 2  # 57,344 B
    assert q3.kv_bytes_per_token("bf16") / q25.kv_bytes_per_token("bf16") == pytest.approx(2.6, abs=0.05)
    assert q3.kv_bytes_per_token("fp8") * 2 == q3.kv_bytes_per_token("bf16")


def test_llama_3_1_70b_fp16_needs_about_140_gb_of_weights():
    m = shape("llama-3.1-70b")
    assert m.total_params / 1e9 == pytest.approx(70.6, abs=0.1)
    assert m.weight_bytes("fp16") / 1e9 == pytest.approx(141, abs=1.5)
    assert plan(m, get_device("h100"), Workload()).users_per_device == 0  # does not fit on one 80 GB device


@pytest.mark.parametrize("name, total_b, active_b", [("mixtral-8x7b", 46.7, 12.9), ("qwen1.5-moe-a2.7b", 14.3, 2.7),
                                                     ("deepseek-v2-lite", 15.7, 2.4)])
def test_moe_total_and_active_parameters(name, total_b, active_b):
    m = shape(name)
    assert m.is_moe
    assert m.total_params / 1e9 == pytest.approx(total_b, rel=0.03)
    # Model cards differ on whether "activated" counts the input embedding table (Qwen's A2.7B does,
    # DeepSeek's 2.4B does not): the published figure must match one of the two readings.
    readings = (m.active_params, m.active_params - m.embed_params)
    assert any(abs(r / 1e9 - active_b) / active_b < 0.05 for r in readings), [r / 1e9 for r in readings]
    # a batch touches more experts than one token: bytes per step grow towards the whole model
    assert m.step_weight_bytes("bf16", 1) < m.step_weight_bytes("bf16", 64) <= m.weight_bytes("bf16")


def test_mla_caches_the_latent():
    m = shape("deepseek-v2-lite")
    assert m.is_mla and m.kv_bytes_per_token("bf16") == 27 * (512 + 64) * 2  # 31,104 B, vs 27*2*16*128*2 for MHA


def test_a_shared_prefix_is_held_once():
    """Prefix caching keeps the tokens every sequence shares once: more sequences fit, as many as the unshared
    tail of each allows."""
    from dataclasses import replace

    from sieve.plan.roofline import kv_memory_bytes, sequences_that_fit

    m, h100 = shape("llama-2-7b"), get_device("h100")
    w = Workload(weights="bf16", kv="bf16", context=4096, output_tokens=512)
    shared = replace(w, shared_prefix_tokens=3072)
    alone, together = sequences_that_fit(m, h100, w), sequences_that_fit(m, h100, shared)
    free, prefix = kv_memory_bytes(m, h100, w), m.kv_bytes(3072, "bf16")
    assert together == int((free - prefix) // (m.kv_bytes(4096 + 512, "bf16") - prefix)) > 2 * alone
    assert sequences_that_fit(m, h100, replace(w, shared_prefix_tokens=10**6)) > 0  # never more than the context


def test_users_per_device_respects_slo_and_memory_and_ladder_climbs():
    m, h100 = shape("llama-2-7b"), get_device("h100")
    w = Workload(weights="bf16", kv="bf16", context=4096, output_tokens=512, slo_tpot_ms=50)
    p = plan(m, h100, w)
    assert 1 < p.users_per_device <= p.sequences_that_fit
    assert decode_point(m, h100, w, p.users_per_device).step_ms <= 50
    rungs = ladder(m, h100, w, spec_tokens=4, acceptance=0.7)
    assert [r.users for r in rungs][0] == 1
    assert all(b.users >= a.users for a, b in zip(rungs[1:], rungs[2:]))  # each change helps or holds
    assert rungs[-1].factor > rungs[1].factor > 1
    assert rungs[1].binding == "memory capacity"  # bf16 7B at 4k context: KV space runs out first


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "sieve.cli", "plan", *args], capture_output=True, text=True, timeout=300)


def test_cli_json_compare_ladder_and_plot(tmp_path):
    out = tmp_path / "roofline.png"
    r = run_cli("--model", str(CONFIGS / "qwen3-8b.json"), "--device", "h100", "--json", "--ladder",
                "--compare", str(CONFIGS / "qwen2.5-7b.json"), "--plot", str(out))
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    for key in ("weight_bytes", "kv_bytes_per_token", "decode_step_ms", "users_per_device"):
        assert key in j
    assert j["kv_bytes_per_token"] / j["compare"]["kv_bytes_per_token"] == pytest.approx(2.57, abs=0.01)
    assert len(j["ladder"]) == 6 and out.stat().st_size > 10_000
    text = run_cli("--model", str(CONFIGS / "qwen3-8b.json"), "--device", "l4", "--ladder")
    assert text.returncode == 0 and "users per device" in text.stdout and "INT4 weights" in text.stdout


def test_cli_bad_device_and_custom_spec():
    r = run_cli("--model", str(CONFIGS / "llama-2-7b.json"), "--device", "tpu-v9")
    assert r.returncode != 0 and "unknown device" in r.stderr
    spec = json.dumps({"name": "mine", "memory_gb": 48, "bandwidth_gbps": 1000, "tflops": {"bf16": 200}})
    r = run_cli("--model", str(CONFIGS / "llama-2-7b.json"), "--device-spec", spec, "--json", "--context", "1")
    j = json.loads(r.stdout)
    assert j["device"] == "mine" and j["decode_step_ms"] == pytest.approx(13.2, abs=0.2)  # 13.2 GB at 1 TB/s


def test_tensor_parallelism_splits_bytes_and_pays_for_its_all_reduces():
    """Llama-3.1-70B bf16 does not fit one H100; over 2 it fits barely, over 4 it serves many users. A step reads 1/N of
    the bytes per device, plus its all-reduces: 2 per layer of [batch, hidden] bf16 over NVLink 4 (450 GB/s each way)."""
    from dataclasses import replace

    from sieve.plan.roofline import comm_seconds

    m, h100 = shape("llama-3.1-70b"), get_device("h100")
    w = Workload(weights="bf16", kv="bf16", context=2048, output_tokens=512, slo_tpot_ms=50)
    users = {n: plan(m, h100, replace(w, tensor_parallel=n)).users_per_device for n in (1, 2, 4)}
    assert users[1] == 0 and 0 < users[2] < users[4]
    one, four = (decode_point(m, h100, replace(w, tensor_parallel=n), 1) for n in (1, 4))
    assert four.comm_ms > 0 and one.comm_ms == 0
    assert four.step_ms == pytest.approx(one.step_ms / 4 + four.comm_ms, rel=1e-6)
    per_all_reduce = 2 * 3 / 4 * 8192 * 2 / 450e9 + 10e-6  # one row, hidden 8192
    gather = 3 / 4 * 128256 * 4 / 450e9 + 10e-6
    assert comm_seconds(m, h100, 4, 1) == pytest.approx(2 * 80 * per_all_reduce + gather)
    with pytest.raises(ValueError, match="no device-to-device link"):
        decode_point(m, get_device("m3-max"), replace(w, tensor_parallel=2), 1)
    r = run_cli("--model", str(CONFIGS / "llama-3.1-70b.json"), "--device", "h100", "-tp", "4", "--context", "2048")
    assert r.returncode == 0 and "users per 4-device group" in r.stdout and "450 GB/s links" in r.stdout


def test_disaggregation_weighs_the_kv_transfer_against_the_prefill_it_moves():
    """A 2,000-token prompt of Llama-3.1-70B bf16 holds 80 layers x 8 KV heads x 128 x 2 x 2 bytes per token = 0.66 GB of
    KV: 26 ms over a 25 GB/s link, a fraction of its prefill on 4 H100s; over 10 GbE (1.25 GB/s) the transfer costs more
    than the prefill it takes off the decode devices."""
    from dataclasses import replace

    from sieve.plan.roofline import disaggregation, prefill_ms

    m, h100 = shape("llama-3.1-70b"), get_device("h100")
    w = Workload(weights="bf16", kv="bf16", context=2000, tensor_parallel=4)
    fast, slow = disaggregation(m, h100, w, 25), disaggregation(m, h100, w, 1.25)
    assert fast.kv_bytes == pytest.approx(2000 * 80 * 8 * 128 * 2 * 2)
    assert fast.transfer_ms == pytest.approx(fast.kv_bytes / 25e9 * 1e3)
    assert fast.prefill_ms == pytest.approx(prefill_ms(m, h100, w))
    assert fast.transfer_per_prefill < 0.5 < 2 < slow.transfer_per_prefill
    assert disaggregation(m, h100, replace(w, kv="fp8"), 25).transfer_ms == pytest.approx(fast.transfer_ms / 2)
    r = run_cli("--model", str(CONFIGS / "llama-3.1-70b.json"), "--device", "h100", "-tp", "4", "--context", "2000",
                "--pd-link-gbps", "25")
    assert r.returncode == 0 and "P/D pays" in r.stdout


def test_the_closed_loop_terms_against_hand_arithmetic():
    """The terms the roofline leaves out, on a toy device (1 TFLOP/s, 100 GB/s) and Llama-2-7B at 1,000 tokens of
    context and 100 out: 10 users each bringing 500 new prompt tokens a turn put 10 x 500 / 100 = 50 prefill rows in
    every step; the step is its bytes at the bandwidth plus its FLOPs at the peak times the measured compute scale,
    plus the fixed cost; the p99 TPOT is that over the tokens a step gives, times the measured spread."""
    from sieve.plan.devices import Device
    from sieve.plan.roofline import (Calibration, closed_loop_point, closed_loop_users, steady_prefill_rows, step_terms,
                                     tpot_p99_ms)

    m, dev = shape("llama-2-7b"), Device("toy", memory_gb=40, bandwidth_gbps=100, tflops={"bf16": 1.0})
    w = Workload(weights="bf16", kv="bf16", context=1000, output_tokens=100, slo_tpot_ms=400)
    cal = Calibration(fixed_ms=5.0, compute_scale=1.5, p99_over_mean=1.2, prefill_tokens_per_turn=500)
    assert steady_prefill_rows(w, cal, 10) == 50
    flops = 10 * m.flops_per_token(1000) + 50 * m.flops_per_token(500)
    bytes_ = m.step_weight_bytes("bf16", 10) + 10 * m.kv_bytes(1000, "bf16")
    assert step_terms(m, dev, w, 10, cal) == pytest.approx((1e3 * bytes_ / 100e9, 1e3 * flops / 1e12))
    p = closed_loop_point(m, dev, w, 10, cal)
    assert p.step_ms == pytest.approx(1e3 * (bytes_ / 100e9 + 1.5 * flops / 1e12) + 5.0) and p.bound == "compute"
    assert tpot_p99_ms(m, dev, w, 10, cal) == pytest.approx(p.step_ms * 1.2)
    # with speculation the turn takes fewer steps, so each carries more prompt rows
    spec = Workload(**{**w.__dict__, "spec_tokens": 3, "acceptance": 0.5})
    assert steady_prefill_rows(spec, cal, 10) == pytest.approx(10 * 500 / (100 / (1 + 0.5 + 0.25 + 0.125)))
    users, binding = closed_loop_users(m, dev, w, cal)
    assert tpot_p99_ms(m, dev, w, users, cal) <= 400 < tpot_p99_ms(m, dev, w, users + 1, cal) and binding == "compute"
    assert closed_loop_users(m, dev, w, Calibration())[0] > users  # each term costs users


def test_a_paced_running_batch_and_its_queue_against_hand_arithmetic():
    """A paced server holds its running batch B where the mean TPOT stays within its step share (0.9 of a 400 ms
    objective here: 360 ms); the users beyond B wait in a FIFO queue that moves up one place every turn / B (a turn:
    100 tokens at B's TPOT), so q queued turns wait q x turn / B on average, and 2x that at p99 (the calibrated
    factor); users = B + the most q whose p99 wait plus one step fits the 20 s TTFT objective."""
    import dataclasses

    from sieve.plan.devices import Device
    from sieve.plan.roofline import (Calibration, closed_loop_point, closed_loop_users, queued_users, running_capacity,
                                     tpot_ms, turn_ms)

    m, dev = shape("llama-2-7b"), Device("toy", memory_gb=40, bandwidth_gbps=100, tflops={"bf16": 1.0})
    w = Workload(weights="bf16", kv="bf16", context=1000, output_tokens=100, slo_tpot_ms=400, slo_ttft_ms=20000)
    cal = Calibration(fixed_ms=5.0, compute_scale=1.5, p99_over_mean=1.05, prefill_tokens_per_turn=50, step_share=0.9,
                      queue_p99_over_mean=2.0)
    b, binding = running_capacity(m, dev, w, cal)
    mean_tpot = lambda n: tpot_ms(closed_loop_point(m, dev, w, n, cal), w)  # noqa: E731
    assert mean_tpot(b) <= 360 < mean_tpot(b + 1) and binding == "compute"
    assert turn_ms(m, dev, w, b, cal) == pytest.approx(100 * mean_tpot(b))
    q = queued_users(m, dev, w, b, cal)
    per_queued = 2.0 * 100 * mean_tpot(b) / b
    step = closed_loop_point(m, dev, w, b, cal).step_ms
    assert q == int((20000 - step) // per_queued) and q >= 1
    assert closed_loop_users(m, dev, w, cal) == (b + q, f"compute, {q} more waiting within TTFT")
    # no queue counted (factor 0), or no room in the TTFT objective: the running batch alone
    assert closed_loop_users(m, dev, w, dataclasses.replace(cal, queue_p99_over_mean=0.0))[0] == b
    tight = Workload(**{**w.__dict__, "slo_ttft_ms": step})
    assert queued_users(m, dev, tight, b, cal) == 0


def test_the_ladder_calibrates_the_terms_from_its_own_probes():
    """Probes made by a known closed loop (fixed 4 ms, FLOPs at 1/2.5 of the peak, p99 1.3 x p50, half of each
    600-token prompt cached) give those terms back; the share of the objective its steps reached where a queue
    formed is the median of those probes' TPOT over the objective (probes without a queue do not count)."""
    from sieve.bench.ladder import calibration, running_batch
    from sieve.plan.devices import Device
    from sieve.plan.roofline import MEMORY_UTILIZATION, Calibration, closed_loop_point, sequences_that_fit

    m, dev = shape("llama-2-7b"), Device("toy", memory_gb=40, bandwidth_gbps=100, tflops={"bf16": 1.0})
    w = Workload(weights="bf16", kv="bf16", context=700, output_tokens=100, slo_tpot_ms=4000)
    truth = Calibration(fixed_ms=4.0, compute_scale=2.5, p99_over_mean=1.3, prefill_tokens_per_turn=300)
    probes, steps = [], {}
    for running, queued in ((4, 0), (9, 3), (6, 2), (10, 4)):  # users = the running batch + those waiting in the queue
        t = steps[running] = closed_loop_point(m, dev, w, running, truth).step_ms
        wait = queued * 100 * t / running  # the FIFO queue's mean wait: queued x a turn (100 tokens) / running
        probes.append({"users": running + queued, "requests": 50, "tpot_p50_ms": t, "tpot_p99_ms": 1.3 * t,
                       "mean_prompt_tokens": 600, "prefix_cache_hit_rate": 0.5, "mean_output_tokens": 100,
                       "output_tokens_per_s": running / (t / 1e3), "ttft_p99_ms": 2.5 * wait if queued else 50.0})
    got = calibration(m, dev, w, probes, step_share=0.95)
    assert got.fixed_ms == pytest.approx(4.0) and got.compute_scale == pytest.approx(2.5)
    assert got.p99_over_mean == pytest.approx(1.3) and got.prefill_tokens_per_turn == pytest.approx(300)
    assert got.queue_p99_over_mean == pytest.approx(2.5)
    assert steps[6] < steps[9] < steps[10] < 0.95 * 4000
    assert got.step_share == pytest.approx(steps[9] / 4000)  # the median of 6, 9 and 10 running: 9's
    assert calibration(m, dev, w, probes, step_share=0.1).step_share == 0.1  # never past what the pacer aims at
    # no probe with a queue: the pacer's own share
    assert calibration(m, dev, w, probes[:1], step_share=0.9).step_share == 0.9
    # a pool that holds 10 sequences held the probes running 9 and 10, not the pacer: 6's alone
    per_seq = m.kv_bytes(w.context + w.output_tokens, "bf16")
    small = Device("toy", memory_gb=(m.weight_bytes("bf16") + 10.5 * per_seq) / MEMORY_UTILIZATION / 1e9,
                   bandwidth_gbps=100, tflops={"bf16": 1.0})
    assert sequences_that_fit(m, small, w) == 10
    assert calibration(m, small, w, probes, step_share=0.95).step_share == pytest.approx(steps[6] / 4000)
    # without a throughput figure a probe's users all count as running (the fit then sees other batches)
    assert running_batch({"users": 7, "tpot_p50_ms": 50.0}) == 7.0
    assert running_batch({"users": 7, "tpot_p50_ms": 50.0, "output_tokens_per_s": 100.0}) == 5.0


def test_the_step_fit_never_returns_a_negative_cost():
    """(running batch, bytes' ms, FLOPs' ms, measured ms): measured - bytes = fixed + scale x FLOPs."""
    from sieve.bench.ladder import fit_step

    assert fit_step([(2, 3.0, 10.0, 28.0), (4, 4.0, 20.0, 49.0), (8, 6.0, 30.0, 71.0)]) == pytest.approx((5.0, 2.0))
    # intercept < 0: through the origin, the FLOPs carry all the step past its bytes
    assert fit_step([(2, 0.0, 10.0, 5.0), (4, 0.0, 20.0, 35.0)]) == pytest.approx((0.0, 40.0 / 30.0))
    # decreasing (noise): through the origin too
    assert fit_step([(2, 0.0, 10.0, 30.0), (4, 0.0, 20.0, 20.0)]) == pytest.approx((0.0, 50.0 / 30.0))
    # running batches within a factor of 2 cannot tell a fixed cost from arithmetic: through the origin
    assert fit_step([(30, 10.0, 20.0, 60.0), (33, 11.0, 22.0, 69.0)]) == pytest.approx((0.0, 108.0 / 42.0))
    assert fit_step([(1, 5.0, 10.0, 30.0)]) == pytest.approx((0.0, 2.5))


def test_w8a8_reads_int8_bytes_and_multiplies_at_the_int8_rate():
    """W8A8 moves the bytes of int8 weights; where a step is bound by arithmetic (a long prefill) it runs at the
    device's int8 rate (twice bf16 on an H100), and a device without int8 figures computes it at its 16-bit rate."""
    from sieve.plan.devices import Device
    from sieve.plan.roofline import prefill_ms
    from sieve.plan.shape import WEIGHT_FORMATS

    m, h100 = shape("llama-2-7b"), get_device("h100-sxm")
    int8, w8a8 = Workload(weights="int8", kv="bf16", context=4096), Workload(weights="w8a8", kv="bf16", context=4096)
    assert m.weight_bytes("w8a8") == m.weight_bytes("int8") < m.weight_bytes("bf16")
    assert decode_point(m, h100, w8a8, 1).step_ms == pytest.approx(decode_point(m, h100, int8, 1).step_ms)
    assert prefill_ms(m, h100, w8a8) == pytest.approx(prefill_ms(m, h100, int8) / 2, rel=0.05)
    bf16_only = Device("cpu-like", 64, 100, {"bf16": 2.0})
    assert prefill_ms(m, bf16_only, w8a8) == pytest.approx(prefill_ms(m, bf16_only, int8))
    assert "w8a8" in WEIGHT_FORMATS  # `sieve plan --weights w8a8`
