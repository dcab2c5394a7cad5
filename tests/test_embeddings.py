"""Embeddings: the prompt's pooled final hidden states (sieve/pooling.py), offline (`LLM.embed`) and through
/v1/embeddings with the `openai` client, against transformers' last_hidden_state in float32; the same vectors
whatever else shares the steps, chunked, from the prefix cache, or after a preemption."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch

from live_server import API_KEY, MODEL
from reference import reference_model
from sieve import SamplingParams
from sieve.pooling import PoolingParams, Pooler

PROMPTS = [[1, 5, 9, 200, 31, 7, 8], list(range(3, 83)), [17] * 40 + list(range(100, 140))]


def reference(path, ids: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
    model = reference_model(path)
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0]
    vec = hidden.mean(0) if pooling == "mean" else hidden[-1]
    return torch.nn.functional.normalize(vec, dim=0) if normalize else vec


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_embeddings_equal_transformers_hidden_states(checkpoints, arch, pooling):
    from sieve import LLM

    llm = LLM(str(checkpoints[arch]), dtype="float32", device="cpu", num_gpu_blocks_override=128)
    for normalize in (True, False):
        outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], PoolingParams(pooling, normalize))
        for ids, out in zip(PROMPTS, outs):
            want = reference(checkpoints[arch], ids, pooling, normalize)
            got = torch.tensor(out.embedding)
            assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-4), (arch, pooling, normalize)
            assert out.finished and out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"


def test_embeddings_do_not_depend_on_chunks_cache_batch_or_preemption(llama_engine_factory, monkeypatch):
    """Chunked into 16-token steps beside running generations, with the prompt's blocks already in the prefix cache,
    and preempted mid-prefill by a generation that outgrows a small pool: each vector equals the one computed alone
    (within float32 rounding: the GEMMs see other row counts)."""
    alone = {pooling: [torch.tensor(o.embedding) for o in llama_engine_factory().embed(
        [{"prompt_token_ids": p} for p in PROMPTS], PoolingParams(pooling))] for pooling in ("mean", "last")}
    llm = llama_engine_factory(max_num_batched_tokens=16)
    llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(max_tokens=1))  # its blocks cached
    gens = [{"prompt_token_ids": [3 + i] * 20} for i in range(2)]
    pooled = [SamplingParams(max_tokens=0, pooling=PoolingParams(pooling)) for pooling in ("mean", "last") for _ in PROMPTS]
    outs = llm.generate(gens + [{"prompt_token_ids": p} for p in PROMPTS] * 2,
                        [SamplingParams(max_tokens=30, ignore_eos=True)] * 2 + pooled)
    for k, pooling in enumerate(("mean", "last")):
        for j in range(len(PROMPTS)):
            out = outs[2 + k * len(PROMPTS) + j]
            assert torch.allclose(torch.tensor(out.embedding), alone[pooling][j], atol=1e-5), (pooling, j)
    assert outs[2 + len(PROMPTS) + 1].num_cached_tokens > 0 and outs[3].num_cached_tokens == 0  # mean reads every position
    assert all(len(o.outputs[0].token_ids) == 30 for o in outs[:2])

    # preempted: a generation of 190 tokens takes 12 of 14 blocks while an 80-token prompt is prefilled beside it
    llm = llama_engine_factory(max_num_batched_tokens=16, num_gpu_blocks_override=14, block_size=16)
    engine, preempted = llm.llm_engine, []
    preempt = engine.scheduler._preempt

    def recorded(seq, out):
        if seq.request.pooler is not None:
            preempted.append(seq.num_computed_tokens)
        preempt(seq, out)

    monkeypatch.setattr(engine.scheduler, "_preempt", recorded)
    engine.add_request("gen", {"prompt_token_ids": [5] * 20}, SamplingParams(max_tokens=170, ignore_eos=True))
    while engine.requests["gen"].seqs[0].num_tokens < 140:
        engine.step()
    engine.add_request("emb", {"prompt_token_ids": PROMPTS[1]}, SamplingParams(max_tokens=0, pooling=PoolingParams()))
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert any(n > 0 for n in preempted), "the embedding request must have been preempted mid-prefill"
    assert torch.allclose(torch.tensor(done["emb"].embedding), alone["mean"][1], atol=1e-5)
    assert len(done["gen"].outputs[0].token_ids) == 170
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_pooling_params_are_checked():
    with pytest.raises(ValueError, match="pooling must be one of"):
        PoolingParams("cls")
    with pytest.raises(ValueError, match="max_tokens 0 and n 1"):
        SamplingParams(max_tokens=5, pooling=PoolingParams())
    with pytest.raises(ValueError, match="kv_compression"):
        SamplingParams(max_tokens=0, pooling=PoolingParams(), kv_compression="snapkv:0.5")
    pooler = Pooler(PoolingParams(), 4)
    pooler.add(0, torch.ones(2, 3))
    with pytest.raises(RuntimeError, match="pooled 2 of 4"):
        pooler.result()


@pytest.fixture(scope="module")
def server(llama_server):
    return llama_server


def test_openai_embeddings_create(server, llama_dir):
    url, engine = server
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY)
    texts = ["The quick brown fox", "jumps over the lazy dog", "and runs away"]
    r = client.embeddings.create(model=MODEL, input=texts)  # the client asks for base64 and decodes it
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    tok = engine.tokenizer
    assert r.model == MODEL and [d.index for d in r.data] == [0, 1, 2]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(tok.encode(t)) for t in texts)
    for text, a, b in zip(texts, r.data, floats.data):
        assert len(a.embedding) == engine.arch.hidden_size and a.embedding == pytest.approx(b.embedding, abs=0)
        want = reference(llama_dir, tok.encode(text), "mean")
        assert torch.allclose(torch.tensor(a.embedding), want, atol=1e-5)
    ids = client.embeddings.create(model=MODEL, input=[tok.encode(texts[0])], encoding_format="float")
    assert ids.data[0].embedding == pytest.approx(floats.data[0].embedding, abs=1e-6)
    raw = httpx.post(url + "/v1/embeddings", headers={"Authorization": f"Bearer {API_KEY}"},
                     json={"input": texts[0], "encoding_format": "base64", "dimensions": engine.arch.hidden_size}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == pytest.approx(floats.data[0].embedding, abs=1e-6)


@pytest.mark.parametrize("body, param, message", [
    ({"input": "hi", "dimensions": 8}, "dimensions", "dimensions"),
    ({"input": ""}, "input", "empty"),
    ({"input": []}, "input", "empty"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", None),
    ({"input": "hi", "pooling": "cls"}, "pooling", "unknown field"),
    ({"input": [[1, 2], []]}, "input", "empty"),
    ({"input": "hi", "model": "other"}, "model", "does not exist"),
])
def test_embeddings_errors_name_the_field(server, body, param, message):
    r = httpx.post(server[0] + "/v1/embeddings", headers={"Authorization": f"Bearer {API_KEY}"}, json=body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param
    if message:
        assert message in r.json()["error"]["message"]
    assert httpx.post(server[0] + "/v1/embeddings", json={"input": "hi"}).status_code == 401
