"""`speculative_config`: vLLM's shape (a dict, or JSON on the command line), validated once."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "suffix", "draft_model", "eagle", "eagle3", "medusa")  # eagle3: an EAGLE layer fusing inner layers
# Chains in one draft tree: each is its own group of 1 + k decode rows with a block of its own, taken from the step's
# token budget and the free blocks after every sequence's own rows (the scheduler drops the chains that do not fit). Where
# a verified row is nearly free (a GPU's launch-bound decode) 16-32 chains still pay (docs/design-notes.md, issue 15).
MAX_BRANCHES = 64


@dataclass
class SpeculativeConfig:
    method: str
    # Draft tokens per sequence per step, or "auto": chosen each step per sequence from acceptance and
    # the measured cost of the step (sieve/spec_decode/controller.py), up to `max_num_speculative_tokens`.
    num_speculative_tokens: int | str = 4
    max_num_speculative_tokens: int = 8  # the ceiling of "auto"
    # A draft tree of `num_branches` chains, all verified in the same target pass, the chain with the longest accepted
    # prefix going on. eagle branches at the root (its likeliest first tokens, each continued greedily); medusa takes
    # its first head's likeliest tokens, each followed by the later heads' guesses; ngram the different continuations
    # of its matches, most recent first. Greedy requests without a grammar (others draft one chain). With "auto" it is
    # the widest: each sequence's width is chosen each step with its depth, from what further chains were measured to
    # add and what their rows cost (sieve/spec_decode/controller.py).
    num_branches: int = 1
    model: str | None = None  # draft_model / eagle / medusa: the checkpoint of the draft or heads
    quantization: str | None = None  # draft_model: the draft's weight format (as --quantization: int8, fp8, int4)
    # ngram (prompt lookup): the longest match of the sequence's last n tokens, n from max down to min.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # suffix (Arctic Inference's suffix decoding; vLLM's names)
    suffix_decoding_max_tree_depth: int = 24  # longest context matched
    suffix_decoding_max_cached_requests: int = 1000  # past outputs kept in the global index
    suffix_decoding_min_token_prob: float = 0.1  # stop drafting when the path's estimated probability drops below

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        if "method" not in value:
            raise ValueError(f"speculative_config needs a 'method': one of {', '.join(METHODS)}")
        config = cls(**value)
        config.validate()
        return config

    @property
    def auto(self) -> bool:
        return self.num_speculative_tokens == "auto"

    @property
    def max_k(self) -> int:
        """The most draft tokens one sequence may be given in a step."""
        return self.max_num_speculative_tokens if self.auto else int(self.num_speculative_tokens)

    def validate(self) -> None:
        def positive_int(name: str, value) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}")

        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not self.auto:
            positive_int("num_speculative_tokens (or \"auto\")", self.num_speculative_tokens)
        positive_int("max_num_speculative_tokens", self.max_num_speculative_tokens)
        positive_int("num_branches", self.num_branches)
        if self.num_branches > 1:
            if self.method not in ("eagle", "eagle3", "medusa", "ngram"):
                raise ValueError(f"speculative_config.num_branches > 1 takes a proposer with several guesses (eagle, eagle3, medusa "
                                 f"or ngram); {self.method!r} drafts one chain")
            if self.num_branches > MAX_BRANCHES:
                raise ValueError(f"speculative_config.num_branches must be at most {MAX_BRANCHES}, got {self.num_branches}")
        positive_int("prompt_lookup_min", self.prompt_lookup_min)
        positive_int("prompt_lookup_max", self.prompt_lookup_max)
        positive_int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth)
        positive_int("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("speculative_config.suffix_decoding_min_token_prob must be in [0, 1], "
                             f"got {self.suffix_decoding_min_token_prob!r}")
        if self.method in ("draft_model", "eagle", "eagle3", "medusa") and not self.model:
            raise ValueError(f"speculative_config: method {self.method!r} needs \"model\": the path of the "
                             f"{'draft checkpoint' if self.method == 'draft_model' else 'heads trained by `sieve distill`'}")
        if self.quantization is not None and self.method != "draft_model":
            raise ValueError("speculative_config.quantization is the draft model's weight format: only for draft_model")
        if self.quantization not in (None, "int8", "fp8", "int4"):
            raise ValueError(f"speculative_config.quantization must be int8, fp8 or int4, got {self.quantization!r}")
        if self.method in ("ngram", "suffix") and self.model:
            raise ValueError(f"speculative_config: method {self.method!r} takes no \"model\"")
