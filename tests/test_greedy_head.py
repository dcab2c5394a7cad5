"""Greedy rows' tokens from a bf16 LM head's int8 sketch (sieve/layers/greedy_head.py): the plain path's argmax bit for
bit, ties included, from about half the head's bytes; and from a Q8_0 head's own codes against int8 activations."""

from __future__ import annotations

import pytest
import torch

from sieve import LLM, SamplingParams
from sieve.kernels import cpu_ops
from sieve.layers.greedy_head import GreedyHead
from tests.conftest import cpu_flags

ops = cpu_ops()
pytestmark = pytest.mark.skipif(ops is None or not hasattr(ops, "greedy_head"),
                                reason="the greedy head runs on the native bf16 GEMV (AVX2 or AVX512-BF16 builds)")


def plain_argmax(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the runner did before: the first max of each row's bf16 logits from the GEMV."""
    return ops.gemv_bf16(x, w, None).float().max(dim=-1).indices


def test_sketch_argmax_is_the_full_heads_for_random_aligned_and_outlier_states():
    g = torch.Generator().manual_seed(0)
    N, K = 3001, 200  # an odd row count (a lone row per thread share) and K not a multiple of the vector
    w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
    w[2900] = w[17]  # exact ties: the first index must win
    w[1000] = w[999]
    head = GreedyHead(w)
    candidates = []
    for trial in range(60):
        M = 1 + trial % head.max_rows
        x = torch.randn(M, K, generator=g) * [0.1, 1.0, 8.0, 40.0][trial % 4]
        if trial % 3 == 0:  # activation outliers, as real hidden states have
            x[:, trial % K] *= 60
        aimed = trial % 5 == 0 and M > 1
        if aimed:  # rows aimed at the tied pairs
            x[0] = w[17].float() * 300
            x[-1] = w[999].float() * 300
        x = x.bfloat16()
        got, want = head(x), plain_argmax(x, w)
        assert got is not None and torch.equal(got, want), (trial, got, want)
        if aimed:
            assert got[0] == 17 and got[-1] == 999
        candidates += head.last_candidates.tolist()
    assert sum(candidates) / len(candidates) < 40  # the bound leaves few rows to multiply exactly


def test_sketch_resolves_logits_that_differ_in_their_last_bits():
    """Rows one bf16 step apart in one weight: their logits are within the sketch's bound of each other, so all of
    them are candidates, and the exact products decide, as the plain path's would."""
    g = torch.Generator().manual_seed(1)
    N, K = 512, 64
    w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
    base = w[40].clone()
    for i, n in enumerate(range(100, 140)):
        row = base.clone()
        row[i % K] = torch.nextafter(row[i % K].float(), torch.tensor(1e9 if i % 2 else -1e9)).bfloat16()
        w[n] = row
    head = GreedyHead(w)
    for trial in range(40):
        x = (base.float() * 200 + torch.randn(K, generator=g) * 0.3 * (trial % 4)).bfloat16()[None]
        got, want = head(x), plain_argmax(x, w)
        assert torch.equal(got, want), (trial, got, want)
        assert head.last_candidates[0] > 1


def test_a_row_the_sketch_underrates_is_still_found():
    """Row 3 has one large weight, so its int8 step is coarse and its 63 small weights all round to 0: its sketch logit
    is 0 where its logit is 0.24. Row 5 is exact in int8 with logit 0.2. The sketch alone would pick row 5; the bound
    (|x| times the row's rounding residual) keeps row 3 a candidate, and the exact product picks it."""
    K = 64
    w = torch.zeros(8, K)
    w[3, 0], w[3, 1:] = 1.0, 0.49 / 127
    w[5, 1] = 0.2
    w = w.bfloat16()
    x = torch.ones(1, K)
    x[0, 0] = 0
    x = x.bfloat16()
    head = GreedyHead(w)
    assert plain_argmax(x, w).item() == 3
    assert head(x).item() == 3 and head.last_candidates.item() == 2


def test_the_sketch_reads_about_half_the_heads_bytes():
    w = torch.randn(1000, 576).bfloat16()
    head = GreedyHead(w)
    assert head.nbytes <= 0.52 * w.numel() * w.element_size()
    assert head.max_rows == ops.gemv_max_rows  # above, the plain path's logits come from another kernel


def test_sketch_declines_what_it_cannot_bound():
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(300, 48, generator=g) * 0.05).bfloat16()
    head = GreedyHead(w)
    x = torch.randn(2, 48, generator=g).bfloat16()
    x[1, 3] = float("inf")
    assert head(x) is None  # a row that is not finite: the caller computes the logits
    assert head(torch.randn(head.max_rows + 1, 48, generator=g).bfloat16()) is None
    assert head(x[:1]) is not None
    wide = GreedyHead(torch.zeros(2, 4097).bfloat16())  # the summation slack is worked out for K <= 4096
    with pytest.raises(RuntimeError, match="K <= 4096"):
        wide(torch.zeros(1, 4097).bfloat16())


