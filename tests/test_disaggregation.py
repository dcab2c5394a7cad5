"""Prefill/decode disaggregation: a prefill engine saves a prompt's KV blocks, a decode engine loads them into its prefix
cache and decodes; the output equals one engine's, over TCP and shared memory, float32 and int8 KV. A missing,
corrupt, foreign or unreachable block ends the transfer there and the decode engine computes the rest: still the
right tokens. Through real servers and the router with the openai client, and with the prefill server killed."""

from __future__ import annotations

import os
import time

import openai
import pytest

from sieve import LLM, SamplingParams
from sieve.config import ConfigError
from sieve.engine import RequestError

LONG = "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 and so on and so forth until the end"
PROMPTS = [LONG, "The quick brown fox jumps over the lazy dog, again and again", "Hi"]


@pytest.fixture(scope="module")
def secret(tmp_path_factory) -> str:
    """The secret every prefill and decode engine of these tests shares (mode 600, as KVAuth requires)."""
    path = tmp_path_factory.mktemp("kv") / "kv.key"
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return str(path)


def where(p: LLM) -> str:
    """A producer's address as a consumer lists it: host:port of its KV port, or its shm directory."""
    store = p.llm_engine.kv_connector.store
    return str(store.shm_dir) if store.shm_dir is not None else f"127.0.0.1:{store.port}"


@pytest.fixture
def engines(checkpoints, secret):
    made = []

    def make(producer: LLM | None = None, **kwargs):
        """An engine; with a KV role it gets the shared secret, and a decode engine lists `producer`."""
        kwargs = {"dtype": "float32", "device": "cpu", "num_gpu_blocks_override": 128, "block_size": 4, **kwargs}
        if kwargs.get("kv_role"):
            cfg = dict(kwargs.get("kv_transfer_config") or {})
            cfg.setdefault("secret_file", secret)
            if producer is not None:
                cfg.setdefault("producers", [where(producer)])
            kwargs["kv_transfer_config"] = cfg
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
    d = engines(p, kv_cache_dtype=kv, kv_role="decode", kv_transfer_config={"transport": transport})
    for prompt in PROMPTS:
        want = _decode(one, prompt, None)
        params = _prefill(p, prompt)
        n_prompt = len(want.prompt_token_ids)
        assert params["remote_num_tokens"] == (n_prompt - 1) // 4 * 4  # every full block the decode server will take
        got = _decode(d, prompt, params)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.num_cached_tokens == (n_prompt - 1) // 4 * 4  # computed here: only what follows the transferred blocks
        seeded = [_decode(e, prompt, _prefill(p, prompt) if e is d else None, temperature=0.9, seed=5) for e in (one, d)]
        assert seeded[0].outputs[0].token_ids == seeded[1].outputs[0].token_ids
    stats = d.llm_engine.kv_connector.stats
    assert stats.blocks["load"] > 0 and stats.bytes["load"] > 0 and not stats.fallbacks
    assert p.llm_engine.kv_connector.stats.blocks["save"] == stats.blocks["load"]
    p.llm_engine.kv_connector.store.sweep()  # (shm: its timer finds the files the consumer removed)
    assert p.llm_engine.kv_connector.store.num_held == 0  # the consumer took them all: the producer let them go


def resign(params: dict, secret: str, ttl: float = 60.0, **changes) -> dict:
    """Params as a producer holding `secret` would sign them, with `changes`: what a compromised or buggy producer
    could send (a client cannot: it has no secret)."""
    from sieve.distributed.kv_auth import KVAuth

    body = {k: v for k, v in params.items() if k not in ("kv_nonce", "kv_expires", "kv_signature")}
    return KVAuth.from_file(secret, ttl).sign({**body, **changes})


MAC_MISMATCH = "block MAC mismatch (other tokens, or not from a producer holding the secret)"


def test_bad_blocks_fall_back_to_computing_and_never_change_a_token(engines, secret):
    one = engines()
    p = engines(kv_role="prefill")
    d = engines(p, kv_role="decode")
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
    payload, expires, size = store._blocks[h]
    store._blocks[h] = (payload[:-40] + bytes([payload[-40] ^ 1]) + payload[-39:], expires, size)
    check(params, MAC_MISMATCH, 2)
    params = _prefill(p, LONG)  # a block whose lease is gone
    store.release([params["remote_block_hashes"][4]])
    check(params, "missing block", 4)
    params = _prefill(p, LONG)  # blocks of another prompt offered for this one
    other = _prefill(p, PROMPTS[1])
    check(resign(params, secret, remote_block_hashes=other["remote_block_hashes"]), MAC_MISMATCH, 0)
    params = _prefill(p, LONG)  # another model / dtype / block size
    check(resign(params, secret, kv_layout="something-else"), "KV layout differs (another model, dtype, KV dtype or block size)", 0)
    params = _prefill(p, LONG)  # names that are not block hashes (a path, say) are never looked up
    check(resign(params, secret, remote_block_hashes=["../../etc/passwd"]), "remote_block_hashes are not block hashes", 0)
    params = _prefill(p, LONG)  # the producer is gone
    p.shutdown()
    check(params, "ConnectionRefusedError", 0)


