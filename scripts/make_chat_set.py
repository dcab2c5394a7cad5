"""Write the chat set: what a chat server's model reads and writes, for `sieve eval --data` (docs/quality.md).

48 questions of the kinds a chat assistant is asked (how-to, facts, writing, code, advice), each rendered with the
model's own chat template (its default system prompt) and followed by the model's greedy answer (up to 160 tokens,
the file dequantized, float32: the reference every quantized variant is scored against), then the end-of-turn
token. The answers are the reference's own, so the reference's perplexity on them is low and its top-1 is theirs;
what the set measures is how far a variant's next-token distributions move from the reference's on text in the
format the server serves (KL, top-1 agreement), where WikiText-2 and TinyStories are prose.

    python scripts/make_chat_set.py --out bench/data/smollm2-chat-set.txt
"""

from __future__ import annotations

import argparse

QUESTIONS = [
    "How do I boil an egg so that the yolk stays soft?",
    "What is the capital of Australia?",
    "Write a short poem about the sea.",
    "Explain what a black hole is to a ten-year-old.",
    "How can I improve my sleep?",
    "Write a Python function that reverses a string.",
    "What are the main causes of inflation?",
    "Give me three ideas for a birthday party.",
    "What is the difference between weather and climate?",
    "How do plants make their food?",
    "Summarise the story of Romeo and Juliet in two sentences.",
    "What should I pack for a weekend hiking trip?",
    "Translate 'good morning, how are you?' into French.",
    "Why is the sky blue?",
    "Write an email asking my manager for a day off.",
    "What is a healthy breakfast?",
    "How does a computer store information?",
    "Explain recursion with a simple example.",
    "What are some tips for learning a new language?",
    "Who painted the Mona Lisa?",
    "How do vaccines work?",
    "Write a haiku about autumn leaves.",
    "What is the Pythagorean theorem?",
    "How can I save money on groceries?",
    "Describe the water cycle.",
    "What is machine learning?",
    "Give me a recipe for a simple tomato soup.",
    "How do I write a good cover letter?",
    "What are the planets of the solar system?",
    "Why do we have seasons?",
    "Write a SQL query that counts the rows of a table named orders.",
    "What is the meaning of the word 'ephemeral'?",
    "How do I calm down before an exam?",
    "Explain how a bicycle stays upright.",
    "What are the benefits of regular exercise?",
    "Tell me a fun fact about octopuses.",
    "How do I change a flat tyre?",
    "What was the Industrial Revolution?",
    "Write a short story about a robot who learns to paint.",
    "How does the internet work, in simple terms?",
    "What is the difference between a virus and a bacterium?",
    "Suggest a name for a small coffee shop.",
    "How do I make my houseplants grow better?",
    "What is photosynthesis?",
    "Explain the rules of chess briefly.",
    "How can I be more productive when working from home?",
    "What is the boiling point of water at sea level?",
    "Write a thank-you note to a teacher.",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from sieve import LLM, SamplingParams
    from sieve.models.default import resolve_default

    model, _ = resolve_default(args.model)
    llm = LLM(model, dtype="float32", dequantize=True)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    answers = llm.chat(convs, params)
    end = tokenizer.convert_ids_to_tokens(llm.llm_engine.eos_token_ids[0]) if llm.llm_engine.eos_token_ids else ""
    parts = []
    for conv, out in zip(convs, answers):
        prompt = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        parts.append(prompt + out.outputs[0].text + end + "\n")
    with open(args.out, "w") as f:
        f.write("".join(parts))
    tokens = len(tokenizer("".join(parts), add_special_tokens=False)["input_ids"])
    print(f"{args.out}: {len(parts)} conversations, {tokens} tokens")
    llm.shutdown()


if __name__ == "__main__":
    main()
