"""Tensor parallelism on torch.distributed (gloo): the model split over 2 processes on this CPU gives the output of the
unsplit model, float32, for every dense family, through everything that moves K/V (chunked prefill, prefix caching,
preemption, forked choices), with quantized weights (sharded GGUF codes, int4 quantized after sharding), with LoRA
adapters sharded as the weights are, and when launched by torchrun; bad splits are refused before any process starts,
and a dead rank fails the step instead of hanging it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sieve import LLM, SamplingParams
from sieve.config import ConfigError

PROMPTS = ["Hello there, how are you", "The quick brown fox jumps over", "Once upon a time in a land far away",
           "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30"]


def _run(llm: LLM, prompts=PROMPTS, **params):
    params.setdefault("max_tokens", 20)
    params.setdefault("temperature", 0.0)
    return llm.generate(prompts, SamplingParams(**params))


def _assert_same(a, b, logprob_tol=1e-4):
    for x, y in zip(a, b):
        assert len(x.outputs) == len(y.outputs)
        for cx, cy in zip(x.outputs, y.outputs):
            assert cx.token_ids == cy.token_ids
            if cx.logprobs is not None:
                for dx, dy in zip(cx.logprobs, cy.logprobs):
                    for t, lp in dx.items():
                        assert abs(lp.logprob - dy[t].logprob) < logprob_tol


@pytest.fixture
def tp_pair():
    """(unsplit LLM, 2-rank LLM) on a checkpoint, same options; the workers are stopped afterwards."""
    made = []

    def make(path, **kwargs):
        kwargs.setdefault("num_gpu_blocks_override", 256)
        kwargs.setdefault("dtype", "float32")
        one = LLM(str(path), device="cpu", **kwargs)
        two = LLM(str(path), device="cpu", tensor_parallel_size=2, **kwargs)
        made.append(two)
        return one, two

    yield make
    for llm in made:
        llm.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_two_ranks_give_the_unsplit_output(checkpoints, tp_pair, arch):
    """llama: untied head, GQA; qwen2: q/k/v biases (column-split) and a tied head (its rows split off the embedding);
    qwen3: q/k norms and a head size unlike hidden / heads."""
    one, two = tp_pair(checkpoints[arch])
    assert two.llm_engine.runner.model.lm_head.out_features == one.llm_engine.arch.vocab_size // 2
    assert two.llm_engine.runner.kv_pool.shape[-2] == one.llm_engine.runner.kv_pool.shape[-2] // 2  # half the KV heads
    _assert_same(_run(one, logprobs=3), _run(two, logprobs=3))


def test_chunks_prefix_cache_preemption_and_forks(checkpoints, tp_pair):
    """Chunked prefill (16-token budget), a tiny pool (preemption), a repeated prompt (prefix-cache hit) and n = 2
    (forked blocks copied on every rank), seeded sampling: the same tokens as unsplit under the same pressure."""
    one, two = tp_pair(checkpoints["llama"], num_gpu_blocks_override=24, block_size=4, max_num_batched_tokens=16,
                       max_num_seqs=4)
    _assert_same(*[_run(llm, max_tokens=24) for llm in (one, two)])
    for _ in range(2):  # the second time, the prompt's blocks are in the prefix cache
        again = [_run(llm, PROMPTS[3:], max_tokens=24) for llm in (one, two)]
        _assert_same(*again)
    assert again[1][0].num_cached_tokens >= 16
    seeded = [_run(llm, PROMPTS[:2], max_tokens=12, temperature=0.9, seed=7, n=2) for llm in (one, two)]
    _assert_same(*seeded)
    assert any(a.outputs[0].token_ids != a.outputs[1].token_ids for a in seeded[0])  # the forks really differ


def test_quantized_weights_shard(tmp_path, demo_dir, tp_pair):
    """A GGUF file's Q8_0 codes are cut, not widened (every rank's linears stay Q8_0), and int4 quantized after
    sharding on group boundaries equals int4 unsplit: the same greedy tokens."""
    from sieve.bench.gguf_export import export_gguf

    path = _checkpoint(tmp_path / "ckpt", demo_dir, intermediate_size=192)
    gguf = export_gguf(path, tmp_path / "model-q8_0.gguf", "q8_0", log=lambda *a: None)
    one, two = tp_pair(gguf)
    kinds = {m.kernel_name() for m in two.llm_engine.runner.model.modules() if hasattr(m, "kernel_name")}
    assert kinds and all("int8 g32" in k or "q8_0" in k.lower() for k in kinds), kinds
    _assert_same(_run(one), _run(two), logprob_tol=1e-3)
    one, two = tp_pair(path, quantization="int4", quantization_group_size=32)
    _assert_same(_run(one), _run(two), logprob_tol=1e-3)


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_lora_adapters_split_with_the_model(tmp_path, demo_dir, tp_pair, quantization):
    """Three PEFT adapters (every target module; attention only with rsLoRA; the head, the embeddings and down_proj)
    and the base model in the same steps: on two ranks, each rank's shard of each adapter (B's rows where the weight's
    rows split, the vocabulary-parallel head's included; A's columns where its columns do) gives the unsplit engine's tokens and logprobs. With max_cpu_loras 2 the ranks drop one adapter and
    are sent it again. Over int4 weights (groups of 32 that split alike) the adapters are bf16 on every rank, as unsplit."""
    import copy

    from reference import reference_model
    from sieve import LoRARequest
    from test_lora import ADAPTERS, make_adapter

    path = _checkpoint(tmp_path / "ckpt", demo_dir, intermediate_size=192)
    base = copy.deepcopy(reference_model(path))
    configs = {"all": ADAPTERS["all"], "attention-rslora": ADAPTERS["attention-rslora"],
               "head": dict(r=8, lora_alpha=16, target_modules=["lm_head", "embed_tokens", "down_proj"])}
    names = list(configs)
    folders = {n: make_adapter(base, tmp_path / n, i, **configs[n]) for i, n in enumerate(names)}
    groups = dict(quantization=quantization, quantization_group_size=32) if quantization else {}
    one, two = tp_pair(path, enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=16, **groups)
    loras = [None] + [LoRARequest(n, i + 1, folders[n]) for i, n in enumerate(names)]
    prompts = PROMPTS * 2
    requests = [loras[i % 4] for i in range(len(prompts))]
    if quantization is None:
        params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)
    else:  # scored, not generated: a random model's near-ties would let the kernels' bf16 rounding pick other tokens
        params = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=0)
    outs = [llm.generate(prompts, params, lora_request=requests) for llm in (one, two)]
    if quantization is None:
        _assert_same(*outs)
    else:  # (the int4 kernels round activations to bf16 on some CPUs; the adapters' products make them larger)
        for x, y in zip(*outs):
            assert [list(d) for d in x.prompt_logprobs[1:]] == [list(d) for d in y.prompt_logprobs[1:]]
            for dx, dy in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
                assert all(abs(dx[t].logprob - dy[t].logprob) < 1e-2 for t in dx)
    plain = one.generate(prompts[:4], params)
    assert all(repr(p.outputs) + repr(p.prompt_logprobs) != repr(o.outputs) + repr(o.prompt_logprobs)
               for p, o in zip(plain[1:], outs[1][1:4])), "an adapter changes nothing"
    assert len(two.llm_engine.runner.model.tp.adapters.held) == 2  # the ranks hold at most max_cpu_loras


def test_splits_that_cannot_work_are_refused(checkpoints, tmp_path, demo_dir):
    with pytest.raises(ConfigError, match="attention heads"):
        LLM(str(checkpoints["llama"]), dtype="float32", device="cpu", tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be"):
        LLM(str(checkpoints["llama"]), dtype="float32", device="cpu", tensor_parallel_size=0)
    # Q8_0 groups of 32 cannot be cut at 80 of down_proj's 160 inputs: the worker's error reaches the caller
    from sieve.bench.gguf_export import export_gguf

    gguf = export_gguf(checkpoints["llama"], tmp_path / "q8.gguf", "q8_0", log=lambda *a: None)
    with pytest.raises(ConfigError, match="groups of 32"):
        LLM(str(gguf), dtype="float32", device="cpu", tensor_parallel_size=2, num_gpu_blocks_override=64)


def test_a_dead_rank_fails_the_step_instead_of_hanging(checkpoints):
    llm = LLM(str(checkpoints["llama"]), dtype="float32", device="cpu", tensor_parallel_size=2, num_gpu_blocks_override=64)
    try:
        worker = llm.llm_engine.tp_workers.processes[0]
        worker.kill()
        worker.join(timeout=10)
        with pytest.raises(Exception):
            _run(llm, PROMPTS[:1], max_tokens=4)
    finally:
        llm.shutdown()


def test_a_rank_s_own_error_reaches_the_caller(checkpoints):
    """A worker that fails (here on a command it does not know) exits with its error in the spawn queue; the step that
    then fails on the collective reports it by name, not as gloo's closed connection."""
    from sieve.engine import EngineDead

    llm = LLM(str(checkpoints["llama"]), dtype="float32", device="cpu", tensor_parallel_size=2, num_gpu_blocks_override=64)
    try:
        llm.llm_engine.tp_workers.group.announce(("bogus",))
        with pytest.raises(EngineDead, match="unknown command 'bogus'"):
            _run(llm, PROMPTS[:1], max_tokens=4)
    finally:
        llm.shutdown()


