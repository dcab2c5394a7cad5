"""Tasks with checkable answers for `sieve router eval`: a jsonl of {"prompt": ..., "answer": str | [str]}.

`builtin_tasks()` writes sieve's own, from data on this machine: capitals (a fact list written here),
arithmetic of growing difficulty, sums explained step by step (`"match": "stated"`: right when the output
states the answer anywhere, as "= 11", "is 11" or "equals 11"; `"budget": true`: the budget runs use them), and recall of a word from a sentence of ../shared/data (TinyStories). A
numeric answer is right when the first number after the output's first "=" (or, without one, its
first number) equals it; a text answer when one of the
accepted strings appears in the output as a whole word (case-insensitive)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from sieve.data import shared_data

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon", "Japan": "Tokyo",
    "China": "Beijing", "Russia": "Moscow", "Egypt": "Cairo", "Greece": "Athens", "Ireland": "Dublin", "Austria": "Vienna",
    "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki", "Denmark": "Copenhagen", "Poland": "Warsaw",
    "Hungary": "Budapest", "Belgium": "Brussels", "the Netherlands": "Amsterdam", "Canada": "Ottawa", "Australia": "Canberra",
    "Mexico": "Mexico City", "Argentina": "Buenos Aires", "Peru": "Lima", "Chile": "Santiago", "Colombia": "Bogota",
    "Kenya": "Nairobi", "Nigeria": "Abuja", "Ghana": "Accra", "Ethiopia": "Addis Ababa", "Morocco": "Rabat",
    "Turkey": "Ankara", "Iran": "Tehran", "Iraq": "Baghdad", "India": "New Delhi", "Pakistan": "Islamabad",
    "Thailand": "Bangkok", "Vietnam": "Hanoi", "Indonesia": "Jakarta", "the Philippines": "Manila",
    "South Korea": "Seoul", "Cuba": "Havana", "Venezuela": "Caracas", "Ukraine": "Kyiv", "Romania": "Bucharest",
    "Bulgaria": "Sofia", "Serbia": "Belgrade", "Croatia": "Zagreb", "the Czech Republic": "Prague", "Switzerland": "Bern",
    "Iceland": "Reykjavik", "New Zealand": "Wellington", "Brazil": "Brasilia", "Saudi Arabia": "Riyadh",
    "Afghanistan": "Kabul", "Nepal": "Kathmandu", "Bangladesh": "Dhaka", "Malaysia": "Kuala Lumpur", "Syria": "Damascus",
}

_NUMBER = re.compile(r"-?\d[\d,]*")


def builtin_tasks(data_dir: Path | None = None, seed: int = 0, arithmetic: int = 120, recall: int = 60, steps: int = 40) -> list[dict]:
    rng = random.Random(seed)
    tasks = [{"prompt": f"What is the capital of {country}? Answer with the city name.", "answer": city, "kind": "capital"}
             for country, city in CAPITALS.items()]
    for i in range(arithmetic):
        level = i % 3
        a, b = (rng.randint(1, 9), rng.randint(1, 9)) if level == 0 else (rng.randint(10, 99), rng.randint(10, 99))
        op = "+" if level < 2 else rng.choice("+-")
        value = a + b if op == "+" else a - b
        tasks.append({"prompt": f"What is {a} {op} {b}? Answer with the number.", "answer": str(value), "kind": f"arithmetic{level}"})
    for _ in range(steps):  # reasoning the model writes out: what token budgets act on (the eval's budget runs use these)
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        tasks.append({"prompt": f"What is {a} + {b}? Explain your reasoning step by step.", "answer": str(a + b),
                      "kind": "steps", "match": "stated", "budget": True})
    data_dir = data_dir or shared_data()
    stories = data_dir / "tinystories_valid_sample.txt"
    if stories.is_file() and recall:
        sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", stories.read_text()) if 6 <= len(s.split()) <= 14]
        for s in rng.sample(sentences, min(recall, len(sentences))):
            words = re.findall(r"[A-Za-z]+", s)
            tasks.append({"prompt": f'Here is a sentence: "{s}" What is the first word of the sentence?',
                          "answer": words[0], "kind": "recall"})
    return tasks


def load_tasks(path: str) -> list[dict]:
    if path == "builtin":
        return builtin_tasks()
    tasks = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        if not isinstance(d, dict) or not isinstance(d.get("prompt"), str) or not isinstance(d.get("answer"), (str, int, float, list)):
            raise ValueError(f"{path}:{n}: expected {{\"prompt\": str, \"answer\": str or [str]}}")
        tasks.append(d)
    if len(tasks) < 8:
        raise ValueError(f"{path}: {len(tasks)} tasks; the evaluation needs at least 8")
    return tasks


def is_correct(output: str, answer, match: str = "first") -> bool:
    """`match`: "first" (above), "last" (the output's last number), "stated" (anywhere after =, is, equals)."""
    answers = answer if isinstance(answer, list) else [answer]
    for a in answers:
        a = str(a)
        if re.fullmatch(r"-?\d+", a):
            if match == "stated":
                if re.search(r"(?:=|\bis|\bequals)\s*\**\s*" + re.escape(a) + r"(?![\d.,]\d|\d)", output):
                    return True
                continue
            if match == "last":
                numbers = _NUMBER.findall(output)
                m_text = numbers[-1] if numbers else None
            else:
                m = _NUMBER.search(output, output.index("=") + 1 if "=" in output else 0)
                m_text = m.group(0) if m else None
            if m_text is not None and m_text.replace(",", "").rstrip(",") == a:
                return True
        elif re.search(r"(?<![A-Za-z0-9])" + re.escape(a.lower()) + r"(?![A-Za-z0-9])", output.lower()):
            return True
    return False