def test_params_a_client_makes_up_are_refused_before_any_connection(engines, secret, tmp_path):
    """A client's own kv_transfer_params (unsigned, signed with another secret, altered, expired, replayed, or naming
    a producer the server does not list) are a 400 naming the field: the decode server connects nowhere (a listener
    on 127.0.0.1 sees no connection) and its prefix cache is untouched."""
    import socket

    from sieve.distributed.kv_auth import KVAuth

    p = engines(kv_role="prefill")
    d = engines(p, kv_role="decode")
    with socket.socket() as lure:
        lure.bind(("127.0.0.1", 0))
        lure.listen(8)
        lure.settimeout(0.2)
        port = lure.getsockname()[1]
        good = _prefill(p, LONG)
        fake = {k: v for k, v in good.items() if not k.startswith("kv_") or k == "kv_layout"}
        fake.update(remote_host="127.0.0.1", remote_port=port)
        other = tmp_path / "other.key"
        other.write_bytes(os.urandom(32))
        other.chmod(0o600)
        cases = [
            ("not signed", fake),
            ("does not verify", KVAuth.from_file(str(other), 60).sign(fake)),  # another deployment's secret
            ("does not verify", {**good, "remote_port": port}),  # a signed answer, altered
            ("expired", resign(fake, secret, ttl=-1.0)),
            ("name a producer", resign(fake, secret)),  # signed, but the lure is not in `producers`
        ]
        for why, params in cases:
            with pytest.raises(RequestError, match=f"kv_transfer_params.*{why}"):  # noqa: B023
                _decode(d, LONG, params)
        assert d.llm_engine.block_manager.num_cached_blocks == 0
        assert _decode(d, LONG, good).num_cached_tokens > 0
        with pytest.raises(RequestError, match="used already"):  # replayed
            _decode(d, LONG, good)
        with pytest.raises(socket.timeout):
            lure.accept()  # nobody came
    refused = d.llm_engine.kv_connector.stats.refused
    assert refused["unlisted producer"] == 1 and sum(refused.values()) == 6


