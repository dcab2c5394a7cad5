"""The grammar engine behind structured outputs: llguidance (a token mask per step, computed on the CPU).

Grammars compile once per distinct constraint (cached by the constraint's hash) into a prototype matcher;
every sequence gets a copy. The engine thread only copies, fills masks and accepts tokens: compiling runs
wherever `compile` is first called (the server calls it on its tokenizer pool, before the request is queued).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from sieve.structured.params import StructuredOutputsParams

# Compact JSON: one space after ',' and ':', no free whitespace (a small model given free whitespace can emit
# newlines forever; the output still parses and validates).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A constraint that cannot be compiled (the message names the construct)."""


class GrammarMatcher:
    """One sequence's position in its grammar: the allowed next tokens, accept, roll back, terminated."""

    __slots__ = ("_m",)

    def __init__(self, matcher) -> None:
        self._m = matcher

    def accept(self, tokens: list[int]) -> bool:
        """Advance over `tokens` (sampled, or verified drafts). False if one is not allowed (the matcher is then
        in error and stays there)."""
        return self._m.consume_tokens(tokens)

    def validate(self, tokens: list[int]) -> int:
        """How many leading `tokens` the grammar allows from here, without advancing."""
        return self._m.validate_tokens(tokens) if tokens else 0

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self._m.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback of {num_tokens} tokens failed: {self._m.get_error()}")

    @property
    def is_terminated(self) -> bool:
        """Nothing but the end can follow (the output is complete), or the matcher is in error."""
        return self._m.is_stopped() or self._m.is_error()

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


@dataclass
class CompiledGrammar:
    key: str
    kind: str
    _prototype: object
    compile_seconds: float

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._prototype.deep_copy())


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe (the server's pool and the engine thread share it)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], cache_size: int = 256):
        self.hf_tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, list(eos_token_ids)
        self.cache_size = cache_size
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._executor = None
        self.num_compiled = self.num_cache_hits = 0
        self.compile_seconds = 0.0

    def _tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance
                import llguidance.hf

                if self.hf_tokenizer is None:
                    raise GrammarError("structured outputs need the model's tokenizer (this engine runs without one)")
                try:
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                                      eos_token=self.eos_token_ids or None)
                except ValueError as e:
                    raise GrammarError(f"structured outputs need a fast tokenizer: {e}") from e
                self._executor = llguidance.LLExecutor()
            return self._ll_tokenizer

    def compile(self, spec: StructuredOutputsParams, deadline_s: float | None = None) -> CompiledGrammar:
        """The constraint's prototype matcher (cached). With `deadline_s`, the compile's own work is bounded to about
        that long: llguidance's lexer fuel (about 50,000 a millisecond) runs out and the compile fails, rather than
        holding a compile thread for as long as a hostile grammar takes."""
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return hit
        import llguidance

        tok = self._tokenizer()
        started = time.perf_counter()
        try:
            text = _grammar_text(spec)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"structured outputs `{spec.kind}`: {e}") from e
        limits = None
        if deadline_s is not None:
            limits = llguidance.LLParserLimits(initial_lexer_fuel=min(1_000_000, max(1, int(50_000 * 1000 * deadline_s))),
                                               verbose_errors=False)
        proto = llguidance.LLMatcher(tok, text, log_level=0, limits=limits)  # drops the GIL while it builds
        if proto.is_error():
            raise GrammarError(f"structured outputs `{spec.kind}` cannot be compiled: {_first_line(proto.get_error())}")
        compiled = CompiledGrammar(key, spec.kind, proto, time.perf_counter() - started)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self.num_compiled += 1
            self.compile_seconds += compiled.compile_seconds
        return compiled

    def fill_bitmask(self, rows: list[tuple["GrammarMatcher", int, list[int]]], num_rows: int) -> torch.Tensor:
        """The allowed-token bitmask [num_rows, ceil(vocab / 32)] (int32, CPU; -1 = every token) for rows
        (matcher, row, drafts): `row` gets the matcher's mask, row + 1 + i its mask after drafts[:i + 1], as far
        as the drafts are allowed (a row past a disallowed draft is never used: that draft is rejected first).
        llguidance's executor fills them in parallel and rolls each matcher back over the drafts itself."""
        import llguidance.torch as llt

        mask = torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        plain = [(m._m, row) for m, row, d in rows if not d]
        drafted = [(m._m, row, list(d)) for m, row, d in rows if d]
        if plain:
            llt.fill_next_token_bitmask_par(self._executor, plain, mask)
        if drafted:
            llt.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, mask)
        return mask


_BITS = {}


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in `logits` [B, V], every token `mask` [B, W] forbids in the given rows (tokens past the
    mask's vocabulary are forbidden; other rows are left alone). On CPU a native kernel (a word of 32
    tokens at a time: 0.1 ms for 32 rows of 49,152 where PyTorch's elementwise ops took 4 to 13 ms)."""
    from sieve.kernels import cpu_ops

    every = len(rows) == mask.shape[0] and rows == list(range(len(rows)))
    words = mask if every else mask.index_select(0, torch.tensor(rows, dtype=torch.int64))
    ops = cpu_ops() if logits.device.type == "cpu" else None
    if ops is not None and logits.dtype == torch.float32 and logits.is_contiguous():
        ops.apply_token_bitmask_(logits, words.contiguous(), torch.tensor(rows, dtype=torch.int64))
        return
    device, V = logits.device, logits.shape[-1]
    bits = _BITS.get(device)
    if bits is None:
        bits = _BITS[device] = torch.arange(32, dtype=torch.int32, device=device)
    idx = torch.tensor(rows, dtype=torch.int64, device=device)
    allowed = ((words.to(device)[:, :, None] >> bits) & 1).reshape(len(rows), -1)[:, :V].bool()
    if allowed.shape[1] < V:
        allowed = torch.cat([allowed, allowed.new_zeros(len(rows), V - allowed.shape[1])], dim=1)
    logits.index_copy_(0, idx, logits.index_select(0, idx).masked_fill_(~allowed, float("-inf")))


def _grammar_text(spec: StructuredOutputsParams) -> str:
    import llguidance

    kind = spec.kind
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.json, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(list(spec.choice)))
    return llguidance.grammar_from("grammar", spec.grammar)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "unknown error"
