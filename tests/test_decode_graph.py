"""The capture-ready decode step (sieve/decode_graph.py) on the CPU, where it runs eagerly through the buffers and
buckets a CUDA graph captures: a padded step equals an unpadded one, padded rows leave the cache untouched, nothing
inside the step syncs with the host or builds a tensor from host data, and whole generations give the eager path's
tokens. tests/test_cuda.py captures the same path where a GPU is lent."""

from __future__ import annotations

import json
import logging
import threading
from contextlib import ExitStack

import pytest
import torch

from sieve import LLM, SamplingParams
from sieve.config import ConfigError, EngineConfig
from sieve.decode_graph import GraphBreak, StepGuard, capture_sizes

PROMPTS = [[5 + i, 17, 33 + i, 90, 11 * i + 7] * (i + 1) for i in range(9)]


def _llm(path, dtype: str, **kw) -> LLM:
    kw.setdefault("num_gpu_blocks_override", 256)
    return LLM(str(path), dtype=dtype, device="cpu", max_num_seqs=16, **kw)


def test_buckets_are_vllms_capture_sizes_up_to_the_largest_step():
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert capture_sizes(1) == (1,)
    assert capture_sizes(5) == (1, 2, 4, 8)
    assert capture_sizes(100)[-3:] == (80, 96, 112)
    assert capture_sizes(64, [8, 2, 8, 32]) == (2, 8, 32)
    with pytest.raises(ValueError):
        capture_sizes(8, [0, 4])
    with pytest.raises(ConfigError, match="cuda_graph_sizes"):
        EngineConfig(model="x", cuda_graph_sizes=(4, -1)).validate()


def test_the_guard_stops_what_a_captured_step_cannot_replay():
    """The hook has teeth: each of these raises under it, and plain device arithmetic does not."""
    x = torch.arange(6.0)
    with StepGuard():
        y = (x * 2 + 1).softmax(0).index_select(0, x.long()[:3])
    assert y.shape == (3,)
    for bad in (lambda: x.sum().item(), lambda: bool(x.any()), lambda: torch.tensor([1, 2]), lambda: x.tolist(),
                lambda: x[x > 2], lambda: x.nonzero()):
        with pytest.raises(GraphBreak), StepGuard():
            bad()
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # restored after the guard
    seen = []
    with StepGuard():  # another thread's .tolist() (a server's) is not this step's
        other = threading.Thread(target=lambda: seen.append(x.tolist()))
        other.start()
        other.join()
    assert seen == [x.tolist()]


def _prefilled(llm: LLM, prompts: list[list[int]]):
    """One borrowed holder per prompt with its prompt's K/V written (the engine's scoring path)."""
    from sieve.model_runner import score_hidden

    engine = llm.llm_engine
    stack = ExitStack()
    holders = []
    for p in prompts:
        h = stack.enter_context(engine._borrowed_blocks(len(p) + 1))
        score_hidden(engine.runner, p, 0, len(p), h)
        holders.append(h)
    return stack, holders


