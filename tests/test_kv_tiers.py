"""The KV tiers (sieve/kv_tiers): prefix-cache blocks written down to disk as they are cached, loaded back when the
pool no longer holds them, and after a restart; outputs equal those of an engine without tiers. A corrupt block, a
block signed under another secret, another model's blocks, a full disk and a tier slower than recomputing each
cost a recomputed prompt, a counter and a log line, never a wrong token or a failed request."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import socket
import subprocess
import time

import openai
import pytest
import torch

from sieve import LLM, SamplingParams
from sieve.config import ConfigError
from sieve.kv_tiers import DiskStore

# 72 tokens or so under the test tokenizer: 18 blocks of 4, in a pool of 40 that three such prompts overflow
DOC = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon phi "
       "chi psi omega one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen")
OTHERS = [f"{w} " * 30 + "and that is all" for w in ("red", "green", "blue", "black", "white")]
GREEDY = SamplingParams(max_tokens=8, temperature=0)


def engine(path, tiers: str | None, measured_cost: bool = False, **kwargs) -> LLM:
    """An engine over a pool of 40 blocks of 4 tokens, with a disk tier at `tiers` (other tiers in kwargs). The tiny test model recomputes a
    block about as fast as the disk gives it back (tens of microseconds each), so the cost model's choice would
    depend on the machine: unless `measured_cost`, recomputing is priced as a real model's (never cheaper)."""
    kwargs = {"dtype": "float32", "device": "cpu", "num_gpu_blocks_override": 40, "block_size": 4, **kwargs}
    if tiers is not None:
        kwargs["kv_cache_disk"] = tiers
    llm = LLM(str(path), **kwargs)
    if llm.llm_engine.kv_tiers is not None and not measured_cost:
        llm.llm_engine.kv_tiers.recompute_s_per_block = float("inf")
    return llm


def run(llm: LLM, prompt: str):
    out = llm.generate([prompt], GREEDY)[0]
    if llm.llm_engine.kv_tiers is not None:
        assert llm.llm_engine.kv_tiers.flush()
    return out


def evict_with_others(llm: LLM) -> None:
    """Fill the pool with other prompts until none of DOC's blocks is left in it."""
    for p in OTHERS:
        run(llm, p)
    bm = llm.llm_engine.block_manager
    ids = llm.llm_engine.tokenize(DOC)[1]
    assert bm.cached_block(bm.prompt_hashes(ids)[0]) is None, "the test's pool must have evicted DOC's first block"


@pytest.fixture(scope="module")
def reference(checkpoints):
    llm = engine(checkpoints["llama"], None)
    yield {p: llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in [DOC] + OTHERS}
    llm.shutdown()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_evicted_blocks_come_back_from_disk_with_the_same_tokens(checkpoints, reference, tmp_path, kv_cache_dtype):
    llm = engine(checkpoints["llama"], str(tmp_path / "kv"), kv_cache_dtype=kv_cache_dtype)
    ref = reference if kv_cache_dtype == "auto" else None
    first = run(llm, DOC)
    assert first.kv_tier_tokens == {}
    evict_with_others(llm)
    again = run(llm, DOC)
    tiers = llm.llm_engine.kv_tiers
    n_blocks = (len(first.prompt_token_ids) - 1) // 4
    assert again.kv_tier_tokens == {"disk": 4 * n_blocks} and again.num_cached_tokens == 4 * n_blocks
    assert tiers.stats.hits["disk"] == n_blocks and tiers.stats.checksum_failures == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    if ref is not None:
        assert first.outputs[0].token_ids == ref[DOC]
    stats = llm.llm_engine.stats().kv_tiers
    assert stats.hits == {"disk": n_blocks} and stats.bytes[("disk", "read")] > 0 and stats.bytes[("disk", "write")] > 0
    llm.shutdown()