def test_shutdown_with_a_dead_rank_never_waits_on_the_groups_destructors():
    """A gloo group's destructor joins its threads, and one blocked on a send to a killed rank never returns: it hung
    `test_a_dead_rank_fails_the_step_instead_of_hanging` in full `make test` runs, aborted or not. Where a rank is gone,
    shutdown aborts the groups and drops them on a daemon thread. Groups whose destructors block until released
    stand in for gloo's: shutdown returns at once, and they are destroyed once released."""
    import threading

    from sieve.distributed.parallel import TensorParallelGroup

    release, both_gone, destroyed, aborted = threading.Event(), threading.Event(), [], []

    class Stuck:
        def __init__(self, name):
            self.name = name

        def abort(self):
            aborted.append(self.name)

        def __del__(self):
            release.wait()
            destroyed.append(self.name)
            if len(destroyed) == 2:
                both_gone.set()

    group = TensorParallelGroup(0, 2, torch.device("cpu"), object(), Stuck("control"), Stuck("data"))
    group.gone = lambda: "tensor-parallel rank 1 exited"
    done = threading.Thread(target=group.shutdown, daemon=True)
    done.start()
    done.join(timeout=30)
    try:
        assert not done.is_alive(), "shutdown waited on a group's destructor"
        assert aborted == ["control", "data"]
    finally:
        release.set()
    assert both_gone.wait(60)
    assert sorted(destroyed) == ["control", "data"]


