"""Workloads for `sieve bench serve`: what each simulated user sends.

A workload is a list of sessions. A session is one user: an optional system prompt and one or more
turns, sent one after another (a turn is sent when the previous answer has fully arrived). Single-shot
workloads are sessions of one turn; the multi-turn chat workload resends the growing history, with
the answers the server actually gave, at every turn.

    synthetic       seeded random prompt and output lengths in given ranges
    shared-prefix   N long system prompts shared by many requests with short user turns
    multi-turn      conversations of several turns over the chat endpoint
    jsonl:PATH      one request per line: {"prompt": "..."} or {"messages": [...]}, optional "max_tokens"

Prompt lengths are in the model's tokens: text is made by decoding random token ids with the model's
tokenizer and re-encoding (a decoded string can re-tokenize differently, so the text is trimmed to
the asked length after the round trip). The server's `usage` gives the counts that are reported.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Turn:
    user: str  # the text this turn adds (the whole prompt for the completions endpoint)
    max_tokens: int


@dataclass
class Session:
    turns: list[Turn]
    system: str | None = None  # sent before the first user text (a shared prefix)
    chat: bool = False  # /v1/chat/completions with a message list, else /v1/completions with text
    messages: list[dict] | None = None  # a jsonl line's own message list, sent as given

    def first_messages(self) -> list[dict]:
        if self.messages is not None:
            return list(self.messages)
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": "user", "content": self.turns[0].user}]

    def completion_prompt(self, turn: Turn) -> str:
        return (self.system + "\n\n" + turn.user) if self.system else turn.user


class TextMaker:
    """Seeded random text that the given tokenizer encodes to (about) a requested number of tokens."""

    def __init__(self, tokenizer, seed: int = 0):
        self.tok = tokenizer
        self.rng = random.Random(seed)
        pool = getattr(tokenizer, "token_pool", None)  # a tokenizer that cannot list its vocabulary names some ids
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.ids = pool if pool is not None else [i for i in range(len(tokenizer)) if i not in special]

    def text(self, n_tokens: int) -> str:
        ids = [self.rng.choice(self.ids) for _ in range(n_tokens)]
        text = self.tok.decode(ids, skip_special_tokens=True)
        again = self.tok.encode(text, add_special_tokens=False)
        return self.tok.decode(again[:n_tokens], skip_special_tokens=True)


def _span(rng: random.Random, lo_hi: tuple[int, int]) -> int:
    return rng.randint(*lo_hi)


def synthetic(maker: TextMaker, n: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int) -> list[Session]:
    rng = random.Random(seed)
    return [Session([Turn(maker.text(_span(rng, input_len)), _span(rng, output_len))]) for _ in range(n)]


def shared_prefix(maker: TextMaker, n: int, num_prefixes: int, prefix_len: int, input_len: tuple[int, int],
                  output_len: tuple[int, int], seed: int) -> list[Session]:
    """`num_prefixes` system prompts of `prefix_len` tokens; request i uses prefix i mod num_prefixes
    (shuffled), with its own user turn."""
    rng = random.Random(seed)
    prefixes = [maker.text(prefix_len) for _ in range(num_prefixes)]
    order = [i % num_prefixes for i in range(n)]
    rng.shuffle(order)
    return [Session([Turn(maker.text(_span(rng, input_len)), _span(rng, output_len))], system=prefixes[p]) for p in order]


def multi_turn(maker: TextMaker, n: int, turns: int, input_len: tuple[int, int], output_len: tuple[int, int],
               seed: int, system_len: int = 0) -> list[Session]:
    """`n` conversations of `turns` turns each over the chat endpoint; with `system_len`, all of them
    open with the same system prompt of that many tokens (one chat application's)."""
    rng = random.Random(seed)
    system = maker.text(system_len) if system_len > 0 else None
    return [Session([Turn(maker.text(_span(rng, input_len)), _span(rng, output_len)) for _ in range(turns)], chat=True,
                    system=system) for _ in range(n)]


def from_jsonl(path: str | Path, n: int | None, default_max_tokens: int) -> list[Session]:
    sessions = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not JSON ({e})") from None
        max_tokens = int(row.get("max_tokens", default_max_tokens))
        if "messages" in row:
            last = row["messages"][-1]["content"] if row["messages"] else ""
            sessions.append(Session([Turn(last, max_tokens)], chat=True, messages=row["messages"]))
        elif "prompt" in row:
            sessions.append(Session([Turn(str(row["prompt"]), max_tokens)]))
        else:
            raise ValueError(f"{path}:{lineno}: a line needs \"prompt\" or \"messages\"")
        if n is not None and len(sessions) >= n:
            break
    if not sessions:
        raise ValueError(f"{path}: no requests")
    return sessions


@dataclass
class WorkloadSpec:
    dataset: str = "synthetic"  # synthetic | shared-prefix | multi-turn | jsonl:PATH
    num_prompts: int = 64  # requests (synthetic, shared-prefix, jsonl) or conversations (multi-turn)
    input_len: tuple[int, int] = (128, 512)
    output_len: tuple[int, int] = (64, 256)
    num_prefixes: int = 8
    prefix_len: int = 2000
    turns: int = 4
    system_len: int = 0  # multi-turn: one system prompt shared by all conversations
    seed: int = 0

    def build_points(self, tokenizer, num_points: int) -> list[list[Session]]:
        """One workload per load point of a sweep, each from its own seed (jsonl: the same file each time)."""
        return [dataclasses.replace(self, seed=self.seed + 1000 * i).build(tokenizer) for i in range(num_points)]

    def build(self, tokenizer) -> list[Session]:
        if self.dataset.startswith("jsonl:"):
            return from_jsonl(self.dataset.removeprefix("jsonl:"), self.num_prompts, self.output_len[1])
        if tokenizer is None:
            raise ValueError(f"the {self.dataset} workload needs the model's tokenizer: pass --tokenizer")
        maker = TextMaker(tokenizer, self.seed)
        if self.dataset == "synthetic":
            return synthetic(maker, self.num_prompts, self.input_len, self.output_len, self.seed)
        if self.dataset == "shared-prefix":
            return shared_prefix(maker, self.num_prompts, self.num_prefixes, self.prefix_len, self.input_len,
                                 self.output_len, self.seed)
        if self.dataset == "multi-turn":
            return multi_turn(maker, self.num_prompts, self.turns, self.input_len, self.output_len, self.seed,
                              self.system_len)
        raise ValueError(f"unknown dataset {self.dataset!r}: use synthetic, shared-prefix, multi-turn or jsonl:PATH")