def test_evicted_blocks_come_back_from_host_ram_first(checkpoints, reference, tmp_path):
    """--kv-offloading-size: a tier in host RAM, nearest below the pool; with the disk tier too, the host answers
    first, and the disk where the host no longer holds the blocks (its capacity, least recently used out)."""
    llm = engine(checkpoints["llama"], None, kv_offloading_size=0.01)
    first = run(llm, DOC)
    evict_with_others(llm)
    again = run(llm, DOC)
    n_blocks = (len(first.prompt_token_ids) - 1) // 4
    assert again.kv_tier_tokens == {"host": 4 * n_blocks} and again.outputs[0].token_ids == reference[DOC]
    assert llm.llm_engine.stats().kv_tiers.hits == {"host": n_blocks}
    host = llm.llm_engine.kv_tiers.stores[0]
    per_block = host.bytes_held / len(host)
    llm.shutdown()
    both = engine(checkpoints["llama"], str(tmp_path / "kv"), kv_offloading_size=0.01)
    run(both, DOC)
    evict_with_others(both)
    assert run(both, DOC).kv_tier_tokens == {"host": 4 * n_blocks}
    both.shutdown()
    # a host tier of 20 blocks: the other prompts' blocks push DOC's out of it, not out of the disk
    small = engine(checkpoints["llama"], str(tmp_path / "kv2"), kv_offloading_size=20.5 * per_block / 1e9)
    run(small, DOC)
    evict_with_others(small)
    out = run(small, DOC)
    assert out.kv_tier_tokens == {"disk": 4 * n_blocks} and out.outputs[0].token_ids == reference[DOC]
    assert small.llm_engine.kv_tiers.stores[0].evictions > 0
    small.shutdown()


def _preempted_then_evicted(path, host_tier: bool) -> tuple[list[int], int, int]:
    """One running slot: a 40-token request ("low", priority 5) runs 7 steps (46 tokens: 11 full blocks, in the prefix
    cache and written down), is displaced by a priority-0 request whose 130-token prompt and 30 tokens take the whole
    pool (40 blocks of 4), and resumes once that one ends, none of its blocks left in the pool. Returns low's tokens,
    the tokens computed for it and the blocks read back for it."""
    from sieve import SamplingParams

    llm = engine(path, None, max_num_seqs=1, max_model_len=256, **({"kv_offloading_size": 0.01} if host_tier else {}))
    eng = llm.llm_engine
    computed = {"low": 0}
    schedule = eng.scheduler.schedule

    def counted():
        out = schedule()
        for s in out.scheduled:
            if s.seq.request.request_id == "low":
                computed["low"] += s.num_new_tokens
        return out

    eng.scheduler.schedule = counted
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    eng.add_request("low", {"prompt_token_ids": [7 + i for i in range(40)]}, params, 5)
    for _ in range(7):
        eng.step()
    if eng.kv_tiers is not None:
        assert eng.kv_tiers.flush()
    eng.add_request("urgent", {"prompt_token_ids": [300 + i for i in range(130)]},
                    SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), 0)
    tokens, order = {}, []
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
                order.append(out.request_id)
    assert order == ["urgent", "low"] and eng.scheduler.num_preemptions == 1
    resumed = eng.kv_tiers.stats.resumed["host"] if eng.kv_tiers is not None else 0
    llm.shutdown()
    return tokens["low"], computed["low"], resumed


