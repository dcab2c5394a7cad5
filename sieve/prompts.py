"""Prompt sets shared by the benchmarks and the training commands: the speculative-decoding benchmark's chat prompts
(which distillation must never train on), wikitext-2 passages, and the templates and topics distillation and the
ladder's workloads draw from."""

from __future__ import annotations

from sieve.data import shared_data

TEMPLATES = [
    "Explain {t} in simple terms.", "What are the main advantages and disadvantages of {t}?", "Write a short story about {t}.",
    "Give me five facts about {t}.", "How would you teach a beginner about {t}?", "Write a friendly email inviting a colleague to talk about {t}.",
    "What is the history of {t}?", "Describe {t} to someone who has never seen it.", "List some common mistakes people make with {t}.",
    "Write a limerick about {t}.", "Compare {t} with something similar and explain the differences.", "Why do people care about {t}?",
    "Tell me a fun fact about {t} and explain it.", "Write a short dialogue between two friends about {t}.",
    "What questions do children often ask about {t}? Answer two of them.", "Summarise what an encyclopedia would say about {t}.",
    "Give step-by-step advice for someone starting with {t}.", "What would the world be like without {t}?",
    "Write a product description related to {t}.", "Explain {t} using an analogy.",
]
TOPICS = [
    "photosynthesis", "the water cycle", "volcanoes", "the moon", "bicycles", "coffee", "chess", "the internet", "gardening",
    "electric cars", "the Roman Empire", "honey bees", "rainbows", "cooking pasta", "public libraries", "jazz music", "sleep",
    "recycling", "the human heart", "airplanes", "friendship", "saving money", "deserts", "penguins", "solar panels",
    "the printing press", "yoga", "earthquakes", "chocolate", "trains",
]
CHAT_PROMPTS = [
    "What are three good habits for staying healthy?",
    "Explain why the sky is blue to a ten-year-old.",
    "Write a short poem about the sea.",
    "Give me some tips for learning a new language.",
    "What is the difference between a virus and a bacterium?",
    "Describe a perfect weekend in the mountains.",
    "How does a refrigerator keep food cold?",
    "Suggest a name for a friendly robot and say why.",
]


def passages(n: int, min_words: int = 120, max_words: int = 220) -> list[str]:
    """The first `n` paragraphs of wikitext-2's test split with at least `min_words` words, cut to `max_words`."""
    paras = []
    for line in shared_data("wikitext2_test.txt").read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line.startswith("=") or not line:
            continue
        words = line.replace(" @-@ ", "-").replace(" @,@ ", ",").replace(" @.@ ", ".").split()
        if len(words) >= min_words:
            paras.append(" ".join(words[:max_words]))
        if len(paras) == n:
            break
    return paras


def _clean(line: str) -> str:
    return " ".join(line.replace(" @-@ ", "-").replace(" @,@ ", ",").replace(" @.@ ", ".").split())


def documents(count_tokens, min_tokens: int, max_tokens: int, n: int, seed: int = 0) -> list[str]:
    """Up to `n` documents of `min_tokens` to `max_tokens` tokens (each length drawn at random, `count_tokens(text)`
    counting), made of wikitext-2's test articles in order: paragraphs are taken until the document reaches its
    length, an article's heading starting a new paragraph. The retrieval workload's documents: each prompt carries a
    different one, so that its KV cache is its own."""
    import random

    rng = random.Random(seed)
    docs, parts, size = [], [], 0
    target = rng.randint(min_tokens, max_tokens)
    for line in shared_data("wikitext2_test.txt").read_text(encoding="utf-8").splitlines():
        text = _clean(line)
        if not text:
            continue
        if text.startswith("= ") and not text.startswith("= ="):  # an article's title
            text = "# " + text.strip("= ")
        elif text.startswith("="):
            text = "## " + text.strip("= ")
        cost = count_tokens(text) + 1
        if size + cost > target:
            if size >= min_tokens:
                docs.append("\n".join(parts))
                if len(docs) == n:
                    return docs
                target = rng.randint(min_tokens, max_tokens)
            parts, size = [], 0
            if cost > target:
                continue
        parts.append(text)
        size += cost
    return docs
