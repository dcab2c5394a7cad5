"""Incremental detokenization of multi-byte text, streamed deltas, and refusals of bad input."""

from __future__ import annotations

import pytest

from sieve import LLM, RequestError, SamplingParams
from sieve.detokenizer import decode_new_text, init_offsets
from sieve.outputs import RequestMetrics
from sieve.sequence import Request, Sequence

TEXT = "naïve café — 日本語のテキスト 🎉🚀 done"


def test_incremental_decoding_of_multibyte_text(demo_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_dir)
    prompt = tok.encode("x = ")
    ids = tok.encode(TEXT)
    assert len(ids) > len(TEXT.encode()) // 3, "expect characters split over byte-level tokens"
    req = Request("r", None, prompt, SamplingParams(), 0, RequestMetrics(0.0))
    seq = Sequence(request=req, index=0, arrival_order=0, token_ids=list(prompt), seed=None)
    init_offsets(seq)
    pieces = []
    for t in ids:
        seq.token_ids.append(t)
        piece = decode_new_text(seq, tok, True)
        assert "\ufffd" not in piece
        pieces.append(piece)
    assert "".join(pieces) == TEXT
    assert any(p == "" for p in pieces), "some tokens end mid-character and emit nothing yet"


def test_streamed_deltas_add_up_and_hold_back_partial_stops(llama_engine_factory):
    llm = llama_engine_factory()
    engine = llm.llm_engine
    full = llm.generate([{"prompt_token_ids": [7, 8, 9]}], SamplingParams(max_tokens=25, temperature=0, ignore_eos=True))[0]
    text = full.outputs[0].text
    stop = text[10:13]
    engine.add_request("s", {"prompt_token_ids": [7, 8, 9]}, SamplingParams(max_tokens=25, temperature=0, ignore_eos=True, stop=stop))
    streamed, ids = "", []
    while engine.has_unfinished():
        for out in engine.step():
            delta_text, delta_ids = out.deltas[0]
            streamed += delta_text
            ids += delta_ids
            assert stop not in streamed
            if not out.finished:
                assert text.startswith(streamed)
    assert streamed == text[: text.index(stop)] and ids == out.outputs[0].token_ids


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", SamplingParams(), "empty"),
        ({"prompt_token_ids": []}, SamplingParams(), "empty"),
        ({"prompt_token_ids": [1, 99999]}, SamplingParams(), "out of range"),
        # 512 tokens of cache: the model's 1024-token context is capped to what the pool can hold
        ({"prompt_token_ids": [1] * 1000}, SamplingParams(max_tokens=100), "maximum context length of 512"),
        ({"prompt_token_ids": [1] * 10}, SamplingParams(max_tokens=900), "maximum context length of 512"),
        (3.5, SamplingParams(), "prompt is a string"),
    ],
)
def test_bad_requests_are_refused_clearly(llama_engine_factory, prompt, params, match):
    llm = llama_engine_factory(num_gpu_blocks_override=32)  # 512 tokens of cache
    assert llm.llm_engine.config.max_model_len == 512
    with pytest.raises(RequestError, match=match):
        llm.generate([prompt], params)
    assert not llm.llm_engine.has_unfinished()
    assert llm.llm_engine.block_manager.num_free_blocks == 32


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_tokens=0), "max_tokens must be at least 1"),
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-5), "top_k"),
        (dict(n=0), "n must be"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(stop=[""]), "stop strings"),
    ],
)
def test_bad_sampling_params_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_engine_options_are_refused(llama_dir):
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(llama_dir), block_size=12)
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(str(llama_dir), max_num_seqs=0)


def test_duplicate_request_id_is_refused(llama_llm):
    engine = llama_llm.llm_engine
    engine.add_request("dup", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("dup", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2))
    engine.abort("dup")
    assert not engine.has_unfinished()
