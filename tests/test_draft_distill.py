"""`sieve distill --method draft`: a draft model cut from the target's layers and trained on its greedy tokens is an
ordinary checkpoint; served as `draft_model` (its own weight format with `quantization`) it is lossless, and it
drafts far better than the same cut untrained."""

from __future__ import annotations

import json

import pytest

from sieve import SamplingParams
from sieve.config import ConfigError
from sieve.train.distill import run_distill
from sieve.train.draft import spaced_layers

from test_medusa import STORIES, distill_args, stories, workload
from test_spec import assert_pool_clean, ids


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    out = tmp_path_factory.mktemp("draft")
    answers = tmp_path_factory.mktemp("answers") / "answers.json"
    report = run_distill(distill_args(STORIES, out, method="draft", draft_layers=2, epochs=3, lr=3e-3, answers=str(answers)))
    return out, report, answers


def test_spaced_layers_keep_first_and_last():
    assert spaced_layers(30, 4) == [0, 10, 19, 29]
    assert spaced_layers(5, 2) == [0, 4]
    assert spaced_layers(5, 1) == [4]
    assert spaced_layers(3, 8) == [0, 1, 2]


def test_a_cut_of_every_layer_is_the_target():
    """The cut takes the target's weights as they are: with every layer kept, transformers' model of the cut gives
    sieve's logits."""
    import torch

    from sieve.train.draft import cut_from_target

    model, _, layers = cut_from_target(str(STORIES), 99)
    assert layers == [0, 1, 2, 3, 4]
    ids = list(range(5, 60))
    with torch.inference_mode():
        got = model(input_ids=torch.tensor([ids])).logits[0]
    want = stories().llm_engine.score(ids)
    assert torch.allclose(got, want, atol=1e-4, rtol=0)


def test_distilled_draft_is_a_checkpoint_that_drafts_better_than_the_cut(draft):
    out, report, _ = draft
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and (out / "model.safetensors").exists()
    meta = json.loads((out / "sieve_distill.json").read_text())
    assert meta["method"] == "draft" and meta["target_layers"] == [0, 4]
    history = report["history"]
    assert history[-1]["loss"] < history[1]["loss"]
    trained, cut = report["simulated_mean_acceptance_length"]["3"], report["before_training"]["3"]
    assert trained > cut + 0.5 and trained > 1.8  # training is what makes it a draft


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_distilled_draft_is_lossless_when_served(draft, quantization):
    out, _, _ = draft
    plain = stories()
    spec = stories(max_num_batched_tokens=32, speculative_config={
        "method": "draft_model", "model": str(out), "num_speculative_tokens": 3, "quantization": quantization})
    prompts, params = workload(17)
    assert ids(spec.generate(prompts, params)) == ids(plain.generate(prompts, params))
    stats = spec.llm_engine.speculator.stats
    assert stats.num_accepted_tokens > 0.5 * stats.num_drafts  # it guesses the target's tokens often
    sampled = [SamplingParams(max_tokens=p.max_tokens, temperature=0.9, seed=i, ignore_eos=True) for i, p in enumerate(params)]
    assert ids(spec.generate(prompts, sampled)) == ids(plain.generate(prompts, sampled))
    assert_pool_clean(spec.llm_engine)


def test_bad_draft_requests_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="--draft-layers"):
        run_distill(distill_args(STORIES, tmp_path, method="draft", draft_layers=0))
    with pytest.raises(ConfigError, match="--depth"):
        run_distill(distill_args(STORIES, tmp_path, method="eagle", depth=0))
    with pytest.raises(ConfigError, match="--batch-tokens"):
        run_distill(distill_args(STORIES, tmp_path, method="eagle", batch_tokens=0))
    with pytest.raises(ValueError, match="only for draft_model"):
        stories(speculative_config={"method": "ngram", "quantization": "int8"})
    with pytest.raises(ValueError, match="int8, fp8 or int4"):
        stories(speculative_config={"method": "draft_model", "model": "x", "quantization": "q3"})


def test_the_targets_answers_are_kept_and_reused(draft, tmp_path, capsys, monkeypatch):
    """One generation serves several trainings (--answers FILE); other settings or prompts generate again."""
    _, report, answers = draft
    saved = json.loads(answers.read_text())
    assert 0 < len(saved["answers"]) <= report["prompts"] and saved["key"]["max_tokens"] == 96  # (prompts too long: left out)
    capsys.readouterr()
    run_distill(distill_args(STORIES, tmp_path / "m", epochs=1, answers=str(answers)))
    assert "answers read from" in capsys.readouterr().out
    run_distill(distill_args(STORIES, tmp_path / "m2", epochs=1, max_tokens=32, answers=str(answers)))
    assert "answers read from" not in capsys.readouterr().out
    assert json.loads(answers.read_text())["key"]["max_tokens"] == 32
    from sieve.train import distill  # the same settings and number of prompts, other prompts: generated again

    monkeypatch.setattr(distill, "TEMPLATES", [t + " Please." for t in distill.TEMPLATES])
    run_distill(distill_args(STORIES, tmp_path / "m3", epochs=1, max_tokens=32, answers=str(answers)))
    assert "answers read from" not in capsys.readouterr().out


class _Tok:
    chat_template = "fake"
    all_special_tokens = ["<|im_start|>", "<|im_end|>"]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        assert not tokenize and not add_generation_prompt
        return "<sys>be helpful</sys><user>" + messages[0]["content"] + "</user>"

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


