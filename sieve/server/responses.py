"""Engine outputs in OpenAI's shapes: the whole response (completions and chat, tool calls, echo, logprobs, vLLM's
prompt_logprobs, usage) and the pieces a stream's chunks are built from."""

from __future__ import annotations

import json

from sieve.outputs import RequestOutput
from sieve.server.tools import parse_tool_calls, tool_names


def offsets(tokens: list[str], base: int) -> list[int]:
    out, pos = [], base
    for s in tokens:
        out.append(pos)
        pos += len(s)
    return out


class ResponseFormat:
    """Turns RequestOutputs into OpenAI's JSON for one served model; `report_cached`: whether usage tells
    cached_tokens (not when the prefix cache is shared between tenants)."""

    def __init__(self, tokenizer, model_name: str, report_cached: bool = True):
        self.tokenizer, self.model_name, self.report_cached = tokenizer, model_name, report_cached

    def chunk(self, rid: str, obj: str, created: int, choices: list, **extra) -> str:
        return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": choices,
                                      **extra}) + "\n\n"

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def token_str(self, t: int) -> str:
        return self.tokenizer.decode([t]) if self.tokenizer is not None else f"token_id:{t}"

    def prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.decode(out.prompt_token_ids)

    def prompt_logprobs_openai(self, out: RequestOutput, n_top: int) -> dict:
        """The legacy completions shape for the prompt's tokens (as `echo` returns them): the first token
        has no logprob (null), every later one its own and the top `n_top`."""
        tokens = [self.token_str(t) for t in out.prompt_token_ids]
        logprobs, tops = [None], [None]
        for t, lp in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
            logprobs.append(lp[t].logprob)
            tops.append({self.token_str(k): v.logprob for k, v in lp.items() if v.rank <= n_top or k == t})
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets(tokens, 0)}

    def prompt_logprobs_vllm(self, out: RequestOutput) -> list:
        """vLLM's `prompt_logprobs`: per prompt token, null for the first, then {token id: {logprob, rank, decoded_token}}."""
        return [None if lp is None else {str(k): {"logprob": v.logprob, "rank": v.rank, "decoded_token": self.token_str(k)}
                                         for k, v in lp.items()} for lp in out.prompt_logprobs]

    def logprobs(self, c, start: int, chat: bool, n_top: int, text_base: int = 0) -> dict:
        """OpenAI logprobs for tokens [start:] of choice `c`: the chosen token's and the top `n_top`; `text_base`:
        where these tokens' text begins in the choice's text (`text_offset`)."""
        ids, lps = c.token_ids[start:], c.logprobs[start:]
        if chat:
            def entry(t, logprob):
                s = self.token_str(t)
                return {"token": s, "logprob": logprob, "bytes": list(s.encode())}

            return {"content": [
                {**entry(t, lp[t].logprob),
                 "top_logprobs": [entry(k, v.logprob) for k, v in sorted(lp.items(), key=lambda kv: kv[1].rank) if v.rank <= n_top]}
                for t, lp in zip(ids, lps)
            ]}
        tokens = [self.token_str(t) for t in ids]
        return {"tokens": tokens, "token_logprobs": [lp[t].logprob for t, lp in zip(ids, lps)],
                "top_logprobs": [{self.token_str(k): v.logprob for k, v in lp.items()} for lp in lps],
                "text_offset": offsets(tokens, text_base)}

    def chat_choice(self, c, index: int, body, n_top: int) -> dict:
        lp = self.logprobs(c, 0, True, n_top) if c.logprobs is not None else None
        message, reason = {"role": "assistant", "content": c.text}, c.finish_reason
        if getattr(body, "tool_mode", False):
            message["content"], calls = parse_tool_calls(c.text, tool_names(body.tools), body.parallel_tool_calls is not False)
            if calls:
                message["tool_calls"] = calls
                reason = "tool_calls" if reason == "stop" else reason
        return {"index": index, "message": message, "logprobs": lp, "finish_reason": reason}

    def completion_choice(self, out: RequestOutput, c, index: int, body, n_top: int) -> dict:
        echo = getattr(body, "echo", False)
        prefix = self.prompt_text(out) if echo else ""
        lp = self.logprobs(c, 0, False, n_top, len(prefix)) if c.logprobs is not None else None
        if echo and body.logprobs is not None:  # the prompt's tokens first, scored by the tokens before them
            scored = self.prompt_logprobs_openai(out, n_top)
            lp = {k: scored[k] + v for k, v in lp.items()} if lp is not None else scored  # max_tokens 0: the prompt alone
        choice = {"index": index, "text": prefix + c.text, "logprobs": lp, "finish_reason": c.finish_reason}
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs_vllm(out)
        return choice

    def full_response(self, rid: str, created: int, finals: list[RequestOutput], n: int, chat: bool, body, n_top: int) -> dict:
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for p_idx, out in enumerate(finals):
            prompt_tokens += len(out.prompt_token_ids)
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                index = p_idx * n + c.index
                choices.append(self.chat_choice(c, index, body, n_top) if chat else self.completion_choice(out, c, index, body, n_top))
        extra = {"prompt_logprobs": self.prompt_logprobs_vllm(finals[0])} if chat and body.prompt_logprobs is not None else {}
        if finals[0].kv_transfer_params is not None:  # a prefill server's answer: where the decode server finds the KV
            extra["kv_transfer_params"] = finals[0].kv_transfer_params
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created, "model": self.model_name,
                "choices": choices, **extra,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": self.cached_details(finals)}}

    def cached_details(self, finals: list[RequestOutput]) -> dict:
        """usage.prompt_tokens_details: `cached_tokens` (the prefix cache's hits), and of those, per KV tier below the
        pool, the tokens loaded from it (`kv_tier_tokens`, only where a tier served some). Neither where the prefix cache
        is shared between tenants."""
        if not self.report_cached:
            return {"cached_tokens": 0, **self.kept_details(finals)}
        tiers: dict[str, int] = {}
        for o in finals:
            for tier, n in o.kv_tier_tokens.items():
                tiers[tier] = tiers.get(tier, 0) + n
        return {"cached_tokens": sum(o.num_cached_tokens for o in finals), **({"kv_tier_tokens": tiers} if tiers else {}),
                **self.kept_details(finals)}

    @staticmethod
    def kept_details(finals: list[RequestOutput]) -> dict:
        """KV compression: `kv_kept_tokens`, the prompt positions its press kept (per layer and KV head), where it ran."""
        kept = [o.kv_kept_tokens for o in finals if o.kv_kept_tokens is not None]
        return {"kv_kept_tokens": sum(kept)} if kept else {}
