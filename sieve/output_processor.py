"""After sampling: append tokens, detokenize, check stop conditions, and build `RequestOutput`s."""

from __future__ import annotations

import time

from sieve.detokenizer import decode_new_text
from sieve.outputs import CompletionOutput, Logprob, RequestOutput
from sieve.sequence import Request, Sequence


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len

    def append_token(self, seq: Sequence, token_id: int, logprobs: dict[int, Logprob] | None) -> None:
        """Add one sampled token to `seq`; sets seq.finish_reason if it ends the sequence."""
        p = seq.params
        seq.token_ids.append(token_id)
        if logprobs is not None:
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token_id].logprob
        n_out = seq.num_output_tokens
        may_stop = n_out >= p.min_tokens
        is_stop_token = (not p.ignore_eos and token_id in self.eos_token_ids) or token_id in p.stop_token_ids
        if may_stop and is_stop_token:  # the stop token itself adds no text
            seq.finish_reason, seq.stop_reason = "stop", token_id
            return
        if self.tokenizer is not None:
            seq.output_text += decode_new_text(seq, self.tokenizer, p.skip_special_tokens)
        if may_stop and p.stop_strings and self._check_stop_strings(seq):
            return
        if (p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    def _check_stop_strings(self, seq: Sequence) -> bool:
        text, p = seq.output_text, seq.params
        longest = max(len(s) for s in p.stop_strings)
        # Only the tail can hold a stop string that was not there before this token.
        search_from = max(0, seq.num_text_emitted - longest)
        best = None
        for s in p.stop_strings:
            i = text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        seq.output_text = text[: i + len(s)] if p.include_stop_str_in_output else text[:i]
        seq.finish_reason, seq.stop_reason = "stop", s
        return True

    def make_output(self, req: Request) -> RequestOutput:
        """Snapshot of a request; also advances each choice's streamed position (deltas)."""
        outputs, deltas = [], []
        for seq in req.seqs:
            text = seq.output_text
            # Hold back a tail that could still grow into a stop string.
            hold = 0 if seq.finish_reason else max((len(s) - 1 for s in seq.params.stop_strings), default=0)
            visible = max(seq.num_text_emitted, len(text) - hold)
            deltas.append((text[seq.num_text_emitted : visible], seq.output_token_ids[seq.num_tokens_emitted :]))
            seq.num_text_emitted = visible
            seq.num_tokens_emitted = seq.num_output_tokens
            outputs.append(CompletionOutput(
                index=seq.index,
                text=text,
                token_ids=list(seq.output_token_ids),
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
            ))
        finished = req.finished
        if finished and req.metrics.finished_time is None:
            req.metrics.finished_time = time.monotonic()
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            metrics=req.metrics,
            num_cached_tokens=min(s.num_cached_tokens for s in req.seqs),
            kv_tier_tokens=dict(req.kv_tier_tokens),
            kv_kept_tokens=req.kv_kept_tokens,
            prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
            embedding=req.pooler.result() if finished and req.pooler is not None and req.pooler.done else None,
            deltas=deltas,
        )