def test_a_preempted_request_resumes_from_the_tiers_not_by_recompute(checkpoints):
    """Preemption keeps the victim's KV where a tier can hold it (issue 66): its blocks, evicted from the pool while
    it waited, come back from host RAM as it re-enters, and it computes again only its partial last block (fewer
    than 4 tokens) where without tiers it recomputes its 46 tokens. Its tokens are those it gives alone."""
    alone_rows = 40 + 24 - 1  # its prompt, then a row for each token but the last
    plain_tokens, plain_computed, _ = _preempted_then_evicted(checkpoints["llama"], host_tier=False)
    tokens, computed, resumed = _preempted_then_evicted(checkpoints["llama"], host_tier=True)
    assert plain_computed - alone_rows >= 44  # the contrast: recomputed from its first token
    assert 0 < computed - alone_rows < 4 and resumed == 11, (computed, resumed)
    llm = engine(checkpoints["llama"], None)
    alone = llm.generate([{"prompt_token_ids": [7 + i for i in range(40)]}],
                         SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    llm.shutdown()
    assert tokens == alone == plain_tokens


def _doc_blocks(llm) -> list:
    """DOC's full blocks in the pool, as copies of their views (None for one not there)."""
    eng = llm.llm_engine
    bm = eng.block_manager
    out = []
    for h in bm.prompt_hashes(eng.tokenize(DOC)[1][:-1]):
        block = bm.cached_block(h)
        out.append(None if block is None else [v.clone() for v in eng.runner.block_tensors(block)])
    return out


def within_half_a_step(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether `y` is `x` through int8 codes with a float16 scale s per row: within s / 2 of each value, plus what a
    row's largest value loses where s rounded down (the code clamps at 127), plus `x`'s dtype's own rounding."""
    from sieve.quant.formats import quantize_int8_rows

    s = quantize_int8_rows(x)[1].float()[..., None]
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    rounding = {torch.float32: 0.0, torch.float16: 2**-11, torch.bfloat16: 2**-8}[x.dtype]
    bound = 0.5 * s + (amax - 127 * s).clamp(min=0) + rounding * x.float().abs() * 1.01
    return bool(((y.float() - x.float()).abs() <= bound * (1 + 1e-6)).all())


def test_a_lossy_tier_holds_int8_blocks_within_half_a_step(checkpoints, tmp_path, caplog):
    """--kv-tier-dtype int8: blocks go down as int8 codes with a scale per token and head, under a quarter of a
    float32 block's bytes with the payload's header; a block loaded back holds each value within half a step of its
    row (amax / 254, with the float16 scale's rounding), and not the pool's bytes. Said in the log and the stats.
    A lossless tier's blocks on the same disk are never loaded by a lossy engine (their own fingerprint)."""
    caplog.set_level(logging.WARNING, logger="sieve")
    llm = engine(checkpoints["llama"], None, kv_offloading_size=0.01, kv_tier_dtype="int8")
    first = run(llm, DOC)
    exact = _doc_blocks(llm)
    assert all(b is not None for b in exact)
    evict_with_others(llm)
    again = run(llm, DOC)
    n_blocks = (len(first.prompt_token_ids) - 1) // 4
    assert again.kv_tier_tokens == {"host": 4 * n_blocks}
    loaded = _doc_blocks(llm)
    assert all(within_half_a_step(x, y) for before, after in zip(exact, loaded) for x, y in zip(before, after))
    assert any(not torch.equal(x, y) for b, a in zip(exact, loaded) for x, y in zip(b, a))
    lossy_per_block = llm.llm_engine.kv_tiers.stores[0].bytes_held / len(llm.llm_engine.kv_tiers.stores[0])
    assert llm.llm_engine.stats().kv_tiers.dtype == "int8" and "lossy" in caplog.text
    llm.shutdown()
    plain = engine(checkpoints["llama"], str(tmp_path / "kv"), kv_offloading_size=0.01)
    run(plain, DOC)
    plain_per_block = plain.llm_engine.kv_tiers.stores[0].bytes_held / len(plain.llm_engine.kv_tiers.stores[0])
    plain.shutdown()
    assert lossy_per_block < 0.5 * plain_per_block, (lossy_per_block, plain_per_block)
    restarted = engine(checkpoints["llama"], str(tmp_path / "kv"), kv_tier_dtype="int8")
    assert run(restarted, DOC).kv_tier_tokens == {}  # the lossless blocks on disk are another fingerprint's
    restarted.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_lossy_tiers_packing_is_the_int8_kv_caches_arithmetic(dtype):
    """The writer thread packs in NumPy (torch there halved the engine's steps): the same codes and scales as the
    int8 KV cache's quantizer, bit for bit, ties and tiny rows included; unpacked, within half a step of each value."""
    from sieve.kv_tiers import lossy
    from sieve.quant.formats import quantize_int8_rows

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 3, 4, 5, 64, generator=g) * torch.logspace(-6, 2, 5)[:, None]).to(dtype)
    x[0, 0, 0, 0] = 0  # a zero row
    x[0, 0, 0, 1, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # ties at half a step
    codes, scales = lossy.pack([x])
    ref_codes, ref_scales = quantize_int8_rows(x)
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
    raw = [t.numpy().tobytes() for t in (codes, scales)]
    back = torch.empty_like(x)
    lossy.unpack_into([back], raw)
    assert within_half_a_step(x, back)
    assert not back[0, 0, 0, 0].any()


def test_a_lossy_tier_is_refused_where_it_means_nothing(checkpoints):
    for kwargs, message in (({"kv_tier_dtype": "int8"}, "needs kv_offloading_size"),
                            ({"kv_tier_dtype": "int4", "kv_offloading_size": 0.01}, "auto .lossless. or int8"),
                            ({"kv_tier_dtype": "int8", "kv_offloading_size": 0.01, "kv_cache_dtype": "int8"}, "already holds 8-bit")):
        with pytest.raises(ConfigError, match=message):
            engine(checkpoints["llama"], None, **kwargs)


def test_the_host_tier_keeps_its_capacity_least_recently_used_out():
    from sieve.kv_tiers import HostStore

    store = HostStore(capacity_bytes=250)
    for key in "abc":
        assert store.write(key, bytes(100))
    assert len(store) == 2 and not store.has("a") and store.evictions == 1 and store.bytes_held == 200
    assert store.read("b") == bytes(100)  # b used: c is now the oldest
    store.write("d", bytes(100))
    assert store.leading(["b", "d", "c"]) == 2 and store.read("c") is None
    assert not store.write("e", bytes(300))  # bigger than the tier
    store.drop("b")
    assert store.bytes_held == 100 and store.read_many(["d", "b"]) == [bytes(100), None]


def test_outputs_equal_with_tiers_on_and_off(checkpoints, reference, tmp_path):
    llm = engine(checkpoints["llama"], str(tmp_path / "kv"))
    for _ in range(2):
        for p in [DOC] + OTHERS:
            assert run(llm, p).outputs[0].token_ids == reference[p]
    assert llm.llm_engine.kv_tiers.stats.hits["disk"] > 0
    llm.shutdown()


def test_salted_prefixes_stay_apart_in_the_tiers(checkpoints, reference, tmp_path):
    llm = engine(checkpoints["llama"], str(tmp_path / "kv"))
    salted = {t: SamplingParams(max_tokens=8, temperature=0, cache_salt=t) for t in ("tenant-a", "tenant-b")}
    llm.generate([DOC], salted["tenant-a"])
    assert llm.llm_engine.kv_tiers.flush()
    evict_with_others(llm)
    other = llm.generate([DOC], salted["tenant-b"])[0]  # another tenant's salt: nothing of tenant-a's is loaded
    assert other.kv_tier_tokens == {} and other.outputs[0].token_ids == reference[DOC]
    assert llm.llm_engine.kv_tiers.flush()
    same = llm.generate([DOC], salted["tenant-a"])[0]
    assert same.kv_tier_tokens["disk"] > 0 and same.outputs[0].token_ids == reference[DOC]
    llm.shutdown()


def test_a_restart_keeps_the_cache(checkpoints, reference, tmp_path):
    llm = engine(checkpoints["llama"], str(tmp_path / "kv"))
    run(llm, DOC)
    llm.shutdown()
    again = engine(checkpoints["llama"], str(tmp_path / "kv"))
    out = run(again, DOC)
    assert out.kv_tier_tokens["disk"] >= 4 * ((len(out.prompt_token_ids) - 1) // 4)
    assert out.outputs[0].token_ids == reference[DOC]
    again.shutdown()


def _block_files(tmp_path):
    return sorted(p for p in (tmp_path / "kv").rglob("*.kv"))


def test_a_corrupt_block_is_recomputed_counted_logged_and_deleted(checkpoints, reference, tmp_path, caplog):
    llm = engine(checkpoints["llama"], str(tmp_path / "kv"))
    run(llm, DOC)
    evict_with_others(llm)
    ids = llm.llm_engine.tokenize(DOC)[1]
    first = tmp_path / "kv" / llm.llm_engine.kv_tiers.stores[0].dir.name / (llm.llm_engine.block_manager.prompt_hashes(ids)[2].hex() + ".kv")
    data = bytearray(first.read_bytes())
    data[len(data) // 2] ^= 0x40
    first.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="sieve"):
        out = run(llm, DOC)
    tiers = llm.llm_engine.kv_tiers
    assert out.outputs[0].token_ids == reference[DOC]
    assert out.kv_tier_tokens == {"disk": 8}  # the two blocks before the corrupt one
    assert tiers.stats.checksum_failures == 1 and tiers.stats.recomputed["failed check"] > 0
    assert "failed its check" in caplog.text
    assert first.read_bytes() != bytes(data)  # deleted, and written again when the recomputed block was cached
    assert llm.llm_engine.stats().kv_tiers.checksum_failures == 1
    evict_with_others(llm)
    assert run(llm, DOC).kv_tier_tokens == {"disk": 4 * ((len(ids) - 1) // 4)}
    llm.shutdown()


def test_blocks_signed_under_another_secret_are_never_loaded(checkpoints, reference, tmp_path):
    keys = []
    for name in ("a.key", "b.key"):
        path = tmp_path / name
        path.write_bytes(os.urandom(32))
        path.chmod(0o600)
        keys.append(str(path))
    llm = engine(checkpoints["llama"], str(tmp_path / "kv"), kv_cache_secret_file=keys[0])
    run(llm, DOC)
    llm.shutdown()
    other = engine(checkpoints["llama"], str(tmp_path / "kv"), kv_cache_secret_file=keys[1])
    out = run(other, DOC)
    assert out.kv_tier_tokens == {} and out.outputs[0].token_ids == reference[DOC]
    assert other.llm_engine.kv_tiers.stats.checksum_failures == 1
    other.shutdown()


def test_another_model_or_kv_layout_never_sees_the_blocks(checkpoints, reference, tmp_path):
    llm = engine(checkpoints["llama"], str(tmp_path / "kv"))
    run(llm, DOC)
    llm.shutdown()
    for path, kwargs in ((checkpoints["mistral"], {}), (checkpoints["llama"], {"kv_cache_dtype": "int8"})):
        other = engine(path, str(tmp_path / "kv"), **kwargs)
        out = run(other, DOC)
        assert out.kv_tier_tokens == {} and other.llm_engine.kv_tiers.stats.checksum_failures == 0
        if not kwargs:
            plain = engine(path, None)
            assert out.outputs[0].token_ids == plain.generate([DOC], GREEDY)[0].outputs[0].token_ids
            plain.shutdown()
        other.shutdown()
    assert len({p.parent for p in _block_files(tmp_path)}) == 3  # a directory per KV fingerprint


def test_a_full_disk_costs_the_copy_never_the_request(checkpoints, reference, tmp_path, monkeypatch, caplog):
    def full(self, key, payload):
        raise OSError(errno.ENOSPC, "No space left on device")

    llm = engine(checkpoints["llama"], str(tmp_path / "kv"))
    monkeypatch.setattr(DiskStore, "write", full)
    with caplog.at_level(logging.WARNING, logger="sieve"):
        outs = [run(llm, p) for p in [DOC] + OTHERS + [DOC]]
    assert [o.outputs[0].token_ids for o in outs] == [reference[p] for p in [DOC] + OTHERS + [DOC]]
    tiers = llm.llm_engine.kv_tiers
    assert tiers.stats.write_errors["disk"] > 0 and tiers.stats.hits["disk"] == 0
    assert "No space left on device" in caplog.text
    llm.shutdown()


def test_a_tier_slower_than_recomputing_is_left_alone(checkpoints, reference, tmp_path):
    llm = engine(checkpoints["llama"], str(tmp_path / "kv"))
    run(llm, DOC)
    evict_with_others(llm)
    tiers = llm.llm_engine.kv_tiers
    tiers.fetch_s_per_block["disk"] = 2 * tiers.recompute_s_per_block  # as a throttled disk measures
    out = run(llm, DOC)
    assert out.kv_tier_tokens == {} and out.outputs[0].token_ids == reference[DOC]
    assert tiers.stats.recomputed["slower"] > 0 and tiers.stats.hits["disk"] == 0
    llm.shutdown()


def test_the_cost_model_is_measured_at_start(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("SIEVE_KV_TIER_READ_DELAY_S", "0.5")  # an injected slow tier: half a second a block
    llm = engine(checkpoints["llama"], str(tmp_path / "kv"), measured_cost=True)
    tiers = llm.llm_engine.kv_tiers
    assert tiers.fetch_s_per_block["disk"] >= 0.5 > tiers.recompute_s_per_block > 0
    llm.shutdown()


def test_recomputing_is_priced_without_the_lm_head(checkpoints, monkeypatch):
    """A prompt computes logits for its last token only: the price of recomputing a block is the forward's, without
    the head (Gemma-3's 262k-word head had tripled it, and a tier slower than recomputing was taken). A fake machine:
    0.1 s a row without logits, 0.5 with."""
    import sieve.model_runner

    def fake(runner, n, tables, context=0, logits=True):
        return (0.5 if logits else 0.1) * n

    monkeypatch.setattr(sieve.model_runner, "time_decode_rows", fake)
    llm = engine(checkpoints["llama"], None, measured_cost=True, kv_offloading_size=0.01)
    assert llm.llm_engine.kv_tiers.recompute_s_per_block == pytest.approx(0.1 * 4)
    llm.shutdown()


def test_what_the_tiers_cannot_hold_is_refused_with_a_reason(checkpoints, tmp_path):
    with pytest.raises(ConfigError, match="prefix caching"):
        engine(checkpoints["llama"], str(tmp_path / "kv"), enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="kv_cache_disk"):
        engine(checkpoints["llama"], None, kv_cache_secret_file=str(tmp_path / "none.key"))
    for size in (0, -1.0, True):
        with pytest.raises(ConfigError, match="kv_offloading_size"):
            engine(checkpoints["llama"], None, kv_offloading_size=size)
    shared = tmp_path / "open"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(ConfigError, match="private"):
        engine(checkpoints["llama"], str(shared))


def test_the_server_reports_tier_tokens_and_metrics(checkpoints, tmp_path):
    import httpx
    from live_server import API_KEY, MODEL, start_server

    from sieve import EngineConfig, LLMEngine

    eng = LLMEngine(EngineConfig(model=str(checkpoints["llama"]), dtype="float32", num_gpu_blocks_override=40, block_size=4,
                                 kv_cache_disk=str(tmp_path / "kv")))
    eng.kv_tiers.recompute_s_per_block = float("inf")  # as `engine` does
    url, stop = start_server(eng)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY)
        first = client.completions.create(model=MODEL, prompt=DOC, max_tokens=8, temperature=0)
        assert eng.kv_tiers.flush()
        for p in OTHERS:
            client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)
        assert eng.kv_tiers.flush()
        again = client.completions.create(model=MODEL, prompt=DOC, max_tokens=8, temperature=0)
        assert again.choices[0].text == first.choices[0].text
        details = again.usage.prompt_tokens_details
        assert details.cached_tokens > 0 and details.model_extra["kv_tier_tokens"]["disk"] == details.cached_tokens
        metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
        assert f'sieve:kv_tier_hits_total{{model_name="{MODEL}",tier="disk"}}' in metrics
        assert "sieve:kv_tier_checksum_failures_total" in metrics and "sieve:kv_tier_bytes_total" in metrics
        assert f'sieve:kv_tier_lossy{{dtype="auto",model_name="{MODEL}"}} 0.0' in metrics
        assert f'sieve:kv_tier_resumed_hits_total{{model_name="{MODEL}",tier="disk"}} 0.0' in metrics
    finally:
        stop()
        eng.shutdown()


# ---- a tier shared by replicas: Redis ----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_url():
    """A real redis-server on a free port of 127.0.0.1 (make install installs Debian's)."""
    import redis

    assert shutil.which("redis-server"), "redis-server is missing: `make install` installs Debian's"
    port = _free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            if redis.Redis(port=port, socket_timeout=0.2).ping():
                break
        except redis.RedisError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


def _key(tmp_path, name: str) -> str:
    path = tmp_path / name
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return str(path)


def test_a_replica_loads_what_another_computed_through_redis(checkpoints, reference, tmp_path, redis_url):
    secret = _key(tmp_path, "shared.key")
    one = engine(checkpoints["llama"], None, kv_cache_remote=redis_url, kv_cache_secret_file=secret)
    first = run(one, DOC)
    assert first.kv_tier_tokens == {}
    two = engine(checkpoints["llama"], None, kv_cache_remote=redis_url, kv_cache_secret_file=secret)
    out = run(two, DOC)
    assert out.kv_tier_tokens == {"redis": 4 * ((len(out.prompt_token_ids) - 1) // 4)}
    assert out.outputs[0].token_ids == first.outputs[0].token_ids == reference[DOC]
    intruder = engine(checkpoints["llama"], None, kv_cache_remote=redis_url, kv_cache_secret_file=_key(tmp_path, "other.key"))
    forged = run(intruder, DOC)  # what another secret's server wrote is never loaded
    assert forged.kv_tier_tokens == {} and forged.outputs[0].token_ids == reference[DOC]
    assert intruder.llm_engine.kv_tiers.stats.checksum_failures == 1
    for llm in (one, two, intruder):
        llm.shutdown()


def test_a_disk_tier_in_front_of_redis_answers_first(checkpoints, reference, tmp_path, redis_url):
    secret = _key(tmp_path, "shared.key")
    llm = engine(checkpoints["llama"], str(tmp_path / "kv"), kv_cache_remote=redis_url, kv_cache_secret_file=secret)
    run(llm, DOC)
    evict_with_others(llm)
    out = run(llm, DOC)
    assert list(out.kv_tier_tokens) == ["disk"] and out.outputs[0].token_ids == reference[DOC]
    assert llm.llm_engine.kv_tiers.stats.bytes[("redis", "write")] > 0
    llm.shutdown()


def test_an_unreachable_redis_costs_a_recompute_never_the_request(checkpoints, reference, tmp_path, caplog):
    dead = f"redis://127.0.0.1:{_free_port()}/0"
    with caplog.at_level(logging.WARNING, logger="sieve"):
        llm = engine(checkpoints["llama"], None, kv_cache_remote=dead, kv_cache_secret_file=_key(tmp_path, "k.key"))
        started = time.monotonic()
        outs = [run(llm, p) for p in [DOC] + OTHERS + [DOC]]
        elapsed = time.monotonic() - started
    assert [o.outputs[0].token_ids for o in outs] == [reference[p] for p in [DOC] + OTHERS + [DOC]]
    tiers = llm.llm_engine.kv_tiers
    assert tiers.stats.write_errors["redis"] + tiers.stats.read_errors["redis"] > 0 and tiers.stats.hits["redis"] == 0
    assert "KV tier redis" in caplog.text
    assert elapsed < 30  # one timeout, then the store's back-off: never a timeout per block
    llm.shutdown()


def test_a_shared_store_needs_a_shared_secret(checkpoints, redis_url):
    with pytest.raises(ConfigError, match="kv_cache_secret_file"):
        engine(checkpoints["llama"], None, kv_cache_remote=redis_url)
    with pytest.raises(ConfigError, match="Redis URL"):
        engine(checkpoints["llama"], None, kv_cache_remote="http://127.0.0.1:1/", kv_cache_secret_file="x")


def test_bench_tiers_end_to_end_on_the_demo_model(demo_dir, tmp_path):
    """`sieve bench tiers` on the random demo model, small enough for a test: every part runs, the answers with the
    disk tier and the slow tier are those without tiers (a slow tier is left alone), a restarted engine answers what
    it answered; a part it does not know, or replicas without a Redis, are refused before anything loads. (Whether a
    tier pays on a model this small depends on the machine: the figures come from SmolLM2, docs/benchmarks.md.)"""
    import argparse

    from sieve.bench.tiers import add_bench_tiers_args, run_bench_tiers

    p = argparse.ArgumentParser()
    add_bench_tiers_args(p)
    args = p.parse_args(["--model", "demo", "--conversations", "3", "--turns", "2", "--doc-tokens", "120,160",
                         "--pool-tokens", "256", "--restart-doc-tokens", "180", "--max-tokens", "4"])
    out = run_bench_tiers(args)
    assert out["outputs_identical"] and out["no_tiers"]["returning_ttft_p50_ms"] > 0
    assert out["slow_disk"]["tier_blocks_loaded"] == 0 and out["slow_disk"]["blocks_recomputed"]["slower"] > 0
    assert out["restart"]["outputs_identical"] and out["restart"]["prompt_tokens"] >= 180
    for parts, message in (("returning,nope", "--parts takes"), ("replicas", "--redis-url")):
        with pytest.raises(ConfigError, match=message):
            run_bench_tiers(p.parse_args(["--model", "demo", "--parts", parts]))


def test_bench_tiers_preemption_part_on_the_demo_model():
    """`sieve bench tiers --parts preemption` on the demo model: background requests displaced by interactive ones
    whose prompts evict their blocks, without tiers and with a host tier; every background output equals its run
    without interruptions either way. (Whether the tier pays on a model this small depends on the machine: SmolLM2's
    figures are in docs/benchmarks.md.)"""
    import argparse

    from sieve.bench.tiers import add_bench_tiers_args, run_bench_tiers

    p = argparse.ArgumentParser()
    add_bench_tiers_args(p)
    out = run_bench_tiers(p.parse_args(["--model", "demo", "--parts", "preemption", "--doc-tokens", "100,120",
                                        "--restart-doc-tokens", "180", "--pool-tokens", "400", "--preempt-background", "2",
                                        "--preempt-max-tokens", "24", "--preempt-every", "6", "--conversations", "2"]))["preemption"]
    assert out["interactive"] == 3 and out["no_tiers"]["preemptions"] > 0 and out["host_tier"]["preemptions"] > 0
    assert out["outputs_identical_to_alone"] == {"no_tiers": True, "host_tier": True}
    assert out["recomputed_tokens"]["no_tiers"] > 0 and out["alone"]["preemptions"] == 0


def test_bench_tiers_lossy_part_on_the_demo_model():
    """`sieve bench tiers --parts lossy` on the demo model: the same conversations through a lossless host tier and an
    int8 one; the int8 blocks take under half the bytes (float32 pool), and the cost figures are there (their values
    are the model's, and whether a tier pays on a model this small the machine's: SmolLM2's are in docs/benchmarks.md)."""
    import argparse

    from sieve.bench.tiers import add_bench_tiers_args, run_bench_tiers

    p = argparse.ArgumentParser()
    add_bench_tiers_args(p)
    out = run_bench_tiers(p.parse_args(["--model", "demo", "--parts", "lossy", "--conversations", "3", "--turns", "2",
                                        "--doc-tokens", "120,160", "--pool-tokens", "256", "--max-tokens", "4",
                                        "--dtype", "float32", "--host-gb", "0.05"]))["lossy"]
    assert out["returning_turns"] == 3 and out["capacity_ratio"] > 2
    assert out["first_token_kl_mean"] >= 0 and 0 <= out["first_token_top1_agreement"] <= 1


def test_the_lossy_parts_kl_is_a_divergence():
    from sieve.bench.tiers import top_kl

    p = {1: -0.1, 2: -2.5, 3: -4.0}
    assert top_kl(p, dict(p)) == pytest.approx(0.0, abs=1e-12)
    assert top_kl(p, {1: -0.2, 2: -2.0, 3: -5.0}) > 0
    assert top_kl(p, {1: -3.0, 2: -0.1, 9: -3.5}) > top_kl(p, {1: -0.2, 2: -2.0, 3: -5.0})  # 3 past Q's list: floor
    assert all(top_kl(p, {1: a, 2: b, 3: -1.0}) >= 0 for a in (-0.1, -1.0, -3.0) for b in (-0.5, -2.5))