def test_torchrun_launch(checkpoints, tmp_path):
    """Every rank runs the same `sieve generate` under torchrun; rank 0 prints the unsplit model's answer."""
    path = str(checkpoints["llama"])
    common = ["generate", "--model", path, "--dtype", "float32", "--device", "cpu", "--max-tokens", "16",
              "--temperature", "0", "--prompt", PROMPTS[1]]
    env = dict(os.environ)
    plain = subprocess.run([sys.executable, "-m", "sieve.cli", *common], capture_output=True, text=True, env=env, timeout=300)
    assert plain.returncode == 0, plain.stderr[-2000:]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(_free_port()), "-m", "sieve.cli", *common, "--tensor-parallel-size", "2"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert plain.stdout.strip() and run.stdout.strip() == plain.stdout.strip()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _checkpoint(path: Path, tokenizer_dir: Path, **overrides) -> Path:
    """A random Llama whose MLP width splits on 32-input groups (the conftest shape's 160 does not)."""
    import shutil

    import transformers

    from conftest import BASE, _widen_init

    cfg = transformers.LlamaConfig(**{**BASE, **overrides}, rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32)
    _widen_init(model, 3)
    model.save_pretrained(path, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, path / f.name)
    return path


def test_ray_tasks_as_ranks(checkpoints):
    """--distributed-executor-backend ray: the worker rank is a Ray task (a local Ray instance here); same output."""
    import ray

    path = str(checkpoints["llama"])
    one = LLM(path, dtype="float32", device="cpu", num_gpu_blocks_override=128)
    two = LLM(path, dtype="float32", device="cpu", num_gpu_blocks_override=128, tensor_parallel_size=2,
              distributed_executor_backend="ray")
    try:
        assert two.llm_engine.tp_workers.ray_refs and not two.llm_engine.tp_workers.processes
        _assert_same(_run(one), _run(two))
    finally:
        two.shutdown()
        ray.shutdown()
    with pytest.raises(ConfigError, match="mp or ray"):
        LLM(path, dtype="float32", device="cpu", tensor_parallel_size=2, distributed_executor_backend="slurm")


def test_a_killed_rank_marks_the_engine_dead_health_503_and_serve_exits_nonzero(checkpoints, tmp_path):
    """Idle or busy, a killed rank ends the engine: in process, /health answers 503 ("dead") and requests 503; as
    `sieve serve`, the process exits with status 1 (a supervisor restarts it) instead of failing every later step."""
    import signal
    import time

    import httpx
    from fastapi.testclient import TestClient

    from sieve import EngineConfig, LLMEngine
    from sieve.server.app import create_app

    engine = LLMEngine(EngineConfig(model=str(checkpoints["llama"]), dtype="float32", device="cpu", tensor_parallel_size=2,
                                    num_gpu_blocks_override=64))
    app = create_app(engine, api_key="k")
    try:
        with TestClient(app) as tc:
            assert tc.get("/health").status_code == 200
            worker = engine.tp_workers.processes[0]
            worker.kill()
            worker.join(timeout=10)
            deadline = time.monotonic() + 20
            while tc.get("/health").status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            health = tc.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "dead" and "exited" in health.json()["error"]
            late = tc.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"Authorization": "Bearer k"})
            assert late.status_code == 503 and late.json()["error"]["code"] == "engine_error"
    finally:
        engine.shutdown()

    port = _free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "sieve.cli", "serve", "--model", str(checkpoints["llama"]), "--dtype", "float32",
                             "--device", "cpu", "--tensor-parallel-size", "2", "--port", str(port), "--no-webui"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        children = [c for task in Path(f"/proc/{proc.pid}/task").iterdir() for c in (task / "children").read_text().split()]
        workers = [int(c) for c in children if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]  # not the resource tracker
        assert len(workers) == 1, children
        os.kill(workers[-1], signal.SIGKILL)
        assert proc.wait(timeout=60) == 1, (tmp_path / "serve.log").read_text()[-3000:]
        assert "tensor-parallel worker" in (tmp_path / "serve.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
