"""Structured outputs: output constrained by a JSON schema, a regex, a choice or a grammar.

One small interface between the engine and the grammar engine (llguidance):
    GrammarCompiler.compile(spec) -> CompiledGrammar       (cached by the spec's hash, off the engine thread)
    CompiledGrammar.matcher() -> GrammarMatcher            (one per sequence)
    GrammarMatcher: accept(tokens), rollback(n), validate(tokens), is_terminated
    GrammarCompiler.fill_bitmask(rows) / apply_bitmask(logits, mask)       (the allowed next tokens of every constrained row)
Speculative decoding verifies constrained drafts through the same interface: each drafted row's mask is the
matcher's after the drafts before it, and nothing is consumed until the tokens are accepted.
"""

from sieve.structured.params import StructuredOutputsParams
from sieve.structured.grammar import CompiledGrammar, GrammarCompiler, GrammarError, GrammarMatcher, apply_bitmask

__all__ = ["StructuredOutputsParams", "CompiledGrammar", "GrammarCompiler", "GrammarError", "GrammarMatcher",
           "apply_bitmask"]