def _decode_rows(runner, prompts, holders, tokens):
    bs = runner.block_size
    writes = [(h, len(p), len(p) + 1) for h, p in zip(holders, prompts)]
    decodes = [(h, len(p) + 1, -(-(len(p) + 1) // bs)) for h, p in zip(holders, prompts)]
    return tokens, [len(p) for p in prompts], writes, decodes


# float32: the PyTorch layer loop; int8 weights and bfloat16: the C++ one (bfloat16 also batch-invariant)
@pytest.mark.parametrize("case", ["float32", "float32 int8", "bfloat16", "bfloat16 invariant"])
@pytest.mark.parametrize("rows", [1, 3, 5, 9])
def test_a_padded_step_equals_an_unpadded_one_and_padding_writes_nowhere(llama_dir, case, rows):
    dtype = case.split()[0]
    kw = {"quantization": "int8"} if "int8" in case else {"batch_invariant": True} if "invariant" in case else {}
    llm = _llm(llama_dir, dtype, static_decode_on_cpu=True, **kw)
    runner = llm.llm_engine.runner
    static = runner.static_decode
    assert static is not None and (static.bucket(rows) > rows) == (rows > 1)  # buckets 1, 2, 4, 8, 16
    prompts = PROMPTS[:rows]
    stack, holders = _prefilled(llm, prompts)
    with stack:
        ids, positions, writes, decodes = _decode_rows(runner, prompts, holders, [40 + i for i in range(rows)])
        before = runner.kv_pool.clone()
        padded = runner.forward_decodes(ids, positions, writes, decodes).clone()
        after_padded = runner.kv_pool.clone()
        runner.kv_pool.copy_(before)
        plain = runner.model(torch.tensor(ids), torch.tensor(positions), runner.caches, runner.metadata(writes, decodes, []))
        after_plain = runner.kv_pool.clone()
        bs = runner.block_size
        real = {h.block_table[len(p) // bs] * bs + len(p) % bs for h, p in zip(holders, prompts)}  # the rows' slots
    assert static.steps == 1 and static.padded_rows == static.bucket(rows) - rows
    # float32 int8 weights and bfloat16 batch-invariant: one kernel per row at every row count, on every CPU, so every
    # real row has the same bits. The PyTorch loop's GEMM (MKL), and bfloat16's kernels as they are chosen by row count
    # (AMX tiles past some count where the CPU has them), can end a row's sums in another order.
    exact = case in ("float32 int8", "bfloat16 invariant")
    if exact:
        assert torch.equal(padded, plain)
    else:
        assert (padded - plain).abs().max() <= 1e-5 * plain.abs().max()
        head = runner.model.compute_logits
        assert torch.equal(head(padded).argmax(-1), head(plain).argmax(-1))
    blocks = runner.num_blocks  # the pad block (index num_blocks) is the padding's; every other block as unpadded
    for after in (after_padded, after_plain):
        changed = (after[:, :, :blocks] != before[:, :, :blocks]).flatten(4).any(-1).any(0).any(0)  # [blocks, bs]
        assert {int(b) * bs + int(s) for b, s in changed.nonzero()} == real  # the slots the step wrote
    if exact:
        assert torch.equal(after_padded[:, :, :blocks], after_plain[:, :, :blocks])
    else:
        assert torch.allclose(after_padded[:, :, :blocks], after_plain[:, :, :blocks], rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nothing_inside_the_step_syncs_or_reads_host_data(llama_dir, dtype):
    """The model's forward over the static buffers runs under the guard in every bucket; the eager path, which builds
    its metadata from lists inside the step, does not get past it. The buffers stay where they were allocated."""
    llm = _llm(llama_dir, dtype, static_decode_on_cpu=True)
    runner = llm.llm_engine.runner
    static = runner.static_decode
    pointers = [v.data_ptr() for v in static.views]
    with torch.inference_mode():
        for b in static.sizes:
            with StepGuard():
                out = static.step(b)
            assert out.shape == (b, runner.arch.hidden_size) and torch.isfinite(out).all()
            assert static.metas[b].slot_mapping.data_ptr() == static.views[2].data_ptr()
        prompts = PROMPTS[:3]
        stack, holders = _prefilled(llm, prompts)
        with stack:
            args = _decode_rows(runner, prompts, holders, [1, 2, 3])
            runner.forward_decodes(*args)
            with pytest.raises(GraphBreak), StepGuard():
                runner.model(torch.tensor(args[0]), torch.tensor(args[1]), runner.caches, runner.metadata(*args[2:], []))
    assert [v.data_ptr() for v in static.views] == pointers


def _generate(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


@pytest.mark.parametrize("case", ["float32 int8", "bfloat16 invariant", "bfloat16 invariant int8-KV",
                                  "float32 int8 ngram", "bfloat16 invariant ngram"])
def test_generations_through_the_buckets_are_the_eager_ones(llama_dir, case):
    """Nine requests of different lengths finish at different steps, so the decode steps hold 9, 8, ... 1 rows (with
    ngram drafts, 1 + k each): every bucket from 1 to 16, padded. Greedy and seeded sampling, token for token. On
    kernels that give a row the same bits at every row count on every CPU (float32 over int8 weights, bfloat16
    batch-invariant): elsewhere a padded row may differ in its last bits, which the padded-step test bounds."""
    dtype = case.split()[0]
    kw = {"kv_cache_dtype": "int8"} if "int8-KV" in case else {}
    if "float32 int8" in case:
        kw["quantization"] = "int8"
    if "invariant" in case:
        kw["batch_invariant"] = True
    if "ngram" in case:
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    params = SamplingParams(max_tokens=24, temperature=0)
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=11)
    want = [_generate(_llm(llama_dir, dtype, **kw), p) for p in (params, seeded)]
    llm = _llm(llama_dir, dtype, static_decode_on_cpu=True, **kw)
    got = [_generate(llm, p) for p in (params, seeded)]
    static = llm.llm_engine.runner.static_decode
    assert static.steps > 20 and static.padded_rows > 0
    assert got == want


def test_a_model_the_step_does_not_cover_runs_eagerly_and_says_why(checkpoints, caplog):
    with caplog.at_level(logging.INFO, logger="sieve"):
        llm = _llm(checkpoints["mistral"], "float32", static_decode_on_cpu=True, hf_overrides=json.dumps({"sliding_window": 8}))
    assert llm.llm_engine.runner.static_decode is None and llm.llm_engine.runner.pad_block is None
    assert "decode steps run eagerly: sliding-window" in caplog.text
    assert len(_generate(llm, SamplingParams(max_tokens=4, temperature=0))[0]) == 4


def test_graph_flags_on_a_cpu_say_they_do_nothing_here(llama_dir, caplog):
    with caplog.at_level(logging.INFO, logger="sieve"):
        llm = _llm(llama_dir, "float32", cuda_graph_sizes=(1, 8))
    assert llm.llm_engine.runner.static_decode is None and "CUDA graphs are a GPU's" in caplog.text