class _LLM:
    """Stands in for the target: hands out scripted completions, records what it was asked."""

    def __init__(self, completions):
        self.completions, self.calls = list(completions), []

    def get_tokenizer(self):
        return _Tok()

    def generate(self, prompts, params):
        from types import SimpleNamespace

        self.calls.append((prompts, params))
        out, self.completions = self.completions[: len(prompts)], self.completions[len(prompts):]
        out += [("", "length")] * (len(prompts) - len(out))
        return [SimpleNamespace(outputs=[SimpleNamespace(text=t, finish_reason=f)]) for t, f in out]


def test_magpie_questions_come_from_the_targets_own_user_turn():
    """--prompt-source magpie: the target is given its chat template up to the user's text and writes the question;
    cut, short, special-token, repeated and benchmark questions are dropped, and sampling goes on until n are kept,
    each request with its own seed."""
    from sieve.bench.spec import CHAT_PROMPTS
    from sieve.train.distill import magpie_messages, prompt_messages

    first = [("How do tides work?", "stop"), ("Explain recursion with an example, please.", "length"),  # cut: dropped
             ("Hi there", "stop"), ("  how do  TIDES work? ", "stop"), (CHAT_PROMPTS[0], "stop"),
             ("What is <|im_start|> for?", "stop"), ("Plan a three day trip to Lisbon for me.", "stop")]
    llm = _LLM(first + [("", "length")] * 5 + [("Why is the sea salty, really?", "stop")])
    got = magpie_messages(llm, 3, seed=7)
    assert [m[0]["content"] for m in got] == ["How do tides work?", "Plan a three day trip to Lisbon for me.",
                                              "Why is the sea salty, really?"]
    assert all(m[0]["role"] == "user" for m in got)
    assert len(llm.calls) == 2  # a second round for the one still missing
    prefix = [ord(c) for c in "<sys>be helpful</sys><user>"]
    params = [p for prompts, ps in llm.calls for p in ps]
    assert all(p["prompt_token_ids"] == prefix for prompts, _ in llm.calls for p in prompts)
    assert all(p.temperature == 1.0 for p in params) and len({p.seed for p in params}) == len(params)
    with pytest.raises(ConfigError, match="unknown"):
        prompt_messages(llm, "shakespeare", 3)
    llm.get_tokenizer = lambda: None
    with pytest.raises(ConfigError, match="chat template"):
        magpie_messages(llm, 3)


def test_the_held_out_tenth_is_whole_prompt_families():
    """The held-out answers that measure a draft share no prompt family with the trained ones: the templates' prompts
    differ only in their topic, Magpie's questions repeat their openings, and a
    draft that memorised a family's answers overstated served acceptance 1.7x when a held-out prompt's family was
    also trained on (docs/design-notes.md, issue 15, fifteenth part)."""
    from sieve.train.distill import TEMPLATES, distill_messages, held_out_split, prompt_family

    texts = [m[0]["content"] for m in distill_messages(600, seed=0)]
    families = [prompt_family(t) for t in texts]
    for i, t in enumerate(TEMPLATES):
        assert prompt_family(t.format(t="penguins")) == prompt_family(t.format(t="the Roman Empire")) == f"template {i}"
    assert len(set(texts)) == 600  # (the code task repeated 7 functions: 75 prompts, identical answers)
    code = [t for t, f in zip(texts, families) if f.startswith("code")]
    assert len(code) == 75 and len({f for f in families if f.startswith("code")}) == 75  # a family per function
    assert prompt_family(code[0] + "\n") == prompt_family(code[0])
    assert prompt_family("Can you provide a plan for my trip?") == prompt_family("can you PROVIDE me ideas") \
        == "opening can you provide"
    for seed in range(5):
        held, train, how = held_out_split(families, 0.1, seed)
        assert how == "family" and sorted(held + train) == list(range(600))
        assert not {families[i] for i in held} & {families[i] for i in train}
        assert 60 <= len(held) <= 120
        for kind, size in (("template", 450), ("passage", 75), ("code", 75)):  # each kind held out alike
            assert 0.08 * size <= sum(families[i].startswith(kind) for i in held) <= 0.34 * size
        assert set(texts[i] for i in held).isdisjoint(texts[i] for i in train)  # no duplicate prompt on both sides
    by_answer = held_out_split(families, 0.1, 0, by="answer")
    assert by_answer[2] == "answer" and len(by_answer[0]) == 60
    assert {families[i] for i in by_answer[0]} & {families[i] for i in by_answer[1]}  # (what the family split avoids)
    # one family, or one that is most of them: answers held out instead, and said so
    assert held_out_split(["a"] * 10, 0.1, 0)[2] == "answer"
    held, train, how = held_out_split(["x a"] * 9 + ["x b"], 0.1, 0)
    assert how == "family" and held == [9]
    with pytest.raises(ConfigError, match="unknown"):
        held_out_split(families, 0.1, 0, by="prompt")
    with pytest.raises(ConfigError, match="at least 2"):
        held_out_split(["a"], 0.1, 0)


def test_answers_files_record_which_prompts_they_answer(draft):
    """The distilled draft was measured on whole families (the report says which), and its answers file records
    which prompts fit the context (the families are those prompts')."""
    _, report, answers = draft
    saved = json.loads(answers.read_text())
    assert len(saved["kept"]) == len(saved["answers"]) and saved["kept"] == sorted(set(saved["kept"]))
    assert report["held_out_by"] == "family" and report["held_out_families"]
    assert report["target"].rstrip("/").endswith("stories260K")  # the model trained against, not the flag's text
    assert 0 < report["held_out_answers"] < len(saved["answers"]) // 2
    from sieve.bench.spec import simulated_acceptance  # what `sieve bench spec` prints next to the served figure

    out = draft[0]
    assert simulated_acceptance({"method": "draft_model", "model": str(out), "num_speculative_tokens": 3}) == \
        (report["simulated_mean_acceptance_length"]["3"], "family")