def test_the_kv_port_answers_only_a_peer_holding_the_secret(engines):
    """Reading blocks off the KV port takes the secret: without it (a wrong challenge answer, no answer, an endless
    line) the port sends nothing and counts the refusal; a connection that says nothing is closed at its timeout."""
    import json
    import socket

    p = engines(kv_role="prefill", kv_transfer_config={"connect_timeout_s": 0.5, "transfer_timeout_s": 1.0})
    params = _prefill(p, LONG)
    store = p.llm_engine.kv_connector.store
    assert store.server.server_address[0] == "127.0.0.1"  # bound where told

    def ask(line: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", store.port), timeout=5) as s:
            s.makefile("rb").readline()  # the challenge
            try:
                s.sendall(line)
                s.shutdown(socket.SHUT_WR)
                return s.recv(1 << 16)
            except (ConnectionResetError, BrokenPipeError, OSError):  # it stopped reading and closed
                return b""

    hashes = params["remote_block_hashes"]
    assert ask(json.dumps({"hashes": hashes, "release": True, "mac": "00" * 32}).encode() + b"\n") == b""
    assert ask(json.dumps({"hashes": hashes}).encode() + b"\n") == b""
    assert ask(b"x" * (2 << 20)) == b""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", store.port), timeout=5) as s:
        s.makefile("rb").readline()
        assert s.recv(16) == b""  # it said nothing: closed by the port
    assert time.monotonic() - started < 3
    assert store.refused["unauthenticated"] == 2 and store.refused["bad_request"] == 1 and store.refused["timeout"] == 1
    assert store.num_held == len(hashes)  # nothing was released either


def test_shm_directories_are_private_and_new(engines, tmp_path):
    existing = tmp_path / "taken"
    existing.mkdir()
    with pytest.raises(ConfigError, match="must be new"):
        engines(kv_role="prefill", kv_transfer_config={"transport": "shm", "shm_dir": str(existing)})
    p = engines(kv_role="prefill", kv_transfer_config={"transport": "shm", "shm_dir": str(tmp_path / "kv")})
    folder = p.llm_engine.kv_connector.store.shm_dir
    assert (folder.stat().st_mode & 0o777) == 0o700
    params = _prefill(p, LONG)
    assert all((f.stat().st_mode & 0o777) == 0o600 for f in folder.iterdir())
    d = engines(p, kv_role="decode", kv_transfer_config={"transport": "shm"})
    folder.chmod(0o755)  # opened to others: the consumer refuses to read from it
    out = _decode(d, LONG, params)
    assert out.num_cached_tokens == 0 and d.llm_engine.kv_connector.stats.fallbacks["the shm directory is not private to this user"] == 1


def test_the_export_store_is_capped_and_swept_by_a_timer(engines):
    """Exports past max_store_bytes are refused with a clear error, counted; leases end without any further put."""
    from sieve.engine import ServerBusy

    p = engines(kv_role="prefill", kv_transfer_config={"max_store_bytes": 20_000, "lease_s": 0.3})
    store, stats = p.llm_engine.kv_connector.store, p.llm_engine.kv_connector.stats
    first = _prefill(p, LONG)  # more blocks than fit: the export stops at the cap
    assert 0 < len(first["remote_block_hashes"]) < len(p.get_tokenizer().encode(LONG)) // 4
    assert store.bytes_held <= 20_000 and stats.refused["store_full"] == 1
    with pytest.raises(ServerBusy, match="KV store is full"):
        _prefill(p, PROMPTS[1])
    assert stats.refused["store_full"] == 2
    deadline = time.monotonic() + 10
    while store.num_held and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.num_held == 0 and store.bytes_held == 0  # swept by its timer
    assert _prefill(p, PROMPTS[1])["remote_block_hashes"]  # room again


def test_leases_expire(engines):
    p = engines(kv_role="prefill", kv_transfer_config={"lease_s": 0.05})
    d = engines(p, kv_role="decode")
    params = _prefill(p, LONG)
    time.sleep(0.2)
    with pytest.raises(RequestError, match="expired"):  # the params expire with the lease
        _decode(d, LONG, params)
    assert p.llm_engine.kv_connector.store.num_held == 0  # and its timer swept the blocks


def test_bad_configs_and_params_are_refused(engines, checkpoints, secret, tmp_path):
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
                       (dict(kv_role="decode", kv_transfer_config={"max_store_bytes": -1}), "max_store_bytes must be"),
                       (dict(kv_role="decode", kv_transfer_config={"producers": "127.0.0.1:1"}), "producers must be a list"),
                       (dict(kv_role="decode", enable_prefix_caching=False), "prefix caching")):
        with pytest.raises(ConfigError, match=match):
            cfg = bad.get("kv_transfer_config")
            if isinstance(cfg, dict):
                bad = dict(bad, kv_transfer_config={"secret_file": secret, **cfg})
            elif cfg is None and bad.get("kv_role") == "decode":
                bad = dict(bad, kv_transfer_config={"secret_file": secret})
            LLM(str(checkpoints["llama"]), dtype="float32", device="cpu", num_gpu_blocks_override=64, **bad)
    open_key, short_key = tmp_path / "open.key", tmp_path / "short.key"
    open_key.write_bytes(os.urandom(32))
    open_key.chmod(0o644)
    short_key.write_bytes(b"hunter2")
    short_key.chmod(0o600)
    for cfg, match in (({}, "needs secret_file"), ({"secret_file": str(open_key)}, "read by other users"),
                       ({"secret_file": str(short_key)}, "at least 16")):
        with pytest.raises(ConfigError, match=match):
            LLM(str(checkpoints["llama"]), dtype="float32", device="cpu", num_gpu_blocks_override=64, kv_role="decode",
                kv_transfer_config=cfg)


