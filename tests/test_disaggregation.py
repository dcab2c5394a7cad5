"""Prefill/decode disaggregation: a prefill engine saves a prompt's KV blocks, a decode engine loads them into its prefix
cache and decodes; the output equals one engine's, over TCP and shared memory, float32 and int8 KV. A missing,
corrupt, foreign or unreachable block ends the transfer there and the decode engine computes the rest: still the
right tokens. Through real servers and the router with the openai client, and with the prefill server killed."""

from __future__ import annotations

import time

import openai
import pytest

from sieve import LLM, SamplingParams
from sieve.config import ConfigError
from sieve.engine import RequestError

LONG = "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 and so on and so forth until the end"
PROMPTS = [LONG, "The quick brown fox jumps over the lazy dog, again and again", "Hi"]


@pytest.fixture
def engines(checkpoints):
    made = []

    def make(**kwargs):
        kwargs = {"dtype": "float32", "device": "cpu", "num_gpu_blocks_override": 128, "block_size": 4, **kwargs}
        llm = LLM(str(checkpoints["llama"]), **kwargs)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown()


def _prefill(p: LLM, prompt: str):
    out = p.generate([prompt], SamplingParams(max_tokens=1, temperature=0, kv_transfer_params={"do_remote_decode": True}))[0]
    assert out.kv_transfer_params["do_remote_prefill"] is True
    return out.kv_transfer_params


def _decode(d: LLM, prompt: str, params: dict | None, **sampling):
    sampling = {"max_tokens": 16, "temperature": 0.0, **sampling}
    return d.generate([prompt], SamplingParams(kv_transfer_params=params, **sampling))[0]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_prefill_there_decode_here_equals_one_engine(engines, transport, kv):
    one = engines(kv_cache_dtype=kv)
    p = engines(kv_cache_dtype=kv, kv_role="prefill", kv_transfer_config={"transport": transport})
    d = engines(kv_cache_dtype=kv, kv_role="decode", kv_transfer_config={"transport": transport})
    for prompt in PROMPTS:
        want = _decode(one, prompt, None)
        params = _prefill(p, prompt)
        n_prompt = len(want.prompt_token_ids)
        assert params["remote_num_tokens"] == n_prompt // 4 * 4  # every full block of the prompt
        got = _decode(d, prompt, params)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.num_cached_tokens == (n_prompt - 1) // 4 * 4  # computed here: only what follows the transferred blocks
        seeded = [_decode(e, prompt, _prefill(p, prompt) if e is d else None, temperature=0.9, seed=5) for e in (one, d)]
        assert seeded[0].outputs[0].token_ids == seeded[1].outputs[0].token_ids
    stats = d.llm_engine.kv_connector.stats
    assert stats.blocks["load"] > 0 and stats.bytes["load"] > 0 and not stats.fallbacks
    assert p.llm_engine.kv_connector.stats.blocks["save"] == stats.blocks["load"]
    if transport == "tcp":
        assert p.llm_engine.kv_connector.store.num_held == 0  # the consumer took them: the producer let them go


def test_bad_blocks_fall_back_to_computing_and_never_change_a_token(engines):
    one = engines()
    p = engines(kv_role="prefill")
    d = engines(kv_role="decode")
    want = _decode(one, LONG, None).outputs[0].token_ids
    store = p.llm_engine.kv_connector.store
    stats = d.llm_engine.kv_connector.stats

    def check(params, reason, loaded_blocks):
        before = stats.blocks["load"]
        d.llm_engine.block_manager.reset_prefix_cache()
        got = _decode(d, LONG, params)
        assert got.outputs[0].token_ids == want
        assert stats.blocks["load"] - before == loaded_blocks and stats.fallbacks[reason] >= 1
        assert got.num_cached_tokens == 4 * loaded_blocks

    params = _prefill(p, LONG)  # corrupt the third block in the producer's store
    h = params["remote_block_hashes"][2]
    payload, expires = store._blocks[h]
    store._blocks[h] = (payload[:-40] + bytes([payload[-40] ^ 1]) + payload[-39:], expires)
    check(params, "checksum mismatch", 2)
    params = _prefill(p, LONG)  # a block whose lease is gone
    store.release([params["remote_block_hashes"][4]])
    check(params, "missing block", 4)
    params = _prefill(p, LONG)  # blocks of another prompt offered for this one
    other = _prefill(p, PROMPTS[1])
    check({**params, "remote_block_hashes": other["remote_block_hashes"]}, "block holds other tokens", 0)
    params = _prefill(p, LONG)  # another model / dtype / block size
    check({**params, "kv_layout": "something-else"}, "KV layout differs (another model, dtype, KV dtype or block size)", 0)
    params = _prefill(p, LONG)  # names that are not block hashes (a path, say) are never looked up
    check({**params, "transport": "shm", "remote_shm_dir": "/tmp", "remote_block_hashes": ["../../etc/passwd"]},
          "remote_block_hashes are not block hashes", 0)
    params = _prefill(p, LONG)  # the producer is gone
    p.shutdown()
    check(params, "ConnectionRefusedError", 0)


def test_leases_expire(engines):
    p = engines(kv_role="prefill", kv_transfer_config={"lease_s": 0.05})
    d = engines(kv_role="decode")
    params = _prefill(p, LONG)
    time.sleep(0.2)
    out = _decode(d, LONG, params)
    assert out.num_cached_tokens == 0 and d.llm_engine.kv_connector.stats.fallbacks["missing block"] == 1
    p.llm_engine.kv_connector.store.sweep()
    assert p.llm_engine.kv_connector.store.num_held == 0