def greedy_with_and_without_sketch(path: str, dtype: str):
    """Two engines on one file, the greedy head on and off: four greedy requests generate the same tokens, and the head's
    calls (rows per call, recorded in `calls`) take a step's decodes at once."""
    on = LLM(path, dtype=dtype, num_gpu_blocks_override=128)
    off = LLM(path, dtype=dtype, num_gpu_blocks_override=128, greedy_head_sketch=False)
    model = on.llm_engine.runner.model
    head = model.greedy_head
    assert head is not None and off.llm_engine.runner.model.greedy_head is None
    calls: list[int] = []
    model.greedy_head = lambda h: calls.append(h.shape[0]) or head(h)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 40, 17, 9)]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    got, want = on.generate(prompts, greedy), off.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert calls and max(calls) <= 4  # a step of the four decodes, rows of one call
    return on, off, head, calls, prompts


def test_engine_takes_greedy_tokens_from_the_sketch_and_they_equal_the_full_heads(checkpoints):
    """A bf16 model: greedy requests take their tokens from the sketch and generate exactly what the full head does;
    requests that need the logits (logprobs, sampling, penalties) compute them."""
    on, off, head, calls, prompts = greedy_with_and_without_sketch(str(checkpoints["qwen2"]), "bfloat16")
    assert isinstance(head, GreedyHead)
    for params in (SamplingParams(max_tokens=4, temperature=0, logprobs=1), SamplingParams(max_tokens=4, temperature=0.7, seed=3),
                   SamplingParams(max_tokens=4, temperature=0, repetition_penalty=1.3)):
        calls.clear()
        a, b = on.generate(prompts[:2], params), off.generate(prompts[:2], params)
        assert calls == []
        assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


# ---- a GGUF Q8_0 head, float32 hidden states (AVX512-VNNI builds) -------------------------------------------------

needs_q8 = pytest.mark.skipif(ops is None or not hasattr(ops, "greedy_head_q8"),
                              reason="the Q8_0 greedy head multiplies int8 activations with AVX512-VNNI (vpdpbusd)")


