"""Routes, chosen by the request's model name:

- `<backend>`: that backend.
- `route:learned[:T | :S%]`: the classifier's score (P(strong needed)) against threshold T, or the threshold
  that sends S% of the reference prompts to the strong model. Default: 50%.
- `route:cascade[:METRIC][:T]`: the weak model answers first, with logprobs; its answer stands when its
  confidence passes T, otherwise the strong model answers. METRIC: `mean` (mean token logprob >= T, default
  T -0.5), `min` (lowest token logprob >= T, default -3), `entropy` (mean entropy of the top-20 distribution
  <= T nats, default 0.5).
- `route:budget[:cap | :prompt][:<backend>]`: TALE-style token budget per query, by default on the strong
  backend. `cap` lowers max_tokens to the budget; `prompt` states the budget in the prompt as TALE does.
  The request's `reasoning_effort` (low, medium, high) scales the budget.

Everything here is pure and deterministic: the gateway does the I/O."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from sieve.router.embed import words


class RouteError(ValueError):
    pass


@dataclass(frozen=True)
class Route:
    policy: str  # backend | learned | cascade | budget
    backend: str | None = None  # `backend` and `budget`
    threshold: float | None = None
    share: float | None = None  # learned: a target share of strong calls
    metric: str = "mean"  # cascade
    mode: str = "cap"  # budget

    @property
    def label(self) -> str:
        return self.policy if self.policy != "backend" else "direct"


CASCADE_DEFAULTS = {"mean": -0.5, "min": -3.0, "entropy": 0.5}
EFFORT_SCALE = {"low": 0.5, "medium": 1.0, "high": 2.5}


def _number(s: str, what: str) -> float:
    try:
        value = float(s)
    except ValueError:
        raise RouteError(f"{what}: {s!r} is not a number") from None
    if not math.isfinite(value):
        raise RouteError(f"{what}: {s!r} is not a finite number")
    return value


def parse_route(name: str, backends: set[str], aliases: dict[str, str]) -> Route:
    """The route a model name asks for; `RouteError` (a 400/404 at the gateway) when it names nothing."""
    target = aliases.get(name, name)
    if target in backends:
        return Route("backend", backend=target)
    if not target.startswith("route:"):
        raise RouteError(f"the model {name!r} does not exist: use a backend ({', '.join(sorted(backends))}), "
                         f"an alias ({', '.join(sorted(aliases)) or 'none configured'}) or route:learned|cascade|budget")
    policy, *args = target[len("route:"):].split(":")
    if policy == "learned":
        if len(args) > 1:
            raise RouteError(f"{target}: expected route:learned[:THRESHOLD | :SHARE%]")
        if not args:
            return Route("learned", share=0.5)
        if args[0].endswith("%"):
            share = _number(args[0][:-1], target) / 100
            if not 0 <= share <= 1:
                raise RouteError(f"{target}: a strong-call share is between 0% and 100%")
            return Route("learned", share=share)
        return Route("learned", threshold=_number(args[0], target))
    if policy == "cascade":
        metric = "mean"
        if args and args[0] in CASCADE_DEFAULTS:
            metric, args = args[0], args[1:]
        if len(args) > 1:
            raise RouteError(f"{target}: expected route:cascade[:mean|min|entropy][:THRESHOLD]")
        threshold = _number(args[0], target) if args else CASCADE_DEFAULTS[metric]
        return Route("cascade", metric=metric, threshold=threshold)
    if policy == "budget":
        mode, backend = "cap", None
        for arg in args:
            if arg in ("cap", "prompt"):
                mode = arg
            elif arg in backends:
                backend = arg
            else:
                raise RouteError(f"{target}: {arg!r} is neither a budget mode (cap, prompt) nor a backend")
        return Route("budget", backend=backend, mode=mode)
    raise RouteError(f"{target}: unknown routing policy {policy!r} (learned, cascade, budget)")


# ---- the text a policy looks at --------------------------------------------------------------
def prompt_text(body: dict) -> str:
    """The request's text for the classifier and the budget: the last user message, or the prompt."""
    if "messages" in body:
        for m in reversed(body.get("messages") or []):
            if isinstance(m, dict) and m.get("role") == "user":
                content = m.get("content")
                if isinstance(content, list):
                    return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
                return content if isinstance(content, str) else ""
        return ""
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return " ".join(p for p in prompt if isinstance(p, str))
    return prompt if isinstance(prompt, str) else ""