def test_bad_configs_and_params_are_refused(engines, checkpoints):
    plain, p, d = engines(), engines(kv_role="prefill"), engines(kv_role="decode")
    with pytest.raises(RequestError, match="no KV transfer"):
        _decode(plain, LONG, {"do_remote_decode": True})
    with pytest.raises(RequestError, match="decode server"):
        _decode(d, LONG, {"do_remote_decode": True})
    with pytest.raises(RequestError, match="prefill server"):
        _decode(p, LONG, {"do_remote_prefill": True, "remote_block_hashes": []})
    with pytest.raises(RequestError, match="must be an object"):
        _decode(d, LONG, ["nope"])
    for bad, match in ((dict(kv_role="sideways"), "role must be"), (dict(kv_role="decode", kv_transfer_config='{"transport": "carrier-pigeon"}'), "transport"),
                       (dict(kv_role="decode", kv_transfer_config={"kv_port": 70000}), "kv_port"),
                       (dict(kv_role="decode", kv_transfer_config={"colour": 1}), "unknown field"),
                       (dict(kv_role="decode", enable_prefix_caching=False), "prefix caching")):
        with pytest.raises(ConfigError, match=match):
            LLM(str(checkpoints["llama"]), dtype="float32", device="cpu", num_gpu_blocks_override=64, **bad)


def test_router_splits_requests_between_prefill_and_decode_servers(checkpoints):
    """Real servers, the gateway, the openai client: the disaggregated answer equals one server's, streamed or not; the
    decode server's /metrics show the loaded KV; with the prefill server gone the gateway still answers, the same."""
    from live_server import API_KEY, metrics_page, serve_app, start_server
    from sieve.config import EngineConfig
    from sieve.engine import LLMEngine
    from sieve.router.app import create_router_app
    from sieve.router.config import parse_config

    def engine(**kw):
        return LLMEngine(EngineConfig(model=str(checkpoints["llama"]), dtype="float32", device="cpu", num_gpu_blocks_override=128,
                                      block_size=4, **kw))

    servers = {name: start_server(engine(**kw)) for name, kw in
               (("one", {}), ("prefill", {"kv_role": "prefill"}), ("decode", {"kv_role": "decode"}))}
    try:
        cfg = parse_config({"backends": [{"name": "pd", "url": servers["decode"][0] + "/v1", "model": "tiny-llama", "api_key": API_KEY,
                                          "prefill": [servers["prefill"][0] + "/v1"]}], "cache": {"backend": "none"}})
        url, stop_gw = serve_app(create_router_app(cfg))
        try:
            direct = openai.OpenAI(base_url=servers["one"][0] + "/v1", api_key=API_KEY)
            gw = openai.OpenAI(base_url=url + "/v1", api_key="x")
            messages = [{"role": "user", "content": LONG}]
            want = direct.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=12, temperature=0)
            got = gw.chat.completions.create(model="pd", messages=messages, max_tokens=12, temperature=0)
            assert got.choices[0].message.content == want.choices[0].message.content
            assert got.usage.prompt_tokens_details.cached_tokens > 0  # the decode server computed only the tail
            stream = gw.chat.completions.create(model="pd", messages=messages, max_tokens=12, temperature=0, stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.choices[0].message.content
            page = metrics_page(servers["decode"][0])
            loaded = [l for l in page.splitlines() if l.startswith("sieve:kv_transfer_bytes_total") and 'direction="load"' in l]
            assert loaded and float(loaded[0].split()[-1]) > 0
            assert 'outcome="transferred"' in _router_metrics(url)
            prefill = openai.OpenAI(base_url=servers["prefill"][0] + "/v1", api_key=API_KEY)
            with pytest.raises(openai.BadRequestError, match="stream false"):  # its answer's params cannot ride a stream
                prefill.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=1, stream=True,
                                                extra_body={"kv_transfer_params": {"do_remote_decode": True}})
            servers.pop("prefill")[1]()  # the prefill server goes away
            alone = gw.chat.completions.create(model="pd", messages=messages, max_tokens=12, temperature=0)
            assert alone.choices[0].message.content == want.choices[0].message.content
            assert 'outcome="prefill_failed"' in _router_metrics(url)
        finally:
            stop_gw()
    finally:
        for _, stop in servers.values():
            stop()


def _router_metrics(url: str) -> str:
    import httpx

    return httpx.get(url + "/metrics").text


def test_bench_pd_runs_both_arrangements(checkpoints, tmp_path):
    """`sieve bench pd` end to end on the tiny checkpoint: the colocated server and the prefill + decode servers behind
    the gateway answer every request, and the decode server loaded the long prompts' KV."""
    import json
    import subprocess
    import sys

    out = tmp_path / "pd.json"
    r = subprocess.run([sys.executable, "-m", "sieve.cli", "bench", "pd", "--model", str(checkpoints["llama"]), "--requests", "6",
                        "--users", "2", "--long-every", "3", "--long-len", "160", "--long-output", "4", "--output-json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"colocated (2 cores)", "P/D (1 + 1 core)"}
    for run in runs.values():
        assert run["all"]["completed"] == run["all"]["requests"] == 6 and run["long"]["requests"] == 2
    transfer = runs["P/D (1 + 1 core)"]["kv_transfer"]
    assert transfer['sieve:kv_transfer_bytes_total{direction="load"}'] > 0
    assert "TPOT p50/p99" in r.stdout