def q8_0_head(w: torch.Tensor):
    """A Q8_0 weight (int8 codes, float16 scale per 32 inputs) in the native kernel the plain path runs."""
    from sieve.quant.formats import ChannelScaledWeight
    from sieve.quant.kernels import make_kernel

    n, k = w.shape
    s = (w.view(n, k // 32, 32).abs().amax(-1) / 127).clamp_min(1e-8).half()
    q = torch.round(w.view(n, k // 32, 32) / s.float()[..., None]).clamp(-127, 127).to(torch.int8).view(n, k)
    return make_kernel(ChannelScaledWeight(q, s), torch.float32, None)


@needs_q8
def test_q8_head_argmax_is_the_plain_kernels_for_random_tied_and_outlier_states():
    from sieve.layers.greedy_head import GreedyHeadQ8

    g = torch.Generator().manual_seed(3)
    N, K = 3001, 192  # a partial last block of 16 rows
    w = torch.randn(N, K, generator=g) * 0.05
    w[2900] = w[17]  # exact ties: the first index must win
    w[1000] = w[999]
    kern = q8_0_head(w)
    head = GreedyHeadQ8(kern.native)
    candidates = []
    for trial in range(60):
        M = 1 + trial % head.max_rows
        x = torch.randn(M, K, generator=g) * [0.1, 1.0, 8.0, 40.0][trial % 4]
        if trial % 3 == 0:  # one activation far above the rest, as real hidden states have
            x[:, trial % K] *= 60
        aimed = trial % 5 == 0 and M > 1
        if aimed:
            x[0], x[-1] = w[17] * 300, w[999] * 300
        got, want = head(x), kern(x).max(dim=-1).indices
        assert got is not None and torch.equal(got, want), (trial, got, want)
        if aimed:
            assert got[0] == 17 and got[-1] == 999
        candidates += head.last_candidates.tolist()
    assert sorted(candidates)[len(candidates) // 2] < 40  # the bound leaves few rows to multiply exactly


def many_row_states(g, w, M, K):
    x = torch.randn(M, K, generator=g) * [0.3, 4.0][M % 2]
    x[:, M % K] *= 50  # an outlier activation
    x[M // 2] = w[M] * 300  # a row aimed at head row M
    return x


ROW_COUNTS = list(range(1, 18)) + [31, 32, 33, 48, 64]


@needs_q8
def test_q8_head_answers_steps_of_many_rows():
    """Steps of many greedy rows (users verifying drafts, draft trees) take the sketch too, 64 rows a call, where the
    plain path would compute every logit."""
    from sieve.layers.greedy_head import GreedyHeadQ8

    g = torch.Generator().manual_seed(5)
    N, K = 1000, 96  # a partial last block of 16 rows
    w = torch.randn(N, K, generator=g) * 0.05
    kern = q8_0_head(w)
    head = GreedyHeadQ8(kern.native)
    assert head.max_rows == ops.greedy_head_q8_max_rows() == 64
    for M in ROW_COUNTS:
        x = many_row_states(g, w, M, K)
        got = head(x)
        assert got is not None and torch.equal(got, kern(x).max(dim=-1).indices), M
        assert got[M // 2] == M
    x = many_row_states(g, w, 150, K)  # more rows than a call takes: 64 at a time
    assert torch.equal(head(x), kern(x).max(dim=-1).indices) and head.last_candidates.shape == (150,)


@needs_q8
def test_q8_head_sketch_on_amx_int8_tiles_is_vpdpbusds():
    """On a CPU with AMX-INT8 tiles the sketch of 9 rows and more is tdpbssd's integer sums, the same as vpdpbusd's:
    the same candidates (their counts show it) and the same answers at every row count, whichever multiplies.
    Skipped on a CPU without the tiles, as the CUDA tests are without a GPU."""
    from sieve.layers.greedy_head import GreedyHeadQ8

    assert ops.greedy_head_q8_amx_rows() == 9  # above vpdpbusd's 8-row tiles (docs/design-notes.md, issue 15)
    with pytest.raises(RuntimeError, match="1 to 65"):
        ops.set_greedy_head_q8_amx_rows(0)
    if not ({"amx_tile", "amx_int8"} <= cpu_flags() and ops.isa == "avx512-bf16"):
        pytest.skip("this CPU has no AMX-INT8 tiles")
    g = torch.Generator().manual_seed(6)
    N, K = 1000, 96
    w = torch.randn(N, K, generator=g) * 0.05
    kern = q8_0_head(w)
    head = GreedyHeadQ8(kern.native)
    before = ops.greedy_head_q8_amx_rows()
    try:
        for M in ROW_COUNTS:
            x = many_row_states(g, w, M, K)
            want, candidates = kern(x).max(dim=-1).indices, []
            for rows in (65, 1):  # vpdpbusd at every row count, then the tiles at every row count
                ops.set_greedy_head_q8_amx_rows(rows)
                got = head(x)
                assert got is not None and torch.equal(got, want), (M, rows)
                candidates.append(head.last_candidates.clone())
            assert torch.equal(candidates[0], candidates[1]), M  # the same sketch: the same candidates
    finally:
        ops.set_greedy_head_q8_amx_rows(before)


@needs_q8
def test_q8_head_resolves_rows_one_code_apart():
    """Rows that differ from row 40 in one code: their logits are within the bound of each other, so they are all
    candidates, and the plain kernel's own products on their blocks decide."""
    from sieve.layers.greedy_head import GreedyHeadQ8

    g = torch.Generator().manual_seed(4)
    N, K = 512, 64
    kern = q8_0_head(torch.randn(N, K, generator=g) * 0.05)
    w8 = kern.native.weight.view(N // 16, K // 2, 16, 2)  # the blocked codes: edit them in place
    base = [(40 // 16, p, 40 % 16, i) for p in range(K // 2) for i in range(2)]
    for j, n in enumerate(range(100, 140)):
        for (b, p, c, i) in base:  # row n := row 40, then one code one step away
            w8[n // 16, p, n % 16, i] = w8[b, p, c, i]
        kern.native.scale.view(N // 16, K // 32, 16)[n // 16, :, n % 16] = kern.native.scale.view(N // 16, K // 32, 16)[40 // 16, :, 40 % 16]
        p, i = (j % K) // 2, (j % K) % 2
        code = w8[n // 16, p, n % 16, i].view(torch.int8).item()
        w8[n // 16, p, n % 16, i] = torch.tensor(code + (1 if code < 127 else -1), dtype=torch.int8).view(torch.uint8)
    head = GreedyHeadQ8(kern.native)
    row40 = kern(torch.eye(K)).T[40]  # the dequantized row 40
    for trial in range(30):
        x = (row40 * 200 + torch.randn(K, generator=g) * 0.3 * (trial % 4))[None]
        got, want = head(x), kern(x).max(dim=-1).indices
        assert torch.equal(got, want), (trial, got, want)
        assert head.last_candidates[0] > 1


@needs_q8
def test_q8_head_declines_what_it_cannot_bound():
    from sieve.layers.greedy_head import GreedyHeadQ8

    kern = q8_0_head(torch.randn(300, 64) * 0.05)
    head = GreedyHeadQ8(kern.native)
    x = torch.randn(2, 64)
    x[1, 3] = float("nan")
    assert head(x) is None  # a row that is not finite: the caller computes the logits
    assert head(x.bfloat16()) is None  # bf16 hidden states: the plain logits are rounded to bf16
    assert head(x[:1]) is not None
    assert head.nbytes == 4 * 300 and head.step_bytes_change == 4 * 300  # what it adds to a step's bytes: a norm per row
    bf16 = GreedyHead(torch.randn(300, 64).bfloat16())
    assert bf16.step_bytes_change == bf16.nbytes - 300 * 64 * 2 < 0  # the bf16 head's sketch replaces the head


@needs_q8
def test_engine_takes_greedy_tokens_from_the_q8_head_and_they_equal_the_plain_heads(checkpoints, tmp_path):
    """A Q8_0 GGUF file at float32: greedy requests take their tokens from the Q8_0 greedy head, token for token what
    the plain head gives; requests that need logits compute them."""
    from sieve.bench.gguf_export import export_gguf
    from sieve.layers.greedy_head import GreedyHeadQ8

    path = str(export_gguf(checkpoints["llama"], tmp_path / "q8_0.gguf", "q8_0", log=lambda s: None))
    on, off, head, calls, prompts = greedy_with_and_without_sketch(path, "float32")
    assert isinstance(head, GreedyHeadQ8)
    calls.clear()
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=1)
    a, b = on.generate(prompts[:2], params), off.generate(prompts[:2], params)
    assert calls == [] and [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    # bf16 activations: the plain logits are rounded to bf16, which this bound does not cover; the head is not built
    assert LLM(path, dtype="bfloat16", num_gpu_blocks_override=16).llm_engine.runner.model.greedy_head is None