def test_router_splits_requests_between_prefill_and_decode_servers(checkpoints, secret):
    """Real servers, the gateway, the openai client: the disaggregated answer equals one server's, streamed or not; the
    decode server's /metrics show the loaded KV; a request the decode server refuses gets its exported blocks released;
    a client's own kv_transfer_params are refused by the gateway and by the decode server; with the prefill server gone
    the gateway still answers, the same."""
    import httpx

    from live_server import API_KEY, metrics_page, serve_app, start_server
    from sieve.config import EngineConfig
    from sieve.engine import LLMEngine
    from sieve.router.app import create_router_app
    from sieve.router.config import parse_config

    def engine(**kw):
        return LLMEngine(EngineConfig(model=str(checkpoints["llama"]), dtype="float32", device="cpu", num_gpu_blocks_override=128,
                                      block_size=4, **kw))

    prefill_engine = engine(kv_role="prefill", kv_transfer_config={"secret_file": secret})
    producer = f"127.0.0.1:{prefill_engine.kv_connector.store.port}"
    servers = {name: start_server(e) for name, e in
               (("one", engine()), ("prefill", prefill_engine),
                ("decode", engine(kv_role="decode", kv_transfer_config={"secret_file": secret, "producers": [producer]})))}
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
            store = prefill_engine.kv_connector.store
            assert store.num_held == 0  # the decode server took them
            with pytest.raises(openai.BadRequestError, match="maximum context length"):  # the decode leg refuses it...
                gw.chat.completions.create(model="pd", messages=messages, max_tokens=100_000, temperature=0)
            assert store.num_held == 0  # ...and the gateway gave the prefill's blocks back at once
            with pytest.raises(openai.BadRequestError, match="kv_transfer_params"):  # clients do not set them
                gw.chat.completions.create(model="pd", messages=messages, max_tokens=4,
                                           extra_body={"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "127.0.0.1"}})
            forged = {"do_remote_prefill": True, "transport": "tcp", "remote_host": "127.0.0.1", "remote_port": 9,
                      "remote_block_hashes": ["0" * 32]}
            r = httpx.post(servers["decode"][0] + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                           json={"messages": messages, "max_tokens": 4, "kv_transfer_params": forged})
            assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
            assert "not signed" in r.json()["error"]["message"]
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


class FakeProducer:
    """A KV port on 127.0.0.1 that holds the secret but misbehaves: `drip` announces a block and sends it a byte every
    half second; `huge` announces 2^40 bytes. Counts its connections."""

    def __init__(self, secret: str, mode: str):
        import socket
        import threading

        from sieve.distributed.kv_auth import KVAuth

        self.auth, self.mode, self.connections = KVAuth.from_file(secret, 60), mode, 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import struct

        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.sendall(self.auth.challenge() + b"\n")
                conn.makefile("rb").readline()
                conn.sendall(struct.pack(">Q", 2**40 if self.mode == "huge" else 5000))
                while self.mode == "drip" and not self.stop.wait(0.5):
                    try:
                        conn.sendall(b"x")
                    except OSError:
                        break

    def params(self, secret: str) -> dict:
        return resign({"do_remote_prefill": True, "transport": "tcp", "remote_host": "127.0.0.1", "remote_port": self.port,
                       "remote_block_hashes": ["ab" * 16] * 8}, secret)

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def test_a_slow_or_lying_producer_delays_only_its_own_request(checkpoints, secret):
    """A listed producer that drips its block holds only its own request, and only until the transfer's deadline (then
    the prompt is computed here, same tokens); other clients' requests run meanwhile as fast as without it. One that
    announces 2^40 bytes is refused before anything is allocated."""
    import threading

    import httpx

    from live_server import API_KEY, start_server
    from sieve.config import EngineConfig
    from sieve.engine import LLMEngine

    drip, huge = FakeProducer(secret, "drip"), FakeProducer(secret, "huge")
    cfg = {"secret_file": secret, "producers": [f"127.0.0.1:{drip.port}", f"127.0.0.1:{huge.port}"], "transfer_timeout_s": 3.0}
    engine = LLMEngine(EngineConfig(model=str(checkpoints["llama"]), dtype="float32", device="cpu", num_gpu_blocks_override=128,
                                    block_size=4, kv_role="decode", kv_transfer_config=cfg))
    url, stop = start_server(engine)
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def ask(prompt: str, params: dict | None = None) -> tuple[float, dict]:
        started = time.monotonic()
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, **({"kv_transfer_params": params} if params else {})}
        r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        return time.monotonic() - started, r.json()

    try:
        want = ask(LONG)[1]["choices"][0]["text"]
        alone = max(ask(f"{i} {PROMPTS[1]}")[0] for i in range(3))
        slow: dict = {}
        t = threading.Thread(target=lambda: slow.update(zip(("seconds", "body"), ask(LONG, drip.params(secret)))))
        t.start()
        while drip.connections == 0:
            time.sleep(0.01)
        during = [ask(f"{i} {PROMPTS[1]}")[0] for i in range(3)]
        assert t.is_alive()  # the drip still holds its own request...
        assert max(during) < max(1.0, 10 * alone)  # ...while the others ran (before: 3 s or more each)
        t.join()
        assert 3.0 <= slow["seconds"] < 3.0 + 5 and slow["body"]["choices"][0]["text"] == want
        assert engine.kv_connector.stats.blocks["load"] == 0
        seconds, body = ask(LONG, huge.params(secret))
        assert body["choices"][0]["text"] == want and seconds < 2
        fallbacks = engine.kv_connector.stats.fallbacks
        assert fallbacks["the transfer passed its deadline (transfer_timeout_s)"] == 1
        assert any(r.startswith("the producer announced a block of 1099511627776 bytes") for r in fallbacks)
    finally:
        stop()
        drip.close()
        huge.close()
