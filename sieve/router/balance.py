"""Which replica of a backend takes a request: data-parallel replicas behind one name.

- `cache_aware` (default; SGLang's router's idea, bounded by load): the prompt is cut into blocks chained by
  hash, as the engine hashes KV blocks, and each replica remembers the blocks it was sent (LRU). The replica
  holding the longest leading run of the request's blocks takes it, unless it has more than `balance_abs`
  requests in flight above the least-loaded replica; otherwise the least-loaded one does. A multi-turn
  conversation resends its history, so it stays where its KV is.
- `round_robin`, `least_load`: the baselines.
The gateway cannot see token ids without a tokenizer per backend, so blocks are `block_chars` characters of
the request's text (roles and contents): the same prefix of text is the same prefix of tokens."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict

POLICIES = ("cache_aware", "round_robin", "least_load")


def prompt_blocks(body: dict, block_chars: int = 64) -> list[bytes]:
    if "messages" in body:
        text = "".join(f"<{m.get('role')}>" + (m.get("content") if isinstance(m.get("content"), str) else json.dumps(m.get("content")))
                       for m in body.get("messages") or [] if isinstance(m, dict))
    else:
        prompt = body.get("prompt")
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
    data = text.encode()
    blocks, prev = [], b""
    for start in range(0, len(data) - block_chars + 1, block_chars):  # full blocks only, as in the KV cache
        prev = hashlib.blake2b(prev + data[start:start + block_chars], digest_size=8).digest()
        blocks.append(prev)
    return blocks


class Balancer:
    def __init__(self, urls: list[str], policy: str = "cache_aware", balance_abs: int = 4, max_blocks: int = 200_000):
        if policy not in POLICIES:
            raise ValueError(f"balancing policy {policy!r} is not one of {', '.join(POLICIES)}")
        self.urls, self.policy, self.balance_abs, self.max_blocks = list(urls), policy, balance_abs, max_blocks
        self.inflight = {u: 0 for u in urls}
        self._blocks = {u: OrderedDict() for u in urls}
        self._next = 0
        self.matched_blocks = 0
        self.total_blocks = 0

    def _match(self, url: str, blocks: list[bytes]) -> int:
        held = self._blocks[url]
        n = 0
        for b in blocks:
            if b not in held:
                break
            n += 1
        return n

    def pick(self, blocks: list[bytes], candidates: list[str]) -> tuple[str, str]:
        """(url, reason): reason is `prefix` (affinity), `load` (least loaded), `round_robin`, or `only`."""
        if len(candidates) == 1:
            return candidates[0], "only"
        if self.policy == "round_robin":
            url = candidates[self._next % len(candidates)]
            self._next += 1
            return url, "round_robin"
        least = min(self.inflight[u] for u in candidates)
        if self.policy == "cache_aware" and blocks:
            scored = [(self._match(u, blocks), -self.inflight[u], u) for u in candidates]
            match, neg_load, url = max(scored, key=lambda t: (t[0], t[1], -candidates.index(t[2])))
            if match > 0 and -neg_load - least <= self.balance_abs:
                return url, "prefix"
        idle = [u for u in candidates if self.inflight[u] == least]
        url = idle[self._next % len(idle)]  # ties rotate, so that an idle pool spreads new conversations
        self._next += 1
        return url, "load"

    def sent(self, url: str, blocks: list[bytes]) -> None:
        """The request went to `url`: count what it matched there, and remember that it holds these blocks now."""
        self.matched_blocks += self._match(url, blocks)
        self.total_blocks += len(blocks)
        held = self._blocks[url]
        for b in blocks:
            held[b] = None
            held.move_to_end(b)
        while len(held) > self.max_blocks:
            held.popitem(last=False)
