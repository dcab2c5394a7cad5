"""Writes mc_wiki.jsonl: a 4-way next-word cloze from WikiText-2 (../shared/data/wikitext2_test.txt), the
lm-evaluation-harness task mc_wiki.yaml scores. Each question is the first 15-40 words of a paragraph (the file's
tokenization undone: "@-@", spaced punctuation); the choices are the word that follows and three words of 4+ letters
drawn from other paragraphs, in a random order. Seeded: the file is the same on every run.

    python docs/lm-eval-tasks/make_mc_wiki.py [N]
"""
import json
import random
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parents[2] / "shared" / "data" / "wikitext2_test.txt"


def detokenize(text: str) -> str:
    text = text.replace(" @-@ ", "-").replace(" @,@ ", ",").replace(" @.@ ", ".")
    text = re.sub(r" ([,.;:!?)'])", r"\1", text)
    return re.sub(r"([(]) ", r"\1", text).replace(" n't", "n't")


def main(n: int = 500) -> None:
    rng = random.Random(63)
    paragraphs = [detokenize(p.strip()) for p in SOURCE.read_text().split("\n") if len(p.split()) >= 60 and not p.strip().startswith("=")]
    words = sorted({w for p in paragraphs for w in p.split() if w.isalpha() and len(w) >= 4})
    rng.shuffle(paragraphs)
    out = []
    for p in paragraphs:
        tokens = p.split()
        k = rng.randrange(15, 41)
        answer = tokens[k]
        if not (answer.isalpha() and len(answer) >= 4):
            continue
        others = [w for w in rng.sample(words, 8) if w.lower() != answer.lower()][:3]
        choices = others + [answer]
        rng.shuffle(choices)
        out.append({"context": " ".join(tokens[:k]), "choices": [" " + c for c in choices], "label": choices.index(answer)})
        if len(out) == n:
            break
    (HERE / "mc_wiki.jsonl").write_text("".join(json.dumps(q) + "\n" for q in out))
    print(f"wrote {len(out)} questions to {HERE / 'mc_wiki.jsonl'}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