def conversation_text(body: dict) -> str:
    """Everything a request's answer depends on in text: every message with its role (the system prompt too), or the
    prompt. What the semantic cache compares, so that an answer given under one conversation never serves another."""
    if "messages" not in body:
        return prompt_text(body)
    parts = []
    for m in body.get("messages") or []:
        if isinstance(m, dict):
            content = m.get("content")
            text = " ".join(p.get("text", "") for p in content if isinstance(p, dict)) if isinstance(content, list) else str(content or "")
            parts.append(f"<{m.get('role')}> {text}")
    return "\n".join(parts)


# ---- cascade -------------------------------------------------------------------------------
def token_logprobs(choice: dict) -> tuple[list[float], list[list[float]]]:
    """Per generated token: its logprob, and the logprobs of the top alternatives (chat or completions shape)."""
    lp = choice.get("logprobs") or {}
    if "content" in lp:  # chat
        rows = lp.get("content") or []
        return ([float(r["logprob"]) for r in rows],
                [[float(t["logprob"]) for t in (r.get("top_logprobs") or [])] for r in rows])
    return ([float(x) for x in (lp.get("token_logprobs") or []) if x is not None],
            [[float(v) for v in (d or {}).values()] for d in (lp.get("top_logprobs") or [])])


def confidence(choice: dict, metric: str) -> float:
    chosen, tops = token_logprobs(choice)
    if not chosen:
        return -math.inf if metric != "entropy" else math.inf
    if metric == "mean":
        return sum(chosen) / len(chosen)
    if metric == "min":
        return min(chosen)
    total = 0.0  # entropy of each position's top-k distribution, renormalised
    for row in tops:
        if not row:
            continue
        probs = [math.exp(x) for x in row]
        z = sum(probs)
        total -= sum(p / z * math.log(p / z) for p in probs if p > 0)
    return total / len(chosen)


def accept(score: float, metric: str, threshold: float) -> bool:
    """The cascade's rule: the weak answer stands when its confidence passes the threshold."""
    return score <= threshold if metric == "entropy" else score >= threshold


# ---- budget --------------------------------------------------------------------------------
BASE_BUDGET = 48


def estimate_budget(text: str, effort: str | None = None) -> int:
    """A token budget for the query (TALE's zero-shot estimate, without the extra model call): grows with
    the question's length and with the numbers and operations it involves, scaled by reasoning_effort."""
    if effort is not None and effort not in EFFORT_SCALE:
        raise RouteError(f"reasoning_effort must be one of low, medium, high, not {effort!r}")
    w = words(text)
    numbers = sum(1 for x in w if x.isdigit())
    ops = len(re.findall(r"[+\-*/×÷=]", text)) + sum(1 for x in w if x in {"sum", "product", "difference", "times",
                                                                          "total", "how", "why", "explain", "step"})
    budget = BASE_BUDGET + 0.5 * len(w) + 12 * numbers + 16 * ops
    return int(max(16, min(2048, budget * EFFORT_SCALE[effort or "medium"])))


def apply_budget(body: dict, budget: int, mode: str) -> dict:
    """A copy of the body under the budget: `cap` lowers max_tokens (never raises it); `prompt` adds TALE's
    instruction to the last user message (or the prompt)."""
    body = dict(body)
    if mode == "cap":
        for key in ("max_completion_tokens", "max_tokens"):
            if body.get(key) is not None:
                body[key] = min(int(body[key]), budget)
                return body
        body["max_tokens"] = budget
        return body
    note = f"\nLet's think step by step and use less than {budget} tokens."
    if "messages" in body:
        messages = [dict(m) for m in body["messages"]]
        for m in reversed(messages):
            if m.get("role") == "user" and isinstance(m.get("content"), str):
                m["content"] += note
                break
        body["messages"] = messages
    elif isinstance(body.get("prompt"), str):
        body["prompt"] += note
    return body
