"""Incremental detokenization that is right for multi-byte characters.

Decoding token by token breaks characters that span several byte-level tokens and loses the
leading-space rules of SentencePiece. We decode a short window that starts a few tokens back and
emit only the text that is new and complete (no trailing U+FFFD), as vLLM and TGI do.
"""

from __future__ import annotations

from sieve.sequence import Sequence

_WINDOW = 5  # tokens of already-emitted context re-decoded for correct spacing


def init_offsets(seq: Sequence) -> None:
    n = seq.num_prompt_tokens
    seq.detok_prefix_offset = max(n - _WINDOW, 0)
    seq.detok_read_offset = n


def decode_new_text(seq: Sequence, tokenizer, skip_special_tokens: bool) -> str:
    """Text added by the tokens appended since the last call ('' while a character is incomplete)."""
    ids = seq.token_ids
    prefix = tokenizer.decode(ids[seq.detok_prefix_offset : seq.detok_read_offset], skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(ids[seq.detok_prefix_offset :], skip_special_tokens=skip_special_tokens)
    if len(full) <= len(prefix) or full.endswith("\ufffd"):
        return ""
    new = full[len(prefix) :]
    seq.detok_prefix_offset = seq.detok_read_offset
    seq.detok_read_offset = len(ids)
    return new
