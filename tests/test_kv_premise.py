"""A quantized KV cache whose premise (memory binds) does not hold says so in the log."""

import logging

from sieve.sampling_params import SamplingParams


def test_the_premise_is_judged_per_window_and_said_once_each_way(monkeypatch, caplog):
    from sieve import kv_premise
    from sieve.kv_premise import KVPremise

    monkeypatch.setattr(kv_premise, "WINDOW_STEPS", 4)
    w = KVPremise("fp8")
    with caplog.at_level(logging.INFO, logger="sieve"):
        for usage in [0.1, 0.3, 0.2, 0.4] + [0.1] * 4:  # two windows under 45%: said once
            w.observe(usage)
        assert w.unmet and w.num_unmet == 1
        for usage in [0.1, 0.9, 0.2, 0.1]:  # one step near full: it binds
            w.observe(usage)
        assert not w.unmet
        for usage in [0.44] * 4:  # under again: said again
            w.observe(usage)
    said = [r for r in caplog.records if "premise does not hold" in r.getMessage()]
    pays = [r for r in caplog.records if "now pays" in r.getMessage()]
    assert len(said) == 2 and all(r.levelno == logging.WARNING for r in said) and len(pays) == 1
    assert "at most 40% of its pool" in said[0].getMessage() and "--kv-cache-dtype auto" in said[0].getMessage()
    assert w.num_unmet == 2


def test_an_fp8_cache_on_a_pool_that_never_fills_says_so(llama_engine_factory, monkeypatch, caplog):
    """One short sequence in a 512-block pool: after a window of steps the engine logs that the FP8 cache's premise
    does not hold. In a 6-block pool that the same sequence fills, it says nothing; a 16-bit cache never watches."""
    from sieve import kv_premise

    monkeypatch.setattr(kv_premise, "WINDOW_STEPS", 16)
    prompt = {"prompt_token_ids": list(range(5, 45))}
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for blocks, expect in ((512, 1), (6, 0)):
        llm = llama_engine_factory(kv_cache_dtype="fp8", num_gpu_blocks_override=blocks)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="sieve"):
            llm.generate([prompt], params)
        said = [r for r in caplog.records if "premise does not hold" in r.getMessage()]
        assert len(said) == expect and llm.llm_engine.kv_premise.num_unmet == expect, blocks
    assert llama_engine_factory().llm_engine.kv_premise is None
